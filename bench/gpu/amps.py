"""AMPS on one GPU: steer a larger two-modality model towards the image, uniform vs MCR strength.

Nothing is downloaded. In order:

1. ``train``: a randomly initialised :class:`~ada_modules.models.ImageTextQAModule` (hidden 256,
   4 layers, 8 heads, MLP 1024; fp32 with TF32 matmuls) is trained on
   ``ModalityConflictDataModule(seed=0, train_size=20000, test_size=250)`` (batch 128, AdamW lr
   1e-3) for up to 4000 steps or 150 s of fit, whichever comes first (Lightning's ``max_time``;
   the time guard shortens it further when little budget is left), saved to a temporary
   checkpoint, and tested: accuracy on consistent pairs and conflicts and the share of conflicts
   answered with the text's and the image's digit (the preference that steering moves).
2. ``arms``: :class:`~ada_modules.models.ModalitySteeringModule` with ``base_checkpoint`` at that
   checkpoint, ``direction="image"``, layer 0, token scope last, run by ``trainer.test`` on the
   DataModule's test split (250 conflicts and 250 consistent items, each in both option orders:
   1000 questions): strength ``none``, then ``uniform`` at alpha 0.5, 1, 2, 4 and ``mcr``
   (threshold 0.5) at alpha 1, 2, 4, 8, alternately (a time-guard cut leaves both alike).
   Printed per arm: test/preference_shift, accuracy_drop, unparseable, target_rate,
   mean_strength and mcr_auroc (see ``ModalitySteeringModule``), and the seconds of
   ``trainer.test`` (setup included: loading the checkpoint and the steering vector).
3. ``throughput``: on the same device, within one run, the whole test split as one batch is
   answered (greedy, 6 new tokens, ``torch.no_grad``) by three arms timed round-robin after a
   warm-up (CUDA synchronised around each call), median of 20: ``none`` (plain generation),
   ``uniform`` (generation under ``steer`` with alpha 2) and ``mcr`` (the three ablation forwards
   of ``ModalitySteeringModule.target_mcr``, ``mcr_scaled_strength`` with alpha 8, then the steered
   generation). Printed: ms per batch, questions per second and the overhead relative to uniform.

The time guard (``--budget-s``, default 420) skips arms that would not fit. Writes
``$OUT/amps.json`` (the base model's test metrics, one record per arm, the throughput rows) when
``OUT`` is set. ``--device cpu --quick`` trains a hidden-32, 1-layer model for 30 steps on 512
items and evaluates one uniform and one mcr arm on 64 questions, in seconds: a smoke test, numbers
meaningless. Exits non-zero without CUDA unless ``--device cpu``.
"""

import argparse
import functools
import logging
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import (  # bench/gpu/_common.py
    Guard,
    add_run_arguments,
    bench_device,
    quiet_trainer,
    sync,
    write_json,
)
from lightning.pytorch import seed_everything

from ada_modules.data import ModalityConflictDataModule
from ada_modules.models import ImageTextQAModule, ModalitySteeringModule
from ada_modules.steering import mcr_scaled_strength, steer

SLUG = "amps"
ARM_METRICS = (
    "preference_shift",
    "accuracy_drop",
    "unparseable",
    "target_rate",
    "mean_strength",
    "mcr_auroc",
)
TIMED_UNIFORM_ALPHA, TIMED_MCR_ALPHA = 2.0, 8.0


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    train_size: int
    test_size: int
    batch_size: int
    max_steps: int
    train_s: float
    uniform_alphas: tuple[float, ...]
    mcr_alphas: tuple[float, ...]
    repeats: int


FULL = Size(
    hidden=256,
    layers=4,
    heads=8,
    intermediate=1024,
    train_size=20_000,
    test_size=250,
    batch_size=128,
    max_steps=4000,
    train_s=150.0,
    uniform_alphas=(0.5, 1.0, 2.0, 4.0),
    mcr_alphas=(1.0, 2.0, 4.0, 8.0),
    repeats=20,
)
QUICK = Size(
    hidden=32,
    layers=1,
    heads=2,
    intermediate=64,
    train_size=512,
    test_size=16,
    batch_size=32,
    max_steps=30,
    train_s=20.0,
    uniform_alphas=(2.0,),
    mcr_alphas=(8.0,),
    repeats=3,
)


