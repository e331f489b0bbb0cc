"""A small CNN that classifies shapes images, used to judge generated images (accuracy, FD).

:class:`ShapesJudge` is the network (``features`` -> penultimate vector, ``forward`` -> logits),
:class:`ShapesJudgeModule` trains it (``cli_configs/ahpa/judge.yaml``) and exports it to one
file, and :func:`load_shapes_judge` reads it back (by default the shipped
``ada_modules/assets/shapes_judge.pt``). The Fréchet distance between the ``features`` of real
and generated images (:func:`~ada_modules.models.frechet.frechet_distance`) plays the role of FID.
"""

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ada_modules.errors import InputError
from ada_modules.models.autoencoder import ASSETS, _load_asset, _save_asset

__all__ = ["DEFAULT_JUDGE_PATH", "ShapesJudge", "ShapesJudgeModule", "load_shapes_judge"]

DEFAULT_JUDGE_PATH = ASSETS / "shapes_judge.pt"
"""The shipped judge asset, trained by ``ada fit -c cli_configs/ahpa/judge.yaml``."""
_JUDGE_FORMAT = "ada_modules.shapes_judge/1"


class ShapesJudge(nn.Module):
    """A CNN classifier of ``3 x H x W`` images in ``[-1, 1]`` (the shapes' 10 classes).

    One stage per entry of ``channels``: ``3x3`` convolution, batch norm, ReLU, ``2x2``
    max-pool; then a global average pool gives the ``channels[-1]``-dimensional
    :meth:`features` and a linear ``head`` the logits.

    Args:
        channels: Output channels of the stages (at least one).
        num_classes: Number of classes (``>= 2``).

    Raises:
        InputError: If an argument is out of range, naming the argument.

    Examples:
        >>> judge = ShapesJudge()
        >>> images = torch.zeros(2, 3, 32, 32)
        >>> tuple(judge.features(images).shape), tuple(judge(images).shape)
        ((2, 128), (2, 10))
    """

    def __init__(self, channels: Sequence[int] = (32, 64, 128), num_classes: int = 10) -> None:
        super().__init__()
        channels = list(channels) if isinstance(channels, Sequence) else channels
        if (
            not isinstance(channels, list)
            or not channels
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in channels)
        ):
            raise InputError(
                f"channels must be a non-empty list of positive ints, got {channels!r}"
            )
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise InputError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        self.channels = channels
        self.num_classes = num_classes
        layers: list[nn.Module] = []
        previous = 3
        for out in channels:
            layers += [
                nn.Conv2d(previous, out, 3, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            previous = out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.trunk = nn.Sequential(*layers)
        self.head = nn.Linear(previous, num_classes)

    @property
    def feature_dim(self) -> int:
        """Width ``F`` of :meth:`features`."""
        return self.channels[-1]

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Penultimate features, shape ``(n, feature_dim)``, of images ``(n, 3, H, W)``."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise InputError(f"images must have shape (n, 3, H, W), got {tuple(images.shape)}")
        return self.trunk(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits, shape ``(n, num_classes)``."""
        return self.head(self.features(images))


class ShapesJudgeModule(LightningModule):
    """Trains a :class:`ShapesJudge` by cross-entropy on ``(images, labels)`` batches.

    Logs ``train/loss``, ``val/loss``, ``val/accuracy``, ``test/loss`` and ``test/accuracy``.

    Args:
        channels: Output channels of the judge's stages (see :class:`ShapesJudge`).
        num_classes: Number of classes.
        optimizer: Builds the optimizer from the parameters (injected, see :mod:`ada_modules.cli`).
        lr_scheduler: Builds a per-step learning-rate scheduler from the optimizer, if given.
        export_path: If set, :meth:`on_fit_end` exports the judge there (:meth:`export`).

    Raises:
        InputError: If an argument is out of range, naming the argument.

    Examples:
        >>> module = ShapesJudgeModule()
        >>> batch = (torch.zeros(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
        >>> module.training_step(batch, 0).ndim
        0

        In YAML::

            model:
              class_path: ada_modules.models.ShapesJudgeModule
              init_args:
                export_path: ada_modules/assets/shapes_judge.pt
                optimizer:
                  class_path: torch.optim.AdamW
                  init_args: {lr: 0.003}
    """

    def __init__(
        self,
        channels: list[int] | None = None,
        num_classes: int = 10,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        export_path: str | None = None,
    ) -> None:
        super().__init__()
        if export_path is not None and (not isinstance(export_path, str) or not export_path):
            raise InputError(f"export_path must be None or a non-empty path, got {export_path!r}")
        self.judge = ShapesJudge([32, 64, 128] if channels is None else channels, num_classes)
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.export_path = export_path
        self.eval_metrics = nn.ModuleDict(
            {
                **{f"{s}_loss": MeanMetric() for s in ("val", "test")},
                **{
                    f"{s}_accuracy": MulticlassAccuracy(num_classes, average="micro")
                    for s in ("val", "test")
                },
            }
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits of ``images``."""
        return self.judge(images)

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=labels.shape[0])
        return loss

    def _evaluate(self, batch: Sequence[torch.Tensor], stage: str) -> None:
        images, labels = batch
        logits = self(images)
        loss = self.eval_metrics[f"{stage}_loss"]
        accuracy = self.eval_metrics[f"{stage}_accuracy"]
        loss.update(nn.functional.cross_entropy(logits, labels), labels.shape[0])
        accuracy.update(logits, labels)
        self.log(f"{stage}/loss", loss, batch_size=labels.shape[0])
        self.log(f"{stage}/accuracy", accuracy, prog_bar=True, batch_size=labels.shape[0])

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Predicted class per image."""
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.optimizer(self.parameters())
        config: dict[str, Any] = {"optimizer": optimizer}
        if self.lr_scheduler is not None:
            config["lr_scheduler"] = {"scheduler": self.lr_scheduler(optimizer), "interval": "step"}
        return config

    def export(self, path: str | os.PathLike[str]) -> Path:
        """Write the judge to ``path`` (one file, atomically) and return ``path``.

        The file (``torch.save``) holds ``{"format", "config", "state_dict"}``: the
        :class:`ShapesJudge` arguments and its fp32 state dict (batch-norm statistics included).

        Examples:
            >>> import tempfile
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     judge = load_shapes_judge(ShapesJudgeModule().export(f"{folder}/judge.pt"))
            >>> judge.feature_dim, judge.training
            (128, False)
        """
        config = {"channels": list(self.judge.channels), "num_classes": self.judge.num_classes}
        state = {k: v.detach().to("cpu").clone() for k, v in self.judge.state_dict().items()}
        return _save_asset({"format": _JUDGE_FORMAT, "config": config, "state_dict": state}, path)

    def on_fit_end(self) -> None:
        """Export to ``export_path`` (if set) on the global-zero process."""
        if self.export_path is not None and self.trainer.is_global_zero:
            self.export(self.export_path)


def load_shapes_judge(path: str | os.PathLike[str] | None = None) -> ShapesJudge:
    """Load an exported judge (default: the shipped ``ada_modules/assets/shapes_judge.pt``).

    The judge comes back in fp32, in eval mode, with ``requires_grad`` off, on the CPU.

    Raises:
        InputError: If the file is missing or is not a :meth:`ShapesJudgeModule.export` file.

    Examples:
        >>> from ada_modules.data.shapes import generate_shapes
        >>> images, labels = generate_shapes(100, seed=12345)
        >>> judge = load_shapes_judge()
        >>> with torch.no_grad():
        ...     accuracy = (judge(images).argmax(1) == labels).float().mean().item()
        >>> accuracy >= 0.9, tuple(judge.features(images).shape)
        (True, (100, 128))
    """
    target = DEFAULT_JUDGE_PATH if path is None else Path(path)
    data = _load_asset(target, _JUDGE_FORMAT, ("config", "state_dict"), "shapes judge")
    try:
        judge = ShapesJudge(**data["config"])
        judge.load_state_dict(data["state_dict"])
    except (TypeError, RuntimeError) as error:
        raise InputError(f"{target}: the weights do not fit the saved config ({error})") from error
    return judge.float().eval().requires_grad_(False)
