"""The Fréchet distance between two sets of features (FID's formula, on any feature extractor)."""

import torch

from ada_modules.errors import InputError

__all__ = ["frechet_distance"]


def _psd_eigenvalues(values: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of a symmetric PSD matrix with rounding noise (below ``n * eps * max``) zeroed."""
    tolerance = values.abs().max() * values.numel() * torch.finfo(values.dtype).eps
    return torch.where(values > tolerance, values, torch.zeros_like(values))


def _sqrt_psd(matrix: torch.Tensor) -> torch.Tensor:
    """Square root of a symmetric positive semi-definite matrix."""
    values, vectors = torch.linalg.eigh(matrix)
    return (vectors * _psd_eigenvalues(values).sqrt()) @ vectors.T


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to the rows of ``a`` and of ``b``.

    ``FD = |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2)`` with the means ``mu``
    and the unbiased covariances ``S`` (``n - 1``) of the two sets, computed in float64 with
    symmetric eigendecompositions (eigenvalues below ``F * eps * largest``, i.e. rounding noise
    and tiny negative values, are set to 0), so it is real and ``>= 0`` up to rounding, and about
    0 for a set against itself even when ``n <= F`` (rank-deficient covariance). With the penultimate features of
    :class:`~ada_modules.models.shapes_judge.ShapesJudge` it plays the role of FID.

    Args:
        a: Features of shape ``(n_a, F)``, ``n_a >= 2``.
        b: Features of shape ``(n_b, F)``, ``n_b >= 2``, same ``F``.

    Raises:
        InputError: If an input is not a 2-D tensor with at least 2 rows, the feature
            dimensions differ, or a value is not finite.

    Examples:
        >>> x = torch.randn(500, 3, generator=torch.Generator().manual_seed(0))
        >>> round(frechet_distance(x, x), 6)
        0.0
        >>> round(frechet_distance(x, x + 2.0), 6)  # a mean shift of 2 in 3 dimensions
        12.0
    """
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, torch.Tensor) or value.ndim != 2:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(f"{name} must be a 2-D tensor (samples, features), got {shape}")
        if value.shape[0] < 2:
            raise InputError(f"{name} needs at least 2 samples, got {value.shape[0]}")
    if a.shape[1] != b.shape[1]:
        raise InputError(
            f"a and b must have the same feature dimension, got {a.shape[1]} and {b.shape[1]}"
        )
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    for name, value in (("a", a), ("b", b)):
        if not torch.isfinite(value).all():
            raise InputError(f"{name} holds non-finite values")
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = torch.cov(a.T).reshape(a.shape[1], -1), torch.cov(b.T).reshape(b.shape[1], -1)
    root_a = _sqrt_psd(cov_a)
    middle = root_a @ cov_b @ root_a
    middle = (middle + middle.T) / 2
    cross = _psd_eigenvalues(torch.linalg.eigvalsh(middle)).sqrt().sum()
    value = (mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * cross
    return float(value)
