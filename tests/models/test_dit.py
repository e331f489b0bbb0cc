"""The DiT LightningModule with and without AHPA's alignment head (shipped VAE and judge)."""

import json

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from ada_modules.data.shapes import ShapesDataModule
from ada_modules.errors import InputError
from ada_modules.models.dit import DiTModule, euler_sample

AHPA = {
    "levels": ["encoder.down_blocks.0", "encoder.down_blocks.1", "encoder.mid_block"],
    "block_index": 1,
    "router": "learned",
    "entropy_weight": 0.05,
}


def _module(**kwargs: object) -> DiTModule:
    seed_everything(0, verbose=False)
    defaults = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16}
    return DiTModule(**{**defaults, **kwargs})


def _trainer(tmp_path, **kwargs: object) -> Trainer:
    settings = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False}  # fmt: skip
    return Trainer(**{**settings, **kwargs}, default_root_dir=tmp_path)


def _data() -> ShapesDataModule:
    return ShapesDataModule(train_size=64, val_size=32, test_size=32, batch_size=16, seed=0)


def test_the_exported_denoiser_is_unchanged_by_the_head():
    module = _module(alignment=AHPA, num_samples=0).train()
    plain = _module(num_samples=0)
    assert sorted(module.export().state_dict()) == sorted(plain.export().state_dict())
    dit = module.dit.eval()  # eval: no random label dropout; the head catches in training mode
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([5.0, 950.0]), torch.tensor([3, 7])
    with_head = dit(x, timestep=t, class_labels=y).sample
    assert module.aligner._tokens is not None
    module.aligner.remove()
    assert torch.equal(with_head, dit(x, timestep=t, class_labels=y).sample)


def test_training_with_ahpa_moves_the_router_and_the_ema(tmp_path):
    module = _module(alignment=AHPA, num_samples=0)
    router = [p.detach().clone() for p in module.aligner.router.parameters()]
    ema = [p.detach().clone() for p in module.ema.parameters()]
    trainer = _trainer(tmp_path, max_steps=4, limit_val_batches=0)
    trainer.fit(module, datamodule=_data())
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and metrics["train/align_loss"] > 0
    assert {f"train/align/loss_{name}" for name in AHPA["levels"]} <= set(metrics)
    moved = [
        not torch.equal(a, b)
        for a, b in zip(router, module.aligner.router.parameters(), strict=True)
    ]
    assert any(moved)
    assert any(not torch.equal(a, b) for a, b in zip(ema, module.ema.parameters(), strict=True))


def test_test_reports_sample_metrics_and_writes_the_router_and_samples(tmp_path):
    module = _module(alignment=AHPA, num_samples=20, sample_steps=2)
    trainer = _trainer(tmp_path, max_steps=2, limit_val_batches=0, logger=True)
    data = _data()
    trainer.fit(module, datamodule=data)
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    for key in ("test/fd", "test/class_acc", "test/flow_loss", "test/fd_recon"):
        assert key in metrics
    assert 0 <= metrics["test/class_acc"] <= 1 and metrics["test/fd"] > metrics["test/fd_recon"]
    log_dir = trainer.log_dir
    record = json.loads((tmp_path / log_dir / "router.json").read_text())
    weights = torch.tensor(record["weights"])
    assert weights.shape == (21, 3) and torch.allclose(weights.sum(-1), torch.ones(21))
    assert (tmp_path / log_dir / "samples.png").exists()


def test_euler_sampling_is_fixed_by_its_generator():
    module = _module(num_samples=0).eval()
    labels = torch.tensor([0, 5])
    first = euler_sample(module.ema, labels, (4, 8, 8), 3, torch.Generator().manual_seed(1))
    again = euler_sample(module.ema, labels, (4, 8, 8), 3, torch.Generator().manual_seed(1))
    assert torch.equal(first, again) and first.shape == (2, 4, 8, 8)


def test_bad_alignment_settings_name_the_value():
    with pytest.raises(InputError, match="'encoder.down_blocks.9' is not a submodule"):
        _module(alignment={**AHPA, "levels": ["encoder.down_blocks.9"]})
    with pytest.raises(InputError, match="block_index 2 is out of range for 2"):
        _module(alignment={**AHPA, "block_index": 2})
    with pytest.raises(InputError, match="num_samples must be 0 or >= 2, got 1"):
        _module(num_samples=1)


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"patch_size": 3}, "patch_size 3 must divide the latent side 8"),
        ({"image_size": 28}, "patch_size 2 must divide the latent side 7"),
        ({"image_size": 30}, "image_size must be a positive multiple of 4.*got 30"),
        ({"image_size": 2}, "image_size must be a positive multiple of 4.*got 2"),
        ({"image_size": 0}, "image_size must be a positive multiple of 4.*got 0"),
        ({"patch_size": 0}, "patch_size must be an int >= 1, got 0"),
    ],
)
def test_sizes_the_dit_cannot_train_are_refused(sizes, match):
    with pytest.raises(InputError, match=match):
        _module(num_samples=0, alignment=AHPA, **sizes)


def test_the_learned_router_trains_in_bf16(tmp_path):
    module = _module(alignment=AHPA, num_samples=0)
    _trainer(tmp_path, max_steps=1, limit_val_batches=0, precision="bf16-true").fit(
        module, datamodule=_data()
    )
    assert module.aligner.router.mlp[0].weight.dtype == torch.bfloat16
    assert module.aligner.loss_ema.isfinite().all()
