"""AVSD vs single-view self-distillation vs GRPO on sorting eight digits, with a larger model, on one GPU.

The CPU mini reproduction (``cli_configs/avsd/repro.yaml``) at a larger scale: a randomly
initialised 4-layer, 256-wide Llama (about 3.2M parameters) warm-started once per seed by 800
supervised steps (half the examples after a privileged view), then, from that warm start, each arm
trains on-policy with 16 tasks x 8 samples per step until 60,000 response tokens were sampled.
Arms: GRPO, single-view self-distillation from the solution view, the arithmetic and the geometric
pool of the four views, AVSD (adaptive gate, residual weight), and AVSD + GRPO (half each). Seeds
0, 1, 2 while the time guard allows (420 s by default). The premise is logged when RL starts: the
warm start without a view and with each view in its context.

Prints one table: per arm, mean ± std over the finished seeds of the start and final held-out
success (Avg@8 on 128 tasks), the best, the normalised area under the success-vs-tokens curve,
the tokens to 70% success (censored at the budget) and the wall time; and the premise. Writes
``$OUT/avsd.json`` with every run when ``OUT`` is set.

``--device cpu --quick`` runs a tiny version in seconds (a smoke test, numbers meaningless).
Exits non-zero without CUDA unless ``--device cpu``.
"""

import argparse
import copy
import sys
import time
from dataclasses import dataclass
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

from ada_modules.data import EnvTaskDataModule
from ada_modules.models import SelfDistillationModule
from ada_modules.posttrain.envs import SortingEnv

SLUG = "avsd"
VIEWS = {
    "solution": "[{solution}]",
    "partial": "[{partial}]",
    "feedback": "[{feedback}]",
    "noisy": "[{noisy}]",
}
METRICS = (
    "val/success_start",
    "val/success",
    "val/success_best",
    "val/success_auc",
    "val/tokens_to_threshold",
)
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"distillation_weight": 0.0},
    "sd_solution": {"teacher_views": ["solution"]},
    "arith": {"gate": 1.0, "residual_scale": 0.0},
    "geo": {"gate": 0.0, "residual_scale": 0.0},
    "avsd": {},
    "avsd_grpo": {"distillation_weight": 0.5},
}


@dataclass(frozen=True)
class Size:
    model: dict[str, int]
    length: int
    tasks_per_step: int
    group_size: int
    sft_steps: int
    budget: int
    eval_every: int
    eval_tasks: int
    eval_samples: int
    seeds: tuple[int, ...]


FULL = Size(
    model={
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 8,
        "intermediate_size": 1024,
    },
    length=8,
    tasks_per_step=16,
    group_size=8,
    sft_steps=800,
    budget=60_000,
    eval_every=15_000,
    eval_tasks=128,
    eval_samples=8,
    seeds=(0, 1, 2),
)
QUICK = Size(
    model={
        "hidden_size": 32,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 2,
        "intermediate_size": 64,
    },
    length=3,
    tasks_per_step=2,
    group_size=2,
    sft_steps=2,
    budget=20,
    eval_every=20,
    eval_tasks=2,
    eval_samples=1,
    seeds=(0,),
)


def _module(size: Size, sft_steps: int, **arm: Any) -> SelfDistillationModule:
    arm = {"gate": "adaptive", "residual_scale": -0.5, **arm}
    return SelfDistillationModule(
        views=VIEWS,
        teacher="base",
        **{**size.model, "max_position_embeddings": 256},
        group_size=size.group_size,
        sft_steps=sft_steps,
        sft_lr=3e-3,
        max_sampled_tokens=size.budget,
        eval_every_tokens=size.eval_every,
        eval_tasks=size.eval_tasks,
        eval_samples=size.eval_samples,
        success_threshold=0.7,
        optimizer=lambda params: torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0),
        **arm,
    )


def _fit(module: SelfDistillationModule, size: Size, seed: int, device: torch.device, **kw):
    data = EnvTaskDataModule(
        SortingEnv(length=size.length, noise=0.5, view_noise=0.2),
        seed=seed,
        num_train=50_000,
        num_val=size.eval_tasks,
        num_test=16,
        batch_size=size.tasks_per_step,
    )
    trainer = quiet_trainer(device, **kw)
    trainer.fit(module, data)
    return trainer


def warm_start(seed: int, size: Size, device: torch.device) -> dict[str, torch.Tensor]:
    """The supervised warm start of a seed (shared by its arms): the policy's weights."""
    seed_everything(seed, verbose=False)
    module = _module(size, size.sft_steps)
    _fit(module, size, seed, device, max_steps=size.sft_steps)
    return copy.deepcopy(module.model.state_dict())


def run_arm(arm: str, seed: int, start: dict, size: Size, device: torch.device) -> dict[str, Any]:
    """RL of one arm from the seed's warm start; returns the final logged metrics."""
    seed_everything(seed, verbose=False)
    module = _module(size, 0, **ARMS[arm])
    module.model.load_state_dict(start)
    begin = time.perf_counter()
    trainer = _fit(module, size, seed, device)
    metrics = {name: float(trainer.callback_metrics[name]) for name in METRICS}
    for view in VIEWS:
        metrics[f"teacher_{view}"] = float(trainer.callback_metrics[f"val/teacher_success_{view}"])
    metrics["wall_s"] = time.perf_counter() - begin
    metrics["rl_steps"] = module.rl_steps
    metrics["curve"] = module.curve
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    found = bench_device(args.device)
    if found is None:
        return 1
    device, name = found
    size = QUICK if args.quick else FULL
    print(f"# AVSD GPU benchmark ({'quick' if args.quick else 'full'}) on {name}\n")
    begin = time.perf_counter()
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    per_run = 0.0
    for seed in size.seeds:
        if runs and time.perf_counter() - begin + per_run * (len(ARMS) + 2) > args.budget_s:
            skipped.append(f"seed{seed}")
            continue
        tic = time.perf_counter()
        start = warm_start(seed, size, device)
        print(f"seed {seed}: warm start in {time.perf_counter() - tic:.0f} s", flush=True)
        for arm in ARMS:
            if runs and time.perf_counter() - begin + per_run * 1.2 > args.budget_s:
                skipped.append(f"{arm}/seed{seed}")
                continue
            record = {"arm": arm, "seed": seed, **run_arm(arm, seed, start, size, device)}
            runs.append(record)
            per_run = max(per_run, record["wall_s"])
            print(
                f"{arm} seed {seed}: success {record['val/success_start']:.3f} -> "
                f"{record['val/success']:.3f} in {record['wall_s']:.0f} s",
                flush=True,
            )
    print("\n| arm | seeds | " + " | ".join(METRICS) + " | wall s |")
    print("| --- | ---: |" + " ---: |" * (len(METRICS) + 1))
    for arm in ARMS:
        rows = [r for r in runs if r["arm"] == arm]
        if rows:
            cells = [mean_std([r[m] for r in rows]) for m in METRICS]
            wall = mean_std([r["wall_s"] for r in rows])
            print(f"| {arm} | {len(rows)} | " + " | ".join(cells) + f" | {wall} |")
    first = {r["seed"]: r for r in runs}.values()  # one record per seed: the premise
    print("\n| context | warm-start success |\n| --- | ---: |")
    print(f"| no view | {mean_std([r['val/success_start'] for r in first])} |")
    for view in VIEWS:
        print(f"| {view} view | {mean_std([r[f'teacher_{view}'] for r in first])} |")
    finish_runs(SLUG, name, args.quick, begin, skipped, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
