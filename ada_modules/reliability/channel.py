"""An LLM sampled at temperature ``T`` as a discrete noisy channel, plus checkers of its answers.

One call of a model on item ``x`` returns the correct answer with probability ``p(x)`` and a wrong
one otherwise, costs tokens, and the samples of one call can be correlated (a shared backbone and
prompt). This module states that view as interfaces, so that the reliability operators
(:mod:`ada_modules.reliability.operators`) work on a real model and on a simulation alike:

- :class:`Channel`: ``sample(item, n, generator=...)`` returns :class:`Samples` (``n`` answers and
  what the call cost). It has no ``truth``: a real model does not know the right answer, so
  correctness is judged by the caller, who holds the item's truth.
- :class:`Verifier`: ``check(item, answer, truth, generator=...)`` accepts or rejects an answer
  (a unit test, a reward model, a second model); ``cost`` per check.
- :class:`Critic`: ``refine(item, answer, truth, generator=...)`` returns a revised answer and the
  cost of the revision (self-refine).

``truth`` is passed to verifiers and critics so that simulated ones can act on it; a real checker
ignores it. The simulations are :class:`SimulatedChannel` (per-item accuracy, Zipf-distributed
distractors, correlation ``rho`` within a call), :class:`SimulatedVerifier` (true- and
false-positive rates) and :class:`SimulatedCritic` (the two-state keep/fix Markov chain).

Examples:
    >>> import torch
    >>> channel = SimulatedChannel([1.0, 0.0], num_distractors=1, cost=2.0)
    >>> g = torch.Generator().manual_seed(0)
    >>> channel.sample(0, 3, generator=g)
    Samples(answers=(0, 0, 0), cost=6.0)
    >>> channel.sample(1, 2, generator=g).answers, channel.truth(1)
    ((1, 1), 0)
"""

import math
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from ada_modules.errors import InputError

__all__ = [
    "Channel",
    "Critic",
    "Samples",
    "SimulatedChannel",
    "SimulatedCritic",
    "SimulatedVerifier",
    "Verifier",
]


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_nonnegative(name: str, value: object) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        raise InputError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InputError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _probabilities(name: str, value: object) -> Tensor:
    """``value`` (a number, a sequence or a tensor of at most one dimension) as float64 in [0, 1]."""
    try:
        rates = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputError(f"{name} must be numbers in [0, 1], got {value!r}") from error
    if rates.ndim > 1 or rates.numel() == 0:
        raise InputError(f"{name} must be a number or a non-empty 1-D sequence, got {value!r}")
    bad = ~((rates >= 0) & (rates <= 1))  # NaN fails both comparisons
    if bad.any():
        index = int(bad.reshape(-1).nonzero()[0, 0])
        raise InputError(
            f"{name} must be in [0, 1], got {rates.reshape(-1)[index].item()} at index {index}"
        )
    return rates


def _check_item(item: object, num_items: int) -> int:
    try:
        index = operator.index(item)  # type: ignore[arg-type]
    except TypeError as error:
        raise InputError(f"item must be an integer, got {item!r}") from error
    if not 0 <= index < num_items:
        raise InputError(f"item must be in [0, {num_items}), got {index}")
    return index


@dataclass(frozen=True)
class Samples:
    """The answers of one channel call and what the call cost (tokens, money, seconds)."""

    answers: tuple[Hashable, ...]
    cost: float

    def __post_init__(self) -> None:
        if not isinstance(self.answers, tuple):
            raise InputError(f"answers must be a tuple, got {type(self.answers).__name__}")
        _check_nonnegative("cost", self.cost)


@runtime_checkable
class Channel(Protocol):
    """A model that answers items: one call draws ``n`` answers (possibly correlated)."""

    name: str

    def sample(self, item: int, n: int, *, generator: torch.Generator) -> Samples:
        """``n`` answers to ``item`` from one call, and its cost."""
        ...


