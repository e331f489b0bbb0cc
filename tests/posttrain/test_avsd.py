"""AVSD targets without a model: reductions, the two pools, the gate, the losses, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_modules.posttrain.avsd import (
    avsd_target,
    generalized_jsd,
    pool_views,
    sampled_token_advantages,
)


def _views(num_views: int, seed: int = 0, shape=(2, 3), vocab: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(2 * torch.randn(num_views, *shape, vocab, generator=g), dim=-1)


@pytest.mark.parametrize("gate", [0.0, 0.3, 1.0, "adaptive"])
def test_one_view_or_identical_views_reduce_to_single_view_distillation(gate):
    one = _views(1)
    for views in (one, one.expand(4, -1, -1, -1)):
        target = avsd_target(views, gate=gate, residual_scale=-0.7)
        torch.testing.assert_close(target.logp, one[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(target.pool.consensus, one[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(target.pool.permissive, one[0], atol=1e-6, rtol=0)
        assert target.pool.disagreement.abs().max() < 1e-6
        torch.testing.assert_close(target.weight, torch.ones(2, 3), atol=1e-6, rtol=0)
    # and the advantage is OPSD's log p_teacher(y) - log p_student(y), to 1e-6
    student = _views(1, seed=1)[0]
    tokens = torch.tensor([[0, 3, 6], [2, 2, 5]])
    advantages = sampled_token_advantages(avsd_target(one, gate=gate).logp, student, tokens)
    for i in range(2):
        for t in range(3):
            expected = one[0, i, t, tokens[i, t]] - student[i, t, tokens[i, t]]
            assert abs(advantages[i, t] - expected) < 1e-6


def test_gate_zero_is_the_normalised_geometric_mean_and_one_the_arithmetic_mean():
    views = _views(3)
    probs = views.exp()
    geometric = probs.prod(0) ** (1 / 3)
    geometric = geometric / geometric.sum(-1, keepdim=True)
    torch.testing.assert_close(avsd_target(views, gate=0.0).logp.exp(), geometric)
    torch.testing.assert_close(avsd_target(views, gate=1.0).logp.exp(), probs.mean(0))
    # in between: log-linear, normalised
    mixed = probs.mean(0) ** 0.25 * geometric**0.75
    mixed = mixed / mixed.sum(-1, keepdim=True)
    torch.testing.assert_close(avsd_target(views, gate=0.25).logp.exp(), mixed)


def test_the_geometric_pool_drops_what_one_confident_view_alone_supports():
    # three views put their mass on token 0, one (noisy) view on token 1
    agree = torch.log(torch.tensor([0.9, 0.001, 0.099]))
    noisy = torch.log(torch.tensor([0.001, 0.9, 0.099]))
    views = torch.stack([agree, agree, agree, noisy])
    arithmetic = avsd_target(views, gate=1.0).logp.exp()
    geometric = avsd_target(views, gate=0.0).logp.exp()
    assert arithmetic[1] > 0.2  # the linear pool keeps the noisy view's token (0.225)
    assert geometric[1] < 0.1 * arithmetic[1]  # the logarithmic pool nearly drops it (0.020)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(0, 10_000), st.sampled_from([0.0, 0.5, 1.0, "adaptive"]))
def test_targets_are_distributions_and_disagreement_is_normalised(num_views, seed, gate):
    target = avsd_target(_views(num_views, seed), gate=gate, residual_scale=-0.5)
    torch.testing.assert_close(target.logp.exp().sum(-1), torch.ones(2, 3))
    assert torch.isfinite(target.logp).all()
    assert ((0 <= target.pool.disagreement) & (target.pool.disagreement <= 1)).all()
    assert ((0 <= target.gate) & (target.gate <= 1)).all()
    assert ((0.5 <= target.weight) & (target.weight <= 1)).all()


def test_disjoint_views_disagree_fully_and_the_adaptive_gate_turns_conservative():
    one_hot = torch.full((2, 4), -30.0)
    one_hot[0, 0] = one_hot[1, 3] = 0.0
    views = torch.log_softmax(one_hot, dim=-1)
    target = avsd_target(views, gate="adaptive", gate_threshold=0.1, gate_sharpness=20.0)
    assert abs(target.pool.disagreement.item() - 1.0) < 1e-4  # D = log 2, normalised
    assert target.gate.item() < 1e-6  # disagreement far above the threshold: the consensus
    same = avsd_target(views[:1].expand(2, -1), gate="adaptive")
    assert abs(same.gate.item() - torch.sigmoid(torch.tensor(2.0)).item()) < 1e-6


@pytest.mark.parametrize("gate", [0.0, 0.5, "adaptive"])
def test_views_with_no_common_token_fall_back_to_the_arithmetic_pool(gate):
    """Top-k views that share no token: the geometric consensus is empty (it was NaN)."""
    views = torch.tensor([[[0.0, -math.inf, -math.inf]], [[-math.inf, -0.1, -2.4]]])
    views = torch.log_softmax(views, dim=-1)
    pool = pool_views(views)
    torch.testing.assert_close(pool.consensus, pool.permissive)
    assert pool.consensus.exp().sum().item() == pytest.approx(1.0)
    target = avsd_target(views, gate=gate)
    torch.testing.assert_close(target.logp, pool.permissive)
    shared = torch.log_softmax(torch.tensor([[[0.0, -1.0, -math.inf]], [[-1.0, 0.0, -9.0]]]), -1)
    assert pool_views(shared).consensus[0, 2] == -math.inf  # a common token: the geometric pool


def test_residual_scale_shrinks_or_grows_the_token_weight_with_disagreement():
    views = _views(3)
    disagreement = pool_views(views).disagreement
    down = avsd_target(views, residual_scale=-0.5).weight
    up = avsd_target(views, residual_scale=2.0).weight
    torch.testing.assert_close(down, 1 - 0.5 * disagreement)
    torch.testing.assert_close(up, 1 + 2.0 * disagreement)
    assert avsd_target(views, residual_scale=-10.0).weight.min() >= 0


def test_generalized_jsd_limits_and_zero():
    target, student = _views(2)
    forward = (target.exp() * (target - student)).sum(-1)
    reverse = (student.exp() * (student - target)).sum(-1)
    torch.testing.assert_close(generalized_jsd(target, student, 0.0), forward)
    torch.testing.assert_close(generalized_jsd(target, student, 1.0), reverse)
    # continuous at the ends (the scale 1 / (beta (1 - beta)) makes the limits the plain KLs)
    target64, student64 = target.double(), student.double()
    for beta, limit in ((1e-6, forward), (1 - 1e-6, reverse)):
        near = generalized_jsd(target64, student64, beta)
        torch.testing.assert_close(near, limit.double(), rtol=1e-3, atol=1e-6)
    half = generalized_jsd(target, student, 0.5)
    torch.testing.assert_close(half, generalized_jsd(student, target, 0.5))
    assert (half > 0).all() and (half <= 4 * math.log(2) + 1e-6).all()
    assert generalized_jsd(target, target, 0.5).abs().max() < 1e-6


def test_the_jsd_gradient_moves_the_student_to_the_target():
    target, start = _views(2, seed=3)
    student = start.clone().requires_grad_(True)
    optimizer = torch.optim.SGD([student], lr=0.5)
    before = generalized_jsd(target, torch.log_softmax(student, -1), 0.5).sum().item()
    for _ in range(50):
        optimizer.zero_grad()
        generalized_jsd(target, torch.log_softmax(student, -1), 0.5).sum().backward()
        optimizer.step()
    after = generalized_jsd(target, torch.log_softmax(student, -1), 0.5).sum().item()
    assert after < 0.2 * before


def _ruled_out(logits: torch.Tensor, fill: float) -> torch.Tensor:
    """Views in which token 1 is ruled out by every view and token 2 by view 0 alone."""
    logits = logits.clone()
    logits[..., 1] = fill
    logits[0, ..., 2] = fill
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("gate", [0.0, 0.5, 1.0, "adaptive"])
def test_tokens_a_view_rules_out_give_the_limit_of_tiny_probabilities(gate):
    logits = 2 * torch.randn(3, 2, 4, 7, generator=torch.Generator().manual_seed(0))
    ruled_out, tiny = _ruled_out(logits, -math.inf), _ruled_out(logits, -1e4)
    # sharpness 1e4 rounds the adaptive gate to exactly 1 or 0 at most positions
    options = {"gate": gate, "gate_sharpness": 1e4, "gate_threshold": 0.4, "residual_scale": -0.5}
    got, limit = avsd_target(ruled_out, **options), avsd_target(tiny, **options)
    if gate == "adaptive":
        assert (got.gate == 1).any() and (got.gate == 0).any()
    for a, b in [
        (got.logp.exp(), limit.logp.exp()),
        (got.pool.disagreement, limit.pool.disagreement),
        (got.weight, limit.weight),
        (got.gate, limit.gate),
    ]:
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    student = torch.log_softmax(torch.randn(2, 4, 7), -1).requires_grad_(True)
    for beta in (0.0, 0.5):
        jsd = generalized_jsd(ruled_out[0], student, beta)
        torch.testing.assert_close(jsd, generalized_jsd(tiny[0], student, beta), atol=1e-5, rtol=0)
        (grad,) = torch.autograd.grad(jsd.sum(), student)
        assert grad.isfinite().all()
    # the reverse KL(s || q) is infinite where the student has mass on a ruled-out token
    assert (generalized_jsd(ruled_out[0], student, 1.0) == math.inf).all()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: avsd_target(_views(2), gate=1.5), "gate must be 'adaptive' or a number"),
        (lambda: avsd_target(_views(2), gate="soft"), "gate must be 'adaptive' or a number"),
        (
            lambda: avsd_target(_views(2), gate_sharpness=-1.0),
            "gate_sharpness must be a finite number >= 0, got -1.0",
        ),
        (lambda: avsd_target(_views(2), gate=math.nan), "gate must be 'adaptive' or a number"),
        (lambda: avsd_target(_views(2), gate=True), "gate must be 'adaptive' or a number"),
        (
            lambda: avsd_target(_views(2), gate_threshold=math.nan),
            "gate_threshold must be a finite number, got nan",
        ),
        (
            lambda: avsd_target(_views(2), residual_scale=-math.inf),
            "residual_scale must be a finite number, got -inf",
        ),
        (lambda: pool_views(torch.zeros(0, 3, 5)), "at least one view"),
        (lambda: generalized_jsd(*_views(2), beta=-0.1), "beta must be in"),
        (lambda: generalized_jsd(_views(1)[0], _views(1, vocab=5)[0]), "same shape"),
        (
            lambda: sampled_token_advantages(_views(1)[0], _views(1)[0], torch.zeros(2, 4).long()),
            "share their leading dimensions",
        ),
        (
            lambda: sampled_token_advantages(_views(1)[0], _views(1)[0], torch.full((2, 3), -100)),
            r"tokens must lie in \[0, 7\).*got -100",
        ),
        (
            lambda: sampled_token_advantages(_views(1)[0], _views(1)[0], torch.zeros(2, 3)),
            "tokens must be integer token ids, got torch.float32",
        ),
    ],
)
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()
