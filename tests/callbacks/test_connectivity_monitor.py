"""ConnectivityMonitor: entropies and images of the routing matrices, every N steps."""

import csv

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ada_modules.callbacks import ConnectivityMonitor
from ada_modules.callbacks.connectivity_monitor import render_connectivity
from ada_modules.nn import MLPResNet


class _Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = MLPResNet(8, depth=4, mode="source")
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.trunk(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _loader() -> DataLoader:
    x = torch.randn(64, 8)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


class _ImageLogger(Logger):
    """A logger with ``log_image`` (the W&B interface)."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[str, int]] = []

    @property
    def name(self) -> str:
        return "images"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_image(self, key, images, step=None) -> None:
        assert images[0].dtype == np.uint8 and images[0].shape[-1] == 3
        self.images.append((key, step))


def test_logs_entropies_and_pngs_every_n_steps(seed, cpu_trainer, tmp_path):
    logger = CSVLogger(tmp_path, name="logs")
    trainer = cpu_trainer(
        max_steps=6,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[ConnectivityMonitor(every_n_steps=3)],
    )
    trainer.fit(_Regression(), _loader())
    rows = list(csv.DictReader(open(f"{logger.log_dir}/metrics.csv")))
    logged = [r for r in rows if r.get("connectivity/trunk.router/entropy")]
    assert [int(r["step"]) for r in logged] == [3, 6]
    assert {f"connectivity/trunk.router/entropy_{i}" for i in range(4)} <= set(rows[0])
    # the gate moved, so the rows mix several states: positive entropy after training
    assert float(logged[-1]["connectivity/trunk.router/entropy"]) > 0
    pngs = sorted(p.name for p in (tmp_path / "logs" / "version_0" / "connectivity").glob("*"))
    assert pngs == ["trunk_router_step3.png", "trunk_router_step6.png"]


def test_uses_log_image_when_the_logger_has_it(seed, cpu_trainer):
    logger = _ImageLogger()
    trainer = cpu_trainer(max_steps=4, logger=logger, callbacks=[ConnectivityMonitor(2)])
    trainer.fit(_Regression(), _loader())
    assert logger.images == [("connectivity/trunk.router", 2), ("connectivity/trunk.router", 4)]


def test_render_gives_an_rgb_image():
    image = render_connectivity(torch.rand(5, 6), "title")
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3


def test_state_dict_round_trip():
    monitor = ConnectivityMonitor(every_n_steps=5)
    monitor.last_logged_step = 10
    other = ConnectivityMonitor(every_n_steps=5)
    other.load_state_dict(monitor.state_dict())
    assert other.last_logged_step == 10


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_period_is_rejected(value):
    with pytest.raises(ValueError, match="every_n_steps"):
        ConnectivityMonitor(every_n_steps=value)
