"""Base LightningDataModule for synthetic prompt -> completion tasks and their batch collator."""

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError

__all__ = ["SequenceCollator", "SequenceExample", "SequenceTaskDataModule"]

_SPLITS = ("train", "val", "test")
# Held-out splits are generated first so that the training stream can reject their prompts.
_GENERATION_ORDER = ("test", "val", "train")
_MAX_REJECTION_FACTOR = 50


@dataclass(frozen=True)
class SequenceExample:
    """One generated example of a prompt -> completion task.

    Attributes:
        prompt: The text the model is conditioned on.
        completion: The text the model must generate (without the end token); exact match is
            checked against it.
        answer: The final answer contained in ``completion`` (equal to it when the task has no
            scratchpad).
        loss_spans: Half-open character ranges of ``prompt`` that also carry the LM loss.
        metadata: Integer facts about the example (e.g. ``{"hops": 2}``), batched as tensors.
    """

    prompt: str
    completion: str
    answer: str
    loss_spans: tuple[tuple[int, int], ...] = ()
    metadata: Mapping[str, int] = field(default_factory=dict)


class SequenceCollator:
    """Turns tokenized examples into a training batch plus a left-padded generation batch.

    Keys of the batch:

    - ``input_ids``, ``attention_mask``: ``<bos> prompt completion <eos>``, right-padded.
    - ``labels``: ``input_ids`` with every position set to ``-100`` except the completion, the
      ``<eos>`` and any prompt loss span (Hugging Face shifts labels inside the model).
    - ``prompt_ids``, ``prompt_mask``: ``<bos> prompt``, left-padded, ready for ``generate``.
    - ``targets``, ``answers``: lists of completion and final-answer strings.
    - one ``LongTensor`` per metadata key (e.g. ``hops``).

    Args:
        pad_id: Token id used for padding.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        batch_size = len(items)
        seq_len = max(len(it["prompt_ids"]) + len(it["completion_ids"]) for it in items)
        prompt_len = max(len(it["prompt_ids"]) for it in items)
        input_ids = torch.full((batch_size, seq_len), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, seq_len), dtype=torch.long)
        labels = torch.full((batch_size, seq_len), -100, dtype=torch.long)
        prompt_ids = torch.full((batch_size, prompt_len), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((batch_size, prompt_len), dtype=torch.long)
        for row, it in enumerate(items):
            prompt = torch.tensor(it["prompt_ids"], dtype=torch.long)
            full = torch.cat([prompt, torch.tensor(it["completion_ids"], dtype=torch.long)])
            input_ids[row, : len(full)] = full
            attention_mask[row, : len(full)] = 1
            labels[row, len(prompt) : len(full)] = full[len(prompt) :]
            for start, end in it["loss_spans"]:
                labels[row, start:end] = full[start:end]
            prompt_ids[row, prompt_len - len(prompt) :] = prompt
            prompt_mask[row, prompt_len - len(prompt) :] = 1
        batch: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "targets": [it["completion"] for it in items],
            "answers": [it["answer"] for it in items],
        }
        for key in items[0]["metadata"]:
            batch[key] = torch.tensor([it["metadata"][key] for it in items], dtype=torch.long)
        return batch


class SequenceTaskDataModule(SplitDataModule, ABC):
    """Synthetic prompt -> completion task generated from a seed, tokenized by ``CharTokenizer``.

    Subclasses implement :meth:`make_example`, which draws one :class:`SequenceExample` from a
    ``random.Random``. Each split has its own random stream derived from ``seed``; the test split
    is generated first, then validation, then training, and a prompt already used by an earlier
    split is rejected (compared by hash), so the splits never share a prompt. Held-out splits
    contain no duplicate prompts; the training split may repeat a prompt.

    Args:
        seed: Seed of the three example streams; equal seeds give equal data. ``None`` takes
            the seed of ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset), so a sweep's
            seeds vary the data too.
        num_train: Number of training examples.
        num_val: Number of validation examples.
        num_test: Number of test (and predict) examples.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        ValueError: If a size is out of range, naming the argument.
    """

    def __init__(
        self,
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
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        for name, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        self.num_train = num_train
        self.num_val = num_val
        self.num_test = num_test
        self.tokenizer = CharTokenizer()
        self.collate_fn = SequenceCollator(self.tokenizer.pad_id)
        self._seen: set[bytes] = set()

    @abstractmethod
    def make_example(self, rng: random.Random) -> SequenceExample:
        """Draw one example using only ``rng`` for randomness."""

    def extract_answer(self, completion: str) -> str:
        """Return the final answer contained in a (generated) completion."""
        return completion

    def reward(self, completion: str, answer: str) -> float:
        """Exact-match reward: 1.0 when the final answer of ``completion`` equals ``answer``."""
        return float(self.extract_answer(completion) == answer)

    def split_rng(self, split: str) -> random.Random:
        """The random stream of ``split``, independent of the other splits' streams."""
        state = np.random.SeedSequence([self.seed, _SPLITS.index(split)]).generate_state(2)
        return random.Random(int(state[0]) << 32 | int(state[1]))

    def setup(self, stage: str | None = None) -> None:
        """Generate the splits that ``stage`` needs (all three for ``fit``), once."""
        needed = {"fit": "train", "validate": "val"}.get(stage or "fit", "test")
        for split in _GENERATION_ORDER[: _GENERATION_ORDER.index(needed) + 1]:
            if split not in self.datasets:
                self.datasets[split] = self._generate(split)

    def _generate(self, split: str) -> list[dict[str, Any]]:
        size = getattr(self, f"num_{split}")
        rng = self.split_rng(split)
        examples: list[dict[str, Any]] = []
        held_out = split != "train"
        rejected = 0
        while len(examples) < size:
            example = self.make_example(rng)
            digest = hashlib.blake2b(example.prompt.encode(), digest_size=16).digest()
            if digest in self._seen:
                rejected += 1
                if rejected > _MAX_REJECTION_FACTOR * size + 1000:
                    raise InputError(
                        f"could not draw num_{split}={size} prompts that are not in another split; "
                        "the task has too few distinct prompts for these split sizes"
                    )
                continue
            if held_out:
                self._seen.add(digest)
            examples.append(self._tokenize(example))
        return examples

    def _tokenize(self, example: SequenceExample) -> dict[str, Any]:
        return {
            "prompt_ids": self.tokenizer.encode(example.prompt, add_bos=True),
            "completion_ids": self.tokenizer.encode(example.completion, add_eos=True),
            # Prompt character i is token i + 1 because of <bos>.
            "loss_spans": [(start + 1, end + 1) for start, end in example.loss_spans],
            "completion": example.completion,
            "answer": example.answer,
            "metadata": dict(example.metadata),
        }
