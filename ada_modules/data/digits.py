"""scikit-learn's 8x8 handwritten digits as a LightningDataModule (no download: the data ships with
scikit-learn)."""

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError

__all__ = ["DigitsDataModule"]

_SPLITS = ("train", "val", "test")
_MAX_PIXEL = 16.0  # load_digits pixels are integers in [0, 16]


class DigitsDataModule(SplitDataModule):
    """The 1,797 8x8 grey-level digit images of ``sklearn.datasets.load_digits``, 10 classes.

    The images are split once, stratified by class, into disjoint train/val/test sets drawn from
    ``seed`` (equal seeds give equal splits). Pixels are scaled to ``[0, 1]``. Batches are
    ``(images, labels)`` with images of shape ``(batch, 64)`` when ``flatten`` (for an MLP) or
    ``(batch, 1, 8, 8)`` (for a CNN), ``float32``, and ``int64`` labels. After :meth:`setup`,
    ``datasets[split]`` holds each split and ``indices[split]`` its rows of ``load_digits``.

    Args:
        seed: Seed of the split and of the training shuffle. ``None`` takes the seed of
            ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset), so a sweep's seeds vary the split.
        val_fraction: Share of the images held out for validation, in ``(0, 1)``.
        test_fraction: Share of the images held out for test (and predict), in ``(0, 1)``; the two
            shares must leave at least half of the images for training.
        flatten: Give images as 64-vectors instead of ``1 x 8 x 8`` tensors.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        ValueError: If an argument is out of range, naming the argument.
        ImportError: In :meth:`setup`, when scikit-learn is not installed.

    Examples:
        >>> dm = DigitsDataModule(seed=0, flatten=False, batch_size=16)
        >>> dm.setup("fit")
        >>> images, labels = next(iter(dm.train_dataloader()))
        >>> tuple(images.shape), labels.dtype, float(images.max()) <= 1.0
        ((16, 1, 8, 8), torch.int64, True)
        >>> {split: len(dm.datasets[split]) for split in ("train", "val", "test")}
        {'train': 1168, 'val': 269, 'test': 360}

        In YAML::

            data:
              class_path: ada_modules.data.DigitsDataModule
              init_args: {flatten: true, batch_size: 64}
    """

    num_classes = 10
    image_size = 8

    def __init__(
        self,
        seed: int | None = None,
        val_fraction: float = 0.15,
        test_fraction: float = 0.2,
        flatten: bool = True,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
                raise InputError(f"{name} must be a number in (0, 1), got {value!r}")
        if val_fraction + test_fraction > 0.5:
            raise InputError(
                f"val_fraction + test_fraction must be <= 0.5 (leaving half for training), got "
                f"{val_fraction} + {test_fraction}"
            )
        if not isinstance(flatten, bool):
            raise InputError(f"flatten must be a bool, got {flatten!r}")
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.flatten = flatten
        self.indices: dict[str, torch.Tensor] = {}

    def setup(self, stage: str | None = None) -> None:
        """Load the images and split them (all three splits, once)."""
        if self.datasets:
            return
        try:
            from sklearn.datasets import load_digits
            from sklearn.model_selection import train_test_split
        except ImportError as error:
            raise ImportError(
                "DigitsDataModule needs scikit-learn: pip install scikit-learn"
            ) from error
        images, labels = load_digits(return_X_y=True)
        index = np.arange(len(labels))
        held_out = self.val_fraction + self.test_fraction
        train_idx, rest_idx = train_test_split(
            index, test_size=held_out, stratify=labels, random_state=self.seed
        )
        val_idx, test_idx = train_test_split(
            rest_idx,
            test_size=self.test_fraction / held_out,
            stratify=labels[rest_idx],
            random_state=self.seed,
        )
        shape = (-1, 64) if self.flatten else (-1, 1, self.image_size, self.image_size)
        x = torch.from_numpy(images.astype(np.float32) / _MAX_PIXEL).reshape(shape)
        y = torch.from_numpy(labels.astype(np.int64))
        for split, idx in zip(_SPLITS, (train_idx, val_idx, test_idx), strict=True):
            self.indices[split] = torch.from_numpy(np.sort(idx))
            self.datasets[split] = TensorDataset(x[self.indices[split]], y[self.indices[split]])
