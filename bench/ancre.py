"""ANCRe's motivating example on CPU: a deep linear network, residual layout vs learned layout.

Deep linear regression (issue 6, part 5a): ``K = 32`` linear blocks ``F_i(x) = W_i x`` of
width ``d = 16``, trained by Adam (``--lr``, default 1e-2; full batch of 512) to fit ``y = A x``
for a random target ``A = scale * G / sqrt(d)`` with ``G`` standard Gaussian (deterministic from
the seed; such a target has eigenvalues on the negative real axis or far from 1, which
identity-initialised residual products reach slowly). The layouts, all ``ANCReStack`` modes on the same blocks and the same init (``W_i`` Gaussian with
std ``0.02/sqrt(d)``):

- ``residual``: ``x_{i+1} = x_i + W_i x_i``,
- ``rezero``: ``x_{i+1} = x_i + alpha_i W_i x_i``,
- ``denseformer``: DenseFormer-like weighted averages of all earlier states as block inputs,
- ``ancre_source``: learned shortcut sources (softmax over earlier states, exact-identity gate),
- ``ancre_input``: learned block inputs with the same softmax.

Columns: steps until the training MSE first falls below ``threshold`` times its initial value
(checked every step, capped at ``steps``; a capped run counts as ``steps`` and is flagged with ``>``),
the ratio to ``residual`` (per seed, then mean ± std), the final loss, extra parameters in percent,
and the time per step relative to ``residual``. Mean ± std over seeds 0, 1, 2 (quick: seed 0).

Then the overhead of each layout on the models of reproductions (b) and (c), and on a wide trunk
(24 blocks of width 512, the GPU benchmark's shape; ``--overhead`` runs only this table): extra
parameters (% of the model) and forward+backward time (% over residual, layouts interleaved,
median of 15 rounds of 5 passes). ``source_deferred`` is ANCRe source routing with
``state_grads="deferred"`` (each state's gradient as one sum over the rows that read it).

``--curves DIR [DIR ...]`` instead reads finished ``ada sweep`` folders (the CSV logs of each
run), prints, per variant, the steps until ``--metric`` first reaches ``--curve-threshold``
(default: the ``residual`` variant's mean final value, i.e. the steps to reach the baseline's final
quality), its final value and the median of its second half (mean ± std over seeds), the final
value minus the ``--baseline`` variant's on the same seed (mean ± std of these paired
differences, and on how many seeds it is lower; default baseline ``residual``; ``--by-step``
adds the same paired differences at every logged step), and plots the mean curve per variant to
``--out/<sweep>_curve.png`` (``--variants`` restricts both to the variants named).
(What grows before the LM of reproduction (f) diverges: ``bench/ancre_divergence.py``.)
``--connectivity DIR [DIR ...]`` plots the learned ``W - W_residual`` (mean over seeds) of the
``--variant`` runs' final checkpoints (default ``ancre_source``; give ``--lr-scale`` for a variant
trained with one) to ``--out/connectivity_<variant>.png``.

Runs on one thread. Writes ``ancre.json`` (and ``deep_linear.png``, the loss curves of seed 0) to
``--out``. Reports only; no assertion on the numbers.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib
import torch
from torch import Tensor, nn

from ada_modules.nn import ANCReStack, ConnectivityRouter, MLPResNet
from ada_modules.nn.ancre_router import StateGrads

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LAYOUTS = ("residual", "rezero", "denseformer", "ancre_source", "ancre_input")


def _stack(layout: str, depth: int, width: int, seed: int) -> ANCReStack:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(depth):
        linear = nn.Linear(width, width, bias=False)
        nn.init.normal_(linear.weight, std=0.02 / math.sqrt(width))
        blocks.append(linear)
    mode = {"ancre_source": "source", "ancre_input": "input"}.get(layout, layout)
    return ANCReStack(blocks, mode=mode, residual_in_block=False)


def deep_linear(
    layout: str,
    seed: int,
    depth: int,
    width: int,
    steps: int,
    threshold: float,
    target_scale: float,
    lr: float = 1e-2,
) -> dict:
    """Train one layout on one seed; return steps-to-threshold, final loss, curve and timing."""
    generator = torch.Generator().manual_seed(1000 + seed)
    target = target_scale * torch.randn(width, width, generator=generator) / math.sqrt(width)
    inputs = torch.randn(512, width, generator=generator)
    labels = inputs @ target.T
    model = _stack(layout, depth, width, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    curve = []
    hit = None
    start = time.perf_counter()
    for step in range(steps + 1):
        loss = nn.functional.mse_loss(model(inputs), labels)
        curve.append(loss.item())
        if hit is None and curve[-1] <= threshold * curve[0]:
            hit = step
            if step >= 1:
                break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    elapsed = time.perf_counter() - start
    extra = sum(p.numel() for p in model.router.parameters())
    base = sum(p.numel() for p in model.layers.parameters())
    return {
        "layout": layout,
        "seed": seed,
        "steps_to_threshold": steps if hit is None else hit,
        "reached": hit is not None,
        "final_loss": curve[-1],
        "curve": curve,
        "extra_params_pct": 100.0 * extra / base,
        "seconds_per_step": elapsed / len(curve),
    }


def _fmt(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}g}"
    return f"{statistics.mean(values):.{digits}g} ± {statistics.stdev(values):.{digits}g}"


def run_deep_linear(args: argparse.Namespace, seeds: list[int]) -> list[dict]:
    records = []
    for seed in seeds:
        for layout in LAYOUTS:
            records.append(
                deep_linear(
                    layout,
                    seed,
                    args.depth,
                    args.width,
                    args.steps,
                    args.threshold,
                    args.scale,
                    lr=args.lr,
                )
            )
            print(
                f"[done] {layout} seed {seed}: {records[-1]['steps_to_threshold']} steps",
                file=sys.stderr,
                flush=True,
            )
    by = {(r["layout"], r["seed"]): r for r in records}
    print(
        f"\n### Deep linear network: K={args.depth}, d={args.width}, Adam lr {args.lr:g}, "
        f"threshold {args.threshold:g} x initial MSE, cap {args.steps} steps, seeds {seeds}\n"
    )
    print(
        "| layout | steps to threshold | ratio to residual | reached | final MSE | "
        "extra params % | time/step vs residual |"
    )
    print("|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        rows = [by[(layout, s)] for s in seeds]
        steps = [r["steps_to_threshold"] for r in rows]
        ratio = [
            r["steps_to_threshold"] / by[("residual", r["seed"])]["steps_to_threshold"]
            for r in rows
        ]
        time_ratio = [
            r["seconds_per_step"] / by[("residual", r["seed"])]["seconds_per_step"] for r in rows
        ]
        reached = sum(r["reached"] for r in rows)
        print(
            f"| {layout} | {_fmt(steps)} | {_fmt(ratio)} | {reached}/{len(rows)} | "
            f"{_fmt([r['final_loss'] for r in rows])} | {rows[0]['extra_params_pct']:.2f} | "
            f"{_fmt(time_ratio)} |"
        )
    fig, ax = plt.subplots(figsize=(6, 4))
    for layout in LAYOUTS:
        ax.semilogy(by[(layout, seeds[0])]["curve"], label=layout)
    ax.set_xlabel("Adam step")
    ax.set_ylabel("training MSE")
    ax.set_title(f"deep linear network, K={args.depth}, seed {seeds[0]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "deep_linear.png", dpi=110)
    plt.close(fig)
    return records


def _overhead_models(
    mode: str, quick: bool, state_grads: StateGrads = "autograd"
) -> dict[str, tuple[nn.Module, Callable[[nn.Module], Tensor]]]:
    from ada_modules.models import CausalLMModule
    from ada_modules.nn import ConnectivityWrapper

    torch.manual_seed(0)
    trunk = MLPResNet(64, depth=16, mode=mode, state_grads=state_grads)
    images = torch.randn(64, 64)
    # The GPU benchmark's trunk shape (24 blocks, width 512) with transformer-sized branches
    # (expansion 4): wide enough that each routed sum is one large vector operation.
    wide = MLPResNet(512, depth=24, expansion=4, mode=mode, state_grads=state_grads)
    wide_rows = 32 if quick else 256
    tokens = torch.randn(wide_rows, 512)
    lm = CausalLMModule(
        hidden_size=32,
        num_layers=8,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=128,
        model_wrapper=ConnectivityWrapper(mode=mode, state_grads=state_grads),
    ).model
    ids = torch.randint(3, 20, (32, 45))
    return {
        "digits MLP-ResNet trunk (16 blocks, width 64, batch 64)": (
            trunk,
            lambda m: m(images).square().mean(),
        ),
        "tiny LM (Llama, 8 layers, width 32, batch 32x45)": (
            lm,
            lambda m: m(input_ids=ids, labels=ids).loss,
        ),
        f"wide MLP-ResNet trunk (24 blocks, width 512, expansion 4, batch {wide_rows})": (
            wide,
            lambda m: m(tokens).square().mean(),
        ),
    }


def run_overhead(rounds: int, quick: bool) -> list[dict]:
    """Extra parameters and forward+backward time of each layout against residual.

    The layouts are timed in interleaved rounds (A, B, C, ..., A, B, ...) on the same inputs; the
    median over rounds of the per-round time is reported.
    """
    modes = ("residual", "rezero", "denseformer", "source", "source_deferred")
    built = {mode: _overhead_models(mode, quick) for mode in modes[:-1]}
    # ANCRe with each state's gradient as one sum over the later rows (state_grads="deferred")
    built["source_deferred"] = _overhead_models("source", quick, "deferred")
    records = []
    print("\n### Overhead: forward+backward time and parameters vs residual (1 thread)\n")
    print("| model | layout | extra params | extra params % | median ms | time overhead % |")
    print("|---|---|---|---|---|---|")
    for name in built["residual"]:
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(rounds):
            for mode in modes:
                model, loss_fn = built[mode][name]
                start = time.perf_counter()
                for _ in range(5):
                    model.zero_grad(set_to_none=True)
                    loss_fn(model).backward()
                times[mode].append((time.perf_counter() - start) / 5)
        base_ms = 1000 * statistics.median(times["residual"])
        base_params = sum(p.numel() for p in built["residual"][name][0].parameters())
        for mode in modes:
            model = built[mode][name][0]
            extra = sum(p.numel() for p in model.parameters()) - base_params
            ms = 1000 * statistics.median(times[mode])
            record = {
                "model": name,
                "layout": mode,
                "extra_params": extra,
                "extra_params_pct": 100 * extra / base_params,
                "median_ms": ms,
                "time_overhead_pct": 100 * (ms / base_ms - 1),
            }
            records.append(record)
            print(
                f"| {name} | {mode} | {extra} | {record['extra_params_pct']:.3f} | {ms:.2f} | "
                f"{record['time_overhead_pct']:+.1f} |"
            )
    return records


def _read_curve(run_dir: Path, metric: str) -> list[tuple[int, float]]:
    points = []
    for path in sorted(run_dir.glob("**/metrics.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                if row.get(metric):
                    points.append((int(row["step"]), float(row[metric])))
    return sorted(points)


def _print_by_step(
    by_seed: dict[str, dict[str, list[tuple[int, float]]]],
    base_runs: dict[str, list[tuple[int, float]]],
    baseline: str,
    metric: str,
) -> None:
    """Per logged step: each variant's mean, and its value minus the baseline's on the same seed
    (mean ± std over seeds, and on how many seeds it is lower). Non-finite values (a diverged
    run) are counted and left out of both."""
    base = {seed: dict(c) for seed, c in base_runs.items()}
    steps = sorted({s for c in base.values() for s in c})
    print(f"\n{metric} by step: mean over seeds (minus {baseline}'s on the same seed; lower on)\n")
    print("| variant | " + " | ".join(str(s + 1) for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for variant, runs in by_seed.items():
        cells = []
        for step in steps:
            values = {seed: dict(c)[step] for seed, c in runs.items() if step in dict(c)}
            finite = {seed: v for seed, v in values.items() if math.isfinite(v)}
            paired = [
                v - base[seed][step]
                for seed, v in finite.items()
                if math.isfinite(base.get(seed, {}).get(step, math.nan))
            ]
            cell = f"{statistics.mean(finite.values()):.3f}" if finite else "-"
            if len(finite) < len(values):
                cell += f" [{len(values) - len(finite)} not finite]"
            if variant != baseline and len(paired) > 1:
                lower = sum(d < 0 for d in paired)
                cell += f" ({_fmt(paired, 2)}; {lower}/{len(paired)})"
            cells.append(cell)
        print(f"| {variant} | " + " | ".join(cells) + " |")


def fisher_exact_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided Fisher exact test of ``k1`` of ``n1`` against ``k2`` of ``n2`` (e.g. diverged
    runs): the probability, with the margins fixed, of a split at most as likely as this one.

    >>> round(fisher_exact_p(4, 6, 1, 6), 4)
    0.2424
    """
    total, n = k1 + k2, n1 + n2

    def prob(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, total - x) / math.comb(n, total)

    observed = prob(k1)
    splits = range(max(0, total - n2), min(total, n1) + 1)
    return min(1.0, sum(prob(x) for x in splits if prob(x) <= observed * (1 + 1e-9)))


