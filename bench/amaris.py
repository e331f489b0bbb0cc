"""AMARIS on CPU: merge cost, the Pareto fronts of the repro sweeps, and the held-out budget.

What is measured (issue 22):

1. **Merge cost** (always): per layer size ``d`` (square ``d x d`` layer with bias, random
   statistics of ``4 d`` samples), the time of the generalized eigensolver
   (:func:`~ada_modules.merging.generalized_eigh`) and of the whole AMARIS layer merge
   (:func:`~ada_modules.merging.amaris_layer`, eigensolver included), median of 3, against one
   ``d x d`` matrix product for scale. The eigensolver is ``O(d^3)``: this is what a merge costs
   per layer and specialist, once, offline.
2. **Pareto fronts** (``--sweep DIR``, a finished ``ada sweep cli_configs/amaris/repro.yaml``):
   core retention against specialist retention, mean over the seeds (error bars: std), per
   specialist and method, as ``amaris_pareto.png``; and the table "best specialist retention at
   matched core retention": for each method, the highest mean specialist retention among its
   settings whose mean core retention is at least 0.95 / 0.97 / 0.99.
3. **Budget on held-out data** (``--sweep DIR``): for every seed and specialist of the sweep's
   shared fits, AMARIS merges in-process at budgets 0.002..0.05 and ridges 1e-6..1e-1 (the
   ridge regularises the base covariance, ``Σ_b + ridge · tr(Σ_b)/d · I``). For each, the largest
   per-layer deviation over the budget on the calibration data the merge saw (the training split)
   and on held-out core data (the test split), and the core and specialist retention. The merge
   meets its budget on the calibration statistics by construction; the held-out column shows how
   far that carries to new inputs, and what a ridge buys.
4. **Tiny language model** (``--lm-sweep DIR``, a finished
   ``ada sweep cli_configs/amaris/repro_lm.yaml``): the premise table (the base and each
   specialist on every domain) and the Pareto fronts and matched-core table of section 2, as
   ``amaris_lm_pareto.png``.

Run it::

    .venv/bin/python bench/amaris.py --quick                          # merge cost only, ~10 s
    .venv/bin/python bench/amaris.py --sweep sweeps/amaris --out docs/techniques/img/amaris
    .venv/bin/python bench/amaris.py --lm-sweep sweeps/amaris_lm --out docs/techniques/img/amaris

Reports only; no assertion.
"""

import argparse
import copy
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from ada_modules.data import DigitDomainsDataModule
from ada_modules.merging import (
    amaris,
    amaris_layer,
    collect_activation_stats,
    generalized_eigh,
    output_deviation,
)
from ada_modules.models import ImageClassifierModule

CORE = "identity"
BUDGETS = (0.002, 0.005, 0.01, 0.02, 0.05)
RIDGES = (1e-6, 1e-3, 1e-2, 1e-1)
THRESHOLDS = (0.95, 0.97, 0.99)
LM_THRESHOLDS = (0.5, 0.7, 0.9)  # no merge keeps 95 % of the tiny LM's core task
# method families of the repro's variant names `<specialist>_<family>_<setting>` (dare_ties before
# ties: the first that matches wins)
FAMILIES = ("task_arithmetic", "dare_ties", "ties", "dare_linear", "regmean", "fisher", "amaris")
# AMARIS with embeddings and norms kept at the base's (variant names ending in `_other_base`)
OTHER_BASE = "amaris_other_base"


def _median_s(fn, *args, repeats: int = 3, **kwargs) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _random_stats(d: int, samples: int, scale: torch.Tensor, generator) -> torch.Tensor:
    x = torch.randn(samples, d, generator=generator, dtype=torch.float64) * scale
    return x.T @ x / samples


