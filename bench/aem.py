"""AEM on CPU: the bandit check of the entropy-drift formula, the transform's cost, and curves.

1. **Theory check** (the mechanism AEM is built on). A categorical "response-as-action" bandit:
   ``K = 16`` responses with logits ``~ N(0, 1.5²)`` and success probabilities ``~ U(0, 1)``. Per
   draw, ``G = 8`` responses are sampled, rewarded (Bernoulli), given advantages, and one
   natural-gradient step of size ``lr`` is taken on the logits (tabular softmax:
   ``Δz = lr/G · Σ_i A_i e_{y_i} / π(y_i)``). The measured change of the response entropy is
   compared with the first-order prediction ``lr/G · Σ_i A_i (S_i − H)``
   (:func:`~ada_modules.posttrain.advantages.predicted_entropy_drift`): Pearson and Spearman
   correlation and sign agreement over 2,000 draws (500 with ``--quick``), for three step sizes
   (Pearson is dominated by the few draws where a rare response gets a large step, ``1/π(y)``). Then the mean
   measured entropy change under GRPO advantages and under AEM with ``β = +0.5`` (explore) and
   ``β = −0.5`` (exploit), and their difference to GRPO's. Three seeds, mean ± std.
2. **Cost** of :func:`~ada_modules.posttrain.advantages.aem_advantages` relative to
   :func:`~ada_modules.posttrain.advantages.grpo_advantages` on a ``(64, 8)`` batch (median of
   repeats); negligible next to a rollout either way.
3. **Curves** (``--curves SWEEP_DIR``): reads the CSV logs of an ``ada sweep`` of
   ``cli_configs/aem/repro.yaml`` and plots, per variant, held-out success and response-level
   entropy against sampled tokens, mean over seeds with a 95% t-interval band
   (``aem_success_curve.png``, ``aem_entropy_curve.png`` in ``--out``), and prints, from its
   ``results.json``, each metric's mean with a 95% t-interval per variant and the paired
   difference to GRPO (same seed, hence the same warm start) with its 95% t-interval. Before
   both, the **premise table**: per variant, the training success of the first and last third
   of the RL steps, the sampled tokens at which its 5-step moving average first reaches 50%
   (the point where the ``balance`` schedule turns to exploiting), and the response entropy of
   the first and last third with its relative drop.

Reports only; no assertion on the numbers. Writes ``aem.json`` to ``--out``.
"""

import argparse
import csv
import json
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from ada_modules.posttrain.advantages import (
    aem_advantages,
    grpo_advantages,
    predicted_entropy_drift,
)

