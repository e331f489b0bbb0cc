"""Five reliability operators over a :class:`~ada_modules.reliability.channel.Channel`.

Retry, majority voting, self-consistency, best-of-N, self-refine and adaptive stopping are each a
classical reliability operator once an LLM is seen as a noisy channel (sixth, difficulty-adaptive
routing, picks among these per item: see the router of this package):

- :class:`DiversityCombining`: draw ``K`` samples in one call and combine them (plurality vote,
  weighted vote, or best-of-N with a verifier).
- :class:`HybridRetransmission`: HARQ; sample, let a verifier check the decision, stop on accept.
  Chase combining keeps the earlier votes, incremental redundancy decides on each round alone.
- :class:`GeneratorCritic`: one sample, then rounds of critic refinement (iterative decoding).
- :class:`RatelessSampling`: sample until the vote is confident (Adaptive-Consistency's Beta
  stopping rule, Aggarwal et al., EMNLP 2023), like a fountain code sending until decodable.
- :class:`RedundantVerification`: draw candidates until one passes ``min_pass`` of ``J`` checks.

Every operator is called as ``operator(channel, item, truth=..., generator=...)`` and returns an
:class:`Outcome`: the answer, everything spent (channel calls and verifier or critic costs, also
when it stops early), the channel samples drawn and the rounds run. ``truth`` only reaches
verifiers and critics (simulated ones act on it); judge the answer with
:meth:`Outcome.is_correct`.

Examples:
    >>> import torch
    >>> from ada_modules.reliability.channel import SimulatedChannel, SimulatedVerifier
    >>> channel = SimulatedChannel([1.0, 0.0], num_distractors=1, cost=2.0)
    >>> g = torch.Generator().manual_seed(0)
    >>> vote = DiversityCombining(num_samples=5)
    >>> vote(channel, 0, truth=0, generator=g)
    Outcome(answer=0, cost=10.0, samples=5, rounds=1)
    >>> harq = HybridRetransmission(max_rounds=3, verifier=SimulatedVerifier(1.0, 0.0, cost=0.5))
    >>> harq(channel, 1, truth=0, generator=g).cost  # never accepted: 3 calls and 3 checks
    7.5
"""

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Literal, Protocol

import torch

from ada_modules.errors import InputError
from ada_modules.reliability.channel import (
    Channel,
    Critic,
    Samples,
    Verifier,
    _check_count,
    _check_nonnegative,
)

__all__ = [
    "DiversityCombining",
    "GeneratorCritic",
    "HybridRetransmission",
    "Operator",
    "Outcome",
    "RatelessSampling",
    "RedundantVerification",
    "leader_confidence",
    "plurality",
]

_RULES = ("majority", "weighted", "best_of_n")
_MODES = ("chase", "incremental")


@dataclass(frozen=True)
class Outcome:
    """What an operator returned for one item and what it spent.

    Attributes:
        answer: The final answer.
        cost: Everything spent: channel calls plus verifier and critic costs.
        samples: Channel samples drawn.
        rounds: Rounds run (channel calls of a sequential operator, critic rounds, or ``1``).
    """

    answer: Hashable
    cost: float
    samples: int
    rounds: int

    def is_correct(self, truth: Hashable) -> bool:
        """Whether :attr:`answer` equals ``truth``."""
        return self.answer == truth


class Operator(Protocol):
    """A reliability operator: answers ``item`` through ``channel``."""

    def __call__(
        self, channel: Channel, item: int, *, truth: Hashable, generator: torch.Generator
    ) -> Outcome:
        """The :class:`Outcome` on ``item`` (``truth`` only reaches verifiers and critics)."""
        ...


