"""Advantage estimators: GRPO equivalences, AEM invariants, bad input, and the bandit check of the
response-level entropy-drift formula that AEM is built on."""

import math

import pytest
import torch

from ada_modules.posttrain.advantages import (
    ADVANTAGE_ESTIMATORS,
    RolloutStats,
    aem_advantages,
    aem_strength,
    clip_cov_mask,
    dr_grpo_advantages,
    grpo_advantages,
    predicted_entropy_drift,
    register_advantage,
    relative_surprisal,
)


def _batch(seed: int, prompts: int = 6, group: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(prompts, group, generator=gen) < 0.4).float()
    surprisal = torch.rand(prompts, group, generator=gen) * 3
    return rewards, surprisal


# ------------------------------------------------------------------ GRPO family


def test_grpo_rows_are_centred_and_unit_scaled():
    rewards, _ = _batch(0)
    rewards[0] = torch.tensor([1.0, 0, 0, 0, 1, 0, 0, 0])
    adv = grpo_advantages(rewards)
    assert torch.allclose(adv.sum(1), torch.zeros(6), atol=1e-5)
    assert adv[0].std().item() == pytest.approx(1.0, abs=1e-3)
    # Equal rewards in a group: zero advantage.
    assert torch.equal(grpo_advantages(torch.ones(2, 4)), torch.zeros(2, 4))


def test_dr_grpo_is_grpo_without_std_and_batch_scaling_uses_one_std():
    rewards, _ = _batch(1)
    centred = rewards - rewards.mean(1, keepdim=True)
    assert torch.equal(dr_grpo_advantages(rewards), centred)
    batch = grpo_advantages(rewards, scale="batch")
    assert torch.allclose(batch, centred / (rewards.std() + 1e-4))


@pytest.mark.parametrize("fn", [grpo_advantages, dr_grpo_advantages])
def test_group_of_one_is_rejected(fn):
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        fn(torch.zeros(3, 1))


def test_nan_reward_names_the_prompt_index():
    rewards = torch.zeros(4, 3)
    rewards[2, 1] = math.nan
    with pytest.raises(ValueError, match="prompt index 2"):
        grpo_advantages(rewards)
    with pytest.raises(ValueError, match="prompt index 2"):
        aem_advantages(rewards, torch.zeros(4, 3))


def test_bad_shapes_and_types():
    with pytest.raises(ValueError, match="num_prompts, group_size"):
        grpo_advantages(torch.zeros(8))
    with pytest.raises(TypeError, match="floating-point"):
        grpo_advantages(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="surprisal must have the shape"):
        aem_advantages(torch.zeros(2, 4), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(torch.zeros(2, 4), scale="prompt")
    with pytest.raises(TypeError, match="surprisal must be a floating-point"):
        aem_advantages(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="entropy must have one value per prompt \\(2,\\)"):
        predicted_entropy_drift(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3))
    a, s = torch.randn(2, 4), torch.randn(2, 4)
    column = predicted_entropy_drift(a, s, torch.ones(2, 1))  # one per prompt, as a column
    assert torch.equal(column, predicted_entropy_drift(a, s, torch.ones(2)))
    with pytest.raises(ValueError, match="advantages and surprisal"):
        predicted_entropy_drift(torch.zeros(2, 4), torch.zeros(4), torch.zeros(2))


@pytest.mark.parametrize("eps", [0.0, -1.0, math.nan, math.inf])
def test_eps_must_be_finite_and_positive(eps):
    with pytest.raises(ValueError, match=f"eps must be a finite number > 0.*got {eps}"):
        grpo_advantages(torch.ones(1, 4), eps=eps)  # eps=0 gave 0/0 for an all-equal group
    with pytest.raises(ValueError, match="eps must be a finite number > 0"):
        relative_surprisal(torch.ones(1, 4), eps=eps)


# ------------------------------------------------------------------ AEM


@pytest.mark.parametrize("schedule", ["balance", "linear", "entropy", "constant"])
def test_aem_equals_grpo_at_zero_strength(schedule):
    rewards, surprisal = _batch(2)
    aem = aem_advantages(
        rewards, surprisal, strength=0.0, schedule=schedule, entropy=1.0, target_entropy=2.0
    )
    assert torch.equal(aem, grpo_advantages(rewards))


