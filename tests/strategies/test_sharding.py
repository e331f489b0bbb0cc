"""``shard_module`` & co.: which blocks are found, bad input, and FSDP2 in a Lightning ``Trainer``.

The unit tests need no process group. The distributed tests share one fork of 2 gloo ranks (a
module-scoped fixture runs every case once and the tests read its results), set up as in
``test_adera_strategy.py``: the test sets ``LOCAL_RANK`` & co. itself, so Lightning launches no
processes.
"""

import math
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from helpers.distributed import free_port, set_rank_env
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ada_modules.errors import InputError
from ada_modules.models.causal_lm import CausalLMModule
from ada_modules.models.classifier import ImageClassifierModule
from ada_modules.nn import ConnectivityWrapper
from ada_modules.strategies import AdERAStrategy
from ada_modules.strategies.sharding import check_shard_spec, find_blocks, shard_module

TINY_LM = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 2,
    "intermediate_size": 64,
}


def _names(blocks: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in blocks]


class _Nested(nn.Module):
    """A stem outside any container, a Sequential and a ModuleList with parameter-free layers."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), _Block(), nn.Dropout())
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Identity()])


class _Block(nn.Module):
    """A block that holds a container of its own (not a block: it is inside one)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.norm = nn.LayerNorm(8)


# --- find_blocks -----------------------------------------------------------------------------


def test_find_blocks_takes_hugging_face_no_split_modules():
    module = CausalLMModule(**TINY_LM)
    blocks = find_blocks(module)
    assert _names(blocks) == ["model.model.layers.0", "model.model.layers.1"]
    assert [b for _, b in blocks] == list(module.model.model.layers)
    assert {type(b).__name__ for _, b in blocks} == {"LlamaDecoderLayer"}


def test_find_blocks_finds_decoder_layers_inside_routed_blocks():
    module = CausalLMModule(**TINY_LM, model_wrapper=ConnectivityWrapper(mode="source"))
    blocks = find_blocks(module)
    assert _names(blocks) == ["model.model.layers.0.block", "model.model.layers.1.block"]
    assert {type(b).__name__ for _, b in blocks} == {"LlamaDecoderLayer"}


def test_find_blocks_falls_back_to_the_layers_of_outermost_containers():
    # stem is in no container; ReLU, Dropout and Identity have no parameters; _Block's own
    # Sequential is inside a block, so it gives no blocks of its own.
    model = _Nested()
    assert _names(find_blocks(model)) == ["body.0", "body.2", "heads.0"]
    # The model itself is never a block; a bare Sequential gives its layers with parameters.
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert _names(find_blocks(net)) == ["0", "2"]
    assert find_blocks(nn.Linear(2, 2)) == []


def test_find_blocks_ignores_containers_nested_directly_in_a_container():
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    assert _names(find_blocks(model)) == ["body.0", "body.1"]  # got body.0, body.1, body.1.0, ...


def test_find_blocks_by_class_class_name_and_name_pattern():
    model = _Nested()
    linears = ["stem", "body.0", "body.2.mlp.0", "body.2.mlp.2", "heads.0"]
    assert _names(find_blocks(model, shard=[nn.Linear])) == linears
    assert _names(find_blocks(model, shard=["Linear"])) == linears
    assert _names(find_blocks(model, shard=["_Block", nn.LayerNorm])) == ["body.2", "body.2.norm"]
    assert _names(find_blocks(model, shard=["heads.*"])) == ["heads.0"]
    assert _names(find_blocks(model, shard=("stem", "body.2"))) == ["stem", "body.2"]
    # modules without parameters are never blocks, and shard= overrides _no_split_modules
    assert find_blocks(model, shard=["ReLU", "heads.1"]) == []
    lm = CausalLMModule(**TINY_LM)
    assert _names(find_blocks(lm, shard=["model.lm_head"])) == ["model.lm_head"]


@pytest.mark.parametrize(
    ("shard", "match"),
    [
        ("Linear", r"non-empty list .*got 'Linear'"),
        (nn.Linear, r"non-empty list .*got <class 'torch.nn.modules.linear.Linear'>"),
        ([], r"non-empty list .*got \[\]"),
        (3, r"non-empty list .*got 3"),
        ([int], r"nn.Module classes or non-empty strings, got <class 'int'>"),
        ([3], r"nn.Module classes or non-empty strings, got 3"),
        (["Linear", ""], r"nn.Module classes or non-empty strings, got ''"),
    ],
)
def test_bad_shard_specs_are_rejected(shard, match):
    for check in (check_shard_spec, lambda s: find_blocks(nn.Linear(2, 2), shard=s)):
        with pytest.raises(InputError, match=match) as info:
            check(shard)
        assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
        assert str(info.value).startswith("shard")


@pytest.mark.parametrize("shard", ["Linear", [], [3], [int]])
def test_adera_strategy_rejects_a_bad_shard_at_construction(shard):
    with pytest.raises(InputError, match="shard"):
        AdERAStrategy(shard=shard)


