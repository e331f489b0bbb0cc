"""ABC-Align mini reproduction: tables and plots from the sweeps' outputs.

    python bench/abc_align.py --grid sweeps/abc_align_estimators --out docs/techniques/img/abc_align
    python bench/abc_align.py --sweep sweeps/abc_align --sweep sweeps/abc_align_dpo \\
        --out docs/techniques/img/abc_align

Without ``--grid`` or ``--sweep`` it runs the estimator study itself, in this process, on one
seed (``--quick``: 2 x 2 judges, n = 50, 40 draws per cell, seconds), and prints the same
per-cell table. ``--grid`` reads every ``runs/*/seed_*/study/grid.json`` of the estimator sweep
(``repro_estimators.yaml``), pools the seeds per cell (equal draws per seed: RMSE from the pooled
mean squared error, coverage the mean) and prints the per-cell table (RMSE of every estimator,
coverage of PPI++ and ABC, mean λ̂ and ŵ) and a summary; with ``--out`` it draws heatmaps of
RMSE(ABC)/RMSE(PPI++) and RMSE(ABC)/RMSE(human) over judge accuracy x length bias, one panel per
``n`` (``estimator_ratios.png``). ``--sweep`` reads a training sweep's ``results.json``
(``repro.yaml``: reward model; ``repro_dpo.yaml``: DPO) and prints test accuracy mean ± std per
judge and arm; with ``--out`` it draws one bar chart per sweep (``<sweep name>_accuracy.png``).
"""

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

METHODS = ("human", "pseudo", "concat", "ppi", "ppi++", "abc")
TITLES = {
    "abc_align": "reward model (repro.yaml), 24 human + 2000 judge labels",
    "abc_align_dpo": "DPO (repro_dpo.yaml), 24 human + 2000 judge labels",
}


def mean_std(values: list[float], digits: int = 3) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def pooled_grid(sweep: Path) -> list[dict]:
    """The cells of every seed's grid.json, pooled over seeds."""
    files = sorted(sweep.glob("runs/*/seed_*/study/grid.json"))
    if not files:
        raise SystemExit(f"no runs/*/seed_*/study/grid.json under {sweep}")
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    for file in files:
        for cell in json.loads(file.read_text())["cells"]:
            by_cell[(cell["judge_accuracy"], cell["length_bias"], cell["n"])].append(cell)
    pooled = []
    for (accuracy, bias, n), cells in sorted(by_cell.items()):
        row = {"judge_accuracy": accuracy, "length_bias": bias, "n": n, "seeds": len(cells)}
        for method in METHODS:
            row[f"rmse_{method}"] = math.sqrt(
                statistics.mean(c[f"rmse_{method}"] ** 2 for c in cells)
            )
            row[f"coverage_{method}"] = statistics.mean(c[f"coverage_{method}"] for c in cells)
            row[f"bias_{method}"] = statistics.mean(c[f"bias_{method}"] for c in cells)
        row["sd_human"] = statistics.mean(c["sd_human"] for c in cells)
        row["lambda"] = statistics.mean(c["lambda"] for c in cells)
        row["abc_weight"] = statistics.mean(c["abc_weight"] for c in cells)
        pooled.append(row)
    return pooled


def run_study(quick: bool) -> list[dict]:
    """The estimator study of ``repro_estimators.yaml`` (one seed) or a tiny one, in-process."""
    from lightning.pytorch import Trainer

    from ada_modules.models import EstimatorStudyModule

    grid = (
        {"judge_accuracies": [0.6, 0.9], "length_biases": [0.0, 1.0], "num_labelled": [50],
         "trials": 40, "truth_pairs": 50_000}
        if quick
        else {"judge_accuracies": [0.3, 0.6, 0.8, 0.9], "length_biases": [0.0, 0.1, 0.25, 0.5, 1.0],
              "num_labelled": [50, 400], "trials": 400}
    )  # fmt: skip
    study = EstimatorStudyModule(num_unlabelled=5000, seed=0, **grid)
    Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False).test(study, verbose=False)  # fmt: skip
    return [{**cell, "seeds": 1} for cell in study.results]


def grid_tables(cells: list[dict]) -> None:
    print("| judge acc. | length bias | n | pseudo bias | " + " | ".join(
        f"RMSE {m}" for m in METHODS) + " | cov. PPI++ | cov. ABC | λ̂ | ŵ |")  # fmt: skip
    print("|" + "---|" * (len(METHODS) + 8))
    for c in cells:
        rmse = " | ".join(f"{c[f'rmse_{m}']:.4f}" for m in METHODS)
        print(
            f"| {c['judge_accuracy']} | {c['length_bias']} | {c['n']} | {c['bias_pseudo']:+.3f} | "
            f"{rmse} | {c['coverage_ppi++']:.3f} | {c['coverage_abc']:.3f} | {c['lambda']:.2f} | "
            f"{c['abc_weight']:.2f} |"
        )
    ratio = [c["rmse_abc"] / c["rmse_ppi++"] for c in cells]
    human = [c["rmse_abc"] / c["rmse_human"] for c in cells]
    small = [
        c["rmse_abc"] / c["rmse_ppi++"] for c in cells if abs(c["bias_pseudo"]) <= c["sd_human"]
    ]
    print(
        f"\nRMSE(ABC)/RMSE(PPI++): max {max(ratio):.3f}, mean {statistics.mean(ratio):.3f}, "
        f"cells <= 1.05: {sum(r <= 1.05 for r in ratio)}/{len(ratio)}; where |pseudo bias| <= "
        f"human SE: mean {statistics.mean(small):.3f} over {len(small)} cells"
    )
    print(
        f"RMSE(ABC)/RMSE(human): max {max(human):.3f}, cells <= 1: "
        f"{sum(r <= 1 for r in human)}/{len(human)}"
    )


