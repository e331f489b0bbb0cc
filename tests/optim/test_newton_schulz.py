"""Newton–Schulz orthogonalisation against the SVD's polar factor."""

import pytest
import torch

from ada_modules.optim.newton_schulz import NS_COEFFICIENTS, newton_schulz


def _matrix(rows: int, cols: int, cond: float, seed: int = 0) -> torch.Tensor:
    """Random matrix with singular values log-spaced in [1/cond, 1]."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64))
    k = min(rows, cols)
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return (u[:, :k] * s) @ v[:, :k].T


@pytest.mark.parametrize("shape", [(16, 16), (32, 8), (8, 32), (1, 5), (5, 1)])
def test_singular_values_in_band_and_vectors_kept(shape: tuple[int, int]) -> None:
    g = _matrix(*shape, cond=20.0)
    out = newton_schulz(g)
    assert out.shape == g.shape and out.dtype == g.dtype
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    sv = torch.linalg.svdvals(out)
    assert sv.min() >= 0.6 and sv.max() <= 1.3
    # Same singular vectors: U^T NS(g) V is diagonal with the NS singular values.
    inner = u.T @ out @ vh.T
    assert torch.allclose(inner, torch.diag(torch.diagonal(inner)), atol=1e-5)
    polar = u @ vh
    cosine = (out * polar).sum() / (out.norm() * polar.norm())
    assert cosine > 0.98


def test_float32_default_close_to_float64() -> None:
    g = _matrix(24, 12, cond=10.0)
    assert torch.allclose(newton_schulz(g.float()).double(), newton_schulz(g), atol=1e-4)


def test_more_steps_bring_small_singular_values_into_the_band() -> None:
    g = _matrix(32, 32, cond=1000.0)
    assert torch.linalg.svdvals(newton_schulz(g, steps=5)).min() < 0.6
    sv = torch.linalg.svdvals(newton_schulz(g, steps=10))
    assert sv.min() >= 0.68 - 1e-3 and sv.max() <= 1.14


def test_singular_values_follow_the_quintic() -> None:
    a, b, c = NS_COEFFICIENTS
    g = torch.diag(torch.tensor([3.0, 4.0], dtype=torch.float64))
    sigma = torch.tensor([3.0, 4.0], dtype=torch.float64) / 5.0
    for _ in range(3):
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    assert torch.allclose(torch.diagonal(newton_schulz(g, steps=3, eps=1e-300)), sigma)


def test_batched_equals_per_matrix() -> None:
    stack = torch.stack([_matrix(12, 20, cond=5.0, seed=i) for i in range(4)]).float()
    batched = newton_schulz(stack)
    single = torch.stack([newton_schulz(m) for m in stack])
    assert torch.allclose(batched, single, atol=1e-6)
    deep = newton_schulz(stack.reshape(2, 2, 12, 20))
    assert torch.allclose(deep.reshape(4, 12, 20), batched, atol=1e-6)


def test_zero_matrix_gives_zeros() -> None:
    out = newton_schulz(torch.zeros(3, 6, 4))
    assert torch.equal(out, torch.zeros(3, 6, 4))


def test_bfloat16_input_keeps_dtype() -> None:
    g = _matrix(8, 8, cond=4.0).to(torch.bfloat16)
    out = newton_schulz(g)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"g": torch.zeros(4)}, ValueError, r"shape \(4,\)"),
        ({"g": torch.zeros(2, 2), "steps": -1}, ValueError, "steps"),
        ({"g": torch.zeros(2, 2), "eps": 0.0}, ValueError, "eps"),
        ({"g": torch.zeros(2, 2, dtype=torch.int64)}, TypeError, "int64"),
        ({"g": torch.zeros(2, 2, dtype=torch.complex64)}, TypeError, "complex64"),
        ({"g": torch.zeros(2, 2), "dtype": torch.int32}, TypeError, "int32"),
    ],
)
def test_bad_input(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        newton_schulz(**kwargs)
