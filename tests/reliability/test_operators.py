"""The five reliability operators on simulated channels: their accuracy matches the closed forms of
the channel view (binomial majority, generator-critic contraction, HARQ retries), adaptive stopping
saves samples, costs are accounted exactly (also on early stop), and bad input is named.

Monte-Carlo tolerances are >= 3 standard errors of the estimate they bound.
"""

import math
from collections.abc import Hashable

import numpy as np
import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.reliability.channel import (
    Samples,
    SimulatedChannel,
    SimulatedCritic,
    SimulatedVerifier,
)
from ada_modules.reliability.operators import (
    DiversityCombining,
    GeneratorCritic,
    HybridRetransmission,
    Outcome,
    RatelessSampling,
    RedundantVerification,
    leader_confidence,
    plurality,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _accuracies(n: int, low: float, high: float, seed: int) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=_gen(seed), dtype=torch.float64)


def _run(operator, channel: SimulatedChannel, seed: int = 0) -> list[Outcome]:
    g = _gen(seed)
    return [operator(channel, i, truth=channel.truth(i), generator=g) for i in range(len(channel))]


def _accuracy(outcomes: list[Outcome]) -> float:
    return sum(outcome.is_correct(0) for outcome in outcomes) / len(outcomes)


def _binary_majority(p: float, k: int) -> float:
    return sum(math.comb(k, j) * p**j * (1 - p) ** (k - j) for j in range(k // 2 + 1, k + 1))


class CountingChannel:
    """Wraps a channel and counts its calls and samples."""

    def __init__(self, channel: SimulatedChannel) -> None:
        self.channel, self.name, self.calls, self.samples = channel, channel.name, 0, 0

    def __len__(self) -> int:
        return len(self.channel)

    def truth(self, item: int) -> int:
        return self.channel.truth(item)

    def sample(self, item: int, n: int, *, generator: torch.Generator) -> Samples:
        self.calls += 1
        self.samples += n
        return self.channel.sample(item, n, generator=generator)


class CountingVerifier:
    """Wraps a verifier and counts its checks."""

    def __init__(self, verifier: SimulatedVerifier) -> None:
        self.verifier, self.cost, self.checks = verifier, verifier.cost, 0

    def check(self, item: int, answer: Hashable, truth: Hashable, *, generator) -> bool:
        self.checks += 1
        return self.verifier.check(item, answer, truth, generator=generator)


class FixedChannel:
    """Returns the same answers on every call."""

    name = "fixed"

    def __init__(self, answers: tuple, cost: float = 1.0) -> None:
        self.answers, self.cost = answers, cost

    def sample(self, item: int, n: int, *, generator: torch.Generator) -> Samples:
        return Samples(self.answers, self.cost)


# ------------------------------------------------------------------ voting


def test_plurality_breaks_ties_by_sampling_order():
    assert plurality([2, 1, 1, 2]) == 2
    assert plurality([1, 2, 2, 1]) == 1
    assert plurality(["b", "a", "c"]) == "b"
    assert plurality([3, 1, 1]) == 1
    assert plurality([1, 2, 2], weights={1: 3.0, 2: 1.0}.get) == 1


def test_leader_confidence_is_the_beta_tail():
    special = pytest.importorskip("scipy.special")
    for leader, runner_up in [(0, 0), (1, 0), (4, 0), (6, 1), (5, 3), (20, 12), (3, 3)]:
        expected = 1 - special.betainc(leader + 1, runner_up + 1, 0.5)
        assert leader_confidence(leader, runner_up) == pytest.approx(expected, abs=1e-12)


def test_majority_of_k_matches_the_binomial_formula():
    k, accuracy = 5, _accuracies(4_000, 0.3, 0.9, seed=10)
    binary = SimulatedChannel(accuracy, num_distractors=1)
    measured = _accuracy(_run(DiversityCombining(k), binary, seed=11))
    expected = sum(_binary_majority(p, k) for p in accuracy.tolist()) / len(accuracy)
    assert measured == pytest.approx(expected, abs=0.015)  # standard error ~0.005
    # With several distractors the plurality needs fewer than K/2 votes: at least as accurate.
    spread = SimulatedChannel(accuracy, num_distractors=4)
    assert _accuracy(_run(DiversityCombining(k), spread, seed=12)) >= expected - 0.015


def test_majority_gains_shrink_with_correlation():
    """The vote of K correlated samples is worth n_eff = K / (1 + (K - 1) rho) independent ones:
    the gain over one sample shrinks as rho grows and vanishes at rho = 1 (n_eff = 1)."""
    k, p, n = 9, 0.65, 3_000
    gains = []
    for rho in (0.0, 0.2, 0.5, 1.0):
        channel = SimulatedChannel(torch.full((n,), p), num_distractors=1, correlation=rho)
        gains.append(_accuracy(_run(DiversityCombining(k), channel, seed=13)) - p)
    assert gains[0] == pytest.approx(_binary_majority(p, k) - p, abs=0.025)
    assert gains[0] > gains[1] + 0.03 > gains[2] + 0.03
    assert abs(gains[3]) < 0.03  # standard error ~0.009


def test_weighted_vote_with_equal_weights_is_the_majority_vote():
    channel = SimulatedChannel(_accuracies(300, 0.2, 0.8, seed=14), correlation=0.3)
    majority = _run(DiversityCombining(6), channel, seed=15)
    weighted = _run(DiversityCombining(6, rule="weighted", weights=lambda answer: 2.0), channel, 15)
    assert majority == weighted


def test_weighted_vote_follows_the_weights():
    channel = SimulatedChannel(torch.full((2_000,), 0.6), num_distractors=1)
    trust_distractor = DiversityCombining(5, rule="weighted", weights={0: 1.0, 1: 5.0}.get)
    # One vote for the distractor outweighs four for the truth: 0 wins only with all 5 votes.
    assert _accuracy(_run(trust_distractor, channel, seed=16)) == pytest.approx(0.6**5, abs=0.02)


def test_best_of_n_takes_the_first_accepted_sample_and_pays_for_each_check():
    k, accuracy = 4, _accuracies(2_000, 0.2, 0.6, seed=17)
    channel = CountingChannel(SimulatedChannel(accuracy, cost=1.5))
    verifier = CountingVerifier(SimulatedVerifier(1.0, 0.0, cost=0.25))
    best = DiversityCombining(k, rule="best_of_n", verifier=verifier)
    g = _gen(18)
    outcomes = []
    for item in range(len(accuracy)):
        verifier.checks = 0
        outcome = best(channel, item, truth=0, generator=g)
        assert outcome.cost == k * 1.5 + verifier.checks * 0.25
        assert (outcome.samples, outcome.rounds) == (k, 1)
        outcomes.append(outcome)
    assert channel.calls == len(accuracy)
    # A perfect verifier finds a correct sample whenever there is one.
    expected = sum(1 - (1 - p) ** k for p in accuracy.tolist()) / len(accuracy)
    assert _accuracy(outcomes) == pytest.approx(expected, abs=0.03)


# ------------------------------------------------------------------ HARQ


def test_chase_harq_stops_early_and_reports_its_exact_cost():
    max_rounds, accuracy = 6, _accuracies(1_000, 0.3, 0.8, seed=19)
    channel = CountingChannel(SimulatedChannel(accuracy, cost=2.0))
    verifier = CountingVerifier(SimulatedVerifier(tpr=0.9, fpr=0.1, cost=0.25))
    harq = HybridRetransmission(max_rounds, verifier, samples_per_round=2, mode="chase")
    g = _gen(20)
    outcomes = []
    for item in range(len(accuracy)):
        channel.calls = channel.samples = verifier.checks = 0
        outcome = harq(channel, item, truth=0, generator=g)
        assert outcome.cost == channel.calls * 2 * 2.0 + verifier.checks * 0.25
        assert outcome.rounds == channel.calls == verifier.checks
        assert outcome.samples == channel.samples == 2 * outcome.rounds
        outcomes.append(outcome)
    rounds = torch.tensor([outcome.rounds for outcome in outcomes], dtype=torch.float64)
    assert (rounds < max_rounds).double().mean() > 0.8
    assert rounds.mean() < max_rounds / 2
    assert _accuracy(outcomes) > accuracy.mean().item() + 0.1


def test_incremental_harq_matches_the_retry_formulas():
    """With a perfect verifier and one sample a round, it succeeds iff some round is correct, and
    E[rounds] = sum_k P(no ACK in the first k rounds) = sum_{k < R} (1 - p) ** k."""
    max_rounds, accuracy = 4, _accuracies(3_000, 0.1, 0.7, seed=21)
    channel = SimulatedChannel(accuracy)
    harq = HybridRetransmission(max_rounds, SimulatedVerifier(1.0, 0.0), mode="incremental")
    outcomes = _run(harq, channel, seed=22)
    p = accuracy.tolist()
    expected_accuracy = sum(1 - (1 - q) ** max_rounds for q in p) / len(p)
    expected_rounds = sum(sum((1 - q) ** j for j in range(max_rounds)) for q in p) / len(p)
    assert _accuracy(outcomes) == pytest.approx(expected_accuracy, abs=0.02)
    mean_rounds = sum(outcome.rounds for outcome in outcomes) / len(outcomes)
    assert mean_rounds == pytest.approx(expected_rounds, abs=0.07)
    assert all(outcome.cost == outcome.rounds for outcome in outcomes)


# ------------------------------------------------------------------ generator-critic


@pytest.mark.parametrize(
    ("keep", "fix", "p0"),
    [(0.9, 0.3, 0.4), (0.6, 0.1, 0.7)],
    ids=["contractive-helps", "contractive-hurts"],
)
def test_generator_critic_follows_the_two_state_map(keep, fix, p0):
    """p_t = p* + (a - b) ** t * (p0 - p*), p* = b / (1 - a + b); it helps iff
    b * (1 - p0) > (1 - a) * p0."""
    n = 10_000
    channel = SimulatedChannel(torch.full((n,), p0))
    fixed_point = fix / (1 - keep + fix)
    helps = fix * (1 - p0) > (1 - keep) * p0
    for rounds in (1, 3):
        critic = SimulatedCritic(keep, fix, cost=0.5)
        outcomes = _run(GeneratorCritic(rounds, critic), channel, seed=rounds)
        expected = fixed_point + (keep - fix) ** rounds * (p0 - fixed_point)
        assert _accuracy(outcomes) == pytest.approx(expected, abs=0.015)  # standard error 0.005
        assert (_accuracy(outcomes) > p0) == helps
        assert {(o.cost, o.samples, o.rounds) for o in outcomes} == {(1 + 0.5 * rounds, 1, rounds)}


def test_generator_critic_with_zero_rounds_is_one_sample():
    channel = SimulatedChannel(torch.full((2_000,), 0.3))
    outcomes = _run(GeneratorCritic(0, SimulatedCritic(1.0, 1.0)), channel)
    assert _accuracy(outcomes) == pytest.approx(0.3, abs=0.035)
    assert {(o.cost, o.samples, o.rounds) for o in outcomes} == {(1.0, 1, 0)}


# ------------------------------------------------------------------ rateless


def test_rateless_sampling_halves_the_samples_at_no_real_accuracy_loss():
    """Adaptive-Consistency against self-consistency with the same budget (40 samples, as in the
    paper), on items of accuracy ~0.7 with two distractors.

    The rateless sampler stops after ~10-12 samples on average, hardly more as the budget grows,
    so its saving grows with the budget: on this channel 1.6x against K = 16 (below 2x), 2.1x
    against K = 24 and 3.2x against K = 40, each at <= 0.5 points of accuracy lost.
    """
    budget, accuracy = 40, _accuracies(2_000, 0.6, 0.8, seed=23)
    channel = SimulatedChannel(accuracy, num_distractors=2, cost=0.5)
    fixed = _run(DiversityCombining(budget), channel, seed=24)
    rateless = _run(RatelessSampling(budget, confidence=0.95), channel, seed=24)
    mean_samples = sum(outcome.samples for outcome in rateless) / len(rateless)
    assert budget / mean_samples >= 2.0
    assert _accuracy(rateless) >= _accuracy(fixed) - 0.01
    for outcome in rateless:
        assert outcome.cost == 0.5 * outcome.samples
        assert outcome.rounds == outcome.samples
        assert 4 <= outcome.samples <= budget  # 4 unanimous votes are the fewest that stop it


def test_rateless_sampling_draws_batches_and_respects_the_budget():
    channel = CountingChannel(SimulatedChannel(torch.full((200,), 0.4), num_distractors=4))
    rateless = RatelessSampling(10, confidence=0.99, min_samples=3, batch=4)
    outcomes = _run(rateless, channel, seed=25)
    assert channel.calls == sum(outcome.rounds for outcome in outcomes)
    assert channel.samples == sum(outcome.samples for outcome in outcomes)
    for outcome in outcomes:
        assert outcome.samples in (4, 8, 10)  # the last call draws what is left of the budget
        assert outcome.rounds == math.ceil(outcome.samples / 4)


# ------------------------------------------------------------------ redundant verification


def test_redundant_verification_beats_single_shot_with_noisy_verifiers():
    accuracy = _accuracies(2_000, 0.2, 0.6, seed=26)
    channel = CountingChannel(SimulatedChannel(accuracy, cost=1.5))
    costs = (0.125, 0.25, 0.5)
    verifiers = [CountingVerifier(SimulatedVerifier(0.8, 0.2, cost=c)) for c in costs]
    verify = RedundantVerification(num_candidates=5, verifiers=verifiers, min_pass=2)
    single = _accuracy(_run(DiversityCombining(1), channel.channel, seed=27))
    g = _gen(28)
    outcomes = []
    for item in range(len(accuracy)):
        channel.calls = 0
        outcome = verify(channel, item, truth=0, generator=g)
        assert outcome.cost == channel.calls * (1.5 + sum(costs))  # every check of every candidate
        assert outcome.samples == outcome.rounds == channel.calls
        outcomes.append(outcome)
    assert {verifier.checks for verifier in verifiers} == {channel.samples}
    assert _accuracy(outcomes) > single + 0.3
    assert sum(outcome.rounds < 5 for outcome in outcomes) / len(outcomes) > 0.8  # early stops


# ------------------------------------------------------------------ bad input

VERIFIER = SimulatedVerifier(0.9, 0.1)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DiversityCombining(0), "num_samples must be an integer >= 1, got 0"),
        (lambda: DiversityCombining(2.0), "num_samples must be an integer >= 1, got 2.0"),
        (lambda: DiversityCombining(3, rule="median"), "rule must be one of .* got 'median'"),
        (lambda: DiversityCombining(3, rule="best_of_n"), "verifier is used by rule='best_of_n'"),
        (lambda: DiversityCombining(3, verifier=VERIFIER), "verifier is used by rule='best_of_n'"),
        (lambda: DiversityCombining(3, rule="weighted"), "weights is used by rule='weighted'"),
        (
            lambda: DiversityCombining(3, rule="best_of_n", verifier=object()),
            "verifier must be a Verifier",
        ),
        (lambda: HybridRetransmission(0, VERIFIER), "max_rounds must be an integer >= 1, got 0"),
        (lambda: HybridRetransmission(2, None), "verifier must be a Verifier .* got None"),
        (lambda: HybridRetransmission(2, VERIFIER, 0), "samples_per_round must be .* >= 1, got 0"),
        (lambda: HybridRetransmission(2, VERIFIER, mode="soft"), "mode must be one of .* 'soft'"),
        (
            lambda: GeneratorCritic(-1, SimulatedCritic(0.9, 0.1)),
            "rounds must be an integer >= 0, got -1",
        ),
        (lambda: GeneratorCritic(1, VERIFIER), "critic must be a Critic"),
        (lambda: RatelessSampling(0), "max_samples must be an integer >= 1, got 0"),
        (lambda: RatelessSampling(8, confidence=1.0), r"confidence must be in \(0, 1\), got 1.0"),
        (lambda: RatelessSampling(8, confidence=0), r"confidence must be in \(0, 1\), got 0"),
        (lambda: RatelessSampling(8, confidence=math.nan), r"confidence .* got nan"),
        (lambda: RatelessSampling(8, min_samples=9), "min_samples must be <= max_samples=8, got 9"),
        (lambda: RatelessSampling(8, batch=0), "batch must be an integer >= 1, got 0"),
        (
            lambda: RedundantVerification(3, [VERIFIER, VERIFIER], min_pass=3),
            "min_pass must be <= the number of verifiers J=2, got 3",
        ),
        (lambda: RedundantVerification(3, [VERIFIER], min_pass=0), "min_pass must be .* got 0"),
        (lambda: RedundantVerification(0, [VERIFIER], 1), "num_candidates must be .* got 0"),
        (lambda: RedundantVerification(3, [], min_pass=1), "verifiers must not be empty"),
        (lambda: RedundantVerification(3, VERIFIER, 1), "verifiers must be a sequence of Verif"),
        (lambda: RedundantVerification(3, [VERIFIER, 2], 1), r"verifiers\[1\] must be a Verifier"),
        (lambda: plurality([]), "answers must not be empty"),
        (
            lambda: plurality([1, 2], weights=lambda a: math.nan),
            "weight of answer 1 must be a finite real number",
        ),
    ],
)
def test_bad_arguments_are_named(build, message):
    with pytest.raises(InputError, match=message):
        build()


