"""OnPolicyModule under FSDP2 on 2 gloo ranks: the ranks stay in step, and AdERA is exact.

The ranks play episodes of different lengths (one turn on rank 0, three on rank 1, and responses
ending at different tokens) and different numbers of episodes (so of PPO minibatches), so without
the module's lockstep they would run different numbers of forward passes and hang in FSDP2's
all-gathers (the watchdog then ends the ranks). The test forks the two ranks itself and sets
``LOCAL_RANK`` & co., so Lightning does not launch processes (it would re-run pytest).
"""

import hashlib
import random
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.distributed import run_ranks, set_rank_env
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy

from ada_modules.data import EnvTaskDataModule
from ada_modules.models import OnPolicyModule
from ada_modules.posttrain.envs import Episode, TextEnv
from ada_modules.strategies import AdERAStrategy

WORLD_SIZE = 2
WATCHDOG_S = 100  # a rank still running after this (a deadlock) is killed by SIGALRM

TINY = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}


class _TurnsEpisode(Episode):
    def __init__(self, turns: int) -> None:
        self.observation = "go:"
        self.target = turns

    def step(self, action: str) -> None:
        self._begin_step()
        self.success = action.startswith("a")
        self.reward = float(self.success)
        self.done = self.turns >= self.target
        self.observation = "again:"


class _RankTurnsEnv(TextEnv):
    """Episodes of one turn on rank 0 and three on rank 1: the ranks' rollouts differ."""

    def __init__(self) -> None:
        super().__init__(max_turns=3, max_action_tokens=3)

    def task_id(self, seed: int) -> str:
        return str(seed)

    def reset(self, seed: int) -> Episode:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return _TurnsEpisode(1 + 2 * rank)

    def demonstrator_action(self, episode: Episode, rng: random.Random) -> str:
        return rng.choice(["a", "ab", "b"])


def _fit(strategy, tmp: str, rank: int) -> dict:
    from torch.distributed.fsdp import FSDPModule

    seed_everything(0, verbose=False)
    module = OnPolicyModule(
        **TINY,
        group_size=2,
        kl_coef=0.05,
        num_minibatches=3,
        sft_steps=1,
        max_sampled_tokens=120,
        eval_every_tokens=50,
        eval_tasks=2,
        eval_samples=1,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    # Rank 1 plays 3 episodes per task: 6 episodes make 3 minibatches, rank 0's 4 only 2.
    module.group_size = 2 + rank
    forwards, updates = [0], [0]
    module.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    dummies = [0]
    sample = module._sample

    def counting_sample(contexts: list, *args: object) -> list:
        dummies[0] += contexts == [[module.tokenizer.bos_id]]
        return sample(contexts, *args)

    module._sample = counting_sample
    step = module._step

    def counting_step(*args: object) -> None:
        updates[0] += 1
        step(*args)

    module._step = counting_step
    datamodule = EnvTaskDataModule(
        _RankTurnsEnv(), num_train=16, num_val=4, num_test=4, batch_size=2
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        max_epochs=-1,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    trainer.fit(module, datamodule)
    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()  # the root stays unsharded after a forward without backward
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.full_tensor().detach().numpy().tobytes())
    metrics = trainer.callback_metrics
    names = ("train/loss", "train/sft_loss", "train/kl", "val/success", "val/response_length")
    return {
        "params": digest.hexdigest(),
        "forwards": forwards[0],
        "updates": updates[0],
        "dummy_samples": dummies[0],
        "progress": (module.sft_done, module.rl_steps, module.sampled_tokens, module.curve),
        "metrics": {name: float(metrics[name]) for name in names},
        "compressed_gathers": float(metrics.get("train/adera_compressed_gathers", 0.0)),
    }


def _worker(rank: int, port: int, tmp: str, queue: "mp.Queue") -> None:
    signal.alarm(WATCHDOG_S)
    set_rank_env(rank, port, WORLD_SIZE)
    torch.set_num_threads(1)
    sizes = {"data_parallel_size": WORLD_SIZE, "tensor_parallel_size": 1}
    try:
        plain = _fit(ModelParallelStrategy(**sizes), tmp, rank)
        adera = _fit(AdERAStrategy(**sizes, mode="always", min_numel=256), tmp, rank)
        queue.put((rank, {"plain": plain, "adera": adera}))
    except Exception as exc:
        queue.put((rank, {"error": repr(exc)}))
        raise


@pytest.mark.distributed
def test_sharded_rl_keeps_the_ranks_in_step_and_adera_is_exact(tmp_path):
    results, exitcodes = run_ranks(
        _worker, str(tmp_path), world_size=WORLD_SIZE, timeout=WATCHDOG_S + 10
    )
    assert all("error" not in r for r in results.values()), results
    assert exitcodes == [0] * WORLD_SIZE
    for name in ("plain", "adera"):
        runs = [results[rank][name] for rank in range(WORLD_SIZE)]
        first, second = runs
        # Rank 0's episodes end after one turn: it sampled dummy responses for rank 1's turns,
        # and both ranks ran the same forward passes.
        assert first["dummy_samples"] > 0 and second["dummy_samples"] == 0
        assert first["forwards"] == second["forwards"]
        # One budget for both ranks: the same steps, tokens and success curve.
        assert first["progress"] == second["progress"]
        sft_done, rl_steps, sampled_tokens, curve = first["progress"]
        assert sft_done == 1 and rl_steps >= 2 and sampled_tokens >= 120 and len(curve) >= 3
        # 3 minibatch updates per RL step on both ranks (rank 0 adds a zero-loss one).
        assert first["updates"] == second["updates"] == sft_done + 3 * rl_steps
        for run in runs:
            assert all(torch.isfinite(torch.tensor(v)) for v in run["metrics"].values()), run
        assert first["params"] == second["params"]
    assert results[0]["adera"]["compressed_gathers"] > 0
    assert results[0]["plain"]["params"] == results[0]["adera"]["params"]
    assert results[0]["plain"]["forwards"] == results[0]["adera"]["forwards"]
