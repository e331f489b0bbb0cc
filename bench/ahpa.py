"""AHPA on CPU: the regime of the mini task, then the repro sweep's curves, router and samples.

1. **Floors** (always): how well the shipped judge classifies real test images and their
   reconstructions by the shipped VAE, and the Fréchet distance (judge features) of real
   validation images to real test images and of the reconstructions to the real test images. A
   latent model cannot beat the reconstructions' distance; the real-to-real distance is the
   sampling noise of the metric at that many images.
2. **Premise** (``--premise DIR``, a finished ``ada sweep cli_configs/ahpa/premise.yaml``): the
   long vanilla run's validation curve (``val/fd``, ``val/class_acc``, ``val/flow_loss`` against
   steps): the regime where alignment can matter is one where vanilla is still far from where
   longer training takes it at the repro's step budget.
3. **Comparison** (``--sweep DIR``, a finished ``ada sweep cli_configs/ahpa/repro.yaml``): mean
   ± std over seeds of the validation curves per arm (``curves.png``), the steps each arm needs to
   reach vanilla's final ``val/fd``, the learned router's ``w(t)`` per level (``router.png``, from
   each AHPA run's ``router.json``) and seed 0's samples per arm (``samples.png``).

Writes ``ahpa.json`` (and the PNGs) to ``--out``. Reports only; no assertion on the numbers.

    python bench/ahpa.py --out /tmp/ahpa
    python bench/ahpa.py --premise sweeps/ahpa_premise --sweep sweeps/ahpa \
        --out docs/techniques/img/ahpa
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

import matplotlib
import torch

from ada_modules.data.shapes import ShapesDataModule
from ada_modules.models.autoencoder import load_autoencoder
from ada_modules.models.frechet import frechet_distance
from ada_modules.models.shapes_judge import load_shapes_judge

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

CURVE_METRICS = ("val/fd", "val/class_acc", "val/flow_loss")


def _mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4g} ± {std:.2g}"


@torch.no_grad()
def floors(count: int) -> dict:
    """Judge accuracy and Fréchet distances of real and reconstructed images."""
    data = ShapesDataModule(val_size=count, test_size=count, seed=0)
    data.setup("test")
    data.setup("validate")
    val_images = data.datasets["val"].tensors[0]
    test_images, test_labels = data.datasets["test"].tensors
    vae, mean, std = load_autoencoder()
    judge = load_shapes_judge()
    recon = torch.cat([vae(chunk).sample.clamp(-1, 1) for chunk in test_images.split(256)])
    test_features = judge.features(test_images)
    record = {
        "images": count,
        "judge_acc_real": (judge(test_images).argmax(-1) == test_labels).float().mean().item(),
        "judge_acc_recon": (judge(recon).argmax(-1) == test_labels).float().mean().item(),
        "fd_real_val_to_test": frechet_distance(judge.features(val_images), test_features),
        "fd_recon_to_test": frechet_distance(judge.features(recon), test_features),
        "recon_l1": (recon - test_images).abs().mean().item(),
    }
    print(f"\n### Floors ({count} test images, judge feature space)\n")
    print("| judge acc. real | judge acc. VAE recon. | FD real val→test | FD recon→test | L1 |")
    print("|---|---|---|---|---|")
    print(
        f"| {record['judge_acc_real']:.3f} | {record['judge_acc_recon']:.3f} | "
        f"{record['fd_real_val_to_test']:.3g} | {record['fd_recon_to_test']:.3g} | "
        f"{record['recon_l1']:.3f} |"
    )
    return record


def _read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = {m: [] for m in CURVE_METRICS}
    for path in sorted(run_dir.glob("**/metrics.csv")):
        with path.open() as handle:
            for row in csv.DictReader(handle):
                for metric in CURVE_METRICS:
                    if row.get(metric):
                        # Lightning logs the validation after step n at step n - 1.
                        curves[metric].append((int(row["step"]) + 1, float(row[metric])))
    return {m: sorted(points) for m, points in curves.items()}


def _variant_curves(sweep: Path) -> dict[str, list[dict[str, list[tuple[int, float]]]]]:
    runs = sweep / "runs"
    found = {}
    for variant_dir in sorted(p for p in runs.iterdir() if p.is_dir()):
        seeds = [_read_curves(d) for d in sorted(variant_dir.glob("seed_*"))]
        found[variant_dir.name] = [c for c in seeds if c["val/fd"]]
    return found


def premise(sweep: Path, out: Path) -> list[dict]:
    """The long vanilla run's validation curve, as a table and ``premise.png``."""
    rows = []
    for variant, seeds in _variant_curves(sweep).items():
        for seed, curves in enumerate(seeds):
            steps = [s for s, _ in curves["val/fd"]]
            for step in steps:
                row = {"variant": variant, "seed": seed, "step": step}
                row.update({m: dict(curves[m]).get(step) for m in CURVE_METRICS})
                rows.append(row)
    print(f"\n### Premise: {sweep.name}\n")
    print("| variant | seed | step | val/fd | val/class_acc | val/flow_loss |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['seed']} | {row['step']} | {row['val/fd']:.4g} | "
            f"{row['val/class_acc']:.3f} | {row['val/flow_loss']:.4f} |"
        )
    fig, axes = plt.subplots(1, len(CURVE_METRICS), figsize=(5 * len(CURVE_METRICS), 3.4))
    for ax, metric in zip(axes, CURVE_METRICS, strict=True):
        for key in sorted({(r["variant"], r["seed"]) for r in rows}):
            points = [(r["step"], r[metric]) for r in rows if (r["variant"], r["seed"]) == key]
            ax.plot(*zip(*points, strict=True), marker=".", label=f"{key[0]} seed {key[1]}")
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "premise.png", dpi=110)
    plt.close(fig)
    return rows