def merge_cost(sizes: list[int]) -> list[dict]:
    """Section 1: eigensolver and AMARIS layer time per layer size."""
    rows = []
    generator = torch.Generator().manual_seed(0)
    print("\n## 1. Merge cost per layer and specialist (median of 3)\n")
    print("| d | eigensolver (ms) | AMARIS layer (ms) | d x d matmul (ms) | rank kept |")
    print("|---|---|---|---|---|")
    for d in sizes:
        dim = d + 1  # with the bias column
        sigma_b = _random_stats(dim, 4 * dim, torch.ones(dim, dtype=torch.float64), generator)
        scale = torch.linspace(0.5, 2.0, dim, dtype=torch.float64)
        sigma_s = _random_stats(dim, 4 * dim, scale, generator)
        base = torch.randn(d, dim, generator=generator, dtype=torch.float64)
        delta = 0.1 * torch.randn(d, dim, generator=generator, dtype=torch.float64)
        eig_s = _median_s(generalized_eigh, sigma_s, sigma_b)
        layer_s = _median_s(amaris_layer, delta, sigma_s, sigma_b, 0.05, base, ridge=1e-6)
        matmul_s = _median_s(torch.mm, base[:, :d], base[:, :d].T)
        _, report = amaris_layer(delta, sigma_s, sigma_b, 0.05, base, ridge=1e-6)
        row = {
            "d": d,
            "eig_ms": eig_s * 1e3,
            "layer_ms": layer_s * 1e3,
            "matmul_ms": matmul_s * 1e3,
        }
        rows.append({**row, "rank": report.rank})
        print(
            f"| {d} | {eig_s * 1e3:.1f} | {layer_s * 1e3:.1f} | {matmul_s * 1e3:.2f} | "
            f"{report.rank} of {dim} |"
        )
    return rows


def _family(variant: str) -> tuple[str, str] | None:
    """``(specialist, family)`` of a repro variant name such as ``rot90_amaris_b0.01``."""
    for family in FAMILIES:
        marker = f"_{family}"
        if marker in variant:
            specialist = variant.split(marker)[0]
            return specialist, OTHER_BASE if variant.endswith("_other_base") else family
    return None


def _panel_order(specialist: str) -> tuple[int, str]:
    """The repros' panels first (rot90, flip_ud / lower, upper, then both), then any others."""
    order = ("rot90", "flip_ud", "lower", "upper", "both")
    return (order.index(specialist) if specialist in order else len(order)), specialist


def pareto(
    sweep: Path,
    out: Path | None,
    plot: str = "amaris_pareto.png",
    core: str = CORE,
    thresholds: tuple[float, ...] = THRESHOLDS,
) -> dict:
    """Section 2: Pareto fronts and best specialist retention at matched core retention."""
    results = json.loads((sweep / "results.json").read_text())
    points: dict[str, dict] = defaultdict(lambda: {"core": [], "specialist": []})
    for run in results["runs"]:
        if run["status"] != "ok":
            continue
        points[run["variant"]]["core"].append(run["metrics"]["test/core_retention"])
        points[run["variant"]]["specialist"].append(run["metrics"]["test/specialist_retention"])
    summary = {
        name: {
            "core": statistics.mean(p["core"]),
            "core_std": statistics.stdev(p["core"]) if len(p["core"]) > 1 else 0.0,
            "specialist": statistics.mean(p["specialist"]),
            "specialist_std": statistics.stdev(p["specialist"]) if len(p["core"]) > 1 else 0.0,
            "seeds": len(p["core"]),
        }
        for name, p in points.items()
    }
    specialists = sorted({f[0] for name in summary if (f := _family(name))}, key=_panel_order)
    print(f"\n## 2. Best specialist retention at matched core retention ({sweep.name}, mean)\n")
    print("| specialist | method | " + " | ".join(f"core ≥ {t}" for t in thresholds) + " |")
    print("|---|---|" + "---|" * len(thresholds))
    best: dict = {}
    for specialist in specialists:
        for family in (*FAMILIES, OTHER_BASE):
            settings = [
                (name, s) for name, s in summary.items() if _family(name) == (specialist, family)
            ]
            if not settings:
                continue
            cells = []
            for threshold in thresholds:
                ok = [(s["specialist"], name) for name, s in settings if s["core"] >= threshold]
                value, name = max(ok) if ok else (None, None)
                best[f"{specialist}/{family}/{threshold}"] = {"value": value, "variant": name}
                marker = "_amaris" if family == OTHER_BASE else f"_{family}"
                setting = name.split(marker)[-1].removesuffix("_other_base") if name else ""
                setting = setting.lstrip("_")
                cells.append("–" if value is None else f"{value:.3f} ({setting or family})")
            print(f"| {specialist} | {family} | " + " | ".join(cells) + " |")
    if out is not None:
        _plot_pareto(summary, specialists, out / plot, core)
    return {"points": summary, "best_at_core": best}


