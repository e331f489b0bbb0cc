"""BudgetProgressBar: the step budget, a module's own budget, the per-epoch fallback, no v_num."""

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from ada_modules.callbacks import BudgetProgressBar


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _Budgeted(_Tiny):
    """Two warm-up batches, then a budget of 18 samples (4 a batch) that stops the fit at 20."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def progress_budget(self):
        if self.batches < 2:
            return self.batches, 2, "warm-up"
        return 4 * (self.batches - 2), 18, "samples"

    def training_step(self, batch, batch_idx):
        self.batches += 1
        if self.progress_budget()[0] >= 18:
            self.trainer.should_stop = True
        return super().training_step(batch, batch_idx)


def _loader() -> DataLoader:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def _fit(tmp_path, module: LightningModule, **trainer_kwargs) -> BudgetProgressBar:
    bar = BudgetProgressBar()
    trainer = Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path),  # a logger, so Lightning's bar would show v_num
        callbacks=[bar],
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    trainer.fit(module, _loader())
    return bar


def test_step_bounded_fit_shows_the_step_budget_across_epochs_without_v_num(seed, tmp_path, capsys):
    bar = _fit(tmp_path, _Tiny(), max_steps=6)  # 4 batches an epoch: two epochs, one bar
    out = capsys.readouterr().out
    train_bar = bar.train_progress_bar
    assert (train_bar.desc, train_bar.n, train_bar.total) == ("step 6/6", 6, 6)
    assert "step 1/6" in out and "step 6/6: 100%" in out and "train/loss=" in out
    assert "Epoch" not in out and "v_num" not in out
    assert "v_num" not in bar.get_metrics(bar.trainer, bar.trainer.lightning_module)


def test_a_modules_own_budget_wins_and_a_new_phase_starts_a_new_bar(seed, tmp_path, capsys):
    module = _Budgeted()
    bar = _fit(tmp_path, module, max_epochs=-1)  # unbounded but for the module's budget
    out = capsys.readouterr().out
    assert module.batches == 7
    assert "warm-up 2/2: 100%" in out and "samples 20/18: 100%" in out  # the last batch overshoots
    assert bar.train_progress_bar.desc == "samples 20/18"
    assert bar.budget(bar.trainer, module) == (20, 18, "samples")


def test_an_epoch_bounded_fit_keeps_the_per_epoch_bar(seed, tmp_path, capsys):
    bar = _fit(tmp_path, _Tiny(), max_epochs=2, max_steps=100)
    out = capsys.readouterr().out
    assert bar.budget(bar.trainer, bar.trainer.lightning_module) is None
    assert "Epoch 1: 100%" in out and "step " not in out and "v_num" not in out


def test_describe_formats_large_and_fractional_numbers():
    assert BudgetProgressBar.describe(12345, 200000, "sampled tokens") == (
        "sampled tokens 12,345/200,000"
    )
    assert BudgetProgressBar.describe(0.5, 2, "epoch") == "epoch 0.50/2"