def test_answers_of_different_types_in_one_vote_are_named():
    mixed = FixedChannel((1, "1", 1))
    message = "answers in one vote must be of one type, got int and str"
    chase = HybridRetransmission(2, VERIFIER, samples_per_round=3)
    for operator in (DiversityCombining(3), chase, RatelessSampling(3, batch=3)):
        with pytest.raises(InputError, match=message):
            operator(mixed, 0, truth=1, generator=_gen())


def test_a_channel_with_a_bad_cost_or_answer_count_is_named():
    with pytest.raises(InputError, match="cost must be a finite number >= 0, got -1.0"):
        DiversityCombining(2)(FixedChannel((0, 0), cost=-1.0), 0, truth=0, generator=_gen())
    with pytest.raises(InputError, match="channel 'fixed' must return Samples of 3 answers"):
        DiversityCombining(3)(FixedChannel((0, 0)), 0, truth=0, generator=_gen())


def test_a_critic_with_a_bad_cost_is_named():
    class FreeLunchCritic:
        def refine(self, item, answer, truth, *, generator):
            return answer, -1.0

    channel = SimulatedChannel([0.5])
    with pytest.raises(InputError, match="critic cost must be a finite number >= 0, got -1.0"):
        GeneratorCritic(1, FreeLunchCritic())(channel, 0, truth=0, generator=_gen())


