"""ABC-Align's estimators: the coefficient formulas, the optimality of PPI++'s λ̂ and ABC's ŵ
(checked against brute-force grids computed independently with numpy), unbiasedness by
simulation, the clipping rules, the losses and per-example gradients, and bad input."""

import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from ada_modules.errors import InputError
from ada_modules.posttrain.abc import (
    ESTIMATORS,
    SemiSupervisedWeights,
    combine_losses,
    dpo_margin,
    estimate_mean,
    margin_gradients,
    preference_loss,
    semi_supervised_weights,
)

# A tiny hand-made problem: n = 4 labelled, N = 6 unlabelled examples.
HUMAN = [1.0, 0.0, 1.0, 1.0]
PSEUDO_L = [1.0, 0.0, 0.0, 1.0]
PSEUDO_U = [0.0, 1.0, 1.0, 0.0, 1.0, 0.0]


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _rows(values) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    return array[:, None] if array.ndim == 1 else array


def _moments(h, p, u):
    """Trace (co)variances with numpy: (σ_hh, σ_hp, σ_pp, σ_uu) and the three group means."""
    h, p, u = _rows(h), _rows(p), _rows(u)
    hh = sum(np.var(h[:, j], ddof=1) for j in range(h.shape[1]))
    hp = sum(np.cov(h[:, j], p[:, j], ddof=1)[0, 1] for j in range(h.shape[1]))
    pp = sum(np.var(p[:, j], ddof=1) for j in range(p.shape[1]))
    uu = sum(np.var(u[:, j], ddof=1) for j in range(u.shape[1]))
    return (hh, hp, pp, uu), (h.mean(0), p.mean(0), u.mean(0))


def _covariance_matrix(h, p, u, big_n=None) -> np.ndarray:
    """Trace covariance of the three group means (mean_L z_h, mean_L z_p, mean_U z_p)."""
    (hh, hp, pp, uu), _ = _moments(h, p, u)
    n = len(h)
    big_n = len(u) if big_n is None else big_n
    return np.array([[hh / n, hp / n, 0.0], [hp / n, pp / n, 0.0], [0.0, 0.0, uu / big_n]])


def _numpy_lambda(h, p, u, big_n=None) -> float:
    (_, hp, pp, uu), _ = _moments(h, p, u)
    big_n = len(u) if big_n is None else big_n
    return float(np.clip(hp / (pp + len(h) / big_n * uu), 0.0, 1.0))


def _value(a, means) -> np.ndarray:
    return a[0] * means[0] + a[1] * means[1] + a[2] * means[2]


# ------------------------------------------------------------------ coefficient formulas


def test_estimators_are_the_documented_list():
    assert ESTIMATORS == ("human", "pseudo", "concat", "ppi", "ppi++", "abc")


@pytest.mark.parametrize("method", ["human", "pseudo", "concat", "ppi", "ppi++"])
def test_each_estimator_equals_its_formula_on_a_hand_made_problem(method):
    h, p, u = np.array(HUMAN), np.array(PSEUDO_L), np.array(PSEUDO_U)
    n, big_n = len(h), len(u)
    lam = _numpy_lambda(h, p, u)
    # λ̂ by hand: cov(h, p) = 1/6 (ddof 1), var(p) = 1/3, var(u) = 3/10, n/N = 2/3.
    assert lam == pytest.approx((1 / 6) / (1 / 3 + 2 / 3 * 3 / 10), abs=1e-12)
    expected = {
        "human": h.mean(),
        "pseudo": (n * p.mean() + big_n * u.mean()) / (n + big_n),
        "concat": (n * h.mean() + big_n * u.mean()) / (n + big_n),
        "ppi": h.mean() - p.mean() + u.mean(),
        "ppi++": h.mean() + lam * (u.mean() - p.mean()),
    }[method]
    coefficients = {
        "human": (1.0, 0.0, 0.0),
        "pseudo": (0.0, n / (n + big_n), big_n / (n + big_n)),
        "concat": (n / (n + big_n), 0.0, big_n / (n + big_n)),
        "ppi": (1.0, -1.0, 1.0),
        "ppi++": (1.0, -lam, lam),
    }[method]
    estimate = estimate_mean(_t(HUMAN), _t(PSEUDO_L), _t(PSEUDO_U), method)
    assert estimate.value.shape == ()
    assert estimate.value.item() == pytest.approx(expected, abs=1e-12)
    weights = estimate.weights
    assert weights.method == method
    assert (weights.a_h, weights.a_p, weights.a_u) == pytest.approx(coefficients, abs=1e-12)
    # The standard error is the square root of the quadratic form a Σ a of the group means.
    a = np.array(coefficients)
    variance = a @ _covariance_matrix(h, p, u) @ a
    assert weights.variance == pytest.approx(variance, abs=1e-12)
    assert estimate.se == pytest.approx(math.sqrt(variance), abs=1e-12)
    low, high = estimate.interval()
    assert (high - low).item() == pytest.approx(2 * 1.959964 * math.sqrt(variance), abs=1e-9)
    # semi_supervised_weights gives the same coefficients.
    same = semi_supervised_weights(_t(HUMAN), _t(PSEUDO_L), _t(PSEUDO_U), method)
    assert (same.a_h, same.a_p, same.a_u) == pytest.approx(coefficients, abs=1e-12)
    assert same.lam == pytest.approx({"ppi": 1.0, "ppi++": lam}.get(method, 0.0))
    assert same.weight == (1.0 if method in ("ppi", "ppi++") else 0.0)


