"""``ImageTextQAModule`` and ``ModalitySteeringModule`` (AMPS): a tiny two-modality model fits and
tests; steering with no or zero strength reproduces the unsteered answers exactly; the MCR rule
gives no strength where the target modality already dominates; the steering vector is the mean
difference of instructed hidden states; the learned strength module trains and reloads from its
checkpoint; runs repeat on a fixed seed; bad input."""

import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from ada_modules.data.modality_conflict import ModalityConflictDataModule, with_instruction
from ada_modules.errors import InputError
from ada_modules.models import ImageTextQAModule, ModalitySteeringModule
from ada_modules.steering import mcr_scaled_strength

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def _data() -> ModalityConflictDataModule:
    return ModalityConflictDataModule(
        seed=0, train_size=256, val_size=32, test_size=16, max_noise=0.25, batch_size=32,
        eval_batch_size=64,
    )  # fmt: skip


def _trainer(max_steps: int = 0, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory) -> Path:
    """A tiny base model fitted for a few steps, saved as a checkpoint."""
    seed_everything(0)
    module = ImageTextQAModule(**TINY, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3))
    trainer = _trainer(max_steps=20, enable_checkpointing=False)
    trainer.fit(module, datamodule=_data())
    path = tmp_path_factory.mktemp("amps") / "base.ckpt"
    trainer.save_checkpoint(path)
    return path


def _steer_test(checkpoint: Path, **kwargs) -> dict[str, float]:
    seed_everything(0)
    module = ModalitySteeringModule(base_checkpoint=str(checkpoint), **kwargs)
    return _trainer().test(module, datamodule=_data(), verbose=False)[0]


def test_base_module_logs_preference_and_accuracy_per_kind(base_checkpoint):
    module = ImageTextQAModule.load_from_checkpoint(base_checkpoint)
    metrics = _trainer().test(module, datamodule=_data(), verbose=False)[0]
    rates = [f"test/{m}_rate{g}" for m in ("image", "text") for g in ("", "_sure", "_hedged")]
    assert set(metrics) == {"test/accuracy_consistent", "test/accuracy_conflict", *rates}
    for group in ("", "_sure", "_hedged"):
        total = metrics[f"test/text_rate{group}"] + metrics[f"test/image_rate{group}"]
        assert total == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs", [{"strength": "none"}, {"strength": "uniform", "alpha": 0.0}])
def test_no_steering_reproduces_the_unsteered_answers(base_checkpoint, kwargs):
    metrics = _steer_test(base_checkpoint, **kwargs)
    assert metrics["test/preference_shift"] == 0.0
    assert metrics["test/accuracy_drop"] == 0.0
    assert metrics["test/mean_strength"] == 0.0
    assert 0.0 <= metrics["test/mcr_auroc"] <= 1.0


def test_a_strong_uniform_strength_changes_answers(base_checkpoint):
    metrics = _steer_test(base_checkpoint, strength="uniform", alpha=50.0)
    assert metrics["test/mean_strength"] == 50.0
    changed = abs(metrics["test/preference_shift"]) + abs(metrics["test/accuracy_drop"])
    assert changed > 0 or metrics["test/unparseable"] > 0


def test_the_mcr_rule_matches_mcr_scaled_strength(base_checkpoint):
    """Per question: the strength of the module equals the rule on its MCR; none at or above the
    threshold."""
    seed_everything(0)
    module = ModalitySteeringModule(str(base_checkpoint), strength="mcr", alpha=4.0, threshold=0.5)
    data = _data()
    trainer = _trainer()
    trainer.test(module, datamodule=data, verbose=False)
    batch = next(iter(data.test_dataloader()))
    mcr = module.target_mcr(batch)
    strengths = module.strengths(batch, mcr)
    assert torch.equal(strengths, mcr_scaled_strength(mcr, 4.0, 0.5))
    assert torch.all(strengths[mcr >= 0.5] == 0)
    assert ((mcr >= 0) & (mcr <= 1)).all()


@pytest.mark.parametrize("direction", ["image", "text"])
def test_the_steering_vector_is_the_instructed_mean_difference(base_checkpoint, direction):
    seed_everything(0)
    module = ModalitySteeringModule(str(base_checkpoint), direction=direction, contrast_items=40)
    data = _data()
    _trainer().test(module, datamodule=data, verbose=False)
    items = data.items("train")
    rows = torch.nonzero((items.kind == 1) | (items.kind == 2))[:40, 0]
    batch = items[rows]
    follow_image = module._hidden_at_answer(with_instruction(batch, "i")).mean(0)
    follow_text = module._hidden_at_answer(with_instruction(batch, "t")).mean(0)
    expected = follow_image - follow_text if direction == "image" else follow_text - follow_image
    torch.testing.assert_close(module.direction_vector, expected)


