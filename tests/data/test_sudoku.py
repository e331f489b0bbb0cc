"""Seeded Sudoku: valid grids, unique puzzles, the solution counter, encoding and scoring."""

import numpy as np
import pytest
import torch

from ada_modules.data.sudoku import (
    count_solutions,
    generate_sudoku,
    solved_grid,
    sudoku_solved,
    sudoku_tensors,
)
from ada_modules.errors import InputError

# ---------------------------------------------------------------------------------------------
# Independent helpers (no code shared with the module under test)
# ---------------------------------------------------------------------------------------------


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