@runtime_checkable
class Verifier(Protocol):
    """Accepts or rejects an answer; each :meth:`check` costs ``cost``."""

    cost: float

    def check(
        self, item: int, answer: Hashable, truth: Hashable, *, generator: torch.Generator
    ) -> bool:
        """Whether ``answer`` to ``item`` passes (``truth`` is for simulations only)."""
        ...


@runtime_checkable
class Critic(Protocol):
    """Revises an answer (self-refine)."""

    def refine(
        self, item: int, answer: Hashable, truth: Hashable, *, generator: torch.Generator
    ) -> tuple[Hashable, float]:
        """The revised answer and the cost of the revision (``truth`` is for simulations only)."""
        ...


class SimulatedChannel:
    """A simulated model: per-item accuracy, Zipf-distributed wrong answers, correlated samples.

    Answers are ints: ``0`` is the correct answer of every item (:meth:`truth`) and
    ``1 .. num_distractors`` are the distractors, drawn with probabilities proportional to
    ``1 / r ** zipf_exponent``. So one draw on item ``x`` is ``0`` with probability
    ``accuracy[x]`` and distractor ``r`` with ``(1 - accuracy[x]) * zipf(r)``.

    Correlation: one :meth:`sample` call draws a shared answer, and each of its ``n`` samples is
    that shared answer with probability ``sqrt(correlation)``, otherwise an independent draw. Two
    samples agree through the shared answer only when both copy it (probability ``correlation``),
    so their correctness indicators (indeed the indicators of any answer) have correlation
    ``correlation``, and the vote share of ``K`` samples has the variance of
    ``n_eff = K / (1 + (K - 1) * correlation)`` independent ones. Separate calls are independent.

    Args:
        accuracy: Single-call accuracy of each item, in [0, 1] (a sequence or a 1-D tensor).
        num_distractors: Wrong answers per item (>= 1).
        zipf_exponent: Exponent ``s`` of the distractor distribution (0: uniform).
        correlation: Correlation ``rho`` in [0, 1] of the samples of one call.
        cost: Cost of one sample; a call of ``n`` samples costs ``n * cost``.
        name: Name of the channel (for reports).

    Raises:
        InputError: If an argument is out of range, naming it.

    Examples:
        >>> import torch
        >>> channel = SimulatedChannel([0.9, 0.5], correlation=0.3)
        >>> len(channel), channel.truth(0), channel.accuracy.tolist()
        (2, 0, [0.9, 0.5])
        >>> channel.sample(1, 4, generator=torch.Generator().manual_seed(0)).cost
        4.0
    """

    def __init__(
        self,
        accuracy: Sequence[float] | Tensor,
        *,
        num_distractors: int = 4,
        zipf_exponent: float = 1.0,
        correlation: float = 0.0,
        cost: float = 1.0,
        name: str = "sim",
    ) -> None:
        accuracy = _probabilities("accuracy", accuracy)
        if accuracy.ndim != 1:
            raise InputError(f"accuracy must be a 1-D sequence, got {accuracy.tolist()!r}")
        _check_count("num_distractors", num_distractors, 1)
        zipf_exponent = _check_nonnegative("zipf_exponent", zipf_exponent)
        self.correlation = _check_probability("correlation", correlation)
        self.cost = _check_nonnegative("cost", cost)
        self.accuracy = accuracy
        self.num_distractors = num_distractors
        self.name = name
        ranks = torch.arange(1, num_distractors + 1, dtype=torch.float64)
        zipf = ranks.pow(-zipf_exponent)
        zipf = zipf / zipf.sum()
        self._probs = torch.cat([accuracy[:, None], (1 - accuracy)[:, None] * zipf], dim=1)
        self._copy_probability = math.sqrt(self.correlation)

    def __len__(self) -> int:
        return self.accuracy.numel()

    def truth(self, item: int) -> int:
        """The correct answer of ``item``: always ``0``."""
        _check_item(item, len(self))
        return 0

    def sample(self, item: int, n: int, *, generator: torch.Generator) -> Samples:
        """``n`` answers to ``item`` from one call (correlated as described above)."""
        item = _check_item(item, len(self))
        n = _check_count("n", n, 1)
        draws = torch.multinomial(self._probs[item], n + 1, replacement=True, generator=generator)
        copies = torch.rand(n, generator=generator, dtype=torch.float64) < self._copy_probability
        answers = torch.where(copies, draws[0], draws[1:])
        return Samples(tuple(answers.tolist()), n * self.cost)


