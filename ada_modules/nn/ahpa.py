"""AHPA: align a diffusion transformer's tokens with several levels of its frozen VAE encoder.

:class:`HierarchicalPriorAligner` is a training-only head. Forward hooks catch the outputs of named
submodules of the VAE (e.g. ``encoder.down_blocks.0`` ... ``encoder.mid_block``) while the training
step encodes the clean images, and the output tokens of one transformer block of the denoiser
while it predicts. :meth:`~HierarchicalPriorAligner.loss` pools each VAE level to the token grid,
projects the tokens to each level with its own MLP, and weights the per-level cosine losses by a
timestep router (:class:`~ada_modules.nn.ahpa_router.TimestepRouter`). The head is a separate
module: the denoiser's ``state_dict`` and outputs do not change, and :meth:`remove` detaches the
hooks before export.

One level and ``router="none"`` is REPA-style alignment with a single target. The reserved level
name ``"latent"`` stands for the clean latent the denoiser is trained on, passed to ``loss``.

Router collapse (a router minimising ``Σ w_l ℓ_l`` puts all weight on the easiest level) is held
off by per-level EMA normalisation of the losses, an entropy bonus, or a KL to
:func:`~ada_modules.nn.ahpa_router.coarse_to_fine_prior`; ``router="prior"`` uses that schedule
as fixed weights.
"""

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from ada_modules.checks import is_int
from ada_modules.errors import InputError
from ada_modules.nn._diffusers_blocks import ENCODER_FIRST_BLOCKS
from ada_modules.nn.ahpa_router import TimestepRouter, coarse_to_fine_prior

__all__ = ["HierarchicalPriorAligner", "LATENT"]

LATENT = "latent"
RouterKind = Literal["learned", "prior", "uniform", "none"]
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _projector(width: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(width, hidden),
        nn.SiLU(),
        nn.Linear(hidden, hidden),
        nn.SiLU(),
        nn.Linear(hidden, out),
    )


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Sequence) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise InputError(f"a hooked module returned {type(output).__name__}, not a tensor")


def _check_t(t: Any, batch: int | None = None) -> None:
    """Raise :class:`InputError` unless ``t`` is a 1-D tensor of noise levels in ``[0, 1]``
    (of length ``batch`` if given)."""
    if not isinstance(t, torch.Tensor):
        raise InputError(
            f"t must be a 1-D tensor of noise levels in [0, 1], one per sample, got "
            f"{type(t).__name__}"
        )
    if not (t.is_floating_point() or t.dtype in _INTEGER_DTYPES):
        raise InputError(f"t must be a floating or integer tensor, got {t.dtype}")
    if t.dim() != 1 or (batch is not None and t.shape[0] != batch):
        count = "" if batch is None else f"{batch} "
        raise InputError(
            f"t must be a 1-D tensor of {count}noise levels, one per sample, got shape "
            f"{tuple(t.shape)} (flatten a (B, 1, 1, 1) column with t.flatten())"
        )
    bad = t[~((t >= 0) & (t <= 1))]
    if bad.numel():
        raise InputError(
            f"t must be in [0, 1] (0 clean, 1 noise; a DiT's timestep is 1000 t), got "
            f"{bad[0].item()}"
        )


def _probe_channels(vae: nn.Module, names: list[str]) -> dict[str, int]:
    """Channels of each named submodule's output on one zero image through ``vae.encode``, in the
    VAE's dtype and on its device."""
    modules = dict(vae.named_modules())
    channels: dict[str, int] = {}
    handles = [
        modules[name].register_forward_hook(
            lambda m, i, out, name=name: channels.__setitem__(name, _first_tensor(out).shape[1])
        )
        for name in names
    ]
    config = vae.config
    size = int(config.sample_size)
    parameter = next(vae.parameters())
    sample = torch.zeros(
        1, int(config.in_channels), size, size, dtype=parameter.dtype, device=parameter.device
    )
    try:
        with torch.no_grad():
            vae.encode(sample)
    finally:
        for handle in handles:
            handle.remove()
    for name in names:
        if name not in channels:
            raise InputError(
                f"level {name!r} is not run by vae.encode (the pass whose outputs the hooks "
                f"catch); '{LATENT}' or a submodule it runs (encoder.*, quant_conv)"
            )
    return channels


