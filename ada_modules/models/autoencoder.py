"""A tiny diffusers ``AutoencoderKL`` for 32x32 images: its builder, trainer and shipped asset.

AHPA aligns a diffusion transformer with features of a frozen VAE encoder, and no pretrained VAE
can be downloaded, so :class:`AutoencoderKLModule` trains :func:`tiny_autoencoder_kl` on
:class:`~ada_modules.data.shapes.ShapesDataModule` images (``cli_configs/ahpa/vae.yaml``) and
:meth:`~AutoencoderKLModule.export` writes it to one file; :func:`load_autoencoder` reads it back
(by default ``ada_modules/assets/shapes_vae.pt``, shipped with the package).

The encoder's levels that forward hooks can read (:data:`ENCODER_LEVELS`, module names inside
``vae.encoder``), for ``(batch, 3, 32, 32)`` inputs:

- ``down_blocks.0``: ``(batch, 32, 16, 16)``, first ResNet block, then downsampled;
- ``down_blocks.1``: ``(batch, 64, 8, 8)``, second ResNet block, then downsampled;
- ``down_blocks.2``: ``(batch, 64, 8, 8)``, third ResNet block (no downsampling);
- ``mid_block``: ``(batch, 64, 8, 8)``, ResNet + self-attention + ResNet.

The latents (posterior mean or sample) have shape ``(batch, 4, 8, 8)``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric

from ada_modules.errors import InputError

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

__all__ = [
    "DEFAULT_VAE_PATH",
    "ENCODER_LEVELS",
    "ENCODER_LEVEL_SHAPES",
    "AutoencoderKLModule",
    "PretrainedAutoencoder",
    "load_autoencoder",
    "tiny_autoencoder_kl",
]

ASSETS = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_VAE_PATH = ASSETS / "shapes_vae.pt"
"""The shipped VAE asset, trained by ``ada fit -c cli_configs/ahpa/vae.yaml``."""
ENCODER_LEVELS: tuple[str, ...] = ("down_blocks.0", "down_blocks.1", "down_blocks.2", "mid_block")
"""Hookable modules of ``vae.encoder``, shallow to deep (``vae.encoder.get_submodule(name)``)."""
ENCODER_LEVEL_SHAPES: dict[str, tuple[int, int, int]] = {
    "down_blocks.0": (32, 16, 16),
    "down_blocks.1": (64, 8, 8),
    "down_blocks.2": (64, 8, 8),
    "mid_block": (64, 8, 8),
}
"""``(channels, height, width)`` of each level's output for 32x32 images (4 latent channels)."""

_VAE_FORMAT = "ada_modules.autoencoder_kl/1"
_INIT_LOGVAR = -6.0


def tiny_autoencoder_kl(latent_channels: int = 4) -> AutoencoderKL:
    """A fresh (randomly initialised) diffusers ``AutoencoderKL`` for ``3 x 32 x 32`` images.

    Three encoder blocks of widths ``(32, 64, 64)`` with one ResNet layer each (the first two
    downsample), 16 normalisation groups, a mid block with self-attention: 32x32 images map to
    ``latent_channels x 8 x 8`` latents (about 0.95 M parameters). See the module docstring for
    the shapes of the encoder levels.

    Args:
        latent_channels: Channels of the latent (``>= 1``).

    Raises:
        InputError: If ``latent_channels`` is not a positive integer.

    Examples:
        >>> vae = tiny_autoencoder_kl()
        >>> latents = vae.encode(torch.zeros(2, 3, 32, 32)).latent_dist.mean
        >>> tuple(latents.shape), tuple(vae.decode(latents).sample.shape)
        ((2, 4, 8, 8), (2, 3, 32, 32))
    """
    if isinstance(latent_channels, bool) or not isinstance(latent_channels, int):
        raise InputError(f"latent_channels must be an integer >= 1, got {latent_channels!r}")
    if latent_channels < 1:
        raise InputError(f"latent_channels must be an integer >= 1, got {latent_channels!r}")
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=16,
        sample_size=32,
    )


class PretrainedAutoencoder(NamedTuple):
    """What :func:`load_autoencoder` returns (a tuple: ``vae, mean, std = load_autoencoder()``).

    Normalise latents for a diffusion model with
    ``(z - latent_mean.view(1, -1, 1, 1)) / latent_std.view(1, -1, 1, 1)``.

    Attributes:
        vae: The ``AutoencoderKL``, fp32, in eval mode, with ``requires_grad`` off.
        latent_mean: Per-channel mean of the posterior-mean latents of the training images,
            shape ``(latent_channels,)``, fp32.
        latent_std: Their per-channel standard deviation, same shape.
    """

    vae: AutoencoderKL
    latent_mean: torch.Tensor
    latent_std: torch.Tensor


