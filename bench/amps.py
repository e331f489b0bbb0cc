"""AMPS (issue 21) on CPU: the per-batch cost of each steering-strength mode, and the mini
reproduction's tables and plots.

**Without --sweep** (in-process, one thread): the wall-clock cost of answering one batch of test
questions with each strength mode of :class:`~ada_modules.models.ModalitySteeringModule`, on a
randomly initialised :class:`~ada_modules.models.ImageTextQAModule` of ``base.yaml``'s size
(hidden 64, 2 layers, 4 heads, MLP 256; untrained: the answers are meaningless, the cost is not).
The questions are a small ``ModalityConflictDataModule(seed=0)`` test split of
``ceil(batch / 4)`` conflicts and as many consistent items, each in both option orders, cut to the
batch size. The steering vector is built as the module builds it:
the mean difference of layer 0's output at the prompt's last position between up to 512 training
conflicts and instructed items with the instruction set to ``i`` and to ``t``. One timed call is,
under ``torch.no_grad``:

- ``none``: ``ImagePrefixLM.generate`` of 6 tokens (greedy, KV cache);
- ``uniform``: the same generation inside ``steer`` (layer 0, token scope ``last``) with a
  scalar strength of 2;
- ``mcr``: the three ``option_logits`` forwards (full, image removed, text removed), the target
  (image) modality's ``modality_contribution_ratio``, ``mcr_scaled_strength`` (alpha 8, threshold
  0.5), then the steered generation with the per-question strengths;
- ``learned``: the ``mcr`` arm's MCR, a fourth forward under ``capture_hidden_states`` for layer
  0's state at the prompt's end (a separate forward, as the module runs it), a randomly
  initialised ``StrengthPredictor`` (bound 8), then the steered generation.

The arms are timed round-robin after a warm-up; the table gives the median milliseconds per batch
and the ratio to ``none``. Batch 250 (``eval_batch_size`` of ``steer.yaml``), 30 repeats;
``--quick``: batch 32, 5 repeats. ``--out DIR`` also writes ``DIR/amps_timing.json``.

**With --sweep DIR** (the output of ``ada sweep cli_configs/amps/repro.yaml --out DIR``; reads
``DIR/results.json``; nothing is run): the number of ok runs and the failed ones, then per
direction (image, text) a table of every variant, ``none`` first, of test/preference_shift,
accuracy_drop, unparseable, repetition, mean_strength, strength_dominant, strength_needed and
mcr_auroc, mean ± std over seeds ("–" where missing; ``none`` runs with direction image, so its
strength and MCR columns are the image direction's). Then, per direction, two per-seed analyses
(the seeds' trained models steer very differently, so curves are compared within a seed and only
the results are averaged): (1) matched preference shift: for each ``mcr_*`` and ``learned_*`` run,
the same seed's uniform curve (``none``, then the ``uniform_*`` variants by increasing alpha) at
the first point where it reaches that run's shift, linearly interpolated; the table gives the
number of seeds where uniform steering reaches it, mean ± std of the accuracy-drop and
unparseable-share differences (AMPS minus uniform: negative means AMPS loses less), and the
number of seeds where no uniform strength reaches that shift, with the AMPS run's drop there;
(2) preference control: per method, the largest shift any of its strengths reaches on a seed,
and the largest with an accuracy drop of at most 0.05 and 0.10 (``none`` counts as a point of
every method: 0).

With ``--out DIR2`` it draws ``pareto_image.png`` and ``pareto_text.png`` (one panel per seed;
x: preference shift, y: accuracy drop; one line per method in strength order from ``none``,
points labelled with alpha, or with the collapse weight w for learned) and
``collapse_image.png`` / ``collapse_text.png`` (y: unparseable share). Reports only; no
assertion.

**With --sweep DIR --premise** (premise first; loads the sweep's base checkpoints
``DIR/shared_fit/base/seed_<s>/checkpoints/last.ckpt`` and runs them on CPU, about 10 s per seed):
per seed on its own test questions (``steer.yaml``'s data arguments), the unsteered model's
consistent accuracy and image-following rate on conflicts with a sure and with a hedged statement;
the mean image MCR of each group; the hedged conflicts' image MCR after adding pixel noise of std
0.6 to their images, and the share of them whose MCR it lowers (a constructed check: a corrupted
image must contribute less); and, for the sure conflicts the model answers with the text, the
smallest uniform strength on a grid (0.25 to 4; letter choice at the prompt's end, steering
vector as in the module) that makes it answer with the image: its 10/50/90 % quantiles, the share
that no strength up to 4 flips, and its Spearman correlation with the image MCR. Mean ± std over
seeds; ``--out`` also writes ``amps_premise.json``.

    python bench/amps.py                                     # timing table (under a minute)
    python bench/amps.py --quick --out /tmp/amps             # seconds
    python bench/amps.py --sweep sweeps/amps --premise       # premise table
    python bench/amps.py --sweep sweeps/amps --out docs/techniques/img/amps
"""