class SimulatedVerifier:
    """A noisy checker: accepts a correct answer with probability ``tpr``, a wrong one with ``fpr``.

    Args:
        tpr: True-positive rate, in [0, 1].
        fpr: False-positive rate, in [0, 1].
        cost: Cost of one check.

    Raises:
        InputError: If an argument is out of range, naming it.

    Examples:
        >>> import torch
        >>> verifier = SimulatedVerifier(tpr=1.0, fpr=0.0)
        >>> g = torch.Generator().manual_seed(0)
        >>> verifier.check(0, 0, 0, generator=g), verifier.check(0, 3, 0, generator=g)
        (True, False)
    """

    def __init__(self, tpr: float, fpr: float, *, cost: float = 0.0) -> None:
        self.tpr = _check_probability("tpr", tpr)
        self.fpr = _check_probability("fpr", fpr)
        self.cost = _check_nonnegative("cost", cost)

    def check(
        self, item: int, answer: Hashable, truth: Hashable, *, generator: torch.Generator
    ) -> bool:
        """Whether ``answer`` passes (``item`` is unused: the rates are the same for all items)."""
        rate = self.tpr if answer == truth else self.fpr
        return torch.rand((), generator=generator, dtype=torch.float64).item() < rate


class SimulatedCritic:
    """A critic as the two-state Markov chain of generator-critic refinement.

    A correct answer stays correct with probability ``keep`` (``a``), else it becomes a distractor
    drawn uniformly from ``1 .. num_distractors`` (the answers of :class:`SimulatedChannel`, whose
    truth is ``0``); a wrong answer is fixed (becomes ``truth``) with probability ``fix`` (``b``),
    else it stays as it is. So ``p_{t+1} = b + (a - b) * p_t``, with fixed point
    ``p* = b / (1 - a + b)``.

    Args:
        keep: ``a``, a number or one per item, in [0, 1].
        fix: ``b``, a number or one per item, in [0, 1].
        cost: Cost of one refinement.
        num_distractors: Wrong answers a broken answer is drawn from (must not contain ``truth``).

    Raises:
        InputError: If an argument is out of range, naming it.

    Examples:
        >>> import torch
        >>> critic = SimulatedCritic(keep=1.0, fix=[1.0, 0.0])
        >>> g = torch.Generator().manual_seed(0)
        >>> critic.refine(0, 2, 0, generator=g), critic.refine(1, 2, 0, generator=g)
        ((0, 1.0), (2, 1.0))
    """

    def __init__(
        self,
        keep: float | Sequence[float] | Tensor,
        fix: float | Sequence[float] | Tensor,
        *,
        cost: float = 1.0,
        num_distractors: int = 4,
    ) -> None:
        self.keep = _probabilities("keep", keep)
        self.fix = _probabilities("fix", fix)
        self.cost = _check_nonnegative("cost", cost)
        self.num_distractors = _check_count("num_distractors", num_distractors, 1)

    @staticmethod
    def _rate(rates: Tensor, item: int) -> float:
        if rates.ndim == 0:
            return rates.item()
        return rates[_check_item(item, rates.numel())].item()

    def refine(
        self, item: int, answer: Hashable, truth: Hashable, *, generator: torch.Generator
    ) -> tuple[Hashable, float]:
        """The revised answer and :attr:`cost`."""
        if truth in range(1, self.num_distractors + 1):
            raise InputError(
                f"truth must not be one of the critic's distractors 1..{self.num_distractors}, "
                f"got {truth!r}"
            )
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if answer == truth:
            if u < self._rate(self.keep, item):
                return answer, self.cost
            distractor = torch.randint(self.num_distractors, (), generator=generator).item()
            return 1 + distractor, self.cost
        if u < self._rate(self.fix, item):
            return truth, self.cost
        return answer, self.cost