def test_a_verifier_cost_that_turns_negative_is_an_error_not_a_refund():
    class Refunding:  # a Verifier whose checks would pay the caller
        cost = -3.0

        def check(self, item, answer, truth, *, generator):
            return True

    with pytest.raises(InputError, match=r"verifier.cost must be a finite number >= 0, got -3"):
        HybridRetransmission(max_rounds=2, verifier=Refunding())
    verifier = SimulatedVerifier(1.0, 0.0, cost=0.5)
    harq = HybridRetransmission(max_rounds=2, verifier=verifier)
    verifier.cost = -3.0  # changed after construction: checked where it is spent
    with pytest.raises(InputError, match=r"cost of verifier .* must be a finite number >= 0"):
        harq(SimulatedChannel([0.5]), 0, truth=0, generator=torch.Generator().manual_seed(0))


def test_numpy_and_torch_numbers_are_numbers():
    votes = DiversityCombining(np.int64(3), rule="weighted", weights=lambda a: np.float32(2.0))
    assert type(votes.num_samples) is int and votes.num_samples == 3
    assert plurality([1, 2, 2], weights={1: torch.tensor(3.0), 2: torch.tensor(1.0)}.get) == 1
    with pytest.raises(InputError, match="weight of answer 1 must be a finite real number"):
        plurality([1], weights=lambda a: torch.tensor([1.0, 2.0]))
