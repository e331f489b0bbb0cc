"""Neural cellular automata whose perception is a deformable convolution (aNCA).

One learned rule updates every cell of a grid from what it perceives, for as many steps as asked:

.. code-block:: text

    x_t      = [s_t ; inputs]                          the state and the re-injected fixed inputs
    p_t      = DeformConv3x3(x_t; offsets, modulation)  offsets = r * tanh(O(x_t)),
                                                        modulation = 2 * sigmoid(M(x_t))
    s_{t+1}  = s_t + m_t * W2 relu(W1 relu(p_t))        m_t ~ Bernoulli(fire_rate) per cell
    logits   = readout(s_T)                             a 1x1 convolution

``O`` and ``M`` are 3x3 convolutions initialised to zero, so at initialisation every tap samples
its plain neighbour with weight 1 and the cell is the plain NCA with a 3x3 convolutional
perception; ``deformable=False`` is that plain NCA. The fixed inputs (givens, walls, start and end)
are concatenated to the state at every step ("recall"), so the rule never loses them.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ada_modules.errors import InputError

__all__ = ["DeformablePerception", "NeuralCellularAutomaton", "deform_conv2d_reference"]

Backend = Literal["auto", "torchvision", "grid_sample"]


def deform_conv2d_reference(
    inputs: torch.Tensor,
    offset: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    padding: int = 0,
) -> torch.Tensor:
    """Modulated deformable convolution by bilinear sampling (stride 1, one offset group).

    The pure-torch counterpart of ``torchvision.ops.deform_conv2d`` (same argument layout:
    ``offset`` ``(B, 2 K, H_out, W_out)`` holding a ``(dy, dx)`` pair per kernel tap, ``mask``
    ``(B, K, H_out, W_out)``): every tap is sampled by :func:`torch.nn.functional.grid_sample`
    (bilinear, zero outside the grid), scaled by its mask, and the taps are contracted with the
    weight.

    Examples:
        >>> x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
        >>> zero = torch.zeros(1, 18, 5, 5)
        >>> out = deform_conv2d_reference(x, zero, w, padding=1)
        >>> torch.allclose(out, F.conv2d(x, w, padding=1), atol=1e-5)
        True
    """
    batch, channels, height, width = inputs.shape
    out_channels, in_channels, kernel_h, kernel_w = weight.shape
    if in_channels != channels:
        raise InputError(f"weight expects {in_channels} input channels, inputs have {channels}")
    taps = kernel_h * kernel_w
    out_h, out_w = height + 2 * padding - kernel_h + 1, width + 2 * padding - kernel_w + 1
    if offset.shape != (batch, 2 * taps, out_h, out_w):
        raise InputError(
            f"offset must have shape {(batch, 2 * taps, out_h, out_w)}, got {tuple(offset.shape)}"
        )
    if mask is not None and mask.shape != (batch, taps, out_h, out_w):
        raise InputError(
            f"mask must have shape {(batch, taps, out_h, out_w)}, got {tuple(mask.shape)}"
        )
    if bias is not None and bias.shape != (out_channels,):
        raise InputError(f"bias must have shape ({out_channels},), got {tuple(bias.shape)}")
    rows = torch.arange(out_h, dtype=inputs.dtype, device=inputs.device).view(-1, 1)
    cols = torch.arange(out_w, dtype=inputs.dtype, device=inputs.device).view(1, -1)
    offset = offset.view(batch, taps, 2, out_h, out_w)
    sampled = []
    for tap in range(taps):
        i, j = divmod(tap, kernel_w)
        y = rows - padding + i + offset[:, tap, 0]
        x = cols - padding + j + offset[:, tap, 1]
        # align_corners=False puts pixel k's centre at normalised (2k + 1) / size - 1
        grid = torch.stack(((2 * x + 1) / width - 1, (2 * y + 1) / height - 1), dim=-1)
        tap_values = F.grid_sample(
            inputs, grid, mode="bilinear", padding_mode="zeros", align_corners=False
        )
        if mask is not None:
            tap_values = tap_values * mask[:, tap : tap + 1]
        sampled.append(tap_values)
    columns = torch.stack(sampled, dim=2)  # (B, C, K, H, W)
    out = torch.einsum("bckhw,ock->bohw", columns, weight.reshape(out_channels, channels, taps))
    return out if bias is None else out + bias.view(1, -1, 1, 1)


class DeformablePerception(nn.Module):
    """A 3x3 convolution whose taps move: offsets and modulation are predicted from the input.

    Args:
        in_channels: Channels perceived.
        out_channels: Channels of the perception.
        max_offset: Largest displacement of a tap along each axis, in cells (offsets are
            ``max_offset * tanh``).
        modulation: Scale every tap by ``2 * sigmoid`` of a predicted logit (DCNv2); 1 at init.
        deformable: ``False`` gives the plain 3x3 convolution (no offset or modulation layers).
        backend: ``"torchvision"`` (:func:`torchvision.ops.deform_conv2d`), ``"grid_sample"``
            (:func:`deform_conv2d_reference`; on CPU its backward is several times faster than
            torchvision's) or ``"auto"``: torchvision on CUDA tensors, grid_sample otherwise.

    Examples:
        >>> perception = DeformablePerception(4, 8)
        >>> perception(torch.randn(2, 4, 9, 9)).shape
        torch.Size([2, 8, 9, 9])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        max_offset: float = 2.0,
        modulation: bool = True,
        deformable: bool = True,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        if backend not in ("auto", "torchvision", "grid_sample"):
            raise InputError(
                f"backend must be 'auto', 'torchvision' or 'grid_sample', got {backend!r}"
            )
        if isinstance(max_offset, bool) or not isinstance(max_offset, Real):
            raise InputError(f"max_offset must be a finite number > 0, got {max_offset!r}")
        if not 0 < max_offset < math.inf:
            raise InputError(f"max_offset must be a finite number > 0, got {max_offset!r}")
        for name, flag in (("modulation", modulation), ("deformable", deformable)):
            if not isinstance(flag, bool):
                raise InputError(f"{name} must be True or False, got {flag!r}")
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.max_offset, self.backend, self.deformable = float(max_offset), backend, deformable
        self.offsets: nn.Conv2d | None = None
        self.modulation: nn.Conv2d | None = None
        if deformable:
            self.offsets = nn.Conv2d(in_channels, 18, 3, padding=1)
            nn.init.zeros_(self.offsets.weight)
            nn.init.zeros_(self.offsets.bias)
            if modulation:
                self.modulation = nn.Conv2d(in_channels, 9, 3, padding=1)
                nn.init.zeros_(self.modulation.weight)
                nn.init.zeros_(self.modulation.bias)

    def sampling(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The offsets ``(B, 18, H, W)`` (``(dy, dx)`` per tap) and the modulation ``(B, 9, H, W)``."""
        if self.offsets is None:
            raise RuntimeError("a non-deformable perception has no sampling offsets")
        offset = self.max_offset * torch.tanh(self.offsets(x))
        mask = None if self.modulation is None else 2 * torch.sigmoid(self.modulation(x))
        return offset, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.deformable:
            return self.conv(x)
        offset, mask = self.sampling(x)
        if self.backend == "grid_sample" or (self.backend == "auto" and not x.is_cuda):
            return deform_conv2d_reference(
                x, offset, self.conv.weight, self.conv.bias, mask=mask, padding=1
            )
        from torchvision.ops import deform_conv2d  # imported here: torchvision.ops loads slowly

        return deform_conv2d(x, offset, self.conv.weight, self.conv.bias, padding=(1, 1), mask=mask)


class NeuralCellularAutomaton(nn.Module):
    """An NCA with re-injected inputs, stochastic residual updates and a per-cell readout.

    ``forward(inputs, steps)`` starts from a zero state and applies the rule ``steps`` times;
    the same weights run any number of steps on any grid size (more steps for larger grids).

    Args:
        in_channels: Channels of the fixed inputs (re-injected every step).
        out_channels: Per-cell output logits.
        state_channels: Hidden state channels of a cell.
        hidden_channels: Channels of the perception and of the update MLP.
        deformable: Deformable perception (aNCA); ``False`` is the plain NCA.
        max_offset: Largest tap displacement along each axis, in cells.
        modulation: Modulated (DCNv2) taps.
        fire_rate: Probability that a cell updates at a step (1: every cell, every step); also
            at evaluation, so a rule with ``fire_rate < 1`` is stochastic there too.
        backend: Deformable convolution backend, see :class:`DeformablePerception`.

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> nca = NeuralCellularAutomaton(in_channels=3, out_channels=2, state_channels=8,
        ...                               hidden_channels=16)
        >>> nca(torch.randn(2, 3, 11, 11), steps=5).shape
        torch.Size([2, 2, 11, 11])
        >>> nca(torch.randn(2, 3, 11, 11), steps=5, all_steps=True).shape
        torch.Size([5, 2, 2, 11, 11])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        state_channels: int = 32,
        hidden_channels: int = 64,
        deformable: bool = True,
        max_offset: float = 2.0,
        modulation: bool = True,
        fire_rate: float = 1.0,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        for name, value in (
            ("in_channels", in_channels),
            ("out_channels", out_channels),
            ("state_channels", state_channels),
            ("hidden_channels", hidden_channels),
        ):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(fire_rate, bool) or not isinstance(fire_rate, Real):
            raise InputError(f"fire_rate must be a number in (0, 1], got {fire_rate!r}")
        if not 0 < fire_rate <= 1:
            raise InputError(f"fire_rate must be a number in (0, 1], got {fire_rate!r}")
        in_channels, out_channels, state_channels, hidden_channels = (
            int(c) for c in (in_channels, out_channels, state_channels, hidden_channels)
        )
        self.in_channels, self.state_channels = in_channels, state_channels
        self.fire_rate = float(fire_rate)
        self.perception = DeformablePerception(
            state_channels + in_channels,
            hidden_channels,
            max_offset=max_offset,
            modulation=modulation,
            deformable=deformable,
            backend=backend,
        )
        self.update = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(hidden_channels, hidden_channels, 1),
            nn.ReLU(),
            nn.Conv2d(hidden_channels, state_channels, 1),
        )
        self.readout = nn.Conv2d(state_channels, out_channels, 1)

    def step(self, state: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """One application of the rule."""
        delta = self.update(self.perception(torch.cat((state, inputs), dim=1)))
        if self.fire_rate < 1:
            fire = torch.rand_like(state[:, :1]) < self.fire_rate
            delta = delta * fire
        return state + delta

    def forward(self, inputs: torch.Tensor, steps: int, all_steps: bool = False) -> torch.Tensor:
        """Logits ``(B, out, H, W)`` after ``steps`` steps; ``(steps, B, out, H, W)`` if ``all_steps``."""
        if inputs.dim() != 4 or inputs.shape[1] != self.in_channels:
            raise InputError(
                f"inputs must have shape (batch, {self.in_channels}, height, width), got "
                f"{tuple(inputs.shape)}"
            )
        if isinstance(steps, bool) or not isinstance(steps, Integral) or steps < 1:
            raise InputError(f"steps must be an integer >= 1, got {steps!r}")
        state = inputs.new_zeros(inputs.shape[0], self.state_channels, *inputs.shape[2:])
        outputs = []
        for _ in range(steps):
            state = self.step(state, inputs)
            if all_steps:
                outputs.append(self.readout(state))
        return torch.stack(outputs) if all_steps else self.readout(state)