def _print_per_seed(by_seed: dict[str, dict[str, list[tuple[int, float]]]], metric: str) -> None:
    """Each run's final value, or the first logged step at which it was not finite."""
    seeds = sorted(
        {seed for runs in by_seed.values() for seed in runs}, key=lambda n: int(n.split("_")[-1])
    )
    print(f"\n{metric} per seed: final value, or the first step it was not finite\n")
    print("| variant | " + " | ".join(seeds) + " |")
    print("|---|" + "---|" * len(seeds))
    for variant, runs in by_seed.items():
        cells = []
        for seed in seeds:
            curve = runs.get(seed, [])
            bad = next((s + 1 for s, v in curve if not math.isfinite(v)), None)
            cells.append(
                "-" if not curve else f"{curve[-1][1]:.3f}" if bad is None else f"NaN@{bad}"
            )
        print(f"| {variant} | " + " | ".join(cells) + " |")


def run_curves(args: argparse.Namespace) -> list[dict]:
    """Steps-to-threshold and mean curves from finished sweep folders.

    The threshold is ``--curve-threshold`` if given, else the mean final value of the
    ``residual`` variant: the steps each layout needs to reach the baseline's final quality.
    A run whose final value is not finite has diverged: it is counted (with Fisher's exact test
    against the ``residual`` variant's count), and the statistics are over the other runs.
    """
    summary = []
    for folder in args.curves:
        folder = Path(folder)
        runs = folder / "runs"
        by_seed, base_runs = {}, {}
        for variant_dir in sorted(p for p in runs.iterdir() if p.is_dir()):
            found = {
                d.name: _read_curve(d, args.metric) for d in sorted(variant_dir.glob("seed_*"))
            }
            found = {seed: c for seed, c in found.items() if c}
            if variant_dir.name == args.baseline:  # whether or not --variants lists it
                base_runs = found
            wanted = not args.variants or variant_dir.name in args.variants
            if wanted and found:
                by_seed[variant_dir.name] = found
        if not base_runs:
            print(f"\n(no runs of --baseline {args.baseline} in {folder}: no paired differences)")
        # Paired at the baseline's last logged step, on the same seed.
        base_final = {seed: c[-1] for seed, c in base_runs.items()}
        threshold = args.curve_threshold
        if threshold is None:
            if "residual" not in by_seed:
                raise SystemExit(
                    "--curve-threshold is needed when the residual variant is left out"
                )
            finals = [c[-1][1] for c in by_seed["residual"].values() if math.isfinite(c[-1][1])]
            if not finals:
                raise SystemExit("residual diverged on every seed: give --curve-threshold")
            threshold = statistics.mean(finals)
        print(f"\n### {folder.name}: {args.metric}, threshold {threshold:.4g}\n")
        print(
            f"| variant | seeds | diverged | steps to {args.metric} <= {threshold:.4g} (per seed) "
            f"| final | median over the second half | final − {args.baseline}'s, same seed "
            "| lower on |"
        )
        print("|---|---|---|---|---|---|---|---|")
        residual_diverged = None  # (diverged, runs) of the residual variant, for Fisher's test
        if "residual" in by_seed:
            residual_finals = [c[-1][1] for c in by_seed["residual"].values()]
            residual_diverged = (
                sum(not math.isfinite(v) for v in residual_finals),
                len(residual_finals),
            )
        fig, ax = plt.subplots(figsize=(6, 4))
        for variant, runs in by_seed.items():
            runs_curves = list(runs.values())
            # Lightning logs the validation after step n at step n - 1.
            hits = [next((s + 1 for s, v in c if v <= threshold), None) for c in runs_curves]
            label = [
                str(h) if h is not None else f">{c[-1][0] + 1}"
                for h, c in zip(hits, runs_curves, strict=True)
            ]
            finals = [c[-1][1] for c in runs_curves]
            converged = [c for c in runs_curves if math.isfinite(c[-1][1])]
            # A noisy curve's level: the median of its points after half of its steps.
            late = [statistics.median(v for s, v in c if s >= c[-1][0] / 2) for c in converged]
            paired = []
            if variant != args.baseline:
                for seed, c in runs.items():
                    step, base_value = base_final.get(seed, (None, math.nan))
                    value = dict(c).get(step, math.nan)
                    if math.isfinite(value) and math.isfinite(base_value):
                        paired.append(value - base_value)
            lower = sum(d < 0 for d in paired)
            n_diverged = len(runs_curves) - len(converged)
            diverged_cell = str(n_diverged)
            if (
                variant != "residual"
                and residual_diverged is not None
                and any((n_diverged, residual_diverged[0]))
            ):
                p = fisher_exact_p(n_diverged, len(runs_curves), *residual_diverged)
                diverged_cell += f" (p={p:.2g} vs residual)"
            print(
                f"| {variant} | {len(runs_curves)} | {diverged_cell} "
                f"| {', '.join(label)} | {_fmt([f for f in finals if math.isfinite(f)], 4)} "
                f"| {_fmt(late, 4)} | {_fmt(paired, 4)} "
                f"| {f'{lower}/{len(paired)}' if paired else '-'} |"
            )
            # The mean curve of the runs that did not diverge.
            if converged:
                steps = sorted({s for c in converged for s, _ in c})
                mean = [statistics.mean(dict(c).get(s, math.nan) for c in converged) for s in steps]
                label = variant + (f" ({n_diverged} diverged)" if n_diverged else "")
                ax.plot([s + 1 for s in steps], mean, marker=".", label=label)
            summary.append(
                {
                    "sweep": folder.name,
                    "variant": variant,
                    "threshold": threshold,
                    "hits": hits,
                    "final": finals,
                    "second_half_median": late,
                    "minus_baseline": paired,
                }
            )
        if args.by_step and base_runs:
            _print_by_step(by_seed, base_runs, args.baseline, args.metric)
        if args.by_step:
            _print_per_seed(by_seed, args.metric)
        ax.set_xlabel("step")
        any_diverged = any(
            not math.isfinite(c[-1][1]) for runs in by_seed.values() for c in runs.values()
        )
        ax.set_ylabel(f"{args.metric} (mean over {'finite runs' if any_diverged else 'seeds'})")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / f"{folder.name}_curve.png", dpi=110)
        plt.close(fig)
    return summary


