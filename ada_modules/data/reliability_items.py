"""Synthetic queries for the reliability layer: topics, difficulty buckets and text to route on.

Every item belongs to a *topic*; each topic has a difficulty *bucket* (``topic % num_buckets``:
0 easiest) and a vocabulary of made-up words, and an item's text is a few words of its topic's
vocabulary mixed with words every topic shares. So the text says which topic (and through it how
hard) an item is, as the wording of a real question hints at its subject, without naming it:
a router that embeds the text can learn the difficulty from labelled neighbours, and one that
ignores it cannot. Each item also has a *hardness* ``h ~ N(0, 1)`` that simulated channels use
to vary accuracy within a bucket (see :class:`~ada_modules.models.reliability_study.
ReliabilityStudyModule`).

Two splits: ``train`` (the labelled items a router is fitted on) and ``test`` (held-out items it
is scored on), each drawn from its own stream of ``seed`` (so the held-out items do not change
with ``num_labelled``); the topics' vocabularies come from a third stream, shared by both.
"""

import random
import string
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from ada_modules.data.sequence_task import SequenceTaskDataModule
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError

__all__ = ["ReliabilityItems", "ReliabilityItemsDataModule", "TaskItemsDataModule"]


class ReliabilityItems(Dataset):
    """Items ``start .. start + len - 1`` as dicts: ``item``, ``topic``, ``bucket``, ``hardness``,
    ``text`` (see the module docs); ``answers`` (the reference answer of each item, for a real
    model's channel) is an attribute, not in the batches."""

    def __init__(
        self,
        topics: Sequence[int],
        buckets: Sequence[int],
        hardness: Sequence[float],
        texts: Sequence[str],
        start: int = 0,
        answers: Sequence[str] | None = None,
    ) -> None:
        self.topics, self.buckets, self.hardness, self.texts = topics, buckets, hardness, texts
        self.start = start
        self.answers = answers

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "item": self.start + index,
            "topic": self.topics[index],
            "bucket": self.buckets[index],
            "hardness": torch.tensor(self.hardness[index], dtype=torch.float32),
            "text": self.texts[index],
        }


def _word(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 7)))