def _plot_pareto(summary: dict, specialists: list[str], path: Path, core: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "task_arithmetic": ("tab:blue", "o-"),
        "ties": ("tab:orange", "s-"),
        "dare_linear": ("tab:purple", "D"),
        "dare_ties": ("tab:pink", "d"),
        "regmean": ("tab:green", "^"),
        "fisher": ("tab:brown", "v"),
        "amaris": ("tab:red", "*-"),
        OTHER_BASE: ("tab:red", "x"),
    }
    fig, axes = plt.subplots(1, len(specialists), figsize=(5.2 * len(specialists), 4.2))
    for ax, specialist in zip([axes] if len(specialists) == 1 else axes, specialists, strict=True):
        for family, (color, style) in styles.items():
            settings = sorted(
                (s["core"], s["specialist"], s["core_std"], s["specialist_std"])
                for name, s in summary.items()
                if _family(name) == (specialist, family)
            )
            if not settings:
                continue
            x, y, xerr, yerr = zip(*settings, strict=True)
            ax.errorbar(
                x,
                y,
                xerr=xerr,
                yerr=yerr,
                fmt=style,
                color=color,
                label="amaris, other: base" if family == OTHER_BASE else family,
                markersize=7 if family == "amaris" else 5,
                capsize=2,
                linewidth=1,
            )
        if "base" in summary and specialist == specialists[0]:
            base = summary["base"]
            ax.plot([base["core"]], [base["specialist"]], "kx", label="base (no merge)")
        ax.set_xlabel(f"core retention (merged / base on {core})")
        if specialist == "both":
            ax.set_ylabel("specialist retention (mean over both specialists)")
            ax.set_title("both specialists merged at once")
        else:
            ax.set_ylabel(f"specialist retention (merged / specialist on {specialist})")
            ax.set_title(f"one specialist: {specialist}")
        ax.grid(alpha=0.3)
    (axes if len(specialists) == 1 else axes[0]).legend(fontsize=8, loc="center left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nwrote {path}")


def _forward(model, batch):
    return model(batch[0])


@torch.no_grad()
def _accuracy(model, loader) -> float:
    right = total = 0
    for inputs, labels in loader:
        right += int((model(inputs).argmax(-1) == labels).sum())
        total += labels.numel()
    return right / total


def _load(path: Path) -> ImageClassifierModule:
    return ImageClassifierModule.load_from_checkpoint(path, map_location="cpu").eval()