def plot_connectivity(
    folders: list[str], out: Path, variant: str = "ancre_source", lr_scale: float = 1.0
) -> None:
    """Plot ``W - W_residual`` (mean over seeds) of the routers in each sweep's final checkpoints.

    Assumes one ``"source"``-mode router per model (the reproductions' set-up), built with
    ``lr_scale`` (checkpoints store the coefficients divided by it).
    """
    fig, axes = plt.subplots(1, len(folders), figsize=(5 * len(folders), 4.2), squeeze=False)
    for ax, folder in zip(axes[0], folders, strict=True):
        matrices = []
        for ckpt in sorted(Path(folder).glob(f"runs/{variant}/seed_*/checkpoints/last.ckpt")):
            state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
            prefix = next(k for k in state if k.endswith(".logits"))[: -len("logits")]
            gate = state[prefix + "gate"] * lr_scale
            router = ConnectivityRouter(gate.numel() + 1, mode="source", lr_scale=lr_scale)
            router.load_state_dict(
                {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )
            matrices.append(router.connectivity())
            print(f"{folder} {ckpt.parts[-3]}: gate min {gate.min():.4f} max {gate.max():.4f}")
        deviation = torch.stack(matrices).mean(0) - torch.eye(*matrices[0].shape)
        limit = deviation.abs().max().item()
        image = ax.imshow(deviation.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit)
        ax.set_title(
            f"{Path(folder).name}: W - residual (mean of {len(matrices)} seeds)", fontsize=9
        )
        ax.set_xlabel("source state j")
        ax.set_ylabel("block i")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out / f"connectivity_{variant}.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seed 0, 300 steps, K=16")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--threshold", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--scale", type=float, default=3.0, help="A = scale * G / sqrt(d)")
    parser.add_argument("--curves", nargs="*", default=None, help="sweep folders to read")
    parser.add_argument("--metric", default="val/loss")
    parser.add_argument("--variants", nargs="*", default=None, help="with --curves: only these")
    parser.add_argument(
        "--baseline",
        default="residual",
        help="with --curves: the variant of the paired differences",
    )
    parser.add_argument(
        "--by-step",
        action="store_true",
        help="with --curves: paired differences at every step, and each seed's final value",
    )
    parser.add_argument("--overhead", action="store_true", help="only the overhead table")
    parser.add_argument("--variant", default="ancre_source", help="with --connectivity")
    parser.add_argument("--lr-scale", type=float, default=1.0, help="the variant's lr_scale")
    parser.add_argument(
        "--connectivity", nargs="*", default=None, help="sweep folders: plot learned W - residual"
    )
    parser.add_argument(
        "--curve-threshold", type=float, default=None, help="default: residual's final value"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.connectivity:
        plot_connectivity(args.connectivity, args.out, args.variant, args.lr_scale)
        return
    if args.curves:
        results = run_curves(args)
    elif args.overhead:
        results = run_overhead(rounds=3 if args.quick else 15, quick=args.quick)
    else:
        if args.quick:
            args.depth, args.steps = 16, 300
        seeds = [0] if args.quick else [0, 1, 2]
        results = run_deep_linear(args, seeds)
        for record in results:
            record["curve"] = record["curve"][:: max(1, len(record["curve"]) // 200)]
        results += run_overhead(rounds=3 if args.quick else 15, quick=args.quick)
    (args.out / "ancre.json").write_text(json.dumps({"results": results}, indent=1))
    print(f"\nelapsed {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
