"""Offline-RL losses: the expectile loss and its minimiser, AWR weights, the Plackett–Luce
likelihood (normalisation, masking, gradients) and candidate subsampling, plus bad input."""

import itertools
import math

import numpy as np
import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.offline_rl.losses import (
    advantage_weights,
    expectile_loss,
    plackett_luce_log_likelihood,
    sample_plackett_luce,
    subsample_candidates,
)

# ------------------------------------------------------------------ expectile loss


def test_expectile_loss_is_half_mse_at_one_half() -> None:
    diff = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(expectile_loss(diff, 0.5), 0.5 * diff.square().mean())


def test_expectile_loss_hand_computed_value() -> None:
    diff = torch.tensor([1.0, -2.0, 3.0, 0.0])
    # 0.7·1 + 0.3·4 + 0.7·9 + 0.7·0 = 0.7 + 1.2 + 6.3 = 8.2, over 4 elements
    torch.testing.assert_close(expectile_loss(diff, 0.7), torch.tensor(2.05))


def _expectile_by_bisection(sample: torch.Tensor, tau: float) -> float:
    """The root of τ·Σ(y - v)⁺ = (1 - τ)·Σ(v - y)⁺, which is increasing in v."""
    y = sample.double()
    low, high = float(y.min()), float(y.max())
    for _ in range(100):
        v = 0.5 * (low + high)
        balance = tau * (y - v).clamp_min(0).sum() - (1 - tau) * (v - y).clamp_min(0).sum()
        low, high = (v, high) if balance > 0 else (low, v)
    return 0.5 * (low + high)


