"""Spectral token mixing for neural operators: a truncated-Fourier convolution on 1-D or 2-D grids.

``y = irfft(W_k * rfft(x)_k)`` on the lowest ``modes`` frequencies (per axis; in 2-D both signs of
the first axis), zero elsewhere. ``W_k`` is a complex ``dim x dim`` matrix per mode, block-diagonal
with ``num_blocks`` blocks (FNO's spectral convolution with AFNO's block-diagonal channel mixing,
which divides its parameters by ``num_blocks``). Channels come first: ``(batch, dim, *grid)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ada_modules.errors import InputError

__all__ = ["SpectralMixing"]


class SpectralMixing(nn.Module):
    """Truncated-Fourier convolution with per-mode block-diagonal complex weights.

    Args:
        dim: Channels (divisible by ``num_blocks``).
        modes: Frequencies kept per axis: at most ``grid // 2 + 1`` of the input it sees (in 2-D,
            at most ``grid // 2`` on the first axis, whose negative frequencies are kept too).
        spatial_dims: 1 or 2.
        num_blocks: Diagonal blocks of each mode's channel-mixing matrix.

    Raises:
        ValueError: If an argument is out of range, or (in ``forward``) the grid is too small for
            ``modes``.

    Examples:
        >>> mixing = SpectralMixing(dim=8, modes=4, spatial_dims=2, num_blocks=2)
        >>> mixing(torch.randn(3, 8, 16, 16)).shape
        torch.Size([3, 8, 16, 16])
    """

    def __init__(self, dim: int, modes: int, spatial_dims: int = 1, num_blocks: int = 1) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("modes", modes), ("num_blocks", num_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if spatial_dims not in (1, 2):
            raise InputError(f"spatial_dims must be 1 or 2, got {spatial_dims!r}")
        if dim % num_blocks:
            raise InputError(f"dim={dim} must be divisible by num_blocks={num_blocks}")
        self.dim, self.modes, self.spatial_dims, self.num_blocks = (
            dim,
            modes,
            spatial_dims,
            num_blocks,
        )
        block = dim // num_blocks
        mode_shape = (modes,) if spatial_dims == 1 else (2 * modes, modes)
        scale = 1.0 / dim
        # real and imaginary parts: (*modes, blocks, in, out, 2)
        self.weight = nn.Parameter(scale * torch.randn(*mode_shape, num_blocks, block, block, 2))

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, modes={self.modes}, spatial_dims={self.spatial_dims}, "
            f"num_blocks={self.num_blocks}"
        )

    def _mix(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Apply the weights to kept coefficients ``(batch, dim, *modes)`` (complex)."""
        batch, modes = coeffs.shape[0], coeffs.shape[2:]
        x = coeffs.reshape(batch, self.num_blocks, -1, *modes).movedim((1, 2), (-2, -1))
        w = torch.view_as_complex(self.weight.float().contiguous())
        y = torch.einsum("b...ki,...kio->b...ko", x, w)
        return y.movedim((-2, -1), (1, 2)).reshape(batch, self.dim, *modes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = x.shape[2:]
        if len(grid) != self.spatial_dims or x.shape[1] != self.dim:
            raise InputError(
                f"expected (batch, {self.dim}, {self.spatial_dims} grid axes), got {tuple(x.shape)}"
            )
        m = self.modes
        axes = tuple(range(2, 2 + self.spatial_dims))
        coeffs = torch.fft.rfftn(x.float(), dim=axes, norm="ortho")
        if coeffs.shape[-1] < m or (self.spatial_dims == 2 and grid[0] < 2 * m):
            raise InputError(f"modes={m} is more frequencies than the grid {tuple(grid)} resolves")
        out = torch.zeros_like(coeffs)
        if self.spatial_dims == 1:
            out[..., :m] = self._mix(coeffs[..., :m])
        else:
            kept = torch.cat([coeffs[..., :m, :m], coeffs[..., -m:, :m]], dim=-2)
            mixed = self._mix(kept)
            out[..., :m, :m] = mixed[..., :m, :]
            out[..., -m:, :m] = mixed[..., m:, :]
        return torch.fft.irfftn(out, s=grid, dim=axes, norm="ortho").to(x.dtype)
