"""Base LightningDataModule for data held in train/val/test splits drawn from a seed."""

import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from ada_modules.errors import InputError

__all__ = ["SplitDataModule"]


class SplitDataModule(LightningDataModule):
    """Seed, batch sizes and loaders shared by the library's DataModules.

    A subclass fills ``self.datasets["train" | "val" | "test"]`` in ``setup()``; this class turns
    them into loaders (training shuffled by a generator seeded with ``seed``; predict reads the test
    split) with ``self.collate_fn``, if the subclass sets one.

    Args:
        seed: Seed of the data and of the training shuffle; equal seeds give equal data. ``None``
            takes the seed of ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset), so a
            sweep's seeds vary the data too.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        ValueError: If an argument is out of range, naming the argument.
    """

    collate_fn: Callable[[list[Any]], Any] | None = None

    def __init__(
        self,
        seed: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if seed is None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InputError(f"seed must be an integer or None, got {seed!r}")
        for name, value, low in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        if eval_batch_size is not None and (
            isinstance(eval_batch_size, bool)
            or not isinstance(eval_batch_size, int)
            or eval_batch_size < 1
        ):
            raise InputError(
                f"eval_batch_size must be None or an integer >= 1, got {eval_batch_size!r}"
            )
        self.seed = seed
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.datasets: dict[str, Any] = {}

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if split not in self.datasets:
            raise RuntimeError(f"the {split} split is not set up; call setup() first")
        return DataLoader(
            self.datasets[split],
            batch_size=self.batch_size if split == "train" else self.eval_batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
