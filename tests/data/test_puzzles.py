from collections import deque

import numpy as np
import pytest
import torch

from ada_modules.data import MazeDataModule, SudokuDataModule
from ada_modules.data.puzzles import (
    Maze,
    count_solutions,
    generate_maze,
    generate_sudoku,
    maze_solved,
    maze_tensors,
    shortest_path,
    solved_grid,
    sudoku_solved,
    sudoku_tensors,
)
from ada_modules.errors import InputError

# ---------------------------------------------------------------------------------------------
# Independent helpers (no code shared with the module under test)
# ---------------------------------------------------------------------------------------------


def _neighbours(cell, shape):
    r, c = cell
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        if 0 <= r + dr < shape[0] and 0 <= c + dc < shape[1]:
            yield r + dr, c + dc


def _distances(open_, start):
    """Breadth-first distances from ``start`` over the open cells (a dict cell -> steps)."""
    dist = {start: 0}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        for nxt in _neighbours(cell, open_.shape):
            if open_[nxt] and nxt not in dist:
                dist[nxt] = dist[cell] + 1
                queue.append(nxt)
    return dist


def _valid_sudoku(grid):
    n = len(grid)
    box = int(round(n**0.5))
    digits = set(range(1, n + 1))
    rows = [set(row) for row in grid]
    cols = [set(col) for col in zip(*grid, strict=True)]
    boxes = [
        {grid[r][c] for r in range(br, br + box) for c in range(bc, bc + box)}
        for br in range(0, n, box)
        for bc in range(0, n, box)
    ]
    return all(unit == digits for unit in rows + cols + boxes)


# ---------------------------------------------------------------------------------------------
# Mazes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "seed"), [(5, 0), (7, 1), (11, 2), (11, 3), (21, 4)])
def test_maze_is_a_perfect_maze_with_its_shortest_path(size, seed):
    maze = generate_maze(size, np.random.default_rng(seed))
    open_ = maze.open
    assert open_.shape == (size, size) and open_.dtype == bool
    # Closed border; every cell (odd, odd) open; every pillar (even, even) closed.
    assert not open_[0].any() and not open_[-1].any()
    assert not open_[:, 0].any() and not open_[:, -1].any()
    assert open_[1::2, 1::2].all() and not open_[::2, ::2].any()
    # The open cells form a tree: connected, and edges == nodes - 1.
    nodes = int(open_.sum())
    edges = int((open_[1:] & open_[:-1]).sum() + (open_[:, 1:] & open_[:, :-1]).sum())
    first = tuple(int(x) for x in np.argwhere(open_)[0])
    assert len(_distances(open_, first)) == nodes
    assert edges == nodes - 1
    # Start and end: distinct open cells at odd coordinates.
    assert maze.start != maze.end
    for point in (maze.start, maze.end):
        assert open_[point] and point[0] % 2 == 1 and point[1] % 2 == 1
    # The path: open cells, a simple chain from start to end, as short as BFS says.
    path = maze.path
    assert path.shape == (size, size) and path.dtype == bool
    assert path[maze.start] and path[maze.end] and not (path & ~open_).any()
    cells = [tuple(int(x) for x in p) for p in np.argwhere(path)]
    degree = {cell: sum(path[n] for n in _neighbours(cell, path.shape)) for cell in cells}
    assert degree[maze.start] == degree[maze.end] == 1
    assert all(d == 2 for cell, d in degree.items() if cell not in (maze.start, maze.end))
    assert len(_distances(path, maze.start)) == len(cells)  # connected chain
    assert len(cells) == _distances(open_, maze.start)[maze.end] + 1


def test_maze_is_deterministic_per_seed_and_read_only():
    a, b = (generate_maze(11, np.random.default_rng(7)) for _ in range(2))
    c = generate_maze(11, np.random.default_rng(8))
    assert (a.open == b.open).all() and (a.path == b.path).all()
    assert (a.start, a.end) == (b.start, b.end)
    assert (a.open != c.open).any() or (a.start, a.end) != (c.start, c.end)
    with pytest.raises(ValueError):
        a.open[0, 0] = True


