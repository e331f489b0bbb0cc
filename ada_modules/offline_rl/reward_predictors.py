"""Reward predictors with uncertainty, fitted on scarce labelled data (A²IQL's reward model).

A²IQL labels the transitions of an offline dataset with a reward predicted from a few labelled
ones, and penalises the prediction by its uncertainty (:func:`conservative_bonus`) so that the
policy is not drawn to actions whose reward is merely extrapolated.

* :class:`BayesianLinearRewardPredictor`: Bayesian linear regression on standardised features
  plus a bias, with a Gaussian prior of precision ``α`` on every weight; closed-form posterior and
  predictive variance ``1/β + ϕᵀ Σ_N ϕ``. The noise precision ``β`` is fixed or estimated by
  evidence maximisation (MacKay's fixed point).
* :class:`EnsembleRewardPredictor`: a deep ensemble of small MLPs, each trained on a bootstrap
  resample; the spread of the members' predictions is the uncertainty.

Both are :class:`torch.nn.Module` objects whose fitted state lives in buffers, so ``state_dict``
round-trips (a fresh, unfitted module accepts a fitted one's ``state_dict``).

Example:
    >>> import torch
    >>> x = torch.linspace(-1, 1, 50).unsqueeze(1)
    >>> model = BayesianLinearRewardPredictor(noise_precision=100.0).fit(x, 3 * x[:, 0] + 1)
    >>> mean, std = model.predict(torch.tensor([[0.0], [10.0]]))
    >>> [round(v, 1) for v in mean.tolist()], bool(std[1] > std[0])
    ([1.0, 31.0], True)
    >>> conservative_bonus(mean, std, penalty=1.0) < mean
    tensor([True, True])
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ada_modules.checks import check_finite_real
from ada_modules.errors import InputError

__all__ = ["BayesianLinearRewardPredictor", "EnsembleRewardPredictor", "conservative_bonus"]

_STD_FLOOR = 1e-6
# Smallest noise variance the evidence maximisation may reach (noise-free data drives it to 0).
_NOISE_VAR_FLOOR = 1e-12


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_features(features: object, width: int | None = None) -> Tensor:
    """Validate a ``[M, D]`` real, finite feature matrix (of width ``width`` when given)."""
    if not isinstance(features, Tensor):
        raise InputError(f"features must be a torch.Tensor, got {type(features).__name__}")
    if features.is_complex():
        raise InputError(f"features must be real, got dtype {features.dtype}")
    if features.ndim != 2 or features.shape[1] < 1:
        raise InputError(
            f"features must have shape [M, D] with D >= 1, got {tuple(features.shape)}"
        )
    if width is not None and features.shape[1] != width:
        raise InputError(
            f"features must have the width seen by fit, D = {width}, got {tuple(features.shape)}"
        )
    if not torch.isfinite(features).all():
        row = int((~torch.isfinite(features)).any(dim=1).nonzero()[0, 0])
        raise InputError(
            f"features must be finite, got NaN/inf in row {row}: {features[row].tolist()}"
        )
    return features


def _check_training_data(features: object, rewards: object) -> tuple[Tensor, Tensor]:
    features = _check_features(features)
    if features.shape[0] < 2:
        raise InputError(
            f"features must have at least 2 rows (M >= 2), got {tuple(features.shape)}"
        )
    if not isinstance(rewards, Tensor):
        raise InputError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.is_complex():
        raise InputError(f"rewards must be real, got dtype {rewards.dtype}")
    if rewards.ndim != 1 or rewards.shape[0] != features.shape[0]:
        raise InputError(
            f"rewards must have shape [M] with M = {features.shape[0]} (the rows of features), "
            f"got {tuple(rewards.shape)}"
        )
    if not torch.isfinite(rewards).all():
        index = int((~torch.isfinite(rewards)).nonzero()[0, 0])
        raise InputError(f"rewards must be finite, got {rewards[index].item()!r} at index {index}")
    return features, rewards


def _output_dtype(features: Tensor) -> torch.dtype:
    return features.dtype if features.is_floating_point() else torch.get_default_dtype()


class _FittedBuffers(nn.Module):
    """A module whose buffers change shape when fitted; loading a state dict resizes them."""

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        for name, buffer in list(self._buffers.items()):
            incoming = state_dict.get(prefix + name)
            if (
                buffer is not None
                and isinstance(incoming, Tensor)
                and incoming.shape != buffer.shape
            ):
                self._buffers[name] = torch.empty(
                    incoming.shape, dtype=incoming.dtype, device=buffer.device
                )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def is_fitted(self) -> bool:
        """Whether :meth:`fit` has run (or a fitted ``state_dict`` was loaded)."""
        return self.feature_mean.numel() > 0

    def _require_fitted(self) -> None:
        if not self.is_fitted:
            raise RuntimeError(
                f"{type(self).__name__} is used before fit: call fit(features, rewards) first"
            )

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Same as ``predict(features)``."""
        return self.predict(features)