def compare(sweep: Path, out: Path) -> list[dict]:
    """Curves per arm, steps to vanilla's final val/fd, router weights and sample grids."""
    curves = _variant_curves(sweep)
    if "vanilla" not in curves or not curves["vanilla"]:
        raise SystemExit(f"{sweep} has no vanilla runs with val/fd curves")
    target = statistics.mean(c["val/fd"][-1][1] for c in curves["vanilla"])
    fig, axes = plt.subplots(1, len(CURVE_METRICS), figsize=(5 * len(CURVE_METRICS), 3.6))
    rows = []
    print(f"\n### Comparison: {sweep.name} (steps to vanilla's final val/fd = {target:.4g})\n")
    print("| arm | seeds | steps to val/fd ≤ vanilla final (per seed) | final val/fd |")
    print("|---|---|---|---|")
    for variant, seeds in curves.items():
        hits = [next((s for s, v in c["val/fd"] if v <= target), None) for c in seeds]
        finals = [c["val/fd"][-1][1] for c in seeds]
        labels = [
            str(h) if h else f">{c['val/fd'][-1][0]}" for h, c in zip(hits, seeds, strict=True)
        ]
        print(f"| {variant} | {len(seeds)} | {', '.join(labels)} | {_mean_std(finals)} |")
        rows.append({"variant": variant, "hits": hits, "final_val_fd": finals})
        for ax, metric in zip(axes, CURVE_METRICS, strict=True):
            steps = sorted({s for c in seeds for s, _ in c[metric]})
            per_step = [[dict(c[metric])[s] for c in seeds if s in dict(c[metric])] for s in steps]
            means = [statistics.mean(v) for v in per_step]
            stds = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per_step]
            ax.errorbar(steps, means, yerr=stds, marker=".", capsize=2, label=variant)
            ax.set_xlabel("step")
            ax.set_ylabel(f"{metric} (mean ± std over seeds)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
    _plot_router(sweep, out)
    _plot_samples(sweep, out, list(curves))
    return rows


def _plot_router(sweep: Path, out: Path) -> None:
    records = sorted((sweep / "runs").glob("*/seed_*/**/router.json"))
    by_variant: dict[str, list[dict]] = {}
    for path in records:
        variant = path.relative_to(sweep / "runs").parts[0]
        record = json.loads(path.read_text())
        if len(record["levels"]) > 1:  # one level's weight is always 1
            by_variant.setdefault(variant, []).append(record)
    if not by_variant:
        return
    fig, axes = plt.subplots(
        1, len(by_variant), figsize=(4.5 * len(by_variant), 3.4), squeeze=False
    )
    for ax, (variant, runs) in zip(axes[0], sorted(by_variant.items()), strict=True):
        t = runs[0]["t"]
        weights = torch.tensor([run["weights"] for run in runs])  # (seeds, t, levels)
        for level, name in enumerate(runs[0]["levels"]):
            mean, std = weights[:, :, level].mean(0), weights[:, :, level].std(0, correction=0)
            ax.plot(t, mean, label=name.replace("encoder.", ""))
            ax.fill_between(t, mean - std, mean + std, alpha=0.2)
        ax.set_title(f"{variant}: w(t), {len(runs)} seeds")
        ax.set_xlabel("t (0 clean, 1 noise)")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("router weight")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "router.png", dpi=110)
    plt.close(fig)


def _plot_samples(sweep: Path, out: Path, variants: list[str]) -> None:
    grids = [(v, sorted((sweep / "runs" / v / "seed_0").glob("**/samples.png"))) for v in variants]
    grids = [(v, paths[-1]) for v, paths in grids if paths]
    if not grids:
        return
    fig, axes = plt.subplots(1, len(grids), figsize=(3.2 * len(grids), 3.6), squeeze=False)
    for ax, (variant, path) in zip(axes[0], grids, strict=True):
        ax.imshow(mpimg.imread(path))
        ax.set_title(variant)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out / "samples.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/ahpa"))
    parser.add_argument("--premise", type=Path, default=None, help="a finished premise sweep")
    parser.add_argument("--sweep", type=Path, default=None, help="a finished repro sweep")
    parser.add_argument("--quick", action="store_true", help="fewer images for the floors")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    record = {"floors": floors(256 if args.quick else 1024)}
    if args.premise is not None:
        record["premise"] = premise(args.premise, args.out)
    if args.sweep is not None:
        record["comparison"] = compare(args.sweep, args.out)
    (args.out / "ahpa.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