def test_vector_statistics_give_vector_estimates_per_column():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(30, 3, generator=gen, dtype=torch.float64)
    p = h + 0.5 * torch.randn(30, 3, generator=gen, dtype=torch.float64)
    u = torch.randn(80, 3, generator=gen, dtype=torch.float64)
    for method in ("human", "ppi"):
        estimate = estimate_mean(h, p, u, method)
        expected = h.mean(0) if method == "human" else h.mean(0) - p.mean(0) + u.mean(0)
        assert estimate.value.shape == (3,)
        torch.testing.assert_close(estimate.value, expected)


# ------------------------------------------------------------------ PPI++'s λ̂ is optimal


def _plug_in_variance(lam: np.ndarray, h, p, u, big_n=None) -> np.ndarray:
    """tr Var(mean_L z_h - λ mean_L z_p + λ mean_U z_p), for every λ of a grid."""
    (hh, hp, pp, uu), _ = _moments(h, p, u)
    big_n = len(u) if big_n is None else big_n
    return (hh - 2 * lam * hp + lam**2 * pp) / len(h) + lam**2 * uu / big_n


@pytest.mark.parametrize("width", [1, 2])
def test_ppi_lambda_minimises_the_plug_in_variance(width):
    gen = torch.Generator().manual_seed(11)
    shared = torch.randn(40, width, generator=gen, dtype=torch.float64)
    h = shared + torch.randn(40, width, generator=gen, dtype=torch.float64)
    p = shared + 0.7 * torch.randn(40, width, generator=gen, dtype=torch.float64)
    u = 1.3 * torch.randn(60, width, generator=gen, dtype=torch.float64)
    weights = semi_supervised_weights(h.squeeze(1) if width == 1 else h, p, u, "ppi++")
    assert 0.05 < weights.lam < 0.95, "the check needs an interior optimum"
    assert weights.notes == ()
    grid = np.linspace(0.0, 1.0, 10_001)
    variance = _plug_in_variance(grid, h.numpy(), p.numpy(), u.numpy())
    assert weights.lam == pytest.approx(grid[variance.argmin()], abs=2e-4)
    assert weights.variance == pytest.approx(variance.min(), rel=1e-6)
    assert weights.variance < _plug_in_variance(np.array([0.0, 1.0]), h, p, u).min()


def test_lambda_above_one_is_clipped_with_a_note():
    h = _t([0.0, 2.0, 4.0, 2.0, 0.0])
    p = h / 2  # cov(h, p) = 2 var(p): the unclipped λ̂ is near 2
    u = _t([0.0, 1.0, 2.0, 1.0] * 25)
    weights = semi_supervised_weights(h, p, u, "ppi++")
    assert weights.lam == 1.0
    assert len(weights.notes) == 1 and "clipped to 1" in weights.notes[0]


