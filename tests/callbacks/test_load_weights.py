"""LoadWeights: a checkpoint's weights (and only them) at fit start; missing files, shapes that
do not fit, strictness and the clash with ckpt_path."""

import copy

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from ada_modules.callbacks import LoadWeights
from ada_modules.errors import InputError
from ada_modules.models import ImageClassifierModule


def _model(hidden: int = 8) -> ImageClassifierModule:
    return ImageClassifierModule(architecture="mlp", hidden_sizes=[hidden], num_classes=3)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(8, 64, generator=generator)
    return DataLoader(TensorDataset(images, torch.arange(8) % 3), batch_size=4)


class _Record(Callback):
    """The model's weights as the fit starts (after the callbacks before it ran)."""

    def on_fit_start(self, trainer, pl_module):
        self.state = copy.deepcopy(pl_module.state_dict())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Lightning checkpoint after 2 optimizer steps, and its model."""
    folder = tmp_path_factory.mktemp("load_weights")
    torch.manual_seed(0)
    model = _model()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )
    trainer.fit(model, _loader())
    trainer.save_checkpoint(folder / "trained.ckpt")
    return folder / "trained.ckpt", model


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fit_starts_from_the_weights_with_a_fresh_loop(trained, cpu_trainer):
    path, source = trained
    torch.manual_seed(1)
    model, record = _model(), _Record()
    assert not _same(model.state_dict(), source.state_dict())
    trainer = cpu_trainer(max_steps=1, callbacks=[LoadWeights(str(path)), record])
    trainer.fit(model, _loader())
    assert _same(record.state, source.state_dict())
    assert trainer.global_step == 1  # not resumed: the checkpoint had taken 2 steps
    assert not _same(model.state_dict(), source.state_dict())  # and it trained from there


def test_a_plain_state_dict_and_non_strict_loading(trained, cpu_trainer, tmp_path):
    _, source = trained
    state = dict(source.state_dict())
    torch.save(state, tmp_path / "plain.pt")
    model = _model()
    cpu_trainer(max_steps=0, callbacks=[LoadWeights(tmp_path / "plain.pt")]).fit(model, _loader())
    assert _same(model.state_dict(), source.state_dict())

    del state["head.bias"]
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(InputError, match="missing key 'head.bias'"):
        cpu_trainer(max_steps=0, callbacks=[LoadWeights(str(tmp_path / "partial.pt"))]).fit(
            _model(), _loader()
        )
    model = _model()
    bias = model.head.bias.detach().clone()
    callback = LoadWeights(str(tmp_path / "partial.pt"), strict=False)
    cpu_trainer(max_steps=0, callbacks=[callback]).fit(model, _loader())
    assert torch.equal(model.head.weight, source.head.weight)
    assert torch.equal(model.head.bias, bias)


def test_a_missing_file_is_named_when_fit_starts_not_before(cpu_trainer, tmp_path):
    callback = LoadWeights(str(tmp_path / "later.ckpt"))  # may not exist yet at construction
    with pytest.raises(InputError, match="checkpoint not found: .*later.ckpt"):
        cpu_trainer(max_steps=0, callbacks=[callback]).fit(_model(), _loader())


def test_a_shape_mismatch_names_the_key_and_loads_nothing(trained, cpu_trainer):
    path, _ = trained
    model = _model(hidden=16)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(InputError, match=r"'features.1.weight' has shape \(8, 64\)") as error:
        cpu_trainer(max_steps=0, callbacks=[LoadWeights(str(path))]).fit(model, _loader())
    assert "(16, 64)" in str(error.value)
    assert _same(model.state_dict(), before)


def test_together_with_ckpt_path_is_refused(trained, cpu_trainer):
    path, _ = trained
    trainer = cpu_trainer(max_steps=3, callbacks=[LoadWeights(str(path))])
    with pytest.raises(
        InputError, match="starts from weights only, but fit also resumes from ckpt_path"
    ):
        trainer.fit(_model(), _loader(), ckpt_path=str(path))


@pytest.mark.parametrize("path", ["", None, 3])
def test_a_bad_path_is_refused_at_construction(path):
    with pytest.raises(InputError, match="path must be a checkpoint file path"):
        LoadWeights(path)
