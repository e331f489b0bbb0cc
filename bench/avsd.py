"""AVSD on CPU: how the pools treat a noisy view, then the mini reproduction's tables and plots.

0. **Pools on synthetic views** (no model, seconds): at 20,000 positions over a 10-token
   vocabulary, three views put most of their mass on the right token (one of them sure, one
   unsure, one in between) and a fourth, noisy view does too except at a fraction ``rho`` of the
   positions, where it is sure of a wrong token. For the arithmetic pool, the geometric pool and
   the adaptive gate (:func:`~ada_modules.posttrain.avsd.avsd_target`, the defaults of
   ``cli_configs/avsd/sorting.yaml``): the target's mass on the right token and on the noisy
   view's wrong token at the corrupted positions, its mass on the right token elsewhere, and the
   gate there and elsewhere.

With ``--sweep SWEEP``, reads the output of ``ada sweep cli_configs/avsd/repro.yaml --out SWEEP``
and prints markdown:

1. **Premise**: success of the warm-started model sampling without a view (``val/success_start``,
   what the student can do) and with each privileged view in its context
   (``val/teacher_success_<view>``, what a teacher can show), mean with a 95% t-interval over seeds.
   Self-distillation can only help where a teacher beats the student.
2. **Arms**: final held-out success (Avg@8), its best and area over the budget, tokens to 70%
   success, and the target diagnostics (gate, disagreement, token weight), mean ± 95% t-interval,
   with the paired difference ``avsd − arm`` per seed (same seed, same warm start).
3. **The noisy view's effect**: ``arith − arith_clean`` and ``avsd − avsd_clean`` (what adding the
   noisy view changes), and their difference, paired by seed.

4. **What a view carries**: each seed's warm start (the sweep's ``sft`` checkpoint) answers its 64
   held-out tasks (8 samples each) after the solution view, after an empty view ``[]``, and after
   the solution of another task: how much of a teacher's lead comes from reading the view's
   content, and how much from having learnt that examples shown after a view are correct.

and writes ``avsd_premise.png`` (bars) and ``avsd_curves.png`` (held-out success against sampled
tokens, mean over seeds with a 95% band, from the success curve each run's last checkpoint holds)
and ``avsd.json`` to ``--out``. Reports only; no assertion on the numbers.

    python bench/avsd.py --sweep sweeps/avsd --out docs/techniques/img/avsd
    python bench/avsd.py --quick      # the synthetic pools only, fewer positions
"""

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from ada_modules.posttrain.avsd import avsd_target

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
VIEWS = ("solution", "partial", "feedback", "noisy")
CURVE_ARMS = ("grpo", "sd_solution", "sd_solution_live", "arith", "geo", "avsd", "avsd_grpo")


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval (0 for one value)."""
    if len(values) < 2:
        return (values[0] if values else math.nan), 0.0
    t = T95.get(len(values) - 1, 1.96)
    return statistics.mean(values), t * statistics.stdev(values) / math.sqrt(len(values))


def fmt(values: list[float], digits: int = 3) -> str:
    mean, half = interval(values)
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f} ± {half:.{digits}f}" if half else f"{mean:.{digits}f}"


def synthetic_views(positions: int, rho: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four views ``(4, positions, 10)`` (log-probabilities) and the noisy view's corruption mask."""
    gen = torch.Generator().manual_seed(seed)
    vocab, right = 10, 0
    views = []
    for confidence in (4.0, 1.5, 2.5, 3.0):  # sure, unsure, in between, the noisy view
        logits = torch.randn(positions, vocab, generator=gen)
        logits[:, right] += confidence
        views.append(logits)
    corrupted = torch.rand(positions, generator=gen) < rho
    wrong = torch.randint(1, vocab, (positions,), generator=gen)
    noisy = views[-1]
    noisy[corrupted, right] -= 3.0
    noisy[corrupted, wrong[corrupted]] += 6.0
    return torch.log_softmax(torch.stack(views), -1), corrupted, wrong


