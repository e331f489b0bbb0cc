"""Convergence-rate acceptance tests: fitted log–log slopes of ``f − f*`` on a smooth quadratic.

Problem: :func:`~ada_modules.optim.convex_problems.spectral_quadratic` with ``d = 200``
(eigenvalues ``i⁻²``, ``L = 1``, ``μ = 1/d² = 2.5e-5``, initial error spread evenly over
``log λ``), deterministic gradients, slope fitted on log-spaced ``k ∈ [100, 1000]``.

Where the thresholds come from (theory, not tuning):

* **GD, step 1/L.** Exactly ``f(x_k) − f* = ½ Σ i⁻³ (1 − i⁻²)^{2k} ≈ (e^{−2k/d²} − e^{−2k}) / (8k)``,
  so the slope is ``−1`` bent by the factor ``e^{−2k/d²}`` (``e^{−0.05}`` at ``k = 1000``):
  ``≈ −1.02``. The band ``[−1.3, −0.7]`` is ``−1 ± 0.3``.
* **AcceleGrad, ``D = ‖x₀ − x*‖`` (no ``L``).** Its theorem bounds ``f(ȳ_k) − f* ≤ C/k²`` (``C``
  carries ``L D²`` and a log factor). Conversely, after ``k`` gradient steps any first-order method
  leaves the components with ``k²λ ≪ 1`` nearly untouched (a degree-``k`` polynomial ``p`` with
  ``p(0) = 1`` has ``|p'(0)| ≲ k²/L``); with the even spread over ``log λ`` these carry
  ``≈ 1/(4k²)``. Over a window where both hold the slope is ``−2`` up to ``log(C/c)/log(k₂/k₁)``;
  past ``k ≈ d = 1/√μ`` that untouched mass is exhausted and an accelerated method without restart
  falls faster (``≈ k⁻³``), so the slope over ``[100, 1000]`` lies between ``−3`` and ``−2``.
  ``≤ −1.7`` allows a constant ratio up to ``10^{0.3} ≈ 2`` over the decade, and stays far from
  GD's ``−1``: failing it means the acceleration is lost, not noise. It must hold for ``D`` off by
  a factor 4 either way too (the method is only told ``D``; the theorem's ``C`` grows with ``D``
  mis-specification but the exponent does not change).
* **AcceleGrad# with ``anchor="scalar", geometry="sharp", norm="euclidean"``** is AcceleGrad's
  update (``g^# = g``), so its gaps and slope must match AcceleGrad's.
"""

import pytest
import torch

from ada_modules.optim.accelegrad import AcceleGrad
from ada_modules.optim.accelegrad_sharp import AcceleGradSharp
from ada_modules.optim.convex_problems import (
    SpectralQuadratic,
    log_spaced_iterations,
    loglog_slope,
    spectral_quadratic,
    trace_gaps,
)

DIM = 200
FIRST, LAST = 100, 1000
CHECKPOINTS = log_spaced_iterations(LAST, 30)


@pytest.fixture(scope="module")
def problem() -> SpectralQuadratic:
    return spectral_quadratic(DIM, seed=0)


def _gd_gaps(problem: SpectralQuadratic) -> list[float]:
    x = problem.x0.clone()
    opt = torch.optim.SGD([x], lr=1 / problem.smoothness)

    def step() -> None:
        x.grad = problem.grad(x)
        opt.step()

    return trace_gaps(step, lambda: problem.gap(x), CHECKPOINTS)


def _average_output_gaps(
    problem: SpectralQuadratic, opt_factory: type[AcceleGrad] | type[AcceleGradSharp], **kwargs
) -> list[float]:
    x = problem.x0.clone().requires_grad_(True)
    opt = opt_factory([x], **kwargs)

    def step() -> None:
        x.grad = problem.grad(x.detach())
        opt.step()

    def gap() -> float:
        swap = opt.swap_output("average") if isinstance(opt, AcceleGrad) else opt.swap_output()
        with swap:
            return problem.gap(x.detach())

    return trace_gaps(step, gap, CHECKPOINTS)


def test_gradient_descent_slope_is_minus_one(problem):
    slope = loglog_slope(CHECKPOINTS, _gd_gaps(problem), FIRST, LAST)
    assert -1.3 <= slope <= -0.7, slope


@pytest.mark.parametrize("d_factor", [0.25, 1.0, 4.0])
def test_accelegrad_slope_is_accelerated_without_knowing_l(problem, d_factor):
    gaps = _average_output_gaps(problem, AcceleGrad, lr=d_factor * problem.distance)
    slope = loglog_slope(CHECKPOINTS, gaps, FIRST, LAST)
    assert slope <= -1.7, slope
    gd_final = _gd_gaps(problem)[-1]
    assert gaps[-1] < 0.1 * gd_final, (gaps[-1], gd_final)


def test_accelegrad_sharp_in_the_accelegrad_setting_has_the_same_slope(problem):
    lr = problem.distance
    reference = _average_output_gaps(problem, AcceleGrad, lr=lr)
    sharp = _average_output_gaps(
        problem,
        AcceleGradSharp,
        lr=lr,
        anchor="scalar",
        geometry="sharp",
        norm="euclidean",
        output="average",
    )
    slope_ref = loglog_slope(CHECKPOINTS, reference, FIRST, LAST)
    slope_sharp = loglog_slope(CHECKPOINTS, sharp, FIRST, LAST)
    assert slope_sharp <= -1.7, slope_sharp
    assert abs(slope_sharp - slope_ref) < 1e-3, (slope_sharp, slope_ref)
    torch.testing.assert_close(torch.tensor(sharp), torch.tensor(reference), rtol=1e-6, atol=0)