def budget_study(sweep: Path) -> list[dict]:
    """Section 3: calibration and held-out budget use, and retention, per budget and ridge."""
    fits = sweep / "shared_fit"
    seeds = sorted(int(p.name.split("_")[1]) for p in (fits / "base").glob("seed_*"))
    specialists = sorted(p.name for p in fits.iterdir() if p.name != "base")
    rows: dict[tuple[float, float], list[dict]] = defaultdict(list)
    for seed in seeds:
        data = DigitDomainsDataModule(seed=seed, eval_domains=[CORE, *specialists])
        data.setup("test")
        base = _load(fits / "base" / f"seed_{seed}" / "checkpoints" / "last.ckpt")
        base_sd = base.state_dict()

        def batches(domain, split, data=data):
            return list(data.domain_dataloader(domain, split))

        core_train = collect_activation_stats(base, batches(CORE, "train"), forward=_forward)
        core_test = collect_activation_stats(base, batches(CORE, "test"), forward=_forward)
        base_core = _accuracy(base, batches(CORE, "test"))
        for name in specialists:
            tuned = _load(fits / name / f"seed_{seed}" / "checkpoints" / "last.ckpt")
            own = batches(name, "test")
            tuned_acc = _accuracy(tuned, own)
            stats = collect_activation_stats(tuned, batches(name, "train"), forward=_forward)
            for ridge in RIDGES:
                for budget in BUDGETS:
                    merged_sd, report = amaris(
                        base_sd, [tuned.state_dict()], [stats], core_train, budget, ridge=ridge
                    )
                    merged = copy.deepcopy(base)
                    merged.load_state_dict(merged_sd)
                    calibration = output_deviation(base_sd, merged_sd, core_train)
                    held_out = output_deviation(base_sd, merged_sd, core_test)
                    rows[(ridge, budget)].append(
                        {
                            "calibration_use": max(calibration.values()) / budget,
                            "held_out_use": max(held_out.values()) / budget,
                            "core": _accuracy(merged, batches(CORE, "test")) / base_core,
                            "specialist": _accuracy(merged, own) / tuned_acc,
                            "rank": statistics.mean(
                                e["specialists"][0]["rank"] for e in report["layers"].values()
                            ),
                        }
                    )
    print(
        f"\n## 3. Budget use on calibration vs held-out core data "
        f"({len(seeds)} seeds x {len(specialists)} specialists, mean ± std)\n"
    )
    print(
        "| ridge | budget | calibration use | held-out use (max over merges) | core retention | "
        "specialist retention | mean rank |"
    )
    print("|---|---|---|---|---|---|---|")
    table = []
    for (ridge, budget), entries in rows.items():
        summary = {"ridge": ridge, "budget": budget, "n": len(entries)}
        for key in ("calibration_use", "held_out_use", "core", "specialist", "rank"):
            values = [e[key] for e in entries]
            summary[key] = statistics.mean(values)
            summary[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
            summary[f"{key}_max"] = max(values)
        table.append(summary)
        print(
            f"| {ridge:g} | {budget:g} | {summary['calibration_use']:.3f} "
            f"(max {summary['calibration_use_max']:.3f}) | {summary['held_out_use']:.3f} ± "
            f"{summary['held_out_use_std']:.3f} ({summary['held_out_use_max']:.3f}) | "
            f"{summary['core']:.3f} ± {summary['core_std']:.3f} | "
            f"{summary['specialist']:.3f} ± {summary['specialist_std']:.3f} | "
            f"{summary['rank']:.1f} |"
        )
    return table


def lm_premise(sweep: Path) -> list[dict]:
    """Section 3's premise: the base and each specialist (task arithmetic at weight 1) on every
    domain of the LM repro, mean ± std over its seeds."""
    results = json.loads((sweep / "results.json").read_text())
    models = {"base": "base", "lower specialist": "lower_task_arithmetic_w1.0"}
    models["upper specialist"] = "upper_task_arithmetic_w1.0"
    domains = ("addition", "lower", "upper")
    print("\n## 4. Tiny LM premise: exact match per domain (mean ± std over seeds)\n")
    print("| model | " + " | ".join(domains) + " | core retention | seeds |")
    print("|---|" + "---|" * (len(domains) + 2))
    rows = []
    for label, variant in models.items():
        runs = [
            r["metrics"] for r in results["runs"] if r["variant"] == variant and r["status"] == "ok"
        ]
        if not runs:
            continue
        row = {"model": label, "seeds": len(runs)}
        for metric in (*(f"test/{d}/accuracy" for d in domains), "test/core_retention"):
            values = [r[metric] for r in runs]
            row[metric] = _mean_std(values)
        rows.append(row)
        cells = [f"{m:.3f} ± {s:.3f}" for m, s in list(row.values())[2:]]
        print(f"| {label} | " + " | ".join(cells) + f" | {len(runs)} |")
    return rows


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="layer sizes up to 256 only")
    parser.add_argument("--sweep", type=Path, default=None, help="a finished repro sweep folder")
    parser.add_argument(
        "--lm-sweep", type=Path, default=None, help="a finished repro_lm sweep folder"
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for amaris.json and plots")
    args = parser.parse_args()
    result = {"cost": merge_cost([64, 128, 256] if args.quick else [64, 128, 256, 512, 1024])}
    if args.sweep is not None:
        result["pareto"] = pareto(args.sweep, args.out)
        result["budget"] = budget_study(args.sweep)
    if args.lm_sweep is not None:
        result["lm"] = {
            "premise": lm_premise(args.lm_sweep),
            "pareto": pareto(
                args.lm_sweep, args.out, "amaris_lm_pareto.png", "addition", LM_THRESHOLDS
            ),
        }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "amaris_lm.json" if args.sweep is None and args.lm_sweep else "amaris.json"
        (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