def pools(positions: int, results: dict) -> None:
    print(f"\n## Pools on synthetic views ({positions:,} positions, 3 seeds, mean ± std)\n")
    print(
        "| rho | pool | right token, corrupted | noisy token, corrupted | right token, elsewhere "
        "| gate, corrupted | gate, elsewhere |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for rho in (0.0, 0.2, 0.5):
        for name, gate in (("arithmetic", 1.0), ("geometric", 0.0), ("adaptive", "adaptive")):
            cells: dict[str, list[float]] = defaultdict(list)
            for seed in range(3):
                views, corrupted, wrong = synthetic_views(positions, rho, seed)
                target = avsd_target(views, gate=gate, gate_threshold=0.1, gate_sharpness=20.0)
                probs = target.logp.exp()
                clean = ~corrupted
                index = torch.arange(positions)
                if corrupted.any():
                    cells["right_corrupted"].append(float(probs[corrupted, 0].mean()))
                    noisy_mass = probs[index, wrong][corrupted]
                    cells["noisy_corrupted"].append(float(noisy_mass.mean()))
                    cells["gate_corrupted"].append(float(target.gate[corrupted].mean()))
                cells["right_clean"].append(float(probs[clean, 0].mean()))
                cells["gate_clean"].append(float(target.gate[clean].mean()))
            row = [
                _mean_std(cells[key])
                for key in (
                    "right_corrupted",
                    "noisy_corrupted",
                    "right_clean",
                    "gate_corrupted",
                    "gate_clean",
                )
            ]
            print(f"| {rho} | {name} | " + " | ".join(row) + " |")
            results["pools"].append({"rho": rho, "pool": name, **cells})


def _mean_std(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def load(sweep: Path) -> dict[str, dict[int, dict[str, float]]]:
    """Per variant, per seed: the metrics of the runs that succeeded."""
    runs = json.loads((sweep / "results.json").read_text())["runs"]
    by: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for run in runs:
        if run["status"] == "ok":
            by[run["variant"]][run["seed"]] = run["metrics"]
    return by


def premise(by: dict, results: dict) -> None:
    seeds = next(iter(by.values()))
    rows = [("no view (student)", [m["val/success_start"] for m in seeds.values()])]
    rows += [
        (f"{view} view (teacher)", [m[f"val/teacher_success_{view}"] for m in seeds.values()])
        for view in VIEWS
    ]
    print(f"\n## Premise: the warm-started model with and without a view ({len(seeds)} seeds)\n")
    print("| context | held-out success (sampled) |\n| --- | ---: |")
    for name, values in rows:
        print(f"| {name} | {fmt(values)} |")
    results["premise"] = {name: values for name, values in rows}


def arms(by: dict, results: dict) -> None:
    names = [
        ("val/success", "final success"),
        ("val/success_best", "best"),
        ("val/success_auc", "area"),
        ("val/tokens_to_threshold", "tokens to 70%"),
        ("train/gate", "gate"),
        ("train/disagreement", "disagreement"),
        ("train/token_weight", "token weight"),
    ]
    print("\n## Arms: mean ± 95% t-interval over seeds; paired difference avsd − arm\n")
    header = " | ".join(label for _, label in names)
    print(f"| arm | seeds | {header} | avsd − arm (final) | avsd − arm (area) |")
    print("| --- | ---: |" + " ---: |" * (len(names) + 2))
    reference = by.get("avsd", {})
    for variant, seeds in by.items():
        cells = []
        for name, _ in names:
            values = [m[name] for m in seeds.values() if m.get(name) is not None]
            digits = 0 if "tokens" in name else 3
            cells.append(fmt(values, digits) if values else "–")
        diffs = []
        for name in ("val/success", "val/success_auc"):
            paired = [reference[s][name] - m[name] for s, m in seeds.items() if s in reference]
            diffs.append("–" if variant == "avsd" else fmt(paired))
            results["paired"].setdefault(variant, {})[name] = paired
        print(f"| {variant} | {len(seeds)} | " + " | ".join(cells + diffs) + " |")


def noisy_view(by: dict, results: dict) -> None:
    if not all(v in by for v in ("arith", "arith_clean", "avsd", "avsd_clean")):
        return

    def effect(noisy: str, clean: str) -> dict[int, float]:
        return {
            s: by[noisy][s]["val/success"] - by[clean][s]["val/success"]
            for s in by[noisy]
            if s in by[clean]
        }

    arith, gated = effect("arith", "arith_clean"), effect("avsd", "avsd_clean")
    both = [gated[s] - arith[s] for s in arith if s in gated]
    print("\n## The noisy view's effect on final success (with − without it, paired by seed)\n")
    print("| pooling | with noisy − without |\n| --- | ---: |")
    print(f"| arithmetic mean (arith) | {fmt(list(arith.values()))} |")
    print(f"| adaptive gate (avsd) | {fmt(list(gated.values()))} |")
    print(f"| gated − arithmetic | {fmt(both)} |")
    results["noisy_view"] = {"arith": arith, "avsd": gated, "difference": both}


@torch.no_grad()
def content_control(sweep: Path, results: dict, samples: int = 8) -> None:
    from ada_modules.data import EnvTaskDataModule
    from ada_modules.models import SelfDistillationModule

    rows: dict[str, list[float]] = defaultdict(list)
    for checkpoint in sorted(sweep.glob("shared_fit/sft/seed_*/checkpoints/last.ckpt")):
        seed = int(checkpoint.parts[-3].removeprefix("seed_"))
        torch.manual_seed(seed)
        module = SelfDistillationModule.load_from_checkpoint(checkpoint, map_location="cpu")
        module.eval()
        env = module_env(checkpoint)
        data = EnvTaskDataModule(env, seed=seed, num_val=64, num_test=256)
        tasks = data.tasks("val")
        others = tasks[1:] + tasks[:1]
        contexts = {
            "solution view": [f"[{env.solution(t)}]" for t in tasks],
            "empty view []": ["[]" for _ in tasks],
            "another task's solution": [f"[{env.solution(o)}]" for o in others],
            "no view": ["" for _ in tasks],
        }
        tok = module.tokenizer
        for name, texts in contexts.items():
            prompts = [
                [tok.bos_id, *tok.encode(text), *tok.encode(env.reset(t).observation)]
                for t, text in zip(tasks, texts, strict=True)
                for _ in range(samples)
            ]
            responses = module._sample(prompts, env.max_action_tokens, greedy=False)
            solved = 0
            for t, response in zip(
                [t for t in tasks for _ in range(samples)], responses, strict=True
            ):
                episode = env.reset(t)
                episode.step(tok.decode([x for x in response if x != tok.eos_id]))
                solved += episode.success
            rows[name].append(solved / len(responses))
    if not rows:
        return
    print(
        f"\n## What a view carries: the warm start after other contexts ({len(rows['no view'])} seeds)\n"
    )
    print("| context before the task | held-out success (sampled) |\n| --- | ---: |")
    for name, values in rows.items():
        print(f"| {name} | {fmt(values)} |")
    results["content_control"] = dict(rows)


def module_env(checkpoint: Path):
    """The environment of the sweep run that wrote ``checkpoint`` (from its saved config)."""
    import yaml

    from ada_modules.posttrain import envs

    (path,) = checkpoint.parents[1].glob("lightning_logs/version_*/config.yaml")
    config = yaml.safe_load(path.read_text())
    spec = config["data"]["init_args"]["env"]
    return getattr(envs, spec["class_path"].rsplit(".", 1)[1])(**spec.get("init_args", {}))


def _curve(run_dir: Path) -> list[tuple[float, float]]:
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    if not checkpoint.is_file():
        return []
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return [(float(t), float(v)) for t, v in state.get("on_policy_progress", {}).get("curve", [])]


def _interp(x: float, points: list[tuple[float, float]]) -> float:
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (x - x0) / max(x1 - x0, 1e-9) * (y1 - y0)
    return points[-1][1]


def plots(sweep: Path, out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = list(results["premise"])
    means = [interval(v)[0] for v in results["premise"].values()]
    halves = [interval(v)[1] for v in results["premise"].values()]
    ax.bar(range(len(labels)), means, yerr=halves, color=["gray"] + ["tab:blue"] * len(VIEWS))
    ax.set_xticks(range(len(labels)), [label.split(" (")[0] for label in labels], rotation=20)
    ax.set_ylabel("held-out success after warm start")
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "avsd_premise.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for variant in CURVE_ARMS:
        curves = [_curve(d) for d in sorted((sweep / "runs" / variant).glob("seed_*"))]
        curves = [c for c in curves if c]
        if not curves:
            continue
        end = min(c[-1][0] for c in curves)
        grid = [end * i / 40 for i in range(41)]
        at = [[_interp(x, c) for c in curves] for x in grid]
        mean = [interval(v)[0] for v in at]
        half = [interval(v)[1] for v in at]
        ax.plot(grid, mean, label=f"{variant} (n={len(curves)})")
        low = [m - h for m, h in zip(mean, half, strict=True)]
        ax.fill_between(grid, low, [m + h for m, h in zip(mean, half, strict=True)], alpha=0.15)
        results["curves"][variant] = {"tokens": grid, "mean": mean}
    ax.set_xlabel("sampled response tokens")
    ax.set_ylabel("held-out success (Avg@8)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "avsd_curves.png", dpi=120)
    plt.close(fig)
    print(f"\nwrote {out / 'avsd_premise.png'} and {out / 'avsd_curves.png'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=Path, default=None, help="an ada sweep output folder")
    parser.add_argument("--out", type=Path, default=Path("bench_out/avsd"))
    parser.add_argument("--quick", action="store_true", help="fewer synthetic positions")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"pools": [], "paired": {}, "curves": {}}
    pools(2_000 if args.quick else 20_000, results)
    if args.sweep is None:
        (args.out / "avsd.json").write_text(json.dumps(results, indent=2))
        return 0
    by = load(args.sweep)
    premise(by, results)
    arms(by, results)
    noisy_view(by, results)
    content_control(args.sweep, results)
    plots(args.sweep, args.out, results)
    (args.out / "avsd.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
