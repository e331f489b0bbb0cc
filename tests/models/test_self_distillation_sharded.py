"""SelfDistillationModule under FSDP2 on 2 gloo ranks: a frozen (``"base"``) or EMA teacher
sharded like the policy, the ranks in step.

The ranks play different tasks, so their views, responses and targets differ; the teacher's
forward passes all-gather its shards, so a rank running a different number of them would hang
(the watchdog then ends the ranks). The test forks the two ranks itself and sets ``LOCAL_RANK``
& co., so Lightning does not launch processes.
"""

import hashlib
import signal

import pytest
import torch
import torch.multiprocessing as mp
from helpers.distributed import run_ranks, set_rank_env
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy

from ada_modules.data import EnvTaskDataModule
from ada_modules.models import SelfDistillationModule
from ada_modules.posttrain.envs import SortingEnv

WORLD_SIZE = 2
WATCHDOG_S = 100

TINY = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}


def _digest(module: torch.nn.Module) -> str:
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()  # the root stays unsharded after a forward without backward
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.full_tensor().detach().numpy().tobytes())
    return digest.hexdigest()


def _fit(teacher: str, tmp: str) -> dict:
    seed_everything(0, verbose=False)
    module = SelfDistillationModule(
        views={"solution": "[{solution}]", "partial": "[{partial}]"},
        teacher=teacher,
        teacher_ema_decay=0.5,
        **TINY,
        group_size=2,
        kl_coef=0.05,
        sft_steps=1,
        max_sampled_tokens=80,
        eval_tasks=2,
        eval_samples=1,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    datamodule = EnvTaskDataModule(
        SortingEnv(length=3), num_train=32, num_val=4, num_test=4, batch_size=2
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1),
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    trainer.fit(module, datamodule)
    metrics = trainer.callback_metrics
    return {
        "policy": _digest(module.model),
        "teacher": _digest(module.teacher_model()),
        "progress": (module.sft_done, module.rl_steps, module.sampled_tokens),
        "finite": all(
            bool(torch.isfinite(metrics[f"train/{name}"]))
            for name in ("loss", "gate", "disagreement", "distill_advantage")
        ),
    }


def _worker(rank: int, port: int, tmp: str, queue: "mp.Queue") -> None:
    signal.alarm(WATCHDOG_S)
    set_rank_env(rank, port, WORLD_SIZE)
    torch.set_num_threads(1)
    try:
        queue.put((rank, {teacher: _fit(teacher, tmp) for teacher in ("base", "ema")}))
    except Exception as exc:
        queue.put((rank, {"error": repr(exc)}))
        raise


@pytest.mark.distributed
def test_sharded_self_distillation_keeps_a_sharded_teacher_and_the_ranks_in_step(tmp_path):
    results, exitcodes = run_ranks(
        _worker, str(tmp_path), world_size=WORLD_SIZE, timeout=WATCHDOG_S + 10
    )
    assert all("error" not in r for r in results.values()), results
    assert exitcodes == [0] * WORLD_SIZE
    for teacher in ("base", "ema"):
        first, second = (results[rank][teacher] for rank in range(WORLD_SIZE))
        assert first == second  # the same weights, teacher and budget on both ranks
        sft_done, rl_steps, sampled_tokens = first["progress"]
        assert sft_done == 1 and rl_steps >= 2 and sampled_tokens >= 80
        assert first["finite"]
        assert first["teacher"] != first["policy"]  # the policy trained away from its teacher
    # The EMA teacher followed the policy; the base teacher stayed at the start of RL.
    assert results[0]["ema"]["teacher"] != results[0]["base"]["teacher"]
