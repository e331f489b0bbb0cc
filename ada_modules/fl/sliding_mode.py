"""Discrete adaptive sliding-mode control of an uncertain scalar plant (ASAP's controller).

The plant is first order with an unknown, time-varying drift and an unknown input gain::

    y[t+1] = y[t] + F[t] + b * u[t]

The controller steers ``y`` to ``target``. With the sliding variable ``s = y - target`` and
Gao's discrete reaching law ``s[t+1] = (1 - q) s[t] - eps[t] * sat(s[t] / phi)``, the control is::

    u[t] = (-F_hat[t] - q s[t] - eps[t] sat(s[t] / phi)) / b_hat

- ``F_hat[t] = w_hat . z(t)``: a finite Fourier-basis estimate of the drift, ``z(t) = [1, cos(2 pi
  k t / P), sin(2 pi k t / P)]`` for ``k = 1..K`` (the function-approximation technique). ``w_hat``
  and ``b_hat`` are estimated together by recursive least squares with forgetting on the observed
  steps ``y[t+1] - y[t] = w . z(t) + b u[t]``, with the *applied* (saturated) input as regressor, so
  the estimates stay right when the input saturates.
- ``eps``: the switching gain adapts as ``eps <- eps + kappa (|s| - phi)+`` (it grows while ``y`` is
  outside the boundary layer and is clipped to ``[eps_min, eps_max]``). Anti-windup: it does not grow
  in a step whose input was saturated (more gain could not have been applied).
- ``u`` is clipped to ``[u_min, u_max]`` (the actuator's limits, e.g. a stealth envelope).

``b_hat`` keeps the sign of the initial guess ``gain`` and at least ``min_gain_ratio`` of its
magnitude, so the control never flips direction on a poor estimate.

Examples:
    >>> import math
    >>> controller = SlidingModeController(target=0.3, gain=-1.0, u_max=1.0)
    >>> y = 0.9
    >>> for t in range(40):  # unknown drift and a true gain of -0.5
    ...     u = controller.step(y)
    ...     y = y + 0.02 + 0.01 * math.sin(t / 3) - 0.5 * u
    >>> abs(y - 0.3) < 0.02
    True
"""

import math

import torch

from ada_modules.errors import InputError

__all__ = ["SlidingModeController"]