def test_adera_strategy_keeps_a_copy_of_shard():
    shard = ["Linear"]
    strategy = AdERAStrategy(shard=shard)
    shard.append("Conv2d")
    assert strategy.shard == ["Linear"] and AdERAStrategy().shard is None


# --- shard_module without a process group ------------------------------------------------------


def test_shard_module_without_a_mesh_does_nothing():
    from torch.distributed.fsdp import FSDPModule

    for module in (nn.Linear(2, 2), CausalLMModule(**TINY_LM)):  # no blocks / blocks
        assert shard_module(module, None) == []
        assert shard_module(module, None, shard=["Linear"]) == []
        assert not any(isinstance(m, FSDPModule) for m in module.modules())


class _NoBlocks(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)


class _DirectParameter(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.scale = nn.Parameter(torch.ones(()))


# shard_module raises before it looks at the mesh (which it only passes to fully_shard), so any
# non-None stand-in does for these: no process group needed.
_MESH = object()


def test_shard_module_without_blocks_names_the_class_and_shard():
    with pytest.raises(InputError, match=r"cannot shard _NoBlocks: no blocks found") as info:
        shard_module(_NoBlocks(), _MESH)
    assert "shard=[" in str(info.value) and "configure_model" in str(info.value)
    with pytest.raises(InputError, match=r"cannot shard Linear: .*nothing matched shard=\['Conv"):
        shard_module(nn.Linear(2, 2), _MESH, shard=["Conv2d"])


def test_shard_module_rejects_parameters_held_by_a_lightning_module():
    with pytest.raises(InputError, match=r"_DirectParameter: it holds parameters \['scale'\]"):
        shard_module(_DirectParameter(), _MESH)


# --- 2 gloo ranks ------------------------------------------------------------------------------

WORLD_SIZE = 2
SIZES = {"data_parallel_size": WORLD_SIZE, "tensor_parallel_size": 1}
# A hung collective fails after this instead of the 30-minute default (the first strategy's
# timeout is the process group's).
TIMEOUT = timedelta(seconds=60)
MLP_STEPS = 6
LM_STEPS = 8  # 2 epochs of 4 batches per rank: the checkpoint at LM_STEPS // 2 ends epoch 0


class _UserMLP(LightningModule):
    """A user's module: no configure_model, so AdERAStrategy(shard=...) has to shard it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
        )

    def training_step(self, batch: list, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(MLP_STEPS * WORLD_SIZE * 8, 16, generator=gen)
        return DataLoader(TensorDataset(x, torch.sin(x[:, :4])), batch_size=8)


class _SelfShardingMLP(_UserMLP):
    def configure_model(self) -> None:
        shard_module(self, self.device_mesh, shard=["Linear"])


def _trainer(strategy, tmp: str, max_steps: int, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
        **kwargs,
    )


def _local_params(module: nn.Module) -> list[torch.Tensor]:
    """This rank's shards, after resharding (FSDP2 leaves the root gathered after a forward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return [p.to_local().detach().clone() for p in module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def _fsdp_names(module: nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return [n for n, m in module.named_modules() if isinstance(m, FSDPModule)]


def _case_user_module(tmp: str) -> dict:
    reference = _SelfShardingMLP()
    _trainer(ModelParallelStrategy(**SIZES, timeout=TIMEOUT), tmp, MLP_STEPS).fit(reference)
    user = _UserMLP()
    strategy = AdERAStrategy(
        **SIZES, timeout=TIMEOUT, mode="always", min_numel=256, shard=["Linear"]
    )
    trainer = _trainer(strategy, tmp, MLP_STEPS)
    trainer.fit(user)
    return {
        "equal": _same(_local_params(reference), _local_params(user)),
        "fsdp": _fsdp_names(user),
        "reference_fsdp": _fsdp_names(reference),
        "compressed": float(trainer.callback_metrics["train/adera_compressed_gathers"]),
    }


def _case_unsharded_user_module(tmp: str) -> dict:
    strategy = AdERAStrategy(**SIZES, timeout=TIMEOUT, mode="always", min_numel=256)
    try:
        _trainer(strategy, tmp, MLP_STEPS).fit(_UserMLP())
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "input_error": isinstance(exc, InputError),
            "msg": str(exc),
        }
    return {"type": None}