import argparse
import json
import math
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DIRECTIONS = ("image", "text")
METHODS = ("uniform", "mcr", "learned")
METRICS = (
    "preference_shift",
    "accuracy_drop",
    "unparseable",
    "repetition",
    "mean_strength",
    "strength_dominant",
    "strength_needed",
    "mcr_auroc",
)
VARIANT = re.compile(r"^(uniform|mcr|learned)_(image|text)_([aw])([0-9.]+)$")
MAX_NEW_TOKENS = 6
UNIFORM_ALPHA, MCR_ALPHA, THRESHOLD = 2.0, 8.0, 0.5

# ------------------------------------------------------------------ formatting


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def mean_std(values: list[float | None], digits: int = 3, signed: bool = False) -> str:
    """``mean ± std`` (the value alone for one, "–" for none)."""
    values = _finite(values)
    if not values:
        return "–"
    sign = "+" if signed else ""
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f} ± {statistics.stdev(values):.{digits}f}"


# ------------------------------------------------------------------ timing (no --sweep)


def _timed_arms(batch_size: int) -> dict[str, Callable[[], Any]]:
    """The four timed functions of the module docstring, on one batch of test questions."""
    import torch

    from ada_modules.data.modality_conflict import ModalityConflictDataModule
    from ada_modules.models.image_text_qa import (
        ImageTextQAModule,
        answer_state,
        image_contribution_ratio,
    )
    from ada_modules.models.modality_steering import instruction_steering_vector
    from ada_modules.steering import StrengthPredictor, mcr_scaled_strength, steer

    torch.manual_seed(0)
    dm = ModalityConflictDataModule(
        seed=0, train_size=1024, val_size=16, test_size=max(1, -(-batch_size // 4))
    )
    dm.setup("test")
    module = ImageTextQAModule(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256)
    model = module.model.eval().requires_grad_(False)
    lm = model.lm
    test = dm.items("test")
    batch = test[torch.arange(min(batch_size, len(test)))]
    args = (batch["patches"], batch["image_present"], batch["prompt_ids"])
    vector = instruction_steering_vector(model, dm.items("train"), layer=0)
    predictor = StrengthPredictor(64, max_strength=MCR_ALPHA).eval()

    def steered(strength: float | torch.Tensor) -> torch.Tensor:
        with steer(lm, vector, strength, "last"):
            return model.generate(*args, max_new_tokens=MAX_NEW_TOKENS)

    @torch.no_grad()
    def none() -> torch.Tensor:
        return model.generate(*args, max_new_tokens=MAX_NEW_TOKENS)

    @torch.no_grad()
    def uniform() -> torch.Tensor:
        return steered(UNIFORM_ALPHA)

    @torch.no_grad()
    def mcr() -> torch.Tensor:
        return steered(
            mcr_scaled_strength(image_contribution_ratio(model, batch), MCR_ALPHA, THRESHOLD)
        )

    @torch.no_grad()
    def learned() -> torch.Tensor:
        target = image_contribution_ratio(model, batch)
        return steered(predictor(answer_state(model, batch, 0), target))

    return {"none": none, "uniform": uniform, "mcr": mcr, "learned": learned}


def timing(quick: bool, out: Path | None) -> None:
    import torch

    torch.set_num_threads(1)
    batch, repeats = (32, 5) if quick else (250, 30)
    arms = _timed_arms(batch)
    forwards = {"none": 0, "uniform": 0, "mcr": 3, "learned": 4}
    print(
        f"## Answer cost per strength mode (batch {batch}, {MAX_NEW_TOKENS} new tokens, hidden 64, "
        f"2 layers, {torch.get_num_threads()} CPU thread, median of {repeats} round-robin "
        "repeats)\n"
    )
    for arm in arms.values():  # warm-up
        arm()
        arm()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, arm in arms.items():
            begin = time.perf_counter()
            arm()
            times[name].append(1e3 * (time.perf_counter() - begin))
    median = {name: statistics.median(values) for name, values in times.items()}
    print("| mode | extra forwards | ms per batch | ratio to none | questions/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, ms in median.items():
        print(
            f"| {name} | {forwards[name]} | {ms:.2f} | {ms / median['none']:.2f}x | "
            f"{1e3 * batch / ms:.0f} |"
        )
    print(
        "\nExtra forwards: full-prompt forwards before the generation (the MCR's three ablations; "
        "learned adds the hidden-state capture). The generation itself is one prompt forward plus "
        f"{MAX_NEW_TOKENS - 1} one-token steps."
    )
    if out is not None:
        payload = {"quick": quick, "batch": batch, "repeats": repeats, "median_ms": median,
                   "times_ms": times, "threads": torch.get_num_threads()}  # fmt: skip
        (out / "amps_timing.json").write_text(json.dumps(payload, indent=2))


# ------------------------------------------------------------------ sweep


def load_runs(sweep: Path) -> tuple[dict[str, dict[int, dict[str, float]]], dict]:
    """Per variant, per seed: the run's metrics (failed runs are listed and left out)."""
    path = sweep / "results.json"
    if not path.exists():
        raise SystemExit(f"no results.json in {sweep}")
    data = json.loads(path.read_text())
    runs: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    failed = [run for run in data["runs"] if run["status"] != "ok"]
    for run in data["runs"]:
        by_seed = runs[run["variant"]]  # a variant whose runs all failed still gets its row
        if run["status"] == "ok":
            by_seed[run["seed"]] = run["metrics"] or {}
    quick = " (quick profile)" if data.get("quick") else ""
    ok = sum(map(len, runs.values()))
    print(f"# AMPS sweep {sweep}{quick}: {ok} runs ok, {len(failed)} failed\n")
    for run in failed:
        error = str(run.get("error") or "").strip().splitlines()
        print(f"- failed: {run['variant']} seed {run['seed']} ({run['status']}): "
              f"{error[-1] if error else 'no error recorded'}")  # fmt: skip
    if failed:
        print()
    return runs, data


def values(runs: dict, variant: str, metric: str) -> list[float]:
    """The metric's value per seed of ``variant`` (seeds without it left out)."""
    found = [m.get(f"test/{metric}") for m in runs.get(variant, {}).values()]
    return _finite(found)


def variants_of(runs: dict, direction: str) -> dict[str, list[tuple[float, str]]]:
    """Per method, ``(alpha or w, variant)`` of ``direction``, sorted by the parameter."""
    found: dict[str, list[tuple[float, str]]] = {method: [] for method in METHODS}
    for variant in runs:
        match = VARIANT.match(variant)
        if match and match.group(2) == direction:
            found[match.group(1)].append((float(match.group(4)), variant))
    return {method: sorted(items) for method, items in found.items()}


def direction_table(runs: dict, direction: str) -> None:
    print(f"## Steering towards the {direction}: mean ± std over seeds\n")
    print("| variant | seeds | " + " | ".join(METRICS) + " |")
    print("| --- | ---: |" + " ---: |" * len(METRICS))
    names = ["none"] + [v for items in variants_of(runs, direction).values() for _, v in items]
    for name in names:
        cells = [mean_std(values(runs, name, metric), signed=metric == "preference_shift")
                 for metric in METRICS]  # fmt: skip
        print(f"| {name} | {len(runs.get(name, {}))} | " + " | ".join(cells) + " |")
    print()


def _seed_points(runs: dict, names: list[str], seed: int) -> list[tuple[float, float, float]]:
    """``(shift, accuracy drop, unparseable)`` of ``names`` for one seed, in the given order (a
    run without them is left out)."""
    points = []
    for name in names:
        metrics = runs.get(name, {}).get(seed) or {}
        point = [metrics.get(f"test/{m}") for m in ("preference_shift", "accuracy_drop",
                                                    "unparseable")]  # fmt: skip
        if all(v is not None and math.isfinite(v) for v in point):
            points.append(tuple(point))
    return points


def first_crossing(curve: list[tuple[float, float, float]], shift: float) -> tuple | None:
    """Drop and unparseable share where the curve (in strength order) first reaches ``shift``,
    linearly interpolated; ``None`` if it never does."""
    for left, right in zip(curve, curve[1:], strict=False):
        if left[0] < shift <= right[0]:
            weight = (shift - left[0]) / (right[0] - left[0])
            return tuple(left[i] + weight * (right[i] - left[i]) for i in (1, 2))
    if curve and curve[0][0] >= shift:
        return curve[0][1], curve[0][2]
    return None


def _best_shift(points: list[tuple[float, float, float]], max_drop: float) -> float:
    return max([p[0] for p in points if p[1] <= max_drop], default=0.0)


def matched_table(runs: dict, direction: str) -> None:
    """Per seed, each AMPS point against that seed's uniform curve (none, then the uniform
    variants by strength) where it first reaches the AMPS point's shift."""
    found = variants_of(runs, direction)
    uniform_names = ["none"] + [v for _, v in found["uniform"]]
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    print(
        f"## Matched preference shift, towards the {direction}, per seed: each AMPS run against "
        "the same seed's uniform-steering curve (none, then alpha up) where it first reaches the "
        "AMPS run's shift\n"
    )
    print(
        "| variant | seeds uniform reaches | drop AMPS − uniform (there) | unparseable AMPS − "
        "uniform | seeds uniform never reaches | AMPS drop on those |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for _, name in found["mcr"] + found["learned"]:
        drop_diff, unparseable_diff, beyond = [], [], []
        for seed in seeds:
            point = _seed_points(runs, [name], seed)
            curve = _seed_points(runs, uniform_names, seed)
            if not point or not curve:
                continue
            shift, drop, unparseable = point[0]
            uniform = first_crossing(curve, shift)
            if uniform is None:
                beyond.append(drop)
            else:
                drop_diff.append(drop - uniform[0])
                unparseable_diff.append(unparseable - uniform[1])
        print(f"| {name} | {len(drop_diff)} | {mean_std(drop_diff, signed=True)} | "
              f"{mean_std(unparseable_diff, signed=True)} | {len(beyond)} | "
              f"{mean_std(beyond)} |")  # fmt: skip
    print(
        "\nA negative difference: less consistent-pair accuracy lost (or fewer unparseable "
        "answers) than uniform steering at the same shift on the same model.\n"
    )
    print(f"## Preference control, towards the {direction}: the largest shift per seed\n")
    print("| method | largest shift | largest shift with accuracy drop ≤ 0.05 | ≤ 0.10 |")
    print("| --- | ---: | ---: | ---: |")
    for method in METHODS:
        names = ["none"] + [v for _, v in found[method]]
        per_seed = [_seed_points(runs, names, seed) for seed in seeds]
        per_seed = [points for points in per_seed if points]
        cells = [mean_std([_best_shift(p, math.inf) for p in per_seed], signed=True),
                 mean_std([_best_shift(p, 0.05) for p in per_seed], signed=True),
                 mean_std([_best_shift(p, 0.10) for p in per_seed], signed=True)]  # fmt: skip
        print(f"| {method} | " + " | ".join(cells) + " |")
    print()


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_direction(runs: dict, direction: str, metric: str, out: Path) -> None:
    """``metric`` against the preference shift, one panel per seed (the seeds' trained models
    differ too much to average the curves first), one line per method in strength order."""
    plt = _pyplot()
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    fig, axes = plt.subplots(1, len(seeds), figsize=(4.2 * len(seeds), 3.8), squeeze=False)
    colours = {"uniform": "tab:grey", "mcr": "tab:blue", "learned": "tab:orange"}
    column = {"accuracy_drop": 1, "unparseable": 2}[metric]
    for ax, seed in zip(axes[0], seeds, strict=True):
        for method, items in variants_of(runs, direction).items():
            names = ["none"] + [name for _, name in items]
            labels = ["0"] + [f"{parameter:g}" for parameter, _ in items]
            points = _seed_points(runs, names, seed)
            if len(points) < 2:
                continue
            xs, ys = [p[0] for p in points], [p[column] for p in points]
            ax.plot(xs, ys, marker="o", label=method, color=colours[method])
            key = "w" if method == "learned" else "α"
            for x, y, label in zip(xs[1:], ys[1:], labels[1:], strict=False):
                ax.annotate(f"{key}={label}", (x, y), fontsize=7, xytext=(4, 3),
                            textcoords="offset points", color=colours[method])  # fmt: skip
        ax.plot([0], [0], marker="*", markersize=12, color="black", linestyle="", label="none")
        ax.axhline(0, color="black", linewidth=0.5)
        ax.axvline(0, color="black", linewidth=0.5)
        ax.set_title(f"seed {seed}", fontsize=9)
        ax.set_xlabel(f"preference shift towards the {direction}")
    axes[0][0].set_ylabel(
        "accuracy drop (consistent pairs)" if metric == "accuracy_drop" else "unparseable share"
    )
    axes[0][-1].legend(fontsize=8)
    kind = "pareto" if metric == "accuracy_drop" else "collapse"
    fig.suptitle(f"AMPS vs uniform steering towards the {direction}: {kind}, per seed", fontsize=10)
    fig.savefig(out / f"{kind}_{direction}.png", dpi=100, bbox_inches="tight")
    plt.close(fig)


def report_sweep(sweep: Path, out: Path | None) -> None:
    runs, _ = load_runs(sweep)
    for direction in DIRECTIONS:
        direction_table(runs, direction)
    for direction in DIRECTIONS:
        matched_table(runs, direction)
    if out is not None:
        for direction in DIRECTIONS:
            plot_direction(runs, direction, "accuracy_drop", out)
            plot_direction(runs, direction, "unparseable", out)
        print(f"plots in {out}")


# ------------------------------------------------------------------ premise (trained base models)

FLIP_GRID = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
HEAVY_NOISE = 0.6


def _steer_config() -> dict[str, Any]:
    """The data arguments of cli_configs/amps/steer.yaml (the repro's test questions)."""
    import yaml

    config = yaml.safe_load((REPO / "cli_configs/amps/steer.yaml").read_text())
    return {k: v for k, v in config["data"]["init_args"].items() if k != "seed"}


def premise_seed(checkpoint: Path, seed: int) -> dict[str, float]:
    """One seed's base model on its test questions: preference, MCR, and per-instance flip
    strengths of uniform steering towards the image."""
    import torch

    from ada_modules.data import ModalityConflictDataModule
    from ada_modules.models import ImageTextQAModule
    from ada_modules.models.image_text_qa import image_contribution_ratio, option_logits
    from ada_modules.models.modality_steering import instruction_steering_vector
    from ada_modules.steering import steer

    torch.manual_seed(seed)
    base = ImageTextQAModule.load_from_checkpoint(checkpoint, map_location="cpu").eval()
    model = base.model
    data = ModalityConflictDataModule(seed=seed, **_steer_config())
    data.setup("test")
    test = data.items("test")
    batch = test[torch.arange(len(test))]

    def follows_image(b: dict[str, Any], alpha: float) -> Any:
        with steer(model.lm, vector, alpha, "last"):
            letters, _ = option_logits(model, b)
        chosen = b["options"].gather(1, letters.argmax(-1, keepdim=True))[:, 0]
        return chosen == b["image_class"]

    with torch.no_grad():
        vector = instruction_steering_vector(model, data.items("train"), layer=0)
        mcr = image_contribution_ratio(model, batch)
        base_image = follows_image(batch, 0.0)
        conflict, consistent = batch["kind"] == 1, batch["kind"] == 0
        sure, hedged = conflict & ~batch["hedged"], conflict & batch["hedged"]
        noisy = {
            **batch,
            "patches": batch["patches"] + HEAVY_NOISE * torch.randn_like(batch["patches"]),
        }
        mcr_noisy = image_contribution_ratio(model, noisy)
        flip = torch.full((len(test),), math.inf)
        for alpha in reversed(FLIP_GRID):  # the smallest grid strength that answers the image
            flip = torch.where(follows_image(batch, alpha), torch.tensor(alpha), flip)
    needs = sure & ~base_image
    flips = flip[needs]
    finite = flips[flips.isfinite()]
    quantile = lambda q: float(finite.quantile(q)) if len(finite) else math.nan  # noqa: E731
    return {
        "consistent_accuracy": float(base_image[consistent].float().mean()),
        "image_rate_sure": float(base_image[sure].float().mean()),
        "image_rate_hedged": float(base_image[hedged].float().mean()),
        "mcr_v_sure": float(mcr[sure].mean()),
        "mcr_v_hedged": float(mcr[hedged].mean()),
        "mcr_v_consistent": float(mcr[consistent].mean()),
        "mcr_v_hedged_image_noised": float(mcr_noisy[hedged].mean()),
        "noise_lowers_mcr_v_hedged": float((mcr_noisy < mcr)[hedged].float().mean()),
        "flip_alpha_p10": quantile(0.1),
        "flip_alpha_p50": quantile(0.5),
        "flip_alpha_p90": quantile(0.9),
        "never_flips_by_4": float((~flips.isfinite()).float().mean()),
        "flip_alpha_mcr_spearman": _spearman(mcr[needs][flips.isfinite()], finite),
    }


def _spearman(a: Any, b: Any) -> float:
    if len(a) < 3:
        return math.nan
    rank = lambda x: x.argsort().argsort().float()  # noqa: E731
    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def report_premise(sweep: Path, out: Path | None) -> None:
    import torch

    torch.set_num_threads(1)
    per_seed = {}
    for checkpoint in sorted((sweep / "shared_fit" / "base").glob("seed_*/checkpoints/last.ckpt")):
        seed = int(checkpoint.parts[-3].split("_")[1])
        per_seed[seed] = premise_seed(checkpoint, seed)
    if not per_seed:
        raise SystemExit(f"no base checkpoints under {sweep}/shared_fit/base")
    names = list(next(iter(per_seed.values())))
    print(f"## Premise: the unsteered base models ({len(per_seed)} seeds, mean ± std)\n")
    print("| quantity | value |\n|---|---|")
    for name in names:
        print(f"| {name} | {mean_std([r[name] for r in per_seed.values()])} |")
    if out is not None:
        (out / "amps_premise.json").write_text(json.dumps(per_seed, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", type=Path, default=None, help="output folder of repro.yaml")
    parser.add_argument("--out", type=Path, default=None, help="folder for plots and JSON")
    parser.add_argument("--quick", action="store_true", help="small timing run (seconds)")
    parser.add_argument("--premise", action="store_true", help="with --sweep: the base models")
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep is not None and args.premise:
        report_premise(args.sweep, args.out)
    elif args.sweep is not None:
        report_sweep(args.sweep, args.out)
    else:
        timing(args.quick, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
