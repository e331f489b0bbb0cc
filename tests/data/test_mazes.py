"""Seeded mazes: perfect, with their shortest path, deterministic, encoded and scored."""

from collections import deque

import numpy as np
import pytest
import torch

from ada_modules.data.mazes import Maze, generate_maze, maze_solved, maze_tensors, shortest_path
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


def test_maze_class_is_frozen():
    maze = generate_maze(5, np.random.default_rng(0))
    assert isinstance(maze, Maze) and maze.size == 5
    with pytest.raises(AttributeError):
        maze.start = (1, 1)
