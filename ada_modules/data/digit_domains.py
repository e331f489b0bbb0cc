"""scikit-learn's digits under input shifts (rotations, flips, inversion): one domain per shift.

Model merging needs a core domain that a base model is trained on and shifted domains that
specialists are fine-tuned on; this module serves all of them from the same seeded split.
"""

from collections.abc import Callable, Sequence

import torch
from torch.utils.data import DataLoader, TensorDataset

from ada_modules.data.digits import DigitsDataModule
from ada_modules.errors import InputError

__all__ = ["DIGIT_DOMAINS", "DigitDomainsDataModule"]

# Each maps images of shape (n, 1, 8, 8) with pixels in [0, 1] to images of the same shape.
DIGIT_DOMAINS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "rot90": lambda x: torch.rot90(x, 1, dims=(-2, -1)),
    "rot180": lambda x: torch.rot90(x, 2, dims=(-2, -1)),
    "rot270": lambda x: torch.rot90(x, 3, dims=(-2, -1)),
    "flip_lr": lambda x: torch.flip(x, dims=(-1,)),
    "flip_ud": lambda x: torch.flip(x, dims=(-2,)),
    "transpose": lambda x: x.transpose(-2, -1),
    "invert": lambda x: 1.0 - x,
}


def _check_domains(name: str, domains: Sequence[str]) -> list[str]:
    if isinstance(domains, str) or not isinstance(domains, Sequence) or not domains:
        raise InputError(f"{name} must be a non-empty list of domain names, got {domains!r}")
    for domain in domains:
        if domain not in DIGIT_DOMAINS:
            raise InputError(
                f"{name} has an unknown domain {domain!r}; known: {', '.join(DIGIT_DOMAINS)}"
            )
    if len(set(domains)) != len(domains):
        raise InputError(f"{name} lists a domain twice: {list(domains)}")
    return list(domains)


class DigitDomainsDataModule(DigitsDataModule):
    """The digits of :class:`~ada_modules.data.DigitsDataModule`, shifted into named domains.

    Every domain is a fixed transform of the same seeded train/val/test split (``DIGIT_DOMAINS``:
    ``identity``, ``rot90``, ``rot180``, ``rot270``, ``flip_lr``, ``flip_ud``, ``transpose``,
    ``invert``), so the test images of one domain are never the training images of another.
    Training and validation read the union of ``train_domains`` (a base model is trained on
    ``["identity"]``, a specialist fine-tuned on ``["rot90"]``); ``test`` gives one loader per
    entry of ``eval_domains`` (Lightning's ``dataloader_idx`` is the position in that list), and
    :meth:`domain_dataloader` gives any split of any domain, e.g. calibration data for merging.

    Args:
        train_domains: Domains mixed in the train and val splits.
        eval_domains: Domains of the test loaders, in order (default: ``train_domains``).
        seed: Seed of the split and of the training shuffle, as in
            :class:`~ada_modules.data.DigitsDataModule` (images are always flat 64-vectors).
        val_fraction: Share of the images held out for validation.
        test_fraction: Share of the images held out for test.
        batch_size: Batch size of the training loader and of :meth:`domain_dataloader` on ``train``.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        InputError: An unknown or repeated domain name, or an argument of the parent out of range.

    Examples:
        >>> dm = DigitDomainsDataModule(train_domains=["rot90"], eval_domains=["identity", "rot90"],
        ...                             seed=0, batch_size=16)
        >>> dm.setup("test")
        >>> [len(loader.dataset) for loader in dm.test_dataloader()]
        [360, 360]
        >>> images, _ = next(iter(dm.domain_dataloader("invert", "train")))
        >>> tuple(images.shape)
        (16, 64)

        In YAML::

            data:
              class_path: ada_modules.data.DigitDomainsDataModule
              init_args: {train_domains: [rot90], eval_domains: [identity, rot90]}
    """

    def __init__(
        self,
        train_domains: Sequence[str] = ("identity",),
        eval_domains: Sequence[str] | None = None,
        seed: int | None = None,
        val_fraction: float = 0.15,
        test_fraction: float = 0.2,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed,
            val_fraction=val_fraction,
            test_fraction=test_fraction,
            flatten=True,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        self.train_domains = _check_domains("train_domains", train_domains)
        self.eval_domains = (
            list(self.train_domains)
            if eval_domains is None
            else _check_domains("eval_domains", eval_domains)
        )
        self._plain: dict[str, TensorDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        """Split the images once; train and val hold ``train_domains``, test the first eval one."""
        if self._plain:
            return
        super().setup(stage)
        self._plain = dict(self.datasets)
        for split in ("train", "val"):
            parts = [self.domain_dataset(d, split) for d in self.train_domains]
            columns = zip(*(part.tensors for part in parts), strict=True)
            self.datasets[split] = TensorDataset(*(torch.cat(column) for column in columns))
        self.datasets["test"] = self.domain_dataset(self.eval_domains[0], "test")

    def domain_dataset(self, domain: str, split: str) -> TensorDataset:
        """The ``split`` (``train``, ``val`` or ``test``) of ``domain``, as ``(images, labels)``."""
        _check_domains("domain", [domain])
        if not self._plain:
            raise RuntimeError("the splits are not set up; call setup() first")
        if split not in self._plain:
            raise InputError(f"split must be 'train', 'val' or 'test', got {split!r}")
        images, labels = self._plain[split].tensors
        shifted = DIGIT_DOMAINS[domain](images.reshape(-1, 1, self.image_size, self.image_size))
        return TensorDataset(shifted.reshape(images.shape).contiguous(), labels)

    def domain_dataloader(self, domain: str, split: str, shuffle: bool = False) -> DataLoader:
        """A loader of :meth:`domain_dataset`: batches of ``batch_size`` for ``train``, of the
        evaluation batch size for the other splits (seeded if shuffled)."""
        return DataLoader(
            self.domain_dataset(domain, split),
            batch_size=self.eval_batch_size if split != "train" else self.batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            num_workers=self.num_workers,
        )

    def test_dataloader(self) -> list[DataLoader]:
        """One loader per ``eval_domains`` entry, in order."""
        return [self.domain_dataloader(domain, "test") for domain in self.eval_domains]
