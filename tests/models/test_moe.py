from functools import partial

import pytest
import torch
from helpers.distributed import run_ranks

from ada_modules.data import ArithmeticDataModule
from ada_modules.models.moe import MoELMModule


def _small(**kwargs) -> MoELMModule:
    defaults = {"d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 32, "max_seq_len": 64}
    return MoELMModule(**{**defaults, **kwargs})


def _batch() -> dict:
    dm = ArithmeticDataModule(min_digits=1, max_digits=2, seed=0, num_train=32, batch_size=32)
    dm.setup("fit")
    return next(iter(dm.train_dataloader()))


def test_training_steps_reduce_the_loss_on_a_fixed_batch(seed):
    module = _small(optimizer=partial(torch.optim.AdamW, lr=3e-3))
    optimizer = module.configure_optimizers()
    batch = _batch()
    first = module._losses(batch)[0].item()
    for _ in range(30):
        optimizer.zero_grad()
        loss, aux, _ = module._losses(batch)
        (loss + module.aux_loss_weight * aux).backward()
        optimizer.step()
    last = module._losses(batch)[0].item()
    assert last < 0.5 * first


def test_state_dict_round_trip_gives_the_same_logits(seed):
    module = _small()
    other = _small()
    ids = _batch()["input_ids"]
    assert not torch.equal(module(ids), other(ids))
    other.load_state_dict(module.state_dict())
    assert torch.equal(module(ids), other(ids))
    assert tuple(module.state_dict()["model.blocks.0.moe.experts.w_in"].shape) == (8, 32, 32)


def test_fit_and_test_log_the_metrics_on_one_cpu_process(seed, cpu_trainer):
    module = _small()
    trainer = cpu_trainer(max_steps=3, val_check_interval=3, check_val_every_n_epoch=None)
    dm = ArithmeticDataModule(max_digits=2, seed=0, num_train=96, num_val=16, num_test=16)
    trainer.fit(module, dm)
    assert {"train/loss", "train/aux_loss", "val/loss", "val/token_accuracy"} <= set(
        trainer.callback_metrics
    )
    result = trainer.test(module, dm, verbose=False)[0]
    assert set(result) == {"test/loss", "test/token_accuracy"}
    assert 0 <= result["test/token_accuracy"] <= 1


def test_configure_model_without_a_mesh_leaves_the_model_unsharded():
    module = _small()
    module.configure_model()
    assert type(module.model).__name__ == "MoETransformer"


def test_too_long_input_is_rejected():
    module = _small(max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        module(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 9}, "top_k=9 must not exceed num_experts=8"),
        ({"num_heads": 3}, "divisible by num_heads=3"),
        ({"d_model": 0}, "d_model must be a positive integer"),
        ({"aux_loss_weight": -1.0}, "aux_loss_weight"),
        ({"fsdp_param_dtype": "float16"}, "fsdp_param_dtype"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _small(**kwargs)


def _sharded_step(rank: int, port: int, mesh_shape: tuple[int, int], results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        module = _small()
        reference = _small()
        reference.load_state_dict(module.state_dict())
        module._device_mesh = init_device_mesh(
            "cpu", mesh_shape, mesh_dim_names=("data_parallel", "tensor_parallel")
        )
        module.configure_model()
        experts = module.model.blocks[0].moe.experts
        w_in = experts.w_in
        batch = _batch()
        # Every rank sees the same batch, so the sharded loss equals the unsharded one.
        loss = module._losses(batch)[0]
        loss.backward()
        ref_loss = reference._losses(batch)[0]
        ref_loss.backward()
        grad = w_in.grad.full_tensor()
        results.put(
            (
                rank,
                {
                    "fsdp": [isinstance(m, FSDPModule) for m in (experts, module.model)],
                    "local": tuple(w_in.to_local().shape) if isinstance(w_in, DTensor) else None,
                    "loss": (loss.item(), ref_loss.item()),
                    "grad_close": bool(
                        torch.allclose(
                            grad, reference.model.blocks[0].moe.experts.w_in.grad, atol=1e-6
                        )
                    ),
                },
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("mesh_shape", [(2, 1), (1, 2)], ids=["data_parallel", "tensor_parallel"])
def test_configure_model_shards_the_stacked_experts_over_two_gloo_ranks(mesh_shape):
    outputs, exit_codes = run_ranks(_sharded_step, mesh_shape, world_size=2, timeout=120)
    assert exit_codes == [0, 0]
    for out in outputs.values():
        assert out["fsdp"] == [True, True]
        assert out["local"] == (4, 32, 32)  # 8 experts sharded over 2 ranks along dim 0
        assert out["loss"][0] == pytest.approx(out["loss"][1], abs=1e-5)
        assert out["grad_close"]