def plurality(
    answers: Sequence[Hashable], weights: Callable[[Hashable], float] | None = None
) -> Hashable:
    """The answer with the most votes; a tie goes to the answer sampled first.

    Args:
        answers: The votes, in sampling order; all of one type (``1`` and ``"1"`` are not
            compared).
        weights: Weight of a vote for an answer (e.g. a reward model's score of the answer); each
            vote counts ``1`` when ``None``.

    Raises:
        InputError: If ``answers`` is empty or mixes types, or a weight is not finite.

    Examples:
        >>> plurality([2, 1, 1, 2, 3])
        2
        >>> plurality(["a", "b", "b"], weights={"a": 3.0, "b": 1.0}.get)
        'a'
    """
    if len(answers) == 0:
        raise InputError("answers must not be empty")
    types = sorted({type(answer).__name__ for answer in answers})
    if len(types) > 1:
        raise InputError(f"answers in one vote must be of one type, got {' and '.join(types)}")
    scores: dict[Hashable, float] = dict(Counter(answers))  # in order of first appearance
    if weights is not None:
        for answer, votes in scores.items():
            weight = weights(answer)
            if isinstance(weight, torch.Tensor) and weight.numel() == 1:
                weight = weight.item()  # e.g. a reward model's score
            if (
                isinstance(weight, bool)
                or not isinstance(weight, Real)
                or not math.isfinite(weight)
            ):
                raise InputError(
                    f"weight of answer {answer!r} must be a finite real number, got {weight!r}"
                )
            scores[answer] = votes * float(weight)
    return max(scores, key=scores.__getitem__)


def leader_confidence(leader_votes: int, runner_up_votes: int) -> float:
    """``P(theta > 1/2)`` for ``theta ~ Beta(leader_votes + 1, runner_up_votes + 1)``.

    The Beta stopping rule of Adaptive-Consistency: the posterior probability, under a uniform
    prior, that the leading answer beats the runner-up. For integer votes it is the binomial sum
    ``sum_{k <= v1} C(v1 + v2 + 1, k) / 2 ** (v1 + v2 + 1)``, computed exactly.

    Examples:
        >>> leader_confidence(4, 0)
        0.96875
        >>> leader_confidence(3, 3)
        0.5
    """
    for name, votes in (("leader_votes", leader_votes), ("runner_up_votes", runner_up_votes)):
        _check_count(name, votes, 0)
    total = leader_votes + runner_up_votes + 1
    return sum(math.comb(total, k) for k in range(leader_votes + 1)) / 2**total


def _draw(channel: Channel, item: int, n: int, generator: torch.Generator) -> Samples:
    drawn = channel.sample(item, n, generator=generator)
    if not isinstance(drawn, Samples) or len(drawn.answers) != n:
        raise InputError(
            f"channel {channel.name!r} must return Samples of {n} answers, got {drawn!r}"
        )
    return drawn


def _check_verifier(name: str, verifier: object) -> None:
    if not isinstance(verifier, Verifier):
        raise InputError(f"{name} must be a Verifier (cost and check), got {verifier!r}")
    _check_nonnegative(f"{name}.cost", verifier.cost)


def _check_cost(verifier: Verifier) -> float:
    """The verifier's cost per check, checked when it is spent (it is a mutable attribute)."""
    return _check_nonnegative(f"cost of verifier {verifier!r}", verifier.cost)


