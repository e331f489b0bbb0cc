"""A small MLP or CNN image classifier, the task on which optimizers are compared."""

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.optim import Optimizer
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from ada_modules.errors import InputError
from ada_modules.optim.chain import OptimizerChain
from ada_modules.optim.param_groups import (
    check_param_coverage,
    check_radii,
    geometry_param_groups,
    split_param_groups,
)
from ada_modules.strategies.sharding import shard_module

__all__ = ["ImageClassifierModule"]

_COUPLING_KEY = "ada_coupling_state_dict"


class ImageClassifierModule(LightningModule):
    """Classifies small images with an MLP or a CNN trained by cross-entropy.

    ``architecture="mlp"`` flattens the image and applies ``Linear + ReLU`` layers of widths
    ``hidden_sizes``; ``"cnn"`` first applies ``3x3`` convolutions (``channels``, ``ReLU``, one
    ``2x2`` max-pool at the end) and then the same MLP. The last layer, ``head``, maps to
    ``num_classes`` logits. Inputs may be flat (``(batch, C*H*W)``) or images (``(batch, C, H,
    W)``). Logs ``train/loss``, ``val/loss``, ``val/accuracy``, ``test/loss`` and
    ``test/accuracy``.

    Optimizers are injected (see :mod:`ada_modules.cli`):

    - ``param_groups="all"`` passes ``self.parameters()`` to ``optimizer``; ``"geometry"`` passes
      :func:`~ada_modules.optim.param_groups.geometry_param_groups` (a norm per layer role:
      spectral hidden weights, spectral-conv convolutions, RMS biases, sign head), which
      :class:`~ada_modules.optim.scion.Scion` and
      :class:`~ada_modules.optim.accelegrad_sharp.AcceleGradSharp` read and other optimizers ignore.
    - ``aux_optimizer`` (the "Muon for the matrices, AdamW for the rest" recipe): the 2-D hidden
      weight matrices go to ``optimizer`` and every other parameter (convolutions, biases, the
      head) to ``aux_optimizer``. The two are chained into one ``torch.optim.Optimizer`` that steps
      both, so training stays on Lightning's automatic optimization: ``max_steps`` counts batches,
      gradient clipping and mixed precision apply to both, and the checkpoint holds both states.
      ``lr_scheduler`` then schedules every group of both (each from its own initial lr).

    Output iterate: optimizers whose parameters hold a coupling point rather than their output
    (:class:`~ada_modules.optim.accelegrad.AcceleGrad`,
    :class:`~ada_modules.optim.accelegrad_sharp.AcceleGradSharp`) have a ``swap_output()`` context
    manager. Validation and test run inside it (entered in ``on_{validation,test}_epoch_start``,
    exited at the epoch end), so they score the method's output iterate and training resumes at
    the coupling point. Checkpoints store the output iterate as the model weights (what
    ``ada test --ckpt_path``, ``load_from_checkpoint`` and deployment see) and the coupling point
    under ``"ada_coupling_state_dict"``, which ``fit`` restores when it resumes.

    Args:
        architecture: ``"mlp"`` or ``"cnn"``.
        hidden_sizes: Widths of the hidden ``Linear`` layers (may be empty: a linear model).
        channels: Output channels of the convolutions (``"cnn"`` only; at least one).
        in_channels: Channels of the input images.
        image_size: Height and width of the (square) input images.
        num_classes: Number of classes.
        optimizer: Builds the optimizer from the parameters or groups (see above).
        aux_optimizer: If given, builds the optimizer of the parameters that are not 2-D hidden
            weight matrices (see above).
        lr_scheduler: Builds a per-step learning-rate scheduler from the optimizer, if given.
        param_groups: ``"all"`` or ``"geometry"`` (see above).
        radii: With ``param_groups="geometry"``, a ``radius`` per layer role (``"hidden"``,
            ``"conv"``, ``"vector"``, ``"head"``): Scion's norm-ball radius ``rho``, AcceleGrad#'s
            clip in its ``"lmo"`` geometry. ``None`` keeps the optimizer's ``radius``.
        trunk: If given, called with the width of the last hidden layer to build a
            shape-preserving module applied between the hidden layers and the head (e.g.
            :class:`~ada_modules.nn.MLPResNet`, a deep residual trunk); ``None``: no trunk.

    The callables (``optimizer``, ``aux_optimizer``, ``lr_scheduler``, ``trunk``) are not saved as
    hyperparameters.

    Raises:
        ValueError: If an argument is out of range, naming the argument; in
            ``configure_optimizers``, if ``aux_optimizer`` is set and the model has no 2-D hidden
            weight or nothing else.

    Examples:
        >>> from functools import partial
        >>> module = ImageClassifierModule(
        ...     hidden_sizes=[32], optimizer=partial(torch.optim.Muon, lr=0.02),
        ...     aux_optimizer=partial(torch.optim.AdamW, lr=1e-3))
        >>> module(torch.rand(5, 64)).shape
        torch.Size([5, 10])
        >>> config = module.configure_optimizers()
        >>> [type(opt).__name__ for opt in config["optimizer"].optimizers]
        ['Muon', 'AdamW']

        In YAML::

            model:
              class_path: ada_modules.models.ImageClassifierModule
              init_args:
                hidden_sizes: [128, 128]
                param_groups: geometry
                optimizer:
                  class_path: ada_modules.optim.AcceleGradSharp
                  init_args: {lr: 0.1}
    """

    def __init__(
        self,
        architecture: Literal["mlp", "cnn"] = "mlp",
        hidden_sizes: list[int] | None = None,
        channels: list[int] | None = None,
        in_channels: int = 1,
        image_size: int = 8,
        num_classes: int = 10,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        aux_optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        param_groups: Literal["all", "geometry"] = "all",
        radii: dict[str, float] | None = None,
        trunk: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        if architecture not in ("mlp", "cnn"):
            raise InputError(f"architecture must be 'mlp' or 'cnn', got {architecture!r}")
        if param_groups not in ("all", "geometry"):
            raise InputError(f"param_groups must be 'all' or 'geometry', got {param_groups!r}")
        if radii is not None and param_groups != "geometry":
            raise InputError("radii needs param_groups='geometry'")
        check_radii(radii)
        hidden_sizes = [128] if hidden_sizes is None else list(hidden_sizes)
        channels = [16, 32] if channels is None else list(channels)
        _check_sizes("hidden_sizes", hidden_sizes, allow_empty=True)
        _check_sizes("channels", channels, allow_empty=False)
        for name, value, low in (
            ("in_channels", in_channels, 1),
            ("image_size", image_size, 2 if architecture == "cnn" else 1),
            ("num_classes", num_classes, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        self.save_hyperparameters(ignore=["optimizer", "aux_optimizer", "lr_scheduler", "trunk"])
        self.optimizer = optimizer
        self.aux_optimizer = aux_optimizer
        self.lr_scheduler = lr_scheduler
        self.param_groups = param_groups
        self.radii = radii
        self.input_shape = (in_channels, image_size, image_size)

        layers: list[nn.Module] = []
        width = in_channels * image_size * image_size
        if architecture == "cnn":
            previous = in_channels
            for out in channels:
                layers += [nn.Conv2d(previous, out, 3, padding=1), nn.ReLU()]
                previous = out
            layers.append(nn.MaxPool2d(2))
            width = previous * (image_size // 2) ** 2
        layers.append(nn.Flatten())
        for size in hidden_sizes:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        if trunk is not None:
            layers.append(trunk(width))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)
        self.eval_metrics = nn.ModuleDict(
            {
                **{f"{s}_loss": MeanMetric() for s in ("val", "test")},
                **{
                    f"{s}_accuracy": MulticlassAccuracy(num_classes, average="micro")
                    for s in ("val", "test")
                },
            }
        )
        self._swap = ExitStack()

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` or ``AdERAStrategy``: FSDP2 per layer, then the roots.

        Each layer with parameters of ``features`` (``trunk`` as one block) is a block, then
        ``features`` and ``head`` are wrapped as roots (:func:`~ada_modules.strategies.shard_module`).
        Without a device mesh the model stays as it is.
        """
        shard_module(self, self.device_mesh)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits, shape ``(batch, num_classes)``, of flat or image-shaped inputs."""
        return self.head(self.features(images.reshape(-1, *self.input_shape)))

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

    # Evaluation at the optimizer's output iterate ---------------------------------------------

    def _output_swaps(self) -> Iterator[Any]:
        """``swap_output()`` contexts of the trainer's optimizers that have one."""
        trainer = self._trainer
        for optimizer in trainer.optimizers if trainer is not None else []:
            for opt in getattr(optimizer, "optimizers", [optimizer]):
                if hasattr(opt, "swap_output"):
                    yield opt.swap_output()

    def _enter_output(self) -> None:
        for swap in self._output_swaps():
            self._swap.enter_context(swap)

    def _exit_output(self) -> None:
        self._swap.close()

    def on_validation_epoch_start(self) -> None:
        self._enter_output()

    def on_validation_epoch_end(self) -> None:
        self._exit_output()

    def on_test_epoch_start(self) -> None:
        self._enter_output()

    def on_test_epoch_end(self) -> None:
        self._exit_output()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        swaps = list(self._output_swaps())
        if not swaps:
            return
        with ExitStack() as stack:
            for swap in swaps:
                stack.enter_context(swap)
            output = {k: v.detach().clone() for k, v in self.state_dict().items()}
        checkpoint[_COUPLING_KEY] = checkpoint["state_dict"]
        checkpoint["state_dict"] = output

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainer = self._trainer
        if _COUPLING_KEY in checkpoint and trainer is not None and trainer.state.fn == "fit":
            checkpoint["state_dict"] = checkpoint[_COUPLING_KEY]

    # Optimizers ---------------------------------------------------------------------------------

    def _groups(self) -> list[dict[str, Any]]:
        if self.param_groups == "all":
            return [{"params": [p for p in self.parameters() if p.requires_grad]}]
        return geometry_param_groups(self, head="head", radii=self.radii)

    def configure_optimizers(self) -> dict[str, Any]:
        groups = self._groups()
        if self.aux_optimizer is None:
            optimizer: Optimizer = self.optimizer(groups)
        else:
            hidden = [p for p in self.parameters() if p.ndim == 2 and p is not self.head.weight]
            main, aux = split_param_groups(groups, hidden)
            if not main or not aux:
                raise InputError(
                    "aux_optimizer needs both 2-D hidden weight matrices (for optimizer) and other "
                    "parameters (for aux_optimizer); set hidden_sizes or drop aux_optimizer"
                )
            optimizer = OptimizerChain([self.optimizer(main), self.aux_optimizer(aux)])
        check_param_coverage(self, optimizer)
        config: dict[str, Any] = {"optimizer": optimizer}
        if self.lr_scheduler is not None:
            config["lr_scheduler"] = {
                "scheduler": self.lr_scheduler(optimizer),
                "interval": "step",
            }
        return config


def _check_sizes(name: str, sizes: list[int], allow_empty: bool) -> None:
    if not allow_empty and not sizes:
        raise InputError(f"{name} must not be empty")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InputError(f"{name} must be positive integers, got {sizes!r}")