def test_anti_correlated_judge_gets_lambda_zero_with_a_note():
    gen = torch.Generator().manual_seed(0)
    truth = (torch.rand(500, generator=gen) < 0.5).double()
    judge = 1.0 - truth  # always wrong
    weights = semi_supervised_weights(truth[:50], judge[:50], judge[50:], "ppi++")
    assert weights.lam == 0.0
    assert (weights.a_h, weights.a_p, weights.a_u) == (1.0, 0.0, 0.0)
    assert len(weights.notes) == 1
    assert "clipped to 0" in weights.notes[0] and "anti-correlated" in weights.notes[0]
    estimate = estimate_mean(truth[:50], judge[:50], judge[50:], "ppi++")
    assert estimate.value.item() == pytest.approx(truth[:50].mean().item())


def test_constant_pseudo_statistic_gets_lambda_zero_with_a_note():
    weights = semi_supervised_weights(_t(HUMAN), torch.ones(4), torch.ones(6), "ppi++")
    assert weights.lam == 0.0
    assert weights.notes == ("lambda set to 0: the pseudo statistic does not vary",)
    estimate = estimate_mean(_t(HUMAN), torch.ones(4), torch.ones(6), "ppi++")
    assert estimate.value.item() == pytest.approx(0.75)


def test_num_unlabelled_enters_lambda_as_the_formula_says():
    gen = torch.Generator().manual_seed(5)
    shared = torch.randn(30, generator=gen, dtype=torch.float64)
    h = shared + 0.5 * torch.randn(30, generator=gen, dtype=torch.float64)
    p = shared + 0.5 * torch.randn(30, generator=gen, dtype=torch.float64)
    u = torch.randn(40, generator=gen, dtype=torch.float64)
    as_given = semi_supervised_weights(h, p, u, "ppi++")
    same = semi_supervised_weights(h, p, u, "ppi++", num_unlabelled=40)
    assert same.lam == as_given.lam
    larger = semi_supervised_weights(h, p, u, "ppi++", num_unlabelled=4000)
    # Var_U(z_p) is estimated from the subsample; only the n/N factor changes.
    expected = _numpy_lambda(h.numpy(), p.numpy(), u.numpy(), big_n=4000)
    assert larger.lam == pytest.approx(expected, rel=1e-9)
    assert larger.lam > as_given.lam
    assert as_given.lam == pytest.approx(_numpy_lambda(h.numpy(), p.numpy(), u.numpy()), rel=1e-9)
    # The variance of the PPI++ estimator uses the whole unlabelled set's size too.
    variance = _plug_in_variance(np.array(larger.lam), h.numpy(), p.numpy(), u.numpy(), 4000)
    assert larger.variance == pytest.approx(float(variance), rel=1e-9)


def test_num_unlabelled_enters_abc_as_the_formula_says():
    h, p, u = _biased_judge(7, 30, 300, 1, 0.25)
    weights = semi_supervised_weights(h, p, u, "abc", num_unlabelled=3000)
    pseudo, difference, sigma, _, bias2 = _abc_by_numpy(h.numpy(), p.numpy(), u.numpy(), 3000)
    assert weights.bias2 == pytest.approx(bias2, rel=1e-9, abs=1e-12)
    grid = np.linspace(0.0, 1.0, 10_001)
    mse = _abc_mse(grid, pseudo, difference, sigma, bias2)
    assert weights.weight == pytest.approx(grid[mse.argmin()], abs=2e-4)


def test_num_unlabelled_smaller_than_the_subsample_is_rejected():
    for bad in (5, math.nan, math.inf):
        with pytest.raises(
            InputError, match=rf"num_unlabelled must be a finite number >= 6 .*{bad}"
        ):
            semi_supervised_weights(
                _t(HUMAN), _t(PSEUDO_L), _t(PSEUDO_U), "abc", num_unlabelled=bad
            )
    semi_supervised_weights(_t(HUMAN), _t(PSEUDO_L), _t(PSEUDO_U), "abc", num_unlabelled=1e6)


# ------------------------------------------------------------------ ABC's ŵ is optimal


