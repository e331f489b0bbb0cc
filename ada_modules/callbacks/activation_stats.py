"""Collect the activation statistics that RegMean and AMARIS merge with, during ``validate``.

:class:`ActivationStatsCallback` hooks the inputs of the LightningModule's ``nn.Linear`` layers
while validation runs (not the sanity check) and keeps, per layer, the summed second moments of
the inputs (:class:`~ada_modules.merging.ActivationStats`), optionally written to a file for
:func:`~ada_modules.merging.load_stats`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ada_modules.errors import InputError
from ada_modules.merging.stats import ActivationCollector, ActivationStats, save_stats

__all__ = ["ActivationStatsCallback"]


class ActivationStatsCallback(Callback):
    """Second moments of linear-layer inputs over a validation run.

    Every forward call made during validation counts (all validation dataloaders pooled); for a
    dict batch, positions where its ``attention_mask`` is 0 are left out. Layer names are
    relative to the LightningModule (e.g. ``model.layers.0.mlp.down_proj``). Each validation run
    replaces :attr:`stats`; under several processes the sums are added across them.

    Args:
        layers: Names of ``nn.Linear`` submodules; ``None``: all of them (those that never run
            are left out).
        path: If given, rank zero writes the statistics there with
            :func:`~ada_modules.merging.save_stats` after each validation run.

    Attributes:
        stats: ``{layer: ActivationStats}`` from the last validation run (empty before).

    Examples:
        >>> callback = ActivationStatsCallback(path="runs/core_stats.pt")
        >>> callback.stats
        {}

    Usage::

        callback = ActivationStatsCallback()
        Trainer(callbacks=[callback]).validate(model, core_dataloader)
        base_stats = callback.stats
    """

    def __init__(
        self, layers: Sequence[str] | None = None, path: str | os.PathLike[str] | None = None
    ) -> None:
        if layers is not None and (isinstance(layers, str) or not isinstance(layers, Sequence)):
            raise InputError(f"layers must be a list of layer names or None, got {layers!r}")
        if path is not None and (not isinstance(path, str | os.PathLike) or not str(path)):
            raise InputError(f"path must be a file path or None, got {path!r}")
        self.layers = list(layers) if layers is not None else None
        self.path = path
        self.stats: dict[str, ActivationStats] = {}
        self._collector: ActivationCollector | None = None
        self._batches = 0

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._detach()
        self._collector = ActivationCollector(pl_module, self.layers)
        self._batches = 0

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._collector is not None:
            self._collector.start_batch(batch, self._batches)
            self._batches += 1

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        collector = self._collector
        if collector is None:
            return
        self._detach()
        stats = collector.stats()
        if trainer.world_size > 1:
            stats = {name: _reduce(trainer, layer) for name, layer in stats.items()}
        self.stats = stats
        if self.path is not None and trainer.is_global_zero:
            save_stats(stats, self.path)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._detach()

    def _detach(self) -> None:
        if self._collector is not None:
            self._collector.remove()
            self._collector = None


def _reduce(trainer: Trainer, layer: ActivationStats) -> ActivationStats:
    """Sum one layer's statistics over the processes."""
    device = trainer.strategy.root_device
    total = trainer.strategy.reduce(layer.second_moment_sum.to(device), reduce_op="sum")
    count = trainer.strategy.reduce(
        torch.tensor(float(layer.count), dtype=torch.float64, device=device), reduce_op="sum"
    )
    return ActivationStats(total.cpu(), int(count.item()), layer.has_bias)
