"""AHPA's timestep router: weights over alignment levels as a function of the noise level.

The router maps a noise level ``t`` in ``[0, 1]`` (flow-matching convention: ``0`` is the clean
sample, ``1`` pure noise; for DDPM pass ``timestep / num_train_timesteps``) to a point of the
simplex over ``L`` levels. Levels are ordered from fine (early encoder blocks) to coarse (the mid
block). :func:`coarse_to_fine_prior` is the fixed schedule the paper's intuition suggests: its mass
sits on the coarse levels at high noise and moves to the fine ones as the noise decreases.
"""

import math

import torch
from torch import nn

from ada_modules.errors import InputError

__all__ = ["TimestepRouter", "coarse_to_fine_prior", "timestep_embedding"]


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal embedding of noise levels ``t`` in ``[0, 1]`` (scaled by 1000, as in DiT).

    Example:
        >>> timestep_embedding(torch.tensor([0.0, 0.5]), 8).shape
        torch.Size([2, 8])
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    angles = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def coarse_to_fine_prior(t: torch.Tensor, num_levels: int, sigma: float = 0.75) -> torch.Tensor:
    """Fixed schedule ``w_l(t) ∝ exp(-(l - t (L-1))^2 / sigma^2)`` over levels ordered fine to coarse.

    At ``t = 1`` (pure noise) the mass is on the last, coarsest level; at ``t = 0`` on the first.

    Example:
        >>> w = coarse_to_fine_prior(torch.tensor([0.0, 1.0]), 3)
        >>> w.argmax(dim=-1).tolist(), torch.allclose(w.sum(-1), torch.ones(2))
        ([0, 2], True)
    """
    if num_levels < 1:
        raise InputError(f"num_levels must be >= 1, got {num_levels}")
    if not sigma > 0:
        raise InputError(f"sigma must be > 0, got {sigma}")
    levels = torch.arange(num_levels, device=t.device, dtype=torch.float32)
    centre = t.float()[:, None] * (num_levels - 1)
    return torch.softmax(-((levels[None] - centre) ** 2) / sigma**2, dim=-1)


class TimestepRouter(nn.Module):
    """Softmax over ``num_levels`` from a sinusoidal embedding of ``t`` through a small MLP.

    The last layer starts at zero, so every level has weight ``1/L`` at initialisation.
    ``temperature`` divides the logits (lower: sharper weights).

    Args:
        num_levels: Number of alignment levels ``L``.
        embed_dim: Width of the sinusoidal embedding (even).
        hidden_dim: Width of the MLP's hidden layer.
        temperature: Softmax temperature, ``> 0``.

    Example:
        >>> router = TimestepRouter(3)
        >>> router(torch.tensor([0.1, 0.9]))
        tensor([[0.3333, 0.3333, 0.3333],
                [0.3333, 0.3333, 0.3333]], grad_fn=<SoftmaxBackward0>)
    """

    def __init__(
        self, num_levels: int, embed_dim: int = 64, hidden_dim: int = 64, temperature: float = 1.0
    ) -> None:
        super().__init__()
        if num_levels < 1:
            raise InputError(f"num_levels must be >= 1, got {num_levels}")
        if embed_dim < 2 or embed_dim % 2:
            raise InputError(f"embed_dim must be an even int >= 2, got {embed_dim}")
        if not temperature > 0:
            raise InputError(f"temperature must be > 0, got {temperature}")
        self.embed_dim = embed_dim
        self.temperature = temperature
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, num_levels)
        )
        nn.init.zeros_(self.mlp[-1].weight)
        nn.init.zeros_(self.mlp[-1].bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """Weights ``(batch, num_levels)`` on the simplex for noise levels ``t`` of shape ``(batch,)``.

        The embedding is cast to the MLP's dtype, so the router also runs in half precision.
        """
        embedding = timestep_embedding(t, self.embed_dim).to(self.mlp[0].weight.dtype)
        logits = self.mlp(embedding)
        return torch.softmax(logits / self.temperature, dim=-1)
