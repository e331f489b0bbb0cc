"""LightningModules that train a neural cellular automaton to solve grid puzzles (mazes, Sudoku)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from ada_modules.data.mazes import maze_solved
from ada_modules.data.sudoku import sudoku_answer, sudoku_solved
from ada_modules.errors import InputError
from ada_modules.models._checkpoint import check_checkpoint_hparams
from ada_modules.nn.anca import Backend, NeuralCellularAutomaton
from ada_modules.optim.param_groups import geometry_param_groups

__all__ = ["MazeNCAModule", "NCASolverModule", "SudokuNCAModule"]


def _check_steps(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be an integer >= 1, got {value!r}")


class NCASolverModule(LightningModule):
    """Trains a :class:`~ada_modules.nn.anca.NeuralCellularAutomaton` to classify every cell.

    Batches are ``(inputs, target)``: ``inputs`` ``(B, in_channels, H, W)`` re-injected every
    step, ``target`` ``(B, H, W)`` class indices. Training runs a number of steps drawn uniformly
    from ``[min_steps, steps]`` per batch (so the answer must hold over a range of steps, not at
    one step count) and minimises the cross-entropy of the final readout over the cells
    :meth:`loss_mask` selects. Evaluation runs ``eval_steps`` and logs ``{stage}/exact`` (the
    fraction of puzzles solved whole, by :meth:`solved`) and ``{stage}/cell_acc`` (over the
    scored cells). A subclass names the task: :class:`MazeNCAModule`, :class:`SudokuNCAModule`.

    Args:
        in_channels: Channels of the inputs.
        num_classes: Classes per cell.
        state_channels: Hidden state channels of a cell.
        hidden_channels: Channels of the perception and the update.
        deformable: aNCA's deformable perception; ``False``: the plain NCA.
        max_offset: Largest tap displacement, in cells.
        modulation: Modulated taps.
        fire_rate: Probability that a cell updates at a step (also at evaluation: the rule is
            stochastic when below 1; seed it for reproducible scores).
        backend: Deformable convolution backend (``"auto"``: torchvision on CUDA, grid_sample
            on CPU).
        steps: Most steps of a training forward pass.
        min_steps: Fewest steps of a training forward pass (default ``steps``).
        eval_steps: Steps at validation, test and predict (default ``steps``; more for larger
            grids).
        param_groups: ``"all"``: the optimizer gets every parameter in one group;
            ``"geometry"``: one group per layer role, for the geometry-aware optimizers
            (:func:`~ada_modules.optim.param_groups.geometry_param_groups`; e.g.
            :class:`~ada_modules.optim.AcceleGradSharp`, :class:`~ada_modules.optim.Scion`).
        optimizer: Builds the optimizer from the parameters.
        lr_scheduler: Builds a per-step learning-rate scheduler, if given.

    Raises:
        ValueError: If an argument is out of range, naming it.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        state_channels: int = 32,
        hidden_channels: int = 64,
        deformable: bool = True,
        max_offset: float = 2.0,
        modulation: bool = True,
        fire_rate: float = 1.0,
        backend: Backend = "auto",
        steps: int = 30,
        min_steps: int | None = None,
        eval_steps: int | None = None,
        param_groups: Literal["all", "geometry"] = "all",
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        _check_steps("steps", steps)
        _check_steps("min_steps", min_steps, allow_none=True)
        _check_steps("eval_steps", eval_steps, allow_none=True)
        if min_steps is not None and min_steps > steps:
            raise InputError(f"min_steps must be <= steps={steps}, got {min_steps!r}")
        if param_groups not in ("all", "geometry"):
            raise InputError(f"param_groups must be 'all' or 'geometry', got {param_groups!r}")
        # a task subclass fixes in_channels and num_classes: not among its own arguments
        self.save_hyperparameters(
            ignore=["optimizer", "lr_scheduler", "in_channels", "num_classes"]
        )
        self.nca = NeuralCellularAutomaton(
            in_channels,
            num_classes,
            state_channels=state_channels,
            hidden_channels=hidden_channels,
            deformable=deformable,
            max_offset=max_offset,
            modulation=modulation,
            fire_rate=fire_rate,
            backend=backend,
        )
        self.steps, self.min_steps = steps, min_steps or steps
        self.eval_steps = eval_steps or steps
        self.param_groups = param_groups
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler

    def forward(self, inputs: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """Per-cell logits ``(B, classes, H, W)`` after ``steps`` (default ``eval_steps``)."""
        return self.nca(inputs, self.eval_steps if steps is None else steps)

    def loss_mask(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The cells that count in the loss (``None``: all of them)."""
        return None

    def score_mask(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The cells that count in the cell accuracy (default: those of the loss)."""
        return self.loss_mask(inputs)

    def predict(self, inputs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The per-cell answer ``(B, H, W)`` read from the logits."""
        return logits.argmax(dim=1)

    def solved(
        self, prediction: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        """Whether each puzzle of the batch is solved, ``(B,)`` bool."""
        raise NotImplementedError

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        steps = int(torch.randint(self.min_steps, self.steps + 1, ()))
        logits = self.nca(inputs, steps)
        loss = F.cross_entropy(logits, target, reduction="none")
        mask = self.loss_mask(inputs)
        loss = loss.mean() if mask is None else (loss * mask).sum() / mask.sum().clamp_min(1)
        self.log("train/loss", loss, prog_bar=True, batch_size=inputs.shape[0])
        return loss

    def _evaluate(self, batch: Sequence[torch.Tensor], stage: str) -> None:
        inputs, target = batch[0], batch[1]
        prediction = self.predict(inputs, self(inputs))
        correct = (prediction == target).float()
        mask = self.score_mask(inputs)
        cell_acc = correct.mean() if mask is None else (correct * mask).sum() / mask.sum()
        batch_size = inputs.shape[0]
        solved = self.solved(prediction, inputs, target).float().mean()
        self.log(f"{stage}/exact", solved, prog_bar=True, batch_size=batch_size)
        self.log(f"{stage}/cell_acc", cell_acc, batch_size=batch_size)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse the weights of the other perception: the error names both settings."""
        check_checkpoint_hparams(checkpoint, self.hparams, ("deformable", "modulation"))

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The per-cell answers ``(B, H, W)`` after ``eval_steps``."""
        inputs = batch[0]
        return self.predict(inputs, self(inputs))

    def configure_optimizers(self) -> Any:
        if self.param_groups == "geometry":
            optimizer = self.optimizer(geometry_param_groups(self.nca))
        else:
            optimizer = self.optimizer(self.parameters())
        if self.lr_scheduler is None:
            return optimizer
        scheduler = self.lr_scheduler(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class MazeNCAModule(NCASolverModule):
    """Shortest paths through mazes: per cell, on the path or not.

    Batches as :class:`~ada_modules.data.MazeDataModule` gives them: inputs ``(B, 3, H, W)``
    (corridors, start, end), target ``(B, H, W)`` the path mask. A maze counts as solved when the
    whole predicted mask equals the shortest path; the cell accuracy counts the corridor cells
    (walls are never on the path).

    Args:
        kwargs: The arguments of :class:`NCASolverModule` but ``in_channels`` and
            ``num_classes``.

    Examples:
        >>> module = MazeNCAModule(state_channels=8, hidden_channels=16, steps=4)
        >>> module(torch.zeros(2, 3, 11, 11)).shape
        torch.Size([2, 2, 11, 11])

        In YAML::

            model:
              class_path: ada_modules.models.MazeNCAModule
              init_args: {deformable: true, steps: 30, eval_steps: 60}
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(in_channels=3, num_classes=2, **kwargs)

    def score_mask(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs[:, 0]

    def solved(
        self, prediction: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        return maze_solved(prediction, target)


class SudokuNCAModule(NCASolverModule):
    """Sudoku: per cell, its digit.

    Batches as :class:`~ada_modules.data.SudokuDataModule` gives them: inputs ``(B, n + 1, n, n)``
    one-hot (channel 0: blank), target ``(B, n, n)`` digit − 1. The loss and the cell accuracy
    count the blank cells; the answer keeps the givens and takes the argmax elsewhere, and a
    puzzle counts as solved when every row, column and box holds each digit once (whether or not
    it equals the reference solution).

    Args:
        box: Side of a box (3: 9x9 Sudoku, 2: 4x4).
        kwargs: The arguments of :class:`NCASolverModule` but ``in_channels`` and
            ``num_classes``.

    Examples:
        >>> module = SudokuNCAModule(box=2, state_channels=8, hidden_channels=16, steps=4)
        >>> module(torch.zeros(2, 5, 4, 4)).shape
        torch.Size([2, 4, 4, 4])
    """

    def __init__(self, box: int = 3, **kwargs: Any) -> None:
        if type(box) is not int or box not in (2, 3):
            raise InputError(f"box must be 2 or 3, got {box!r}")
        super().__init__(in_channels=box * box + 1, num_classes=box * box, **kwargs)

    def loss_mask(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs[:, 0]

    def predict(self, inputs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return sudoku_answer(inputs, logits)

    def solved(
        self, prediction: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        return sudoku_solved(prediction + 1, inputs.argmax(dim=1))