def test_learned_strength_trains_reloads_and_repeats(base_checkpoint, tmp_path):
    def fit() -> tuple[ModalitySteeringModule, Trainer]:
        seed_everything(0)
        module = ModalitySteeringModule(str(base_checkpoint), strength="learned", alpha=4.0)
        trainer = _trainer(max_steps=4, enable_checkpointing=False)
        trainer.fit(module, datamodule=_data())
        return module, trainer

    module, trainer = fit()
    again, _ = fit()
    for a, b in zip(module.predictor.parameters(), again.predictor.parameters(), strict=True):
        assert torch.equal(a, b)
    assert trainer.callback_metrics["train/loss"].isfinite()
    path = tmp_path / "learned.ckpt"
    trainer.save_checkpoint(path)
    fresh = ModalitySteeringModule(str(base_checkpoint), strength="learned", alpha=4.0)
    metrics = _trainer().test(fresh, datamodule=_data(), ckpt_path=str(path), verbose=False)[0]
    for a, b in zip(module.predictor.parameters(), fresh.predictor.parameters(), strict=True):
        assert torch.equal(a, b)
    assert 0.0 <= metrics["test/mean_strength"] <= 4.0 and math.isfinite(metrics["test/repetition"])
    # load_from_checkpoint restores the base model, the predictor and the steering vector: it
    # tests on plain dataloaders (no datamodule needed) and gives the same metrics
    loaded = ModalitySteeringModule.load_from_checkpoint(path)
    assert torch.equal(loaded.direction_vector, module.direction_vector)
    for a, b in zip(module.predictor.parameters(), loaded.predictor.parameters(), strict=True):
        assert torch.equal(a, b)
    data = _data()
    data.setup("test")
    again = _trainer().test(loaded, dataloaders=data.test_dataloader(), verbose=False)[0]
    assert again == metrics


def test_fitting_a_strength_that_has_nothing_to_train_raises(base_checkpoint):
    module = ModalitySteeringModule(str(base_checkpoint), strength="uniform")
    with pytest.raises(InputError, match="strength='uniform' has nothing to train"):
        _trainer(max_steps=1, enable_checkpointing=False).fit(module, datamodule=_data())


def test_a_layer_beyond_the_base_model_raises(base_checkpoint):
    module = ModalitySteeringModule(str(base_checkpoint), layer=3)
    with pytest.raises(InputError, match="layer 3 is out of range: the base model has 1"):
        _trainer().test(module, datamodule=_data(), verbose=False)


def test_testing_without_a_datamodule_raises(base_checkpoint):
    data = _data()
    data.setup("test")
    module = ModalitySteeringModule(str(base_checkpoint))
    with pytest.raises(InputError, match="needs the ModalityConflictDataModule"):
        _trainer().test(module, dataloaders=data.test_dataloader(), verbose=False)


def test_a_missing_base_checkpoint_raises(tmp_path):
    module = ModalitySteeringModule(str(tmp_path / "missing.ckpt"))
    with pytest.raises(InputError, match="missing.ckpt' is not a file"):
        _trainer().test(module, datamodule=_data(), verbose=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"direction": "sound"}, "direction must be one of image, text, got 'sound'"),
        ({"strength": "max"}, "strength must be one of none, uniform, mcr, learned"),
        ({"token_scope": "first"}, "token_scope must be one of all, last"),
        ({"alpha": -1.0}, "alpha must be a number >= 0, got -1.0"),
        ({"alpha": float("nan")}, "alpha must be a number >= 0, got nan"),
        ({"threshold": 0.0}, r"threshold must be in \(0, 1\], got 0.0"),
        ({"strength": "learned", "alpha": 0.0}, "alpha must be > 0 for strength='learned'"),
        ({"layer": -1}, "layer must be an int >= 0, got -1"),
        ({"max_new_tokens": 2}, "max_new_tokens must be an int >= 3, got 2"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(InputError, match=match):
        ModalitySteeringModule("unused.ckpt", **kwargs)


def test_base_module_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(InputError, match="hidden_size=30 must be divisible by num_heads=4"):
        ImageTextQAModule(hidden_size=30, num_heads=4)
