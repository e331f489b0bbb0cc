"""Convex test problems with a known optimum, and the log–log rate fit used to read them.

Shared by ``bench/accelegrad_sharp.py`` and ``tests/optim/test_convergence_rates.py``: both measure
how fast an optimizer's suboptimality ``f(x_k) − f*`` falls with the iteration count ``k``, as the
slope of ``log(f − f*)`` against ``log k``.

The quadratic :func:`spectral_quadratic` is built so that the textbook rates show up as slopes:

* ``A`` has eigenvalues ``λ_i = i⁻²`` (``i = 1..d``, so ``L = 1`` and ``μ = d⁻²``), and the initial
  error ``x₀ − x* `` has squared component ``1/i`` along the ``i``-th eigenvector. The error is then
  spread evenly over ``log λ`` (``Σ_{λ_i ∈ [a, 2a]} c_i² ≈ ½ log 2`` for every octave), which is the
  spectral shape of the worst case of first-order methods on smooth convex functions.
* Gradient descent with step ``1/L`` leaves ``f(x_k) − f* = ½ Σ λ_i c_i² (1 − λ_i)^{2k}
  ≈ (e^{−2k/d²} − e^{−2k}) / (8k)``: slope ``−1`` while ``k ≪ d²``.
* An accelerated method damps the component at ``λ`` only once ``k√λ ≳ 1``; the components with
  ``λ ≲ k⁻²`` are still untouched and carry ``≈ ½ Σ_{λ_i ≤ k⁻²} λ_i c_i² ≈ 1/(4k²)``: slope ``−2``
  while ``k ≲ d``. Past ``k ≈ d = 1/√μ`` that mass is gone (the problem starts to look strongly
  convex to an accelerated method), so the measured slope can only get steeper than ``−2``.

Everything is float64 so that gaps down to ``1e-12`` are resolved; the gap is computed as
``½ (x − x*)ᵀ A (x − x*)``, which has no cancellation.

Example:
    Gradient descent with step ``1/L`` on ``d = 100``, slope fitted over ``k ∈ [30, 300]``:

    >>> problem = spectral_quadratic(100, seed=0)
    >>> x = problem.x0.clone()
    >>> def gd_step():
    ...     x.sub_(problem.grad(x), alpha=1 / problem.smoothness)
    >>> ks = log_spaced_iterations(300, num=20)
    >>> gaps = trace_gaps(gd_step, lambda: problem.gap(x), ks)
    >>> round(loglog_slope(ks, gaps, first=30, last=300), 1)
    -1.0
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ada_modules.errors import InputError

__all__ = [
    "SpectralQuadratic",
    "log_spaced_iterations",
    "loglog_slope",
    "spectral_quadratic",
    "trace_gaps",
]


@dataclass(frozen=True)
class SpectralQuadratic:
    """``f(x) = ½ xᵀAx − bᵀx`` with ``A`` symmetric positive definite and ``b = A x*``.

    Attributes:
        matrix: ``A``, shape ``[d, d]``.
        eigenvalues: Eigenvalues of ``A`` in decreasing order, shape ``[d]``.
        x_star: The minimiser ``x*``, shape ``[d]``.
        x0: The starting point (zeros), shape ``[d]``.
    """

    matrix: Tensor
    eigenvalues: Tensor
    x_star: Tensor
    x0: Tensor

    @property
    def smoothness(self) -> float:
        """``L``, the largest eigenvalue of ``A``."""
        return float(self.eigenvalues.max())

    @property
    def distance(self) -> float:
        """``‖x₀ − x*‖``, the distance an optimizer must travel."""
        return float(torch.linalg.vector_norm(self.x0 - self.x_star))

    def grad(self, x: Tensor) -> Tensor:
        """``∇f(x) = A (x − x*)``."""
        return self.matrix @ (x - self.x_star)

    def gap(self, x: Tensor) -> float:
        """``f(x) − f* = ½ (x − x*)ᵀ A (x − x*)``."""
        error = x - self.x_star
        return 0.5 * float(error @ (self.matrix @ error))


def spectral_quadratic(
    dim: int, seed: int = 0, rotate: bool = True, dtype: torch.dtype = torch.float64
) -> SpectralQuadratic:
    """The quadratic described in the module docstring, deterministic from ``seed``.

    Args:
        dim: Dimension ``d``.
        seed: Seeds the signs of the error components and, with ``rotate``, the eigenvectors.
        rotate: Use a random orthogonal eigenbasis (QR of a Gaussian matrix). Without it ``A`` is
            diagonal, which favours per-coordinate (diagonal) preconditioners.
        dtype: Floating dtype of every tensor.

    Raises:
        ValueError: If ``dim < 2``.
    """
    if dim < 2:
        raise InputError(f"dim must be at least 2, got {dim}")
    gen = torch.Generator().manual_seed(seed)
    index = torch.arange(1, dim + 1, dtype=dtype)
    eigenvalues = index.pow(-2)
    signs = torch.randint(0, 2, (dim,), generator=gen).to(dtype).mul(2).sub(1)
    coefficients = signs * index.rsqrt()
    if rotate:
        basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=dtype))
    else:
        basis = torch.eye(dim, dtype=dtype)
    matrix = (basis * eigenvalues) @ basis.T
    matrix = 0.5 * (matrix + matrix.T)
    return SpectralQuadratic(
        matrix=matrix,
        eigenvalues=eigenvalues,
        x_star=basis @ coefficients,
        x0=torch.zeros(dim, dtype=dtype),
    )


def log_spaced_iterations(last: int, num: int = 40, first: int = 1) -> list[int]:
    """About ``num`` distinct integers from ``first`` to ``last``, evenly spaced in ``log k``.

    Examples:
        >>> log_spaced_iterations(1000, num=4)
        [1, 10, 100, 1000]
    """
    if not 1 <= first <= last:
        raise InputError(f"need 1 <= first <= last, got first={first}, last={last}")
    if num < 2 or first == last:
        return [last]
    ratio = math.log(last / first) / (num - 1)
    return sorted({round(first * math.exp(ratio * j)) for j in range(num)})


def loglog_slope(iterations: Sequence[int], gaps: Sequence[float], first: int, last: int) -> float:
    """Least-squares slope of ``log gap`` on ``log k`` over the points with ``first ≤ k ≤ last``.

    Points with a non-positive or non-finite gap are dropped (a gap that reached exactly zero
    carries no rate information).

    Raises:
        ValueError: If fewer than two usable points remain.
    """
    points = [
        (math.log(k), math.log(g))
        for k, g in zip(iterations, gaps, strict=True)
        if first <= k <= last and math.isfinite(g) and g > 0
    ]
    if len(points) < 2:
        raise InputError(f"need at least two positive gaps in [{first}, {last}] to fit a slope")
    mean_x = sum(p[0] for p in points) / len(points)
    mean_y = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mean_x) ** 2 for p in points)
    sxy = sum((p[0] - mean_x) * (p[1] - mean_y) for p in points)
    return sxy / sxx


def trace_gaps(
    step: Callable[[], None], gap: Callable[[], float], checkpoints: Sequence[int]
) -> list[float]:
    """Call ``step`` up to ``max(checkpoints)`` times and record ``gap()`` after each checkpoint.

    Args:
        step: Performs one iteration of the method (gradient, update).
        gap: Suboptimality of the point the method currently reports (last iterate, average...).
        checkpoints: Increasing positive iteration counts, e.g. from :func:`log_spaced_iterations`.

    Returns:
        One gap per checkpoint, in order.
    """
    gaps: list[float] = []
    done = 0
    for k in checkpoints:
        for _ in range(k - done):
            step()
        done = k
        gaps.append(gap())
    return gaps
