import math
import random

import pytest

from ada_modules.fl.sliding_mode import SlidingModeController


def _run(controller, steps, y0=0.9, gain=-0.5, drift=None, noise=0.0, seed=0):
    """Close the loop on ``y[t+1] = y[t] + F[t] + gain * u[t]``; returns the outputs and inputs."""
    rng = random.Random(seed)
    drift = drift or (lambda t: 0.02 + 0.01 * math.sin(t / 3))
    y, outputs, inputs = y0, [], []
    for t in range(steps):
        u = controller.step(y + rng.gauss(0.0, noise))
        y = y + drift(t) + gain * u
        outputs.append(y)
        inputs.append(u)
    return outputs, inputs


@pytest.mark.parametrize(("period", "band"), [(6 * math.pi, 0.005), (50.0, 0.03)])
def test_reaches_the_band_in_finite_time_and_stays_despite_an_unknown_drift_and_gain(period, band):
    """The drift ``0.02 + 0.01 sin(t / 3)``: in the Fourier basis when its period is 6 pi (then
    learnt almost exactly), outside it with period 50 (then tracked by the forgetting, less well)."""
    controller = SlidingModeController(target=0.3, gain=-1.0, boundary_layer=0.02, period=period)
    outputs, _ = _run(controller, 200)
    errors = [abs(y - 0.3) for y in outputs]
    reached = next(t for t, e in enumerate(errors) if e <= 0.05)
    assert reached <= 5
    assert max(errors[60:]) <= band
    # The gain is identified in the transient (the only excitation): roughly right, right sign.
    assert -0.75 <= controller.gain_estimate <= -0.15


def test_without_drift_the_reaching_law_is_followed_exactly():
    q, phi = 0.5, 0.02
    controller = SlidingModeController(
        target=0.0,
        gain=-0.5,
        reaching_rate=q,
        boundary_layer=phi,
        gain_adaptation=0.0,
        forgetting=1.0,
        prior_variance=1e-9,  # the gain is known: nothing to learn
    )
    outputs, _ = _run(controller, 12, y0=1.0, drift=lambda t: 0.0)
    s = 1.0
    for y in outputs:  # s[t+1] = (1 - q) s[t]: exponential, below phi after log(phi)/log(1-q)
        s = (1 - q) * s
        assert y == pytest.approx(s, abs=1e-9)
    assert abs(outputs[math.ceil(math.log(phi) / math.log(1 - q))]) <= phi


def test_drift_that_the_input_cannot_beat_saturates_without_winding_up():
    controller = SlidingModeController(
        target=0.3, gain=-1.0, gain_adaptation=0.001, u_min=-0.05, u_max=0.05
    )
    outputs, inputs = _run(controller, 60)
    assert all(u == 0.05 for u in inputs)  # pushing as hard as allowed
    assert controller.saturated
    # The switching gain grew in the first step only (before any saturation): anti-windup.
    assert controller.switching_gain == pytest.approx(0.001 * (0.9 - 0.3 - 0.02))
    assert outputs[-1] > 0.5  # the limit is too tight to reach the target in 60 steps
    # Given room again, the same controller gets there.
    controller.u_min, controller.u_max = -1.0, 1.0
    outputs, _ = _run(controller, 60, y0=outputs[-1])
    assert abs(outputs[-1] - 0.3) <= 0.03


def test_per_step_limits_tighten_the_static_ones():
    controller = SlidingModeController(target=0.0, gain=-1.0, u_max=10.0)
    assert controller.step(1.0, u_min=-0.1, u_max=0.1) == 0.1
    assert controller.saturated
    controller.reset()
    # (q s + eps) / |b|, eps already at its cap (1 - q) phi = 0.01
    assert controller.step(1.0, u_max=100.0) == pytest.approx(0.51)


def test_measurement_noise_keeps_the_output_near_the_target():
    controller = SlidingModeController(target=0.3, gain=-1.0, boundary_layer=0.03)
    outputs, _ = _run(controller, 200, noise=0.02, seed=1)
    assert sum(abs(y - 0.3) for y in outputs[50:]) / 150 <= 0.03


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gain": 0.0}, "gain"),
        ({"reaching_rate": 0.0}, "reaching_rate"),
        ({"boundary_layer": 0.0}, "boundary_layer"),
        ({"max_switching_gain": 1.0}, "max_switching_gain"),
        ({"fourier_order": -1}, "fourier_order"),
        ({"fourier_order": True}, "fourier_order"),
        ({"forgetting": 1.5}, "forgetting"),
        ({"u_min": 1.0, "u_max": 0.0}, "u_max"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SlidingModeController(**{"target": 0.0, "gain": -1.0, **kwargs})


def test_a_non_finite_measurement_is_refused():
    controller = SlidingModeController(target=0.0, gain=-1.0)
    with pytest.raises(ValueError, match="finite"):
        controller.step(float("nan"))