class HierarchicalPriorAligner(nn.Module):
    """Timestep-routed alignment of denoiser tokens with multi-level VAE-encoder features.

    Args:
        vae: The frozen autoencoder whose submodules are hooked (e.g. diffusers' ``AutoencoderKL``).
        blocks: The denoiser's transformer blocks (e.g. ``dit.transformer_blocks``).
        levels: Names of submodules of ``vae`` whose outputs ``(B, C, H, W)`` are the targets,
            ordered fine to coarse, or ``"latent"`` (the latent passed to :meth:`loss`).
        level_channels: Channels of each level's output.
        block_index: Index in ``blocks`` of the block whose output tokens ``(B, N, D)`` are aligned
            (a block wrapped by AOT-POT's ``StreamsWrapper`` returns ``(B, N, n D)``, its ``n``
            packed streams, read as their mean). Blocks that return ``(encoder_hidden_states,
            hidden_states)`` (SD3, Flux, ...) are refused.
        hidden_size: Width ``D`` of the tokens.
        token_grid: ``(h, w)`` with ``h * w = N``: the levels are average-pooled to this grid.
        router: ``"learned"`` (:class:`TimestepRouter`), ``"prior"`` (fixed coarse-to-fine
            schedule), ``"uniform"`` (``1/L`` each) or ``"none"`` (one level, weight 1).
        normalize: ``"ema"`` divides each level's loss by its running mean (decay ``ema_decay``),
            ``"none"`` leaves it.
        entropy_weight: Weight of the router entropy bonus (subtracted from the loss).
        prior_kl_weight: Weight of ``KL(w(t) || prior(t))`` added to the loss.
        prior_sigma: Width of the coarse-to-fine prior, in levels.
        projector_dim: Hidden width of the per-level projector MLPs.
        router_temperature: Softmax temperature of the learned router.

    Example:
        >>> from torch import nn
        >>> vae = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.Conv2d(8, 16, 3, 2, 1))
        >>> blocks = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])
        >>> aligner = HierarchicalPriorAligner(vae, blocks, levels=["0", "1"],
        ...     level_channels=[8, 16], block_index=0, hidden_size=32, token_grid=(4, 4))
        >>> with torch.no_grad():
        ...     _ = vae(torch.randn(2, 3, 16, 16))  # the hooks catch both levels
        >>> aligned_block = blocks[0]
        >>> _ = aligned_block(torch.randn(2, 16, 32))  # and the block's tokens
        >>> loss, stats = aligner.loss(torch.tensor([0.2, 0.8]))
        >>> loss.shape, sorted(stats)
        (torch.Size([]), ['align/loss_0', 'align/loss_1', 'align/router_entropy'])
    """

    def __init__(
        self,
        vae: nn.Module,
        blocks: Sequence[nn.Module],
        levels: Sequence[str],
        level_channels: Sequence[int],
        block_index: int,
        hidden_size: int,
        token_grid: tuple[int, int],
        router: RouterKind = "learned",
        normalize: Literal["ema", "none"] = "ema",
        ema_decay: float = 0.99,
        entropy_weight: float = 0.0,
        prior_kl_weight: float = 0.0,
        prior_sigma: float = 0.75,
        projector_dim: int = 256,
        router_temperature: float = 1.0,
    ) -> None:
        super().__init__()
        levels = list(levels)
        self._check(levels, level_channels, blocks, block_index, token_grid, router, normalize)
        self.check_levels(vae, levels)
        if not 0 <= ema_decay < 1:
            raise InputError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if not (0 <= entropy_weight < math.inf and 0 <= prior_kl_weight < math.inf):
            raise InputError(
                f"entropy_weight and prior_kl_weight must be finite and >= 0, got {entropy_weight} "
                f"and {prior_kl_weight}"
            )
        if not 0 < prior_sigma < math.inf:
            raise InputError(f"prior_sigma must be finite and > 0, got {prior_sigma}")
        if not is_int(hidden_size) or hidden_size < 1:
            raise InputError(f"hidden_size must be an int >= 1, got {hidden_size!r}")
        if not is_int(projector_dim) or projector_dim < 1:
            raise InputError(f"projector_dim must be an int >= 1, got {projector_dim!r}")
        self.levels = levels
        self.hidden_size = hidden_size
        # a StreamsWrapper block packs its streams on the last axis (its last block reduces them)
        self.packed_streams = int(getattr(blocks[block_index], "n_streams", 1))
        self.token_grid = (int(token_grid[0]), int(token_grid[1]))
        self.router_kind = router
        self.normalize = normalize
        self.ema_decay = ema_decay
        self.entropy_weight = entropy_weight
        self.prior_kl_weight = prior_kl_weight
        self.prior_sigma = prior_sigma
        self.projectors = nn.ModuleList(
            _projector(hidden_size, projector_dim, c) for c in level_channels
        )
        self.router = (
            TimestepRouter(len(levels), temperature=router_temperature)
            if router == "learned"
            else None
        )
        self.register_buffer("loss_ema", torch.zeros(len(levels)))
        self.register_buffer("ema_steps", torch.zeros((), dtype=torch.long))
        self._targets: dict[str, torch.Tensor] = {}
        self._tokens: torch.Tensor | None = None
        modules = dict(vae.named_modules())
        self._handles: list[RemovableHandle] = [
            modules[name].register_forward_hook(self._target_hook(name))
            for name in levels
            if name != LATENT
        ]
        self._handles.append(blocks[block_index].register_forward_hook(self._token_hook))

    @staticmethod
    def _check(
        levels: list[str],
        level_channels: Sequence[int],
        blocks: Sequence[nn.Module],
        block_index: int,
        token_grid: tuple[int, int],
        router: str,
        normalize: str,
    ) -> None:
        if not levels:
            raise InputError("levels must name at least one level")
        if len(set(levels)) != len(levels):
            raise InputError(f"levels must be distinct, got {levels}")
        if len(level_channels) != len(levels):
            raise InputError(
                f"level_channels must give one width per level: {len(levels)} levels, "
                f"got {list(level_channels)}"
            )
        if not all(is_int(c) and c >= 1 for c in level_channels):
            raise InputError(f"level_channels must be ints >= 1, got {list(level_channels)}")
        if not is_int(block_index):
            raise InputError(f"block_index must be an int, got {block_index!r}")
        if not -len(blocks) <= block_index < len(blocks):
            raise InputError(
                f"block_index {block_index} is out of range for {len(blocks)} transformer blocks"
            )
        block = type(blocks[block_index]).__name__
        if block in ENCODER_FIRST_BLOCKS:
            raise InputError(
                f"block {block_index} ({block}) is not supported: it returns the tuple "
                "(encoder_hidden_states, hidden_states), and the head would align the text "
                "stream; only blocks that return the image tokens (or a tuple that starts with "
                "them) can be aligned"
            )
        if len(token_grid) != 2 or min(token_grid) < 1:
            raise InputError(f"token_grid must be (h, w) with h, w >= 1, got {token_grid}")
        if router not in ("learned", "prior", "uniform", "none"):
            raise InputError(
                f"router must be 'learned', 'prior', 'uniform' or 'none', got {router!r}"
            )
        if router == "none" and len(levels) != 1:
            raise InputError(f"router='none' needs exactly one level, got {levels}")
        if normalize not in ("ema", "none"):
            raise InputError(f"normalize must be 'ema' or 'none', got {normalize!r}")

    @classmethod
    def for_diffusers(
        cls, vae: nn.Module, dit: nn.Module, levels: Sequence[str], block_index: int, **kwargs: Any
    ) -> "HierarchicalPriorAligner":
        """An aligner for a diffusers ``AutoencoderKL`` and ``DiTTransformer2DModel``.

        The level widths come from one probe pass of a zero image through ``vae.encode`` (in the
        VAE's dtype, so half-precision VAEs work; a level must be run by it), the token width and
        grid from the DiT's config. ``kwargs`` go to the constructor.

        Example:
            >>> from diffusers import AutoencoderKL, DiTTransformer2DModel
            >>> vae = AutoencoderKL(block_out_channels=(8, 16), norm_num_groups=4, sample_size=16,
            ...     down_block_types=("DownEncoderBlock2D",) * 2,
            ...     up_block_types=("UpDecoderBlock2D",) * 2)
            >>> dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8,
            ...     in_channels=4, num_layers=2, sample_size=8, norm_num_groups=4,
            ...     num_embeds_ada_norm=10)
            >>> aligner = HierarchicalPriorAligner.for_diffusers(
            ...     vae, dit, ["encoder.down_blocks.0", "encoder.mid_block"], block_index=1)
            >>> aligner.token_grid, [p[-1].out_features for p in aligner.projectors]
            ((4, 4), [8, 16])
        """
        cls.check_levels(vae, levels)
        config = dit.config
        grid = int(config.sample_size) // int(config.patch_size)
        channels = _probe_channels(vae, [name for name in levels if name != LATENT])
        latent_channels = int(getattr(vae.config, "latent_channels", 0))
        widths = [latent_channels if name == LATENT else channels[name] for name in levels]
        return cls(vae, dit.transformer_blocks, levels, widths, block_index,
                   hidden_size=int(dit.inner_dim), token_grid=(grid, grid), **kwargs)  # fmt: skip

    @classmethod
    def check_levels(cls, vae: nn.Module, levels: Sequence[str]) -> None:
        """Raise :class:`InputError` naming the first level that is not a submodule of ``vae``."""
        names = [name for name, _ in vae.named_modules() if name]
        for level in levels:
            if level != LATENT and level not in names:
                # the encoder's blocks when it has one (diffusers: encoder.down_blocks.i, ...)
                shallow = [n for n in names if n.count(".") <= 2]
                hint = [n for n in shallow if n.startswith("encoder.")] or shallow
                raise InputError(
                    f"level {level!r} is not a submodule of the VAE; '{LATENT}' or one of: "
                    f"{', '.join(hint[:10])}"
                )

    def _target_hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if self.training:
                self._targets[name] = _first_tensor(output).detach()

        return hook

    def _token_hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self.training:
            self._tokens = _first_tensor(output)

    def remove(self) -> None:
        """Detach every hook: the denoiser and the VAE are as they were before."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._targets.clear()
        self._tokens = None

    def _pooled(self, name: str, feature: torch.Tensor) -> torch.Tensor:
        if feature.dim() != 4:
            raise InputError(
                f"level {name!r} gave a tensor of shape {tuple(feature.shape)}; expected (B, C, H, W)"
            )
        pooled = F.adaptive_avg_pool2d(feature.float(), self.token_grid)
        return pooled.flatten(2).transpose(1, 2)  # (B, N, C)

    def weights(self, t: torch.Tensor) -> torch.Tensor:
        """The level weights ``(batch, L)`` at noise levels ``t`` ``(batch,)`` in ``[0, 1]``
        (``0`` clean, ``1`` noise).

        Raises:
            InputError: If ``t`` is not a 1-D floating or integer tensor of values in ``[0, 1]``.
        """
        _check_t(t)
        return self._weights(t)

    def _weights(self, t: torch.Tensor) -> torch.Tensor:
        n = len(self.levels)
        if self.router is not None:
            return self.router(t)
        if self.router_kind == "prior":
            return coarse_to_fine_prior(t, n, self.prior_sigma)
        return torch.full((t.shape[0], n), 1.0 / n, device=t.device)

    def level_losses(self, latent: torch.Tensor | None = None) -> torch.Tensor:
        """Per-sample, per-level ``mean_tokens(1 - cos)`` of the caught tokens, shape ``(B, L)``.

        ``latent`` ``(B, C, H, W)`` is the target of the ``"latent"`` level (detached, as the
        caught VAE levels are).
        """
        if latent is not None and not isinstance(latent, torch.Tensor):
            raise InputError(f"latent must be a tensor (B, C, H, W), got {type(latent).__name__}")
        tokens = self._tokens
        if tokens is None:
            raise InputError(
                "no denoiser tokens caught: call the denoiser (in training mode) first"
            )
        if tokens.dim() != 3 or tokens.shape[1] != self.token_grid[0] * self.token_grid[1]:
            raise InputError(
                f"the aligned block gave tokens of shape {tuple(tokens.shape)}, but token_grid "
                f"{self.token_grid} needs {self.token_grid[0] * self.token_grid[1]} tokens"
            )
        width, streams = tokens.shape[-1], self.packed_streams
        if width != self.hidden_size:
            if width != streams * self.hidden_size:
                packed = f" ({streams} packed streams: {streams * self.hidden_size})"
                raise InputError(
                    f"the aligned block gave tokens of width {width}; hidden_size is "
                    f"{self.hidden_size}{packed if streams > 1 else ''}"
                )
            # multi-stream residuals (StreamsWrapper) pack their streams: read out their mean
            tokens = tokens.unflatten(-1, (streams, self.hidden_size)).mean(-2)
        losses = []
        for name, projector in zip(self.levels, self.projectors, strict=True):
            feature = latent if name == LATENT else self._targets.get(name)
            if feature is None:
                what = "pass latent=" if name == LATENT else "encode the clean images with the VAE"
                raise InputError(f"no target for level {name!r}: {what} before loss()")
            target = self._pooled(name, feature.detach())
            channels = projector[-1].out_features
            if target.shape[-1] != channels:
                raise InputError(
                    f"level {name!r} has {target.shape[-1]} channels; expected {channels}"
                )
            if target.shape[0] != tokens.shape[0]:
                raise InputError(
                    f"level {name!r} has batch {target.shape[0]}, the tokens {tokens.shape[0]}"
                )
            cosine = F.cosine_similarity(projector(tokens), target, dim=-1)
            losses.append((1 - cosine).mean(dim=1))
        return torch.stack(losses, dim=1)

    def loss(
        self, t: torch.Tensor, latent: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The alignment loss for noise levels ``t`` ``(B,)`` in ``[0, 1]``, and detached statistics
        to log.

        Uses (and clears) the targets and tokens the hooks caught since the last call. A batch
        whose level losses are not finite gives a non-finite loss and leaves the EMA as it was.

        Raises:
            InputError: If ``t`` is not a 1-D floating or integer tensor of ``B`` values in
                ``[0, 1]``, or a caught target or ``latent`` does not fit (nothing is cleared).
        """
        per_level = self.level_losses(latent)
        _check_t(t, per_level.shape[0])
        self._targets.clear()
        self._tokens = None
        if self.normalize == "ema":
            scaled = per_level / self._update_ema(per_level.detach().mean(dim=0))
        else:
            scaled = per_level
        w = self._weights(t.to(per_level.device))
        loss = (w * scaled).sum(dim=1).mean()
        entropy = -(w * w.clamp_min(1e-12).log()).sum(dim=1).mean()
        if self.router is not None and self.entropy_weight:
            loss = loss - self.entropy_weight * entropy
        if self.router is not None and self.prior_kl_weight:
            prior = coarse_to_fine_prior(t, len(self.levels), self.prior_sigma)
            kl = (w * (w.clamp_min(1e-12).log() - prior.clamp_min(1e-12).log())).sum(dim=1)
            loss = loss + self.prior_kl_weight * kl.mean()
        stats = {f"align/loss_{name}": per_level[:, i].mean().detach()
                 for i, name in enumerate(self.levels)}  # fmt: skip
        stats["align/router_entropy"] = entropy.detach()
        return loss, stats

    def _update_ema(self, batch_means: torch.Tensor) -> torch.Tensor:
        if self.training and bool(batch_means.isfinite().all()):
            if int(self.ema_steps) == 0:
                self.loss_ema.copy_(batch_means)
            else:
                self.loss_ema.mul_(self.ema_decay).add_(batch_means, alpha=1 - self.ema_decay)
            self.ema_steps += 1
        return self.loss_ema.clamp_min(1e-6)
