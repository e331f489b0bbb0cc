"""AIQL / A²IQL (issue 24) on CPU: training-step cost at large candidate counts, and the mini
reproduction's tables and plots.

**Without --sweep** (in-process, one thread): the wall-clock cost of one training step of
:class:`~ada_modules.models.CandidateSelectionModule` as the candidate pool grows. Pools are real
simulator states, ``ConsolidationSimulator(min_candidates=N, max_candidates=N).reset(B)`` (every
row holds exactly N open orders), with ``candidate_features``; the logged picks are the top 8 of
the ``edd`` scores plus Gumbel noise. One timed step is, in this order: ``zero_grad``; the critic's
aggregate inputs ``state_summary`` of the ``[B, N, 9]`` pool and ``action_summary`` of the picks
(recomputed inside the step so that the O(N log N) pooling is counted; the next state's summary is
precomputed, as a log stores it); ``CandidateSelectionModule.training_step`` on that batch dict
(its ``log``/``log_dict`` replaced by no-ops, since no Trainer is attached); and ``backward`` of
the summed actor + value + Q losses. Not timed: the optimizer step and the Polyak update. Arms,
all with ``hidden=32``: BC (``critic="none"``), IQL (``"per_candidate"``), AIQL
(``"aggregate"``) and AIQL with ``num_negatives=64`` (the Plackett–Luce normaliser over the picks
plus 64 sampled others; the actor still scores all N candidates, which its DeepSets context needs).
N = 200, 1000, 5000 at batch 64 (``--quick``: N = 100, 400 at batch 16, fewer repeats); the arms
are timed round-robin (A, B, C, D, A, ...) after a warm-up. The table gives the median
milliseconds per step, each arm's ratio to BC, and the summaries' own median time and its share
of the AIQL step. ``--out DIR`` also writes ``DIR/aiql_timing.json``.

**With --sweep DIR** (the output of ``ada sweep cli_configs/aiql/repro.yaml --out DIR``; reads
``DIR/results.json`` and the runs' CSV logs; nothing is run): two tables, mean ± std over seeds,
"–" where an arm or a seed is missing.

1. Source objective: test/return_source (mean reward per decision epoch on the test episodes) of
   BC, IQL and AIQL; the behaviour heuristics edd, volume, zone, random and the reward-aware
   reference greedy_source, from the runs' logged ``test/<h>_return_source`` (every run of a seed
   rolls the heuristics out on the same episodes: per seed the mean over its runs, then mean ± std
   over seeds); each learned arm's relative gain over the best behaviour heuristic of the same
   seed; then AIQL's relative gain over BC and over IQL, per seed (paired), mean ± std.
2. Target objective, per number of target episodes (5, 11, 33 against 1000 source episodes:
   200:1, 90:1, 30:1): test/return_target of source-only AIQL (the same runs in every row),
   pooled, reward-relabelled, A²IQL and A²IQL without the uncertainty penalty; the edd and
   greedy_target references; and A²IQL minus source-only and minus pooled in reward per epoch
   (paired per seed; target returns are negative, so differences, not ratios).

With ``--out DIR2`` it draws ``source_returns.png`` (bars with std error bars, heuristics
included), ``target_returns.png`` (target return vs target episodes, one line per arm, source-only
and the references as horizontal lines) and ``return_curves.png`` (val/return vs training step,
mean over seeds, from ``runs/<variant>/seed_<s>/lightning_logs/version_*/metrics.csv``: BC, IQL,
AIQL on the source objective; the target arms at 33 target episodes). Reports only; no assertion.

    python bench/aiql.py                                     # timing table (about a minute)
    python bench/aiql.py --quick --out /tmp/aiql             # seconds
    python bench/aiql.py --sweep sweeps/aiql --out docs/techniques/img/aiql
"""

import argparse
import csv
import json
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

SOURCE_ARMS = ("bc", "iql", "aiql")
BEHAVIOUR = ("edd", "volume", "zone", "random")
SOURCE_REFERENCES = ("greedy_source",)
TARGET_ARMS = ("source_only", "pooled", "relabel", "a2iql", "a2iql_no_penalty")
TARGET_REFERENCES = ("edd", "greedy_target")
TARGET_EPISODES = (5, 11, 33)
SOURCE_EPISODES = 1000
CURVE_TARGET_EPISODES = 33

