"""Reward predictors: the Bayesian linear posterior against numpy, the evidence-maximised noise
precision, uncertainty far from the data, the deep ensemble's fit, spread and determinism,
state-dict round trips and bad input."""

import io
import math

import numpy as np
import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.offline_rl.reward_predictors import (
    BayesianLinearRewardPredictor,
    EnsembleRewardPredictor,
    _train_members,
    conservative_bonus,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Fit on one thread: the many small ops of a fit gain nothing from more, and on a busy
    machine OpenMP threads waiting for a core slow them down by an order of magnitude."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _linear_data(num: int, seed: int, noise: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num, 3, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 3.0, 0.2])
    x = x + torch.tensor([0.0, 5.0, -1.0], dtype=torch.float64)
    r = x @ torch.tensor([1.5, -0.5, 4.0], dtype=torch.float64) + 2.0
    return x, r + noise * torch.randn(num, generator=gen, dtype=torch.float64)


# ------------------------------------------------------------------ Bayesian linear


def test_bayesian_linear_recovers_true_weights_and_noise() -> None:
    x, r = _linear_data(300, seed=0, noise=0.01)
    model = BayesianLinearRewardPredictor().fit(x, r)
    weight, bias = model.coefficients()
    torch.testing.assert_close(
        weight, torch.tensor([1.5, -0.5, 4.0], dtype=torch.float64), atol=0.01, rtol=0
    )
    assert bias.item() == pytest.approx(2.0, abs=0.05)
    assert model.fitted_noise_precision.item() ** -0.5 == pytest.approx(0.01, rel=0.15)
    mean, _ = model.predict(x)
    assert (mean - r).abs().max().item() < 0.05


def _numpy_posterior(x: np.ndarray, r: np.ndarray, alpha: float, beta: float):
    """The posterior in standardised units (features and rewards); ``beta`` in reward units."""
    mu, sd = x.mean(axis=0), np.maximum(x.std(axis=0), 1e-6)
    phi = np.hstack([(x - mu) / sd, np.ones((len(x), 1))])
    z = (r - r.mean()) / r.std()
    beta = beta * r.var()
    cov = np.linalg.inv(alpha * np.eye(phi.shape[1]) + beta * phi.T @ phi)
    return mu, sd, phi, cov, beta * cov @ phi.T @ z


def test_bayesian_linear_matches_closed_form_with_fixed_precisions() -> None:
    x, r = _linear_data(40, seed=1, noise=0.5)
    alpha, beta = 2.5, 3.0
    model = BayesianLinearRewardPredictor(prior_precision=alpha, noise_precision=beta).fit(x, r)
    mu, sd, _, cov, mean = _numpy_posterior(x.numpy(), r.numpy(), alpha, beta)
    np.testing.assert_allclose(model.posterior_mean.numpy(), mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(model.posterior_cov.numpy(), cov, rtol=1e-10, atol=1e-12)

    query = np.array([[0.0, 0.0, 0.0], [1.0, 5.0, -1.0], [-3.0, 12.0, 2.0]])
    phi = np.hstack([(query - mu) / sd, np.ones((3, 1))])
    pred_mean, pred_std = model.predict(torch.from_numpy(query))
    r_mean, r_std = r.numpy().mean(), r.numpy().std()
    np.testing.assert_allclose(pred_mean.numpy(), r_mean + r_std * (phi @ mean), rtol=1e-10)
    expected_var = 1 / beta + r_std**2 * np.einsum("md,de,me->m", phi, cov, phi)
    np.testing.assert_allclose(pred_std.numpy() ** 2, expected_var, rtol=1e-10)


def test_bayesian_linear_estimated_beta_is_mackay_fixed_point() -> None:
    x, r = _linear_data(25, seed=2, noise=0.3)
    alpha = 0.7
    model = BayesianLinearRewardPredictor(prior_precision=alpha).fit(x, r)
    beta = model.fitted_noise_precision.item()
    _, _, phi, cov, mean = _numpy_posterior(x.numpy(), r.numpy(), alpha, beta)
    np.testing.assert_allclose(model.posterior_mean.numpy(), mean, rtol=1e-8, atol=1e-12)
    eigenvalues = beta * r.numpy().var() * np.linalg.eigvalsh(phi.T @ phi)
    gamma = (eigenvalues / (alpha + eigenvalues)).sum()
    residual = ((r.numpy() - r.numpy().mean() - r.numpy().std() * (phi @ mean)) ** 2).sum()
    assert beta == pytest.approx((len(r) - gamma) / residual, rel=1e-6)
    assert 1 / math.sqrt(beta) == pytest.approx(0.3, rel=0.4)


def test_bayesian_linear_std_grows_away_from_data_and_shrinks_with_more_data() -> None:
    x, r = _linear_data(1000, seed=3, noise=0.5)
    model = BayesianLinearRewardPredictor(noise_precision=4.0).fit(x[:50], r[:50])
    centre = x[:50].mean(dim=0, keepdim=True)
    direction = torch.tensor([[1.0, 3.0, 0.2]], dtype=torch.float64)  # one feature std each
    _, stds = model.predict(centre + torch.tensor([[0.0], [1.0], [3.0], [10.0]]) * direction)
    assert (stds[1:] > stds[:-1]).all()  # grows with the distance from the data
    assert stds[0].item() >= 0.5  # never below the noise std 1/√β
    assert stds[-1].item() > 2 * stds[0].item()

    query = centre + torch.tensor([[1.0, 3.0, 0.2]], dtype=torch.float64)
    stds = [
        BayesianLinearRewardPredictor(noise_precision=4.0).fit(x[:m], r[:m]).predict(query)[1]
        for m in (10, 100, 1000)
    ]
    assert stds[0].item() > stds[1].item() > stds[2].item()


def test_bayesian_linear_does_not_shrink_a_large_reward_mean() -> None:
    # Rewards far from zero and in large units: with the prior on standardised rewards the fit
    # stays close to least squares (it used to collapse towards zero, R² < 0).
    x, r = _linear_data(60, seed=6, noise=0.1)
    r = 40.0 * r - 500.0
    mean, _ = BayesianLinearRewardPredictor().fit(x, r).predict(x)
    r_squared = 1 - ((mean - r) ** 2).mean() / r.var(correction=0)
    assert r_squared > 0.95


def test_bayesian_linear_output_dtype_and_constant_feature() -> None:
    x, _ = _linear_data(30, seed=4)
    x[:, 1] = 7.0  # a constant column: its std is floored, not divided by zero
    r = x[:, 0] - 2 * x[:, 2]
    model = BayesianLinearRewardPredictor().fit(x.float(), r.float())
    mean32, std32 = model.predict(x.float())
    assert mean32.dtype == std32.dtype == torch.float32
    mean64, _ = model.predict(x)
    assert mean64.dtype == torch.float64
    assert torch.isfinite(mean64).all() and (mean64 - r).abs().max() < 0.1


def test_bayesian_linear_state_dict_round_trip() -> None:
    x, r = _linear_data(50, seed=5, noise=0.2)
    model = BayesianLinearRewardPredictor(prior_precision=0.5).fit(x, r)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    restored = BayesianLinearRewardPredictor(prior_precision=0.5)
    restored.load_state_dict(torch.load(buffer))
    query = x[:7] + 1.0
    for got, want in zip(restored.predict(query), model.predict(query), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert restored(query)[0].shape == (7,)


def test_bayesian_linear_predict_before_fit_raises() -> None:
    with pytest.raises(RuntimeError, match="before fit"):
        BayesianLinearRewardPredictor().predict(torch.zeros(2, 3))


# ------------------------------------------------------------------ ensemble


def _target(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] ** 2


def _nonlinear_data(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(num, 2, generator=gen) * 4 - 2
    return x, _target(x) + 0.05 * torch.randn(num, generator=gen)


_SMALL = {"num_members": 4, "hidden": 32, "steps": 300}


@pytest.fixture(scope="module")
def fitted_ensemble() -> EnsembleRewardPredictor:
    x, r = _nonlinear_data(300, seed=0)
    return EnsembleRewardPredictor(**_SMALL).fit(x, r)


def test_ensemble_fits_a_nonlinear_function(fitted_ensemble: EnsembleRewardPredictor) -> None:
    x_test, _ = _nonlinear_data(500, seed=1)
    truth = _target(x_test)
    mean, std = fitted_ensemble.predict(x_test)
    r2 = 1 - (mean - truth).square().sum() / (truth - truth.mean()).square().sum()
    assert r2.item() > 0.8
    assert mean.shape == std.shape == (500,) and (std >= 0).all()


def test_ensemble_is_more_uncertain_off_distribution(
    fitted_ensemble: EnsembleRewardPredictor,
) -> None:
    x_in, _ = _nonlinear_data(200, seed=2)
    x_out = x_in * 3 + torch.tensor([8.0, -8.0])
    _, std_in = fitted_ensemble.predict(x_in)
    _, std_out = fitted_ensemble.predict(x_out)
    assert std_out.mean().item() > 3 * std_in.mean().item()


def test_ensemble_is_deterministic_for_a_seed() -> None:
    x, r = _nonlinear_data(64, seed=3)
    config = {"num_members": 3, "hidden": 8, "steps": 30}
    first = EnsembleRewardPredictor(**config, seed=11).fit(x, r).member_predictions(x)
    again = EnsembleRewardPredictor(**config, seed=11).fit(x, r).member_predictions(x)
    other = EnsembleRewardPredictor(**config, seed=12).fit(x, r).member_predictions(x)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    # Member e is seeded with seed + e, so it does not depend on how many members there are.
    fewer = EnsembleRewardPredictor(**{**config, "num_members": 2}, seed=11).fit(x, r)
    torch.testing.assert_close(fewer.member_predictions(x), first[:2], rtol=1e-5, atol=1e-5)


def test_member_training_is_adam() -> None:
    gen = torch.Generator().manual_seed(6)
    members, num, width, hidden = 2, 16, 3, 5
    shapes = [(width, hidden), (1, hidden), (hidden, hidden), (1, hidden), (hidden, 1), (1, 1)]
    layers = [torch.randn(members, *shape, generator=gen) * 0.5 for shape in shapes]
    inputs = torch.randn(members, num, width, generator=gen)
    targets = torch.randn(members, num, generator=gen)
    trained = _train_members(layers, inputs, targets, steps=5, lr=0.05, weight_decay=0.1)

    for e in range(members):
        params = [layer[e].clone().requires_grad_() for layer in layers]
        optimiser = torch.optim.Adam(
            [{"params": params[0::2], "weight_decay": 0.1}, {"params": params[1::2]}], lr=0.05
        )
        for _ in range(5):
            optimiser.zero_grad()
            h = torch.nn.functional.silu(inputs[e] @ params[0] + params[1])
            h = torch.nn.functional.silu(h @ params[2] + params[3])
            ((h @ params[4] + params[5]).squeeze(-1) - targets[e]).square().mean().backward()
            optimiser.step()
        for got, want in zip(trained, params, strict=True):
            torch.testing.assert_close(got[e], want.detach(), rtol=1e-5, atol=1e-6)


def test_ensemble_state_dict_round_trip_and_dtype(
    fitted_ensemble: EnsembleRewardPredictor,
) -> None:
    restored = EnsembleRewardPredictor()  # other hyperparameters: the buffers carry the shapes
    restored.load_state_dict(fitted_ensemble.state_dict())
    assert list(restored.parameters()) == []
    x, _ = _nonlinear_data(10, seed=4)
    for got, want in zip(restored.predict(x), fitted_ensemble.predict(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    mean, std = restored.predict(x.double())
    assert mean.dtype == std.dtype == torch.float64


def test_ensemble_predict_before_fit_raises() -> None:
    with pytest.raises(RuntimeError, match="before fit"):
        EnsembleRewardPredictor().predict(torch.zeros(2, 3))


# ------------------------------------------------------------------ conservative bonus


def test_conservative_bonus() -> None:
    mean, std = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([0.5, 0.0, 2.0])
    torch.testing.assert_close(conservative_bonus(mean, std, 2.0), torch.tensor([0.0, 2.0, -5.0]))
    torch.testing.assert_close(conservative_bonus(mean, std, 0), mean)


# ------------------------------------------------------------------ bad input

_X = torch.zeros(4, 2)
_R = torch.zeros(4)
_NAN_X = _X.clone().index_put_((torch.tensor([2]), torch.tensor([1])), torch.tensor(math.nan))
_INF_R = _R.clone().index_put_((torch.tensor([1]),), torch.tensor(math.inf))


def _fitted_linear() -> BayesianLinearRewardPredictor:
    return BayesianLinearRewardPredictor().fit(torch.randn(5, 2), torch.randn(5))


@pytest.mark.parametrize("cls", [BayesianLinearRewardPredictor, EnsembleRewardPredictor])
@pytest.mark.parametrize(
    ("features", "rewards", "name"),
    [
        (_X[:1], _R[:1], "features"),
        (_X, _R[:3], "rewards"),
        (_X, _R[:, None], "rewards"),
        (_X[:, 0], _R, "features"),
        (_NAN_X, _R, "features"),
        (_X, _INF_R, "rewards"),
        (_X.numpy(), _R, "features"),
        (_X, _R.tolist(), "rewards"),
    ],
)
def test_fit_rejects_bad_data(cls, features, rewards, name: str) -> None:
    model = cls(steps=1) if cls is EnsembleRewardPredictor else cls()
    with pytest.raises(InputError, match=name):
        model.fit(features, rewards)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: BayesianLinearRewardPredictor(prior_precision=0.0), "prior_precision"),
        (lambda: BayesianLinearRewardPredictor(prior_precision=math.nan), "prior_precision"),
        (lambda: BayesianLinearRewardPredictor(noise_precision=-1.0), "noise_precision"),
        (lambda: BayesianLinearRewardPredictor(noise_precision="1"), "noise_precision"),
        (lambda: EnsembleRewardPredictor(num_members=1), "num_members"),
        (lambda: EnsembleRewardPredictor(hidden=0), "hidden"),
        (lambda: EnsembleRewardPredictor(steps=2.5), "steps"),
        (lambda: EnsembleRewardPredictor(lr=0.0), "lr"),
        (lambda: EnsembleRewardPredictor(weight_decay=-1e-4), "weight_decay"),
        (lambda: EnsembleRewardPredictor(seed=1.0), "seed"),
        (lambda: _fitted_linear().predict(torch.zeros(3, 4)), "features"),
        (lambda: _fitted_linear().predict(torch.full((3, 2), math.inf)), "features"),
        (lambda: conservative_bonus(torch.ones(2), torch.ones(2), -0.5), "penalty"),
        (lambda: conservative_bonus(torch.ones(2), torch.ones(3), 1.0), "std"),
        (lambda: conservative_bonus([1.0], torch.ones(1), 1.0), "mean"),
    ],
)
def test_bad_input_raises_input_error_naming_the_argument(call, name: str) -> None:
    with pytest.raises(InputError, match=name):
        call()
