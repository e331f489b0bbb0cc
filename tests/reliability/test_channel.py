"""The simulated channel, verifier and critic: their statistics match their parameters (Monte Carlo,
seeded, tolerances of >= 3 standard errors), and bad input gets a message naming it."""

import math

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.reliability.channel import (
    Channel,
    Critic,
    Samples,
    SimulatedChannel,
    SimulatedCritic,
    SimulatedVerifier,
    Verifier,
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _correct(channel: SimulatedChannel, item: int, calls: int, n: int, seed: int) -> torch.Tensor:
    """Correctness indicators of ``calls`` calls of ``n`` samples, shape ``(calls, n)``."""
    g = _gen(seed)
    rows = [channel.sample(item, n, generator=g).answers for _ in range(calls)]
    return (torch.tensor(rows) == 0).double()


# ------------------------------------------------------------------ channel


def test_channel_is_a_channel_and_exposes_its_parameters():
    channel = SimulatedChannel(
        torch.tensor([0.2, 0.9], dtype=torch.float64), cost=1.5, name="small"
    )
    assert isinstance(channel, Channel)
    assert not isinstance(SimulatedVerifier(1.0, 0.0), Channel)
    assert len(channel) == 2
    assert channel.name == "small"
    assert channel.truth(1) == 0
    assert channel.accuracy.tolist() == [0.2, 0.9]
    drawn = channel.sample(0, 7, generator=_gen())
    assert drawn.cost == 7 * 1.5
    assert len(drawn.answers) == 7
    assert all(type(answer) is int and 0 <= answer <= 4 for answer in drawn.answers)


def test_channel_is_reproducible_from_the_generator():
    channel = SimulatedChannel([0.5] * 3, correlation=0.4)
    first = [channel.sample(i, 5, generator=_gen(7)) for i in range(3)]
    again = [channel.sample(i, 5, generator=_gen(7)) for i in range(3)]
    assert first == again


def test_marginal_accuracy_matches_the_item_accuracy():
    accuracy = [0.0, 0.1, 0.35, 0.5, 0.8, 0.95, 1.0]
    channel = SimulatedChannel(accuracy)
    g = _gen()
    for item, p in enumerate(accuracy):
        answers = channel.sample(item, 20_000, generator=g).answers
        share = sum(answer == 0 for answer in answers) / len(answers)
        assert share == pytest.approx(p, abs=0.015)  # standard error <= 0.0036


def test_marginal_accuracy_is_kept_under_correlation():
    channel = SimulatedChannel([0.3, 0.7], correlation=0.6)
    for item, p in enumerate([0.3, 0.7]):
        share = _correct(channel, item, calls=4_000, n=4, seed=item).mean().item()
        assert share == pytest.approx(p, abs=0.025)  # standard error ~0.006


@pytest.mark.parametrize("rho", [0.0, 0.25, 0.6])
def test_correctness_of_two_samples_of_one_call_has_correlation_rho(rho):
    channel = SimulatedChannel([0.6], correlation=rho)
    x = _correct(channel, 0, calls=4_000, n=6, seed=1)
    p = x.mean()
    per_call = x.sum(dim=1)
    both_correct = ((per_call**2 - per_call).sum() / (x.shape[0] * 6 * 5)).item()  # over pairs
    measured = (both_correct - p.item() ** 2) / (p.item() * (1 - p.item()))
    assert measured == pytest.approx(rho, abs=0.04)
    # Separate calls are independent.
    across = torch.corrcoef(torch.stack([x[:-1, 0], x[1:, 0]]))[0, 1].item()
    assert abs(across) < 0.05


@pytest.mark.parametrize("rho", [0.0, 0.3, 1.0])
def test_vote_share_variance_is_that_of_n_eff_independent_samples(rho):
    k, p = 8, 0.6
    channel = SimulatedChannel([p], correlation=rho)
    share = _correct(channel, 0, calls=6_000, n=k, seed=2).mean(dim=1)
    n_eff = k / (1 + (k - 1) * rho)
    assert share.var().item() == pytest.approx(p * (1 - p) / n_eff, rel=0.1)


@pytest.mark.parametrize("exponent", [0.0, 1.0, 2.0])
def test_distractors_follow_zipf(exponent):
    channel = SimulatedChannel([0.0], num_distractors=4, zipf_exponent=exponent)
    answers = torch.tensor(channel.sample(0, 40_000, generator=_gen(3)).answers)
    zipf = torch.tensor([r**-exponent for r in range(1, 5)], dtype=torch.float64)
    expected = zipf / zipf.sum()
    measured = torch.bincount(answers, minlength=5).double() / answers.numel()
    assert measured[0] == 0
    assert torch.allclose(measured[1:], expected, atol=0.01)  # standard error <= 0.0025


def test_wrong_mass_is_shared_by_the_distractors():
    channel = SimulatedChannel([0.6], num_distractors=2, zipf_exponent=1.0)
    answers = torch.tensor(channel.sample(0, 40_000, generator=_gen(4)).answers)
    measured = torch.bincount(answers, minlength=3).double() / answers.numel()
    expected = torch.tensor([0.6, 0.4 * 2 / 3, 0.4 / 3], dtype=torch.float64)
    assert torch.allclose(measured, expected, atol=0.01)


# ------------------------------------------------------------------ verifier and critic


def test_verifier_accepts_at_its_rates():
    verifier = SimulatedVerifier(tpr=0.8, fpr=0.15, cost=0.5)
    assert isinstance(verifier, Verifier)
    assert verifier.cost == 0.5
    g = _gen(5)
    right = sum(verifier.check(0, 0, 0, generator=g) for _ in range(20_000)) / 20_000
    wrong = sum(verifier.check(0, 2, 0, generator=g) for _ in range(20_000)) / 20_000
    assert right == pytest.approx(0.8, abs=0.01)
    assert wrong == pytest.approx(0.15, abs=0.01)
    assert verifier.check(0, "Paris", "Paris", generator=g) in (True, False)


def test_critic_keeps_and_fixes_at_its_rates():
    critic = SimulatedCritic(keep=0.7, fix=0.25, cost=2.0, num_distractors=3)
    assert isinstance(critic, Critic)
    g = _gen(6)
    from_right = [critic.refine(0, 0, 0, generator=g) for _ in range(20_000)]
    from_wrong = [critic.refine(0, 2, 0, generator=g) for _ in range(20_000)]
    assert {cost for _, cost in from_right + from_wrong} == {2.0}
    kept = sum(answer == 0 for answer, _ in from_right) / 20_000
    fixed = sum(answer == 0 for answer, _ in from_wrong) / 20_000
    assert kept == pytest.approx(0.7, abs=0.01)
    assert fixed == pytest.approx(0.25, abs=0.01)
    broken = torch.tensor([answer for answer, _ in from_right if answer != 0])
    shares = torch.bincount(broken, minlength=4)[1:] / broken.numel()
    assert torch.allclose(shares, torch.full((3,), 1 / 3), atol=0.02)  # broken: uniform distractor
    assert {answer for answer, _ in from_wrong} == {0, 2}  # an unfixed answer stays as it is


def test_critic_rates_can_be_per_item():
    critic = SimulatedCritic(keep=[1.0, 0.0], fix=[0.0, 1.0])
    g = _gen()
    assert critic.refine(0, 0, 0, generator=g) == (0, 1.0)
    assert critic.refine(0, 3, 0, generator=g) == (3, 1.0)
    assert critic.refine(1, 0, 0, generator=g)[0] != 0
    assert critic.refine(1, 3, 0, generator=g) == (0, 1.0)


# ------------------------------------------------------------------ bad input

NAN = math.nan


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SimulatedChannel([0.5, 1.5]), r"accuracy must be in \[0, 1\], got 1.5 at index 1"),
        (lambda: SimulatedChannel([0.5, NAN]), r"accuracy must be in \[0, 1\], got nan at index 1"),
        (lambda: SimulatedChannel([-0.1]), r"accuracy must be in \[0, 1\], got -0.1 at index 0"),
        (lambda: SimulatedChannel([]), "accuracy must be a number or a non-empty 1-D sequence"),
        (lambda: SimulatedChannel([[0.5]]), "accuracy must be a number or a non-empty 1-D"),
        (lambda: SimulatedChannel(0.5), "accuracy must be a 1-D sequence, got 0.5"),
        (lambda: SimulatedChannel(["x"]), r"accuracy must be numbers in \[0, 1\], got \['x'\]"),
        (lambda: SimulatedChannel([0.5], cost=-1.0), "cost must be a finite number >= 0, got -1.0"),
        (lambda: SimulatedChannel([0.5], cost=NAN), "cost must be a finite number >= 0, got nan"),
        (lambda: SimulatedChannel([0.5], cost=None), "cost must be a finite number >= 0, got None"),
        (lambda: SimulatedChannel([0.5], correlation=1.2), r"correlation must be .* got 1.2"),
        (lambda: SimulatedChannel([0.5], correlation=-0.1), r"correlation must be .* got -0.1"),
        (lambda: SimulatedChannel([0.5], num_distractors=0), "num_distractors must be .* got 0"),
        (lambda: SimulatedChannel([0.5], zipf_exponent=-1.0), "zipf_exponent must be .* got -1.0"),
        (lambda: SimulatedChannel([0.5]).sample(0, 0, generator=_gen()), "n must be .* got 0"),
        (
            lambda: SimulatedChannel([0.5]).sample(1, 2, generator=_gen()),
            r"item must be in \[0, 1\)",
        ),
        (lambda: SimulatedChannel([0.5]).truth("a"), "item must be an integer, got 'a'"),
        (lambda: Samples((0,), cost=None), "cost must be a finite number >= 0, got None"),
        (lambda: Samples((0,), cost=-2.0), "cost must be a finite number >= 0, got -2.0"),
        (lambda: Samples([0], cost=1.0), "answers must be a tuple, got list"),
        (lambda: SimulatedVerifier(tpr=1.2, fpr=0.0), r"tpr must be a number in \[0, 1\], got 1.2"),
        (lambda: SimulatedVerifier(tpr=1.0, fpr=NAN), r"fpr must be a number in \[0, 1\], got nan"),
        (lambda: SimulatedVerifier(1.0, 0.0, cost=-1), "cost must be a finite number >= 0"),
        (lambda: SimulatedCritic(keep=[0.5, -0.1], fix=0.1), r"keep must be in \[0, 1\], got -0.1"),
        (lambda: SimulatedCritic(keep=0.5, fix=NAN), r"fix must be in \[0, 1\], got nan"),
        (
            lambda: SimulatedCritic(0.5, 0.5).refine(0, 0, 2, generator=_gen()),
            "truth must not be one of the critic's distractors 1..4, got 2",
        ),
        (
            lambda: SimulatedCritic([0.5], 0.5).refine(3, 0, 0, generator=_gen()),
            r"item must be in \[0, 1\), got 3",
        ),
    ],
)
def test_bad_input_is_named(build, message):
    with pytest.raises(InputError, match=message):
        build()
