"""Instance-aware steering strength: a scaling rule from the MCR and a small learnable module."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ada_modules.errors import InputError
from ada_modules.steering._checks import check_real

__all__ = ["StrengthPredictor", "mcr_scaled_strength"]


def mcr_scaled_strength(target_mcr: Tensor, max_strength: float, threshold: float = 0.5) -> Tensor:
    """AMPS's scaling rule: ``max_strength * relu(threshold - MCR) / threshold`` per row.

    ``target_mcr`` is the contribution ratio of the modality to steer towards (``MCR_v`` to steer
    towards the image, ``1 - MCR_v`` towards the text). Rows where that modality already has at
    least ``threshold`` of the answer get no steering; the less it contributes, the stronger
    the push, up to ``max_strength`` (a finite number >= 0) at 0.

    Example:
        >>> mcr_scaled_strength(torch.tensor([0.0, 0.25, 0.5, 0.9]), max_strength=8.0).tolist()
        [8.0, 4.0, 0.0, 0.0]
    """
    max_strength = check_real(
        "max_strength", max_strength, "a finite number >= 0", lambda x: 0 <= x < math.inf
    )
    threshold = check_real("threshold", threshold, "in (0, 1]", lambda x: 0 < x <= 1)
    _check_mcr(target_mcr)
    return max_strength * torch.relu(threshold - target_mcr) / threshold


def _check_mcr(target_mcr: object, rows: int | None = None) -> None:
    """``target_mcr`` is a ``(rows,)`` tensor (any length if ``rows`` is None) in ``[0, 1]``."""
    if not isinstance(target_mcr, Tensor):
        raise InputError(f"target_mcr must be a tensor, got {type(target_mcr).__name__}")
    if rows is not None and target_mcr.shape != (rows,):
        raise InputError(f"target_mcr must be (batch,) = ({rows},), got {tuple(target_mcr.shape)}")
    if not ((target_mcr >= 0) & (target_mcr <= 1)).all():
        raise InputError("target_mcr must lie in [0, 1] (it holds NaN or values outside)")


class StrengthPredictor(nn.Module):
    """A learnable per-instance strength ``max_strength * sigmoid(MLP([LayerNorm(h); MCR]))``.

    ``h`` is the steered layer's hidden state at the prompt's last position and ``MCR`` the
    contribution ratio of the modality to steer towards. :class:`~ada_modules.models.
    ModalitySteeringModule` trains it with a preference loss and a collapse regulariser.

    Args:
        hidden_size: Width of ``h``.
        width: Width of the MLP's hidden layer.
        max_strength: Upper bound of the output, a finite number > 0 (a sigmoid keeps the
            output bounded and differentiable).
        init_strength: The output at initialisation for every input (the last layer starts at
            zero weight), in ``(0, max_strength)``.

    Example:
        >>> predictor = StrengthPredictor(hidden_size=16, max_strength=8.0, init_strength=1.0)
        >>> alpha = predictor(torch.randn(3, 16), torch.tensor([0.1, 0.5, 0.9]))
        >>> tuple(alpha.shape), torch.allclose(alpha, torch.ones(3), atol=1e-5)
        ((3,), True)
    """

    def __init__(
        self,
        hidden_size: int,
        width: int = 32,
        max_strength: float = 8.0,
        init_strength: float = 1.0,
    ) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("width", width)):
            if not (isinstance(value, int) and value >= 1):
                raise InputError(f"{name} must be an int >= 1, got {value!r}")
        max_strength = check_real(
            "max_strength", max_strength, "a finite number > 0", lambda x: 0 < x < math.inf
        )
        init_strength = check_real(
            "init_strength",
            init_strength,
            f"in (0, max_strength={max_strength})",
            lambda x: 0 < x < max_strength,
        )
        self.max_strength = max_strength
        self.norm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size + 1, width), nn.GELU(), nn.Linear(width, 1))
        nn.init.zeros_(self.mlp[-1].weight)
        fraction = init_strength / max_strength  # sigmoid(bias) = fraction
        nn.init.constant_(self.mlp[-1].bias, float(torch.logit(torch.tensor(fraction))))

    def forward(self, hidden: Tensor, target_mcr: Tensor) -> Tensor:
        """``(batch,)`` strengths from ``hidden`` ``(batch, hidden_size)`` and ``target_mcr``
        ``(batch,)`` in ``[0, 1]``, computed and returned in the parameters' dtype (inputs of
        another dtype are cast, e.g. under Lightning's ``precision="bf16-true"``)."""
        size = self.norm.normalized_shape[0]
        if not isinstance(hidden, Tensor):
            raise InputError(f"hidden must be a tensor, got {type(hidden).__name__}")
        if hidden.dim() != 2 or hidden.shape[1] != size:
            raise InputError(f"hidden must be (batch, {size}), got {tuple(hidden.shape)}")
        _check_mcr(target_mcr, rows=hidden.shape[0])
        dtype = self.norm.weight.dtype
        features = torch.cat([self.norm(hidden.to(dtype)), target_mcr.to(dtype).unsqueeze(-1)], -1)
        return self.max_strength * torch.sigmoid(self.mlp(features).squeeze(-1))