class BayesianLinearRewardPredictor(_FittedBuffers):
    """Bayesian linear regression of rewards on standardised features, with predictive std.

    The design matrix ``Φ`` holds the features standardised with the fit data's mean and
    (population) std, floored at ``1e-6``, plus a column of ones for the bias; the rewards are
    standardised the same way (``z = (r - r̄) / s_r``), so the prior ``w ~ N(0, α⁻¹ I)`` (the
    bias included) is on the same scale whatever the reward's units and does not shrink its
    mean towards zero. With Gaussian noise of precision ``β`` (in standardised units), the
    posterior is ``N(μ_N, Σ_N)`` with ``Σ_N = (α I + β ΦᵀΦ)⁻¹`` and ``μ_N = β Σ_N Φᵀ z``; the
    predictive distribution at ``ϕ`` has mean ``r̄ + s_r ϕᵀ μ_N`` and variance
    ``s_r² (1/β + ϕᵀ Σ_N ϕ)``. ``noise_precision`` and ``fitted_noise_precision`` are in the
    rewards' own units (``β / s_r²``). Everything is computed in float64.

    When ``noise_precision`` is ``None``, ``β`` is estimated by evidence maximisation with ``α``
    held fixed: starting from ``β = 1 / var(r)``, MacKay's fixed point
    ``β ← (M - γ) / ‖r - Φ μ_N‖²`` with ``γ = Σ_i βλ_i / (α + βλ_i)`` (``λ_i`` the eigenvalues of
    ``ΦᵀΦ``) is iterated up to 100 times, stopping early at a relative change below ``1e-8``; the
    noise variance ``1/β`` is floored at ``1e-12``.

    Args:
        prior_precision: The prior precision ``α > 0`` of every weight (standardised units).
        noise_precision: The noise precision ``β > 0``, or ``None`` to estimate it in :meth:`fit`.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(200, 2, generator=g)
        >>> r = x @ torch.tensor([2.0, -1.0]) + 0.5 + 0.1 * torch.randn(200, generator=g)
        >>> model = BayesianLinearRewardPredictor().fit(x, r)
        >>> weight, bias = model.coefficients()
        >>> [round(v, 1) for v in weight.tolist()], round(bias.item(), 1)
        ([2.0, -1.0], 0.5)
        >>> round(model.fitted_noise_precision.item() ** -0.5, 1)  # estimated noise std
        0.1
    """

    feature_mean: Tensor
    feature_std: Tensor
    posterior_mean: Tensor
    posterior_cov: Tensor
    fitted_noise_precision: Tensor
    reward_mean: Tensor
    reward_std: Tensor

    def __init__(self, prior_precision: float = 1.0, noise_precision: float | None = None) -> None:
        super().__init__()
        alpha = check_finite_real("prior_precision", prior_precision)
        if alpha <= 0:
            raise InputError(f"prior_precision must be > 0, got {prior_precision!r}")
        if noise_precision is not None:
            beta = check_finite_real("noise_precision", noise_precision)
            if beta <= 0:
                raise InputError(f"noise_precision must be > 0 or None, got {noise_precision!r}")
        self.prior_precision = alpha
        self.noise_precision = None if noise_precision is None else float(noise_precision)
        empty = torch.empty(0, dtype=torch.float64)
        self.register_buffer("feature_mean", empty.clone())
        self.register_buffer("feature_std", empty.clone())
        self.register_buffer("posterior_mean", empty.clone())
        self.register_buffer("posterior_cov", empty.clone().reshape(0, 0))
        self.register_buffer("fitted_noise_precision", torch.tensor(math.nan, dtype=torch.float64))
        self.register_buffer("reward_mean", torch.tensor(0.0, dtype=torch.float64))
        self.register_buffer("reward_std", torch.tensor(1.0, dtype=torch.float64))

    def _design(self, features: Tensor) -> Tensor:
        mean = self.feature_mean.to(torch.float64)
        std = self.feature_std.to(torch.float64)
        x = features.detach().to(device=mean.device, dtype=torch.float64)
        standardised = (x - mean) / std
        return torch.cat([standardised, torch.ones_like(standardised[:, :1])], dim=1)

    @torch.no_grad()
    def fit(self, features: Tensor, rewards: Tensor) -> BayesianLinearRewardPredictor:
        """Compute the posterior from ``features [M, D]`` and ``rewards [M]`` (``M >= 2``).

        Args:
            features: The labelled transitions' features, shape ``[M, D]``, finite.
            rewards: Their rewards, shape ``[M]``, finite.

        Returns:
            ``self``, fitted.

        Raises:
            InputError: If ``M < 2``, the rows disagree or a value is NaN/inf.
        """
        features, rewards = _check_training_data(features, rewards)
        device = self.feature_mean.device
        x = features.detach().to(device=device, dtype=torch.float64)
        raw = rewards.detach().to(device=device, dtype=torch.float64)
        self.reward_mean = raw.mean()
        self.reward_std = raw.std(correction=0).clamp_min(_STD_FLOOR)
        r = (raw - self.reward_mean) / self.reward_std
        scale = float(self.reward_std) ** 2
        self.feature_mean = x.mean(dim=0)
        self.feature_std = x.std(dim=0, correction=0).clamp_min(_STD_FLOOR)
        phi = self._design(x)
        alpha = self.prior_precision
        # ΦᵀΦ = V diag(λ) Vᵀ, so Σ_N = V diag(1 / (α + βλ)) Vᵀ for every β.
        eigenvalues, eigenvectors = torch.linalg.eigh(phi.T @ phi)
        eigenvalues = eigenvalues.clamp_min(0.0)
        projected = eigenvectors.T @ (phi.T @ r)  # Vᵀ Φᵀ r

        def posterior_mean(beta: float) -> Tensor:
            return eigenvectors @ (beta * projected / (alpha + beta * eigenvalues))

        if self.noise_precision is not None:
            beta = self.noise_precision * scale
        else:
            num = r.shape[0]
            beta = 1.0 / max(float(r.var(correction=0)), _NOISE_VAR_FLOOR)
            for _ in range(100):
                mean = posterior_mean(beta)
                gamma = float((beta * eigenvalues / (alpha + beta * eigenvalues)).sum())
                squared_error = float((r - phi @ mean).square().sum())
                noise_var = max(squared_error / max(num - gamma, 1e-12), _NOISE_VAR_FLOOR)
                new_beta = 1.0 / noise_var
                converged = abs(new_beta - beta) <= 1e-8 * beta
                beta = new_beta
                if converged:
                    break
        covariance = (eigenvectors / (alpha + beta * eigenvalues)) @ eigenvectors.T
        self.posterior_cov = 0.5 * (covariance + covariance.T)
        self.posterior_mean = posterior_mean(beta)
        self.fitted_noise_precision = torch.tensor(beta / scale, dtype=torch.float64, device=device)
        return self

    @torch.no_grad()
    def predict(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Predictive mean and std of the reward at each row of ``features [M', D]``.

        Args:
            features: Features of the width seen by :meth:`fit`, shape ``[M', D]``, finite.

        Returns:
            ``(mean, std)``, each of shape ``[M']``, in the dtype (and on the device) of
            ``features`` (the default dtype for integer features).

        Raises:
            RuntimeError: If called before :meth:`fit`.
            InputError: If ``features`` is malformed or of another width.
        """
        self._require_fitted()
        features = _check_features(features, self.feature_mean.shape[0])
        phi = self._design(features)
        covariance = self.posterior_cov.to(torch.float64)
        scale = self.reward_std.to(torch.float64)
        mean = self.reward_mean.to(torch.float64) + scale * (
            phi @ self.posterior_mean.to(torch.float64)
        )
        variance = 1.0 / self.fitted_noise_precision.to(torch.float64) + scale**2 * (
            (phi @ covariance) * phi
        ).sum(dim=1)
        std = variance.clamp_min(0.0).sqrt()
        dtype = _output_dtype(features)
        return mean.to(features.device, dtype), std.to(features.device, dtype)

    def coefficients(self) -> tuple[Tensor, Tensor]:
        """The posterior mean as weights and bias in the original feature units.

        Returns:
            ``(weight [D], bias [])`` in float64 with ``mean reward = features @ weight + bias``.

        Raises:
            RuntimeError: If called before :meth:`fit`.
        """
        self._require_fitted()
        mean = self.posterior_mean.to(torch.float64) * self.reward_std.to(torch.float64)
        weight = mean[:-1] / self.feature_std.to(torch.float64)
        bias = self.reward_mean + mean[-1] - (weight * self.feature_mean.to(torch.float64)).sum()
        return weight, bias


def _init_uniform(shape: tuple[int, ...], fan_in: int, generator: torch.Generator) -> Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def _forward_members(layers: list[Tensor], x: Tensor) -> Tensor:
    """Stacked MLPs: ``x [E, M, D]`` → predictions ``[E, M]``; ``layers`` as in ``_LAYERS``."""
    weight1, bias1, weight2, bias2, weight3, bias3 = layers
    h = F.silu(torch.baddbmm(bias1, x, weight1))
    h = F.silu(torch.baddbmm(bias2, h, weight2))
    return torch.baddbmm(bias3, h, weight3).squeeze(-1)


def _train_members(
    layers: list[Tensor],
    inputs: Tensor,
    targets: Tensor,
    steps: int,
    lr: float,
    weight_decay: float,
) -> list[Tensor]:
    """Full-batch Adam on the stacked members; returns the trained (detached) layers.

    The update is torch.optim.Adam's (default betas and eps, L2 ``weight_decay`` added to the
    gradient of the weight matrices only), written out so that no optimiser machinery is needed.
    Adam is elementwise and the loss is the sum of the members' mean squared errors, so each
    member trains exactly as it would alone.
    """
    layers = [layer.detach().clone().requires_grad_() for layer in layers]
    decays = [weight_decay, 0.0] * (len(layers) // 2)
    first = [torch.zeros_like(layer) for layer in layers]
    second = [torch.zeros_like(layer) for layer in layers]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for step in range(1, steps + 1):
        with torch.enable_grad():
            loss = (_forward_members(layers, inputs) - targets).square().mean(dim=1).sum()
            grads = torch.autograd.grad(loss, layers)
        with torch.no_grad():
            step_size = lr / (1 - beta1**step)
            correction = math.sqrt(1 - beta2**step)
            for layer, grad, m1, m2, decay in zip(
                layers, grads, first, second, decays, strict=True
            ):
                if decay:
                    grad = grad.add(layer, alpha=decay)
                m1.lerp_(grad, 1 - beta1)
                m2.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                layer.addcdiv_(m1, (m2.sqrt() / correction).add_(eps), value=-step_size)
    return [layer.detach() for layer in layers]


class EnsembleRewardPredictor(_FittedBuffers):
    """A bootstrap ensemble of small MLPs; the spread of the members is the uncertainty.

    Features are standardised with the fit data's mean and (population) std (floored at
    ``1e-6``), and so are the rewards. Member ``e`` is an MLP ``D → hidden → hidden → 1`` with SiLU
    activations, initialised and bootstrap-resampled from a ``torch.Generator`` seeded with
    ``seed + e``, and trained full-batch on its resample with Adam (L2 ``weight_decay`` on the
    weight matrices, not the biases) for ``steps`` steps. The members are trained together as
    stacked weights with batched matrix products. The fitted weights are buffers, not
    parameters, so an outer optimiser never trains them.

    Args:
        num_members: Number of ensemble members, ``>= 2``.
        hidden: Width of both hidden layers, ``>= 1``.
        steps: Full-batch Adam steps per member, ``>= 1``.
        lr: Adam learning rate, ``> 0``.
        weight_decay: L2 penalty on the weight matrices, ``>= 0``.
        seed: Base seed; the fit is deterministic given it (on a given machine).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.rand(64, 1, generator=g) * 4 - 2
        >>> model = EnsembleRewardPredictor(num_members=3, hidden=16, steps=150)
        >>> mean, std = model.fit(x, torch.sin(2 * x[:, 0])).predict(torch.tensor([[0.5], [8.0]]))
        >>> abs(mean[0].item() - math.sin(1.0)) < 0.1, bool(std[1] > 5 * std[0])
        (True, True)
    """

    feature_mean: Tensor
    feature_std: Tensor
    reward_mean: Tensor
    reward_std: Tensor
    weight1: Tensor
    bias1: Tensor
    weight2: Tensor
    bias2: Tensor
    weight3: Tensor
    bias3: Tensor

    _LAYERS = ("weight1", "bias1", "weight2", "bias2", "weight3", "bias3")

    def __init__(
        self,
        num_members: int = 5,
        hidden: int = 64,
        steps: int = 500,
        lr: float = 1e-2,
        weight_decay: float = 1e-4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_members = _check_int("num_members", num_members, 2)
        self.hidden = _check_int("hidden", hidden, 1)
        self.steps = _check_int("steps", steps, 1)
        self.lr = check_finite_real("lr", lr)
        if self.lr <= 0:
            raise InputError(f"lr must be > 0, got {lr!r}")
        self.weight_decay = check_finite_real("weight_decay", weight_decay)
        if self.weight_decay < 0:
            raise InputError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InputError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        for name in ("feature_mean", "feature_std", *self._LAYERS):
            self.register_buffer(name, torch.empty(0))
        self.register_buffer("reward_mean", torch.tensor(0.0))
        self.register_buffer("reward_std", torch.tensor(1.0))

    def fit(self, features: Tensor, rewards: Tensor) -> EnsembleRewardPredictor:
        """Train the members on ``features [M, D]`` and ``rewards [M]`` (``M >= 2``).

        Args:
            features: The labelled transitions' features, shape ``[M, D]``, finite.
            rewards: Their rewards, shape ``[M]``, finite.

        Returns:
            ``self``, fitted.

        Raises:
            InputError: If ``M < 2``, the rows disagree or a value is NaN/inf.
        """
        features, rewards = _check_training_data(features, rewards)
        device = self.feature_mean.device
        x = features.detach().to(device=device, dtype=torch.float32)
        r = rewards.detach().to(device=device, dtype=torch.float32)
        num, width = x.shape
        feature_mean = x.mean(dim=0)
        feature_std = x.std(dim=0, correction=0).clamp_min(_STD_FLOOR)
        reward_mean = r.mean()
        reward_std = r.std(correction=0).clamp_min(_STD_FLOOR)
        x = (x - feature_mean) / feature_std
        r = (r - reward_mean) / reward_std

        hidden = self.hidden
        shapes = {
            "weight1": ((width, hidden), width),
            "bias1": ((1, hidden), width),
            "weight2": ((hidden, hidden), hidden),
            "bias2": ((1, hidden), hidden),
            "weight3": ((hidden, 1), hidden),
            "bias3": ((1, 1), hidden),
        }
        initial: dict[str, list[Tensor]] = {name: [] for name in self._LAYERS}
        resamples = []
        for member in range(self.num_members):
            generator = torch.Generator().manual_seed(self.seed + member)
            for name in self._LAYERS:
                shape, fan_in = shapes[name]
                initial[name].append(_init_uniform(shape, fan_in, generator))
            resamples.append(torch.randint(num, (num,), generator=generator))
        index = torch.stack(resamples).to(device)  # [E, M]
        inputs, targets = x[index], r[index]  # [E, M, D], [E, M]

        layers = [torch.stack(initial[name]).to(device) for name in self._LAYERS]
        layers = _train_members(layers, inputs, targets, self.steps, self.lr, self.weight_decay)

        self.feature_mean, self.feature_std = feature_mean, feature_std
        self.reward_mean, self.reward_std = reward_mean, reward_std
        for name, layer in zip(self._LAYERS, layers, strict=True):
            setattr(self, name, layer.detach())
        return self

    @torch.no_grad()
    def member_predictions(self, features: Tensor) -> Tensor:
        """Each member's predicted reward at each row of ``features [M', D]``.

        Args:
            features: Features of the width seen by :meth:`fit`, shape ``[M', D]``, finite.

        Returns:
            Predictions of shape ``[E, M']`` in reward units, float32 on the module's device.

        Raises:
            RuntimeError: If called before :meth:`fit`.
            InputError: If ``features`` is malformed or of another width.
        """
        self._require_fitted()
        features = _check_features(features, self.feature_mean.shape[0])
        layers = [getattr(self, name).float() for name in self._LAYERS]
        x = features.detach().to(device=self.feature_mean.device, dtype=torch.float32)
        x = (x - self.feature_mean.float()) / self.feature_std.float()
        x = x.unsqueeze(0).expand(layers[0].shape[0], -1, -1)
        return _forward_members(layers, x) * self.reward_std.float() + self.reward_mean.float()

    @torch.no_grad()
    def predict(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Ensemble mean and std (population std across members) of the reward.

        Args:
            features: Features of the width seen by :meth:`fit`, shape ``[M', D]``, finite.

        Returns:
            ``(mean, std)``, each of shape ``[M']`` in reward units, in the dtype (and on the
            device) of ``features`` (the default dtype for integer features).

        Raises:
            RuntimeError: If called before :meth:`fit`.
            InputError: If ``features`` is malformed or of another width.
        """
        predictions = self.member_predictions(features)
        dtype = _output_dtype(features)
        mean = predictions.mean(dim=0)
        std = predictions.std(dim=0, correction=0)
        return mean.to(features.device, dtype), std.to(features.device, dtype)


def conservative_bonus(mean: Tensor, std: Tensor, penalty: float) -> Tensor:
    """The pessimistic reward ``mean - penalty · std`` (a lower confidence bound).

    Args:
        mean: Predicted reward, any shape.
        std: Its uncertainty, broadcastable with ``mean``.
        penalty: How many standard deviations to subtract, ``>= 0``.

    Returns:
        ``mean - penalty · std``, broadcast.

    Raises:
        InputError: If ``penalty`` is negative or not finite, or ``mean``/``std`` are not
            tensors or do not broadcast.

    Example:
        >>> conservative_bonus(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.0]), penalty=2.0)
        tensor([0., 2.])
    """
    if not isinstance(mean, Tensor):
        raise InputError(f"mean must be a torch.Tensor, got {type(mean).__name__}")
    if not isinstance(std, Tensor):
        raise InputError(f"std must be a torch.Tensor, got {type(std).__name__}")
    try:
        torch.broadcast_shapes(mean.shape, std.shape)
    except RuntimeError as error:
        raise InputError(
            f"std must broadcast with mean {tuple(mean.shape)}, got {tuple(std.shape)}"
        ) from error
    value = check_finite_real("penalty", penalty)
    if value < 0:
        raise InputError(f"penalty must be >= 0, got {penalty!r}")
    return mean - value * std
