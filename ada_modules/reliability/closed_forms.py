"""Closed forms of the reliability layer: sampling an LLM seen as a noisy channel.

Channel model: a query has one correct answer; one sample is a memoryless channel that returns it
with probability ``p`` (its accuracy). Reliability operators spend more calls to raise ``p``:

- Diversity combining (vote over ``k`` samples): the binomial tail of the Condorcet jury theorem,
  ``P_maj = sum_{j > k/2} C(k, j) p^j (1-p)^(k-j)``, the effective sample count of correlated votes
  ``k / (1 + (k-1) rho)`` and the log-odds weight ``log(p / (1-p))`` of an independent voter.
- Combining ``K`` numeric estimates: inverse-variance weights are optimal when known, but noisy
  estimated weights can lose to the uniform mean (the forecast-combination puzzle, Claeskens et
  al. 2016); :func:`averaging_threshold` is the weight-noise level where they break even.
- Generator-critic refinement: the accuracy after each round follows a two-state Markov chain,
  ``p_{t+1} = b + (a-b) p_t``, a contraction (Banach) with factor ``|a-b|`` and one fixed point.

Every function takes plain floats (or a sequence of floats; numpy and 0-d torch numbers work too),
returns a float (a bool for the yes/no questions, an int for a round count) and raises
:class:`~ada_modules.errors.InputError` naming the argument and the value it refuses.

Examples:
    >>> round(majority_vote_accuracy(0.7, 5), 4)
    0.8369
    >>> round(averaging_threshold([0.5, 1, 2, 4, 8]), 4)
    0.0292
    >>> refinement_fixed_point(0.9, 0.3)
    0.75
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral
from typing import Any, Literal

from ada_modules.errors import InputError

__all__ = [
    "averaging_threshold",
    "effective_samples",
    "inverse_variance_mse",
    "is_contractive",
    "majority_vote_accuracy",
    "optimal_vote_weight",
    "refinement_accuracy",
    "refinement_fixed_point",
    "refinement_helps",
    "rounds_to_converge",
    "uniform_mse",
    "weighted_mse",
]

_NO_CHANGE = 1e-12  # accuracy gains this small are float rounding (see refinement_helps)

# ----------------------------------------------------------------------------- validation


def _real(name: str, value: Any, allowed: str) -> float:
    """``value`` as a float (a Python, numpy or 0-d torch number); NaN passes through."""
    if isinstance(value, bool | str | bytes):
        raise InputError(f"{name} must be a real number {allowed}, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(f"{name} must be a real number {allowed}, got {value!r}") from None


def _probability(name: str, value: Any) -> float:
    number = _real(name, value, "in [0, 1]")
    if not 0.0 <= number <= 1.0:  # also refuses NaN
        raise InputError(f"{name} must be in [0, 1], got {number}")
    return number


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise InputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _positive(name: str, value: Any) -> float:
    number = _real(name, value, "> 0")
    if not 0.0 < number < math.inf:
        raise InputError(f"{name} must be finite and > 0, got {number}")
    return number


def _variances(sigma2: Any) -> list[float]:
    """The error variances of K >= 2 estimates, each finite and > 0."""
    if isinstance(sigma2, str | bytes):
        raise InputError(f"sigma2 must be a sequence of variances, got {sigma2!r}")
    try:
        items = list(sigma2)
    except TypeError:
        raise InputError(f"sigma2 must be a sequence of variances, got {sigma2!r}") from None
    if len(items) < 2:
        raise InputError(
            f"sigma2 must hold the variances of at least 2 estimates, got {len(items)}"
        )
    values = []
    for index, item in enumerate(items):
        number = _real(f"sigma2[{index}]", item, "> 0")
        if not 0.0 < number < math.inf:
            raise InputError(f"sigma2 must hold finite variances > 0, got sigma2[{index}]={number}")
        values.append(number)
    return values


# ----------------------------------------------------------------------------- diversity combining


def majority_vote_accuracy(p: float, k: int, ties: Literal["half", "lose"] = "half") -> float:
    """Probability that a majority of ``k`` independent binary votes, each right with probability
    ``p``, is right (the Condorcet jury theorem's binomial tail).

    With an even ``k`` a ``k/2``-``k/2`` tie can happen. ``ties="half"`` (the default) breaks it by
    a fair coin, so it counts as half correct; ``ties="lose"`` counts it as wrong (a strict
    majority is needed). Odd ``k`` never ties, so ``ties`` does not matter there.

    Args:
        p: The accuracy of one vote, in [0, 1].
        k: The number of votes, an int >= 1.
        ties: How an even split counts: ``"half"`` or ``"lose"``.

    Returns:
        ``sum_{j > k/2} C(k, j) p^j (1-p)^(k-j)``, plus half the ``j = k/2`` term with
        ``ties="half"``.

    Examples:
        >>> majority_vote_accuracy(0.6, 1)
        0.6
        >>> round(majority_vote_accuracy(0.6, 3), 3)  # 0.6^3 + 3 * 0.6^2 * 0.4
        0.648
        >>> round(majority_vote_accuracy(0.6, 2), 3)  # a 1-1 split counts half
        0.6
        >>> round(majority_vote_accuracy(0.6, 2, ties="lose"), 3)  # 0.6^2
        0.36
    """
    p = _probability("p", p)
    k = _count("k", k, 1)
    if ties not in ("half", "lose"):
        raise InputError(f"ties must be 'half' or 'lose', got {ties!r}")
    if p in (0.0, 1.0):  # every vote agrees (and k >= 1, so no tie)
        return p
    log_p, log_q = math.log(p), math.log1p(-p)
    log_k_factorial = math.lgamma(k + 1)

    def term(j: int) -> float:  # C(k, j) p^j (1-p)^(k-j), in log space so large k cannot overflow
        log_comb = log_k_factorial - math.lgamma(j + 1) - math.lgamma(k - j + 1)
        return math.exp(log_comb + j * log_p + (k - j) * log_q)

    terms = [term(j) for j in range(k // 2 + 1, k + 1)]
    if k % 2 == 0 and ties == "half":
        terms.append(0.5 * term(k // 2))
    return min(1.0, math.fsum(terms))


def effective_samples(k: int, rho: float) -> float:
    """The number of independent samples that ``k`` samples with pairwise correlation ``rho`` are
    worth: the mean of ``k`` equicorrelated draws has the variance of ``k / (1 + (k-1) rho)``
    independent ones.

    Args:
        k: The number of samples, an int >= 1.
        rho: The pairwise correlation, in [-1, 1]; for ``k > 1`` it must exceed ``-1/(k-1)``
            (below that no ``k`` variables have this correlation).

    Returns:
        ``k / (1 + (k-1) rho)``: ``k`` when ``rho = 0``, 1 when ``rho = 1``.

    Examples:
        >>> effective_samples(10, 0.0), effective_samples(10, 1.0)
        (10.0, 1.0)
        >>> round(effective_samples(10, 0.2), 3)
        3.571
    """
    k = _count("k", k, 1)
    number = _real("rho", rho, "in [-1, 1]")
    if not -1.0 <= number <= 1.0:
        raise InputError(f"rho must be in [-1, 1], got {number}")
    if k > 1 and 1.0 + (k - 1) * number <= 0.0:
        raise InputError(
            f"rho must be > -1/(k-1) = {-1.0 / (k - 1):.6g} for k={k} samples, got {number}"
        )
    return k / (1.0 + (k - 1) * number)


def optimal_vote_weight(p: float) -> float:
    """The weight of a voter with accuracy ``p`` in the optimal weighted vote over independent
    voters (prior 1/2 on each of two answers): its log-odds. A coin flip (``p = 1/2``) gets 0, a
    voter that is more often wrong gets a negative weight (its vote counts against its answer),
    and a perfect voter (``p`` = 0 or 1) gets an infinite weight.

    Args:
        p: The voter's accuracy, in [0, 1].

    Returns:
        ``log(p / (1-p))``; ``-inf`` at ``p = 0`` and ``inf`` at ``p = 1``.

    Examples:
        >>> optimal_vote_weight(0.5)
        0.0
        >>> round(optimal_vote_weight(0.9), 4)  # log 9
        2.1972
        >>> optimal_vote_weight(1.0)
        inf
    """
    p = _probability("p", p)
    if p == 0.0:
        return -math.inf
    if p == 1.0:
        return math.inf
    return math.log(p) - math.log1p(-p)


# ----------------------------------------------------------------------------- averaging


def inverse_variance_mse(sigma2: Sequence[float]) -> float:
    """MSE of the inverse-variance weighted mean of ``K`` unbiased estimates with independent
    errors, the best any weights summing to 1 can do (the oracle weights ``u_k ∝ 1/sigma2_k``).

    Args:
        sigma2: The error variances ``sigma_k^2``, at least 2, each finite and > 0.

    Returns:
        ``V_opt = 1 / sum_k (1 / sigma_k^2)``.

    Examples:
        >>> inverse_variance_mse([1.0, 1.0])
        0.5
        >>> inverse_variance_mse([1.0, 4.0])
        0.8
    """
    values = _variances(sigma2)
    return 1.0 / math.fsum(1.0 / value for value in values)


def uniform_mse(sigma2: Sequence[float]) -> float:
    """MSE of the plain mean of ``K`` unbiased estimates with independent errors.

    Args:
        sigma2: The error variances ``sigma_k^2``, at least 2, each finite and > 0.

    Returns:
        ``V_unif = sum_k sigma_k^2 / K^2``.

    Examples:
        >>> uniform_mse([1.0, 1.0])
        0.5
        >>> uniform_mse([1.0, 4.0])
        1.25
    """
    values = _variances(sigma2)
    return math.fsum(values) / len(values) ** 2


def weighted_mse(sigma2: Sequence[float], tau2: float) -> float:
    """MSE of the mean weighted by estimated inverse-variance weights ``w = u + delta``, where
    ``u`` are the oracle weights and the estimation noise ``delta`` is independent of the
    estimates, with ``Cov(delta) = tau2 (I - 11^T/K)`` (so the weights still sum to 1).

    Args:
        sigma2: The error variances ``sigma_k^2``, at least 2, each finite and > 0.
        tau2: The weight-noise level ``tau^2``, finite and >= 0.

    Returns:
        ``V_opt + tau2 (1 - 1/K) sum_k sigma_k^2``, which equals :func:`inverse_variance_mse`
        at ``tau2 = 0``.

    Examples:
        >>> weighted_mse([1.0, 4.0], 0.0)
        0.8
        >>> round(weighted_mse([1.0, 4.0], 0.1), 6)  # 0.8 + 0.1 * 0.5 * 5
        1.05
    """
    values = _variances(sigma2)
    noise = _real("tau2", tau2, ">= 0")
    if not 0.0 <= noise < math.inf:
        raise InputError(f"tau2 must be finite and >= 0, got {noise}")
    size = len(values)
    return inverse_variance_mse(values) + noise * (1.0 - 1.0 / size) * math.fsum(values)


def averaging_threshold(sigma2: Sequence[float]) -> float:
    """The weight-noise level ``tau*^2`` at which estimated inverse-variance weights (see
    :func:`weighted_mse`) and the plain mean have the same MSE: the plain mean wins iff
    ``tau^2 > tau*^2``. It is 0 when all variances are equal (then the weights cannot help).

    Args:
        sigma2: The error variances ``sigma_k^2``, at least 2, each finite and > 0.

    Returns:
        ``(V_unif - V_opt) / ((1 - 1/K) sum_k sigma_k^2)``.

    Examples:
        >>> averaging_threshold([2.0, 2.0, 2.0])
        0.0
        >>> round(averaging_threshold([0.5, 1, 2, 4, 8]), 4)
        0.0292
    """
    values = _variances(sigma2)
    size = len(values)
    gap = max(0.0, uniform_mse(values) - inverse_variance_mse(values))  # >= 0 up to rounding
    return gap / ((1.0 - 1.0 / size) * math.fsum(values))


# ----------------------------------------------------------------------------- refinement


def _critic(a: Any, b: Any) -> tuple[float, float]:
    return _probability("a", a), _probability("b", b)


def refinement_fixed_point(a: float, b: float) -> float:
    """The accuracy that generator-critic rounds converge to, when a right answer stays right
    with probability ``a`` and a wrong one is fixed with probability ``b``.

    Args:
        a: ``P(stay correct | correct)``, in [0, 1].
        b: ``P(fixed | wrong)``, in [0, 1].

    Returns:
        ``p* = b / (1 - a + b)``, the one solution of ``p = b + (a-b) p``.

    Raises:
        InputError: For ``a = 1, b = 0`` (the critic never changes an answer): every accuracy is
            then fixed, so there is no single fixed point.

    Examples:
        >>> refinement_fixed_point(0.9, 0.3)
        0.75
        >>> refinement_fixed_point(0.0, 1.0)  # flips every answer: oscillates around 1/2
        0.5
    """
    a, b = _critic(a, b)
    if a == 1.0 and b == 0.0:
        raise InputError(
            f"a=1 and b=0 leave every accuracy unchanged: no single fixed point, got a={a}, b={b}"
        )
    return b / (1.0 - a + b)


def refinement_accuracy(p0: float, a: float, b: float, rounds: int) -> float:
    """The accuracy after ``rounds`` generator-critic rounds, starting from accuracy ``p0``.

    Args:
        p0: The accuracy before refinement, in [0, 1].
        a: ``P(stay correct | correct)``, in [0, 1].
        b: ``P(fixed | wrong)``, in [0, 1].
        rounds: The number of rounds ``t``, an int >= 0.

    Returns:
        ``p_t = p* + (a-b)^t (p0 - p*)`` with ``p*`` from :func:`refinement_fixed_point`; ``p0``
        when ``a = 1, b = 0`` (nothing ever changes).

    Examples:
        >>> round(refinement_accuracy(0.5, 0.9, 0.3, 1), 6)  # 0.5 * 0.9 + 0.5 * 0.3
        0.6
        >>> round(refinement_accuracy(0.5, 0.9, 0.3, 100), 6)  # the fixed point
        0.75
    """
    p0 = _probability("p0", p0)
    a, b = _critic(a, b)
    rounds = _count("rounds", rounds, 0)
    if a == 1.0 and b == 0.0:
        return p0
    fixed = b / (1.0 - a + b)
    return min(1.0, max(0.0, fixed + (a - b) ** rounds * (p0 - fixed)))


def refinement_helps(p0: float, a: float, b: float) -> bool:
    """Whether a refinement round raises the accuracy ``p0``: it fixes more wrong answers than it
    breaks right ones. Then every later round stays above ``p0`` too when the map is contractive,
    since ``p0`` is below the fixed point. No change counts as not helping, and so does a change
    within ``1e-12``, so that float rounding at the fixed point cannot flip the answer.

    Args:
        p0: The accuracy before refinement, in [0, 1].
        a: ``P(stay correct | correct)``, in [0, 1].
        b: ``P(fixed | wrong)``, in [0, 1].

    Returns:
        ``b (1 - p0) > (1 - a) p0``, i.e. ``p_1 > p0`` (equivalently ``p* > p0``).

    Examples:
        >>> refinement_helps(0.5, 0.9, 0.3)
        True
        >>> refinement_helps(0.9, 0.9, 0.3)  # the fixed point 0.75 is below 0.9
        False
        >>> refinement_helps(0.75, 0.9, 0.3)  # at the fixed point
        False
    """
    p0 = _probability("p0", p0)
    a, b = _critic(a, b)
    return b * (1.0 - p0) - (1.0 - a) * p0 > _NO_CHANGE


def rounds_to_converge(p0: float, a: float, b: float, eps: float) -> int | float:
    """The number of generator-critic rounds until the accuracy is within ``eps`` of its limit.

    Args:
        p0: The accuracy before refinement, in [0, 1].
        a: ``P(stay correct | correct)``, in [0, 1].
        b: ``P(fixed | wrong)``, in [0, 1].
        eps: The tolerance, > 0.

    Returns:
        The smallest ``t >= 0`` with ``|a-b|^t |p0 - p*| <= eps``, i.e.
        ``ceil(log(eps / |p0 - p*|) / log|a-b|)`` (0 when ``p0`` is already within ``eps``).
        Edge cases: ``a = b`` lands on ``p* = b`` in 1 round; ``a = 1, b = 0`` never changes the
        accuracy, so ``p0`` is its own limit: 0; ``a = 0, b = 1`` flips every answer, so the
        accuracy swaps ``p0`` and ``1 - p0`` forever: 0 if ``|p0 - 1/2| <= eps``, else
        ``math.inf``.

    Examples:
        >>> rounds_to_converge(0.5, 0.9, 0.3, 0.01)  # 0.25 * 0.6^t <= 0.01
        7
        >>> rounds_to_converge(0.75, 0.9, 0.3, 0.01), rounds_to_converge(0.2, 0.4, 0.4, 0.01)
        (0, 1)
        >>> rounds_to_converge(0.2, 0.0, 1.0, 0.01)
        inf
    """
    p0 = _probability("p0", p0)
    a, b = _critic(a, b)
    eps = _positive("eps", eps)
    if a == 1.0 and b == 0.0:
        return 0
    factor = abs(a - b)
    distance = abs(p0 - b / (1.0 - a + b))
    if distance <= eps:
        return 0
    if factor == 0.0:
        return 1
    if factor == 1.0:
        return math.inf
    rounds = max(1, math.ceil(math.log(eps / distance) / math.log(factor)))
    # The logarithms can round across an integer; settle on the exact smallest t.
    while rounds > 1 and factor ** (rounds - 1) * distance <= eps:
        rounds -= 1
    while factor**rounds * distance > eps:
        rounds += 1
    return rounds


def is_contractive(a: float, b: float) -> bool:
    """Whether the refinement map ``p -> b + (a-b) p`` is a contraction, so that the accuracy
    converges geometrically to the one fixed point from any start (Banach).

    Args:
        a: ``P(stay correct | correct)``, in [0, 1].
        b: ``P(fixed | wrong)``, in [0, 1].

    Returns:
        ``|a - b| < 1``: False only for ``a = 1, b = 0`` and ``a = 0, b = 1``.

    Examples:
        >>> is_contractive(0.9, 0.3), is_contractive(1.0, 0.0)
        (True, False)
    """
    a, b = _critic(a, b)
    return abs(a - b) < 1.0