def _abc_by_numpy(h, p, u, big_n=None):
    """ŵ's ingredients with numpy: P's and D's coefficients, Σ, D's value and b̂².

    With ``big_n`` (the whole unlabelled set's size when ``u`` is a subsample) Σ is that of the
    estimators, while b̂² is de-biased by the variance of D over the subsample actually used.
    """
    h, p, u = np.asarray(h), np.asarray(p), np.asarray(u)
    n, big_n = len(h), len(u) if big_n is None else big_n
    lam = _numpy_lambda(h, p, u, big_n)
    pseudo = np.array([0.0, n / (n + big_n), big_n / (n + big_n)])
    difference = np.array([1.0, -lam, lam]) - pseudo
    sigma = _covariance_matrix(h, p, u, big_n)
    observed = _covariance_matrix(h, p, u)
    _, means = _moments(h, p, u)
    d_value = _value(difference, means)
    bias2 = max(float(np.sum(d_value**2)) - difference @ observed @ difference, 0.0)
    return pseudo, difference, sigma, means, bias2


def _abc_mse(w: np.ndarray, pseudo, difference, sigma, bias2) -> np.ndarray:
    """Plug-in MSE of P + w D: Var(P + w D) + (1 - w)² b̂², for every w of a grid."""
    mixed = pseudo[None, :] + w[:, None] * difference[None, :]
    return np.einsum("wi,ij,wj->w", mixed, sigma, mixed) + (1 - w) ** 2 * bias2


def _biased_judge(seed, n, big_n, width, bias):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(n + big_n, width, generator=gen, dtype=torch.float64)
    h = shared[:n] + 0.6 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    p = shared + 0.3 * torch.randn(n + big_n, width, generator=gen, dtype=torch.float64) + bias
    return h, p[:n], p[n:]


@pytest.mark.parametrize(("width", "bias"), [(1, 0.25), (2, 0.2), (1, 0.0), (1, 3.0)])
def test_abc_weight_minimises_the_plug_in_mse(width, bias):
    h, p, u = _biased_judge(7, 30, 300, width, bias)
    estimate = estimate_mean(h, p, u, "abc")
    weights = estimate.weights
    pseudo, difference, sigma, means, bias2 = _abc_by_numpy(h.numpy(), p.numpy(), u.numpy())
    assert weights.lam == pytest.approx(_numpy_lambda(h.numpy(), p.numpy(), u.numpy()))
    assert weights.bias2 == pytest.approx(bias2, rel=1e-9, abs=1e-12)
    grid = np.linspace(0.0, 1.0, 10_001)
    mse = _abc_mse(grid, pseudo, difference, sigma, bias2)
    assert weights.weight == pytest.approx(grid[mse.argmin()], abs=2e-4)
    if bias == 0.25:
        assert 0.05 < weights.weight < 0.95, "the check needs an interior optimum"
    if bias == 3.0:
        assert weights.weight > 0.99  # a large bias: ABC is PPI++
    # The estimate is P + ŵ D, and its coefficients are those of that blend.
    blend = pseudo + weights.weight * difference
    assert (weights.a_h, weights.a_p, weights.a_u) == pytest.approx(tuple(blend), abs=1e-12)
    np.testing.assert_allclose(np.atleast_1d(estimate.value.numpy()), _value(blend, means))
    assert weights.variance == pytest.approx(blend @ sigma @ blend, rel=1e-9)


def test_abc_weight_is_one_when_pseudo_and_ppi_coincide():
    # Constant statistics: D = PP - P is 0 with no variance, so b̂² + Var(D) = 0 and the rule
    # (not the formula, which would divide by zero) sets ŵ.
    ones4, ones6 = torch.ones(4), torch.ones(6)
    weights = semi_supervised_weights(ones4, ones4, ones6, "abc")
    assert weights.weight == 1.0
    assert "weight set to 1: pseudo-only and PPI++ coincide" in weights.notes


# ------------------------------------------------------------------ unbiasedness by simulation


