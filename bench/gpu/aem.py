"""AEM vs GRPO vs GRPO+Clip-Cov on the key-and-door maze with a larger model, on one GPU.

The CPU mini reproduction (``cli_configs/aem/repro.yaml``) at a larger scale: a randomly
initialised 4-layer, 256-wide Llama (about 3.2M parameters) on a 6x6 maze with 5 walls, warm-started
by 150 steps of imitating the noisy scripted demonstrator, then on-policy RL with 16 tasks x 16
episodes per step until 150,000 response tokens were sampled. Arms: GRPO, GRPO + Clip-Cov
(ratio 0.02), AEM (strength 0.5, ``balance`` schedule); seeds 0, 1, 2 while the time guard allows
(420 s by default; each arm of a seed starts from the same warm start). Every 30,000 tokens the
policy plays 128 held-out mazes, 4 sampled episodes each.

Prints one table: per arm, mean ± std over the finished seeds of the start, final and best
held-out success, the normalised area under the success-vs-tokens curve, the tokens to 50%
success (censored at the budget), the response-level entropy in the first and last third of the
budget, and the wall time. Writes ``$OUT/aem.json`` with every run when ``OUT`` is set.

``--device cpu --quick`` runs a tiny version in seconds (a smoke test, numbers meaningless).
Exits non-zero without CUDA unless ``--device cpu``.
"""

import argparse
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
from ada_modules.models import OnPolicyModule
from ada_modules.posttrain.envs import KeyDoorEnv

SLUG = "aem"
METRICS = (
    "val/success_start",
    "val/success",
    "val/success_best",
    "val/success_auc",
    "val/tokens_to_threshold",
    "train/response_entropy_early",
    "train/response_entropy_late",
)
ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"advantage": "grpo"},
    "grpo_clip_cov": {"advantage": "grpo", "clip_cov_ratio": 0.02},
    "aem": {"advantage": "aem", "advantage_kwargs": {"strength": 0.5, "schedule": "balance"}},
}


@dataclass(frozen=True)
class Size:
    model: dict[str, int]
    maze: dict[str, int]
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
    maze={"size": 6, "num_walls": 5},
    tasks_per_step=16,
    group_size=16,
    sft_steps=150,
    budget=150_000,
    eval_every=30_000,
    eval_tasks=128,
    eval_samples=4,
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
    maze={"size": 4, "num_walls": 1},
    tasks_per_step=2,
    group_size=4,
    sft_steps=1,
    budget=30,
    eval_every=30,
    eval_tasks=2,
    eval_samples=1,
    seeds=(0,),
)


def run_arm(arm: str, seed: int, size: Size, device: torch.device) -> dict[str, Any]:
    """Warm start + RL for one arm and seed; returns the final logged metrics."""
    seed_everything(seed, verbose=False)
    module = OnPolicyModule(
        **size.model,
        max_position_embeddings=1024,
        group_size=size.group_size,
        sft_steps=size.sft_steps,
        sft_lr=3e-3,
        max_sampled_tokens=size.budget,
        eval_every_tokens=size.eval_every,
        eval_tasks=size.eval_tasks,
        eval_samples=size.eval_samples,
        success_threshold=0.5,
        optimizer=lambda params: torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0),
        **ARMS[arm],
    )
    data = EnvTaskDataModule(
        KeyDoorEnv(**size.maze, slack=2, noise=0.3),
        seed=seed,
        num_train=50_000,
        num_val=size.eval_tasks,
        num_test=16,
        batch_size=size.tasks_per_step,
    )
    trainer = quiet_trainer(device)
    start = time.perf_counter()
    trainer.fit(module, data)
    metrics = {name: float(trainer.callback_metrics[name]) for name in METRICS}
    metrics["wall_s"] = time.perf_counter() - start
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
    print(f"# AEM GPU benchmark ({'quick' if args.quick else 'full'}) on {name}\n")
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    skipped: list[str] = []
    per_run = 0.0
    for seed in size.seeds:
        for arm in ARMS:
            elapsed = time.perf_counter() - start
            if runs and elapsed + per_run * 1.2 > args.budget_s:
                skipped.append(f"{arm}/seed{seed}")
                continue
            record = {"arm": arm, "seed": seed, **run_arm(arm, seed, size, device)}
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
        if not rows:
            continue
        cells = [mean_std([r[m] for r in rows]) for m in METRICS]
        print(
            f"| {arm} | {len(rows)} | "
            + " | ".join(cells)
            + f" | {mean_std([r['wall_s'] for r in rows])} |"
        )
    finish_runs(SLUG, name, args.quick, start, skipped, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
