"""Reliability layer: the closed forms against the library's operators, and the router sweep.

What is measured (issue 25, mini reproduction):

1. **Closed forms** (``--closed-forms``, the default when no ``--sweep`` is given), part (b):
   Monte-Carlo runs of the library's own channels and operators
   (:mod:`ada_modules.reliability`) against the formulas of
   :mod:`ada_modules.reliability.closed_forms`. Every cell has its own seeded generator, so the
   numbers are deterministic; each table prints its ``N`` and the Monte-Carlo standard error.

   (i) Majority vote: :class:`DiversityCombining` ``(K)`` on a :class:`SimulatedChannel` with one
       distractor and no correlation, against :func:`majority_vote_accuracy`; then ``K = 9``,
       ``p = 0.65`` with correlated samples, beside :func:`effective_samples` (no formula is
       claimed for correlated votes beyond ``n_eff``).
   (ii) Uniform vs weighted averaging (numpy; not an operator): ``K = 5`` estimates of variances
        ``(0.5, 1, 2, 4, 8)``, noisy inverse-variance weights ``u + delta`` with
        ``Cov(delta) = tau^2 (I - 11^T/K)``, against :func:`weighted_mse`, :func:`uniform_mse` and
        the threshold :func:`averaging_threshold`; the empirical crossover ``tau^2 / tau*^2``.
   (iii) Generator-critic: :class:`GeneratorCritic` with a :class:`SimulatedCritic` (keep ``a``,
         fix ``b``), against :func:`refinement_accuracy`, :func:`refinement_helps` and
         :func:`refinement_fixed_point`.
   (iv) Rateless vs fixed-``K`` majority: :class:`RatelessSampling` ``(K, 0.95)`` against
        :class:`DiversityCombining` ``(K)`` on items of accuracy uniform in [0.6, 0.8] with two
        distractors; the brief's criterion (at least 2x fewer samples at no more than 1 point of
        accuracy lost) is reported as it comes out, not tuned.

2. **Router sweep** (``--sweep DIR``, a finished
   ``ada sweep cli_configs/reliability/repro.yaml``), part (a): per variant the mean ± std over
   the seeds of the study's metrics (``router_cost_ratio`` over the seeds where the router reached
   the matched quality only); the premise table of one run (seed 0 of ``knn15``: every fixed
   option's test quality and cost, the empirical Pareto front, the bucket winners); and with
   ``--out`` the figure ``reliability_frontier.png`` (seed 0: the fixed options, each variant's
   router frontier and the bucket oracle's).

Run it::

    .venv/bin/python bench/reliability.py                 # closed forms, ~25 s on 2 cores
    .venv/bin/python bench/reliability.py --quick         # closed forms at tiny N, a few seconds
    .venv/bin/python bench/reliability.py --sweep sweeps/reliability \\
        --out docs/techniques/img/reliability

Reports only; no assertion.
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ada_modules.reliability import (
    DiversityCombining,
    FixedOption,
    GeneratorCritic,
    RatelessSampling,
    SimulatedChannel,
    SimulatedCritic,
    averaging_threshold,
    effective_samples,
    inverse_variance_mse,
    majority_vote_accuracy,
    pareto_front,
    refinement_accuracy,
    refinement_fixed_point,
    refinement_helps,
    rounds_to_converge,
    uniform_mse,
    weighted_mse,
)

VOTE_P = (0.55, 0.6, 0.7, 0.8)
VOTE_K = (1, 3, 5, 9)
CORRELATED = {"p": 0.65, "k": 9, "rho": (0.0, 0.2, 0.5)}
SIGMA2 = (0.5, 1.0, 2.0, 4.0, 8.0)
TAU_RATIOS = (0.25, 0.5, 0.9, 1.0, 1.1, 2.0, 4.0)
# (p0, a, b): helps, hurts, helps, oscillates (a < b) and lands on a higher accuracy
CRITIC_CASES = ((0.4, 0.9, 0.3), (0.8, 0.7, 0.2), (0.6, 0.95, 0.4), (0.3, 0.2, 0.9))
CRITIC_ROUNDS = (0, 1, 2, 3, 5)
RATELESS_K = (16, 40)
RATELESS_CONFIDENCE = 0.95
SIZES = {  # Monte-Carlo trials per cell
    "full": {"vote": 20_000, "average": 1_000_000, "critic": 16_000, "rateless": 8_000},
    "quick": {"vote": 400, "average": 20_000, "critic": 400, "rateless": 200},
}
METRICS = (
    "router_cost_ratio",
    "router_quality_gain",
    "router_gain_over_single",
    "router_pareto_gain_min",
    "router_pareto_gain_mean",
    "router_pareto_unreached",
    "bucket_oracle_cost_ratio",
    "bucket_winners",
    "best_fixed_quality",
    "best_fixed_cost",
)
REAL_MODEL_VARIANT = "lm"  # part (c): a real model as the channel
PREMISE_VARIANT = "knn15"
PLOT_COLORS = {  # the variants drawn in the figure
    "blind": "tab:gray",
    "knn5": "tab:orange",
    "knn15": "tab:blue",
    "knn50": "tab:green",
    "knn150_labelled3000": "tab:red",
}


# ----------------------------------------------------------------------------- Monte Carlo helpers


def _run(operator, channel: SimulatedChannel, seed: int) -> list:
    """The operator's outcome on every item of ``channel`` (one trial per item), seeded."""
    generator = torch.Generator().manual_seed(seed)
    return [operator(channel, item, truth=0, generator=generator) for item in range(len(channel))]