def test_ppi_estimators_are_unbiased_and_pseudo_only_is_not():
    draws, n, big_n, rate = 400, 40, 400, 0.6
    gen = torch.Generator().manual_seed(2024)
    truth = (torch.rand(draws, n + big_n, generator=gen) < rate).double()
    keep_one = torch.rand(draws, n + big_n, generator=gen) < 0.9
    false_one = torch.rand(draws, n + big_n, generator=gen) < 0.4
    judge = torch.where(truth == 1, keep_one.double(), false_one.double())
    judge_rate = rate * 0.9 + (1 - rate) * 0.4  # 0.70: the judge over-states by 0.10
    values = {method: [] for method in ("pseudo", "ppi", "ppi++")}
    for i in range(draws):
        for method, found in values.items():
            estimate = estimate_mean(truth[i, :n], judge[i, :n], judge[i, n:], method)
            found.append(estimate.value.item())
    for method, found in values.items():
        found = np.array(found)
        standard_error = found.std(ddof=1) / math.sqrt(draws)
        if method == "pseudo":
            assert abs(found.mean() - judge_rate) < 4 * standard_error
            assert found.mean() - rate > 20 * standard_error
        else:
            assert abs(found.mean() - rate) < 4 * standard_error, method


# ------------------------------------------------------------------ losses and gradients


def test_combine_losses_is_the_weighted_sum_of_the_means():
    loss_h = _t([1.0, 2.0, 6.0])
    loss_p = _t([0.5, 0.5, 2.0])
    loss_u = _t([3.0, 1.0, 2.0, 2.0, 7.0])
    weights = SemiSupervisedWeights("abc", 0.3, -0.2, 0.9)
    total = combine_losses(loss_h, loss_p, loss_u, weights)
    assert total.item() == pytest.approx(0.3 * 3.0 - 0.2 * 1.0 + 0.9 * 3.0)
    # A zero coefficient ignores its group (even a NaN loss there, which is never computed).
    human = SemiSupervisedWeights("human", 1.0, 0.0, 0.0)
    nan = torch.full((2,), math.nan, dtype=torch.float64)
    assert combine_losses(loss_h, nan, nan, human).item() == pytest.approx(3.0)
    # Gradients flow through every group with a non-zero coefficient.
    leaves = [x.clone().requires_grad_(True) for x in (loss_h, loss_p, loss_u)]
    combine_losses(*leaves, weights).backward()
    torch.testing.assert_close(leaves[1].grad, torch.full((3,), -0.2 / 3, dtype=torch.float64))
    torch.testing.assert_close(leaves[2].grad, torch.full((5,), 0.9 / 5, dtype=torch.float64))


@pytest.mark.parametrize(
    ("losses", "match"),
    [
        ((_t([1.0, 2.0]), _t([1.0, 2.0, 3.0]), _t([1.0])), "human_labelled has 2 losses but"),
        ((_t([1.0, 2.0]), _t([1.0, 2.0]), _t([])), r"pseudo_unlabelled must .*shape \(0,\)"),
        ((_t([[1.0], [2.0]]), _t([1.0, 2.0]), _t([1.0])), r"human_labelled must .*\(2, 1\)"),
    ],
)
def test_combine_losses_rejects_groups_that_do_not_fit(losses, match):
    with pytest.raises(InputError, match=match):
        combine_losses(*losses, SemiSupervisedWeights("abc", 0.3, -0.2, 0.9))


def test_margin_gradients_rejects_shapes_that_would_broadcast():
    with pytest.raises(
        InputError, match=r"\(m,\), \(m,\) and \(m, d\), got \(3,\), \(3,\) and \(3,\)"
    ):
        margin_gradients(torch.zeros(3), torch.ones(3), torch.zeros(3))  # an outer product before
    with pytest.raises(InputError, match=r"got \(\), \(\) and \(3, 1\)"):
        margin_gradients(torch.tensor(0.5), torch.tensor(1.0), torch.zeros(3, 1))
    with pytest.raises(InputError, match="margin_grads has 2 rows for 3 margins"):
        margin_gradients(torch.zeros(3), torch.ones(3), torch.zeros(2, 4))