@pytest.mark.parametrize("schedule", ["balance", "linear", "constant"])
def test_aem_keeps_shape_and_signs_and_bounds(schedule):
    rewards, surprisal = _batch(3)
    grpo = grpo_advantages(rewards)
    aem = aem_advantages(rewards, surprisal, strength=1.0, schedule=schedule, progress=0.3)
    assert aem.shape == rewards.shape
    assert torch.equal(torch.sign(aem), torch.sign(grpo))
    assert (aem.abs() <= 2 * grpo.abs() + 1e-6).all()


def test_aem_explore_raises_and_exploit_lowers_the_predicted_drift():
    # With H estimated by the group mean surprisal, the predicted first-order entropy change is
    # monotone in beta: sign(A) * tanh(rho) has the sign of A * (S - mean S) for every response.
    for seed in range(20):
        rewards, surprisal = _batch(seed)
        entropy = surprisal.mean(1)

        def drift(advantages, surprisal=surprisal, entropy=entropy):
            return predicted_entropy_drift(advantages, surprisal, entropy)

        grpo = drift(grpo_advantages(rewards))
        explore = drift(aem_advantages(rewards, surprisal, strength=0.5, schedule="constant"))
        exploit = drift(
            aem_advantages(rewards, surprisal, strength=0.5, schedule="linear", progress=1.0)
        )
        assert (explore >= grpo - 1e-6).all()
        assert (exploit <= grpo + 1e-6).all()
        assert (explore > grpo + 1e-3).any()


def test_aem_balance_schedule_explores_when_failing_and_exploits_when_succeeding():
    rewards = torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 1, 0], [1.0, 1, 0, 0], [0.0, 0, 0, 0]])
    beta = aem_strength(rewards, 0.8, "balance")
    assert beta.tolist() == pytest.approx([0.4, -0.4, 0.0, 0.0])
    assert aem_strength(rewards, 0.5, "linear", progress=0.0).tolist() == [0.5] * 4
    assert aem_strength(rewards, 0.5, "linear", progress=1.0).tolist() == [-0.5] * 4
    low = aem_strength(rewards, 0.5, "entropy", entropy=0.5, target_entropy=1.0)
    high = aem_strength(rewards, 0.5, "entropy", entropy=3.0, target_entropy=1.0)
    assert low.tolist() == [0.25] * 4 and high.tolist() == [-0.5] * 4


def test_aem_bad_arguments():
    rewards, surprisal = _batch(4)
    with pytest.raises(ValueError, match="strength"):
        aem_advantages(rewards, surprisal, strength=1.5)
    with pytest.raises(ValueError, match="schedule"):
        aem_advantages(rewards, surprisal, schedule="cosine")
    with pytest.raises(ValueError, match="target_entropy"):
        aem_advantages(rewards, surprisal, schedule="entropy")
    for entropy, target in ((math.nan, 2.0), (1.0, math.nan), (1.0, math.inf)):
        with pytest.raises(ValueError, match="finite"):  # these gave full exploration before
            aem_advantages(
                rewards, surprisal, schedule="entropy", entropy=entropy, target_entropy=target
            )
    with pytest.raises(ValueError, match="progress"):
        aem_advantages(rewards, surprisal, schedule="linear", progress=2.0)
    for strength in (0.0, 0.5):  # at strength 0 (a sweep's first arm) they went unnoticed
        with pytest.raises(ValueError, match="schedule"):
            aem_advantages(rewards, surprisal, strength=strength, schedule="bogus")
        with pytest.raises(ValueError, match="target_entropy"):
            aem_advantages(rewards, surprisal, strength=strength, schedule="entropy")


def test_relative_surprisal_is_standardised():
    _, surprisal = _batch(5)
    rho = relative_surprisal(surprisal)
    assert torch.allclose(rho.mean(1), torch.zeros(6), atol=1e-5)
    assert torch.allclose(rho.std(1), torch.ones(6), atol=1e-4)


