"""MazeDataModule and SudokuDataModule: shapes, ranges, determinism per split, bad arguments."""

import pytest
import torch

from ada_modules.data import MazeDataModule, SudokuDataModule
from ada_modules.data.sudoku import count_solutions, sudoku_solved
from ada_modules.errors import InputError

_MAZE_SMALL = {"size": 7, "train_mazes": 6, "val_mazes": 3, "test_mazes": 4, "batch_size": 4}
_SUDOKU_SMALL = {"train_puzzles": 6, "val_puzzles": 3, "test_puzzles": 4, "batch_size": 4}


def _tensors(dm, split):
    return dm.datasets[split].tensors


def test_maze_datamodule_shapes_determinism_and_eval_size():
    dm = MazeDataModule(seed=3, **_MAZE_SMALL)
    dm.setup()
    assert (dm.in_channels, dm.num_classes) == (MazeDataModule.in_channels, 2) == (3, 2)
    inputs, target = next(iter(dm.train_dataloader()))
    assert inputs.shape == (4, 3, 7, 7) and target.shape == (4, 7, 7)
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [6, 3, 4]
    train = dm.datasets["train"]
    dm.setup("fit")
    assert dm.datasets["train"] is train  # no re-generation
    same = MazeDataModule(seed=3, **_MAZE_SMALL)
    same.setup()
    bigger = MazeDataModule(seed=3, eval_size=11, **_MAZE_SMALL)
    bigger.setup()
    other = MazeDataModule(seed=4, **_MAZE_SMALL)
    other.setup()
    for split in ("train", "val", "test"):
        assert all(map(torch.equal, _tensors(dm, split), _tensors(same, split)))
    for split in ("train", "val"):
        assert all(map(torch.equal, _tensors(dm, split), _tensors(bigger, split)))
    assert _tensors(bigger, "test")[0].shape == (4, 3, 11, 11)
    assert not torch.equal(_tensors(dm, "train")[0], _tensors(other, "train")[0])
    assert not torch.equal(_tensors(dm, "val")[0], _tensors(dm, "test")[0][:3])
    # The test split depends neither on the other splits' sizes nor on the stage.
    test_only = MazeDataModule(seed=3, **(_MAZE_SMALL | {"train_mazes": 1, "val_mazes": 9}))
    test_only.setup("test")
    assert set(test_only.datasets) == {"test"}
    assert all(map(torch.equal, _tensors(dm, "test"), _tensors(test_only, "test")))


def test_sudoku_datamodule_shapes_ranges_and_determinism():
    dm = SudokuDataModule(givens=(30, 40), eval_givens=(26, 28), seed=1, **_SUDOKU_SMALL)
    dm.setup()
    assert (dm.in_channels, dm.num_classes) == (10, 9)
    inputs, target = next(iter(dm.train_dataloader()))
    assert inputs.shape == (4, 10, 9, 9) and target.shape == (4, 9, 9)
    for split, (lo, hi) in (("train", (30, 40)), ("val", (26, 28)), ("test", (26, 28))):
        inputs, target = _tensors(dm, split)
        givens = inputs[:, 1:].sum(dim=(1, 2, 3))
        assert ((givens >= lo) & (givens <= hi)).all()
        puzzles = inputs.argmax(dim=1)
        assert sudoku_solved(target + 1, puzzles).all()
        if split != "train":
            assert all(count_solutions(p.numpy()) == 1 for p in puzzles)
    same = SudokuDataModule(givens=(30, 40), eval_givens=(26, 28), seed=1, **_SUDOKU_SMALL)
    same.setup("validate")
    assert set(same.datasets) == {"val"}
    assert all(map(torch.equal, _tensors(dm, "val"), _tensors(same, "val")))
    small = SudokuDataModule(box=2, givens=[5, 8], seed=1, **_SUDOKU_SMALL)
    small.setup("test")
    assert _tensors(small, "test")[0].shape == (4, 5, 4, 4)
    assert (small.in_channels, small.num_classes) == (5, 4)


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (MazeDataModule, {"size": 10}, "size"),
        (MazeDataModule, {"size": 3}, "size"),
        (MazeDataModule, {"eval_size": 8}, "eval_size"),
        (MazeDataModule, {"train_mazes": 0}, "train_mazes"),
        (MazeDataModule, {"test_mazes": 0}, "test_mazes"),
        (SudokuDataModule, {"box": 4}, "box"),
        (SudokuDataModule, {"givens": (10, 20)}, "givens"),
        (SudokuDataModule, {"givens": (40, 30)}, "givens"),
        (SudokuDataModule, {"givens": (30, 82)}, "givens"),
        (SudokuDataModule, {"givens": (70, 81)}, "givens"),  # a full grid: no blank to score
        (SudokuDataModule, {"box": 2, "givens": (16, 16), "unique_eval": False}, "givens"),
        (SudokuDataModule, {"givens": 30}, "givens"),
        (SudokuDataModule, {"eval_givens": (16, 20)}, "eval_givens"),
        (SudokuDataModule, {"eval_givens": (30, 25)}, "eval_givens"),
        (SudokuDataModule, {"val_puzzles": 0}, "val_puzzles"),
        (SudokuDataModule, {"unique_eval": "yes"}, "unique_eval"),
    ],
)
def test_bad_datamodule_arguments_are_named(cls, kwargs, name):
    with pytest.raises(InputError, match=rf"^{name} must"):
        cls(**kwargs)


def test_non_unique_puzzles_allow_few_givens():
    dm = SudokuDataModule(
        givens=(5, 10), unique_train=False, unique_eval=False, seed=0, **_SUDOKU_SMALL
    )
    dm.setup("validate")
    givens = _tensors(dm, "val")[0][:, 1:].sum(dim=(1, 2, 3))
    assert ((givens >= 5) & (givens <= 10)).all()


def test_training_puzzles_are_unique_unless_asked_otherwise():
    small = {**_SUDOKU_SMALL, "train_puzzles": 12}
    for unique, expected in ((True, {1}), (False, None)):
        dm = SudokuDataModule(box=2, givens=(4, 6), unique_train=unique, seed=0, **small)
        dm.setup("fit")
        inputs = _tensors(dm, "train")[0]
        puzzles = (inputs.argmax(dim=1)).numpy()
        counts = {count_solutions(p) for p in puzzles}
        if expected is None:
            assert max(counts) == 2  # some have several solutions
        else:
            assert counts == expected
    with pytest.raises(InputError, match="givens must be >= 17"):
        SudokuDataModule(box=3, givens=(10, 20), unique_eval=False)