class ReliabilityItemsDataModule(SplitDataModule):
    """Labelled (``train``) and held-out (``test``) synthetic queries for routing studies.

    Args:
        num_labelled: Items of the ``train`` split (what a router is fitted on).
        num_test: Items of the ``test`` split; their ids follow the labelled ones.
        num_topics: Topics; topic ``t`` is in difficulty bucket ``t % num_buckets``.
        num_buckets: Difficulty buckets.
        words_per_item: Words of its topic's vocabulary in an item's text.
        shared_words: Words of the shared vocabulary in an item's text.
        vocab_size: Words in each topic's vocabulary (and in the shared one).
        seed: Seed of the items; ``None`` takes the seed of ``seed_everything``.
        batch_size: Batch size of the loaders.
        eval_batch_size: Batch size of the test loader (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        InputError: If an argument is out of range, naming it.

    Examples:
        >>> dm = ReliabilityItemsDataModule(num_labelled=4, num_test=2, num_topics=2, seed=0)
        >>> dm.setup("test")
        >>> batch = next(iter(dm.test_dataloader()))
        >>> batch["item"].tolist(), batch["bucket"].tolist() == [t % 3 for t in batch["topic"]]
        ([4, 5], True)
    """

    def __init__(
        self,
        num_labelled: int = 200,
        num_test: int = 300,
        num_topics: int = 6,
        num_buckets: int = 3,
        words_per_item: int = 4,
        shared_words: int = 4,
        vocab_size: int = 12,
        seed: int | None = None,
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
        for name, value, low in (
            ("num_labelled", num_labelled, 1),
            ("num_test", num_test, 1),
            ("num_topics", num_topics, 1),
            ("num_buckets", num_buckets, 1),
            ("words_per_item", words_per_item, 1),
            ("shared_words", shared_words, 0),
            ("vocab_size", vocab_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        self.num_labelled, self.num_test = num_labelled, num_test
        self.num_topics, self.num_buckets = num_topics, num_buckets
        self.words_per_item, self.shared_words = words_per_item, shared_words
        self.vocab_size = vocab_size

    def setup(self, stage: str | None = None) -> None:
        """Draw both splits (every stage uses both: a router is fitted on ``train``)."""
        rng = random.Random(f"{self.seed}-vocabulary")
        vocab = [[_word(rng) for _ in range(self.vocab_size)] for _ in range(self.num_topics)]
        shared = [_word(rng) for _ in range(self.vocab_size)]
        self.datasets = {
            "train": self._split(
                random.Random(f"{self.seed}-train"), self.num_labelled, 0, vocab, shared
            ),
            "test": self._split(
                random.Random(f"{self.seed}-test"), self.num_test, self.num_labelled, vocab, shared
            ),
        }

    def _split(
        self,
        rng: random.Random,
        size: int,
        start: int,
        vocab: list[list[str]],
        shared: list[str],
    ) -> ReliabilityItems:
        # Each split has its own stream: the held-out items do not change with num_labelled.
        topics = [rng.randrange(self.num_topics) for _ in range(size)]
        hardness = [rng.gauss(0.0, 1.0) for _ in range(size)]
        texts = []
        for topic in topics:
            words = rng.choices(vocab[topic], k=self.words_per_item)
            words += rng.choices(shared, k=self.shared_words)
            rng.shuffle(words)
            texts.append(" ".join(words))
        buckets = [topic % self.num_buckets for topic in topics]
        return ReliabilityItems(topics, buckets, hardness, texts, start=start)


class TaskItemsDataModule(SplitDataModule):
    """A sequence task's prompts as reliability items, for a real model's channel.

    The labelled (``train``) items are the task's validation examples, the held-out (``test``)
    ones its test examples (the task keeps the two apart). An item's text is its prompt, its
    answer the task's reference answer, its bucket ``metadata[bucket_key]`` minus the smallest
    value of the key over both splits (e.g. the operand digits of
    :class:`~ada_modules.data.ArithmeticDataModule`), its hardness 0 and its topic its bucket.

    Args:
        task: The sequence task (its ``num_val`` and ``num_test`` set the split sizes).
        bucket_key: The example metadata that sets the difficulty bucket.
        batch_size: Batch size of the loaders.
        num_workers: Worker processes per loader.

    Raises:
        InputError: If the task's examples have no ``bucket_key`` metadata.

    Examples:
        >>> from ada_modules.data import ArithmeticDataModule
        >>> task = ArithmeticDataModule(min_digits=1, max_digits=2, num_val=4, num_test=3, seed=0)
        >>> dm = TaskItemsDataModule(task)
        >>> dm.setup("test")
        >>> test = dm.datasets["test"]
        >>> len(dm.datasets["train"]), test.start, test.texts[0].endswith("="), test.answers[0].isdigit()
        (4, 4, True, True)
    """

    def __init__(
        self,
        task: SequenceTaskDataModule,
        bucket_key: str = "digits",
        batch_size: int = 64,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seed=task.seed, batch_size=batch_size, num_workers=num_workers)
        self.task = task
        self.bucket_key = bucket_key

    def setup(self, stage: str | None = None) -> None:
        """Draw the task's validation and test examples (both splits serve every stage)."""
        self.task.setup("validate")
        splits = {"train": self.task.datasets["val"], "test": self.task.datasets["test"]}
        try:
            values = {n: [e["metadata"][self.bucket_key] for e in ex] for n, ex in splits.items()}
        except KeyError as error:
            raise InputError(
                f"bucket_key {self.bucket_key!r} is not in the task's example metadata"
            ) from error
        low = min(min(v) for v in values.values())
        self.datasets = {}
        start = 0
        for name, examples in splits.items():
            buckets = [value - low for value in values[name]]
            self.datasets[name] = ReliabilityItems(
                topics=buckets,
                buckets=buckets,
                hardness=[0.0] * len(examples),
                texts=[self.task.tokenizer.decode(e["prompt_ids"]) for e in examples],
                start=start,
                answers=[e["answer"] for e in examples],
            )
            start += len(examples)
