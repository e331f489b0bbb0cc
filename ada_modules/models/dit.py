"""A class-conditional diffusers DiT trained by flow matching in a frozen VAE's latent space.

The training-only alignment head (:class:`~ada_modules.nn.ahpa.HierarchicalPriorAligner`) is
configured by ``alignment``; it never changes the denoiser, which :meth:`DiTModule.export`
returns on its own.
"""

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DiTTransformer2DModel
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torchvision.utils import save_image

from ada_modules.errors import InputError
from ada_modules.models.autoencoder import load_autoencoder
from ada_modules.models.frechet import frechet_distance
from ada_modules.models.shapes_judge import load_shapes_judge
from ada_modules.nn.ahpa import HierarchicalPriorAligner

__all__ = ["DiTModule", "euler_sample"]

_ROUTER_T = [i / 20 for i in range(21)]


@torch.no_grad()
def euler_sample(
    dit: nn.Module,
    labels: torch.Tensor,
    shape: tuple[int, int, int],
    steps: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Integrate the flow ``dx/dt = v(x, t)`` from noise at ``t = 1`` to ``t = 0`` in ``steps`` steps.

    Example:
        >>> dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
        ...     out_channels=4, num_layers=1, sample_size=8, norm_num_groups=4,
        ...     num_embeds_ada_norm=10)
        >>> euler_sample(dit, torch.tensor([0, 1]), (4, 8, 8), steps=2).shape
        torch.Size([2, 4, 8, 8])
    """
    device = labels.device
    x = torch.randn((labels.shape[0], *shape), generator=generator, device="cpu").to(device)
    times = torch.linspace(1.0, 0.0, steps + 1, device=device)
    for t, t_next in zip(times[:-1], times[1:], strict=True):
        timestep = (t * 1000).expand(labels.shape[0])
        v = dit(x, timestep=timestep, class_labels=labels).sample
        x = x + (t_next - t) * v
    return x


class DiTModule(LightningModule):
    """Trains a diffusers ``DiTTransformer2DModel`` by flow matching on VAE latents of images.

    ``x_t = (1 - t) z + t ε`` with ``t ~ U(0, 1)``, the DiT predicts ``v = ε - z`` (loss: MSE),
    conditioned on ``1000 t`` and the class. ``z`` is the VAE posterior mean, standardised per
    channel with the asset's latent statistics. An EMA copy of the DiT (``ema_decay``, warmed up
    as ``min(decay, (1 + step) / (10 + step))``) generates the samples.

    Metrics: ``train/flow_loss``, ``train/loss``; ``{val,test}/flow_loss`` on fixed noise and a
    fixed grid of 8 noise levels; ``{val,test}/fd`` (Fréchet distance of ``num_samples``
    class-balanced Euler samples, ``sample_steps`` steps, no guidance, to the split's real images
    in the judge classifier's feature space) and ``{val,test}/class_acc`` (share of samples the
    judge assigns to their conditioning class); ``test/fd_recon`` (the same distance for VAE
    reconstructions of the real images: the floor a latent model can reach). With a router, the
    test also writes ``router.json`` (``w(t)`` on a grid) to the log folder and logs
    ``test/router_coarse_shift``, the coarsest level's weight at ``t = 0.9`` minus at ``t = 0.1``.

    Args:
        num_layers: Transformer blocks of the DiT.
        num_attention_heads: Attention heads.
        attention_head_dim: Width per head.
        patch_size: Latent patch size; it must divide the latent side.
        num_classes: Classes of the conditioning labels.
        alignment: ``None`` (vanilla) or keyword arguments of
            :meth:`HierarchicalPriorAligner.for_diffusers <ada_modules.nn.ahpa.HierarchicalPriorAligner.for_diffusers>`
            (``levels``, ``block_index``, ``router``, ...).
        alignment_weight: ``λ`` in ``flow_loss + λ align_loss``.
        vae_path: The autoencoder asset (``None``: the shipped shapes VAE).
        judge_path: The judge classifier asset (``None``: the shipped shapes judge).
        optimizer: Builds the optimizer from the trainable parameters (DiT and alignment head).
        ema_decay: Decay of the EMA weights.
        num_samples: Samples generated per evaluation (``0``: no sampling metrics).
        sample_steps: Euler steps per sample.
        image_size: Side of the training images (``None``: the VAE's ``sample_size``), a multiple
            of the VAE's downsampling factor; the latent side is this over that factor.
        model_wrapper: Called once as ``model_wrapper(dit)`` on the built DiT, before the
            alignment head attaches (e.g. ANCRe's ``ConnectivityWrapper`` or AOT-POT's
            ``StreamsWrapper``, which both reach a DiT's ``transformer_blocks``).

    Example:
        >>> module = DiTModule(num_layers=2, alignment={"levels": ["encoder.mid_block"],
        ...     "block_index": 1, "router": "none", "normalize": "none"})
        >>> sorted(module.export().state_dict()) == sorted(module.dit.state_dict())
        True
    """

    def __init__(
        self,
        num_layers: int = 6,
        num_attention_heads: int = 4,
        attention_head_dim: int = 24,
        patch_size: int = 2,
        num_classes: int = 10,
        alignment: dict[str, Any] | None = None,
        alignment_weight: float = 0.5,
        vae_path: str | None = None,
        judge_path: str | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        ema_decay: float = 0.999,
        num_samples: int = 256,
        sample_steps: int = 20,
        image_size: int | None = None,
        model_wrapper: Callable[[nn.Module], Any] | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= ema_decay < 1:
            raise InputError(f"ema_decay must be in [0, 1), got {ema_decay}")
        if num_samples < 0 or (num_samples and num_samples < 2):
            raise InputError(f"num_samples must be 0 or >= 2, got {num_samples}")
        if sample_steps < 1:
            raise InputError(f"sample_steps must be >= 1, got {sample_steps}")
        if alignment_weight < 0:
            raise InputError(f"alignment_weight must be >= 0, got {alignment_weight}")
        if isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1:
            raise InputError(f"patch_size must be an int >= 1, got {patch_size!r}")
        self.save_hyperparameters(ignore=["optimizer", "model_wrapper"])
        asset = load_autoencoder(vae_path)
        self.vae = asset.vae
        self.register_buffer("latent_mean", asset.latent_mean.view(1, -1, 1, 1).float())
        self.register_buffer("latent_std", asset.latent_std.view(1, -1, 1, 1).float())
        channels = int(self.vae.config.latent_channels)
        side = int(self.vae.config.sample_size) if image_size is None else image_size
        factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        if isinstance(side, bool) or not isinstance(side, int) or side < 1 or side % factor:
            raise InputError(
                f"image_size must be a positive multiple of {factor} (the VAE's downsampling "
                f"factor), got {side!r}"
            )
        size = side // factor
        if size % patch_size:
            raise InputError(
                f"patch_size {patch_size} must divide the latent side {size} (image_size {side} "
                f"over the VAE's downsampling factor {factor})"
            )
        self.latent_shape = (channels, size, size)
        self.dit = DiTTransformer2DModel(
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            in_channels=channels,
            out_channels=channels,
            num_layers=num_layers,
            sample_size=size,
            patch_size=patch_size,
            num_embeds_ada_norm=num_classes,
            norm_num_groups=1,
        )
        if model_wrapper is not None:
            model_wrapper(self.dit)
        self.ema = copy.deepcopy(self.dit).requires_grad_(False)
        self.aligner = (
            None
            if alignment is None
            else HierarchicalPriorAligner.for_diffusers(self.vae, self.dit, **alignment)
        )
        self.judge = load_shapes_judge(judge_path) if num_samples else None
        self.optimizer = optimizer
        self.num_classes = num_classes
        self._real: list[torch.Tensor] = []
        self._recon: list[torch.Tensor] = []

    def train(self, mode: bool = True) -> "DiTModule":
        """Set the training mode; the frozen VAE, judge and EMA denoiser always stay in eval."""
        super().train(mode)
        for frozen in (self.vae, self.judge, self.ema):
            if frozen is not None:
                frozen.eval()
        return self

    def export(self) -> DiTTransformer2DModel:
        """The EMA denoiser alone: no alignment head, no hooks' effect on its outputs."""
        return self.ema

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Standardised VAE posterior means of ``images`` (the aligner's hooks see this pass)."""
        latent = self.vae.encode(images).latent_dist.mean
        return (latent - self.latent_mean) / self.latent_std

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Images in ``[-1, 1]`` from standardised latents."""
        return self.vae.decode(z * self.latent_std + self.latent_mean).sample.clamp(-1, 1)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        images, labels = batch
        z = self.encode(images)
        t = torch.rand(z.shape[0], device=z.device)
        noise = torch.randn_like(z)
        flow = self._flow_loss(self.dit, z, labels, t, noise)
        loss = flow
        if self.aligner is not None:
            align, stats = self.aligner.loss(t, latent=z)
            loss = flow + self.hparams.alignment_weight * align
            self.log_dict({f"train/{k}": v for k, v in stats.items()})
            self.log("train/align_loss", align.detach())
        self.log("train/flow_loss", flow.detach())
        self.log("train/loss", loss.detach())
        return loss

    def _flow_loss(
        self, dit: nn.Module, z: torch.Tensor, labels: torch.Tensor, t: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        tb = t.view(-1, 1, 1, 1)
        x_t = (1 - tb) * z + tb * noise
        v = dit(x_t, timestep=1000 * t, class_labels=labels).sample
        return F.mse_loss(v, noise - z)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self.global_step
        decay = min(self.hparams.ema_decay, (1 + step) / (10 + step))
        ema = list(self.ema.parameters())
        torch._foreach_lerp_(ema, [p.detach() for p in self.dit.parameters()], 1 - decay)

    def _evaluate(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, stage: str
    ) -> None:
        images, labels = batch
        z = self.encode(images)
        generator = torch.Generator().manual_seed(batch_idx)
        losses = []
        for k in range(8):
            t = torch.full((z.shape[0],), (k + 0.5) / 8, device=z.device)
            noise = torch.randn(z.shape, generator=generator).to(z.device)
            losses.append(self._flow_loss(self.dit, z, labels, t, noise))
        self.log(f"{stage}/flow_loss", torch.stack(losses).mean(), batch_size=z.shape[0])
        if self.judge is not None:
            self._real.append(self.judge.features(images))
            if stage == "test":
                self._recon.append(self.judge.features(self.decode(z)))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test")

    def on_validation_epoch_end(self) -> None:
        real, self._real = self._real, []
        if real and not self.trainer.sanity_checking:
            self._sample_metrics("val", torch.cat(real))

    def on_test_epoch_end(self) -> None:
        real, self._real = self._real, []
        recon, self._recon = self._recon, []
        if real:
            self._sample_metrics("test", torch.cat(real))
            self.log("test/fd_recon", frechet_distance(torch.cat(recon), torch.cat(real)))
        if self.aligner is not None:
            self._write_router()

    @torch.no_grad()
    def generate(self, labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """Images in ``[-1, 1]`` of classes ``labels`` from the EMA denoiser, fixed sampler."""
        generator = torch.Generator().manual_seed(seed)
        z = euler_sample(self.ema, labels, self.latent_shape, self.hparams.sample_steps, generator)
        return self.decode(z)

    def _sample_metrics(self, stage: str, real: torch.Tensor) -> None:
        n = self.hparams.num_samples
        labels = torch.arange(n, device=self.device) % self.num_classes
        samples = []
        for chunk in labels.split(256):
            samples.append(self.generate(chunk, seed=len(samples)))
        images = torch.cat(samples)
        features = self.judge.features(images)
        accuracy = (self.judge(images).argmax(dim=-1) == labels).float().mean()
        self.log(f"{stage}/fd", frechet_distance(features, real))
        self.log(f"{stage}/class_acc", accuracy)
        if stage == "test" and self.trainer.log_dir is not None and n >= self.num_classes:
            per_class = min(8, n // self.num_classes)  # one row of samples per class
            grid = images[: per_class * self.num_classes].view(
                per_class, self.num_classes, *images.shape[1:]
            )
            path = Path(self.trainer.log_dir) / "samples.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            save_image(grid.transpose(0, 1).flatten(0, 1) * 0.5 + 0.5, path, nrow=max(per_class, 1))

    def _write_router(self) -> None:
        t = torch.tensor(_ROUTER_T, device=self.device)
        w = self.aligner.weights(t).detach().cpu()
        coarse = len(self.aligner.levels) - 1
        self.log("test/router_coarse_shift", w[18, coarse] - w[2, coarse])
        if self.trainer.log_dir is not None:
            path = Path(self.trainer.log_dir) / "router.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            record = {"t": _ROUTER_T, "levels": self.aligner.levels, "weights": w.tolist()}
            path.write_text(json.dumps(record))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return self.optimizer(params)