def _accuracy(outcomes: list) -> tuple[float, float]:
    """Fraction correct and its binomial standard error."""
    n = len(outcomes)
    acc = sum(outcome.is_correct(0) for outcome in outcomes) / n
    return acc, math.sqrt(max(acc * (1 - acc), 1 / n) / n)


def _pts(value: float) -> str:
    """A probability difference in percentage points, signed."""
    return f"{100 * value:+.2f}"


# ----------------------------------------------------------------------------- (i) majority vote


def majority_vote(n: int) -> dict:
    print(f"\n### (i) Majority vote vs the binomial formula (N = {n:,} items per cell)\n")
    print(
        "DiversityCombining(K) on SimulatedChannel(accuracy=[p]*N, num_distractors=1, "
        "correlation=0); formula majority_vote_accuracy(p, K, ties='half') (odd K never ties; "
        "'half' is also what plurality's first-sampled tie-break gives with one distractor).\n"
    )
    print("| p | K | MC accuracy ± SE | formula | MC − formula (points) | z |")
    print("|---|---|---|---|---|---|")
    rows = []
    for i, p in enumerate(VOTE_P):
        channel = SimulatedChannel([p] * n, num_distractors=1, correlation=0.0)
        for j, k in enumerate(VOTE_K):
            acc, se = _accuracy(_run(DiversityCombining(k), channel, seed=100 + 10 * i + j))
            formula = majority_vote_accuracy(p, k, ties="half")
            rows.append({"p": p, "k": k, "mc": acc, "se": se, "formula": formula})
            print(
                f"| {p} | {k} | {acc:.4f} ± {se:.4f} | {formula:.4f} | {_pts(acc - formula)} | "
                f"{(acc - formula) / se:+.1f} |"
            )
    worst = max(rows, key=lambda r: abs(r["mc"] - r["formula"]))
    gap = abs(worst["mc"] - worst["formula"])
    print(
        f"\nLargest |MC − formula|: {100 * gap:.2f} points (p = {worst['p']}, K = {worst['k']}; "
        f"SE there {100 * worst['se']:.2f} points). Criterion (within 1 point): "
        f"{'holds' if gap <= 0.01 else 'fails'}."
    )

    p, k = CORRELATED["p"], CORRELATED["k"]
    print(
        f"\nCorrelated samples: K = {k}, p = {p}, one distractor, N = {n:,} items per row. "
        f"Independent-vote formula at K = {k}: {majority_vote_accuracy(p, k):.4f}; one sample: "
        f"{p}.\n"
    )
    print("| rho | n_eff = effective_samples(9, rho) | MC accuracy ± SE | gain over one sample |")
    print("|---|---|---|---|")
    correlated = []
    for i, rho in enumerate(CORRELATED["rho"]):
        channel = SimulatedChannel([p] * n, num_distractors=1, correlation=rho)
        acc, se = _accuracy(_run(DiversityCombining(k), channel, seed=200 + i))
        n_eff = effective_samples(k, rho)
        correlated.append({"rho": rho, "n_eff": n_eff, "mc": acc, "se": se})
        print(f"| {rho} | {n_eff:.2f} | {acc:.4f} ± {se:.4f} | {_pts(acc - p)} points |")
    return {"independent": rows, "max_gap": gap, "correlated": correlated}


