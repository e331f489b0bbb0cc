"""The reliability layer's closed forms against independent simulations (seeded numpy draws), exact
enumeration and direct iteration of the recurrences they solve."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.reliability.closed_forms import (
    averaging_threshold,
    effective_samples,
    inverse_variance_mse,
    is_contractive,
    majority_vote_accuracy,
    optimal_vote_weight,
    refinement_accuracy,
    refinement_fixed_point,
    refinement_helps,
    rounds_to_converge,
    uniform_mse,
    weighted_mse,
)

SIGMA2 = (0.5, 1.0, 2.0, 4.0, 8.0)  # the example of the design note: tau*^2 = 0.0292


# ----------------------------------------------------------------------------- diversity combining


@pytest.mark.parametrize(("p", "k"), [(0.6, 1), (0.6, 5), (0.3, 7), (0.55, 4), (0.8, 6), (0.45, 9)])
def test_majority_vote_matches_simulated_votes(p, k):
    rng = np.random.default_rng(100 + k)
    n = 200_000
    right = (rng.random((n, k)) < p).sum(axis=1)
    coin = rng.random(n) < 0.5  # a fair coin breaks a k/2-k/2 tie
    strict = 2 * right > k
    tie_won = (2 * right == k) & coin
    assert abs((strict | tie_won).mean() - majority_vote_accuracy(p, k)) < 0.01
    assert abs(strict.mean() - majority_vote_accuracy(p, k, ties="lose")) < 0.01


def test_majority_vote_matches_exact_binomial_sum():
    for p, k in itertools.product((0.05, 0.3, 0.5, 0.61, 0.97), range(1, 26)):
        q = Fraction(p)
        upper = sum(math.comb(k, j) * q**j * (1 - q) ** (k - j) for j in range(k // 2 + 1, k + 1))
        tie = math.comb(k, k // 2) * (q * (1 - q)) ** (k // 2) if k % 2 == 0 else 0
        assert majority_vote_accuracy(p, k, ties="lose") == pytest.approx(float(upper), abs=1e-12)
        assert majority_vote_accuracy(p, k) == pytest.approx(float(upper + tie / 2), abs=1e-12)


def test_majority_vote_known_values_and_condorcet_limit():
    for p in (0.0, 0.13, 0.5, 0.9, 1.0):
        assert majority_vote_accuracy(p, 1) == pytest.approx(p, abs=1e-15)  # one vote is the vote
    for p, k in itertools.product((0.2, 0.5, 0.7), (2, 3, 10, 11)):  # half-ties keep the symmetry
        assert majority_vote_accuracy(p, k) + majority_vote_accuracy(1 - p, k) == pytest.approx(1)
    # Condorcet: with many votes the majority is almost surely right iff p > 1/2 (no overflow).
    assert majority_vote_accuracy(0.55, 2001) > 0.9999
    assert majority_vote_accuracy(0.45, 2001) < 1e-4
    assert majority_vote_accuracy(0.5, 2001) == pytest.approx(0.5, abs=1e-9)


@pytest.mark.parametrize(("k", "rho"), [(8, 0.0), (8, 0.3), (4, 0.9), (5, -0.2)])
def test_effective_samples_matches_variance_of_correlated_mean(k, rho):
    rng = np.random.default_rng(7)
    n = 200_000
    shared = rng.standard_normal((n, 1))
    own = rng.standard_normal((n, k))
    # Covariance (1 - rho) I + rho 11^T: eigenvalue 1 + (k-1) rho along the all-ones direction,
    # 1 - rho on the sum-zero subspace; build each part from its own independent normals.
    centred = own - own.mean(axis=1, keepdims=True)
    draws = math.sqrt(1 - rho) * centred + math.sqrt((1 + (k - 1) * rho) / k) * shared
    correlation = np.corrcoef(draws[:, 0], draws[:, 1])[0, 1]
    assert correlation == pytest.approx(rho, abs=0.01)  # the simulation is what it claims
    simulated = 1.0 / draws.mean(axis=1).var()  # a mean of n_eff independent unit draws
    assert simulated == pytest.approx(effective_samples(k, rho), rel=0.03)


def _likelihood(accuracies, votes, truth):
    """P(votes | truth) for independent voters, each right with its own accuracy."""
    return math.prod(p if v == truth else 1 - p for p, v in zip(accuracies, votes, strict=True))


def _vote_accuracy(accuracies, decide):
    """Exact accuracy of a decision rule over two answers (+1/-1, prior 1/2 each) by enumerating
    every pattern of independent votes; a decision of 0 is a coin flip."""
    total = 0.0
    for votes in itertools.product((1, -1), repeat=len(accuracies)):
        decision = decide(votes)
        for truth in (1, -1):
            credit = 1.0 if decision == truth else 0.5 if decision == 0 else 0.0
            total += 0.5 * _likelihood(accuracies, votes, truth) * credit
    return total


def _bayes_accuracy(accuracies):
    """The best any rule can do: pick the answer that makes the votes most likely."""
    total = 0.0
    for votes in itertools.product((1, -1), repeat=len(accuracies)):
        total += 0.5 * max(_likelihood(accuracies, votes, truth) for truth in (1, -1))
    return total


@pytest.mark.parametrize("accuracies", [(0.9, 0.65, 0.65, 0.6), (0.8, 0.7, 0.3, 0.55, 0.6)])
def test_log_odds_weights_give_the_bayes_optimal_vote(accuracies):
    def weighted(weights):
        return lambda votes: np.sign(sum(w * v for w, v in zip(weights, votes, strict=True)))

    optimal = _vote_accuracy(accuracies, weighted([optimal_vote_weight(p) for p in accuracies]))
    uniform = _vote_accuracy(accuracies, weighted([1.0] * len(accuracies)))
    by_accuracy = _vote_accuracy(accuracies, weighted(accuracies))
    assert optimal == pytest.approx(_bayes_accuracy(accuracies), abs=1e-12)
    assert optimal > uniform + 0.01
    assert optimal > by_accuracy + 0.01  # weighting by p itself is not enough
    assert optimal_vote_weight(0.3) == pytest.approx(-optimal_vote_weight(0.7))


# ----------------------------------------------------------------------------- averaging


@pytest.fixture(scope="module")
def averaging_draws():
    """Errors of K=5 estimates with variances SIGMA2, and unit weight noise with covariance
    I - 11^T/K (iid normals projected onto the sum-zero subspace)."""
    rng = np.random.default_rng(2016)
    n = 400_000
    sigma2 = np.asarray(SIGMA2)
    errors = rng.standard_normal((n, len(SIGMA2))) * np.sqrt(sigma2)
    iid = rng.standard_normal((n, len(SIGMA2)))
    unit_noise = iid - iid.mean(axis=1, keepdims=True)
    oracle = (1 / sigma2) / (1 / sigma2).sum()
    return errors, unit_noise, oracle


def test_simulated_weight_noise_has_the_assumed_covariance(averaging_draws):
    _, unit_noise, _ = averaging_draws
    size = len(SIGMA2)
    expected = np.eye(size) - np.ones((size, size)) / size
    assert np.abs(np.cov(unit_noise.T) - expected).max() < 0.01
    assert np.abs(unit_noise.sum(axis=1)).max() < 1e-12  # noisy weights still sum to 1


def test_averaging_mses_match_simulation(averaging_draws):
    errors, unit_noise, oracle = averaging_draws
    assert (errors.mean(axis=1) ** 2).mean() == pytest.approx(uniform_mse(SIGMA2), rel=0.03)
    assert ((errors @ oracle) ** 2).mean() == pytest.approx(inverse_variance_mse(SIGMA2), rel=0.03)
    threshold = averaging_threshold(SIGMA2)
    for ratio in (0.0, 0.5, 1.0, 2.0, 4.0):
        tau2 = ratio * threshold
        weights = oracle + math.sqrt(tau2) * unit_noise
        simulated = (((weights * errors).sum(axis=1)) ** 2).mean()
        assert simulated == pytest.approx(weighted_mse(SIGMA2, tau2), rel=0.03)


def test_simulated_crossover_is_at_the_threshold(averaging_draws):
    errors, unit_noise, oracle = averaging_draws
    uniform = (errors.mean(axis=1) ** 2).mean()
    # With the same draws the weighted MSE at noise scale tau is A + 2 B tau + C tau^2 exactly.
    clean = errors @ oracle
    noise = (unit_noise * errors).sum(axis=1)
    a, b, c = (clean**2).mean(), (clean * noise).mean(), (noise**2).mean()
    tau = (-b + math.sqrt(b * b - c * (a - uniform))) / c  # where uniform and weighted tie
    assert 0.9 <= tau**2 / averaging_threshold(SIGMA2) <= 1.1
    assert averaging_threshold(SIGMA2) == pytest.approx(0.0292, abs=5e-4)
    for tau2, uniform_wins in ((0.8 * tau**2, False), (1.25 * tau**2, True)):
        assert (weighted_mse(SIGMA2, tau2) > uniform_mse(SIGMA2)) is uniform_wins


def test_averaging_known_values():
    assert round(averaging_threshold(SIGMA2), 3) == 0.029
    assert averaging_threshold([3.0, 3.0, 3.0, 3.0]) == pytest.approx(0.0, abs=1e-15)
    assert inverse_variance_mse([2.0, 2.0]) == pytest.approx(1.0)
    assert uniform_mse([2.0, 2.0]) == pytest.approx(1.0)
    assert weighted_mse([1.0, 3.0], 0.0) == pytest.approx(0.75)
    # arrays and tensors work like lists
    assert uniform_mse(np.asarray(SIGMA2)) == pytest.approx(uniform_mse(list(SIGMA2)))
    assert averaging_threshold(torch.tensor(SIGMA2)) == pytest.approx(averaging_threshold(SIGMA2))


# ----------------------------------------------------------------------------- refinement


def _simulate_refinement(rng, p0, a, b, rounds, n=200_000):
    """Accuracy per round of ``n`` items, each a two-state chain (right / wrong)."""
    right = rng.random(n) < p0
    accuracy = [right.mean()]
    for _ in range(rounds):
        draw = rng.random(n)
        right = np.where(right, draw < a, draw < b)
        accuracy.append(right.mean())
    return accuracy


@pytest.mark.parametrize(
    ("p0", "a", "b"),
    [(0.4, 0.9, 0.3), (0.9, 0.8, 0.2), (0.3, 0.2, 0.9), (0.5, 0.5, 0.5), (0.6, 1.0, 0.0)],
)
def test_refinement_accuracy_matches_simulated_chain(p0, a, b):
    rng = np.random.default_rng(31)
    simulated = _simulate_refinement(rng, p0, a, b, rounds=6)
    for rounds, accuracy in enumerate(simulated):
        assert abs(accuracy - refinement_accuracy(p0, a, b, rounds)) < 0.01


def test_refinement_helps_exactly_where_accuracy_rises():
    rng = np.random.default_rng(5)
    checked = {True: 0, False: 0}
    for p0, a, b in itertools.product((0.1, 0.3, 0.5, 0.7, 0.9), (0.5, 0.8, 0.95), (0.05, 0.3)):
        simulated = _simulate_refinement(rng, p0, a, b, rounds=3, n=50_000)
        gains = [accuracy - simulated[0] for accuracy in simulated[1:]]
        if min(abs(gain) for gain in gains) < 0.01:  # too close to call from the simulation
            continue
        helps = refinement_helps(p0, a, b)
        assert all(bool(gain > 0) is helps for gain in gains), (p0, a, b, gains)
        checked[helps] += 1
    assert checked[True] >= 5 and checked[False] >= 5
    # At the fixed point nothing changes, which does not count as helping.
    assert not refinement_helps(0.75, 0.9, 0.3)
    assert refinement_accuracy(0.75, 0.9, 0.3, 4) == pytest.approx(0.75)


def _iterate(p0, a, b, rounds):
    p = p0
    for _ in range(rounds):
        p = a * p + b * (1 - p)
    return p


def test_refinement_closed_form_solves_the_recurrence():
    rng = np.random.default_rng(11)
    for p0, a, b in rng.random((200, 3)):
        for rounds in (0, 1, 2, 5, 17):
            expected = _iterate(p0, a, b, rounds)
            assert refinement_accuracy(p0, a, b, rounds) == pytest.approx(expected, abs=1e-12)
        fixed = refinement_fixed_point(a, b)
        assert b + (a - b) * fixed == pytest.approx(fixed, abs=1e-12)
        assert 0.0 <= fixed <= 1.0
        assert refinement_helps(p0, a, b) is bool(fixed > p0)
    assert refinement_fixed_point(0.9, 0.3) == pytest.approx(0.3 / 0.4)
    assert refinement_fixed_point(0.0, 1.0) == 0.5


def _rounds_by_iteration(p0, a, b, eps, limit=100_000):
    fixed = b / (1 - a + b)
    p = p0
    for rounds in range(limit):
        if abs(p - fixed) <= eps:
            return rounds
        p = b + (a - b) * p
    return math.inf


def test_rounds_to_converge_matches_iteration():
    rng = np.random.default_rng(3)
    for p0, a, b, log_eps in zip(*rng.random((3, 300)), rng.uniform(-8, -1, 300), strict=True):
        eps = 10.0**log_eps
        assert rounds_to_converge(p0, a, b, eps) == _rounds_by_iteration(p0, a, b, eps)
    # the edge cases
    assert rounds_to_converge(0.2, 0.4, 0.4, 1e-6) == 1  # a = b: one round lands on p* = b
    assert rounds_to_converge(0.2, 1.0, 0.0, 1e-6) == 0  # nothing ever changes
    assert rounds_to_converge(0.2, 0.0, 1.0, 1e-6) == math.inf  # flips 0.2 <-> 0.8 forever
    assert rounds_to_converge(0.5, 0.0, 1.0, 1e-6) == 0
    assert rounds_to_converge(0.75, 0.9, 0.3, 1e-9) == 0  # already at the fixed point
    assert rounds_to_converge(0.5, 0.9, 0.3, 0.01) == math.ceil(
        math.log(0.01 / 0.25) / math.log(0.6)
    )


def test_is_contractive():
    assert is_contractive(0.9, 0.3) and is_contractive(0.3, 0.9) and is_contractive(0.5, 0.5)
    assert is_contractive(0.999, 0.0) and is_contractive(0.0, 0.999)
    assert not is_contractive(1.0, 0.0) and not is_contractive(0.0, 1.0)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: majority_vote_accuracy(1.2, 3), r"^p must be in \[0, 1\], got 1\.2$"),
        (lambda: majority_vote_accuracy(float("nan"), 3), r"^p must be in \[0, 1\], got nan$"),
        (lambda: majority_vote_accuracy("0.5", 3), r"^p must be a real number .*got '0\.5'$"),
        (lambda: majority_vote_accuracy(0.5, 0), r"^k must be an int >= 1, got 0$"),
        (lambda: majority_vote_accuracy(0.5, 2.0), r"^k must be an int >= 1, got 2\.0$"),
        (lambda: majority_vote_accuracy(0.5, 2, ties="win"), r"^ties must be .*got 'win'$"),
        (lambda: effective_samples(0, 0.1), r"^k must be an int >= 1, got 0$"),
        (lambda: effective_samples(5, 1.5), r"^rho must be in \[-1, 1\], got 1\.5$"),
        (lambda: effective_samples(5, -0.3), r"^rho must be > -1/\(k-1\) = -0\.25 .*got -0\.3$"),
        (lambda: optimal_vote_weight(-0.1), r"^p must be in \[0, 1\], got -0\.1$"),
        (lambda: inverse_variance_mse([1.0]), r"^sigma2 must .* at least 2 estimates, got 1$"),
        (lambda: uniform_mse([1.0, 0.0]), r"^sigma2 must .*> 0, got sigma2\[1\]=0\.0$"),
        (lambda: averaging_threshold([1.0, float("nan")]), r"got sigma2\[1\]=nan$"),
        (lambda: averaging_threshold(3.0), r"^sigma2 must be a sequence of variances, got 3\.0$"),
        (lambda: weighted_mse([1.0, -2.0], 0.1), r"got sigma2\[1\]=-2\.0$"),
        (lambda: weighted_mse([1.0, 2.0], -0.1), r"^tau2 must be finite and >= 0, got -0\.1$"),
        (lambda: weighted_mse([1.0, 2.0], float("inf")), r"^tau2 must .*got inf$"),
        (lambda: refinement_fixed_point(1.5, 0.2), r"^a must be in \[0, 1\], got 1\.5$"),
        (lambda: refinement_fixed_point(1.0, 0.0), r"no single fixed point, got a=1\.0, b=0\.0$"),
        (lambda: refinement_accuracy(1.1, 0.9, 0.3, 2), r"^p0 must be in \[0, 1\], got 1\.1$"),
        (lambda: refinement_accuracy(0.5, 0.9, 0.3, -1), r"^rounds must be an int >= 0, got -1$"),
        (lambda: refinement_helps(0.5, 0.9, -0.3), r"^b must be in \[0, 1\], got -0\.3$"),
        (lambda: rounds_to_converge(0.5, 0.9, 0.3, 0.0), r"^eps must be finite and > 0, got 0\.0$"),
        (lambda: rounds_to_converge(0.5, 0.9, 0.3, -1e-3), r"^eps must .*got -0\.001$"),
        (lambda: is_contractive(0.5, 2), r"^b must be in \[0, 1\], got 2\.0$"),
    ],
)
def test_bad_input_raises_input_error_naming_the_value(call, message):
    with pytest.raises(InputError, match=message) as raised:
        call()
    assert isinstance(raised.value, ValueError)


def test_numpy_and_torch_scalars_are_accepted():
    expected = majority_vote_accuracy(0.7, 5)
    assert majority_vote_accuracy(np.float64(0.7), np.int64(5)) == expected
    assert majority_vote_accuracy(torch.tensor(0.7, dtype=torch.float64), 5) == expected
    assert refinement_accuracy(np.float32(0.5), 0.9, 0.3, 1) == pytest.approx(0.6)
