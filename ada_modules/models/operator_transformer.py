"""Auto-regressive next-frame training of an operator transformer on PDE trajectories."""

from __future__ import annotations

from collections.abc import Sequence
from math import inf
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics import MeanMetric

from ada_modules.data.pde import PDE_FAMILIES
from ada_modules.errors import InputError
from ada_modules.models._checkpoint import check_checkpoint_hparams
from ada_modules.nn.operator_transformer import OperatorTransformer, Residual
from ada_modules.optim.param_groups import check_param_coverage

__all__ = ["OperatorTransformerModule", "relative_l2"]

_KINDS = ("rel_l2", "rel_l2_rollout", "rel_l2_persistence")


def relative_l2(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample ``||prediction - target|| / ||target||`` over all but the first axis.

    Examples:
        >>> relative_l2(torch.ones(2, 3), torch.full((2, 3), 2.0))
        tensor([0.5000, 0.5000])
    """
    diff = (prediction - target).flatten(1).norm(dim=1)
    return diff / target.flatten(1).norm(dim=1).clamp_min(1e-12)


class OperatorTransformerModule(LightningModule):
    """Trains an :class:`~ada_modules.nn.operator_transformer.OperatorTransformer` on PDE data.

    Batches are ``(frames, labels)`` as :class:`~ada_modules.data.pde.PDEDataModule` gives them:
    ``frames`` ``(batch, history + horizon, channels, *grid)`` and the PDE family's index in
    :data:`~ada_modules.data.pde.PDE_FAMILIES`. Training predicts frame ``history`` from the
    frames before it, with Gaussian noise of ``noise_scale`` times each sample's standard
    deviation added to the inputs (DPOT's auto-regressive denoising), and minimises the mean
    relative L2 error (plus ``aux_weight`` times the PDE-type cross-entropy, if set).

    Evaluation logs, per family seen and as the mean over families (every family weighs the same):
    ``{stage}/rel_l2/<family>`` (one step), ``{stage}/rel_l2_rollout/<family>`` (the model fed its
    own predictions for the rest of the window, error over all predicted frames) and
    ``{stage}/rel_l2_persistence/<family>`` (predicting the last input frame: the trivial
    baseline), plus ``{stage}/num_params`` and ``{stage}/stream_params`` (the multi-stream
    connections' parameters).

    Args:
        spatial_dims: 1 or 2 (the network's arguments, see
            :class:`~ada_modules.nn.operator_transformer.OperatorTransformer`).
        grid: Points per axis.
        channels: Field channels.
        history: Input frames.
        patch_size: Side of a patch.
        width: Hidden channels.
        depth: Blocks (two sub-layers each).
        mlp_ratio: MLP hidden channels as a multiple of ``width``.
        modes: Fourier modes kept per axis.
        spectral_blocks: Diagonal blocks of the spectral channel mixing.
        groups: GroupNorm groups.
        residual: ``"residual"``, ``"hyper"`` or ``"mhc"``.
        streams: Multi-stream options for ``"hyper"``/``"mhc"``.
        normalize: Reversible instance normalisation.
        noise_scale: Input noise during training, relative to each sample's standard deviation.
        aux_weight: Weight of the PDE-type classification loss (0: no classifier head).
        stream_lr_scale: Learning-rate multiplier of the multi-stream connections' group (the
            connections start symmetric and, at the sub-layers' learning rate, move slowly).
        optimizer: Builds the optimizer from three groups: weights of two or more dimensions
            (decayed), the other sub-layer parameters, and the multi-stream connections (group
            ``name="streams"``); the last two have ``weight_decay=0``.
        lr_scheduler: Builds a per-step learning-rate scheduler from the optimizer, if given.

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> module = OperatorTransformerModule(grid=32, width=16, depth=2, modes=4,
        ...                                    residual="mhc")
        >>> frames = torch.randn(3, 4, 1, 32)  # (batch, history, channels, grid)
        >>> module(frames).shape, module.rollout(frames, steps=5).shape
        (torch.Size([3, 1, 32]), torch.Size([3, 5, 1, 32]))

        In YAML::

            model:
              class_path: ada_modules.models.OperatorTransformerModule
              init_args:
                residual: mhc
                streams: {n_streams: 4, dynamic: token}
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
        noise_scale: float = 1e-3,
        aux_weight: float = 0.0,
        stream_lr_scale: float = 1.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("noise_scale", noise_scale), ("aux_weight", aux_weight)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 <= value < inf
            ):
                raise InputError(f"{name} must be a finite number >= 0, got {value!r}")
        if (
            isinstance(stream_lr_scale, bool)
            or not isinstance(stream_lr_scale, int | float)
            or not 0 < stream_lr_scale < inf
        ):
            raise InputError(
                f"stream_lr_scale must be a finite number > 0, got {stream_lr_scale!r}"
            )
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.net = OperatorTransformer(
            spatial_dims=spatial_dims,
            grid=grid,
            channels=channels,
            history=history,
            patch_size=patch_size,
            width=width,
            depth=depth,
            mlp_ratio=mlp_ratio,
            modes=modes,
            spectral_blocks=spectral_blocks,
            groups=groups,
            residual=residual,
            streams=streams,
            normalize=normalize,
            num_classes=len(PDE_FAMILIES) if aux_weight > 0 else 0,
        )
        self.history, self.noise_scale, self.aux_weight = history, noise_scale, aux_weight
        self.stream_lr_scale = stream_lr_scale
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.eval_metrics = nn.ModuleDict(
            {
                f"{stage}_{kind}_{family}": MeanMetric()
                for stage in ("val", "test")
                for kind in _KINDS
                for family in PDE_FAMILIES
            }
        )

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """The next frame after ``frames`` ``(batch, history, channels, *grid)``."""
        return self.net(frames)[0]

    def rollout(self, frames: torch.Tensor, steps: int) -> torch.Tensor:
        """``steps`` frames predicted auto-regressively from ``frames`` (its last ``history``)."""
        return self.net.rollout(frames, steps)

    def _check_batch(self, frames: torch.Tensor) -> None:
        if frames.shape[1] <= self.history:
            raise InputError(
                f"frames has {frames.shape[1]} time steps; history={self.history} needs at "
                "least history + 1"
            )

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        frames, labels = batch
        self._check_batch(frames)
        inputs, target = frames[:, : self.history], frames[:, self.history]
        if self.noise_scale > 0:
            scale = inputs.flatten(1).std(dim=1).view(-1, *[1] * (inputs.dim() - 1))
            inputs = inputs + self.noise_scale * scale * torch.randn_like(inputs)
        prediction, logits = self.net(inputs)
        loss = relative_l2(prediction, target).mean()
        if logits is not None:
            aux = nn.functional.cross_entropy(logits, labels)
            self.log("train/aux_loss", aux, batch_size=labels.shape[0])
            loss = loss + self.aux_weight * aux
        self.log("train/loss", loss, prog_bar=True, batch_size=labels.shape[0])
        return loss

    def _evaluate(self, batch: Sequence[torch.Tensor], stage: str) -> None:
        frames, labels = batch
        self._check_batch(frames)
        horizon = frames.shape[1] - self.history
        target = frames[:, self.history :]
        predicted = self.rollout(frames[:, : self.history], horizon)
        errors = {
            "rel_l2": relative_l2(predicted[:, 0], target[:, 0]),
            "rel_l2_rollout": relative_l2(predicted, target),
            "rel_l2_persistence": relative_l2(frames[:, self.history - 1], target[:, 0]),
        }
        for label in labels.unique().tolist():
            mask = labels == label
            for kind, values in errors.items():
                self.eval_metrics[f"{stage}_{kind}_{PDE_FAMILIES[label]}"].update(values[mask])

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _log_epoch(self, stage: str) -> None:
        means: dict[str, list[torch.Tensor]] = {kind: [] for kind in _KINDS}
        for kind in _KINDS:
            for family in PDE_FAMILIES:
                metric = self.eval_metrics[f"{stage}_{kind}_{family}"]
                if metric.update_called:
                    value = metric.compute()
                    means[kind].append(value)
                    self.log(f"{stage}/{kind}/{family}", value)
                metric.reset()
        for kind, values in means.items():
            if values:
                self.log(f"{stage}/{kind}", torch.stack(values).mean(), prog_bar=kind == "rel_l2")
        if stage == "test":
            stream = sum(p.numel() for p in self.net.stream_parameters())
            self.log("test/num_params", float(sum(p.numel() for p in self.net.parameters())))
            self.log("test/stream_params", float(stream))

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse weights of another residual type: hyper and mhc checkpoints have the same keys."""
        check_checkpoint_hparams(checkpoint, self.hparams, ("residual", "streams"))

    def predict_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The rolled-out frames of each window (as many as it has after ``history``)."""
        frames = batch[0]
        self._check_batch(frames)
        return self.rollout(frames[:, : self.history], frames.shape[1] - self.history)

    def configure_optimizers(self) -> Any:
        stream = {id(p) for p in self.net.stream_parameters()}
        decay, no_decay, streams = [], [], []
        for param in self.parameters():
            if not param.requires_grad:
                continue
            if id(param) in stream:
                streams.append(param)
            elif param.ndim >= 2:
                decay.append(param)
            else:
                no_decay.append(param)
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
        if streams:
            groups.append({"params": streams, "weight_decay": 0.0, "name": "streams"})
        optimizer = self.optimizer(groups)
        for group in optimizer.param_groups:
            if group.get("name") == "streams":
                group["lr"] *= self.stream_lr_scale
        check_param_coverage(self, optimizer)
        if self.lr_scheduler is None:
            return optimizer
        scheduler = self.lr_scheduler(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