def test_shortest_path_on_a_grid_with_loops():
    grid = np.ones((4, 5), dtype=bool)
    grid[1, 1:4] = False  # a wall with a way around both ends
    path = shortest_path(grid, (0, 2), (2, 2))
    assert path is not None and int(path.sum()) == _distances(grid, (0, 2))[(2, 2)] + 1 == 7
    assert path[0, 2] and path[2, 2] and not (path & ~grid).any()
    assert shortest_path(grid, (3, 4), (3, 4)).sum() == 1
    grid[:, 2] = False  # split the grid into two halves
    assert shortest_path(grid, (0, 0), (0, 4)) is None
    assert shortest_path(grid, (0, 0), (0, 2)) is None  # end is a wall
    with pytest.raises(InputError, match="end"):
        shortest_path(grid, (0, 0), (4, 0))


def test_maze_tensors_and_maze_solved():
    rng = np.random.default_rng(0)
    mazes = [generate_maze(7, rng) for _ in range(3)]
    inputs, target = maze_tensors(mazes)
    assert inputs.shape == (3, 3, 7, 7) and inputs.dtype == torch.float32
    assert target.shape == (3, 7, 7) and target.dtype == torch.int64
    for i, maze in enumerate(mazes):
        assert torch.equal(inputs[i, 0], torch.tensor(maze.open).float())
        assert inputs[i, 1].sum() == 1 and inputs[(i, 1, *maze.start)] == 1
        assert inputs[i, 2].sum() == 1 and inputs[(i, 2, *maze.end)] == 1
        assert torch.equal(target[i], torch.tensor(maze.path).long())
    prediction = target.clone()
    prediction[1, 0, 0] = 1
    assert maze_solved(prediction, target).tolist() == [True, False, True]
    with pytest.raises(InputError, match="same size"):
        maze_tensors([mazes[0], generate_maze(9, rng)])
    with pytest.raises(InputError, match="mazes"):
        maze_tensors([])


@pytest.mark.parametrize("size", [4, 3, 6, 11.0, True])
def test_bad_maze_size_is_named(size):
    with pytest.raises(InputError, match=f"size must be an odd integer >= 5, got {size!r}"):
        generate_maze(size, np.random.default_rng(0))


# ---------------------------------------------------------------------------------------------
# Sudoku
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("box", [2, 3])
def test_solved_grid_is_valid_and_varies(box):
    grids = [solved_grid(box, np.random.default_rng(seed)) for seed in range(6)]
    for grid in grids:
        assert grid.shape == (box * box, box * box) and grid.dtype == np.int64
        assert _valid_sudoku(grid.tolist())
    boards = torch.from_numpy(np.stack(grids))
    assert sudoku_solved(boards, torch.zeros_like(boards)).all()
    assert len({grid.tobytes() for grid in grids}) > 1


@pytest.mark.parametrize(("box", "givens", "seed"), [(2, 4, 0), (2, 7, 1), (3, 24, 2), (3, 40, 3)])
def test_unique_sudoku_has_its_givens_and_one_solution(box, givens, seed):
    puzzle, solution = generate_sudoku(box, givens, np.random.default_rng(seed))
    n = box * box
    assert puzzle.shape == solution.shape == (n, n)
    assert int(np.count_nonzero(puzzle)) == givens
    assert ((puzzle == 0) | (puzzle == solution)).all()
    assert _valid_sudoku(solution.tolist())
    assert count_solutions(puzzle) == 1
    assert count_solutions(solution) == 1


def test_non_unique_sudoku_and_determinism():
    puzzle, solution = generate_sudoku(3, 20, np.random.default_rng(5), unique=False)
    assert int(np.count_nonzero(puzzle)) == 20
    assert ((puzzle == 0) | (puzzle == solution)).all() and _valid_sudoku(solution.tolist())
    assert count_solutions(puzzle) >= 1
    again = generate_sudoku(3, 20, np.random.default_rng(5), unique=False)
    assert (again[0] == puzzle).all() and (again[1] == solution).all()
    assert (generate_sudoku(2, 0, np.random.default_rng(0), unique=False)[0] == 0).all()