def _set_count(operator: object, name: str, minimum: int) -> None:
    """Check the count field ``name`` of a frozen operator and store it as an ``int``."""
    object.__setattr__(operator, name, _check_count(name, getattr(operator, name), minimum))


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InputError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class DiversityCombining:
    """Draw ``num_samples`` answers in one call and combine them.

    Rules:

    - ``"majority"``: plurality vote (self-consistency); a tie goes to the answer sampled first.
    - ``"weighted"``: plurality vote where a vote for answer ``y`` counts ``weights(y)``
      (confidence- or reward-weighted voting, the analogue of maximal-ratio combining).
    - ``"best_of_n"``: the first sample, in sampling order, that ``verifier`` accepts (selection
      combining); each sample checked costs ``verifier.cost``. If none passes, the plurality.

    Args:
        num_samples: Samples ``K`` (>= 1), drawn in one call (so correlated as the channel's are).
        rule: One of the rules above.
        verifier: The checker of ``"best_of_n"`` (and only of it).
        weights: The weight function of ``"weighted"`` (and only of it).

    Raises:
        InputError: If an argument is out of range or does not fit the rule, naming it.

    Examples:
        >>> import torch
        >>> from ada_modules.reliability.channel import SimulatedChannel, SimulatedVerifier
        >>> best = DiversityCombining(4, rule="best_of_n", verifier=SimulatedVerifier(1.0, 0.0))
        >>> best(SimulatedChannel([1.0]), 0, truth=0, generator=torch.Generator())
        Outcome(answer=0, cost=4.0, samples=4, rounds=1)
    """

    num_samples: int
    rule: Literal["majority", "weighted", "best_of_n"] = "majority"
    verifier: Verifier | None = None
    weights: Callable[[Hashable], float] | None = None

    def __post_init__(self) -> None:
        _set_count(self, "num_samples", 1)
        _check_choice("rule", self.rule, _RULES)
        if (self.verifier is not None) != (self.rule == "best_of_n"):
            raise InputError(
                f"verifier is used by rule='best_of_n' and only by it, got rule={self.rule!r} "
                f"and verifier={self.verifier!r}"
            )
        if self.verifier is not None:
            _check_verifier("verifier", self.verifier)
        if (self.weights is not None) != (self.rule == "weighted"):
            raise InputError(
                f"weights is used by rule='weighted' and only by it, got rule={self.rule!r} "
                f"and weights={self.weights!r}"
            )
        if self.weights is not None and not callable(self.weights):
            raise InputError(f"weights must be a callable answer -> float, got {self.weights!r}")

    def __call__(
        self, channel: Channel, item: int, *, truth: Hashable, generator: torch.Generator
    ) -> Outcome:
        drawn = _draw(channel, item, self.num_samples, generator)
        cost = drawn.cost
        if self.verifier is not None:
            for answer in drawn.answers:
                cost += _check_cost(self.verifier)
                if self.verifier.check(item, answer, truth, generator=generator):
                    return Outcome(answer, cost, self.num_samples, 1)
        return Outcome(plurality(drawn.answers, self.weights), cost, self.num_samples, 1)


@dataclass(frozen=True)
class HybridRetransmission:
    """HARQ: each round draws ``samples_per_round`` answers in a new call, then ``verifier``
    checks the round's decision; the first accepted decision (ACK) ends it.

    - ``"chase"`` (Chase combining): the decision is the plurality of all samples so far.
    - ``"incremental"``: the decision is the plurality of the round's own samples (a fresh retry;
      with a real model, the round where a new hint or view of the query goes in).

    Without an ACK after ``max_rounds`` rounds, the last decision is returned. With a perfect
    verifier and one sample per round, the expected cost is
    ``(c + verifier.cost) * sum_{k=0}^{R-1} P(no ACK in the first k rounds)``.

    Args:
        max_rounds: Most rounds (>= 1).
        verifier: Checks each round's decision, at ``verifier.cost`` per check.
        samples_per_round: Samples per round (>= 1).
        mode: ``"chase"`` or ``"incremental"``.

    Raises:
        InputError: If an argument is out of range, naming it.

    Examples:
        >>> import torch
        >>> from ada_modules.reliability.channel import SimulatedChannel, SimulatedVerifier
        >>> harq = HybridRetransmission(4, SimulatedVerifier(1.0, 0.0, cost=0.5))
        >>> harq(SimulatedChannel([1.0]), 0, truth=0, generator=torch.Generator())
        Outcome(answer=0, cost=1.5, samples=1, rounds=1)
    """

    max_rounds: int
    verifier: Verifier
    samples_per_round: int = 1
    mode: Literal["chase", "incremental"] = "chase"

    def __post_init__(self) -> None:
        _set_count(self, "max_rounds", 1)
        _check_verifier("verifier", self.verifier)
        _set_count(self, "samples_per_round", 1)
        _check_choice("mode", self.mode, _MODES)

    def __call__(
        self, channel: Channel, item: int, *, truth: Hashable, generator: torch.Generator
    ) -> Outcome:
        votes: list[Hashable] = []
        cost = 0.0
        rounds = 0
        while rounds < self.max_rounds:
            rounds += 1
            drawn = _draw(channel, item, self.samples_per_round, generator)
            votes = [*votes, *drawn.answers] if self.mode == "chase" else list(drawn.answers)
            decision = plurality(votes)
            cost += drawn.cost + _check_cost(self.verifier)
            if self.verifier.check(item, decision, truth, generator=generator):
                break
        return Outcome(decision, cost, rounds * self.samples_per_round, rounds)


