"""LightningDataModules of mazes and Sudoku puzzles generated from a seed (data for aNCA).

Both serve ``TensorDataset(inputs, target)`` items, images a neural cellular automaton reads and
labels it predicts per cell: :class:`MazeDataModule` the ``[open, start, end]`` channels of a
maze and its shortest path (:func:`~ada_modules.data.mazes.maze_tensors`),
:class:`SudokuDataModule` one-hot puzzles and their solutions' digits
(:func:`~ada_modules.data.sudoku.sudoku_tensors`). Evaluation can be harder than training:
larger test mazes (``eval_size``), fewer givens in the validation and test puzzles
(``eval_givens``).

Every split is drawn from its own generator, seeded by ``seed``, the split and the grid, so no
split shares a stream with another and each split's data depends neither on the other splits'
sizes nor on their order of generation.
"""

import logging
import time

import numpy as np
from torch.utils.data import TensorDataset

from ada_modules.checks import is_int
from ada_modules.data._puzzle_args import check_box, check_maze_size
from ada_modules.data.mazes import generate_maze, maze_tensors
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.data.sudoku import UNIQUE_MIN_GIVENS, generate_sudoku, sudoku_tensors
from ada_modules.errors import InputError

__all__ = ["MazeDataModule", "SudokuDataModule"]

_LOG = logging.getLogger(__name__)
_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
# The splits each Trainer stage reads (None: all of them).
_STAGE_SPLITS = {
    "fit": ("train", "val"),
    "validate": ("val",),
    "test": ("test",),
    "predict": ("test",),
}
_MAZE, _SUDOKU = 1, 2  # puzzle codes in the seeds


def _check_count(name: str, value: object) -> int:
    if not is_int(value) or value < 1:  # type: ignore[operator]
        raise InputError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)  # type: ignore[arg-type]


def _split_rng(seed: int, puzzle: int, split: str, grid: int) -> np.random.Generator:
    """The generator of one split: its own stream for each (seed, puzzle, split, grid)."""
    return np.random.default_rng([int(seed < 0), abs(seed), puzzle, _SPLIT_CODES[split], grid])


class _PuzzleDataModule(SplitDataModule):
    """Generates, in :meth:`setup`, the splits its stage reads that are not there yet."""

    def _make_split(self, split: str) -> TensorDataset:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """Generate the splits ``stage`` reads (all of them for ``None``), each only once."""
        missing = [
            s for s in _STAGE_SPLITS.get(stage or "", _SPLIT_CODES) if s not in self.datasets
        ]
        for split in missing:
            began = time.perf_counter()
            self.datasets[split] = self._make_split(split)
            _LOG.debug(
                "%s: generated %d %s items in %.2f s",
                type(self).__name__,
                len(self.datasets[split]),
                split,
                time.perf_counter() - began,
            )


class MazeDataModule(_PuzzleDataModule):
    """Perfect mazes and their shortest start-to-end paths, generated from a seed.

    The mazes come from :func:`~ada_modules.data.mazes.generate_maze`. Items are
    ``(inputs, target)``: ``inputs`` float32 ``(3, H, W)``, channels ``[open, start, end]`` as
    0/1, and ``target`` int64 ``(H, W)``, 1 on the path and 0 elsewhere. Training and validation
    mazes have side ``size``; test (and predict) mazes have side ``eval_size``, so a model trained
    on small mazes can be tested on larger ones by overriding only ``eval_size``.

    Args:
        size: Side of the training and validation grids, an odd integer >= 5.
        eval_size: Side of the test grids (defaults to ``size``), an odd integer >= 5.
        train_mazes: Training mazes.
        val_mazes: Validation mazes.
        test_mazes: Test (and predict) mazes.
        seed: Seed of the data and of the training shuffle. ``None`` takes the seed of
            ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset).
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Attributes:
        in_channels: Input channels, 3.
        num_classes: Classes per cell, 2 (off / on the path).

    Raises:
        ValueError: If an argument is out of range, naming the argument.

    Examples:
        >>> dm = MazeDataModule(size=7, eval_size=9, train_mazes=8, val_mazes=2, test_mazes=3,
        ...     seed=0, batch_size=4)
        >>> dm.setup()
        >>> inputs, target = next(iter(dm.train_dataloader()))
        >>> tuple(inputs.shape), tuple(target.shape), tuple(dm.datasets["test"][0][0].shape)
        ((4, 3, 7, 7), (4, 7, 7), (3, 9, 9))

        In YAML::

            data:
              class_path: ada_modules.data.MazeDataModule
              init_args: {size: 11, eval_size: 21}
    """

    in_channels = 3
    num_classes = 2

    def __init__(
        self,
        size: int = 11,
        eval_size: int | None = None,
        train_mazes: int = 4096,
        val_mazes: int = 256,
        test_mazes: int = 256,
        seed: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seed, batch_size, eval_batch_size, num_workers)
        self.save_hyperparameters()  # in checkpoints: the data a model was trained on
        self.size = check_maze_size("size", size)
        self.eval_size = self.size if eval_size is None else check_maze_size("eval_size", eval_size)
        self.counts = {
            "train": _check_count("train_mazes", train_mazes),
            "val": _check_count("val_mazes", val_mazes),
            "test": _check_count("test_mazes", test_mazes),
        }

    def _make_split(self, split: str) -> TensorDataset:
        size = self.eval_size if split == "test" else self.size
        rng = _split_rng(self.seed, _MAZE, split, size)
        mazes = [generate_maze(size, rng) for _ in range(self.counts[split])]
        return TensorDataset(*maze_tensors(mazes))