def plot_grid(cells: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({c["n"] for c in cells})
    accuracies = sorted({c["judge_accuracy"] for c in cells})
    biases = sorted({c["length_bias"] for c in cells})
    fig, axes = plt.subplots(2, len(ns), figsize=(4.8 * len(ns), 7.5), squeeze=False)
    for row, (against, title) in enumerate((("ppi++", "PPI++"), ("human", "human-only"))):
        for col, n in enumerate(ns):
            grid = [[math.nan] * len(biases) for _ in accuracies]
            for c in cells:
                if c["n"] == n:
                    i, j = accuracies.index(c["judge_accuracy"]), biases.index(c["length_bias"])
                    grid[i][j] = c["rmse_abc"] / c[f"rmse_{against}"]
            ax = axes[row][col]
            image = ax.imshow(grid, cmap="RdBu_r", vmin=0.4, vmax=1.6, origin="lower")
            for i in range(len(accuracies)):
                for j in range(len(biases)):
                    ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(biases)), [str(b) for b in biases])
            ax.set_yticks(range(len(accuracies)), [str(a) for a in accuracies])
            ax.set_xlabel("judge length bias")
            ax.set_ylabel("judge accuracy")
            ax.set_title(f"ABC / {title}, n = {n}", fontsize=10)
    fig.suptitle("RMSE ratio of the win-rate estimate (below 1, blue: ABC better)")
    fig.colorbar(image, ax=axes, shrink=0.6)
    fig.savefig(out / "estimator_ratios.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def training_table(sweep: Path) -> dict[str, dict[str, list[float]]]:
    """Per judge, per arm: the seeds' test accuracies (runs that did not finish are listed)."""
    runs = json.loads((sweep / "results.json").read_text())["runs"]
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    extra: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        arm, judge = run["variant"].split(",judge=")
        if run["status"] != "ok":
            print(f"not ok: {run['variant']} seed {run['seed']}: {run.get('error')}")
            continue
        by[judge][arm].append(run["metrics"]["test/accuracy"])
        for key in ("train/lambda", "train/abc_weight", "test/sample_length"):
            if run["metrics"].get(key) is not None:
                extra[f"{judge}|{arm}"][key].append(run["metrics"][key])
    arms = list(dict.fromkeys(arm for judge in by.values() for arm in judge))
    print(f"\n{sweep.name}: test accuracy (held-out pairs vs the true preference)\n")
    print("| judge | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for judge, per_arm in by.items():
        print(f"| {judge} | " + " | ".join(mean_std(per_arm.get(a, [])) for a in arms) + " |")
    print("\nλ̂, ŵ (last logged) and sample length, mean over seeds:")
    for key, values in extra.items():
        print(f"  {key}: " + ", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in values.items()))
    return by


def plot_training(by: dict, name: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judges = list(by)
    arms = list(dict.fromkeys(arm for judge in by.values() for arm in judge))
    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * len(judges), 3.6))
    for k, arm in enumerate(arms):
        means = [statistics.mean(by[j][arm]) if by[j].get(arm) else math.nan for j in judges]
        stds = [statistics.stdev(by[j][arm]) if len(by[j].get(arm, [])) > 1 else 0.0
                for j in judges]  # fmt: skip
        xs = [i + (k - (len(arms) - 1) / 2) * width for i in range(len(judges))]
        ax.bar(xs, means, width, yerr=stds, label=arm, capsize=2)
    ax.set_xticks(range(len(judges)), [f"judge={j}" for j in judges])
    ax.set_ylabel("held-out accuracy vs true preference")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(TITLES.get(name, name))
    fig.savefig(out / f"{name}_accuracy.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", type=Path, help="output folder of repro_estimators.yaml")
    parser.add_argument("--sweep", type=Path, action="append", default=[],
                        help="output folder of repro.yaml or repro_dpo.yaml (repeatable)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="folder for the plots")
    parser.add_argument("--quick", action="store_true", help="a tiny in-process estimator study")
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.grid is not None or not args.sweep:
        cells = pooled_grid(args.grid) if args.grid is not None else run_study(args.quick)
        grid_tables(cells)
        if args.out is not None:
            plot_grid(cells, args.out)
    for sweep in args.sweep:
        by = training_table(sweep)
        if args.out is not None:
            plot_training(by, sweep.name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