# ------------------------------------------------------------------ bandit theory check


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def _bandit_drifts(
    estimator, draws: int = 400, arms: int = 12, group: int = 8, lr: float = 0.02, seed: int = 0
):
    """Predicted vs measured response-level entropy change of one natural-gradient step."""
    gen = torch.Generator().manual_seed(seed)
    predicted, measured = [], []
    for _ in range(draws):
        logits = torch.randn(arms, generator=gen, dtype=torch.float64) * 1.5
        success = torch.rand(arms, generator=gen, dtype=torch.float64)
        probs = torch.softmax(logits, -1)
        responses = torch.multinomial(probs, group, replacement=True, generator=gen)
        rewards = torch.rand(group, generator=gen, dtype=torch.float64) < success[responses]
        rewards = rewards.double()[None]
        surprisal = -torch.log(probs[responses])[None]
        advantages = estimator(rewards, surprisal)[0]
        # Natural-gradient step on the logits of a tabular softmax (Fisher pseudo-inverse):
        # delta z = lr / G * sum_i A_i e_{y_i} / pi(y_i), up to a constant shift.
        delta = torch.zeros(arms, dtype=torch.float64)
        delta.index_add_(0, responses, advantages / probs[responses])
        delta *= lr / group
        h = _entropy(logits)
        measured.append(float(_entropy(logits + delta) - h))
        predicted.append(float(lr * predicted_entropy_drift(advantages[None], surprisal, h)[0]))
    return torch.tensor(predicted), torch.tensor(measured)


def test_bandit_entropy_drift_matches_advantage_times_relative_surprisal():
    predicted, measured = _bandit_drifts(lambda r, s: grpo_advantages(r))
    corr = torch.corrcoef(torch.stack([predicted, measured]))[0, 1]
    assert corr > 0.9, corr
    # The sign is right too, not just the correlation.
    agree = (torch.sign(predicted) == torch.sign(measured))[measured.abs() > 1e-4].float().mean()
    assert agree > 0.9


def test_bandit_aem_raises_entropy_when_exploring_and_lowers_it_when_exploiting():
    grpo = _bandit_drifts(lambda r, s: grpo_advantages(r))[1].mean()
    explore = _bandit_drifts(lambda r, s: aem_advantages(r, s, strength=0.8, schedule="constant"))[
        1
    ].mean()
    exploit = _bandit_drifts(
        lambda r, s: aem_advantages(r, s, strength=0.8, schedule="linear", progress=1.0)
    )[1].mean()
    assert explore > grpo + 1e-4 > exploit + 2e-4, (explore, grpo, exploit)


# ------------------------------------------------------------------ Clip-Cov and registry


def test_clip_cov_drops_only_high_covariance_tokens():
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(4, 10, generator=gen) * 2
    logp = -torch.rand(4, 10, generator=gen) * 4
    mask = torch.ones(4, 10)
    mask[:, 8:] = 0
    keep = clip_cov_mask(adv, logp, mask, ratio=0.1, generator=gen)
    dropped = mask.bool() & ~keep
    assert int(dropped.sum()) == 3  # 10% of 32 valid tokens
    assert not (keep & ~mask.bool()).any()
    a_mean, lp_mean = adv[mask.bool()].mean(), logp[mask.bool()].mean()
    cov = (adv - a_mean) * (logp - lp_mean)
    assert ((cov[dropped] >= 1.0) & (cov[dropped] <= 5.0)).all()
    assert torch.equal(clip_cov_mask(adv, logp, mask, ratio=0.0), mask.bool())


def test_clip_cov_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        clip_cov_mask(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="ratio"):
        clip_cov_mask(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), ratio=2.0)


def test_registry_wraps_the_pure_functions():
    rewards, surprisal = _batch(6)
    stats = RolloutStats(surprisal=surprisal, progress=0.5, entropy=1.0)
    assert torch.equal(ADVANTAGE_ESTIMATORS["grpo"](rewards, stats), grpo_advantages(rewards))
    assert torch.equal(ADVANTAGE_ESTIMATORS["dr_grpo"](rewards, stats), dr_grpo_advantages(rewards))
    assert torch.equal(
        ADVANTAGE_ESTIMATORS["aem"](rewards, stats, strength=0.5, schedule="linear"),
        aem_advantages(rewards, surprisal, strength=0.5, schedule="linear", progress=0.5),
    )
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda r, s: r)
