"""ASAP on CPU: the sliding-mode controller on a scalar plant, then the mini reproduction's tables.

0. **Scalar plant** (no model, seconds): ``y[t+1] = y[t] + F[t] + b u[t]`` with a drift
   ``F[t] = 0.02 + 0.01 sin(t / 3)`` and a gain ``b = -0.5`` that the controllers do not know (they
   start from a guess of -1), from ``y = 0.9`` to the target 0.3, with measurement noise of
   standard deviation ``noise``. :class:`~ada_modules.fl.sliding_mode.SlidingModeController` (the
   drift in a Fourier basis, the gain by least squares) against a fixed proportional controller
   ``u = q s / b_guess`` (the same reaching rate, no estimate): rounds to enter and stay 5 rounds
   in ±0.05, and the mean ``|y - 0.3|`` after, over 5 noise seeds, with and without an input limit.

With ``--sweep SWEEP``, reads ``ada sweep cli_configs/asap/repro.yaml --out SWEEP`` and prints:

1. **Premise**, per number of attackers ``f`` and rule: the clean accuracy when the attack starts,
   the final accuracy without an attack (the task is solved and stays solved), and the lowest
   accuracy any attack arm reached (whether the target, half the clean accuracy, is within reach
   of any attack under that rule).
2. **Per rule**: for every attack, how many seeds reached the target band (5 rounds in a row),
   rounds to reach it (a run that never does counts all 80 attacked rounds), the deviation after
   reaching, the mean deviation over the last 10 rounds, the final accuracy, and the share of the
   malicious updates the rule kept; mean ± std over seeds.

and writes ``asap_curves.png`` (server accuracy per round, mean over seeds, one panel per rule, for
each ``f``) and ``asap.json`` to ``--out``. Reports only; no assertion on the numbers.

    python bench/asap.py --sweep sweeps/asap --out docs/techniques/img/asap
    python bench/asap.py --quick      # the scalar plant only
"""

import argparse
import csv
import json
import math
import random
import statistics
from collections import defaultdict
from pathlib import Path

from ada_modules.fl.round_metrics import deviation_after, rounds_to_reach_and_stay
from ada_modules.fl.sliding_mode import SlidingModeController

RULES = ("mean", "median", "trimmed_mean", "multi_krum", "fltrust")
ATTACKS = ("none", "lie", "ipm", "fang_krum", "fang_trimmed_mean", "min_max", "min_sum", "asap")