def test_preference_loss_is_bradley_terry_with_soft_labels():
    margin = _t([-3.0, -0.5, 0.0, 0.7, 4.0])
    labels = _t([1.0, 0.0, 0.5, 0.25, 1.0])
    expected = -(labels * F.logsigmoid(margin) + (1 - labels) * F.logsigmoid(-margin))
    torch.testing.assert_close(preference_loss(margin, labels), expected)
    torch.testing.assert_close(
        preference_loss(margin, labels),
        F.binary_cross_entropy_with_logits(margin, labels, reduction="none"),
    )
    # Integer-like labels of another dtype are converted.
    assert preference_loss(margin.float(), torch.tensor([1, 0, 1, 0, 1])).dtype == torch.float32


@pytest.mark.parametrize(("bad", "text"), [(1.5, "1.5"), (-0.25, "-0.25"), (math.nan, "nan")])
def test_preference_loss_rejects_labels_outside_zero_one(bad, text):
    labels = _t([1.0, 0.0, bad])
    with pytest.raises(InputError, match="preference labels must lie in") as error:
        preference_loss(_t([0.0, 1.0, 2.0]), labels)
    assert str(error.value).endswith(f"got {text}")
    with pytest.raises(InputError, match=f"got {text}"):
        margin_gradients(_t([0.0, 1.0, 2.0]), labels, torch.ones(3, 2, dtype=torch.float64))


def test_margin_gradients_equal_autograd_of_the_loss_through_a_linear_head():
    gen = torch.Generator().manual_seed(1)
    first = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    second = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    labels = _t([1.0, 0.0, 1.0, 0.3, 0.0, 1.0])
    head = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    margin = first @ head - second @ head
    losses = preference_loss(margin, labels)
    expected = torch.stack(
        [torch.autograd.grad(loss, head, retain_graph=True)[0] for loss in losses]
    )
    found = margin_gradients(margin.detach(), labels, first - second)
    torch.testing.assert_close(found, expected)


def test_dpo_margin_is_beta_times_the_log_ratio_difference():
    margin = dpo_margin(_t([-1.0]), _t([-4.0]), _t([-2.0]), _t([-2.5]), beta=0.5)
    assert margin.item() == pytest.approx(0.5 * ((-1.0 + 2.0) - (-4.0 + 2.5)))


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1.0], [1.0], [0.0, 1.0]), "the human-labelled set has 1 example(s)"),
        (
            ([1.0, 0.0, 1.0], [1.0, 0.0], [0.0, 1.0]),
            "human_labelled has 3 rows but pseudo_labelled has 2",
        ),
        (([1.0, 0.0], [1.0, 0.0], [0.0]), "the pseudo-labelled (unlabelled) set has 1 example(s)"),
        (([1.0, math.nan], [1.0, 0.0], [0.0, 1.0]), "human_labelled contains NaN"),
        (([1.0, 0.0], [1.0, 0.0], [0.0, math.inf]), "pseudo_unlabelled contains NaN or infinite"),
        (([1.0, 0.0], [math.nan, 0.0], [0.0, 1.0]), "pseudo_labelled contains NaN"),
    ],
)
@pytest.mark.parametrize("entry", ["estimate_mean", "semi_supervised_weights"])
def test_bad_statistics_raise_input_error_naming_them(args, message, entry):
    function = estimate_mean if entry == "estimate_mean" else semi_supervised_weights
    with pytest.raises(InputError) as error:
        function(*(_t(a) for a in args), "ppi++")
    assert message in str(error.value)


def test_width_mismatch_and_bad_dimensions_are_rejected():
    two_wide = torch.zeros(4, 2)
    with pytest.raises(InputError, match="same width, got 2, 2 and 1"):
        estimate_mean(two_wide, two_wide, torch.zeros(6, 1), "ppi")
    with pytest.raises(InputError, match=r"human_labelled must have one row per example .* 3-D"):
        estimate_mean(torch.zeros(4, 1, 1), two_wide, two_wide, "ppi")


@pytest.mark.parametrize("entry", [estimate_mean, semi_supervised_weights])
def test_unknown_method_is_rejected_naming_it(entry):
    with pytest.raises(InputError) as error:
        entry(_t(HUMAN), _t(PSEUDO_L), _t(PSEUDO_U), "ppi+")
    assert "method must be one of human, pseudo, concat, ppi, ppi++, abc" in str(error.value)
    assert "'ppi+'" in str(error.value)