class SlidingModeController:
    """Adaptive sliding-mode controller with a Fourier-basis drift estimate (see the module doc).

    Args:
        target: The set point of ``y``.
        gain: Initial guess of the input gain ``b`` (its sign must be right).
        reaching_rate: ``q`` in ``(0, 1]``, the share of ``s`` removed per step.
        switching_gain: Initial ``eps`` (``>= 0``).
        gain_adaptation: ``kappa >= 0``, the growth rate of ``eps``.
        boundary_layer: ``phi > 0``: ``sat(s / phi)`` replaces ``sign(s)`` within it.
        max_switching_gain: Upper clip of ``eps``; by default ``(1 - q) * phi``, so that within the
            boundary layer the loop does not overshoot (``q + eps / phi <= 1``). At most
            ``(2 - q) * phi`` (beyond it the loop is unstable inside the layer).
        fourier_order: ``K >= 0`` harmonics of the drift estimate (0: a constant drift).
        period: ``P > 0``, the period in steps of the first harmonic.
        forgetting: RLS forgetting factor in ``(0, 1]`` (smaller: tracks faster, noisier).
        prior_variance: Initial RLS covariance scale (``> 0``).
        min_gain_ratio: ``|b_hat| >= min_gain_ratio * |gain|``, in ``(0, 1]``.
        u_min: Lower input limit.
        u_max: Upper input limit (``> u_min``).
    """

    def __init__(
        self,
        target: float,
        gain: float,
        reaching_rate: float = 0.5,
        switching_gain: float = 0.0,
        gain_adaptation: float = 0.05,
        boundary_layer: float = 0.02,
        max_switching_gain: float | None = None,
        fourier_order: int = 2,
        period: float = 50.0,
        forgetting: float = 0.95,
        prior_variance: float = 10.0,
        min_gain_ratio: float = 0.05,
        u_min: float = -math.inf,
        u_max: float = math.inf,
    ) -> None:
        if max_switching_gain is None:
            max_switching_gain = max((1 - reaching_rate) * boundary_layer, switching_gain)
        checks = {
            "gain": gain != 0 and math.isfinite(gain),
            "reaching_rate": 0 < reaching_rate <= 1,
            "switching_gain": switching_gain >= 0,
            "gain_adaptation": gain_adaptation >= 0,
            "boundary_layer": boundary_layer > 0,
            "max_switching_gain": switching_gain
            <= max_switching_gain
            <= (2 - reaching_rate) * boundary_layer,
            "period": period > 0,
            "forgetting": 0 < forgetting <= 1,
            "prior_variance": prior_variance > 0,
            "min_gain_ratio": 0 < min_gain_ratio <= 1,
            "u_max": u_max > u_min,
        }
        allowed = {
            "gain": "a finite non-zero number",
            "reaching_rate": "in (0, 1]",
            "switching_gain": ">= 0",
            "gain_adaptation": ">= 0",
            "boundary_layer": "> 0",
            "max_switching_gain": f"in [switching_gain, (2 - reaching_rate) * boundary_layer] = "
            f"[{switching_gain}, {(2 - reaching_rate) * boundary_layer:.4g}]",
            "period": "> 0",
            "forgetting": "in (0, 1]",
            "prior_variance": "> 0",
            "min_gain_ratio": "in (0, 1]",
            "u_max": f"> u_min={u_min}",
        }
        for name, ok in checks.items():
            if not ok:
                raise InputError(f"{name} must be {allowed[name]}, got {locals()[name]!r}")
        if isinstance(fourier_order, bool) or not isinstance(fourier_order, int):
            raise InputError(f"fourier_order must be an integer >= 0, got {fourier_order!r}")
        if fourier_order < 0:
            raise InputError(f"fourier_order must be an integer >= 0, got {fourier_order!r}")
        self.target = float(target)
        self.gain = float(gain)
        self.reaching_rate = reaching_rate
        self.initial_switching_gain = switching_gain
        self.gain_adaptation = gain_adaptation
        self.boundary_layer = boundary_layer
        self.max_switching_gain = max_switching_gain
        self.fourier_order = fourier_order
        self.period = period
        self.forgetting = forgetting
        self.prior_variance = prior_variance
        self.min_gain_ratio = min_gain_ratio
        self.u_min = u_min
        self.u_max = u_max
        self.reset()

    def reset(self) -> None:
        """Forget the estimates and the history (a new run)."""
        size = 2 * self.fourier_order + 2  # Fourier weights, then the gain
        self.theta = torch.zeros(size, dtype=torch.float64)
        self.theta[-1] = self.gain
        self.covariance = torch.eye(size, dtype=torch.float64) * self.prior_variance
        self.switching_gain = self.initial_switching_gain
        self.t = 0
        self.saturated = False
        self._last: tuple[float, torch.Tensor, float] | None = None  # y, z, applied u

    def basis(self, t: int) -> torch.Tensor:
        """The Fourier basis ``z(t)``: 1, then cos and sin of each harmonic."""
        angles = [2 * math.pi * k * t / self.period for k in range(1, self.fourier_order + 1)]
        values = [1.0] + [f(a) for a in angles for f in (math.cos, math.sin)]
        return torch.tensor(values, dtype=torch.float64)

    @property
    def gain_estimate(self) -> float:
        """``b_hat``: the estimated gain, with the guess's sign and a floor on its magnitude."""
        estimate = float(self.theta[-1])
        magnitude = abs(estimate) if estimate * self.gain > 0 else 0.0
        return math.copysign(max(self.min_gain_ratio * abs(self.gain), magnitude), self.gain)

    def drift_estimate(self, t: int | None = None) -> float:
        """``F_hat(t)``: the estimated drift at step ``t`` (default the current step)."""
        z = self.basis(self.t if t is None else t)
        return float(self.theta[:-1] @ z)

    def _learn(self, y: float) -> None:
        """One RLS step on the last transition ``y_prev -> y`` under the applied input."""
        if self._last is None:
            return
        y_prev, z, u = self._last
        regressor = torch.cat([z, torch.tensor([u], dtype=torch.float64)])
        error = (y - y_prev) - float(regressor @ self.theta)
        p_x = self.covariance @ regressor
        k = p_x / (self.forgetting + float(regressor @ p_x))
        self.theta += k * error
        self.covariance = (self.covariance - torch.outer(k, p_x)) / self.forgetting
        self.covariance = (self.covariance + self.covariance.T) / 2
        # Bound the covariance (forgetting without excitation lets it grow without limit).
        scale = float(self.covariance.diagonal().max()) / (10 * self.prior_variance)
        if scale > 1:
            self.covariance /= scale

    def step(self, y: float, u_min: float | None = None, u_max: float | None = None) -> float:
        """Observe ``y[t]`` and return the input ``u[t]``, clipped to the limits.

        ``u_min`` / ``u_max`` tighten the constructor's limits for this step only (a limit that
        moves with the data, such as a stealth envelope).
        """
        if not math.isfinite(y):
            raise InputError(f"the measured output must be finite, got {y!r}")
        self._learn(y)
        s = y - self.target
        if not self.saturated:
            growth = self.gain_adaptation * max(abs(s) - self.boundary_layer, 0.0)
            self.switching_gain = min(self.switching_gain + growth, self.max_switching_gain)
        switching = self.switching_gain * max(-1.0, min(1.0, s / self.boundary_layer))
        z = self.basis(self.t)
        command = (-float(self.theta[:-1] @ z) - self.reaching_rate * s - switching) / (
            self.gain_estimate
        )
        lower = self.u_min if u_min is None else max(u_min, self.u_min)
        upper = self.u_max if u_max is None else min(u_max, self.u_max)
        if lower > upper:
            raise InputError(f"u_min={lower} must be <= u_max={upper} in this step")
        u = min(max(command, lower), upper)
        self.saturated = u != command
        self._last = (y, z, u)
        self.t += 1
        return u