# ------------------------------------------------------------------ formatting


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def mean_std(values: list[float | None], digits: int = 2, signed: bool = False) -> str:
    """``mean ± std`` (the value alone for one, "–" for none)."""
    values = _finite(values)
    if not values:
        return "–"
    sign = "+" if signed else ""
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def percent(values: list[float | None]) -> str:
    """Relative gains (fractions) as ``+x.x % ± y.y``."""
    values = _finite(values)
    return "–" if not values else mean_std([100 * v for v in values], 1, signed=True) + " %"


# ------------------------------------------------------------------ timing (no --sweep)


def _synthetic_batch(num_candidates: int, batch: int, seed: int) -> dict[str, Any]:
    """A training batch of real simulator pools of exactly ``num_candidates`` orders."""
    import torch

    from ada_modules.data.consolidation import (
        ConsolidationSimulator,
        candidate_features,
        heuristic_scores,
        select_top_k,
        state_summary,
    )

    sim = ConsolidationSimulator(min_candidates=num_candidates, max_candidates=num_candidates)
    state = sim.reset(batch, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(state.mask.shape, generator=generator).clamp(1e-12, 1 - 1e-7)
    noisy = heuristic_scores(state, "edd") + 3.0 * -torch.log(-torch.log(uniform))
    chosen = select_top_k(noisy, state.mask, sim.pick)
    following = sim.reset(batch, seed=seed + 1)  # stands in for the logged next state
    next_features = candidate_features(following)
    return {
        "candidates": candidate_features(state),
        "mask": state.mask,
        "chosen": chosen,
        "progress": torch.full((batch,), 0.5),
        "reward": torch.randn(batch, generator=generator),
        "next_state": state_summary(next_features, following.mask, torch.full((batch,), 0.55)),
        "done": torch.zeros(batch),
        "domain": torch.zeros(batch, dtype=torch.long),
    }


TIMED_ARMS: dict[str, dict[str, Any]] = {
    "BC": {"critic": "none"},
    "IQL": {"critic": "per_candidate"},
    "AIQL": {"critic": "aggregate"},
    "AIQL, 64 neg.": {"critic": "aggregate", "num_negatives": 64},
}


def _make_step(arm: str, data: dict[str, Any], hidden: int):
    """The timed function of one arm (see the module docstring) and its module."""
    import torch

    from ada_modules.data.consolidation import action_summary, state_summary
    from ada_modules.models import CandidateSelectionModule

    torch.manual_seed(0)
    module = CandidateSelectionModule(hidden=hidden, **TIMED_ARMS[arm])
    module.log = module.log_dict = lambda *args, **kwargs: None  # no Trainer attached
    fixed = {k: v for k, v in data.items() if k != "progress"}

    def step() -> None:
        module.zero_grad(set_to_none=True)
        candidates, mask, chosen = data["candidates"], data["mask"], data["chosen"]
        batch = {
            **fixed,
            "state": state_summary(candidates, mask, data["progress"]),
            "action": action_summary(candidates, chosen),
        }
        module.training_step(batch, 0).backward()

    return step


def _summaries_step(data: dict[str, Any]):
    from ada_modules.data.consolidation import action_summary, state_summary

    def step() -> None:
        state_summary(data["candidates"], data["mask"], data["progress"])
        action_summary(data["candidates"], data["chosen"])

    return step


def timing(quick: bool, out: Path | None) -> None:
    import torch

    torch.set_num_threads(1)
    sizes = (100, 400) if quick else (200, 1000, 5000)
    batch, hidden = (16, 32) if quick else (64, 32)
    print(
        f"## Training-step time vs candidates per pool (batch {batch}, hidden {hidden}, "
        f"pick 8, {torch.get_num_threads()} CPU thread, median of round-robin repeats)\n"
    )
    header = ["N", *TIMED_ARMS, "summaries"]
    print("| " + " | ".join(header) + " |")
    print("| ---: |" + " ---: |" * (len(header) - 1))
    records = []
    for num_candidates in sizes:
        data = _synthetic_batch(num_candidates, batch, seed=num_candidates)
        steps = {arm: _make_step(arm, data, hidden) for arm in TIMED_ARMS}
        steps["summaries"] = _summaries_step(data)
        for step in steps.values():  # warm-up
            step()
        repeats = 5 if quick else max(5, min(20, 20_000 // num_candidates))
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                begin = time.perf_counter()
                step()
                times[name].append(1e3 * (time.perf_counter() - begin))
        median = {name: statistics.median(values) for name, values in times.items()}
        cells = [f"{median['BC']:.2f} ms"]
        for arm in list(TIMED_ARMS)[1:]:
            cells.append(f"{median[arm]:.2f} ms ({median[arm] / median['BC']:.2f}x)")
        share = median["summaries"] / median["AIQL"]
        cells.append(f"{median['summaries']:.2f} ms ({100 * share:.0f} % of AIQL)")
        print(f"| {num_candidates} | " + " | ".join(cells) + " |", flush=True)
        records.append(
            {"candidates": num_candidates, "batch": batch, "hidden": hidden, "repeats": repeats,
             "median_ms": median}
        )  # fmt: skip
    print(
        "\nEach arm's time includes the summaries column (state_summary + action_summary, "
        "recomputed every step); ratios are to BC. The sampled negatives shrink only the "
        "Plackett–Luce normaliser: the actor still embeds every candidate."
    )
    if out is not None:
        (out / "aiql_timing.json").write_text(json.dumps({"quick": quick, "rows": records}))


# ------------------------------------------------------------------ sweep


def load_runs(sweep: Path) -> tuple[dict[str, dict[int, dict[str, float]]], dict]:
    """Per variant, per seed: the run's metrics (failed runs are reported and left out)."""
    path = sweep / "results.json"
    if not path.exists():
        raise SystemExit(f"no results.json in {sweep}")
    data = json.loads(path.read_text())
    runs: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for run in data["runs"]:
        if run["status"] != "ok":
            print(f"not ok: {run['variant']} seed {run['seed']}: {run.get('error')}")
            continue
        runs[run["variant"]][run["seed"]] = run["metrics"]
    return runs, data


def per_seed(runs: dict, variant: str, metric: str) -> dict[int, float]:
    return {
        seed: metrics[metric]
        for seed, metrics in runs.get(variant, {}).items()
        if metrics.get(metric) is not None
    }


def heuristic_per_seed(runs: dict, metric: str) -> dict[int, float]:
    """Per seed, the mean over every run of that seed (they roll out the same episodes)."""
    values: dict[int, list[float]] = defaultdict(list)
    for by_seed in runs.values():
        for seed, metrics in by_seed.items():
            if metrics.get(metric) is not None:
                values[seed].append(metrics[metric])
    for seed, found in values.items():
        if max(found) - min(found) > 1e-3 * max(1.0, abs(found[0])):
            print(f"note: {metric} differs between the runs of seed {seed}: {min(found):.3f} to "
                  f"{max(found):.3f} (their mean is used)")  # fmt: skip
    return {seed: statistics.mean(v) for seed, v in sorted(values.items())}


def paired(a: dict[int, float], b: dict[int, float], relative: bool) -> list[float]:
    """Per shared seed ``a - b`` (or ``(a - b) / |b|``)."""
    return [
        (a[s] - b[s]) / abs(b[s]) if relative else a[s] - b[s]
        for s in sorted(a)
        if s in b and (not relative or b[s] != 0)
    ]


def source_table(runs: dict) -> dict[str, dict[int, float]]:
    print("## Source objective: test return (mean reward per epoch), mean ± std over seeds\n")
    returns: dict[str, dict[int, float]] = {}
    for arm in SOURCE_ARMS:
        returns[arm] = per_seed(runs, arm, "test/return_source")
    for name in (*BEHAVIOUR, *SOURCE_REFERENCES):
        returns[name] = heuristic_per_seed(runs, f"test/{name}_return_source")
    best: dict[int, float] = {}
    for seed in sorted({s for name in BEHAVIOUR for s in returns[name]}):
        seen = [returns[name][seed] for name in BEHAVIOUR if seed in returns[name]]
        best[seed] = max(seen)
    kinds = {"bc": "behaviour cloning", "iql": "IQL, per-candidate critic",
             "aiql": "AIQL, aggregate critic", "greedy_source": "reference (knows the reward)"}  # fmt: skip
    print("| policy | kind | seeds | return (source) | vs best behaviour heuristic, per seed |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, values in returns.items():
        kind = kinds.get(name, "behaviour heuristic")
        gain = percent(paired(values, best, relative=True)) if name in SOURCE_ARMS else ""
        cell = mean_std(list(values.values()))
        print(f"| {name} | {kind} | {len(values)} | {cell} | {gain} |")
    print()
    for a, b in (("aiql", "bc"), ("aiql", "iql"), ("iql", "bc")):
        rel = paired(returns[a], returns[b], relative=True)
        diff = paired(returns[a], returns[b], relative=False)
        print(
            f"- {a.upper()} vs {b.upper()} (paired seeds: {len(diff)}): {percent(rel)}, "
            f"{mean_std(diff, signed=True)} reward per epoch"
        )
    best_names = []
    for seed in best:
        for name in BEHAVIOUR:
            if returns[name].get(seed) == best[seed]:
                best_names.append(f"seed {seed}: {name}")
                break
    print(f"- best behaviour heuristic per seed: {', '.join(best_names) or '–'}\n")
    return returns


def target_table(runs: dict) -> dict[str, dict[int, dict[int, float]]]:
    print(
        "## Target objective: test return (mean reward per epoch; negative), mean ± std over "
        f"seeds, against {SOURCE_EPISODES} source episodes\n"
    )
    source_only = per_seed(runs, "source_only", "test/return_target")
    references = {
        name: heuristic_per_seed(runs, f"test/{name}_return_target") for name in TARGET_REFERENCES
    }
    returns: dict[str, dict[int, dict[int, float]]] = {"source_only": {}}
    for arm in TARGET_ARMS[1:]:
        returns[arm] = {n: per_seed(runs, f"{arm}_{n}", "test/return_target")
                        for n in TARGET_EPISODES}  # fmt: skip
    for n in TARGET_EPISODES:
        returns["source_only"][n] = source_only
    columns = [*TARGET_ARMS, *TARGET_REFERENCES, "A²IQL − source-only", "A²IQL − pooled"]
    print("| target episodes | ratio | " + " | ".join(columns) + " |")
    print("| ---: | ---: |" + " ---: |" * len(columns))
    for n in TARGET_EPISODES:
        cells = [mean_std(list(returns[arm][n].values())) for arm in TARGET_ARMS]
        cells += [mean_std(list(references[name].values())) for name in TARGET_REFERENCES]
        a2iql = returns["a2iql"][n]
        for base in ("source_only", "pooled"):
            cells.append(mean_std(paired(a2iql, returns[base][n], relative=False), signed=True))
        ratio = f"{round(SOURCE_EPISODES / n)}:1"
        print(f"| {n} | {ratio} | " + " | ".join(cells) + " |")
    seeds = {
        arm: sorted({s for by in per_n.values() for s in by}) for arm, per_n in returns.items()
    }
    print(
        "\nSeeds per arm: "
        + ", ".join(f"{arm} {len(found)}" for arm, found in seeds.items())
        + ". Differences are paired per seed (reward per decision epoch; higher is better).\n"
    )
    for name, values in references.items():
        returns[name] = {n: values for n in TARGET_EPISODES}
    return returns


def _curve(run_dir: Path) -> dict[int, float]:
    """``{step: val/return}`` of the run's fit (the last CSV log that has validation rows)."""
    for path in sorted(run_dir.glob("lightning_logs/version_*/metrics.csv"), reverse=True):
        with path.open() as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("val/return")]
        if rows:
            return {int(row["step"]): float(row["val/return"]) for row in rows}
    return {}


def curves(sweep: Path, data: dict, variants: list[str]) -> dict[str, dict[int, list[float]]]:
    from ada_modules.sweep_report import file_name

    found: dict[str, dict[int, list[float]]] = {}
    for run in data["runs"]:
        if run["status"] != "ok" or run["variant"] not in variants:
            continue
        run_dir = sweep / "runs" / file_name(run["variant"]) / f"seed_{run['seed']}"
        if not run_dir.exists() and run.get("run_dir"):
            run_dir = Path(run["run_dir"])
        for step, value in _curve(run_dir).items():
            found.setdefault(run["variant"], defaultdict(list))[step].append(value)
    return found


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _stats(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, 0.0
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def plot_source(returns: dict[str, dict[int, float]], out: Path) -> None:
    plt = _pyplot()
    names = list(returns)
    colours = ["tab:blue" if n in SOURCE_ARMS else "tab:grey" if n in BEHAVIOUR else "tab:green"
               for n in names]  # fmt: skip
    stats = [_stats(list(returns[n].values())) for n in names]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.bar(names, [m for m, _ in stats], yerr=[s for _, s in stats], color=colours, capsize=3)
    for i, name in enumerate(names):
        count = len(returns[name])
        label = f"n={count}" if count else "missing"
        ax.annotate(label, (i, 0), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                    textcoords="offset points")  # fmt: skip
    ax.axhline(0, color="black", linewidth=0.6)
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_ylabel("test return (source), reward per epoch")
    ax.set_title(
        "Source objective: learned (blue), behaviour (grey), reward-aware reference (green)"
    )
    fig.savefig(out / "source_returns.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_target(returns: dict[str, dict[int, dict[int, float]]], out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    horizontal = ("source_only", *TARGET_REFERENCES)
    styles = {"source_only": ("tab:blue", "--"), "edd": ("tab:grey", ":"),
              "greedy_target": ("tab:green", ":")}  # fmt: skip
    for arm, per_n in returns.items():
        if arm in horizontal:
            mean, std = _stats(list(per_n[TARGET_EPISODES[0]].values()))
            if math.isnan(mean):
                continue
            colour, style = styles[arm]
            ax.axhline(mean, color=colour, linestyle=style, label=arm)
            if std:
                ax.axhspan(mean - std, mean + std, color=colour, alpha=0.12)
            continue
        stats = [_stats(list(per_n[n].values())) for n in TARGET_EPISODES]
        if all(math.isnan(m) for m, _ in stats):
            continue
        ax.errorbar(TARGET_EPISODES, [m for m, _ in stats], yerr=[s for _, s in stats],
                    marker="o", capsize=3, label=arm)  # fmt: skip
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xlim(TARGET_EPISODES[0] / 1.5, TARGET_EPISODES[-1] * 1.5)
    ax.set_xticks(
        TARGET_EPISODES, [f"{n}\n({round(SOURCE_EPISODES / n)}:1)" for n in TARGET_EPISODES]
    )
    ax.set_xlabel("target episodes (source:target ratio)")
    ax.set_ylabel("test return (target), reward per epoch")
    ax.set_title("Target objective from scarce target logs")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(out / "target_returns.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_curves(sweep: Path, data: dict, out: Path) -> None:
    target_variants = ["source_only"] + [
        f"{arm}_{CURVE_TARGET_EPISODES}" for arm in TARGET_ARMS[1:]
    ]
    panels = [
        ("source objective", list(SOURCE_ARMS)),
        (f"target objective, {CURVE_TARGET_EPISODES} target episodes", target_variants),
    ]
    found = [(title, curves(sweep, data, variants)) for title, variants in panels]
    found = [(title, by) for title, by in found if by]
    if not found:
        print("no validation curves found (runs/<variant>/seed_<s>/lightning_logs/*/metrics.csv)")
        return
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(found), figsize=(5.5 * len(found), 3.8), squeeze=False)
    for ax, (title, by) in zip(axes[0], found, strict=True):
        for variant, points in by.items():
            steps = sorted(points)
            stats = [_stats(points[s]) for s in steps]
            means = [m for m, _ in stats]
            seeds = max(len(v) for v in points.values())
            ax.plot(steps, means, marker="o", markersize=3, label=f"{variant} ({seeds} seeds)")
            low = [m - s for m, s in stats]
            high = [m + s for m, s in stats]
            ax.fill_between(steps, low, high, alpha=0.15)
        ax.set_xlabel("training step")
        ax.set_ylabel("val/return (mean over seeds)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.savefig(out / "return_curves.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def report_sweep(sweep: Path, out: Path | None) -> None:
    runs, data = load_runs(sweep)
    quick = " (quick profile)" if data.get("quick") else ""
    print(f"# AIQL / A²IQL sweep {sweep}{quick}: {sum(map(len, runs.values()))} runs ok\n")
    source = source_table(runs)
    target = target_table(runs)
    if out is not None:
        plot_source(source, out)
        plot_target(target, out)
        plot_curves(sweep, data, out)
        print(f"plots in {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=Path, default=None, help="output folder of repro.yaml")
    parser.add_argument("--out", type=Path, default=None, help="folder for plots and JSON")
    parser.add_argument("--quick", action="store_true", help="small timing run (seconds)")
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep is not None:
        report_sweep(args.sweep, args.out)
    else:
        timing(args.quick, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
