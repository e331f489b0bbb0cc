"""A synthetic preference world: digit-string responses, a known true preference, a biased AI judge.

A response is a string of random digits of random length. Its true reward is
``r*(s) = count("7") - count("3")``, which does not depend on the length. Humans prefer the
response with the higher true reward (flipped with probability ``1 - human_accuracy``); pairs whose
true rewards tie are never drawn. The AI judge scores ``r*(s) + judge_length_bias·len(s)`` (it
likes long answers when the bias is positive), prefers the higher score (ties at random) and then
flips its label with probability ``1 - judge_accuracy``: below 0.5 the judge is anti-correlated
with humans.

:class:`PreferenceDataModule` serves the semi-supervised setting of ABC-Align
(:mod:`ada_modules.posttrain.abc`): a small *labelled* set with human and judge labels, a large
*unlabelled* set with judge labels only, and validation/test pairs with the true preference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import CombinedLoader
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError

__all__ = ["PreferenceDataModule", "PreferencePairs", "PreferenceWorld"]

_DIGIT_OFFSET = CharTokenizer().encode("0")[0]


@dataclass(frozen=True)
class PreferencePairs:
    """``count`` response pairs: digits ``(count, width)`` (``-1`` past a response's length).

    ``truth`` is 1 where the first response has the higher true reward, ``human`` and ``judge``
    are the human's and the judge's labels (1: first preferred).
    """

    first: Tensor
    second: Tensor
    truth: Tensor
    human: Tensor
    judge: Tensor

    def __len__(self) -> int:
        return len(self.truth)

    def tokens(self, which: str) -> Tensor:
        """``<bos> digits <eos>`` ids for CharTokenizer, right-padded with ``<pad>`` (0)."""
        digits = self.first if which == "first" else self.second
        tok = CharTokenizer()
        lengths = (digits >= 0).sum(1)
        ids = torch.full((len(digits), digits.shape[1] + 2), tok.pad_id, dtype=torch.long)
        ids[:, 0] = tok.bos_id
        ids[:, 1:-1] = torch.where(digits >= 0, digits.long() + _DIGIT_OFFSET, tok.pad_id)
        ids[torch.arange(len(digits)), lengths + 1] = tok.eos_id
        return ids

    def texts(self, which: str) -> list[str]:
        """The responses as strings."""
        digits = self.first if which == "first" else self.second
        return ["".join(str(int(d)) for d in row if d >= 0) for row in digits]


@dataclass(frozen=True)
class PreferenceWorld:
    """Draws response pairs with true, human and judge preferences (see the module docstring).

    Args:
        judge_accuracy: Probability that the judge keeps its own opinion (``[0, 1]``).
        judge_length_bias: Weight of the length in the judge's score.
        human_accuracy: Probability that a human label equals the true preference.
        min_length: Shortest response.
        max_length: Longest response.

    Examples:
        >>> world = PreferenceWorld(judge_accuracy=1.0, judge_length_bias=0.0)
        >>> pairs = world.sample(1000, torch.Generator().manual_seed(0))
        >>> bool((pairs.judge == pairs.truth).all()), pairs.tokens("first").shape[1]
        (True, 12)
    """

    judge_accuracy: float = 0.8
    judge_length_bias: float = 0.0
    human_accuracy: float = 1.0
    min_length: int = 2
    max_length: int = 10

    def __post_init__(self) -> None:
        for name in ("judge_accuracy", "human_accuracy"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InputError(f"{name} must lie in [0, 1], got {value}")
        if not 1 <= self.min_length <= self.max_length:
            raise InputError(
                "need 1 <= min_length <= max_length, got "
                f"min_length={self.min_length}, max_length={self.max_length}"
            )

    @staticmethod
    def true_reward(digits: Tensor) -> Tensor:
        """``count(7) - count(3)`` per row of a digit matrix."""
        return (digits == 7).sum(1) - (digits == 3).sum(1)

    def _responses(self, count: int, generator: Tensor, extra_length: int) -> Tensor:
        width = self.max_length + extra_length
        lengths = torch.randint(
            self.min_length + extra_length, width + 1, (count,), generator=generator
        )
        digits = torch.randint(0, 10, (count, width), generator=generator, dtype=torch.int8)
        return torch.where(torch.arange(width) < lengths[:, None], digits, -1)

    def sample(
        self, count: int, generator: torch.Generator, first_extra_length: int = 0
    ) -> PreferencePairs:
        """``count`` pairs without true-reward ties.

        ``first_extra_length`` makes the first responses that much longer (an evaluation of a
        verbose policy against a terse one: the judge's length bias then biases its win rate).
        """
        if count < 1:
            raise InputError(f"count must be at least 1, got {count}")
        if first_extra_length < 0:
            raise InputError(f"first_extra_length must be at least 0, got {first_extra_length}")
        firsts, seconds = [], []
        kept = 0
        while kept < count:
            first = self._responses(2 * (count - kept) + 16, generator, first_extra_length)
            second = self._responses(len(first), generator, 0)
            untied = self.true_reward(first) != self.true_reward(second)
            firsts.append(first[untied])
            seconds.append(second[untied])
            kept += int(untied.sum())
        width = max(f.shape[1] for f in firsts)
        first = torch.cat([_pad(f, width) for f in firsts])[:count]
        second = torch.cat([_pad(s, self.max_length) for s in seconds])[:count]
        gap = (self.true_reward(first) - self.true_reward(second)).double()
        truth = (gap > 0).double()
        human = _flip(truth, self.human_accuracy, generator)
        length_gap = ((first >= 0).sum(1) - (second >= 0).sum(1)).double()
        score = gap + self.judge_length_bias * length_gap
        coin = (torch.rand(count, generator=generator) < 0.5).double()
        opinion = torch.where(score == 0, coin, (score > 0).double())
        judge = _flip(opinion, self.judge_accuracy, generator)
        return PreferencePairs(first, second, truth, human, judge)


def _pad(digits: Tensor, width: int) -> Tensor:
    if digits.shape[1] == width:
        return digits
    return torch.cat([digits, digits.new_full((len(digits), width - digits.shape[1]), -1)], 1)


def _flip(labels: Tensor, accuracy: float, generator: torch.Generator) -> Tensor:
    keep = torch.rand(len(labels), generator=generator) < accuracy
    return torch.where(keep, labels, 1.0 - labels)


class _PairDataset(Dataset):
    def __init__(self, pairs: PreferencePairs, labels: tuple[str, ...]) -> None:
        self.first, self.second = pairs.tokens("first"), pairs.tokens("second")
        self.labels = {name: getattr(pairs, name).float() for name in labels}

    def __len__(self) -> int:
        return len(self.first)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        item = {"first": self.first[index], "second": self.second[index]}
        return item | {name: values[index] for name, values in self.labels.items()}


class PreferenceDataModule(LightningDataModule):
    """Labelled, unlabelled and held-out pairs of a :class:`PreferenceWorld`.

    The training loader is a :class:`~lightning.pytorch.utilities.CombinedLoader` whose batches
    are ``{"labelled": ..., "unlabelled": ...}``: the labelled pairs (``first``, ``second`` token
    ids, ``human`` and ``judge`` labels) cycle while the unlabelled pairs (``judge`` only) make
    one epoch. Validation and test pairs carry ``truth``. :meth:`statistics_batches` gives the
    whole labelled set and a fixed subset of the unlabelled one, from which a
    :class:`~ada_modules.models.preference.PreferenceModule` re-estimates its λ̂ and ŵ.

    Args:
        judge_accuracy: The :class:`PreferenceWorld`'s judge accuracy.
        judge_length_bias: The judge's length bias.
        human_accuracy: Probability that a human label equals the true preference.
        min_length: Shortest response.
        max_length: Longest response.
        num_labelled: Pairs with a human label (``n``).
        num_unlabelled: Pairs with the judge's label only (``N``).
        num_val: Validation pairs (with the true preference).
        num_test: Test pairs (with the true preference).
        batch_size: Unlabelled pairs per training batch.
        labelled_batch_size: Labelled pairs per training batch.
        seed: Seed of every draw; ``None`` takes the seed of ``seed_everything``
            (``PL_GLOBAL_SEED``; 0 when unset), so a sweep's seeds vary the data too.

    Examples:
        >>> dm = PreferenceDataModule(num_labelled=20, num_unlabelled=100, batch_size=25,
        ...                           labelled_batch_size=5)
        >>> dm.setup("fit")
        >>> batch, _, _ = next(iter(dm.train_dataloader()))
        >>> sorted(batch["labelled"]), sorted(batch["unlabelled"])
        (['first', 'human', 'judge', 'second'], ['first', 'judge', 'second'])
    """

    def __init__(
        self,
        judge_accuracy: float = 0.8,
        judge_length_bias: float = 0.0,
        human_accuracy: float = 1.0,
        min_length: int = 2,
        max_length: int = 10,
        num_labelled: int = 100,
        num_unlabelled: int = 2000,
        num_val: int = 500,
        num_test: int = 1000,
        batch_size: int = 64,
        labelled_batch_size: int = 16,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.world = PreferenceWorld(
            judge_accuracy, judge_length_bias, human_accuracy, min_length, max_length
        )
        for name, value in (("num_labelled", num_labelled), ("num_unlabelled", num_unlabelled)):
            if value < 2:
                raise InputError(f"{name} must be at least 2, got {value}")
        for name, value in (
            ("num_val", num_val),
            ("num_test", num_test),
            ("batch_size", batch_size),
            ("labelled_batch_size", labelled_batch_size),
        ):
            if value < 1:
                raise InputError(f"{name} must be at least 1, got {value}")
        self.num_labelled, self.num_unlabelled = num_labelled, num_unlabelled
        self.num_val, self.num_test = num_val, num_test
        self.batch_size, self.labelled_batch_size = batch_size, labelled_batch_size
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        self.splits: dict[str, PreferencePairs] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        generator = torch.Generator().manual_seed(self.seed)
        for name, count in (
            ("labelled", self.num_labelled),
            ("unlabelled", self.num_unlabelled),
            ("val", self.num_val),
            ("test", self.num_test),
        ):
            self.splits[name] = self.world.sample(count, generator)

    def _loader(self, split: str, labels: tuple[str, ...], batch_size: int, shuffle: bool):
        generator = torch.Generator().manual_seed(self.seed + 1) if shuffle else None
        return DataLoader(
            _PairDataset(self.splits[split], labels),
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
        )

    def train_dataloader(self) -> CombinedLoader:
        loaders = {
            "labelled": self._loader(
                "labelled", ("human", "judge"), self.labelled_batch_size, True
            ),
            "unlabelled": self._loader("unlabelled", ("judge",), self.batch_size, True),
        }
        return CombinedLoader(loaders, mode="max_size_cycle")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", ("truth",), 256, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", ("truth",), 256, False)

    def statistics_batches(
        self, max_unlabelled: int
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The whole labelled set and the first ``max_unlabelled`` unlabelled pairs, as batches."""
        labelled = _PairDataset(self.splits["labelled"], ("human", "judge"))
        unlabelled = _PairDataset(self.splits["unlabelled"], ("judge",))
        count = min(max_unlabelled, len(unlabelled))
        return (
            {"first": labelled.first, "second": labelled.second} | labelled.labels,
            {"first": unlabelled.first[:count], "second": unlabelled.second[:count]}
            | {"judge": unlabelled.labels["judge"][:count]},
        )