def train_base(size: Size, device: torch.device, guard: Guard, ckpt: Path) -> tuple[Any, dict]:
    """Train the two-modality model, save it to ``ckpt``; the DataModule and its test metrics."""
    seed_everything(0, verbose=False)
    dm = ModalityConflictDataModule(
        seed=0,
        train_size=size.train_size,
        val_size=16,
        test_size=size.test_size,
        batch_size=size.batch_size,
        eval_batch_size=4 * size.test_size,
    )
    dm.setup("fit")
    module = ImageTextQAModule(
        hidden_size=size.hidden,
        num_layers=size.layers,
        num_heads=size.heads,
        intermediate_size=size.intermediate,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01),
    )
    # leave at least 40 % of what is left of the budget to the arms
    seconds = max(5.0, min(size.train_s, 0.6 * (guard.budget_s - guard.elapsed())))
    trainer = quiet_trainer(device, max_steps=size.max_steps, max_time={"seconds": seconds})
    begin = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    fit_s = time.perf_counter() - begin
    trainer.save_checkpoint(ckpt)
    metrics = trainer.test(module, datamodule=dm, verbose=False)[0]
    base = {"steps": trainer.global_step, "fit_s": fit_s, "time_cap_s": seconds,
            **{k.removeprefix("test/"): float(v) for k, v in metrics.items()}}  # fmt: skip
    print(
        f"## Base model: hidden {size.hidden}, {size.layers} layers, {size.heads} heads, "
        f"{trainer.global_step} steps in {fit_s:.0f} s (cap {size.max_steps} steps / "
        f"{seconds:.0f} s)\n"
    )
    print("| consistent acc. | conflict acc. | text rate | image rate |")
    print("| ---: | ---: | ---: | ---: |")
    cells = [base.get(k, float("nan")) for k in
             ("accuracy_consistent", "accuracy_conflict", "text_rate", "image_rate")]  # fmt: skip
    print("| " + " | ".join(f"{v:.3f}" for v in cells) + " |\n", flush=True)
    return dm, base


def steering_module(ckpt: Path, strength: str, alpha: float) -> Any:
    return ModalitySteeringModule(
        base_checkpoint=str(ckpt), direction="image", strength=strength, alpha=alpha
    )


def run_arms(size: Size, device: torch.device, guard: Guard, ckpt: Path, dm: Any) -> list[dict]:
    arms = [("none", 0.0)]  # then uniform and mcr alternately, so a time cut leaves both
    for index in range(max(len(size.uniform_alphas), len(size.mcr_alphas))):
        arms += [("uniform", a) for a in size.uniform_alphas[index : index + 1]]
        arms += [("mcr", a) for a in size.mcr_alphas[index : index + 1]]
    rows: list[dict] = []
    slowest = 5.0
    for strength, alpha in arms:
        if not guard.ok(f"arm {strength} alpha {alpha:g}", 1.5 * slowest + 5):
            continue
        trainer = quiet_trainer(device)
        begin = time.perf_counter()
        metrics = trainer.test(steering_module(ckpt, strength, alpha), datamodule=dm, verbose=False)
        seconds = time.perf_counter() - begin
        slowest = max(slowest, seconds)
        found = {k.removeprefix("test/"): float(v) for k, v in metrics[0].items()}
        rows.append({"strength": strength, "alpha": alpha, "test_s": seconds, **found})
        print(f"{strength} alpha {alpha:g}: done in {seconds:.1f} s", flush=True)
    print(
        f"\n## Steering towards the image ({4 * size.test_size} test questions; shift on "
        "conflicts, accuracy drop on consistent pairs)\n"
    )
    print("| strength | alpha | " + " | ".join(ARM_METRICS) + " | test s |")
    print("| --- | ---: |" + " ---: |" * (len(ARM_METRICS) + 1))
    for row in rows:
        cells = [f"{row[k]:.3f}" if k in row else "–" for k in ARM_METRICS]
        print(
            f"| {row['strength']} | {row['alpha']:g} | " + " | ".join(cells)
            + f" | {row['test_s']:.1f} |"
        )  # fmt: skip
    print()
    return rows


