"""ABC-Align: a reward model from scarce human and abundant biased AI-judge labels, on one GPU.

The CPU mini reproduction (``cli_configs/abc_align/repro.yaml``: a 1-layer, 32-wide reward model,
24 human and 2000 judge labels) at a larger scale, through the same library path
(:class:`~ada_modules.data.PreferenceDataModule`, :class:`~ada_modules.models.RewardModelModule`,
the estimators of :mod:`ada_modules.posttrain.abc`): a randomly initialised 4-layer, 256-wide Llama
reward model (8 heads, intermediate 1024, scalar head on the last token), 64 human-labelled pairs
and 20,000 judge-labelled pairs of digit strings 2 to 24 long, 600 AdamW steps (lr 1e-3) of 32
labelled + 256 unlabelled pairs, fp32. Judges: ``length`` (90 % self-consistent, length bias 1.0:
a systematic bias, the pseudo labels mislead) and ``noisy`` (85 %, length bias 0.2: nearly
unbiased, the pseudo labels help). Arms: human-only, pseudo-only, PPI++ and ABC (λ̂ and ŵ estimated
once, before training, from head gradients on the 64 labelled and 512 unlabelled pairs); the
human-only arm never sees the judge's labels, so its one run per seed serves both judges. Seed 0
for every judge and arm, then seed 1 (new pairs, new initialisation), while the time guard allows
(420 s by default): 14 runs.

Prints one table: per judge and arm, the number of finished seeds, the mean ± std over them of the
test accuracy (the share of 2000 held-out pairs whose reward order matches the true preference),
of PPI++'s λ̂ (ppi++ and abc) and ABC's ŵ (abc), and the wall time per run (fit and test); and how
often each judge agrees with the truth. Writes ``$OUT/abc_align.json`` with every run when ``OUT``
is set.

``--device cpu --quick`` runs a tiny version in seconds (a smoke test, numbers meaningless).
Exits non-zero without CUDA unless ``--device cpu``.
"""

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from _common import (  # bench/gpu/_common.py
    add_run_arguments,
    bench_device,
    finish_runs,
    mean_std,
    quiet_trainer,
)
from lightning.pytorch import seed_everything

from ada_modules.data import PreferenceDataModule
from ada_modules.models import RewardModelModule

SLUG = "abc_align"
JUDGES = {
    "length": {"judge_accuracy": 0.9, "judge_length_bias": 1.0},
    "noisy": {"judge_accuracy": 0.85, "judge_length_bias": 0.2},
}


@dataclass(frozen=True)
class Size:
    model: dict[str, int]
    data: dict[str, int]
    steps: int
    judges: tuple[str, ...]
    arms: tuple[str, ...]
    seeds: tuple[int, ...]


FULL = Size(
    model={"hidden_size": 256, "num_layers": 4, "num_heads": 8, "intermediate_size": 1024},
    data={
        "max_length": 24,
        "num_labelled": 64,
        "num_unlabelled": 20_000,
        "num_val": 1,
        "num_test": 2000,
        "batch_size": 256,
        "labelled_batch_size": 32,
    },
    steps=600,
    judges=("length", "noisy"),
    arms=("human", "pseudo", "ppi++", "abc"),
    seeds=(0, 1),
)
QUICK = Size(
    model={"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32},
    data={
        "max_length": 6,
        "num_labelled": 8,
        "num_unlabelled": 64,
        "num_val": 1,
        "num_test": 32,
        "batch_size": 16,
        "labelled_batch_size": 4,
    },
    steps=3,
    judges=("length", "noisy"),
    arms=("human", "abc"),
    seeds=(0,),
)


def run(judge: str, arm: str, seed: int, size: Size, device: torch.device) -> dict[str, Any]:
    """Fit and test one reward model; the test accuracy, λ̂, ŵ and the wall time."""
    seed_everything(seed, verbose=False)
    data = PreferenceDataModule(**JUDGES[judge], **size.data, seed=seed)
    module = RewardModelModule(
        estimator=arm,
        **size.model,
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
    )
    trainer = quiet_trainer(device, max_steps=size.steps)
    begin = time.perf_counter()
    trainer.fit(module, datamodule=data)
    trainer.test(module, datamodule=data, verbose=False)
    wall = time.perf_counter() - begin
    weights = module.weights
    unlabelled = data.splits["unlabelled"]
    return {
        "judge": judge,
        "arm": arm,
        "seed": seed,
        "test_accuracy": float(trainer.callback_metrics["test/accuracy"]),
        "lambda": weights.lam,
        "abc_weight": weights.weight,
        "bias2": None if math.isnan(weights.bias2) else weights.bias2,
        "coefficients": [weights.a_h, weights.a_p, weights.a_u],
        "notes": list(weights.notes),
        "judge_agreement": float((unlabelled.judge == unlabelled.truth).double().mean()),
        "steps": trainer.global_step,
        "wall_s": wall,
    }


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
    print(f"# ABC-Align GPU benchmark ({'quick' if args.quick else 'full'}) on {name}\n")
    begin = time.perf_counter()
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    per_run = 0.0
    for seed in size.seeds:
        for judge in size.judges:
            for arm in size.arms:
                human = [r for r in runs if r["arm"] == "human" and r["seed"] == seed]
                if arm == "human" and human:  # the same run: it never sees the judge's labels
                    reused = {"judge_agreement": None, "reused_from": human[0]["judge"]}
                    runs.append({**human[0], "judge": judge, **reused})
                    continue
                if runs and time.perf_counter() - begin + per_run * 1.2 > args.budget_s:
                    skipped.append(f"{judge}/{arm}/seed{seed}")
                    continue
                record = run(judge, arm, seed, size, device)
                runs.append(record)
                per_run = max(per_run, record["wall_s"])
                print(
                    f"{judge} / {arm} / seed {seed}: test accuracy "
                    f"{record['test_accuracy']:.3f} in {record['wall_s']:.1f} s",
                    flush=True,
                )
    print("\n| judge | arm | seeds | test accuracy | λ̂ | ŵ | s / run |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for judge in size.judges:
        for arm in size.arms:
            rows = [r for r in runs if r["judge"] == judge and r["arm"] == arm]
            if not rows:
                continue
            lam = mean_std([r["lambda"] for r in rows]) if arm in ("ppi++", "abc") else "–"
            weight = mean_std([r["abc_weight"] for r in rows]) if arm == "abc" else "–"
            accuracy = mean_std([r["test_accuracy"] for r in rows])
            wall = mean_std([r["wall_s"] for r in rows])
            print(f"| {judge} | {arm} | {len(rows)} | {accuracy} | {lam} | {weight} | {wall} |")
    print()
    for judge in size.judges:
        by_seed = {
            r["seed"]: r["judge_agreement"]
            for r in runs
            if r["judge"] == judge and r["judge_agreement"] is not None
        }
        agreement = list(by_seed.values())
        if agreement:
            share = mean_std(agreement)
            print(f"judge {judge}: agrees with the truth on {share} of the unlabelled pairs")
    finish_runs(SLUG, name, args.quick, begin, skipped, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
