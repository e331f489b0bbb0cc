"""Single-turn verifiable sorting of digits, with privileged views for self-distillation."""

import math
import random

from ada_modules.errors import InputError
from ada_modules.posttrain.envs.base import Episode, TextEnv

__all__ = ["SortingEnv"]

_DIGITS = "0123456789"


class _SortingEpisode(Episode):
    def __init__(self, digits: str) -> None:
        self.digits = digits
        self.answer = "".join(sorted(digits))
        self.observation = f"{digits}:"
        self.turns = 0
        self.done = False
        self.reward = 0.0
        self.success = False

    def step(self, action: str) -> None:
        self._begin_step()
        self.success = action == self.answer
        self.reward = float(self.success)
        self.done = True
        self.observation = ""


class SortingEnv(TextEnv):
    """Sort a string of digits; reward 1 when the answer is exactly the sorted string.

    The observation is the ``length`` digits followed by ``:`` (``52813:``); the agent answers once
    with the digits in ascending order (``12358``), ending with the end token. The scripted
    demonstrator writes the sorted string; with probability ``noise`` it makes one error: it swaps
    two adjacent different digits (or, if all digits are equal, replaces one by another digit).

    Privileged views (:meth:`privileged_info`): ``solution`` is the sorted string, ``partial`` its
    first half (rounded up), ``feedback`` the sorted string up to and including the first position
    where the response is wrong or missing (the whole of it if the response starts with it), and
    ``noisy`` the sorted string with each digit replaced, with probability ``view_noise``, by a
    different random digit (fixed per task, independent of the response).

    Args:
        length: Number of digits to sort (2 to 12, repeats allowed).
        noise: Probability that a demonstration contains an error.
        view_noise: Probability that the ``noisy`` view corrupts a digit.
        max_action_tokens: Most tokens of the answer (``length + 2`` by default).

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> env = SortingEnv(length=5, noise=0.0)
        >>> episode = env.reset(seed=0)
        >>> episode.observation
        '66048:'
        >>> episode.step(env.demonstrator_action(episode, random.Random(0)))
        >>> episode.reward
        1.0
        >>> env.privileged_info(0, "04686")["feedback"]
        '0466'
    """

    privileged_fields = ("solution", "partial", "feedback", "noisy")

    def __init__(
        self,
        length: int = 5,
        noise: float = 0.5,
        view_noise: float = 0.2,
        max_action_tokens: int | None = None,
    ) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or not 2 <= length <= 12:
            raise InputError(f"length must be an integer in [2, 12], got {length!r}")
        for name, value in (("noise", noise), ("view_noise", view_noise)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputError(f"{name} must be a number in [0, 1], got {value!r}")
            if not 0.0 <= value <= 1.0:
                raise InputError(f"{name} must be in [0, 1], got {value!r}")
        if max_action_tokens is None:
            max_action_tokens = length + 2
        super().__init__(max_turns=1, max_action_tokens=max_action_tokens)
        self.length = length
        self.noise = noise
        self.view_noise = view_noise

    def reset(self, seed: int) -> Episode:
        """A new episode sorting the ``length`` digits drawn from ``seed``."""
        rng = random.Random(seed)
        return _SortingEpisode("".join(rng.choice(_DIGITS) for _ in range(self.length)))

    def demonstrator_action(self, episode: Episode, rng: random.Random) -> str:
        """The sorted digits, with one error with probability ``noise``."""
        assert isinstance(episode, _SortingEpisode)
        answer = list(episode.answer)
        if rng.random() >= self.noise:
            return episode.answer
        swaps = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
        if swaps:
            i = rng.choice(swaps)
            answer[i], answer[i + 1] = answer[i + 1], answer[i]
        else:
            i = rng.randrange(len(answer))
            answer[i] = rng.choice(_DIGITS.replace(answer[i], ""))
        return "".join(answer)

    def solution(self, seed: int) -> str:
        """The sorted digits of the task of ``seed``."""
        return "".join(sorted(self.reset(seed).digits))

    def privileged_info(self, seed: int, response: str) -> dict[str, str]:
        """The ``solution``, ``partial``, ``feedback`` and ``noisy`` views of the task of ``seed``.

        ``feedback`` depends on ``response``; the other views ignore it.
        """
        answer = self.solution(seed)
        wrong = next(
            (i for i, ch in enumerate(answer) if i >= len(response) or response[i] != ch),
            len(answer) - 1,
        )
        rng = random.Random(seed * 7919 + 17)
        noisy = "".join(
            rng.choice(_DIGITS.replace(ch, "")) if rng.random() < self.view_noise else ch
            for ch in answer
        )
        return {
            "solution": answer,
            "partial": answer[: math.ceil(len(answer) / 2)],
            "feedback": answer[: wrong + 1],
            "noisy": noisy,
        }