def mean_std(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


# ------------------------------------------------------------------ 0. scalar plant


class _Proportional:
    """``u = (q s) / b_guess``: the reaching law without estimates or switching."""

    def __init__(self, target: float, gain: float, q: float, limit: float) -> None:
        self.target, self.gain, self.q, self.limit = target, gain, q, limit

    def step(self, y: float) -> float:
        u = -self.q * (y - self.target) / self.gain
        return max(-self.limit, min(self.limit, u))


def scalar_plant(rounds: int, noise: float, results: dict) -> None:
    print("## 0. Scalar plant: unknown drift and gain (5 noise seeds)\n")
    print(
        "| controller | input limit | rounds to reach ±0.05 | deviation after | final |y - 0.3| |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for limit in (math.inf, 0.1):
        for name in ("sliding mode", "proportional"):
            reach, after, final = [], [], []
            for seed in range(5):
                rng = random.Random(seed)
                if name == "sliding mode":
                    controller = SlidingModeController(
                        target=0.3, gain=-1.0, boundary_layer=0.03, u_min=-limit, u_max=limit
                    )
                else:
                    controller = _Proportional(0.3, -1.0, 0.5, limit)
                y, trace = 0.9, []
                for t in range(rounds):
                    u = controller.step(y + rng.gauss(0.0, noise))
                    y = y + 0.02 + 0.01 * math.sin(t / 3) - 0.5 * u
                    trace.append(y)
                reached = rounds_to_reach_and_stay(trace, 0.3, 0.05)
                reach.append(float(rounds if reached is None else reached + 1))
                after.append(deviation_after(trace, 0.3, reached))
                final.append(abs(trace[-1] - 0.3))
            shown = "none" if math.isinf(limit) else f"{limit}"
            print(
                f"| {name} | {shown} | {mean_std(reach, 1)} | {mean_std(after)} "
                f"| {mean_std(final)} |"
            )
            results["scalar_plant"].append(
                {"controller": name, "limit": shown, "rounds": reach, "after": after}
            )
    print()


# ------------------------------------------------------------------ sweep


def load(sweep: Path) -> dict[tuple[str, str, int], dict[int, dict]]:
    """Per (attack, rule, f), per seed: the run's metrics and its accuracy curve."""
    runs = json.loads((sweep / "results.json").read_text())["runs"]
    by: dict[tuple[str, str, int], dict[int, dict]] = defaultdict(dict)
    for run in runs:
        if run["status"] != "ok":
            continue
        attack, rule, f = run["variant"].split(",")
        key = (attack, rule.split("=")[1], int(f.split("=")[1]))
        by[key][run["seed"]] = {**run["metrics"], "curve": _curve(Path(run["run_dir"]))}
    return by


def _curve(run_dir: Path) -> list[float]:
    """The server's accuracy after each round, from the run's CSV log."""
    files = sorted(run_dir.glob("lightning_logs/version_*/metrics.csv"))
    if not files:
        return []
    with files[-1].open() as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train/accuracy")]
    return [float(row["train/accuracy"]) for row in rows]


def premise(by: dict, results: dict) -> None:
    print("## 1. Premise: the task is solved, and is the target within reach of any attack?\n")
    print(
        "| f | rule | clean accuracy (attack start) | final, no attack | target | lowest accuracy, any attack |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for f in sorted({key[2] for key in by}):
        for rule in RULES:
            clean = by.get(("none", rule, f), {})
            if not clean:
                continue
            lowest = [
                min(seed["curve"][40:])
                for (attack, r, ff), seeds in by.items()
                if r == rule and ff == f and attack != "none"
                for seed in seeds.values()
                if seed["curve"]
            ]
            row = {
                "f": f,
                "rule": rule,
                "clean": [m["val/clean_accuracy"] for m in clean.values()],
                "final_clean": [m["val/accuracy_final"] for m in clean.values()],
                "target": [m["val/target"] for m in clean.values()],
                "lowest": min(lowest) if lowest else None,
            }
            lowest_text = f"{row['lowest']:.3f}" if row["lowest"] is not None else "–"
            print(
                f"| {f} | {rule} | {mean_std(row['clean'])} | {mean_std(row['final_clean'])} "
                f"| {mean_std(row['target'])} | {lowest_text} |"
            )
            results["premise"].append(row)
    print()


def per_rule(by: dict, results: dict) -> None:
    print("## 2. Attacks per rule (mean ± std over seeds)\n")
    for f in sorted({key[2] for key in by}):
        for rule in RULES:
            if not any((attack, rule, f) in by for attack in ATTACKS):
                continue
            print(f"### f = {f}, {rule}\n")
            print(
                "| attack | reached | rounds to target ↓ | deviation after ↓ | final deviation ↓ "
                "| final accuracy | malicious kept |"
            )
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
            for attack in ATTACKS:
                seeds = by.get((attack, rule, f))
                if not seeds:
                    continue
                runs = list(seeds.values())
                reached = sum(m.get("val/reached", 0.0) == 1.0 for m in runs)
                cells = {
                    name: [m.get(f"val/{name}") for m in runs]
                    for name in (
                        "rounds_to_target",
                        "deviation_after_reach",
                        "final_deviation",
                        "accuracy_final",
                        "malicious_kept",
                    )
                }
                print(
                    f"| {attack} | {reached}/{len(runs)} | {mean_std(cells['rounds_to_target'], 1)} "
                    f"| {mean_std(cells['deviation_after_reach'])} "
                    f"| {mean_std(cells['final_deviation'])} | {mean_std(cells['accuracy_final'])} "
                    f"| {mean_std(cells['malicious_kept'], 2)} |"
                )
                results["arms"].append(
                    {"f": f, "rule": rule, "attack": attack, "reached": reached, **cells}
                )
            print()


def plot(by: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({key[2] for key in by})
    figure, axes = plt.subplots(
        len(counts), len(RULES), figsize=(4 * len(RULES), 3.2 * len(counts)), squeeze=False
    )
    for row, f in enumerate(counts):
        for col, rule in enumerate(RULES):
            axis = axes[row][col]
            for attack in ATTACKS:
                curves = [s["curve"] for s in by.get((attack, rule, f), {}).values() if s["curve"]]
                if not curves:
                    continue
                length = min(len(c) for c in curves)
                mean = [statistics.mean(c[i] for c in curves) for i in range(length)]
                style = {"linewidth": 2.5, "color": "black"} if attack == "asap" else {}
                axis.plot(range(1, length + 1), mean, label=attack, **style)
            targets = [m["val/target"] for m in by.get(("none", rule, f), {}).values()]
            if targets:
                target = statistics.mean(targets)
                axis.axhspan(target - 0.05, target + 0.05, color="tab:green", alpha=0.15)
            axis.axvline(40, color="gray", linestyle=":")
            axis.set_title(f"{rule}, f = {f}")
            axis.set_ylim(0, 1)
            axis.set_xlabel("round")
            if col == 0:
                axis.set_ylabel("server accuracy")
    axes[0][0].legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(out / "asap_curves.png", dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=Path, help="output folder of the repro sweep")
    parser.add_argument("--out", type=Path, default=None, help="folder for the json and plots")
    parser.add_argument("--quick", action="store_true", help="the scalar plant only, short")
    parser.add_argument("--noise", type=float, default=0.02, help="measurement noise (std)")
    args = parser.parse_args(argv)
    results: dict = {"scalar_plant": [], "premise": [], "arms": []}
    scalar_plant(60 if args.quick else 150, args.noise, results)
    if args.sweep is not None:
        by = load(args.sweep)
        premise(by, results)
        per_rule(by, results)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            plot(by, args.out)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "asap.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