ARMS = 16
GROUP = 8
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def bandit(estimator, draws: int, lr: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted and measured entropy changes of one natural-gradient step, per draw."""
    gen = torch.Generator().manual_seed(seed)
    predicted, measured = [], []
    for _ in range(draws):
        logits = torch.randn(ARMS, generator=gen, dtype=torch.float64) * 1.5
        success = torch.rand(ARMS, generator=gen, dtype=torch.float64)
        probs = torch.softmax(logits, -1)
        responses = torch.multinomial(probs, GROUP, replacement=True, generator=gen)
        rewards = torch.rand(GROUP, generator=gen, dtype=torch.float64) < success[responses]
        rewards = rewards.double()[None]
        surprisal = -torch.log(probs[responses])[None]
        advantages = estimator(rewards, surprisal)[0]
        delta = torch.zeros(ARMS, dtype=torch.float64)
        delta.index_add_(0, responses, advantages / probs[responses])
        h = _entropy(logits)
        measured.append(float(_entropy(logits + delta * lr / GROUP) - h))
        predicted.append(float(lr * predicted_entropy_drift(advantages[None], surprisal, h)[0]))
    return torch.tensor(predicted), torch.tensor(measured)


ESTIMATORS = {
    "GRPO": lambda r, s: grpo_advantages(r),
    "AEM β=+0.5 (explore)": lambda r, s: aem_advantages(r, s, strength=0.5, schedule="constant"),
    "AEM β=−0.5 (exploit)": lambda r, s: aem_advantages(
        r, s, strength=0.5, schedule="linear", progress=1.0
    ),
}


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g}"


def theory_check(draws: int, seeds: list[int], results: dict) -> None:
    print("\n## Bandit check: predicted vs measured response-entropy change (GRPO advantages)\n")
    print(f"K = {ARMS} responses, G = {GROUP}, {draws} draws per seed, seeds {seeds}\n")
    print("| step size | Pearson r | Spearman ρ | sign agreement | mean measured ΔH |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for lr in (0.01, 0.05, 0.2):
        corr, rank, agree, mean = [], [], [], []
        for seed in seeds:
            predicted, measured = bandit(ESTIMATORS["GRPO"], draws, lr, seed)
            corr.append(float(torch.corrcoef(torch.stack([predicted, measured]))[0, 1]))
            ranks = torch.stack([predicted.argsort().argsort(), measured.argsort().argsort()])
            rank.append(float(torch.corrcoef(ranks.double())[0, 1]))
            big = measured.abs() > 1e-6
            agree.append(float((predicted.sign() == measured.sign())[big].float().mean()))
            mean.append(float(measured.mean()))
        print(
            f"| {lr} | {mean_std(corr)} | {mean_std(rank)} | {mean_std(agree)} | {mean_std(mean)} |"
        )
        results["theory"].append(
            {
                "lr": lr,
                "pearson_r": corr,
                "spearman_rho": rank,
                "sign_agreement": agree,
                "mean_delta_h": mean,
            }
        )

    print("\n## Mean measured entropy change per step, by advantage estimator (step size 0.01)\n")
    print("| estimator | mean ΔH | minus GRPO's |")
    print("| --- | ---: | ---: |")
    base = [float(bandit(ESTIMATORS["GRPO"], draws, 0.01, s)[1].mean()) for s in seeds]
    for name, estimator in ESTIMATORS.items():
        values = [float(bandit(estimator, draws, 0.01, s)[1].mean()) for s in seeds]
        diffs = [v - b for v, b in zip(values, base, strict=True)]
        print(f"| {name} | {mean_std(values)} | {mean_std(diffs)} |")
        results["modulation"].append(
            {"estimator": name, "mean_delta_h": values, "minus_grpo": diffs}
        )


def cost(results: dict, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = (torch.rand(64, 8, generator=gen) < 0.4).float()
    surprisal = torch.rand(64, 8, generator=gen)
    timings = {}
    for name, fn in (
        ("grpo_advantages", lambda: grpo_advantages(rewards)),
        ("aem_advantages", lambda: aem_advantages(rewards, surprisal)),
    ):
        fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        timings[name] = statistics.median(samples) * 1e6
    ratio = timings["aem_advantages"] / timings["grpo_advantages"]
    print(f"\n## Cost on a (64, 8) batch ({torch.get_num_threads()} threads)\n")
    print("| function | median µs | ratio to GRPO |")
    print("| --- | ---: | ---: |")
    for name, micro in timings.items():
        print(f"| {name} | {micro:.1f} | {micro / timings['grpo_advantages']:.2f} |")
    results["cost_us"] = timings
    results["cost_ratio"] = ratio


def _read_runs(sweep: Path) -> dict[str, list[dict[str, list[tuple[float, float]]]]]:
    """Per variant, per seed: (sampled tokens, value) series of held-out success and entropy.

    The success curve is the module's own record (``on_policy_progress`` in the run's last
    checkpoint: exact token counts); the entropy comes from the CSV log of every RL step.
    """
    runs: dict[str, list] = defaultdict(list)
    for metrics_csv in sorted(sweep.glob("runs/*/seed_*/**/metrics.csv")):
        run_dir = sweep / "runs" / Path(*metrics_csv.relative_to(sweep / "runs").parts[:2])
        series: dict[str, list[tuple[float, float]]] = {
            "success": [],
            "entropy": [],
            "train_success": [],
        }
        with metrics_csv.open() as f:
            for row in csv.DictReader(f):
                if row.get("train/sampled_tokens") and row.get("train/response_entropy"):
                    tokens = float(row["train/sampled_tokens"])
                    series["entropy"].append((tokens, float(row["train/response_entropy"])))
                    series["train_success"].append((tokens, float(row["train/success"])))
        checkpoint = run_dir / "checkpoints" / "last.ckpt"
        if checkpoint.is_file():
            progress = torch.load(checkpoint, map_location="cpu", weights_only=False)
            curve = progress.get("on_policy_progress", {}).get("curve", [])
            series["success"] = [(float(t), float(v)) for t, v in curve]
        runs[run_dir.parent.name].append(series)
    return runs


def _band(series: list[list[tuple[float, float]]], grid: list[float]):
    curves = []
    for points in series:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        curves.append([_interp(x, xs, ys) for x in grid])
    mean = [statistics.mean(c[i] for c in curves) for i in range(len(grid))]
    if len(curves) < 2:
        return mean, mean, mean
    t = T95.get(len(curves) - 1, 1.96)
    half = [
        t * statistics.stdev(c[i] for c in curves) / math.sqrt(len(curves))
        for i in range(len(grid))
    ]
    return (
        mean,
        [m - h for m, h in zip(mean, half, strict=True)],
        [m + h for m, h in zip(mean, half, strict=True)],
    )


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / max(xs[i] - xs[i - 1], 1e-9)
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


def _ci(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3g}" if values else "–"
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{statistics.mean(values):.3g} ± {half:.2g}"


def _thirds(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Mean value over the first and over the last third of a per-step series."""
    third = max(1, len(points) // 3)
    return (
        statistics.mean(v for _, v in points[:third]),
        statistics.mean(v for _, v in points[-third:]),
    )


def _crossing(points: list[tuple[float, float]], level: float = 0.5, window: int = 5) -> float:
    """Sampled tokens at which the ``window``-step moving mean first reaches ``level`` (nan: never)."""
    for i in range(window, len(points) + 1):
        if statistics.mean(v for _, v in points[i - window : i]) >= level:
            return points[i - 1][0]
    return math.nan


def premise_table(sweep: Path, results: dict) -> None:
    """Does the run reach the regime AEM's schedule is about: success past 50%, entropy falling?"""
    runs = _read_runs(sweep)
    print("\n## Premise: training success and response entropy (mean ± std over seeds)\n")
    print(
        "| variant | seeds | train success, first third | last third | tokens to 50% "
        "(5-step mean; runs that got there) | entropy, first third | last third | drop |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for variant, seeds in sorted(runs.items()):
        seeds = [s for s in seeds if s["train_success"]]
        if not seeds:
            continue
        success = [_thirds(s["train_success"]) for s in seeds]
        entropy = [_thirds(s["entropy"]) for s in seeds]
        crossings = [_crossing(s["train_success"]) for s in seeds]
        reached = [c for c in crossings if not math.isnan(c)]
        drops = [1 - late / early for early, late in entropy]
        print(
            f"| {variant} | {len(seeds)} | {mean_std([a for a, _ in success])} "
            f"| {mean_std([b for _, b in success])} "
            f"| {mean_std(reached) if reached else '–'} ({len(reached)}/{len(seeds)}) "
            f"| {mean_std([a for a, _ in entropy])} | {mean_std([b for _, b in entropy])} "
            f"| {mean_std([100 * d for d in drops])} % |"
        )
        results["premise"][variant] = {
            "train_success_thirds": success,
            "tokens_to_half": crossings,
            "entropy_thirds": entropy,
        }


def paired_table(sweep: Path, results: dict) -> None:
    runs = json.loads((sweep / "results.json").read_text())["runs"]
    by = defaultdict(dict)
    for run in runs:
        if run["status"] == "ok":
            by[run["variant"]][run["seed"]] = run["metrics"]
    names = sorted({k for m in by.get("grpo", {}).values() for k in m if k.startswith("val/")})
    names += ["train/response_entropy_early", "train/response_entropy_late"]
    print("\n## Sweep: mean ± 95% t-interval over seeds; paired difference to GRPO\n")
    print(
        "| metric | "
        + " | ".join(by)
        + " | "
        + " | ".join(f"{v} − grpo" for v in by if v != "grpo")
        + " |"
    )
    print("| --- |" + " ---: |" * (2 * len(by) - 1))
    for name in names:
        cells = [
            _ci([m[name] for m in seeds.values() if m.get(name) is not None])
            for seeds in by.values()
        ]
        diffs = []
        for variant, seeds in by.items():
            if variant == "grpo":
                continue
            paired = [
                seeds[s][name] - by["grpo"][s][name]
                for s in seeds
                if s in by["grpo"]
                and seeds[s].get(name) is not None
                and by["grpo"][s].get(name) is not None
            ]
            diffs.append(_ci(paired))
            results["paired"].setdefault(variant, {})[name] = paired
        print(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(diffs) + " |")


def curves(sweep: Path, out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _read_runs(sweep)
    if not runs:
        print(f"\nno CSV logs under {sweep}/runs; skipped the curves")
        return
    for key, label, name in (
        ("success", "held-out success (sampled)", "aem_success_curve.png"),
        ("entropy", "response-level entropy (nats/response)", "aem_entropy_curve.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for variant, seeds in sorted(runs.items()):
            series = [s[key] for s in seeds if s[key]]
            if not series:
                continue
            end = min(p[-1][0] for p in series)
            grid = [end * i / 40 for i in range(41)]
            mean, low, high = _band(series, grid)
            ax.plot(grid, mean, label=f"{variant} (n={len(series)})")
            ax.fill_between(grid, low, high, alpha=0.2)
            results["curves"].setdefault(variant, {})[key] = {"tokens": grid, "mean": mean}
        ax.set_xlabel("sampled response tokens")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        print(f"wrote {out / name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer draws and seeds")
    parser.add_argument("--out", type=Path, default=Path("bench_out/aem"))
    parser.add_argument("--curves", type=Path, default=None, help="an ada sweep output folder")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"theory": [], "modulation": [], "curves": {}, "paired": {}, "premise": {}}
    start = time.perf_counter()
    seeds = [0] if args.quick else [0, 1, 2]
    theory_check(500 if args.quick else 2000, seeds, results)
    cost(results, 200 if args.quick else 2000)
    if args.curves is not None:
        premise_table(args.curves, results)
        curves(args.curves, args.out, results)
        paired_table(args.curves, results)
    print(f"\nelapsed: {time.perf_counter() - start:.1f} s")
    (args.out / "aem.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
