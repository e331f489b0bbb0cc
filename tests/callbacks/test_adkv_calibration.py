"""ADKVCalibration: at the end of fit it captures the model's K/V, calibrates, and writes a
parameter file that ADKVCache reads; bad arguments are named."""

import json

import pytest
import torch

from ada_modules.callbacks import ADKVCalibration
from ada_modules.data import RecallDataModule
from ada_modules.errors import InputError
from ada_modules.kv import ADKVCache
from ada_modules.models import CausalLMModule


@pytest.mark.slow
@pytest.mark.parametrize("given", ["datamodule", "dataloaders"])  # the latter crashed at fit end
def test_fit_end_writes_parameters_the_cache_reads(cpu_trainer, tmp_path, seed, given):
    module = CausalLMModule(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=128,
        max_new_tokens=2,
        attn_implementation="sdpa",
    )
    data = RecallDataModule(num_pairs=6, num_train=32, num_val=8, num_test=8, batch_size=8)
    callback = ADKVCalibration(tmp_path / "adkv", bits=[2, 4], num_batches=2, max_steps=3)
    trainer = cpu_trainer(max_steps=2, callbacks=[callback], limit_val_batches=0)
    if given == "datamodule":
        trainer.fit(module, data)
    else:
        data.setup("fit")
        trainer.fit(module, train_dataloaders=data.train_dataloader())
    report = json.loads((tmp_path / "adkv" / "calibration.json").read_text())
    assert {"val/rel_mse_b2", "val/rel_mse_uncalibrated_b4"} <= set(report)
    assert len(report["drift"]) == 2  # one entry per layer
    captured = torch.load(tmp_path / "adkv" / "captured_kv.pt", weights_only=True)
    assert captured["keys"].shape[:3] == (2, 16, 1)  # layers, 2 batches of 8, kv heads
    cache = ADKVCache(module.model.config, 4, 2, params=tmp_path / "adkv" / "adkv_params.pt")
    assert cache.layers[1].key_params.alpha_code.shape == (1, 16)  # per channel, layer 1's own
    ids = torch.randint(1, 20, (2, 40))
    module.model.generate(ids, max_new_tokens=2, do_sample=False, cache=cache, pad_token_id=0)
    assert cache.layers[0].history.num_tokens == 32


@pytest.mark.parametrize("name", ["num_batches", "num_queries", "max_steps"])
def test_counts_must_be_positive(name, tmp_path):
    with pytest.raises(InputError, match=f"{name} must be a positive int, got 0"):
        ADKVCalibration(tmp_path, **{name: 0})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 0}, r"bits must be one of \(2, 3, 4, 8\)"),
        ({"bits": [3, 17]}, r"bits must be one of .* got 17"),
        ({"bits": []}, "bits must be a width or a non-empty list"),
        ({"keyframe_period": 0}, "keyframe_period must be an int >= 1, got 0"),
        ({"lr": -1.0}, "lr must be a finite number > 0, got -1.0"),
    ],
)
def test_calibration_settings_are_checked_when_the_callback_is_built(kwargs, match, tmp_path):
    """They were read only when the fit ended, after the whole training."""
    with pytest.raises(InputError, match=match):
        ADKVCalibration(tmp_path, **kwargs)
