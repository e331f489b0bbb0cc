"""Seeded Sudoku puzzles, their solver and checker, and tensor encodings (data for aNCA).

Sudokus of side ``n = box * box``: :func:`solved_grid` shuffles a valid base pattern,
:func:`generate_sudoku` blanks cells (keeping the solution unique, or not), and
:func:`count_solutions` counts completions by bitmask backtracking. :func:`sudoku_tensors` one-hot
encodes puzzles. Predictions are scored by :func:`sudoku_solved` (constraint satisfaction and the
givens, not agreement with the reference solution, which need not be the only one).

Every generator draws from the ``numpy.random.Generator`` it is given, so equal seeds give equal
puzzles.
"""

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ada_modules.checks import is_int
from ada_modules.data._puzzle_args import check_box, check_rng
from ada_modules.errors import InputError

__all__ = [
    "UNIQUE_MIN_GIVENS",
    "count_solutions",
    "sudoku_answer",
    "generate_sudoku",
    "solved_grid",
    "sudoku_solved",
    "sudoku_tensors",
]

UNIQUE_MIN_GIVENS = {2: 4, 3: 17}
"""Fewest givens a uniquely solvable puzzle can have, per box (17: McGuire et al. 2012)."""
_MAX_COUNT_BOX = 4  # count_solutions recurses once per blank: sides up to 16 x 16