class AutoencoderKLModule(LightningModule):
    """Trains :func:`tiny_autoencoder_kl` by L1 (+ MSE) reconstruction plus a small KL penalty.

    The loss of a batch of images ``x`` in ``[-1, 1]`` is ``mean|y - x| + mse_weight *
    mean((y - x)^2) + kl_weight * KL`` with ``y = decode(z)``, ``z`` sampled from the posterior
    and ``KL`` the posterior's KL divergence to ``N(0, I)`` summed over the latent elements of an
    image and averaged over the batch. The MSE term pulls the decoder off the flat-background
    solution where pure L1 stays for a long time (measured on the shapes: after 250 steps pure
    L1 still drew backgrounds only, L1 + MSE drew the shapes). The posterior's log-variance
    starts at -6 (bias of the ``quant_conv`` log-variance channels), so that early samples are
    not drowned in unit noise. Validation decodes the posterior mean. Logs ``train/loss``, ``train/l1``, ``val/l1`` (mean absolute error in
    ``[-1, 1]`` pixel units), ``val/kl``, and the same under ``test/``. Batches are
    ``(images, labels)`` (labels are ignored) or images alone.

    Args:
        latent_channels: Channels of the latent.
        kl_weight: Weight of the KL term (``>= 0``).
        mse_weight: Weight of the MSE term (``>= 0``; 0: pure L1).
        optimizer: Builds the optimizer from the parameters (injected, see :mod:`ada_modules.cli`).
        lr_scheduler: Builds a per-step learning-rate scheduler from the optimizer, if given.
        export_path: If set, :meth:`on_fit_end` exports the trained VAE there (:meth:`export`,
            latent statistics over the training loader); ``None``: no export.

    Raises:
        InputError: If an argument is out of range, naming the argument.

    Examples:
        >>> module = AutoencoderKLModule()
        >>> module.training_step(torch.rand(2, 3, 32, 32) * 2 - 1, 0).ndim
        0

        In YAML::

            model:
              class_path: ada_modules.models.AutoencoderKLModule
              init_args:
                kl_weight: 1.0e-6
                export_path: ada_modules/assets/shapes_vae.pt
                optimizer:
                  class_path: torch.optim.AdamW
                  init_args: {lr: 0.001}
    """

    def __init__(
        self,
        latent_channels: int = 4,
        kl_weight: float = 1e-6,
        mse_weight: float = 1.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        export_path: str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("kl_weight", kl_weight), ("mse_weight", mse_weight)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise InputError(f"{name} must be a number >= 0, got {value!r}")
        if export_path is not None and (not isinstance(export_path, str) or not export_path):
            raise InputError(f"export_path must be None or a non-empty path, got {export_path!r}")
        self.vae = tiny_autoencoder_kl(latent_channels)
        with torch.no_grad():
            self.vae.quant_conv.bias[latent_channels:] = _INIT_LOGVAR
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.kl_weight = float(kl_weight)
        self.mse_weight = float(mse_weight)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.export_path = export_path
        self.eval_metrics = torch.nn.ModuleDict(
            {f"{s}_{m}": MeanMetric() for s in ("val", "test") for m in ("l1", "kl")}
        )

    @staticmethod
    def _images(batch: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        return batch if isinstance(batch, torch.Tensor) else batch[0]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Reconstructions of ``images`` through the posterior mean (no sampling)."""
        return self.vae.decode(self.vae.encode(images).latent_dist.mean).sample

    def training_step(
        self, batch: torch.Tensor | Sequence[torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        images = self._images(batch)
        posterior = self.vae.encode(images).latent_dist
        reconstruction = self.vae.decode(posterior.sample()).sample
        error = reconstruction - images
        l1 = error.abs().mean()
        loss = l1 + self.mse_weight * error.square().mean() + self.kl_weight * posterior.kl().mean()
        self.log("train/loss", loss, prog_bar=True, batch_size=images.shape[0])
        self.log("train/l1", l1, batch_size=images.shape[0])
        return loss

    def _evaluate(self, batch: torch.Tensor | Sequence[torch.Tensor], stage: str) -> None:
        images = self._images(batch)
        posterior = self.vae.encode(images).latent_dist
        reconstruction = self.vae.decode(posterior.mean).sample
        size = images.shape[0]
        l1 = self.eval_metrics[f"{stage}_l1"]
        kl = self.eval_metrics[f"{stage}_kl"]
        l1.update((reconstruction - images).abs().mean(), size)
        kl.update(posterior.kl().mean(), size)
        self.log(f"{stage}/l1", l1, prog_bar=True, batch_size=size)
        self.log(f"{stage}/kl", kl, batch_size=size)

    def validation_step(self, batch: torch.Tensor | Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: torch.Tensor | Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.optimizer(self.parameters())
        config: dict[str, Any] = {"optimizer": optimizer}
        if self.lr_scheduler is not None:
            config["lr_scheduler"] = {"scheduler": self.lr_scheduler(optimizer), "interval": "step"}
        return config

    @torch.no_grad()
    def latent_statistics(
        self, data: torch.Tensor | Iterable[torch.Tensor | Sequence[torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and std (fp32, on the CPU) of the posterior-mean latents of ``data``.

        ``data`` is a tensor of images or an iterable of batches (``images`` or
        ``(images, labels)``, e.g. a DataLoader); statistics run in fp64 over all positions.
        """
        batches = [data] if isinstance(data, torch.Tensor) else data
        was_training = self.vae.training
        self.vae.eval()
        total, total_sq, count = None, None, 0
        try:
            for batch in batches:
                images = self._images(batch).to(self.device, torch.float32)
                z = self.vae.encode(images).latent_dist.mean.double().transpose(0, 1)
                z = z.reshape(z.shape[0], -1)
                total = z.sum(1) if total is None else total + z.sum(1)
                total_sq = (z * z).sum(1) if total_sq is None else total_sq + (z * z).sum(1)
                count += z.shape[1]
        finally:
            self.vae.train(was_training)
        if total is None or total_sq is None or count < 2:
            raise InputError("latent_statistics needs at least one image, got no batches")
        mean = total / count
        var = (total_sq - count * mean * mean) / (count - 1)
        return mean.float().cpu(), var.clamp(min=0).sqrt().float().cpu()

    def export(
        self,
        path: str | os.PathLike[str],
        data: torch.Tensor | Iterable[torch.Tensor | Sequence[torch.Tensor]] | None = None,
    ) -> Path:
        """Write the VAE and its latent statistics to ``path`` (one file, atomically).

        The file (``torch.save``) holds ``{"format", "config", "state_dict", "latent_mean",
        "latent_std"}``: the diffusers config as a plain dict, an fp16 state dict and the
        per-channel statistics of :meth:`latent_statistics` over ``data`` (``None``: the
        trainer's training loader). It is written to a temporary file in the same folder, then
        renamed, so ``path`` never holds half a file. Returns ``path``.

        Examples:
            >>> import tempfile
            >>> module = AutoencoderKLModule()
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     path = module.export(f"{folder}/vae.pt", torch.zeros(2, 3, 32, 32))
            ...     loaded = load_autoencoder(path)
            >>> tuple(loaded.latent_mean.shape), loaded.vae.training
            ((4,), False)
        """
        if data is None:
            trainer = self._trainer
            loader = None if trainer is None else trainer.train_dataloader
            if loader is None and trainer is not None and trainer.datamodule is not None:
                loader = trainer.datamodule.train_dataloader()
            if loader is None:
                raise InputError("export needs data (images or batches) when no trainer is fitted")
            data = loader
        mean, std = self.latent_statistics(data)
        config = {k: v for k, v in dict(self.vae.config).items() if not k.startswith("_")}
        state = {k: v.detach().to("cpu", torch.float16) for k, v in self.vae.state_dict().items()}
        payload = {
            "format": _VAE_FORMAT,
            "config": config,
            "state_dict": state,
            "latent_mean": mean,
            "latent_std": std,
        }
        return _save_asset(payload, path)

    def on_fit_end(self) -> None:
        """Export to ``export_path`` (if set) on the global-zero process."""
        if self.export_path is not None and self.trainer.is_global_zero:
            self.export(self.export_path)


def load_autoencoder(path: str | os.PathLike[str] | None = None) -> PretrainedAutoencoder:
    """Load an exported VAE (default: the shipped ``ada_modules/assets/shapes_vae.pt``).

    The VAE comes back in fp32, in eval mode, with ``requires_grad`` off, on the CPU.

    Raises:
        InputError: If the file is missing or is not an :meth:`AutoencoderKLModule.export` file.

    Examples:
        >>> vae, latent_mean, latent_std = load_autoencoder()
        >>> z = vae.encode(torch.zeros(1, 3, 32, 32)).latent_dist.mean
        >>> tuple(z.shape), tuple(latent_std.shape), vae.dtype
        ((1, 4, 8, 8), (4,), torch.float32)
    """
    from diffusers import AutoencoderKL

    target = DEFAULT_VAE_PATH if path is None else Path(path)
    data = _load_asset(
        target, _VAE_FORMAT, ("config", "state_dict", "latent_mean", "latent_std"), "autoencoder"
    )
    vae = AutoencoderKL.from_config(data["config"])
    try:
        vae.load_state_dict(data["state_dict"])
    except RuntimeError as error:
        raise InputError(f"{target}: the weights do not fit the saved config ({error})") from error
    vae.float().eval().requires_grad_(False)
    mean = data["latent_mean"].float()
    std = data["latent_std"].float()
    return PretrainedAutoencoder(vae, mean, std)


def _save_asset(payload: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a unique temporary file beside ``path``, then ``os.replace`` onto it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        torch.save(dict(payload), temporary)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target


def _load_asset(path: Path, file_format: str, keys: Sequence[str], what: str) -> dict[str, Any]:
    """Read a file written by :func:`_save_asset` and check its format tag and keys."""
    if not path.is_file():
        raise InputError(f"{what} asset not found: {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a torch file, or one holding other objects
        raise InputError(
            f"{path}: not a valid {what} asset (torch.load failed: {error})"
        ) from error
    if not isinstance(data, dict) or data.get("format") != file_format:
        raise InputError(f"{path}: not a valid {what} asset (no format tag {file_format!r})")
    missing = [key for key in keys if key not in data]
    if missing:
        raise InputError(f"{path}: not a valid {what} asset (missing {missing})")
    return data
