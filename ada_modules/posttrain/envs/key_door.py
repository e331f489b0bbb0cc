"""A key-and-door grid maze played through one-character actions and short text observations."""

import random
from collections import deque

from ada_modules.errors import InputError
from ada_modules.posttrain.envs.base import Episode, TextEnv

__all__ = ["KeyDoorEnv"]

_MOVES = {"u": (-1, 0), "d": (1, 0), "l": (0, -1), "r": (0, 1)}


class _KeyDoorEpisode(Episode):
    def __init__(
        self,
        env: "KeyDoorEnv",
        walls: frozenset,
        agent: tuple[int, int],
        key: tuple[int, int],
        door: tuple[int, int],
        budget: int,
    ) -> None:
        self.env = env
        self.walls = walls
        self.agent = agent
        self.key = key
        self.door = door
        self.has_key = False
        self.budget = budget
        self.turns = 0
        self.done = False
        self.reward = 0.0
        self.success = False
        self.observation = self._render()

    def _render(self) -> str:
        target = self.target()
        rows = "u" if target[0] < self.agent[0] else "d" if target[0] > self.agent[0] else "="
        cols = "l" if target[1] < self.agent[1] else "r" if target[1] > self.agent[1] else "="
        walls = "".join(
            "1" if self.env.blocked(self.walls, self._moved(m)) else "0" for m in _MOVES
        )
        return f"{'k' if self.has_key else 'n'}{rows}{cols}{walls}:"

    def _moved(self, move: str) -> tuple[int, int]:
        dr, dc = _MOVES[move]
        return self.agent[0] + dr, self.agent[1] + dc

    def target(self) -> tuple[int, int]:
        return self.door if self.has_key else self.key

    def step(self, action: str) -> None:
        self._begin_step()
        if action in _MOVES and not self.env.blocked(self.walls, self._moved(action)):
            self.agent = self._moved(action)
        if self.agent == self.key:
            self.has_key = True
        if self.has_key and self.agent == self.door:
            self.done, self.success, self.reward = True, True, 1.0
        elif self.turns >= self.budget:
            self.done = True
        self.observation = self._render()


class KeyDoorEnv(TextEnv):
    """Fetch the key, then reach the door, on a small grid with walls; reward 1 on success.

    Each task (from a seed) places walls, the agent, the key and the door on a ``size x size``
    grid so that the key and then the door are reachable. The agent answers each observation with
    one character, ``u``/``d``/``l``/``r``; anything else, or a move into a wall or the border,
    wastes the turn. Stepping on the key picks it up. The episode ends with reward 1 when the agent
    stands on the door holding the key, or with reward 0 after ``shortest path + slack`` turns
    (at most ``max_turns``): a wasted turn uses one turn of slack, a step away from the target two.

    The observation is local (the maze is partially observable): ``k`` if the agent holds the key
    else ``n``; the direction of the current target (the key, then the door) along rows (``u``,
    ``d`` or ``=``) and columns (``l``, ``r`` or ``=``); four bits saying whether ``u``, ``d``,
    ``l``, ``r`` are blocked; then ``:``. E.g. ``"nd=0100:"``: no key yet, the key is straight
    down, and the way down is blocked.

    The scripted demonstrator follows a shortest path (ties broken at random) and, with
    probability ``noise``, plays a uniformly random move instead.

    Args:
        size: Side of the grid, 3 to 9.
        num_walls: Wall cells per task.
        slack: Turns allowed beyond the shortest solution.
        noise: Probability that the demonstrator plays a random move.

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> env = KeyDoorEnv(size=4, num_walls=0, slack=2)
        >>> episode = env.reset(seed=3)
        >>> episode.observation
        'ndl0001:'
        >>> rng = random.Random(0)
        >>> while not episode.done:
        ...     episode.step(env.demonstrator_action(episode, rng))
        >>> episode.success, episode.reward
        (True, 1.0)
    """

    def __init__(
        self,
        size: int = 5,
        num_walls: int = 3,
        slack: int = 2,
        noise: float = 0.3,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or not 3 <= size <= 9:
            raise InputError(f"size must be an integer in [3, 9], got {size!r}")
        if not isinstance(num_walls, int) or not 0 <= num_walls <= size * size - 3 - size:
            raise InputError(
                f"num_walls must be an integer in [0, {size * size - 3 - size}], got {num_walls!r}"
            )
        if not isinstance(slack, int) or slack < 0:
            raise InputError(f"slack must be an integer >= 0, got {slack!r}")
        if not 0.0 <= noise <= 1.0:
            raise InputError(f"noise must be in [0, 1], got {noise!r}")
        # Worst case: two shortest paths around the walls, each below the number of free cells.
        super().__init__(max_turns=2 * (size * size - num_walls) + slack, max_action_tokens=1)
        self.size = size
        self.num_walls = num_walls
        self.slack = slack
        self.noise = noise

    def blocked(self, walls: frozenset, cell: tuple[int, int]) -> bool:
        """Whether ``cell`` is a wall or outside the grid."""
        row, col = cell
        return not (0 <= row < self.size and 0 <= col < self.size) or cell in walls

    def _distances(self, walls: frozenset, source: tuple[int, int]) -> dict:
        dist = {source: 0}
        queue = deque([source])
        while queue:
            cell = queue.popleft()
            for dr, dc in _MOVES.values():
                nxt = (cell[0] + dr, cell[1] + dc)
                if nxt not in dist and not self.blocked(walls, nxt):
                    dist[nxt] = dist[cell] + 1
                    queue.append(nxt)
        return dist

    def task_id(self, seed: int) -> str:
        """The layout of the task of ``seed``: walls, agent, key and door."""
        episode = self.reset(seed)
        assert isinstance(episode, _KeyDoorEpisode)
        return repr((sorted(episode.walls), episode.agent, episode.key, episode.door))

    def reset(self, seed: int) -> Episode:
        """A new episode of the task of ``seed`` (layouts are redrawn until solvable)."""
        rng = random.Random(seed)
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        while True:
            chosen = rng.sample(cells, self.num_walls + 3)
            walls = frozenset(chosen[3:])
            agent, key, door = chosen[:3]
            to_key = self._distances(walls, agent).get(key)
            to_door = self._distances(walls, key).get(door)
            if to_key is not None and to_door is not None:
                budget = to_key + to_door + self.slack
                return _KeyDoorEpisode(self, walls, agent, key, door, budget)

    def demonstrator_action(self, episode: Episode, rng: random.Random) -> str:
        """A shortest-path move to the current target, or a random move with prob. ``noise``."""
        assert isinstance(episode, _KeyDoorEpisode)
        if rng.random() < self.noise:
            return rng.choice(tuple(_MOVES))
        dist = self._distances(episode.walls, episode.target())
        here = dist[episode.agent]
        best = [m for m in _MOVES if dist.get(episode._moved(m), here + 1) < here]
        return rng.choice(best)
