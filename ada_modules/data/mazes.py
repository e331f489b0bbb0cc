"""Seeded perfect mazes, their shortest paths, and tensor encodings (data for aNCA).

Mazes are ``size x size`` boolean grids (``size`` odd, >= 5): cells sit at odd coordinates
``(1, 3, ..., size - 2)``, the walls between them and the whole border are closed, and a randomized
depth-first search from a random cell opens the walls of a spanning tree, so the maze is *perfect*
(exactly one path between any two cells). :func:`generate_maze` also picks two distinct random
cells as start and end and marks the shortest path between them (:func:`shortest_path`, a BFS on
any grid). :func:`maze_tensors` stacks mazes into inputs ``[open, start, end]`` and a path mask.
Predictions are scored by :func:`maze_solved` (exact path mask).

:func:`generate_maze` draws from the ``numpy.random.Generator`` it is given, so equal seeds give
equal mazes.
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ada_modules.checks import is_int
from ada_modules.data._puzzle_args import check_maze_size, check_rng
from ada_modules.errors import InputError

__all__ = ["Maze", "generate_maze", "maze_solved", "maze_tensors", "shortest_path"]


@dataclass(frozen=True, eq=False)
class Maze:
    """A perfect maze and the shortest path between its start and end (arrays are read-only).

    Attributes:
        open: ``(size, size)`` bool, ``True`` on corridors (cells and opened walls).
        start: ``(row, col)`` of the start cell (odd coordinates).
        end: ``(row, col)`` of the end cell, distinct from ``start``.
        path: ``(size, size)`` bool, the shortest start-to-end path, both ends included.
    """

    open: np.ndarray
    start: tuple[int, int]
    end: tuple[int, int]
    path: np.ndarray

    @property
    def size(self) -> int:
        """Side of the grid."""
        return int(self.open.shape[0])


def shortest_path(
    open: np.ndarray, start: tuple[int, int], end: tuple[int, int]
) -> np.ndarray | None:
    """A shortest 4-connected path from ``start`` to ``end`` through the ``True`` cells of ``open``.

    Breadth-first search; works on any 2D grid, not only mazes.

    Args:
        open: 2D array, truthy where a cell may be walked on.
        start: ``(row, col)`` inside the grid.
        end: ``(row, col)`` inside the grid.

    Returns:
        A bool mask of the grid's shape, ``True`` on the path (both ends included), or ``None``
        if ``end`` cannot be reached (also when ``start`` or ``end`` is not open).

    Raises:
        InputError: If ``open`` is not 2D or ``start``/``end`` is not a cell of the grid.

    Examples:
        >>> grid = np.array([[1, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=bool)
        >>> shortest_path(grid, (0, 0), (2, 0)).astype(int)
        array([[1, 1, 1],
               [0, 0, 1],
               [1, 1, 1]])
        >>> shortest_path(grid, (0, 0), (1, 0)) is None
        True
    """
    grid = np.asarray(open)
    if grid.ndim != 2 or grid.size == 0:
        raise InputError(f"open must be a non-empty 2D array, got shape {grid.shape}")
    height, width = grid.shape
    points = []
    for name, point in (("start", start), ("end", end)):
        if (
            not isinstance(point, (tuple, list, np.ndarray))
            or len(point) != 2
            or not all(is_int(x) for x in point)
            or not (0 <= point[0] < height and 0 <= point[1] < width)
        ):
            raise InputError(
                f"{name} must be a (row, col) pair of integers inside the {height}x{width} grid, "
                f"got {point!r}"
            )
        points.append(int(point[0]) * width + int(point[1]))
    source, target = points
    walkable = grid.astype(bool).ravel().tolist()
    if not (walkable[source] and walkable[target]):
        return None
    parent = [-1] * (height * width)
    parent[source] = source
    queue = deque([source])
    while queue and parent[target] < 0:
        here = queue.popleft()
        row, col = divmod(here, width)
        for there, inside in (
            (here - width, row > 0),
            (here + width, row < height - 1),
            (here - 1, col > 0),
            (here + 1, col < width - 1),
        ):
            if inside and walkable[there] and parent[there] < 0:
                parent[there] = here
                queue.append(there)
    if parent[target] < 0:
        return None
    path = np.zeros(height * width, dtype=bool)
    here = target
    path[here] = True
    while here != source:
        here = parent[here]
        path[here] = True
    return path.reshape(height, width)


def generate_maze(size: int, rng: np.random.Generator) -> Maze:
    """A random perfect maze of side ``size``, carved by iterative randomized depth-first search.

    Args:
        size: Side of the grid, an odd integer >= 5 (``(size - 1) / 2`` cells per side).
        rng: The generator to draw from.

    Returns:
        A :class:`Maze` with two distinct random cells as start and end and its shortest path.

    Raises:
        InputError: If ``size`` is not an odd integer >= 5 or ``rng`` is not a generator.

    Examples:
        >>> maze = generate_maze(7, np.random.default_rng(0))
        >>> maze.open.shape, bool(maze.open[0].any()), bool(maze.path[maze.start])
        ((7, 7), False, True)
        >>> int(maze.open.sum())  # 9 cells and the 8 walls of a spanning tree
        17
    """
    size = check_maze_size("size", size)
    rng = check_rng(rng)
    side = (size - 1) // 2
    cells = side * side
    grid = [False] * (size * size)

    def open_cell(cell: int) -> None:
        row, col = divmod(cell, side)
        grid[(2 * row + 1) * size + 2 * col + 1] = True

    first = int(rng.integers(cells))
    draws = rng.random(cells - 1).tolist()  # one choice per carved wall
    visited = [False] * cells
    visited[first] = True
    open_cell(first)
    stack, carved = [first], 0
    while stack:
        here = stack[-1]
        row, col = divmod(here, side)
        options = [
            there
            for there, inside in (
                (here - side, row > 0),
                (here + side, row < side - 1),
                (here - 1, col > 0),
                (here + 1, col < side - 1),
            )
            if inside and not visited[there]
        ]
        if not options:
            stack.pop()
            continue
        there = options[int(draws[carved] * len(options))]
        carved += 1
        visited[there] = True
        open_cell(there)
        row2, col2 = divmod(there, side)
        grid[(row + row2 + 1) * size + col + col2 + 1] = True  # the wall between the two cells
        stack.append(there)
    open_grid = np.array(grid, dtype=bool).reshape(size, size)
    a, b = (int(i) for i in rng.choice(cells, size=2, replace=False))
    start = (2 * (a // side) + 1, 2 * (a % side) + 1)
    end = (2 * (b // side) + 1, 2 * (b % side) + 1)
    path = shortest_path(open_grid, start, end)
    assert path is not None  # a spanning tree connects every pair of cells
    open_grid.setflags(write=False)
    path.setflags(write=False)
    return Maze(open=open_grid, start=start, end=end, path=path)


def maze_tensors(mazes: Sequence[Maze]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack mazes of one size into model inputs and path targets.

    Args:
        mazes: Non-empty sequence of :class:`Maze` of equal size.

    Returns:
        ``inputs`` float32 ``(N, 3, H, W)``, channels ``[open, start, end]`` as 0/1, and
        ``target`` int64 ``(N, H, W)``, 1 on the path and 0 elsewhere.

    Raises:
        InputError: If ``mazes`` is empty, holds something else, or mixes sizes.

    Examples:
        >>> rng = np.random.default_rng(1)
        >>> inputs, target = maze_tensors([generate_maze(5, rng), generate_maze(5, rng)])
        >>> tuple(inputs.shape), inputs.dtype, tuple(target.shape), target.dtype
        ((2, 3, 5, 5), torch.float32, (2, 5, 5), torch.int64)
    """
    if not isinstance(mazes, Sequence) or not mazes:
        raise InputError(f"mazes must be a non-empty sequence of Maze, got {mazes!r}")
    bad = next((m for m in mazes if not isinstance(m, Maze)), None)
    if bad is not None:
        raise InputError(f"mazes must hold only Maze objects, got {type(bad).__name__}")
    sizes = sorted({m.open.shape for m in mazes})
    if len(sizes) > 1:
        raise InputError(f"mazes must all have the same size, got shapes {sizes}")
    count, (height, width) = len(mazes), sizes[0]
    inputs = np.zeros((count, 3, height, width), dtype=np.float32)
    target = np.zeros((count, height, width), dtype=np.int64)
    for i, maze in enumerate(mazes):
        inputs[i, 0] = maze.open
        inputs[(i, 1, *maze.start)] = 1.0
        inputs[(i, 2, *maze.end)] = 1.0
        target[i] = maze.path
    return torch.from_numpy(inputs), torch.from_numpy(target)


def maze_solved(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Whether each predicted path mask equals the target exactly.

    Args:
        prediction: ``(B, H, W)`` path mask (nonzero = on the path), e.g. class predictions.
        target: ``(B, H, W)`` path mask, as from :func:`maze_tensors`.

    Returns:
        bool ``(B,)``.

    Raises:
        InputError: If the shapes differ or are not ``(B, H, W)``.

    Examples:
        >>> target = torch.tensor([[[0, 1], [1, 1]], [[1, 0], [0, 0]]])
        >>> maze_solved(torch.tensor([[[0, 1], [1, 1]], [[1, 1], [0, 0]]]), target).tolist()
        [True, False]
    """
    if prediction.ndim != 3 or prediction.shape != target.shape:
        raise InputError(
            "prediction and target must both be (B, H, W) of the same shape, got "
            f"{tuple(prediction.shape)} and {tuple(target.shape)}"
        )
    return ((prediction != 0) == (target != 0)).flatten(1).all(dim=1)
