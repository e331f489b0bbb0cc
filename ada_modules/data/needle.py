"""Long-context key -> value recall: needles scattered through periodic filler, queried at the end."""

import random
import string
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Sampler

from ada_modules.data.sequence_task import SequenceExample, SequenceTaskDataModule
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError

__all__ = ["NeedleRecallDataModule"]


class _SameLengthBatches(Sampler[list[int]]):
    """Batches of equal-length examples (no padding), in a fresh random order every epoch."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int) -> None:
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0

    def _batches(self) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        buckets: dict[int, list[int]] = {}
        for i in torch.randperm(len(self.lengths), generator=generator).tolist():
            buckets.setdefault(self.lengths[i], []).append(i)
        batches = [
            bucket[start : start + self.batch_size]
            for _, bucket in sorted(buckets.items())
            for start in range(0, len(bucket), self.batch_size)
        ]
        order = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in order]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        self.epoch += 1
        return iter(batches)

    def __len__(self) -> int:
        return sum(-(-n // self.batch_size) for n in _counts(self.lengths).values())


def _counts(lengths: Sequence[int]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n] = counts.get(n, 0) + 1
    return counts


# Characters with a fixed role in the prompt; key, value and filler alphabets may not use them.
_RESERVED = "#|,"


class NeedleRecallDataModule(SequenceTaskDataModule):
    """Associative recall over a long context: ``num_pairs`` needles ``#kv`` hidden in filler.

    The context is ``filler_segments`` segments of ``filler_length`` characters, each repeating a
    random motif of ``motif_length`` filler characters; the ``num_pairs`` needles ``#kv`` (a
    distinct one-character key ``k``, a one-character value ``v``) sit at random segment
    boundaries. After the context, ``|`` opens the queries: ``extra_queries`` answered queries
    ``kv`` (LM loss on each value; their keys are other needles' keys, never the final one), then
    the final key, whose value is the completion. A prompt with 3 needles, 6 segments of 8
    characters and 1 answered query::

        QMQMQMQM#a3XKEXKEXK#q7BBBBBBBBPJPJPJPJ#c5ZUYZUYZUOTOTOTOT|q7,c

    The answer is ``5``. Recalling it takes the one needle ``#c5``, which lies anywhere in the
    context: far from the end for most examples, so that a model whose attention only sees the
    first and the last tokens (static sink + local sparse attention) answers at chance, while the
    filler is locally predictable (with ``filler_loss=True`` its repeats carry the LM loss, so that
    some heads learn local attention). The tokens are single characters and the query ends with
    the key, so the prediction is the classic induction pattern (``k`` seen before, followed by
    ``v``; predict ``v`` after ``k``), which a 2-layer attention model learns quickly; the answered
    queries give several supervised retrievals per sequence (multi-query associative recall).

    Every prompt has the same length, :attr:`prompt_length`. Each batch has a ``distance``
    tensor: tokens from the final needle's value to the end of the prompt.

    Args:
        num_pairs: Needles in the context (distinct keys).
        key_alphabet: Characters that keys are drawn from (at least ``num_pairs`` of them).
        value_alphabet: Characters that values are drawn from (with repetition).
        filler_segments: Filler segments in the context.
        filler_length: Characters per filler segment.
        motif_length: Length of the repeated motif of a filler segment.
        filler_alphabet: Characters that motifs are drawn from.
        filler_loss: Put LM loss on the predictable part of the filler (after its first motif).
        extra_queries: Answered queries before the final one (at most ``num_pairs - 1``).
        train_filler_segments: Filler segments of the training split only (``None``: the same
            as ``filler_segments``): train on short contexts, where attention learns to retrieve
            in far fewer steps, and validate and test on long ones. A list, e.g.
            ``[2, 4, 8, 16, 32, 64]``, draws each training example's count uniformly from it: a
            length mix in one run, whose short examples get the retrieval off its plateau and
            whose long ones make it hold at the evaluation length. Training batches then group
            examples of equal length (no padding; batch order shuffled every epoch).
        seed: Seed of the three example streams (``None``: the seed of ``seed_everything``).
        num_train: Number of training examples.
        num_val: Number of validation examples.
        num_test: Number of test (and predict) examples.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        ValueError: If an argument is out of range, naming the argument.

    Examples:
        >>> dm = NeedleRecallDataModule(num_pairs=4, filler_segments=8, filler_length=8,
        ...                             extra_queries=2, num_train=16, num_val=4, num_test=4)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["prompt_ids"].shape[1] == dm.prompt_length
        True
    """

    def __init__(
        self,
        num_pairs: int = 16,
        key_alphabet: str = string.ascii_lowercase,
        value_alphabet: str = string.digits,
        filler_segments: int = 64,
        filler_length: int = 16,
        motif_length: int = 3,
        filler_alphabet: str = string.ascii_uppercase,
        filler_loss: bool = True,
        extra_queries: int = 0,
        train_filler_segments: int | list[int] | None = None,
        seed: int | None = None,
        num_train: int = 10_000,
        num_val: int = 256,
        num_test: int = 256,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed,
            num_train=num_train,
            num_val=num_val,
            num_test=num_test,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        if train_filler_segments is None:
            train_range = None
        elif isinstance(train_filler_segments, int) and not isinstance(train_filler_segments, bool):
            train_range = (train_filler_segments, train_filler_segments)
        elif (
            isinstance(train_filler_segments, Sequence)
            and not isinstance(train_filler_segments, str)
            and len(train_filler_segments) > 0
        ):
            train_range = tuple(train_filler_segments)
        else:
            raise InputError(
                "train_filler_segments must be an integer, a non-empty list of integers or None, "
                f"got {train_filler_segments!r}"
            )
        for name, value, low in (
            ("num_pairs", num_pairs, 1),
            ("filler_segments", filler_segments, 0),
            ("filler_length", filler_length, 1),
            ("motif_length", motif_length, 1),
            ("extra_queries", extra_queries, 0),
            *(("train_filler_segments", v, 0) for v in train_range or ()),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        vocabulary = set(CharTokenizer.characters) - set(_RESERVED)
        alphabets = {
            "key_alphabet": key_alphabet,
            "value_alphabet": value_alphabet,
            "filler_alphabet": filler_alphabet,
        }
        for name, alphabet in alphabets.items():
            if len(set(alphabet)) != len(alphabet) or not alphabet or set(alphabet) - vocabulary:
                raise InputError(
                    f"{name} must be distinct tokenizer characters other than {_RESERVED!r}, "
                    f"got {alphabet!r}"
                )
        if set(key_alphabet) & (set(value_alphabet) | set(filler_alphabet)):
            raise InputError("key_alphabet may not share characters with value or filler alphabets")
        if len(key_alphabet) < num_pairs:
            raise InputError(
                f"num_pairs={num_pairs} needs as many distinct keys, key_alphabet has "
                f"{len(key_alphabet)}"
            )
        if extra_queries > num_pairs - 1:
            raise InputError(
                f"extra_queries={extra_queries} must be at most num_pairs - 1 = {num_pairs - 1}"
            )
        if motif_length > filler_length:
            raise InputError(
                f"motif_length={motif_length} must not exceed filler_length={filler_length}"
            )
        self.num_pairs = num_pairs
        self.key_alphabet = key_alphabet
        self.value_alphabet = value_alphabet
        self.filler_segments = filler_segments
        self.filler_length = filler_length
        self.motif_length = motif_length
        self.filler_alphabet = filler_alphabet
        self.filler_loss = filler_loss
        self.extra_queries = extra_queries
        self.train_filler_segments = train_filler_segments
        self._train_range = train_range
        self._range = (filler_segments,)  # segment counts of the split being generated
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; with a training length range, each batch is one length."""
        if self._train_range is None or len(set(self._train_range)) == 1:
            return super().train_dataloader()
        if "train" not in self.datasets:
            raise RuntimeError("the train split is not set up; call setup() first")
        data = self.datasets["train"]
        sampler = _SameLengthBatches(
            [len(x["prompt_ids"]) for x in data], self.batch_size, seed=self.seed or 0
        )
        return DataLoader(
            data,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            persistent_workers=self.num_workers > 0,
        )

    @property
    def prompt_length(self) -> int:
        """Prompt length in tokens, ``<bos>`` included, of validation and test prompts."""
        context = self.filler_segments * self.filler_length + 3 * self.num_pairs
        return 1 + context + 1 + 3 * self.extra_queries + 1

    def _generate(self, split: str) -> list:
        if split == "train" and self._train_range is not None:
            self._range = self._train_range
        try:
            return super()._generate(split)
        finally:
            self._range = (self.filler_segments,)

    def make_example(self, rng: random.Random) -> SequenceExample:
        """Scatter the needles between filler segments and query one of them."""
        num_segments = self._range[0] if len(self._range) == 1 else rng.choice(self._range)
        keys = rng.sample(self.key_alphabet, self.num_pairs)
        values = [rng.choice(self.value_alphabet) for _ in keys]
        segments = []
        for _ in range(num_segments):
            motif = "".join(rng.choices(self.filler_alphabet, k=self.motif_length))
            repeats = -(-self.filler_length // self.motif_length)
            segments.append((motif * repeats)[: self.filler_length])
        # Needle i goes before segment slots[i] (slot filler_segments: after the last segment).
        slots = sorted(rng.randrange(num_segments + 1) for _ in keys)
        order = list(range(self.num_pairs))
        rng.shuffle(order)
        prompt, loss_spans, value_at = "", [], {}
        needle = 0
        for s in range(num_segments + 1):
            while needle < self.num_pairs and slots[needle] == s:
                i = order[needle]
                prompt += f"#{keys[i]}"
                value_at[i] = len(prompt)
                prompt += values[i]
                needle += 1
            if s < num_segments:
                if self.filler_loss and self.filler_length > self.motif_length:
                    start = len(prompt) + self.motif_length
                    loss_spans.append((start, start + self.filler_length - self.motif_length))
                prompt += segments[s]
        final = rng.randrange(self.num_pairs)
        others = [i for i in range(self.num_pairs) if i != final]
        prompt += "|"
        for i in rng.sample(others, self.extra_queries):
            prompt += keys[i]
            loss_spans.append((len(prompt), len(prompt) + 1))
            prompt += values[i] + ","
        prompt += keys[final]
        return SequenceExample(
            prompt=prompt,
            completion=values[final],
            answer=values[final],
            loss_spans=tuple(loss_spans),
            metadata={"distance": len(prompt) - value_at[final]},
        )