@pytest.mark.parametrize("tau", [0.7, 0.9])
def test_expectile_loss_minimiser_is_the_upper_expectile(tau: float) -> None:
    sample = torch.randn(500, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    target = _expectile_by_bisection(sample, tau)
    assert target > sample.mean().item() + 0.1  # an upper expectile, above the mean

    value = torch.tensor(target, dtype=torch.float64, requires_grad=True)
    expectile_loss(sample - value, tau).backward()
    assert abs(value.grad.item()) < 1e-9  # stationary point of the loss
    at = expectile_loss(sample - target, tau)
    for step in (-0.05, 0.05):
        assert expectile_loss(sample - (target + step), tau) > at

    # Gradient descent on the loss lands on the same value.
    fitted = torch.zeros((), dtype=torch.float64, requires_grad=True)
    for _ in range(300):
        (grad,) = torch.autograd.grad(expectile_loss(sample - fitted, tau), fitted)
        with torch.no_grad():
            fitted -= grad
    assert fitted.item() == pytest.approx(target, abs=1e-6)


def test_expectile_loss_gradient_flows_to_diff() -> None:
    diff = torch.tensor([1.0, -1.0], requires_grad=True)
    expectile_loss(diff, 0.8).backward()
    # d/dd mean(w·d²) = 2·w·d / n
    torch.testing.assert_close(diff.grad, torch.tensor([0.8, -0.2]))


# ------------------------------------------------------------------ advantage weights


def test_advantage_weights_values_and_clamp() -> None:
    advantage = torch.tensor([-2.0, 0.0, 0.5, 1e4, math.inf])
    weights = advantage_weights(advantage, temperature=3.0, max_weight=20.0)
    expected = torch.tensor([math.exp(-6.0), 1.0, math.exp(1.5), 20.0, 20.0])
    torch.testing.assert_close(weights, expected)
    assert torch.isfinite(weights).all()


def test_advantage_weights_no_overflow_in_half_precision() -> None:
    advantage = torch.tensor([100.0, 60000.0], dtype=torch.float16)
    weights = advantage_weights(advantage, temperature=10.0)
    assert weights.dtype == torch.float16
    assert torch.isfinite(weights).all() and (weights <= 100.0).all()


def test_advantage_weights_temperature_zero_is_behaviour_cloning() -> None:
    advantage = torch.tensor([-1e6, 0.0, 3.0, 1e6])
    torch.testing.assert_close(advantage_weights(advantage, temperature=0.0), torch.ones(4))


def test_advantage_weights_are_detached() -> None:
    advantage = torch.tensor([0.1, 0.2], requires_grad=True)
    weights = advantage_weights(advantage * 2, temperature=1.0)
    assert not weights.requires_grad


# ------------------------------------------------------------------ Plackett–Luce


def _reference_log_likelihood(scores: torch.Tensor, mask: torch.Tensor, chosen: torch.Tensor):
    """Row by row, pick by pick, straight from the definition."""
    out = []
    for b in range(scores.shape[0]):
        pool = [j for j in range(scores.shape[1]) if mask[b, j]]
        total = 0.0
        for c in chosen[b].tolist():
            total += scores[b, c].item() - math.log(sum(math.exp(scores[b, j]) for j in pool))
            pool.remove(c)
        out.append(total)
    return torch.tensor(out, dtype=scores.dtype)


def test_plackett_luce_full_rankings_of_three_sum_to_one() -> None:
    scores = torch.tensor([[0.3, -1.2, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    rankings = torch.tensor(list(itertools.permutations(range(3))))  # [6, 3]
    loglik = plackett_luce_log_likelihood(scores.expand(6, 3), mask.expand(6, 3), rankings)
    assert loglik.exp().sum().item() == pytest.approx(1.0, abs=1e-12)


def test_plackett_luce_partial_rankings_sum_to_one_over_valid_candidates() -> None:
    scores = torch.tensor([[0.5, 9.0, -0.7, 1.1, 0.2]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True, True, True]])
    valid = [0, 2, 3, 4]
    tops = torch.tensor(list(itertools.permutations(valid, 2)))  # 12 ordered top-2 picks
    loglik = plackett_luce_log_likelihood(scores.expand(12, 5), mask.expand(12, 5), tops)
    assert loglik.exp().sum().item() == pytest.approx(1.0, abs=1e-12)


def test_plackett_luce_top1_is_log_softmax() -> None:
    scores = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 6, dtype=torch.bool)
    chosen = torch.tensor([[0], [5], [2], [3]])
    expected = torch.log_softmax(scores, dim=1).gather(1, chosen).squeeze(1)
    torch.testing.assert_close(plackett_luce_log_likelihood(scores, mask, chosen), expected)


def test_plackett_luce_matches_reference_and_ignores_masked_scores() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 8, generator=gen) < 0.7
    mask[:, :3] = True
    chosen = torch.stack([torch.randperm(3, generator=gen) for _ in range(5)])
    result = plackett_luce_log_likelihood(scores, mask, chosen)
    torch.testing.assert_close(result, _reference_log_likelihood(scores, mask, chosen))

    poisoned = scores.masked_fill(~mask, 1e30)
    poisoned[~mask & (torch.arange(8) % 2 == 0)] = math.inf
    torch.testing.assert_close(plackett_luce_log_likelihood(poisoned, mask, chosen), result)


def test_plackett_luce_gradient_is_finite_and_zero_on_masked_entries() -> None:
    scores = torch.tensor([[1.0, 2.0, 1e30, 0.5], [0.0, -3.0, 4.0, 1e4]], requires_grad=True)
    mask = torch.tensor([[True, True, False, True], [True, True, True, False]])
    chosen = torch.tensor([[1, 3], [2, 0]])
    plackett_luce_log_likelihood(scores, mask, chosen).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert (scores.grad[~mask] == 0).all()
    # Each row's gradient sums to zero (shifting all scores leaves the likelihood unchanged).
    torch.testing.assert_close(scores.grad.sum(dim=1), torch.zeros(2))


def test_plackett_luce_rows_are_independent() -> None:
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(3, 5, generator=gen)
    mask = torch.ones(3, 5, dtype=torch.bool)
    chosen = torch.tensor([[4, 1], [0, 2], [3, 4]])
    batched = plackett_luce_log_likelihood(scores, mask, chosen)
    for b in range(3):
        single = plackett_luce_log_likelihood(scores[b : b + 1], mask[b : b + 1], chosen[b : b + 1])
        torch.testing.assert_close(batched[b : b + 1], single)


# ------------------------------------------------------------------ subsampling


def _subsample_case() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(64, 30, generator=gen) < 0.5
    mask[:, :2] = True
    mask[0, 2:] = False  # a row with no negatives
    mask[1, 2:5] = True  # a row with few negatives
    mask[1, 5:] = False
    chosen = torch.tensor([[1, 0]]).expand(64, 2).clone()
    return mask, chosen


@pytest.mark.parametrize("num_negatives", [0, 2, 7, 100])
def test_subsample_keeps_chosen_and_exact_negative_count(num_negatives: int) -> None:
    mask, chosen = _subsample_case()
    kept = subsample_candidates(mask, chosen, num_negatives, torch.Generator().manual_seed(0))
    assert kept.dtype == torch.bool and kept.shape == mask.shape
    assert kept[:, :2].all()  # every chosen candidate
    assert not (kept & ~mask).any()  # never an invalid one
    negatives = (mask.sum(dim=1) - 2).clamp_min(0)
    torch.testing.assert_close(kept.sum(dim=1) - 2, negatives.clamp_max(num_negatives))


def test_subsample_is_deterministic_with_a_seeded_generator() -> None:
    mask, chosen = _subsample_case()

    def draw(seed: int) -> torch.Tensor:
        return subsample_candidates(mask, chosen, 3, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_subsample_draws_negatives_uniformly() -> None:
    rows = 4000
    mask = torch.ones(rows, 6, dtype=torch.bool)
    chosen = torch.zeros(rows, 1, dtype=torch.long)
    kept = subsample_candidates(mask, chosen, 2, torch.Generator().manual_seed(0))
    frequency = kept[:, 1:].float().mean(dim=0)  # each of the 5 negatives: 2/5
    torch.testing.assert_close(frequency, torch.full((5,), 0.4), atol=0.03, rtol=0)


def test_subsampled_likelihood_is_the_exact_one_when_all_negatives_are_kept() -> None:
    mask, chosen = _subsample_case()
    scores = torch.randn(mask.shape, generator=torch.Generator().manual_seed(9))
    kept = subsample_candidates(mask, chosen, 1000)
    assert torch.equal(kept, mask)
    torch.testing.assert_close(
        plackett_luce_log_likelihood(scores, kept, chosen),
        plackett_luce_log_likelihood(scores, mask, chosen),
    )


# ------------------------------------------------------------------ bad input

_MASK = torch.tensor([[True, True, False]])
_SCORES = torch.zeros(1, 3)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: expectile_loss(torch.ones(3), 0.0), "expectile"),
        (lambda: expectile_loss(torch.ones(3), 1.0), "expectile"),
        (lambda: expectile_loss(torch.ones(3), math.nan), "expectile"),
        (lambda: expectile_loss(torch.ones(3), True), "expectile"),
        (lambda: expectile_loss([1.0, 2.0], 0.5), "diff"),
        (lambda: expectile_loss(torch.ones(3, dtype=torch.long), 0.5), "diff"),
        (lambda: expectile_loss(torch.ones(0), 0.5), "diff"),
        (lambda: advantage_weights(torch.ones(2), -0.1), "temperature"),
        (lambda: advantage_weights(torch.ones(2), math.inf), "temperature"),
        (lambda: advantage_weights(torch.ones(2), 1.0, max_weight=0.0), "max_weight"),
        (lambda: advantage_weights(torch.ones(2, dtype=torch.long), 1.0), "advantage"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK, torch.tensor([[2]])), "chosen"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK, torch.tensor([[3]])), "chosen"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK, torch.tensor([[-1]])), "chosen"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK, torch.tensor([[0, 0]])), "chosen"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK, torch.tensor([[0, 1, 2]])), "chosen"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK, torch.tensor([[0.0]])), "chosen"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK, torch.tensor([0])), "chosen"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK.float(), torch.tensor([[0]])), "mask"),
        (lambda: plackett_luce_log_likelihood(_SCORES, _MASK[:, :2], torch.tensor([[0]])), "mask"),
        (lambda: plackett_luce_log_likelihood(_SCORES[0], _MASK, torch.tensor([[0]])), "scores"),
        (lambda: subsample_candidates(_MASK, torch.tensor([[0]]), -1), "num_negatives"),
        (lambda: subsample_candidates(_MASK, torch.tensor([[0]]), 1.5), "num_negatives"),
        (lambda: subsample_candidates(_MASK, torch.tensor([[2]]), 1), "chosen"),
        (lambda: subsample_candidates(_MASK.long(), torch.tensor([[0]]), 1), "mask"),
        # a masked-out candidate was picked before: row 0 has 2 valid candidates
        (lambda: sample_plackett_luce(_SCORES, _MASK, 3), "k = 3 picks, but mask row 0"),
        (lambda: sample_plackett_luce(_SCORES, _MASK, 4), "k = 4 picks"),
        (lambda: sample_plackett_luce(_SCORES, _MASK, -1), "k must be an integer"),
        (lambda: sample_plackett_luce(_SCORES, _MASK, 1.0), "k must be an integer"),
        (lambda: sample_plackett_luce(_SCORES, _MASK.float(), 1), "mask must be a bool tensor"),
        (lambda: sample_plackett_luce(_SCORES, _MASK[:, :2], 1), "mask of shape \\(1, 2\\)"),
        (lambda: sample_plackett_luce(torch.tensor([[0.0, math.nan, 0.0]]), _MASK, 1), "NaN"),
    ],
)
def test_bad_input_raises_input_error_naming_the_argument(call, name: str) -> None:
    with pytest.raises(InputError, match=name):
        call()


def test_sample_plackett_luce_takes_numpy_and_tensor_counts() -> None:
    mask = torch.ones(1, 3, dtype=torch.bool)
    for k in (np.int64(2), torch.tensor(2)):
        assert sample_plackett_luce(torch.zeros(1, 3), mask, k).shape == (1, 2)


def test_sample_plackett_luce_never_picks_a_masked_candidate_over_a_valid_minus_inf_one() -> None:
    logits = torch.tensor([[0.0, -math.inf, -math.inf, 5.0]])
    mask = torch.tensor([[False, True, True, True]])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        picks = sample_plackett_luce(logits, mask, 3, g)[0].tolist()
        assert picks[0] == 3 and sorted(picks[1:]) == [1, 2]
