"""AdaCal and its baselines on CPU: probe cost vs attention cost, density vs length, block masks.

What is compared (issue 16, part 6), on layers of planted-pattern attention
(:func:`~ada_modules.data.planted_attention.planted_attention`: 8 heads of dim 64, block 64), for
the sparse prefill policies of :mod:`ada_modules.attention` (A-shape, vertical-slash, block
top-k, FlexPrefill-like, AdaCal):

1. **Probe cost vs attention cost** at L = 1K..8K (retrieval-intensive layer): each policy's
   planning time (median of 3) and probe multiply-adds, against dense causal attention
   (``F.scaled_dot_product_attention``, median of 3, and its ``2 * D * L (L + 1) / 2``
   multiply-adds per head). The planning cost grows as ``L`` (last-block probe) or
   ``L^2 / block^2`` (pooled block scores), attention as ``L^2``: the ratios fall with ``L``.
   The sparse kernel's CPU path is a dense masked reference (it does not skip blocks), so CPU
   attention time says nothing about sparsity; the ``ideal`` column is density x dense MACs.
2. **Density and recall vs length** at L = 1K..8K, both regimes: plan density (computed over
   causal blocks) and attention recall (mean dense mass inside the computed blocks over all query
   rows), mean of two layers per regime and length (one with --quick). AdaCal's dispatcher is
   calibrated at each length on 16 mixed-regime layers of other seeds (:meth:`TaskDispatcher.fit`);
   AdaCal runs with the settings of ``cli_configs/adacal/study.yaml`` (``policy_kwargs``), the
   other policies with their defaults.
3. **Block masks** (``--out``): for three heads of each regime at L = 4096, the dense attention
   mass per block and the blocks A-shape, FlexPrefill-like and AdaCal compute
   (``adacal_masks.png``), plus ``adacal_density.png`` (density vs length).

Run it::

    .venv/bin/python bench/adacal.py                 # ~2 minutes on 2 cores
    .venv/bin/python bench/adacal.py --quick         # L <= 2048, ~20 s
    .venv/bin/python bench/adacal.py --out docs/techniques/img/adacal

Reports only; no assertion.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from ada_modules.attention import REGIMES, TaskDispatcher, plan_density
from ada_modules.data.planted_attention import HEAD_KINDS, planted_attention
from ada_modules.models.sparse_prefill_study import ARMS, dense_head_attention

HEADS, HEAD_DIM, BLOCK = 8, 64, 64
STUDY = Path(__file__).resolve().parents[1] / "cli_configs" / "adacal" / "study.yaml"
ADACAL_KWARGS = yaml.safe_load(STUDY.read_text())["model"]["init_args"]["policy_kwargs"]
SCALING = HEAD_DIM**-0.5
POLICIES = ("a_shape", "vertical_slash", "block_topk", "flexprefill", "adacal")
PICTURE_ARMS = ("a_shape", "flexprefill", "adacal")
# Head kinds shown in the picture, in order of preference, per regime.
PICTURE_KINDS = {
    "structure": ("sink_local", "slash", "periodic", "hub"),
    "retrieval": ("needle", "hub", "sink_local", "slash"),
}


def layer(length: int, regime: str, seed: int) -> dict[str, torch.Tensor]:
    sample = planted_attention(
        length, num_heads=HEADS, head_dim=HEAD_DIM, regime=regime,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    return {name: x[None] for name, x in vars(sample).items()}


def calibrated(length: int) -> TaskDispatcher:
    """A dispatcher fitted on 16 layers of both regimes (seeds 1000+, not used elsewhere)."""
    adacal = ARMS["adacal"](block_size=BLOCK)
    features, labels = [], []
    for i in range(16):
        regime = REGIMES[i % 2]
        x = layer(length, regime, 1000 + i)
        features.append(adacal.dispatch_features(x["query"], x["key"], None, SCALING))
        labels.append(i % 2)
    return TaskDispatcher().fit(torch.cat(features), labels)


def policies(dispatcher: TaskDispatcher) -> dict[str, object]:
    built = {name: ARMS[name](block_size=BLOCK) for name in POLICIES if name != "adacal"}
    built["adacal"] = ARMS["adacal"](block_size=BLOCK, dispatcher=dispatcher, **ADACAL_KWARGS)
    return built


def median_time(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cost_rows(length: int, dispatcher: TaskDispatcher) -> list[dict]:
    x = layer(length, "retrieval", 0)
    q, k, v = x["query"], x["key"], x["value"]
    dense_macs = 2 * HEADS * HEAD_DIM * length * (length + 1) // 2
    dense_s = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    rows = [
        {"L": length, "policy": "dense (SDPA)", "plan_ms": 0.0, "probe_macs": 0,
         "density": 1.0, "attention_ms": 1e3 * dense_s, "dense_macs": dense_macs}
    ]  # fmt: skip
    for name, policy in policies(dispatcher).items():
        plan = policy.plan(q, k, key_padding_mask=None, scaling=SCALING)
        plan_s = median_time(lambda p=policy: p.plan(q, k, key_padding_mask=None, scaling=SCALING))
        rows.append(
            {"L": length, "policy": name, "plan_ms": 1e3 * plan_s, "probe_macs": plan.probe_flops,
             "density": plan_density(plan.block_mask, length, length, BLOCK),
             "attention_ms": 1e3 * dense_s, "dense_macs": dense_macs}
        )  # fmt: skip
    return rows


def block_mass(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """Dense attention mass per (row, key block), ``(H, L, key blocks)``."""
    return torch.stack(
        [dense_head_attention(x["query"][0, h], x["key"][0, h], SCALING, BLOCK)[1]
         for h in range(HEADS)]
    )  # fmt: skip


def recall(mass: torch.Tensor, block_mask: torch.Tensor) -> torch.Tensor:
    """Per head, the mean over rows of the mass inside ``block_mask`` ``(H, nQ, nK)``."""
    rows = torch.arange(mass.shape[1]) // BLOCK
    return (mass * block_mask[:, rows]).sum(-1).mean(-1)


def length_rows(length: int, dispatcher: TaskDispatcher, layers: int) -> list[dict]:
    """Mean density and recall of each policy over ``layers`` layers per regime."""
    rows = []
    for regime in REGIMES:
        totals = {name: torch.zeros(2) for name in POLICIES}
        for seed in range(1, 1 + layers):
            x = layer(length, regime, seed)
            mass = block_mass(x)
            for name, policy in policies(dispatcher).items():
                plan = policy.plan(x["query"], x["key"], key_padding_mask=None, scaling=SCALING)
                density = plan_density(plan.block_mask, length, length, BLOCK)
                totals[name] += torch.tensor([density, recall(mass, plan.block_mask[0]).mean()])
        for name, (density, mean_recall) in totals.items():
            rows.append(
                {"L": length, "regime": regime, "policy": name,
                 "density": density.item() / layers, "recall": mean_recall.item() / layers}
            )  # fmt: skip
    return rows


def plot_density(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, regime in zip(axes, REGIMES, strict=True):
        for name in POLICIES:
            pts = [
                (r["L"], r["density"]) for r in rows if (r["regime"], r["policy"]) == (regime, name)
            ]
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length L (tokens)")
        ax.set_title(f"{regime} regime")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("density (computed / causal blocks)")
    axes[1].legend(fontsize=8)
    fig.suptitle("Plan density vs length (planted attention, 8 heads, block 64)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_masks(length: int, dispatcher: TaskDispatcher, path: Path) -> None:
    """Per regime three heads: dense block mass, then each picture arm's computed blocks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    built = policies(dispatcher)
    picked = []
    for regime in REGIMES:
        x = layer(length, regime, 2)
        kinds = [HEAD_KINDS[i] for i in x["head_kind"][0]]
        heads = [kinds.index(kind) for kind in PICTURE_KINDS[regime] if kind in kinds][:3]
        mass = block_mass(x)
        plans = {
            name: built[name].plan(x["query"], x["key"], key_padding_mask=None, scaling=SCALING)
            for name in PICTURE_ARMS
        }
        picked += [(regime, h, kinds[h], mass[h], plans) for h in heads]
    fig, axes = plt.subplots(len(picked), 1 + len(PICTURE_ARMS), figsize=(13, 3.2 * len(picked)))
    rows = torch.arange(length) // BLOCK
    for r, (regime, h, kind, mass, plans) in enumerate(picked):
        blocks = torch.zeros(rows.max() + 1, mass.shape[-1]).index_add_(0, rows, mass)
        shade = (blocks / blocks.sum(-1, keepdim=True)).clamp_min(1e-4).log10()
        axes[r, 0].imshow(shade, cmap="magma", vmin=-4, vmax=0)
        axes[r, 0].set_title(
            f"{regime}: head {h} ({kind})\ndense mass per block (log10)", fontsize=9
        )
        for c, name in enumerate(PICTURE_ARMS, start=1):
            mask = plans[name].block_mask[0, h]
            head_recall = recall(mass[None], mask[None]).item()
            density = plan_density(mask[None, None], length, length, BLOCK)
            axes[r, c].imshow(_mask_image(mask, shade))
            axes[r, c].set_title(
                f"{name}: density {density:.2f}, recall {head_recall:.3f}", fontsize=9
            )
        for ax in axes[r]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(
        f"Planted attention, L = {length}, block {BLOCK}: computed blocks in blue, skipped in "
        "white to red (darker: more dense attention mass)"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _mask_image(mask: torch.Tensor, shade: torch.Tensor) -> torch.Tensor:
    """RGB ``(nQ, nK, 3)``: computed blocks light to dark blue and skipped ones white to red by
    their dense mass (``shade``: log10 of the row share, -4 to 0); non-causal blocks grey."""
    weight = ((shade + 4) / 4).clamp(0, 1)[..., None]
    computed = (1 - weight) * torch.tensor([0.8, 0.88, 1.0]) + weight * torch.tensor(
        [0.0, 0.2, 0.6]
    )
    skipped = (1 - weight) * torch.ones(3) + weight * torch.tensor([0.8, 0.0, 0.0])
    image = torch.where(mask[..., None], computed, skipped)
    causal = torch.ones_like(mask).tril(mask.shape[1] - mask.shape[0])
    return torch.where(causal[..., None], image, torch.tensor([0.85, 0.85, 0.85]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L <= 2048 only")
    parser.add_argument("--out", type=Path, default=None, help="folder for adacal.json and plots")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    lengths = [1024, 2048] if args.quick else [1024, 2048, 4096, 8192]
    dispatchers = {length: calibrated(length) for length in lengths}
    results: dict[str, list[dict]] = {"cost": [], "length": []}

    print(f"\n### Probe cost vs dense attention (torch, {torch.get_num_threads()} thread)\n")
    print("ms: planning time of a policy, attention time of SDPA; MACs: multiply-adds.\n")
    print("| L | policy | density | ms | ms / SDPA | probe / dense MACs | ideal / dense MACs |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for length in lengths:
        for r in cost_rows(length, dispatchers[length]):
            results["cost"].append(r)
            ms = r["plan_ms"] or r["attention_ms"]
            probe = r["probe_macs"] / r["dense_macs"]
            print(
                f"| {r['L']} | {r['policy']} | {r['density']:.3f} | {ms:.1f} | "
                f"{ms / r['attention_ms']:.3f} | {probe:.4f} | {r['density'] + probe:.3f} |"
            )

    layers = 1 if args.quick else 2
    print(f"\n### Density and recall vs length (mean of {layers} layer(s) per regime and length)\n")
    print("| regime | policy | " + " | ".join(f"L={n} density / recall" for n in lengths) + " |")
    print("|---|---|" + "---:|" * len(lengths))
    for length in lengths:
        results["length"] += length_rows(length, dispatchers[length], layers)
    for regime in REGIMES:
        for name in POLICIES:
            cells = [
                f"{r['density']:.3f} / {r['recall']:.3f}"
                for r in results["length"]
                if (r["regime"], r["policy"]) == (regime, name)
            ]
            print(f"| {regime} | {name} | " + " | ".join(cells) + " |")

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "adacal.json").write_text(json.dumps(results, indent=1))
        plot_density(results["length"], args.out / "adacal_density.png")
        picture_length = 1024 if args.quick else 4096
        plot_masks(picture_length, calibrated(picture_length), args.out / "adacal_masks.png")
    print(f"\nElapsed: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