@dataclass(frozen=True)
class GeneratorCritic:
    """One sample, then ``rounds`` refinements by ``critic`` (iterative generator-critic decoding).

    With a critic that keeps a correct answer with probability ``a`` and fixes a wrong one with
    ``b``, the accuracy after ``t`` rounds is ``p* + (a - b) ** t * (p0 - p*)``, with
    ``p* = b / (1 - a + b)``: refinement helps iff ``b * (1 - p0) > (1 - a) * p0``.

    Args:
        rounds: Critic rounds (>= 0; ``0`` is a single sample).
        critic: Revises the answer; its costs are added to the outcome's.

    Raises:
        InputError: If an argument is out of range, or the critic reports a bad cost.

    Examples:
        >>> import torch
        >>> from ada_modules.reliability.channel import SimulatedChannel, SimulatedCritic
        >>> refine = GeneratorCritic(2, SimulatedCritic(keep=1.0, fix=1.0, cost=0.5))
        >>> refine(SimulatedChannel([0.0]), 0, truth=0, generator=torch.Generator())
        Outcome(answer=0, cost=2.0, samples=1, rounds=2)
    """

    rounds: int
    critic: Critic

    def __post_init__(self) -> None:
        _set_count(self, "rounds", 0)
        if not isinstance(self.critic, Critic):
            raise InputError(f"critic must be a Critic (with refine), got {self.critic!r}")

    def __call__(
        self, channel: Channel, item: int, *, truth: Hashable, generator: torch.Generator
    ) -> Outcome:
        drawn = _draw(channel, item, 1, generator)
        answer, cost = drawn.answers[0], drawn.cost
        for _ in range(self.rounds):
            answer, spent = self.critic.refine(item, answer, truth, generator=generator)
            cost += _check_nonnegative("critic cost", spent)
        return Outcome(answer, cost, 1, self.rounds)


@dataclass(frozen=True)
class RatelessSampling:
    """Sample until the vote is confident, at most ``max_samples`` (Adaptive-Consistency).

    Batches of ``batch`` samples are drawn in separate calls. Once ``min_samples`` are in, it stops
    as soon as ``leader_confidence(v1, v2) >= confidence``, where ``v1`` and ``v2`` are the votes
    of the leading and runner-up answers (``v2 = 0`` while all agree): the posterior probability
    that the leader beats the runner-up. The answer is the plurality of all samples.

    Args:
        max_samples: Most samples (>= 1).
        confidence: Stopping threshold, in (0, 1).
        min_samples: Samples before the rule is first applied (1 .. ``max_samples``).
        batch: Samples per call (>= 1); the last call draws only what is left of the budget.

    Raises:
        InputError: If an argument is out of range, naming it.

    Examples:
        >>> import torch
        >>> from ada_modules.reliability.channel import SimulatedChannel
        >>> rateless = RatelessSampling(max_samples=16, confidence=0.95)
        >>> rateless(SimulatedChannel([1.0]), 0, truth=0, generator=torch.Generator())
        Outcome(answer=0, cost=4.0, samples=4, rounds=4)
    """

    max_samples: int
    confidence: float = 0.95
    min_samples: int = 2
    batch: int = 1

    def __post_init__(self) -> None:
        _set_count(self, "max_samples", 1)
        numeric = isinstance(self.confidence, (int, float)) and not isinstance(
            self.confidence, bool
        )
        if not numeric or not 0 < self.confidence < 1:
            raise InputError(f"confidence must be in (0, 1), got {self.confidence!r}")
        _set_count(self, "min_samples", 1)
        if self.min_samples > self.max_samples:
            raise InputError(
                f"min_samples must be <= max_samples={self.max_samples}, got {self.min_samples}"
            )
        _set_count(self, "batch", 1)

    def _confident(self, answers: Sequence[Hashable]) -> bool:
        votes = [count for _, count in Counter(answers).most_common(2)]
        return leader_confidence(votes[0], votes[1] if len(votes) > 1 else 0) >= self.confidence

    def __call__(
        self, channel: Channel, item: int, *, truth: Hashable, generator: torch.Generator
    ) -> Outcome:
        answers: list[Hashable] = []
        cost = 0.0
        rounds = 0
        while len(answers) < self.max_samples:
            n = min(self.batch, self.max_samples - len(answers))
            drawn = _draw(channel, item, n, generator)
            answers.extend(drawn.answers)
            cost += drawn.cost
            rounds += 1
            if len(answers) >= self.min_samples and self._confident(answers):
                break
        return Outcome(plurality(answers), cost, len(answers), rounds)


