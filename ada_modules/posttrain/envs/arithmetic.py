"""Single-turn verifiable addition: the foundation's scratchpad task as an environment."""

import random

from ada_modules.data.arithmetic import addition_scratchpad
from ada_modules.errors import InputError
from ada_modules.posttrain.envs.base import Episode, TextEnv

__all__ = ["ArithmeticEnv"]

_ANSWER_MARKER = ">"


class _ArithmeticEpisode(Episode):
    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b
        self.observation = f"{a}+{b}="
        self.turns = 0
        self.done = False
        self.reward = 0.0
        self.success = False

    def step(self, action: str) -> None:
        self._begin_step()
        head, marker, answer = action.rpartition(_ANSWER_MARKER)
        self.success = bool(marker) and answer == str(self.a + self.b)
        self.reward = float(self.success)
        self.done = True
        self.observation = ""


class ArithmeticEnv(TextEnv):
    """Add two numbers with a scratchpad; reward 1 when the answer after ``>`` is the sum.

    The observation is ``a+b=`` (as in :class:`~ada_modules.data.ArithmeticDataModule`); the agent
    answers once, ending with the end token. The scripted demonstrator writes
    :func:`~ada_modules.data.addition_scratchpad`; with probability ``noise`` it writes a wrong final
    answer (the sum changed by a small amount at one digit position) after a correct scratchpad.

    Privileged views (:meth:`privileged_info`, for self-distillation): ``solution`` the whole
    scratchpad and answer; ``partial`` its first half of steps (the first ``ceil(steps / 2)``);
    ``feedback`` the correct completion up to and including the first character where the agent's
    response differs from it; ``noisy`` the whole scratchpad with each digit replaced, with
    probability ``view_noise``, by another digit (the same corruption for every call on a task).

    Args:
        min_digits: Fewest digits of an operand.
        max_digits: Most digits of an operand.
        noise: Probability that a demonstration contains an error.
        max_action_tokens: Most tokens of the answer.
        view_noise: Probability that a digit of the ``noisy`` view is wrong.

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> env = ArithmeticEnv(min_digits=2, max_digits=2, noise=0.0)
        >>> episode = env.reset(seed=0)
        >>> episode.observation
        '63+43='
        >>> episode.step(env.demonstrator_action(episode, random.Random(0)))
        >>> episode.reward
        1.0
        >>> env.privileged_info(seed=0, response="3+3+0=6,6+4+0=11>116")["feedback"]
        '3+3+0=6,6+4+0=10'
    """

    privileged_fields = ("solution", "partial", "feedback", "noisy")

    def __init__(
        self,
        min_digits: int = 1,
        max_digits: int = 2,
        noise: float = 0.5,
        max_action_tokens: int = 40,
        view_noise: float = 0.2,
    ) -> None:
        super().__init__(max_turns=1, max_action_tokens=max_action_tokens)
        if isinstance(min_digits, bool) or not isinstance(min_digits, int) or min_digits < 1:
            raise InputError(f"min_digits must be an integer >= 1, got {min_digits!r}")
        if not isinstance(max_digits, int) or not min_digits <= max_digits <= 8:
            raise InputError(
                f"max_digits must be an integer in [min_digits={min_digits}, 8], got {max_digits!r}"
            )
        if not 0.0 <= noise <= 1.0:
            raise InputError(f"noise must be in [0, 1], got {noise!r}")
        if isinstance(view_noise, bool) or not 0.0 <= view_noise <= 1.0:
            raise InputError(f"view_noise must be in [0, 1], got {view_noise!r}")
        self.view_noise = view_noise
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.noise = noise

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)

    def reset(self, seed: int) -> Episode:
        """A new episode adding the two operands drawn from ``seed``."""
        rng = random.Random(seed)
        return _ArithmeticEpisode(self._operand(rng), self._operand(rng))

    def demonstrator_action(self, episode: Episode, rng: random.Random) -> str:
        """The scratchpad, with a wrong final answer with probability ``noise``."""
        assert isinstance(episode, _ArithmeticEpisode)
        if rng.random() >= self.noise:
            return addition_scratchpad(episode.a, episode.b)
        digits = max(len(str(episode.a)), len(str(episode.b)))
        position = rng.randrange(digits)
        delta = rng.choice([d for d in range(-3, 4) if d])
        total = episode.a + episode.b + delta * 10**position
        if total < 0:
            total = episode.a + episode.b + abs(delta) * 10**position
        return addition_scratchpad(episode.a, episode.b).rpartition(_ANSWER_MARKER)[0] + (
            _ANSWER_MARKER + str(total)
        )

    def solution(self, seed: int) -> str:
        """The scratchpad and the sum of the task of ``seed``."""
        episode = self.reset(seed)
        assert isinstance(episode, _ArithmeticEpisode)
        return addition_scratchpad(episode.a, episode.b)

    def privileged_info(self, seed: int, response: str) -> dict[str, str]:
        """The ``solution``, ``partial``, ``feedback`` and ``noisy`` views of the task of ``seed``."""
        solution = self.solution(seed)
        steps = solution.rpartition(_ANSWER_MARKER)[0].split(",")
        first_error = next(
            (i for i, (x, y) in enumerate(zip(response, solution, strict=False)) if x != y),
            min(len(response), len(solution) - 1),
        )
        rng = random.Random(seed * 7919 + 17)
        noisy = "".join(
            str((int(ch) + rng.randint(1, 9)) % 10)
            if ch.isdigit() and rng.random() < self.view_noise
            else ch
            for ch in solution
        )
        return {
            "solution": solution,
            "partial": ",".join(steps[: (len(steps) + 1) // 2]),
            "feedback": solution[: first_error + 1],
            "noisy": noisy,
        }