def throughput(size: Size, device: torch.device, ckpt: Path, dm: Any) -> list[dict]:
    modules = {}
    for strength, alpha in (("uniform", TIMED_UNIFORM_ALPHA), ("mcr", TIMED_MCR_ALPHA)):
        module = steering_module(ckpt, strength, alpha)
        quiet_trainer(device).test(module, datamodule=dm, verbose=False)  # runs setup
        modules[strength] = module.to(device).eval()
    test = dm.items("test")
    batch = {k: v.to(device) for k, v in test[torch.arange(len(test))].items()}
    args = (batch["patches"], batch["image_present"], batch["prompt_ids"])
    uniform, mcr = modules["uniform"], modules["mcr"]
    model = uniform.base.model

    @torch.no_grad()
    def none() -> torch.Tensor:
        return model.generate(*args, max_new_tokens=6)

    @torch.no_grad()
    def steered_uniform() -> torch.Tensor:
        with steer(model.lm, uniform.steering_vector, TIMED_UNIFORM_ALPHA, "last"):
            return model.generate(*args, max_new_tokens=6)

    @torch.no_grad()
    def steered_mcr() -> torch.Tensor:
        alpha = mcr_scaled_strength(mcr.target_mcr(batch), TIMED_MCR_ALPHA, 0.5)
        with steer(mcr.base.model.lm, mcr.steering_vector, alpha, "last"):
            return mcr.base.model.generate(*args, max_new_tokens=6)

    arms = {"none": none, "uniform": steered_uniform, "mcr": steered_mcr}
    for arm in arms.values():  # warm-up
        for _ in range(3):
            arm()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(size.repeats):
        for name, arm in arms.items():
            sync(device)
            begin = time.perf_counter()
            arm()
            sync(device)
            times[name].append(1e3 * (time.perf_counter() - begin))
    median = {name: statistics.median(values) for name, values in times.items()}
    questions = len(test)
    print(
        f"## Throughput ({questions} questions per batch, 6 new tokens, median of "
        f"{size.repeats} round-robin repeats)\n"
    )
    print("| mode | ms per batch | questions/s | vs uniform |")
    print("| --- | ---: | ---: | ---: |")
    rows = []
    for name, ms in median.items():
        overhead = ms / median["uniform"] - 1
        print(f"| {name} | {ms:.2f} | {1e3 * questions / ms:.0f} | {100 * overhead:+.0f} % |")
        rows.append({"mode": name, "ms": ms, "questions_per_s": 1e3 * questions / ms,
                     "overhead_vs_uniform": overhead, "times_ms": times[name]})  # fmt: skip
    print(
        "\nmcr's overhead is its three ablation forwards of the prompt (no generation); "
        "uniform's over none is the steering hook.\n"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    found = bench_device(args.device)
    if found is None:
        return 1
    device, name = found
    size = QUICK if args.quick else FULL
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no per-Trainer banners
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_float32_matmul_precision("high")
    print(f"# AMPS GPU benchmark ({'quick' if args.quick else 'full'}) on {name}\n")
    guard = Guard(args.budget_s)
    payload: dict[str, Any] = {"device": name, "torch": torch.__version__, "quick": args.quick}
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        ckpt = Path(folder) / "base.ckpt"
        try:
            dm, payload["base"] = train_base(size, device, guard, ckpt)
            payload["arms"] = run_arms(size, device, guard, ckpt, dm)
            if guard.ok("throughput", 20 if not args.quick else 2):
                payload["throughput"] = throughput(size, device, ckpt, dm)
        except Exception as err:  # report, still write what was measured, exit non-zero
            errors.append(f"{type(err).__name__}: {err}")
            print(f"\n**failed**: {errors[-1]}")
    elapsed = guard.elapsed()
    if guard.skipped:
        print(f"skipped by the time guard: {', '.join(guard.skipped)}")
    print(f"elapsed: {elapsed:.1f} s")
    write_json(SLUG, {**payload, "elapsed_s": elapsed, "skipped": guard.skipped, "errors": errors})
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
