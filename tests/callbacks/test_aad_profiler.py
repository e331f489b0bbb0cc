"""AADProfiler: profiles a real HF model in a Trainer, writes JSON + PNG, logs, keeps state."""

import json
from pathlib import Path

import pytest
import torch

from ada_modules.callbacks import AADProfiler
from ada_modules.data import RecallDataModule
from ada_modules.kv import AADAccumulator, AADProfile
from ada_modules.models import CausalLMModule


@pytest.fixture
def module_and_data(seed):
    module = CausalLMModule(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
        max_new_tokens=3,
        attn_implementation="sdpa",
    )
    data = RecallDataModule(
        num_pairs=4,
        max_hops=2,
        filler_segments=1,
        filler_length=6,
        num_train=16,
        num_val=12,
        num_test=6,
        batch_size=4,
    )
    return module, data


def test_validate_writes_profile_png_and_logs_per_layer_scalars(
    module_and_data, cpu_trainer, tmp_path
):
    module, data = module_and_data
    profiler = AADProfiler(dirpath=str(tmp_path / "aad"), max_batches=2, sink_tokens=1)
    trainer = cpu_trainer(callbacks=[profiler], limit_val_batches=3)
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]
    profile = AADProfile.from_json(tmp_path / "aad" / "aad_profile.json")
    assert (tmp_path / "aad" / "aad_profile.png").stat().st_size > 0
    assert profile.num_layers == 2 and profile.aad.shape[1] == 2
    assert profile.metadata["num_batches"] == 2 and profile.metadata["loop"] == "validation"
    assert profile.sink_tokens == 1
    for layer in range(2):
        assert metrics[f"aad/layer_{layer}"] == pytest.approx(profile.layer_mean()[layer].item())
        assert metrics[f"aad/layer_{layer}_std"] == pytest.approx(profile.layer_std()[layer].item())
    # The module's attention implementation is restored after each profiled forward.
    assert module.model.config._attn_implementation == "sdpa"
    # Same numbers as feeding the eager attention of those two batches to an accumulator.
    reference = AADAccumulator(sink_tokens=1)
    module.model.set_attn_implementation("eager")
    loader = iter(data.val_dataloader())
    with torch.no_grad():
        for _ in range(2):
            batch = next(loader)
            out = module.model(
                input_ids=batch["prompt_ids"],
                attention_mask=batch["prompt_mask"],
                output_attentions=True,
            )
            reference.update(list(out.attentions), batch["prompt_mask"])
    expected = reference.compute()
    assert torch.allclose(profile.layer_mean(), expected.layer_mean(), atol=1e-5)
    assert torch.allclose(profile.naad.nan_to_num(-1), expected.naad.nan_to_num(-1), atol=1e-5)
    # Left-padded prompts of a fixed-length task: every real position is covered.
    assert profile.counts.min() > 0


def test_fit_profiles_each_validation_but_not_the_sanity_check_and_state_round_trips(
    module_and_data, cpu_trainer, tmp_path
):
    module, data = module_and_data
    profiler = AADProfiler(dirpath=str(tmp_path), loops=["validation"], max_batches=1, plot=False)
    trainer = cpu_trainer(
        callbacks=[profiler],
        max_steps=2,
        limit_train_batches=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
    )
    trainer.fit(module, datamodule=data)
    saved = json.loads((tmp_path / "aad_profile.json").read_text())
    assert saved["metadata"]["global_step"] == 2
    assert not (tmp_path / "aad_profile.png").exists()
    assert profiler.accumulator.num_batches == 1
    trainer.test(module, datamodule=data, verbose=False)  # "test" is not in loops
    assert profiler.profile.metadata["loop"] == "validation"
    restored = AADProfiler()
    restored.load_state_dict(profiler.state_dict())
    assert torch.equal(restored.profile.layer_mean(), profiler.profile.layer_mean())
    assert restored.accumulator.num_batches == 1


def test_bad_arguments_and_models_without_attention_weights(cpu_trainer):
    with pytest.raises(ValueError, match="loops"):
        AADProfiler(loops=["train"])
    with pytest.raises(ValueError, match="max_batches"):
        AADProfiler(max_batches=0)
    with pytest.raises(ValueError, match="filename"):
        AADProfiler(filename="a/b")
    profiler = AADProfiler()
    with pytest.raises(TypeError, match="transformers model"):
        profiler._model(torch.nn.Linear(2, 2))


def test_two_profilers_share_a_trainer_and_the_folder_is_not_a_collective_call(
    cpu_trainer, tmp_path, monkeypatch
):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    validation = AADProfiler(dirpath=str(tmp_path / "v"), loops=["validation"])
    test = AADProfiler(dirpath=str(tmp_path / "t"), loops=["test"])
    assert validation.state_key != test.state_key  # Lightning refused two of one state key
    logger = CSVLogger(tmp_path)
    trainer = cpu_trainer(logger=logger, callbacks=[validation, test])

    def collective(self):
        raise AssertionError("trainer.log_dir is a broadcast: rank zero alone would hang")

    monkeypatch.setattr(Trainer, "log_dir", property(collective))
    assert AADProfiler()._folder(trainer) == Path(logger.log_dir) / "aad"