def _check_givens(name: str, value: object, box: int, unique: bool) -> tuple[int, int]:
    cells = box**4
    low = UNIQUE_MIN_GIVENS[box] if unique else 0
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(is_int(v) for v in value):
        raise InputError(f"{name} must be a pair [lo, hi] of integers, got {value!r}")
    lo, hi = int(value[0]), int(value[1])
    if lo > hi:
        raise InputError(f"{name} must have lo <= hi, got {value!r}")
    if lo < 0 or hi >= cells:  # a full grid has no blank to solve (and no cell to score)
        raise InputError(
            f"{name} must lie within [{low}, {cells - 1}] (at least one blank), got {value!r}"
        )
    if lo < low:
        raise InputError(
            f"{name} must be >= {low}: a unique {box * box}x{box * box} puzzle needs at least "
            f"{low} givens, got {value!r}"
        )
    return lo, hi


class SudokuDataModule(_PuzzleDataModule):
    """Sudoku puzzles and their solutions, generated from a seed.

    The puzzles come from :func:`~ada_modules.data.sudoku.generate_sudoku`. Items are
    ``(inputs, target)``: ``inputs`` float32 ``(n + 1, n, n)``, one-hot (channel 0 = blank,
    channel ``d`` = digit ``d``), and ``target`` int64 ``(n, n)``, the solution's digit minus 1.
    Each puzzle's number of givens is drawn uniformly from an inclusive range:
    ``givens`` for training, ``eval_givens`` for validation and test. Training puzzles have
    exactly one solution when ``unique_train`` (else the target is one of several valid
    completions, and the cross-entropy penalises the others: at 36-45 givens more than half of
    the puzzles are ambiguous), validation and test puzzles when ``unique_eval``. Score
    predictions with :func:`~ada_modules.data.sudoku.sudoku_solved`, which accepts any valid
    completion.

    Unique puzzles with fewer than about 24 givens (9x9) take many generation attempts, and
    below about 22 generation usually fails (``RuntimeError`` in :meth:`setup`).

    Args:
        box: Side of a box: 2 (4x4 puzzles) or 3 (9x9).
        givens: ``[lo, hi]``, the range of givens of the training puzzles, within
            ``[0, n * n - 1]``.
        eval_givens: ``[lo, hi]`` of the validation and test puzzles (defaults to ``givens``);
            with ``unique_eval``, ``lo`` must be at least 17 (box 3) or 4 (box 2).
        train_puzzles: Training puzzles.
        val_puzzles: Validation puzzles.
        test_puzzles: Test (and predict) puzzles.
        unique_train: Whether training puzzles must have exactly one solution.
        unique_eval: Whether validation and test puzzles must have exactly one solution.
        seed: Seed of the data and of the training shuffle. ``None`` takes the seed of
            ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset).
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        ValueError: If an argument is out of range, naming the argument.

    Examples:
        >>> dm = SudokuDataModule(box=2, givens=(6, 10), train_puzzles=8, val_puzzles=2,
        ...     test_puzzles=2, seed=0, batch_size=4)
        >>> dm.setup("fit")
        >>> inputs, target = next(iter(dm.train_dataloader()))
        >>> tuple(inputs.shape), tuple(target.shape), dm.in_channels, dm.num_classes
        ((4, 5, 4, 4), (4, 4, 4), 5, 4)

        In YAML::

            data:
              class_path: ada_modules.data.SudokuDataModule
              init_args: {box: 3, givens: [36, 45], eval_givens: [28, 32]}
    """

    def __init__(
        self,
        box: int = 3,
        givens: tuple[int, int] | list[int] = (36, 45),
        eval_givens: tuple[int, int] | list[int] | None = None,
        train_puzzles: int = 4096,
        val_puzzles: int = 256,
        test_puzzles: int = 256,
        unique_train: bool = True,
        unique_eval: bool = True,
        seed: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seed, batch_size, eval_batch_size, num_workers)
        self.save_hyperparameters()  # in checkpoints: the data a model was trained on
        box = check_box(box, tuple(UNIQUE_MIN_GIVENS))
        for name, flag in (("unique_train", unique_train), ("unique_eval", unique_eval)):
            if not isinstance(flag, bool):
                raise InputError(f"{name} must be a bool, got {flag!r}")
        self.box = box
        self.unique_train, self.unique_eval = unique_train, unique_eval
        self.givens = _check_givens("givens", givens, box, unique=unique_train)
        eval_name, eval_value = (
            ("givens", givens) if eval_givens is None else ("eval_givens", eval_givens)
        )
        self.eval_givens = _check_givens(eval_name, eval_value, box, unique=unique_eval)
        self.counts = {
            "train": _check_count("train_puzzles", train_puzzles),
            "val": _check_count("val_puzzles", val_puzzles),
            "test": _check_count("test_puzzles", test_puzzles),
        }

    @property
    def in_channels(self) -> int:
        """Input channels, ``n + 1`` (blank and the ``n`` digits)."""
        return self.box**2 + 1

    @property
    def num_classes(self) -> int:
        """Classes per cell, ``n`` (the digits)."""
        return self.box**2

    def _make_split(self, split: str) -> TensorDataset:
        lo, hi = self.givens if split == "train" else self.eval_givens
        unique = self.unique_train if split == "train" else self.unique_eval
        rng = _split_rng(self.seed, _SUDOKU, split, self.box)
        counts = rng.integers(lo, hi + 1, size=self.counts[split]).tolist()
        pairs = [generate_sudoku(self.box, givens, rng, unique=unique) for givens in counts]
        puzzles, solutions = zip(*pairs, strict=True)
        return TensorDataset(*sudoku_tensors(np.stack(puzzles), np.stack(solutions)))