def solved_grid(box: int, rng: np.random.Generator) -> np.ndarray:
    """A random solved Sudoku of side ``n = box * box`` (values ``1..n``).

    The base pattern ``(box * (r % box) + r // box + c) % n + 1`` is valid; permuting its bands,
    the rows within each band, its stacks, the columns within each stack and its digits, and a
    random transpose keep it valid.

    Args:
        box: Side of a box, an integer >= 2.
        rng: The generator to draw from.

    Returns:
        int64 ``(n, n)``.

    Raises:
        InputError: If ``box`` is not an integer >= 2 or ``rng`` is not a generator.

    Examples:
        >>> grid = solved_grid(2, np.random.default_rng(0))
        >>> [sorted(row) for row in grid.tolist()] == [[1, 2, 3, 4]] * 4
        True
        >>> bool(sudoku_solved(torch.from_numpy(grid)[None], torch.zeros(1, 4, 4)))
        True
    """
    if not is_int(box) or box < 2:
        raise InputError(f"box must be an integer >= 2, got {box!r}")
    rng = check_rng(rng)
    box = int(box)
    n = box * box
    index = np.arange(n)
    base = (box * (index[:, None] % box) + index[:, None] // box + index[None, :]) % n

    def lines() -> np.ndarray:  # a band (stack) order, then a row (column) order in each
        return np.concatenate([band * box + rng.permutation(box) for band in rng.permutation(box)])

    rows, cols = lines(), lines()
    digits = rng.permutation(n) + 1
    grid = digits[base[np.ix_(rows, cols)]].astype(np.int64)
    if rng.random() < 0.5:
        grid = np.ascontiguousarray(grid.T)
    return grid


@functools.lru_cache(maxsize=8)
def _units(n: int, box: int) -> tuple[list[int], list[int], list[int]]:
    """Row, column and box index of every cell of an ``n x n`` board, in row-major order."""
    rows = [i // n for i in range(n * n)]
    cols = [i % n for i in range(n * n)]
    boxes = [(r // box) * box + c // box for r, c in zip(rows, cols, strict=True)]
    return rows, cols, boxes


def _count_completions(cells: list[int], n: int, box: int, limit: int) -> int:
    """Completions of the row-major board ``cells`` (0 = blank), stopping at ``limit``."""
    full = (1 << n) - 1
    in_row, in_col, in_box = [0] * n, [0] * n, [0] * n
    row_of, col_of, box_of = _units(n, box)
    blanks = []
    for i, value in enumerate(cells):
        if not value:
            blanks.append(i)
            continue
        bit = 1 << (value - 1)
        r, c, b = row_of[i], col_of[i], box_of[i]
        if (in_row[r] | in_col[c] | in_box[b]) & bit:
            return 0  # two equal givens share a unit
        in_row[r] |= bit
        in_col[c] |= bit
        in_box[b] |= bit
    found = 0

    def search(blanks: list[int]) -> None:
        nonlocal found
        if not blanks:
            found += 1
            return
        best, best_mask, best_count = -1, 0, n + 1
        for i in blanks:  # the blank with the fewest candidates
            mask = full & ~(in_row[row_of[i]] | in_col[col_of[i]] | in_box[box_of[i]])
            if not mask:
                return  # dead end
            count = mask.bit_count()
            if count < best_count:
                best, best_mask, best_count = i, mask, count
                if count == 1:
                    break
        rest = [i for i in blanks if i != best]
        r, c, b = row_of[best], col_of[best], box_of[best]
        while best_mask:
            bit = best_mask & -best_mask
            best_mask ^= bit
            in_row[r] |= bit
            in_col[c] |= bit
            in_box[b] |= bit
            search(rest)
            in_row[r] ^= bit
            in_col[c] ^= bit
            in_box[b] ^= bit
            if found >= limit:
                return

    search(blanks)
    return min(found, limit)


def _check_board(name: str, board: object) -> tuple[np.ndarray, int, int]:
    """``board`` as an int64 array of side ``n = box * box`` with values in ``0..n``."""
    array = np.asarray(board)
    if array.ndim != 2 or array.shape[0] != array.shape[1] or array.shape[0] == 0:
        raise InputError(f"{name} must be a square 2D array, got shape {array.shape}")
    n = array.shape[0]
    box = math.isqrt(n)
    if box * box != n:
        raise InputError(f"{name} must have side box * box (4, 9, 16, ...), got side {n}")
    if not (np.issubdtype(array.dtype, np.integer) or array.dtype == bool):
        raise InputError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.min() < 0 or array.max() > n:
        raise InputError(
            f"{name} values must be in 0..{n} (0 = blank), got {array.min()}..{array.max()}"
        )
    return array.astype(np.int64), n, box


def count_solutions(puzzle: np.ndarray, limit: int = 2) -> int:
    """Number of completions of a Sudoku puzzle, counting no further than ``limit``.

    Bitmask backtracking in pure Python that fills, at each step, the blank cell with the fewest
    candidates. A 9x9 puzzle with 22 or more givens typically takes about a millisecond.

    Args:
        puzzle: ``(n, n)`` integers, ``0`` for blanks, ``n = box * box`` with ``box <= 4``.
        limit: Stop counting here, an integer >= 1 (``2`` answers "is it unique?").

    Returns:
        The number of solutions, at most ``limit``; 0 if the givens contradict each other.

    Raises:
        InputError: If ``puzzle`` is not such a board or ``limit`` is not an integer >= 1.

    Examples:
        >>> count_solutions(np.zeros((4, 4), dtype=int), limit=5)
        5
        >>> count_solutions(np.array([[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 0]]))
        1
    """
    array, n, box = _check_board("puzzle", puzzle)
    if box > _MAX_COUNT_BOX:
        raise InputError(f"puzzle must be at most 16x16, got {n}x{n}")
    if not is_int(limit) or limit < 1:
        raise InputError(f"limit must be an integer >= 1, got {limit!r}")
    return _count_completions(array.ravel().tolist(), n, box, int(limit))


def _reduce(solution: np.ndarray, givens: int, rng: np.random.Generator) -> np.ndarray:
    """Blank the cells of ``solution`` in random order, keeping each blank only if the puzzle
    stays uniquely solvable, until ``givens`` remain or every cell was tried.

    A puzzle with the unique solution ``S`` minus the given ``v`` at cell ``i`` is still unique
    iff no completion puts another candidate ``d != v`` at ``i``: one existence search per
    candidate, and none at all when ``v`` is the only candidate left at ``i``.
    """
    n = solution.shape[0]
    box = math.isqrt(n)
    full = (1 << n) - 1
    cells = solution.ravel().tolist()
    row_of, col_of, box_of = _units(n, box)
    in_row, in_col, in_box = [full] * n, [full] * n, [full] * n
    remaining = n * n
    for i in rng.permutation(n * n).tolist():
        if remaining <= givens:
            break
        value = cells[i]
        bit = 1 << (value - 1)
        r, c, b = row_of[i], col_of[i], box_of[i]
        in_row[r] ^= bit
        in_col[c] ^= bit
        in_box[b] ^= bit
        others = full & ~(in_row[r] | in_col[c] | in_box[b]) & ~bit
        unique = True
        while others and unique:
            other = others & -others
            others ^= other
            cells[i] = other.bit_length()
            unique = not _count_completions(cells, n, box, 1)
        if unique:
            cells[i] = 0
            remaining -= 1
        else:
            cells[i] = value
            in_row[r] |= bit
            in_col[c] |= bit
            in_box[b] |= bit
    return np.array(cells, dtype=np.int64).reshape(n, n)


def generate_sudoku(
    box: int,
    givens: int,
    rng: np.random.Generator,
    unique: bool = True,
    *,
    max_attempts: int = 100,
) -> tuple[np.ndarray, np.ndarray]:
    """A random Sudoku puzzle with exactly ``givens`` filled cells, and its solution.

    With ``unique=True`` the cells of a :func:`solved_grid` are blanked in random order, each
    blank kept only if the puzzle still has exactly one solution, until ``givens`` remain; a pass
    that gets stuck above ``givens`` (its puzzle is minimal) starts over from a new solved grid.
    Targets near the minimum are rarely reached (greedy passes on 9x9 usually stop at 22-26
    givens). With ``unique=False`` random cells are blanked, and the puzzle may have other
    solutions than the one returned.

    Args:
        box: Side of a box, 2 (4x4 puzzles) or 3 (9x9).
        givens: Filled cells, from ``0`` (``unique=True``: 4 when ``box=2``, 17 when ``box=3``,
            the fewest a unique puzzle can have) to ``n * n``.
        rng: The generator to draw from.
        unique: Whether the puzzle must have exactly one solution.
        max_attempts: Solved grids to try before giving up on ``givens`` (``unique=True``).

    Returns:
        ``(puzzle, solution)``, int64 ``(n, n)``; ``puzzle`` has 0 for blanks and agrees with
        ``solution`` elsewhere.

    Raises:
        InputError: If an argument is out of range, naming it.
        RuntimeError: If no pass of ``max_attempts`` reached ``givens`` with a unique solution.

    Examples:
        >>> puzzle, solution = generate_sudoku(3, 30, np.random.default_rng(0))
        >>> int((puzzle > 0).sum()), count_solutions(puzzle), bool((solution > 0).all())
        (30, 1, True)
    """
    box = check_box(box, tuple(UNIQUE_MIN_GIVENS))
    n = box * box
    if not isinstance(unique, (bool, np.bool_)):
        raise InputError(f"unique must be a bool, got {unique!r}")
    low = UNIQUE_MIN_GIVENS[box] if unique else 0
    if not is_int(givens) or not 0 <= givens <= n * n:
        raise InputError(f"givens must be an integer in [{low}, {n * n}], got {givens!r}")
    if givens < low:
        raise InputError(
            f"givens must be >= {low}: a unique {n}x{n} puzzle needs at least {low} givens, "
            f"got {givens!r}"
        )
    if not is_int(max_attempts) or max_attempts < 1:
        raise InputError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
    rng = check_rng(rng)
    givens = int(givens)
    if not unique:
        solution = solved_grid(box, rng)
        puzzle = solution.copy()
        puzzle.ravel()[rng.choice(n * n, size=n * n - givens, replace=False)] = 0
        return puzzle, solution
    fewest = n * n
    for _ in range(max_attempts):
        solution = solved_grid(box, rng)
        puzzle = _reduce(solution, givens, rng)
        left = int(np.count_nonzero(puzzle))
        if left == givens:
            return puzzle, solution
        fewest = min(fewest, left)
    raise RuntimeError(
        f"could not reach {givens} givens with a unique solution in {max_attempts} attempts "
        f"(the fewest reached was {fewest}); ask for more givens or more max_attempts"
    )


def _stack_boards(name: str, boards: object) -> np.ndarray:
    """``boards`` as an int64 array ``(N, n, n)``, ``n = box * box``, values in ``0..n``."""
    try:
        array = np.asarray(boards)
    except ValueError as error:  # ragged
        raise InputError(f"{name} must be boards of one shape ({error})") from None
    if array.ndim != 3 or 0 in array.shape or array.shape[1] != array.shape[2]:
        raise InputError(f"{name} must be a non-empty stack of (n, n) boards, got {array.shape}")
    n = array.shape[1]
    if math.isqrt(n) ** 2 != n:
        raise InputError(f"{name} must have side box * box (4, 9, 16, ...), got side {n}")
    if not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.min() < 0 or array.max() > n:
        raise InputError(
            f"{name} values must be in 0..{n} (0 = blank), got {array.min()}..{array.max()}"
        )
    return array.astype(np.int64)


def sudoku_tensors(
    puzzles: Sequence[np.ndarray] | np.ndarray, solutions: Sequence[np.ndarray] | np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-hot encode puzzles and index their solutions.

    Args:
        puzzles: ``N`` boards ``(n, n)`` (a sequence, or an array ``(N, n, n)``), 0 for blanks.
        solutions: ``N`` solved boards of the same side, agreeing with the puzzles' givens.

    Returns:
        ``inputs`` float32 ``(N, n + 1, n, n)`` (channel 0 = blank, channel ``d`` = digit
        ``d``) and ``target`` int64 ``(N, n, n)``, the solution's digit minus 1 (``0..n-1``).

    Raises:
        InputError: If the boards are malformed, differ in number or shape, or disagree.

    Examples:
        >>> puzzle, solution = generate_sudoku(2, 10, np.random.default_rng(0))
        >>> inputs, target = sudoku_tensors([puzzle], [solution])
        >>> tuple(inputs.shape), int(inputs[0, 0].sum()), int(target.min()), int(target.max())
        ((1, 5, 4, 4), 6, 0, 3)
    """
    puzzle = _stack_boards("puzzles", puzzles)
    solution = _stack_boards("solutions", solutions)
    if puzzle.shape != solution.shape:
        raise InputError(
            f"puzzles and solutions must have the same shape, got {puzzle.shape} and "
            f"{solution.shape}"
        )
    if solution.min() < 1:
        raise InputError("solutions must be complete (no 0 cells)")
    if not ((puzzle == 0) | (puzzle == solution)).all():
        raise InputError("puzzles must agree with their solutions on every given")
    n = puzzle.shape[1]
    inputs = F.one_hot(torch.from_numpy(puzzle), n + 1).permute(0, 3, 1, 2).float().contiguous()
    return inputs, torch.from_numpy(solution - 1)


def sudoku_answer(inputs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A model's answer ``(B, n, n)``, digits minus 1: the givens of the one-hot ``inputs`` kept,
    the argmax of ``logits`` ``(B, n, n, n)`` on the blanks.

    Examples:
        >>> solution = np.array([[[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]])
        >>> puzzle = solution * (np.arange(4) == 0)[:, None]  # the first row given
        >>> inputs, _ = sudoku_tensors(puzzle, solution)
        >>> sudoku_answer(inputs, torch.zeros(1, 4, 4, 4))[0, :2].tolist()  # blanks: argmax 0
        [[0, 1, 2, 3], [0, 0, 0, 0]]
    """
    givens = inputs.argmax(dim=1)  # 0 for blanks, else the digit
    return torch.where(givens > 0, givens - 1, logits.argmax(dim=1))


def sudoku_solved(board: torch.Tensor, givens: torch.Tensor) -> torch.Tensor:
    """Whether each board is a valid completed Sudoku that keeps its puzzle's givens.

    Vectorised over the batch. A board counts as solved iff every row, column and box holds each
    digit ``1..n`` exactly once and it agrees with every nonzero given; it need not equal the
    reference solution.

    Args:
        board: ``(B, n, n)`` integer digits (``1..n``; anything else fails).
        givens: ``(B, n, n)`` the puzzles, 0 for blanks.

    Returns:
        bool ``(B,)``.

    Raises:
        InputError: If the shapes differ or are not ``(B, n, n)`` with ``n = box * box``.

    Examples:
        >>> solution = torch.tensor([[[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]])
        >>> puzzle = torch.zeros_like(solution)
        >>> puzzle[0, 0, 0] = 1
        >>> sudoku_solved(solution, puzzle).tolist(), sudoku_solved(solution, 2 * puzzle).tolist()
        ([True], [False])
        >>> latin = torch.tensor([[[1, 2, 3, 4], [2, 3, 4, 1], [3, 4, 1, 2], [4, 1, 2, 3]]])
        >>> sudoku_solved(latin, 0 * puzzle).tolist()  # rows and columns fine, boxes not
        [False]
    """
    if board.ndim != 3 or board.shape != givens.shape or board.shape[1] != board.shape[2]:
        raise InputError(
            "board and givens must both be (B, n, n) of the same shape, got "
            f"{tuple(board.shape)} and {tuple(givens.shape)}"
        )
    batch, n = board.shape[0], board.shape[1]
    box = math.isqrt(n)
    if box * box != n or n == 0:
        raise InputError(f"board must have side box * box (4, 9, 16, ...), got side {n}")
    board = board.long()
    in_range = ((board >= 1) & (board <= n)).flatten(1).all(dim=1)
    one_hot = F.one_hot((board - 1).clamp(0, n - 1), n)  # (B, row, col, digit)
    rows_ok = (one_hot.sum(dim=2) == 1).flatten(1).all(dim=1)
    cols_ok = (one_hot.sum(dim=1) == 1).flatten(1).all(dim=1)
    boxes = one_hot.reshape(batch, box, box, box, box, n).sum(dim=(2, 4))
    boxes_ok = (boxes == 1).flatten(1).all(dim=1)
    givens = givens.long()
    kept = ((givens == 0) | (givens == board)).flatten(1).all(dim=1)
    return in_range & rows_ok & cols_ok & boxes_ok & kept
