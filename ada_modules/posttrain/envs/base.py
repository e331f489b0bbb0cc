"""The text-environment interface of the on-policy loop: tasks from a seed, episodes, demos."""

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ada_modules.errors import InputError

__all__ = ["Episode", "TextEnv", "Transcript"]


class Episode(ABC):
    """One running episode of a task: the agent reads ``observation`` and answers with ``step``.

    Attributes:
        observation: The text shown to the agent before its next response.
        done: Whether the episode has ended.
        reward: Outcome reward of the episode so far (sparse: set when it ends).
        success: Whether the episode ended with the task solved.
        turns: Responses received so far.
    """

    observation: str
    done: bool = False
    reward: float = 0.0
    success: bool = False
    turns: int = 0

    @abstractmethod
    def step(self, action: str) -> None:
        """Apply the agent's response ``action``; update ``observation``, ``done``, ``reward``.

        Raises:
            RuntimeError: If the episode has already ended.
        """

    def _begin_step(self) -> None:
        if self.done:
            raise RuntimeError("step() called on an episode that has ended")
        self.turns += 1


@dataclass(frozen=True)
class Transcript:
    """A finished episode as text: the first observation, then (response, observation) turns.

    Attributes:
        observations: ``observations[t]`` is shown before response ``t``; one more than
            ``actions`` unless the episode ended (then the final observation is left out).
        actions: The agent's responses.
        reward: Outcome reward.
        success: Whether the task was solved.
    """

    observations: tuple[str, ...]
    actions: tuple[str, ...]
    reward: float
    success: bool


class TextEnv(ABC):
    """A distribution of text tasks, each drawn from an integer seed, with a scripted demonstrator.

    A subclass implements :meth:`reset` (a fresh :class:`Episode` of the task of a seed) and
    :meth:`demonstrator_action` (the noisy scripted expert). An agent response ends with the end
    token unless it reaches ``max_action_tokens`` (so one-token actions need no end token).

    Args:
        max_turns: Most responses per episode (the episode ends after them).
        max_action_tokens: Most tokens per response.

    Raises:
        ValueError: If an argument is out of range, naming it.
    """

    def __init__(self, max_turns: int, max_action_tokens: int) -> None:
        for name, value in (("max_turns", max_turns), ("max_action_tokens", max_action_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_turns = max_turns
        self.max_action_tokens = max_action_tokens

    @abstractmethod
    def reset(self, seed: int) -> Episode:
        """A new episode of the task drawn from ``seed`` (equal seeds give equal tasks)."""

    def task_id(self, seed: int) -> str:
        """A string that identifies the task of ``seed`` (equal for equal tasks).

        Used to keep held-out tasks out of training; the first observation by default.
        """
        return self.reset(seed).observation

    @abstractmethod
    def demonstrator_action(self, episode: Episode, rng: random.Random) -> str:
        """The scripted (noisy) demonstrator's response to the episode's current observation."""

    #: Names of the privileged texts :meth:`privileged_info` returns (empty: it has none).
    privileged_fields: tuple[str, ...] = ()

    def solution(self, seed: int) -> str:
        """A correct response to the task of ``seed`` (single-turn tasks with privileged views).

        Raises:
            ValueError: If the environment has no privileged information.
        """
        raise InputError(f"{type(self).__name__} provides no privileged information")

    def privileged_info(self, seed: int, response: str) -> dict[str, str]:
        """Privileged texts about the task of ``seed``, one per name in :attr:`privileged_fields`.

        For self-distillation (:class:`~ada_modules.models.SelfDistillationModule`): a teacher sees
        one of them in its context, the student none. ``response`` is the agent's answer, for the
        texts that comment on it (feedback on its first error); the others ignore it. Equal
        arguments give equal texts.

        Raises:
            ValueError: If the environment has no privileged information.
        """
        raise InputError(f"{type(self).__name__} provides no privileged information")

    def demonstrate(self, seed: int, rng: random.Random) -> Transcript:
        """Run the demonstrator on the task of ``seed`` until the episode ends."""
        episode = self.reset(seed)
        observations, actions = [episode.observation], []
        while not episode.done:
            action = self.demonstrator_action(episode, rng)
            episode.step(action)
            actions.append(action)
            if not episode.done:
                observations.append(episode.observation)
        return Transcript(tuple(observations), tuple(actions), episode.reward, episode.success)
