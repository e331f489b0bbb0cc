"""AOT-POT on CPU: what the multi-stream residual costs, and what the trained models learned.

1. **Overhead** (always): the operator transformer of ``cli_configs/aot_pot/pretrain.yaml``
   (1-D, grid 64, width 64, 4 blocks = 8 sub-layers, batch 32) with each residual type: extra
   parameters (% of the residual model) and forward+backward time relative to ``residual``
   (types interleaved, median of ``--rounds`` rounds of 3 passes, one thread). Types: residual;
   hyper (token-dynamic); mhc with token-dynamic, per-sample (``pooled``) or static weights,
   per-stream (``stream``, the default) or concatenated (``flat``, mHC's) dynamic inputs, and
   log-domain Sinkhorn or the permutation mixture.
2. **Learned models** (``--sweep DIR``, a finished ``ada sweep cli_configs/aot_pot/repro.yaml``
   folder): from the seed-0 pre-trained checkpoints, ``rollouts.png`` (one test trajectory per
   PDE: ground truth and the rolled-out predictions of ``pre_residual``, ``pre_mhc`` and
   ``pre_mhc_fast``), ``mixing_matrices.png`` (the static part of each mHC model's doubly
   stochastic mixing matrix per sub-layer) and a table of how much the stream machinery is used:
   per sub-layer, the largest difference between two PDEs' mean aggregation weights (input
   dependence); the streams' relative spread at the trunk's output (0: the streams are equal and
   the network is the plain residual one); the composite gain of the mixing matrices (1 for
   exactly doubly stochastic products).

Writes ``aot_pot.json`` (and the PNGs) to ``--out``. Reports only; no assertion on the numbers.

    python bench/aot_pot.py --out /tmp/aot_pot
    python bench/aot_pot.py --sweep sweeps/aot_pot --out docs/techniques/img/aot_pot
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import matplotlib
import torch
import yaml

from ada_modules.data.pde import PDE_FAMILIES, PDEDataModule
from ada_modules.models import OperatorTransformerModule
from ada_modules.nn.operator_transformer import OperatorTransformer

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "cli_configs" / "aot_pot" / "pretrain.yaml"
TYPES: dict[str, tuple[str, dict | None]] = {
    "residual": ("residual", None),
    "hyper (token)": ("hyper", {"dynamic": "token"}),
    "mhc (token, stream)": ("mhc", {"dynamic": "token"}),
    "mhc (pooled)": ("mhc", {"dynamic": "pooled"}),
    "mhc (static)": ("mhc", {"dynamic": "none"}),
    "mhc (token, flat)": ("mhc", {"dynamic": "token", "dynamic_input": "flat"}),
    "mhc (token, log-domain)": ("mhc", {"dynamic": "token", "mixing": "sinkhorn_log"}),
    "mhc (token, permutations)": ("mhc", {"dynamic": "token", "mixing": "permutation"}),
}


def _net_kwargs() -> dict:
    args = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]
    keep = ("spatial_dims", "grid", "history", "patch_size", "width", "depth", "mlp_ratio")
    return {k: args[k] for k in (*keep, "modes", "spectral_blocks")}


def overhead(rounds: int, batch: int) -> list[dict]:
    """Parameters and forward+backward time of each residual type, interleaved."""
    torch.manual_seed(0)
    kwargs = _net_kwargs()
    nets = {
        name: OperatorTransformer(**kwargs, residual=kind, streams=streams)
        for name, (kind, streams) in TYPES.items()
    }
    frames = torch.randn(batch, kwargs["history"], 1, kwargs["grid"])
    times: dict[str, list[float]] = {name: [] for name in nets}
    for _ in range(rounds):
        for name, net in nets.items():
            start = time.perf_counter()
            for _ in range(3):
                net(frames)[0].square().mean().backward()
            times[name].append((time.perf_counter() - start) / 3)
    base_params = sum(p.numel() for p in nets["residual"].parameters())
    base_time = statistics.median(times["residual"])
    rows = []
    for name, net in nets.items():
        params = sum(p.numel() for p in net.parameters())
        median = statistics.median(times[name])
        rows.append(
            {
                "type": name,
                "params": params,
                "extra_params_pct": 100 * (params - base_params) / base_params,
                "step_ms": 1000 * median,
                "time_ratio": median / base_time,
            }
        )
    return rows


def _load(sweep: Path, fit: str) -> tuple[OperatorTransformerModule, dict]:
    """The seed-0 checkpoint of a shared fit, and the arguments of the data it was trained on."""
    path = sweep / "shared_fit" / fit / "seed_0" / "checkpoints" / "last.ckpt"
    module = OperatorTransformerModule.load_from_checkpoint(path, map_location="cpu")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    data = saved.get("datamodule_hyper_parameters")
    if data is None:  # checkpoints written before the data module saved its arguments
        data = yaml.safe_load(CONFIG.read_text())["data"]["init_args"]
    return module.eval(), {**data, "seed": 0}


def _test_windows(data: dict) -> tuple[PDEDataModule, torch.Tensor, torch.Tensor]:
    dm = PDEDataModule(**data)
    dm.setup("test")
    items = [dm.datasets["test"][i] for i in range(len(dm.datasets["test"]))]
    frames = torch.stack([frames for frames, _ in items])
    labels = torch.stack([torch.as_tensor(label) for _, label in items])
    return dm, frames, labels


def learned(sweep: Path, out: Path) -> dict:
    """Rollout and mixing-matrix figures, and how much the stream machinery was used."""
    names = [
        n for n in ("residual", "mhc", "mhc_fast") if (sweep / "shared_fit" / f"pre_{n}").is_dir()
    ]
    loaded = {name: _load(sweep, f"pre_{name}") for name in names}
    models = {name: module for name, (module, _) in loaded.items()}
    dm, frames, labels = _test_windows(loaded["mhc"][1])
    history = models["mhc"].history
    picks = [int((labels == i).nonzero()[0]) for i in labels.unique().tolist()]
    fig, axes = plt.subplots(len(picks), 1, figsize=(8, 2.2 * len(picks)), squeeze=False)
    with torch.no_grad():
        rolled = {
            name: m.rollout(frames[picks, :history], frames.shape[1] - history)
            for name, m in models.items()
        }
    x = torch.arange(frames.shape[-1]) / frames.shape[-1]
    for row, (ax, i) in enumerate(zip(axes[:, 0], picks, strict=True)):
        last = frames.shape[1] - 1
        ax.plot(x, frames[i, history - 1, 0], color="0.7", label="last input")
        ax.plot(x, frames[i, last, 0], color="k", label="truth (last frame)")
        for name, style in zip(models, ("--", ":", "-."), strict=False):
            ax.plot(x, rolled[name][row, -1, 0], style, label=f"pre_{name}")
        title = f"{PDE_FAMILIES[int(labels[i])]}: {last - history + 1} frames rolled out"
        ax.set_title(title, fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(out / "rollouts.png", dpi=120)
    plt.close(fig)

    streams = [n for n in models if n != "residual"]
    layers = {n: list(models[n].net.trunk.layers) for n in streams}
    width = len(layers["mhc"])
    fig, axes = plt.subplots(len(streams), width, figsize=(1.6 * width, 2.1 * len(streams)))
    axes = axes.reshape(len(streams), width)
    for r, name in enumerate(streams):
        for i, layer in enumerate(layers[name]):
            ax = axes[r, i]
            ax.imshow(layer.mixing_matrix().numpy(), vmin=0, vmax=1, cmap="viridis")
            ax.set_title(f"pre_{name}: {'spectral' if i % 2 == 0 else 'MLP'} {i // 2}", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(out / "mixing_matrices.png", dpi=120)
    plt.close(fig)

    report = {"families": list(dm.families)}
    for name in streams:
        module = models[name]
        report[name] = {
            "composite_gain": module.net.trunk.composite_gain(),
            "pre_weight_spread": _pre_weight_spread(module, frames[:, :history], labels),
            "stream_spread": _stream_spread(module, frames[:, :history]),
        }
    return report


def _stream_spread(module, inputs: torch.Tensor) -> float:
    """||X_s - mean_s X|| / ||mean_s X|| of the streams the trunk averages (0: one stream)."""
    seen: list[torch.Tensor] = []
    hook = module.net.trunk.layers[-1].register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        module(inputs)
    hook.remove()
    streams = seen[0]
    mean = streams.mean(1, keepdim=True)
    return float((streams - mean).norm() / (mean.norm() * streams.shape[1] ** 0.5))


def _pre_weight_spread(module, inputs: torch.Tensor, labels: torch.Tensor) -> list[float]:
    """Per sub-layer: max over stream and PDE pairs of |mean_a(PDE 1) - mean_a(PDE 2)|."""
    captured: list[torch.Tensor] = []
    hooks = []
    for layer in module.net.trunk.layers:

        def hook(mod, args, _store=captured):
            z = args[0].movedim(2, -1).movedim(1, -2)  # channel-first streams -> (b, ..., n, d)
            _store.append(mod.weights(z)[0].flatten(1, -2).mean(1))  # (b, n)

        hooks.append(layer.register_forward_pre_hook(hook))
    with torch.no_grad():
        module(inputs)
    for h in hooks:
        h.remove()
    spread = []
    for weights in captured:
        means = torch.stack([weights[labels == i].mean(0) for i in labels.unique().tolist()])
        spread.append(float((means.max(0).values - means.min(0).values).max()))
    return spread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/aot_pot"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sweep", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="3 rounds, batch 8")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rounds, batch = (3, 8) if args.quick else (args.rounds, args.batch)
    rows = overhead(rounds, batch)
    print(f"Overhead (pretrain.yaml's network, batch {batch}, one thread, median of {rounds}):\n")
    print("| residual type | parameters | extra parameters | fwd+bwd ms | time vs residual |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['type']} | {r['params']:,} | {r['extra_params_pct']:.2f} % | "
            f"{r['step_ms']:.1f} | {r['time_ratio']:.2f}x |"
        )
    result: dict = {"overhead": rows}
    if args.sweep is not None:
        result["learned"] = info = learned(args.sweep, args.out)
        names = [n for n in info if n != "families"]
        print(f"\nLearned (seed 0 of {args.sweep}): per sub-layer, the largest difference of the")
        print("mean aggregation weights between two PDEs; then the streams' relative spread at the")
        print("trunk's output and the composite gain of the static mixing matrices.\n")
        print("| sub-layer | " + " | ".join(f"pre_{n}" for n in names) + " |")
        print("|---" * (1 + len(names)) + "|")
        for i in range(len(info[names[0]]["pre_weight_spread"])):
            cells = " | ".join(f"{info[n]['pre_weight_spread'][i]:.4f}" for n in names)
            print(f"| {'spectral' if i % 2 == 0 else 'MLP'} {i // 2} | {cells} |")
        print(
            "| stream spread | "
            + " | ".join(f"{info[n]['stream_spread']:.4f}" for n in names)
            + " |"
        )
        print(
            "| composite gain | "
            + " | ".join(f"{info[n]['composite_gain']:.4f}" for n in names)
            + " |"
        )
        print(f"\nWrote {args.out / 'rollouts.png'} and {args.out / 'mixing_matrices.png'}")
    (args.out / "aot_pot.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