@dataclass(frozen=True)
class RedundantVerification:
    """Draw candidates one call at a time; accept the first that passes ``min_pass`` of the ``J``
    verifiers (parity checks, unit tests).

    Every candidate is checked by all ``J`` verifiers, and each check costs that verifier's
    ``cost``. With independent checks of rates ``tpr``/``fpr``, a correct candidate passes with
    the binomial tail ``P(Bin(J, tpr) >= min_pass)``, a wrong one with ``P(Bin(J, fpr) >=
    min_pass)``. If no candidate passes, the plurality of the candidates is returned.

    Args:
        num_candidates: Most candidates (>= 1).
        verifiers: The ``J >= 1`` checkers.
        min_pass: Passes needed to accept (1 .. ``J``).

    Raises:
        InputError: If an argument is out of range, naming it.

    Examples:
        >>> import torch
        >>> from ada_modules.reliability.channel import SimulatedChannel, SimulatedVerifier
        >>> checks = [SimulatedVerifier(1.0, 0.0, cost=0.25)] * 3
        >>> verify = RedundantVerification(num_candidates=4, verifiers=checks, min_pass=2)
        >>> verify(SimulatedChannel([1.0]), 0, truth=0, generator=torch.Generator())
        Outcome(answer=0, cost=1.75, samples=1, rounds=1)
    """

    num_candidates: int
    verifiers: Sequence[Verifier]
    min_pass: int

    def __post_init__(self) -> None:
        _set_count(self, "num_candidates", 1)
        if isinstance(self.verifiers, Verifier) or not isinstance(self.verifiers, Sequence):
            raise InputError(f"verifiers must be a sequence of Verifiers, got {self.verifiers!r}")
        object.__setattr__(self, "verifiers", tuple(self.verifiers))
        if not self.verifiers:
            raise InputError("verifiers must not be empty")
        for index, verifier in enumerate(self.verifiers):
            _check_verifier(f"verifiers[{index}]", verifier)
        _set_count(self, "min_pass", 1)
        if self.min_pass > len(self.verifiers):
            raise InputError(
                f"min_pass must be <= the number of verifiers J={len(self.verifiers)}, "
                f"got {self.min_pass}"
            )

    def __call__(
        self, channel: Channel, item: int, *, truth: Hashable, generator: torch.Generator
    ) -> Outcome:
        candidates: list[Hashable] = []
        cost = 0.0
        for _ in range(self.num_candidates):
            drawn = _draw(channel, item, 1, generator)
            candidates.append(drawn.answers[0])
            cost += drawn.cost + sum(_check_cost(verifier) for verifier in self.verifiers)
            passes = sum(
                verifier.check(item, drawn.answers[0], truth, generator=generator)
                for verifier in self.verifiers
            )
            if passes >= self.min_pass:
                return Outcome(drawn.answers[0], cost, len(candidates), len(candidates))
        return Outcome(plurality(candidates), cost, len(candidates), len(candidates))
