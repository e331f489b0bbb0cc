"""Approximate polar factor (orthogonalisation) of matrices by a quintic Newton–Schulz iteration.

For a matrix ``G = U S Vᵀ`` (thin SVD) the polar factor is ``U Vᵀ``: the matrix with the same
singular vectors and all singular values equal to one. It is the linear minimisation oracle of the
spectral norm and the core of Muon and Scion. :func:`newton_schulz` approximates it with matrix
products only, which is fast on accelerators and needs no SVD.

The iteration is the quintic ``X ← a X + (b A + c A²) X`` with ``A = X Xᵀ`` and the commonly used
coefficients ``(a, b, c) = (3.4445, −4.7750, 2.0315)``. On the singular values it acts as the odd
polynomial ``p(σ) = a σ + b σ³ + c σ⁵``, whose slope at zero is large (``a ≈ 3.4``) so that small
singular values grow fast. The coefficients trade exactness for speed: the iteration does not
converge to ``U Vᵀ``: its limit band is about ``[0.68, 1.14]`` (singular values that enter it stay
in it; during the first steps they may overshoot to ~1.2). More steps therefore bring *small*
singular values into the band (ill-conditioned inputs need more steps); they do not make the band
narrower. After 5 steps all singular values are within ``[0.6, 1.3]`` when the condition number is
below ~100; at condition number 1000 the smallest ones need about 8 steps.
"""

import torch
from torch import Tensor

from ada_modules.errors import InputError

__all__ = ["NS_COEFFICIENTS", "newton_schulz"]

NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""The quintic's coefficients ``(a, b, c)``."""


def newton_schulz(
    g: Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype | None = None
) -> Tensor:
    """Approximate polar factor ``U Vᵀ`` of the last two dimensions of ``g``.

    Leading dimensions are a batch: a stack of same-shape matrices (e.g. the experts of a
    mixture-of-experts layer, ``[E, out, in]``) is orthogonalised in one batched call. Each matrix
    is divided by its Frobenius norm plus ``eps`` (so all singular values start in ``[0, 1]``), and
    a tall matrix is transposed so that the Gram matrix ``X Xᵀ`` is the smaller one. A zero matrix
    gives zeros.

    Args:
        g: Tensor with at least two dimensions.
        steps: Number of quintic iterations (``0`` returns the normalised input).
        eps: Added to the Frobenius norm before dividing.
        dtype: Floating dtype of the computation. ``None`` (default): float32, or float64 for a
            float64 ``g``. ``torch.bfloat16`` is faster on CUDA and is what Muon uses. The result
            is cast back to ``g.dtype``.

    Returns:
        A tensor of ``g``'s shape and dtype with ``g``'s singular vectors and singular values
        roughly in ``[0.68, 1.2]`` (see the module docstring).

    Raises:
        ValueError: If ``g`` has fewer than two dimensions, ``steps`` is negative or ``eps`` is
            not positive.
        TypeError: If ``g`` or ``dtype`` is not a real floating type.

    Examples:
        >>> import torch
        >>> g = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        >>> o = newton_schulz(g)
        >>> o.shape
        torch.Size([8, 4])
        >>> s = torch.linalg.svdvals(o)
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """
    if g.ndim < 2:
        raise InputError(
            f"newton_schulz needs a tensor with >= 2 dimensions, got shape {tuple(g.shape)}"
        )
    if not g.is_floating_point():
        raise InputError(f"newton_schulz needs a real floating tensor, got dtype {g.dtype}")
    if dtype is None:
        dtype = torch.promote_types(g.dtype, torch.float32)
    if not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating dtype, got {dtype}")
    if not isinstance(steps, int) or steps < 0:
        raise InputError(f"steps must be an integer >= 0, got {steps!r}")
    if not eps > 0:
        raise InputError(f"eps must be > 0, got {eps!r}")
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.shape[-2] > g.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)