def test_count_solutions_counts_stops_and_finds_contradictions():
    empty = np.zeros((4, 4), dtype=int)
    assert count_solutions(empty) == 2
    assert count_solutions(empty, limit=7) == 7
    assert count_solutions(empty, limit=1000) == 288  # all 4x4 Sudoku grids
    clash = empty.copy()
    clash[0, 0] = clash[0, 3] = 1  # two 1s in a row
    assert count_solutions(clash) == 0
    dead = empty.copy()
    dead[0, 1:] = [2, 3, 4]
    dead[1, 0] = 1  # cell (0, 0) must be 1 but its column has a 1
    assert count_solutions(dead) == 0
    with pytest.raises(InputError, match="limit"):
        count_solutions(empty, limit=0)
    with pytest.raises(InputError, match="puzzle"):
        count_solutions(np.zeros((5, 5), dtype=int))
    with pytest.raises(InputError, match="puzzle"):
        count_solutions(np.full((4, 4), 5))


def test_sudoku_solved_checks_boxes_and_givens():
    n = 9
    r, c = np.indices((n, n))
    latin = (r + c) % n + 1  # rows and columns are permutations, boxes are not
    assert _valid_sudoku(latin.T.tolist()) is False
    assert all(sorted(row) == list(range(1, 10)) for row in np.vstack([latin, latin.T]).tolist())
    good = solved_grid(3, np.random.default_rng(0))
    givens = good * (np.random.default_rng(1).random((n, n)) < 0.4)
    wrong_given = givens.copy()
    i, j = np.argwhere(givens > 0)[0]
    wrong_given[i, j] = good[i, j] % n + 1
    zero = good.copy()
    zero[0, 0] = 0
    boards = torch.from_numpy(np.stack([good, latin, good, zero]))
    puzzles = torch.from_numpy(np.stack([givens, np.zeros_like(good), wrong_given, givens * 0]))
    assert sudoku_solved(boards, puzzles).tolist() == [True, False, False, False]
    # Any valid completion counts, not only the reference: relabel the digits.
    other = torch.from_numpy(good % n + 1)[None]
    assert sudoku_solved(other, torch.zeros_like(other)).tolist() == [True]
    with pytest.raises(InputError, match="board"):
        sudoku_solved(boards, puzzles[:, :4])


def test_sudoku_tensors_encode_one_hot():
    rng = np.random.default_rng(0)
    pairs = [generate_sudoku(3, 30, rng, unique=False) for _ in range(3)]
    puzzles, solutions = (np.stack(x) for x in zip(*pairs, strict=True))
    inputs, target = sudoku_tensors(list(puzzles), list(solutions))
    assert inputs.shape == (3, 10, 9, 9) and inputs.dtype == torch.float32
    assert target.shape == (3, 9, 9) and target.dtype == torch.int64
    assert torch.equal(inputs.sum(dim=1), torch.ones(3, 9, 9))
    assert torch.equal(inputs.argmax(dim=1), torch.from_numpy(puzzles))
    assert torch.equal(target + 1, torch.from_numpy(solutions))
    with pytest.raises(InputError, match="agree"):
        sudoku_tensors(puzzles, np.roll(solutions, 1, axis=0))


def test_unreachable_unique_target_raises_runtime_error():
    with pytest.raises(RuntimeError, match="could not reach 17 givens"):
        generate_sudoku(3, 17, np.random.default_rng(0), max_attempts=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"box": 4, "givens": 100}, "box must be one of 2, 3, got 4"),
        ({"box": 3, "givens": 10}, "givens must be >= 17: a unique 9x9 puzzle needs at least 17"),
        ({"box": 2, "givens": 3}, "givens must be >= 4: a unique 4x4 puzzle needs at least 4"),
        ({"box": 3, "givens": 82, "unique": False}, "givens must be an integer in"),
        ({"box": 3, "givens": -1, "unique": False}, "givens must be an integer in"),
    ],
)
def test_bad_sudoku_arguments_are_named(kwargs, message):
    with pytest.raises(InputError, match=message):
        generate_sudoku(rng=np.random.default_rng(0), **kwargs)


# ---------------------------------------------------------------------------------------------
# DataModules
# ---------------------------------------------------------------------------------------------

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


def test_non_unique_eval_allows_few_givens():
    dm = SudokuDataModule(givens=(5, 10), unique_eval=False, seed=0, **_SUDOKU_SMALL)
    dm.setup("validate")
    givens = _tensors(dm, "val")[0][:, 1:].sum(dim=(1, 2, 3))
    assert ((givens >= 5) & (givens <= 10)).all()


def test_maze_class_is_frozen():
    maze = generate_maze(5, np.random.default_rng(0))
    assert isinstance(maze, Maze) and maze.size == 5
    with pytest.raises(AttributeError):
        maze.start = (1, 1)
