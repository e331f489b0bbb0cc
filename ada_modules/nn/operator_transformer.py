"""A DPOT-style operator transformer on 1-D or 2-D grids, with a selectable residual type.

Maps the last ``history`` frames of a field to the next frame:

1. (optional) reversible instance normalisation: each sample's channels are standardised over its
   history and grid, and the prediction is mapped back;
2. patch embedding: the history frames and the grid coordinates, stacked as channels, go through
   ``Conv(kernel=stride=patch_size) -> GELU -> Conv1x1`` to ``width`` channels, plus a learned
   position embedding per patch (the stacking is a learned linear aggregation over time);
3. ``depth`` blocks of two sub-layers, ``GroupNorm -> SpectralMixing`` and
   ``GroupNorm -> Conv1x1 -> GELU -> Conv1x1``, each inside a residual of type ``residual``:
   ``"residual"`` (``x + F(x)``), ``"hyper"`` (Hyper-Connections) or ``"mhc"`` (the
   manifold-constrained multi-stream residual of AOT-POT), see
   :class:`~ada_modules.nn.multistream.MultiStreamStack`;
4. head: ``ConvTranspose(kernel=stride=patch_size) -> GELU -> Conv1x1`` to the channels, added to
   the last input frame (the network predicts the change);
5. (optional) a PDE-type classifier on the spatial mean of the trunk's output.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.nn.multistream import MultiStreamStack
from ada_modules.nn.spectral_mixing import SpectralMixing

__all__ = ["OperatorTransformer", "RESIDUALS"]

RESIDUALS = ("residual", "hyper", "mhc")
"""Residual types of the trunk."""
Residual = Literal["residual", "hyper", "mhc"]
_STREAM_DEFAULTS: dict[str, Any] = {"n_streams": 4}


class OperatorTransformer(nn.Module):
    """Next-frame operator network (see the module docstring).

    Args:
        spatial_dims: 1 or 2.
        grid: Points per axis of the input (divisible by ``patch_size``).
        channels: Field channels.
        history: Input frames.
        patch_size: Side of a patch.
        width: Hidden channels (divisible by ``groups`` and ``spectral_blocks``).
        depth: Blocks (each two sub-layers).
        mlp_ratio: Hidden channels of the MLP sub-layer as a multiple of ``width``.
        modes: Fourier modes kept per axis by the spectral sub-layer, on the patch grid.
        spectral_blocks: Diagonal blocks of the spectral channel mixing.
        groups: GroupNorm groups.
        residual: ``"residual"``, ``"hyper"`` or ``"mhc"``.
        streams: Arguments of :class:`~ada_modules.nn.multistream.MultiStreamStack` for
            ``"hyper"``/``"mhc"`` (``n_streams`` (default 4), ``mixing``, ``dynamic``,
            ``dynamic_input``, ``sinkhorn_iters``, ...).
        normalize: Reversible instance normalisation.
        num_classes: Outputs of the PDE-type head (0: no head).

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> net = OperatorTransformer(grid=32, history=4, patch_size=4, width=16, depth=2,
        ...                           modes=4, residual="mhc")
        >>> pred, logits = net(torch.randn(2, 4, 1, 32))
        >>> pred.shape, logits
        (torch.Size([2, 1, 32]), None)
    """

    def __init__(
        self,
        spatial_dims: int = 1,
        grid: int = 64,
        channels: int = 1,
        history: int = 4,
        patch_size: int = 4,
        width: int = 64,
        depth: int = 4,
        mlp_ratio: int = 2,
        modes: int = 8,
        spectral_blocks: int = 4,
        groups: int = 8,
        residual: Residual = "residual",
        streams: dict[str, Any] | None = None,
        normalize: bool = True,
        num_classes: int = 0,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("grid", grid, 2),
            ("channels", channels, 1),
            ("history", history, 1),
            ("patch_size", patch_size, 1),
            ("width", width, 1),
            ("depth", depth, 1),
            ("mlp_ratio", mlp_ratio, 1),
            ("groups", groups, 1),
            ("modes", modes, 1),
            ("num_classes", num_classes, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        if spatial_dims not in (1, 2):
            raise InputError(f"spatial_dims must be 1 or 2, got {spatial_dims!r}")
        if grid % patch_size:
            raise InputError(f"grid={grid} is not divisible by patch_size={patch_size}")
        tokens = grid // patch_size
        if modes > tokens // 2 + 1 or (spatial_dims == 2 and modes > tokens // 2):
            raise InputError(
                f"modes={modes} is more Fourier modes than the {tokens}-patch grid resolves "
                f"(grid={grid} / patch_size={patch_size}; at most {tokens // 2 + 2 - spatial_dims})"
            )
        if width % groups:
            raise InputError(f"width={width} is not divisible by groups={groups}")
        if residual not in RESIDUALS:
            raise InputError(f"residual must be one of {RESIDUALS}, got {residual!r}")
        if streams and residual == "residual":
            raise InputError("streams is set but residual='residual' has no streams")
        for key in ("dim", "channel_first", "disable"):
            if key in (streams or {}):
                raise InputError(
                    f"streams sets {key!r}, which the operator transformer sets itself (width "
                    "and channel-first tokens); leave it out"
                )
        if (streams or {}).get("kind", residual) != residual:
            raise InputError(
                f"streams kind={streams['kind']!r} disagrees with residual={residual!r}; the "
                "kind is set by residual"
            )
        self.spatial_dims, self.grid, self.channels = spatial_dims, grid, channels
        self.history, self.normalize, self.residual = history, normalize, residual
        conv = nn.Conv1d if spatial_dims == 1 else nn.Conv2d
        deconv = nn.ConvTranspose1d if spatial_dims == 1 else nn.ConvTranspose2d
        patches = (grid // patch_size,) * spatial_dims
        in_channels = history * channels + spatial_dims
        self.embed = nn.Sequential(
            conv(in_channels, width, patch_size, stride=patch_size),
            nn.GELU(),
            conv(width, width, 1),
        )
        self.pos_embed = nn.Parameter(torch.zeros(1, width, *patches))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        branches: list[nn.Module] = []
        for _ in range(depth):
            branches.append(
                nn.Sequential(
                    nn.GroupNorm(groups, width),
                    SpectralMixing(width, modes, spatial_dims, spectral_blocks),
                )
            )
            branches.append(
                nn.Sequential(
                    nn.GroupNorm(groups, width),
                    conv(width, mlp_ratio * width, 1),
                    nn.GELU(),
                    conv(mlp_ratio * width, width, 1),
                )
            )
        kwargs = {**_STREAM_DEFAULTS, **(streams or {})}
        if residual == "residual":
            kwargs = {"disable": True}
        else:
            kwargs["kind"] = residual
        self.trunk = MultiStreamStack(branches, width, channel_first=True, **kwargs)
        self.head = nn.Sequential(
            deconv(width, width, patch_size, stride=patch_size),
            nn.GELU(),
            conv(width, channels, 1),
        )
        self.classifier = nn.Linear(width, num_classes) if num_classes else None
        coords = torch.meshgrid(
            *[torch.arange(grid, dtype=torch.float32) / grid] * spatial_dims, indexing="ij"
        )
        self.register_buffer("coords", torch.stack(coords), persistent=False)

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next frame ``(batch, channels, *grid)`` and PDE-type logits (``None`` without head).

        Args:
            frames: ``(batch, history, channels, *grid)``.
        """
        expected = (self.history, self.channels) + (self.grid,) * self.spatial_dims
        if frames.dim() != 1 + len(expected) or tuple(frames.shape[1:]) != expected:
            raise InputError(f"expected frames (batch, {expected}), got {tuple(frames.shape)}")
        batch = frames.shape[0]
        last = frames[:, -1]
        if self.normalize:
            axes = (1, *range(3, frames.dim()))
            mean = frames.mean(dim=axes, keepdim=True)
            std = frames.std(dim=axes, keepdim=True) + 1e-5
            frames = (frames - mean) / std
        coords = self.coords.expand(batch, *self.coords.shape)
        x = torch.cat([frames.flatten(1, 2), coords], dim=1)
        h = self.trunk(self.embed(x) + self.pos_embed)
        delta = self.head(h)
        if self.normalize:
            delta = delta * std.squeeze(1)
        logits = None
        if self.classifier is not None:
            logits = self.classifier(h.flatten(2).mean(-1))
        return last + delta, logits

    def rollout(self, frames: torch.Tensor, steps: int) -> torch.Tensor:
        """``steps`` frames predicted auto-regressively from the last ``history`` of ``frames``.

        Returns ``(batch, steps, channels, *grid)``: each prediction is fed back as the newest
        input frame (``steps=0``: no frame).
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InputError(f"steps must be an integer >= 0, got {steps!r}")
        window = frames[:, -self.history :]
        if steps == 0:
            return window[:, :0]
        predictions = []
        for _ in range(steps):
            nxt = self(window)[0]
            predictions.append(nxt)
            window = torch.cat([window[:, 1:], nxt.unsqueeze(1)], dim=1)
        return torch.stack(predictions, dim=1)

    def stream_parameters(self) -> list[nn.Parameter]:
        """The multi-stream connections' own parameters (not the sub-layers'); empty for residual."""
        branch = {id(p) for layer in self.trunk.layers for p in layer.branch.parameters()}
        return [p for p in self.trunk.parameters() if id(p) not in branch]