# ----------------------------------------------------------------------------- (ii) averaging


def averaging(n: int) -> dict:
    sigma2 = np.asarray(SIGMA2)
    k = len(SIGMA2)
    threshold = averaging_threshold(SIGMA2)
    print(
        f"\n### (ii) Uniform vs weighted averaging (K = {k}, sigma² = {SIGMA2}, "
        f"N = {n:,} draws, the same draws for every row)\n"
    )
    print(
        f"tau*² = averaging_threshold(sigma²) = {threshold:.5f}; uniform_mse = "
        f"{uniform_mse(SIGMA2):.4f}, inverse_variance_mse = {inverse_variance_mse(SIGMA2):.4f}. "
        "Estimates x_k = theta + e_k, e_k ~ N(0, sigma_k²); weights w = u + delta, u the oracle "
        "inverse-variance weights, delta = tau (z - mean z), z ~ N(0, I), so "
        "Cov(delta) = tau² (I - 11ᵀ/K).\n"
    )
    rng = np.random.default_rng(7)
    errors = rng.standard_normal((n, k)) * np.sqrt(sigma2)
    z = rng.standard_normal((n, k))
    noise = ((z - z.mean(1, keepdims=True)) * errors).sum(1)  # delta^T e / tau
    oracle = errors @ ((1 / sigma2) / (1 / sigma2).sum())
    uniform_sq = errors.mean(1) ** 2
    mc_uniform = float(uniform_sq.mean())
    se_uniform = float(uniform_sq.std() / math.sqrt(n))
    print(
        "| tau²/tau*² | tau² | MC weighted MSE ± SE | weighted_mse | MC / formula − 1 | "
        "MC uniform MSE | MC weighted − uniform ± SE | better (MC) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for ratio in TAU_RATIOS:
        tau2 = ratio * threshold
        weighted_sq = (oracle + math.sqrt(tau2) * noise) ** 2
        diff = weighted_sq - uniform_sq
        row = {
            "ratio": ratio,
            "tau2": tau2,
            "mc": float(weighted_sq.mean()),
            "se": float(weighted_sq.std() / math.sqrt(n)),
            "formula": weighted_mse(SIGMA2, tau2),
            "diff": float(diff.mean()),
            "diff_se": float(diff.std() / math.sqrt(n)),
        }
        rows.append(row)
        better = "weighted" if row["diff"] < 0 else "uniform"
        print(
            f"| {ratio} | {tau2:.5f} | {row['mc']:.4f} ± {row['se']:.4f} | "
            f"{row['formula']:.4f} | {row['mc'] / row['formula'] - 1:+.2%} | {mc_uniform:.4f} | "
            f"{row['diff']:+.4f} ± {row['diff_se']:.4f} | {better} |"
        )
    crossover, crossover_se = math.nan, math.nan
    for lo, hi in zip(rows, rows[1:], strict=False):
        if lo["diff"] < 0 <= hi["diff"]:
            slope = (hi["diff"] - lo["diff"]) / (hi["ratio"] - lo["ratio"])
            crossover = lo["ratio"] - lo["diff"] / slope
            near = lo if crossover - lo["ratio"] < hi["ratio"] - crossover else hi
            crossover_se = near["diff_se"] / slope  # delta method
            break
    worst = max(abs(r["mc"] / r["formula"] - 1) for r in rows)
    print(
        f"\nMC uniform MSE {mc_uniform:.4f} ± {se_uniform:.4f} (formula "
        f"{uniform_mse(SIGMA2):.4f}). Largest |MC / weighted_mse − 1|: {worst:.2%}. Empirical "
        f"crossover (weighted MSE = uniform MSE, linear interpolation between the bracketing "
        f"rows): tau²/tau*² = {crossover:.3f} ± {crossover_se:.3f} (delta-method SE); formula: 1. "
        f"Criterion (crossover in [0.9, 1.1]): "
        f"{'holds' if 0.9 <= crossover <= 1.1 else 'fails'}."
    )
    return {
        "threshold": threshold,
        "rows": rows,
        "mc_uniform": mc_uniform,
        "crossover": crossover,
        "crossover_se": crossover_se,
    }


# ----------------------------------------------------------------------------- (iii) refinement


def refinement(n: int) -> dict:
    print(f"\n### (iii) Generator-critic refinement (N = {n:,} items per cell)\n")
    print(
        "GeneratorCritic(t, SimulatedCritic(keep=a, fix=b)) on SimulatedChannel(accuracy=[p0]*N) "
        "(4 distractors). Cells: MC accuracy after t rounds / refinement_accuracy(p0, a, b, t). "
        "p* = refinement_fixed_point(a, b); helps = refinement_helps(p0, a, b); "
        "t(1 pt) = rounds_to_converge(p0, a, b, 0.01).\n"
    )
    header = " | ".join(f"t = {t}" for t in CRITIC_ROUNDS)
    print(f"| p0 | a | b | p* | helps | t(1 pt) | {header} | MC p₁ − p₀ (points) |")
    print("|---|---|---|---|---|---|" + "---|" * len(CRITIC_ROUNDS) + "---|")
    rows = []
    worst = {"gap": 0.0}
    for i, (p0, a, b) in enumerate(CRITIC_CASES):
        channel = SimulatedChannel([p0] * n)
        critic = SimulatedCritic(keep=a, fix=b)
        cells, mc = [], {}
        for j, t in enumerate(CRITIC_ROUNDS):
            acc, se = _accuracy(_run(GeneratorCritic(t, critic), channel, seed=300 + 10 * i + j))
            formula = refinement_accuracy(p0, a, b, t)
            mc[t] = acc
            cells.append(f"{acc:.4f} / {formula:.4f}")
            if abs(acc - formula) > worst["gap"]:
                worst = {"gap": abs(acc - formula), "se": se, "case": (p0, a, b), "t": t}
        helps = refinement_helps(p0, a, b)
        rows.append({"case": (p0, a, b), "helps": helps, "mc": mc})
        print(
            f"| {p0} | {a} | {b} | {refinement_fixed_point(a, b):.4f} | "
            f"{'yes' if helps else 'no'} | {rounds_to_converge(p0, a, b, 0.01)} | "
            + " | ".join(cells)
            + f" | {_pts(mc[1] - mc[0])} |"
        )
    agree = all((r["mc"][1] > r["mc"][0]) == r["helps"] for r in rows)
    print(
        f"\nLargest |MC − formula|: {100 * worst['gap']:.2f} points (p0, a, b = "
        f"{worst['case']}, t = {worst['t']}; SE there {100 * worst['se']:.2f} points). "
        f"Criterion (within 1 point): {'holds' if worst['gap'] <= 0.01 else 'fails'}. "
        f"Sign of the MC change after one round agrees with refinement_helps in every case: "
        f"{'yes' if agree else 'no'}."
    )
    return {"rows": rows, "max_gap": worst["gap"]}


# ----------------------------------------------------------------------------- (iv) rateless


def rateless(n: int) -> dict:
    generator = torch.Generator().manual_seed(400)
    accuracy = 0.6 + 0.2 * torch.rand(n, generator=generator, dtype=torch.float64)
    channel = SimulatedChannel(accuracy, num_distractors=2)
    print(f"\n### (iv) Rateless vs fixed-K majority (N = {n:,} items)\n")
    print(
        f"RatelessSampling(max_samples=K, confidence={RATELESS_CONFIDENCE}) (defaults: "
        "min_samples=2, one sample per call) against DiversityCombining(K), on the same "
        "SimulatedChannel items: accuracy uniform in [0.6, 0.8], 2 Zipf distractors, no "
        "correlation. Criterion: saving ≥ 2x at ≤ 1 point of accuracy lost.\n"
    )
    print(
        "| K | rateless mean samples | saving (K / mean) | rateless accuracy ± SE | "
        "fixed-K accuracy ± SE | loss (points) ± SE | criterion |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for i, k in enumerate(RATELESS_K):
        adaptive = _run(RatelessSampling(k, RATELESS_CONFIDENCE), channel, seed=410 + i)
        fixed = _run(DiversityCombining(k), channel, seed=420 + i)
        acc_r, se_r = _accuracy(adaptive)
        acc_f, se_f = _accuracy(fixed)
        mean_samples = statistics.fmean(outcome.samples for outcome in adaptive)
        saving = k / mean_samples
        loss, loss_se = acc_f - acc_r, math.hypot(se_r, se_f)
        holds = saving >= 2 and loss <= 0.01
        rows.append({"k": k, "mean_samples": mean_samples, "saving": saving, "loss": loss})
        print(
            f"| {k} | {mean_samples:.2f} | {saving:.2f}x | {acc_r:.4f} ± {se_r:.4f} | "
            f"{acc_f:.4f} ± {se_f:.4f} | {100 * loss:+.2f} ± {100 * loss_se:.2f} | "
            f"{'holds' if holds else 'fails'} ({'≥' if saving >= 2 else '<'} 2x, "
            f"{'≤' if loss <= 0.01 else '>'} 1 pt) |"
        )
    return {"rows": rows}


def closed_forms(quick: bool) -> dict:
    sizes = SIZES["quick" if quick else "full"]
    print(
        f"\n## 1. Closed forms against the library's operators "
        f"({'--quick sizes, a smoke test: its verdicts mean nothing at this N; ' if quick else ''}"
        f"torch threads: {torch.get_num_threads()})"
    )
    result = {}
    for name, section in (
        ("vote", majority_vote),
        ("average", averaging),
        ("critic", refinement),
        ("rateless", rateless),
    ):
        start = time.perf_counter()
        result[name] = section(sizes[name])
        print(f"\n({name}: {time.perf_counter() - start:.1f} s)")
    return result


# ----------------------------------------------------------------------------- 2. router sweep


def _summary(values: list[float], digits: int = 3) -> str:
    if not values:
        return "–"
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _pareto(fixed: list[dict]) -> set[str]:
    """Names of the fixed options (frontier.json's dicts) on the study's Pareto front."""
    return {option.name for option in pareto_front([FixedOption(**f) for f in fixed])}


def sweep_tables(sweep: Path, out: Path | None) -> dict:
    results = json.loads((sweep / "results.json").read_text())
    runs = results["runs"]
    variants = list(dict.fromkeys(run["variant"] for run in runs))
    ok = {v: [r for r in runs if r["variant"] == v and r["status"] == "ok"] for v in variants}
    total = {v: sum(r["variant"] == v for r in runs) for v in variants}
    print(f"\n## 2. Router sweep: {sweep} (mean ± std over the ok seeds)\n")
    print(
        "test/router_cost_ratio is averaged over the matched seeds only (those where some lambda "
        "reached the best fixed quality − 0.01; it is NaN in the others), with the count beside "
        "it. Qualities and gains are fractions of items (0.01 = 1 point); costs in cost units "
        "(one small-model sample = 1).\n"
    )
    print("| metric | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    print("| seeds ok | " + " | ".join(f"{len(ok[v])}/{total[v]}" for v in variants) + " |")
    table: dict = {v: {} for v in variants}
    for metric in METRICS:
        cells = []
        for v in variants:
            values = [r["metrics"].get(f"test/{metric}", math.nan) for r in ok[v]]
            finite = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
            table[v][metric] = {"values": values, "finite": len(finite)}
            cell = _summary(finite, 2 if metric in ("bucket_winners", "best_fixed_cost") else 3)
            if metric.endswith("cost_ratio"):
                cell += f" (matched in {len(finite)}/{len(values)} seeds)"
            elif len(finite) < len(values):  # NaN in some seeds: say over how many
                cell += f" ({len(finite)}/{len(values)} seeds defined)"
            cells.append(cell)
        print(f"| {metric} | " + " | ".join(cells) + " |")

    reference = PREMISE_VARIANT if PREMISE_VARIANT in ok else variants[0]
    best = []
    for run in sorted(ok[reference], key=lambda r: r["seed"]):
        frontier = _frontier(sweep, run)
        name = frontier["best_fixed"] if frontier else "?"
        metrics = run["metrics"]
        best.append(
            f"seed {run['seed']}: {name} ({metrics['test/best_fixed_quality']:.3f} at "
            f"{metrics['test/best_fixed_cost']:.2f})"
        )
    print(
        "\nBest fixed option per seed (the same in every simulated variant of a seed): "
        + "; ".join(best)
    )
    if REAL_MODEL_VARIANT in ok:
        _real_model_options(ok[REAL_MODEL_VARIANT], sweep)

    frontiers = {}
    for v in (v for v in variants if v != REAL_MODEL_VARIANT):
        seed0 = [r for r in ok[v] if r["seed"] == 0]
        if seed0 and (frontier := _frontier(sweep, seed0[0])) is not None:
            frontiers[v] = frontier
    if PREMISE_VARIANT in frontiers:
        _premise(frontiers)
    if out is not None and frontiers:
        _plot_frontier(frontiers, out / "reliability_frontier.png")
    return {"table": table}


def _real_model_options(runs: list[dict], sweep: Path) -> None:
    """Part (c): each option's held-out quality and token cost on the tiny LM, over the seeds."""
    names = [o["name"] for o in (_frontier(sweep, runs[0]) or {"fixed": []})["fixed"]]
    print(
        f"\n### Part (c): the operators on the tiny LM ({REAL_MODEL_VARIANT}; mean ± std over "
        f"{len(runs)} seeds; cost = generated tokens per item)\n"
    )
    print("| option | test quality | test cost (tokens) | best fixed in |")
    print("|---|---|---|---|")
    best = [(_frontier(sweep, run) or {}).get("best_fixed") for run in runs]
    for name in names:
        quality = [run["metrics"][f"test/quality/{name}"] for run in runs]
        cost = [run["metrics"][f"test/cost/{name}"] for run in runs]
        print(
            f"| {name} | {_summary(quality)} | {_summary(cost, 1)} | "
            f"{best.count(name)}/{len(runs)} seeds |"
        )


def _frontier(sweep: Path, run: dict) -> dict | None:
    """The run's ``frontier.json`` (looked up under ``sweep`` if the folder has moved)."""
    path = Path(run["run_dir"]) / "study" / "frontier.json"
    if not path.exists():
        path = sweep / "runs" / run["variant"] / f"seed_{run['seed']}" / "study" / "frontier.json"
    return json.loads(path.read_text()) if path.exists() else None


def _premise(frontiers: dict) -> None:
    frontier = frontiers[PREMISE_VARIANT]
    fixed = sorted(frontier["fixed"], key=lambda f: (f["cost"], -f["quality"]))
    front = _pareto(fixed)
    winners = frontier["bucket_winners"]
    target = max(f["quality"] for f in fixed) - 0.01
    same = all(f["fixed"] == frontier["fixed"] for f in frontiers.values())
    print(
        f"\n### Premise: the fixed options of seed 0 ({PREMISE_VARIANT}; the fixed options are "
        f"{'the same' if same else 'NOT the same'} in every variant of the seed), by cost\n"
    )
    print(
        f"Pareto: no other option is as good for less. Best fixed: the cheapest option within "
        f"0.01 of the highest quality (target {target:.3f}).\n"
    )
    print("| option | test quality | test cost | Pareto front | note |")
    print("|---|---|---|---|---|")
    for f in fixed:
        notes = []
        if f["name"] == frontier["best_fixed"]:
            notes.append("best fixed")
        buckets = [str(b) for b, w in enumerate(winners) if w == f["name"]]
        if buckets:
            notes.append(f"bucket winner ({', '.join(buckets)})")
        print(
            f"| {f['name']} | {f['quality']:.3f} | {f['cost']:.2f} | "
            f"{'yes' if f['name'] in front else ''} | {'; '.join(notes)} |"
        )
    print(
        "\nBucket winners (per difficulty bucket, easiest first; the cheapest option within 0.01 "
        "of the bucket's best quality on the labelled items): "
        + ", ".join(f"bucket {b}: {w}" for b, w in enumerate(winners))
        + f" ({len(set(winners))} distinct)."
    )


def _plot_frontier(frontiers: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    reference = frontiers.get(PREMISE_VARIANT, next(iter(frontiers.values())))
    fixed = reference["fixed"]
    front = _pareto(fixed)
    target = max(f["quality"] for f in fixed) - 0.01
    markers = {"small": "o", "medium": "s", "large": "^"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, zoom in zip(axes, (False, True), strict=True):
        for variant, color in PLOT_COLORS.items():
            if variant not in frontiers:
                continue
            points = sorted((p["cost"], p["quality"]) for p in frontiers[variant]["router"])
            cost, quality = zip(*points, strict=True)
            ax.plot(
                cost, quality, "-o", color=color, markersize=3.5, linewidth=1.4,
                label=f"router {variant}", zorder=3,
            )  # fmt: skip
        oracle = sorted((p["cost"], p["quality"]) for p in reference["bucket_oracle"])
        cost, quality = zip(*oracle, strict=True)
        ax.plot(
            cost, quality, "--", color="black", linewidth=1.3,
            label="bucket oracle (300 labelled)", zorder=3,
        )  # fmt: skip
        ax.axhline(
            target, color="tab:purple", linestyle=":", linewidth=1,
            label="matched quality (best fixed − 0.01)",
        )  # fmt: skip
        for f in fixed:
            on_front = f["name"] in front
            ax.plot(
                f["cost"], f["quality"], markers.get(f["name"].split("_")[0], "o"),
                color="black" if on_front else "0.6", markersize=6.5 if on_front else 5.5,
                markeredgecolor="white", markeredgewidth=0.6, zorder=5,
            )  # fmt: skip
            if zoom or on_front:
                ax.annotate(
                    f["name"], (f["cost"], f["quality"]), fontsize=6.5,
                    xytext=(4, -9), textcoords="offset points", color="0.2", zorder=6,
                )  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("mean cost per query (log scale; one small-model sample = 1)")
        ax.set_ylabel("test quality (fraction correct)")
        ax.grid(alpha=0.3, which="both")
        if zoom:
            ax.set_xlim(4, 300)
            ax.set_ylim(0.84, 1.0)
            ax.set_title("zoom on the high-quality end")
        else:
            ax.set_title("all fixed options and router frontiers")
    axes[0].legend(fontsize=7.5, loc="lower right")
    fixed_legend = [
        Line2D([], [], marker=marker, linestyle="", color="0.6", label=f"fixed: {name} model")
        for name, marker in markers.items()
    ]
    fixed_legend.append(
        Line2D([], [], marker="o", linestyle="", color="black", label="fixed, on the Pareto front")
    )
    axes[1].legend(handles=fixed_legend, fontsize=7.5, loc="lower right")
    fig.suptitle(
        "Reliability layer, seed 0: kNN router frontiers (one point per λ) vs the 19 fixed options",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--closed-forms",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="section 1 (default: on unless --sweep is given)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny Monte-Carlo sizes (smoke test)")
    parser.add_argument("--sweep", type=Path, default=None, help="a finished repro sweep folder")
    parser.add_argument("--out", type=Path, default=None, help="folder for the sweep's figure")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.closed_forms or (args.closed_forms is None and args.sweep is None):
        closed_forms(args.quick)
    if args.sweep is not None:
        sweep_tables(args.sweep, args.out)
    print(f"\n(total {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
