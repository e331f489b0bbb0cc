"""Task seeds of a text environment in disjoint train/val/test splits, for the on-policy loop."""

import random
from typing import Any

import numpy as np
import torch

from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError
from ada_modules.posttrain.envs.base import TextEnv

__all__ = ["EnvTaskDataModule"]

_SPLITS = ("train", "val", "test")
_GENERATION_ORDER = ("test", "val", "train")
_MAX_REJECTION_FACTOR = 50


def _collate(seeds: list[int]) -> dict[str, Any]:
    return {"task_seeds": torch.tensor(seeds, dtype=torch.long)}


class EnvTaskDataModule(SplitDataModule):
    """Batches of task seeds of ``env``, with held-out tasks never seen in training.

    Each split is a list of task seeds drawn from its own random stream derived from ``seed``.
    The test split is drawn first, then validation, then training; a task whose
    :meth:`~ada_modules.posttrain.envs.TextEnv.task_id` already occurs in an earlier split is
    rejected, so a held-out task is never trained on. A batch is
    ``{"task_seeds": LongTensor[batch_size]}``: the on-policy module runs the episodes itself
    (:class:`~ada_modules.models.OnPolicyModule` reads ``env`` from this DataModule).

    Args:
        env: The environment whose tasks are drawn.
        seed: Seed of the three streams; ``None`` takes ``PL_GLOBAL_SEED`` (0 when unset).
        num_train: Training tasks (the pool a training epoch shuffles).
        num_val: Validation tasks.
        num_test: Test tasks.
        batch_size: Tasks per training step (the number of prompts; each gets a group of
            episodes).
        eval_batch_size: Tasks per evaluation batch (defaults to ``batch_size``).

    Raises:
        ValueError: If a size is out of range or the env has too few distinct tasks.

    Examples:
        >>> from ada_modules.posttrain.envs import KeyDoorEnv
        >>> dm = EnvTaskDataModule(KeyDoorEnv(), num_train=64, num_val=8, num_test=8, batch_size=4)
        >>> dm.setup("fit")
        >>> next(iter(dm.train_dataloader()))["task_seeds"].shape
        torch.Size([4])
        >>> set(dm.tasks("val")) & set(dm.tasks("train"))
        set()
    """

    def __init__(
        self,
        env: TextEnv,
        seed: int | None = None,
        num_train: int = 20_000,
        num_val: int = 128,
        num_test: int = 256,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
    ) -> None:
        super().__init__(seed=seed, batch_size=batch_size, eval_batch_size=eval_batch_size)
        if not isinstance(env, TextEnv):
            raise InputError(f"env must be a TextEnv, got {type(env).__name__}")
        for name, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        self.env = env
        self.num_train = num_train
        self.num_val = num_val
        self.num_test = num_test
        self.collate_fn = _collate
        self._seen: set[str] = set()

    def setup(self, stage: str | None = None) -> None:
        """Draw the splits ``stage`` needs (all three for ``fit``), once."""
        needed = {"fit": "train", "validate": "val"}.get(stage or "fit", "test")
        for split in _GENERATION_ORDER[: _GENERATION_ORDER.index(needed) + 1]:
            if split not in self.datasets:
                self.datasets[split] = self._draw(split)

    def tasks(self, split: str) -> list[int]:
        """The task seeds of ``split`` (``"train"``, ``"val"`` or ``"test"``), set up on demand."""
        if split not in _SPLITS:
            raise InputError(f"split must be one of {_SPLITS}, got {split!r}")
        if split not in self.datasets:
            self.setup({"train": "fit", "val": "validate", "test": "test"}[split])
        return self.datasets[split]

    def _draw(self, split: str) -> list[int]:
        size = getattr(self, f"num_{split}")
        state = np.random.SeedSequence([self.seed, _SPLITS.index(split), 7]).generate_state(2)
        rng = random.Random(int(state[0]) << 32 | int(state[1]))
        seeds: list[int] = []
        rejected = 0
        held_out = split != "train"
        while len(seeds) < size:
            task_seed = rng.getrandbits(62)
            key = self.env.task_id(task_seed)
            if key in self._seen:
                rejected += 1
                if rejected > _MAX_REJECTION_FACTOR * size + 1000:
                    raise InputError(
                        f"could not draw num_{split}={size} tasks that are not in another split; "
                        "the environment has too few distinct tasks for these split sizes"
                    )
                continue
            if held_out:
                self._seen.add(key)
            seeds.append(task_seed)
        return seeds
