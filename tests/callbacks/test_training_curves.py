"""TrainingCurves: the recorded history, the PNG, resume, and fit_summary."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from ada_modules.callbacks import TrainingCurves, fit_summary
from ada_modules.callbacks.training_curves import metric_panel, split_metric_name


class _Tiny(LightningModule):
    """Logs train/loss per step, train/acc per epoch and val/loss per validation."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", 1.0 / (1.0 + loss.detach()), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loaders() -> tuple[DataLoader, DataLoader]:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    return DataLoader(data, batch_size=4), DataLoader(data, batch_size=8)


def _trainer(tmp_path, max_steps: int, curves: TrainingCurves) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        val_check_interval=3,  # 4 batches an epoch: validation at step 3 (and 7)
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=[
            curves,
            ModelCheckpoint(
                dirpath=tmp_path / "ckpt", monitor="val/loss", filename="best", save_last=True
            ),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
        default_root_dir=tmp_path,
    )


def test_fit_records_train_val_and_epoch_metrics_and_writes_the_png(seed, tmp_path):
    curves = TrainingCurves(every_n_steps=2)
    trainer = _trainer(tmp_path, max_steps=6, curves=curves)
    trainer.fit(_Tiny(), *_loaders())

    steps = {name: [s for s, _ in points] for name, points in curves.history.items()}
    # train/loss at every second step, val/loss once (not in the sanity check), train/acc at
    # each epoch end (step 4, and step 6 where max_steps ends the second epoch).
    assert steps == {"train/loss": [2, 4, 6], "val/loss": [3], "train/acc": [4, 6]}
    assert curves.history["train/loss"][-1][1] == pytest.approx(
        trainer.callback_metrics["train/loss"].item()
    )
    assert curves.panels() == {"loss": ["train/loss", "val/loss"], "acc": ["train/acc"]}
    assert curves.path == tmp_path / "logs" / "version_0" / "curves.png"
    assert curves.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert curves.path.stat().st_size > 1000

    summary = fit_summary(trainer)
    lines = summary.splitlines()
    assert lines[0] == "Fit ended at step 6."
    assert lines[1].startswith("  train: acc=") and "loss=" in lines[1]
    assert lines[2].startswith("  val:   loss=")
    assert f"best checkpoint: {tmp_path / 'ckpt' / 'best.ckpt'} (val/loss=" in summary
    assert f"last checkpoint: {tmp_path / 'ckpt' / 'last.ckpt'}" in summary
    assert f"logs: {tmp_path / 'logs' / 'version_0'}" in summary
    assert lines[-1] == f"  curves: {curves.path}"
    assert "_step" not in summary and "_epoch" not in summary


def test_resume_keeps_the_history_and_a_filter_and_dirpath_apply(seed, tmp_path):
    first = TrainingCurves(every_n_steps=2)
    _trainer(tmp_path, max_steps=6, curves=first).fit(_Tiny(), *_loaders())

    # last.ckpt was saved at the validation of step 3: the points up to there come from it.
    resumed = TrainingCurves(dirpath=tmp_path / "out", every_n_steps=2, metrics=["*loss"])
    trainer = _trainer(tmp_path, max_steps=10, curves=resumed)
    trainer.fit(_Tiny(), *_loaders(), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    steps = {name: [s for s, _ in points] for name, points in resumed.history.items()}
    assert steps == {"train/loss": [2, 4, 6, 8, 10], "val/loss": [3, 7]}  # no train/acc
    assert resumed.history["train/loss"][0] == first.history["train/loss"][0]
    assert resumed.history["val/loss"][0] == first.history["val/loss"][0]
    assert resumed.path == tmp_path / "out" / "curves.png" and resumed.path.exists()


def test_state_round_trip_and_a_resume_from_an_earlier_step_drops_later_points():
    curves = TrainingCurves(filename="a.png")
    curves.load_state_dict({"history": {"train/loss": [[2, 1.5], [4, 1.0]], "val/loss": [[4, 2]]}})
    assert curves.state_dict() == {
        "history": {"train/loss": [[2, 1.5], [4, 1.0]], "val/loss": [[4, 2.0]]}
    }
    assert curves.state_key != TrainingCurves(filename="b.png").state_key
    curves.on_train_start(SimpleNamespace(global_step=3, logged_metrics={}), None)
    assert curves.history == {"train/loss": [(2, 1.5)]}


def test_summary_without_logger_or_checkpoints(seed, cpu_trainer):
    trainer = cpu_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(_Tiny(), _loaders()[0])
    summary = fit_summary(trainer)
    assert "  checkpoints: none saved" in summary and "  logs: none (no logger)" in summary
    assert "curves:" not in summary


def test_names_panels_and_bad_arguments():
    assert split_metric_name("validation/acc") == ("val", "acc")
    assert split_metric_name("test_loss") == ("test", "loss")
    assert split_metric_name("val/") == ("", "val/")
    assert metric_panel("train/success_greedy") == "success_greedy"
    with pytest.raises(ValueError, match="filename"):
        TrainingCurves(filename="curves.jpg")
    with pytest.raises(ValueError, match="every_n_steps"):
        TrainingCurves(every_n_steps=0)
    with pytest.raises(ValueError, match="max_columns"):
        TrainingCurves(max_columns=True)
    with pytest.raises(ValueError, match="metrics"):
        TrainingCurves(metrics="val/*")
    with pytest.raises(RuntimeError, match="no metrics"):
        TrainingCurves().write("x.png")