class _SaveAt(Callback):
    """``trainer.save_checkpoint(path)`` after training step ``step`` (no ModelCheckpoint)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _lm_fit(tmp: str, callbacks: list, ckpt: str | None = None) -> tuple[CausalLMModule, Trainer]:
    from transformers import DynamicCache

    from ada_modules.data import RecallDataModule

    torch.manual_seed(0)
    module = CausalLMModule(**TINY_LM, max_new_tokens=6, cache_factory=DynamicCache)
    data = RecallDataModule(
        num_pairs=4, seed=0, num_train=64, num_val=8, num_test=8, batch_size=8, eval_batch_size=4
    )
    strategy = AdERAStrategy(**SIZES, timeout=TIMEOUT, mode="always", min_numel=256)
    trainer = _trainer(strategy, tmp, LM_STEPS, limit_val_batches=0, callbacks=callbacks)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    return module, trainer


def _case_causal_lm(tmp: str) -> dict:
    # The checkpoint is written during fit at the end of epoch 0: Lightning resumes exactly from
    # there. (Mid-epoch, a plain DataLoader restarts the epoch; after a fit that stopped at
    # max_steps on an epoch's last batch, the resumed fit runs one batch as epoch 1 batch 4.)
    path = os.path.join(tmp, "lm.ckpt")
    straight, _ = _lm_fit(tmp, [_SaveAt(LM_STEPS // 2, path)])
    straight_params = _local_params(straight)
    resumed, trainer = _lm_fit(tmp, [], ckpt=path)
    result = {
        "checkpoint_is_dir": os.path.isdir(path),
        "steps": trainer.global_step,
        "equal": _same(straight_params, _local_params(resumed)),
        "fsdp": _fsdp_names(resumed),
    }
    synced = []  # generate's synced_gpus, per call
    generate = resumed.model.generate

    def spy(*args: object, **kwargs: object) -> object:
        synced.append(kwargs.get("synced_gpus"))
        return generate(*args, **kwargs)

    resumed.model.generate = spy
    metrics = trainer.test(resumed, datamodule=trainer.datamodule, verbose=False)[0]
    result["test"] = {k: float(v) for k, v in metrics.items()}
    result["synced_gpus"] = synced
    return result


def _case_classifier(tmp: str) -> dict:
    from ada_modules.data.digits import DigitsDataModule

    torch.manual_seed(0)
    module = ImageClassifierModule(hidden_sizes=[16])
    trainer = _trainer(ModelParallelStrategy(**SIZES, timeout=TIMEOUT), tmp, 3, limit_val_batches=0)
    trainer.fit(module, datamodule=DigitsDataModule(seed=0, batch_size=32))
    return {
        "loss": float(trainer.callback_metrics["train/loss"]),
        "steps": trainer.global_step,
        "fsdp": _fsdp_names(module),
    }


CASES = {
    "user_module": _case_user_module,
    "unsharded_user_module": _case_unsharded_user_module,
    "causal_lm": _case_causal_lm,
    "classifier": _case_classifier,
}


def _worker(rank: int, port: int, tmp: str, queue: "mp.Queue") -> None:
    set_rank_env(rank, port, WORLD_SIZE)
    torch.set_num_threads(1)
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = case(os.path.join(tmp, name))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    queue.put((rank, results))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    """Every case's result on each rank, from one fork of 2 gloo ranks."""
    context = mp.get_context("fork")
    queue = context.Queue()
    port = free_port()
    tmp = str(tmp_path_factory.mktemp("sharding"))
    processes = [
        context.Process(target=_worker, args=(rank, port, tmp, queue), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    for process in processes:
        process.start()
    try:
        results = dict(queue.get(timeout=240) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
                process.join()
    assert sorted(results) == list(range(WORLD_SIZE))
    return results


def _result(ranks: dict[int, dict], case: str) -> list[dict]:
    results = [ranks[rank][case] for rank in range(WORLD_SIZE)]
    for result in results:
        assert "error" not in result, result["error"]
    return results


@pytest.mark.distributed
def test_adera_strategy_shards_a_user_module_like_shard_module(ranks):
    for result in _result(ranks, "user_module"):
        assert result["equal"]
        assert result["fsdp"] == result["reference_fsdp"] == ["net", "net.0", "net.2", "net.4"]
        assert result["compressed"] > 0


@pytest.mark.distributed
def test_adera_strategy_rejects_a_module_that_does_not_shard(ranks):
    for result in _result(ranks, "unsharded_user_module"):
        assert result["input_error"], result
        assert result["msg"].startswith("_UserMLP does not shard itself in configure_model")
        assert "shard=[" in result["msg"]


@pytest.mark.distributed
def test_causal_lm_resumes_exactly_and_generates_in_step(ranks):
    for result in _result(ranks, "causal_lm"):
        assert result["checkpoint_is_dir"] and result["steps"] == LM_STEPS
        assert result["fsdp"] == ["model", "model.model.layers.0", "model.model.layers.1"]
        assert result["equal"]
        assert result["synced_gpus"] == [True]  # one test batch per rank
        assert math.isfinite(result["test"]["test/loss"])
        assert 0 <= result["test"]["test/exact_match"] <= 1


@pytest.mark.distributed
def test_image_classifier_trains_under_model_parallel_strategy(ranks):
    for result in _result(ranks, "classifier"):
        assert result["steps"] == 3 and math.isfinite(result["loss"])
        assert result["fsdp"] == ["features", "features.1", "head"]
