"""Record the scalar metrics of a fit and draw them as training/validation curves in a PNG."""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from ada_modules.errors import InputError

__all__ = ["TrainingCurves", "log_dir_of", "metric_panel", "split_metric_name"]

_STAGE = re.compile(r"^(train|training|val|valid|validation|test)[/_]", re.IGNORECASE)
_FORK = re.compile(r"_(step|epoch)$")


def split_metric_name(name: str) -> tuple[str, str]:
    """The stage (``"train"``, ``"val"``, ``"test"`` or ``""``) and the rest of a metric name.

    Examples:
        >>> split_metric_name("val/loss"), split_metric_name("train_acc"), split_metric_name("lr")
        (('val', 'loss'), ('train', 'acc'), ('', 'lr'))
    """
    match = _STAGE.match(name)
    if not match or match.end() == len(name):
        return "", name
    head = match.group(1).lower()
    stage = "train" if head.startswith("train") else "test" if head == "test" else "val"
    return stage, name[match.end() :]


def metric_panel(name: str) -> str:
    """The panel a metric is drawn in: its name without the stage and the step/epoch suffix.

    ``train/loss``, ``val/loss``, ``train/loss_step`` and ``val_loss`` all go to ``loss``, so a
    panel shows the training and the validation curve of one quantity together.

    Examples:
        >>> metric_panel("train/loss_epoch"), metric_panel("val_acc"), metric_panel("lr-AdamW")
        ('loss', 'acc', 'lr-AdamW')
    """
    rest = split_metric_name(name)[1]
    return _FORK.sub("", rest) or rest


def log_dir_of(trainer: Trainer) -> str | None:
    """The first logger's directory (``log_dir``, else ``save_dir``), ``None`` without a logger.

    Unlike ``trainer.log_dir`` this is not a collective call, so rank zero may call it alone.
    """
    for logger in trainer.loggers:
        directory = getattr(logger, "log_dir", None) or logger.save_dir
        if directory:
            return str(directory)
    return None


class TrainingCurves(Callback):
    """Records the scalar metrics a fit logs and, when the fit ends, draws them in one PNG.

    The history holds what Lightning hands to the loggers (metrics logged with ``logger=True``,
    the default), keyed by the logged name, against ``trainer.global_step``:

    - metrics logged in training steps, every ``every_n_steps`` optimizer steps (default: the
      Trainer's ``log_every_n_steps``; the last value of each interval) and at the last step;
      metrics logged per epoch (``on_epoch=True``) at each epoch end;
    - metrics logged in the validation loop, once per validation (not in the sanity check).

    At the end of the fit (or when it is interrupted), rank zero writes ``filename`` into
    ``dirpath`` (default: the first logger's ``log_dir``, else the Trainer's
    ``default_root_dir``): one panel per quantity (:func:`metric_panel`: ``train/loss`` and
    ``val/loss`` share the panel ``loss``), x the global step; training curves as lines,
    validation curves with markers. ``path`` then holds the file's path. The history is part of
    the callback's checkpoint state (keyed by ``filename``: two of these callbacks in one
    Trainer need different file names), so a resumed fit draws the whole run.

    Args:
        dirpath: Directory of the PNG (``None``: the log directory, see above).
        filename: File name of the PNG.
        every_n_steps: Steps between recorded training values (``None``: ``log_every_n_steps``).
        metrics: ``fnmatch`` patterns of metric names to record (``None``: all), e.g.
            ``["*loss*", "val/*"]``.
        max_columns: Panels per row of the figure.

    Raises:
        ValueError: If ``filename`` does not end in ``.png``, or ``every_n_steps`` or
            ``max_columns`` is not a positive integer.

    Example::

        from lightning.pytorch import Trainer
        from ada_modules.callbacks import TrainingCurves, fit_summary

        curves = TrainingCurves()
        trainer = Trainer(max_steps=500, callbacks=[curves])
        trainer.fit(model, datamodule=data)
        print(curves.path)            # e.g. lightning_logs/version_0/curves.png
        print(curves.history["train/loss"][-1])   # (500, 0.123)
        print(fit_summary(trainer))   # final metrics, checkpoints, log dir, this PNG

    Examples:
        >>> TrainingCurves(filename="run.png", every_n_steps=10).every_n_steps
        10
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "curves.png",
        every_n_steps: int | None = None,
        metrics: Sequence[str] | None = None,
        max_columns: int = 3,
    ) -> None:
        super().__init__()
        if not isinstance(filename, str) or not filename.lower().endswith(".png"):
            raise InputError(f"filename must be a file name ending in .png, got {filename!r}")
        for name, value in (("every_n_steps", every_n_steps), ("max_columns", max_columns)):
            if value is None and name == "every_n_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(metrics, str):
            raise InputError(f"metrics must be a list of name patterns, got the string {metrics!r}")
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.every_n_steps = every_n_steps
        self.metrics = None if metrics is None else [str(p) for p in metrics]
        self.max_columns = max_columns
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.path: Path | None = None
        self._seen: dict[str, Any] = {}  # the metric objects last read, to tell new values apart
        self._pending: dict[str, tuple[int, Any]] = {}  # last training value of each interval
        self._last_flush = 0
        self._before_validation: dict[str, Any] = {}

    @property
    def state_key(self) -> str:
        # By file name only, so that a resumed fit may write elsewhere and keep the history.
        return self._generate_state_key(filename=self.filename)

    # ------------------------------------------------------------------ recording

    def _wanted(self, name: str, value: Any) -> bool:
        if self.metrics is not None and not any(fnmatch.fnmatch(name, p) for p in self.metrics):
            return False
        numel = getattr(value, "numel", None)
        return isinstance(value, (int, float)) or (numel is not None and numel() == 1)

    def _new_values(self, trainer: Trainer) -> dict[str, Any]:
        """Metrics Lightning produced since the last read (it builds new objects for them)."""
        fresh = {}
        for name, value in trainer.logged_metrics.items():
            if self._seen.get(name) is not value and self._wanted(name, value):
                fresh[name] = value
            self._seen[name] = value
        return fresh

    def _record(self, name: str, step: int, value: Any) -> None:
        points = self.history.setdefault(name, [])
        if points and points[-1][0] == step:
            points.pop()  # one value per metric and step: the latest
        points.append((int(step), float(value)))

    def _flush(self, step: int) -> None:
        for name, (at, value) in self._pending.items():
            self._record(name, at, value)
        self._pending.clear()
        self._last_flush = step

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        for name in list(self.history):  # resuming from an earlier point than the history's end
            points = [(s, v) for s, v in self.history[name] if s <= step]
            if points:
                self.history[name] = points
            else:
                del self.history[name]
        self._seen = dict(trainer.logged_metrics)
        self._pending.clear()
        self._last_flush = step
        self.path = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning re-creates the previous epoch's per-epoch values after our epoch-end read.
        self._seen = dict(trainer.logged_metrics)

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        for name, value in self._new_values(trainer).items():
            self._pending[name] = (step, value)
        every = self.every_n_steps or trainer.log_every_n_steps or 1
        if step // every > self._last_flush // every or trainer.should_stop:
            self._flush(step)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush(trainer.global_step)
        for name, value in self._new_values(trainer).items():  # per-epoch training metrics
            self._record(name, trainer.global_step, value)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._before_validation = dict(trainer.logged_metrics)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        before = self._before_validation
        for name, value in trainer.logged_metrics.items():
            if before.get(name) is not value and self._wanted(name, value):
                self._record(name, trainer.global_step, value)
            self._seen[name] = value

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush(trainer.global_step)

    # ------------------------------------------------------------------ writing

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._write_on_rank_zero(trainer)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        if trainer.state.fn == "fit" and self.history:
            self._flush(trainer.global_step)
            try:
                self._write_on_rank_zero(trainer)
            except Exception:  # never hide the exception that stopped the fit
                pass

    def _write_on_rank_zero(self, trainer: Trainer) -> None:
        directory = self.dirpath or log_dir_of(trainer) or trainer.default_root_dir
        if trainer.is_global_zero and self.history:
            self.path = self.write(Path(directory) / self.filename)

    def panels(self) -> dict[str, list[str]]:
        """The recorded metric names by panel (:func:`metric_panel`), in first-seen order."""
        groups: dict[str, list[str]] = {}
        for name in self.history:
            groups.setdefault(metric_panel(name), []).append(name)
        return groups

    def write(self, path: str | Path) -> Path:
        """Draw the recorded history into a PNG at ``path`` (directories are created).

        Returns:
            The path written.

        Raises:
            RuntimeError: If nothing was recorded yet.
        """
        if not self.history:
            raise RuntimeError("TrainingCurves has recorded no metrics yet; nothing to draw")
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        groups = self.panels()
        columns = min(self.max_columns, len(groups))
        rows = math.ceil(len(groups) / columns)
        fig, axes = plt.subplots(
            rows, columns, figsize=(4.2 * columns, 3.0 * rows), dpi=90, squeeze=False
        )
        for ax, (panel, names) in zip(axes.flat, groups.items(), strict=False):
            for name in names:
                steps = [s for s, _ in self.history[name]]
                values = [v for _, v in self.history[name]]
                dots = split_metric_name(name)[0] == "val" or len(steps) <= 50
                marker = "o" if dots else None
                ax.plot(steps, values, marker=marker, markersize=3, linewidth=1.2, label=name)
            ax.set_title(panel, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[len(groups) :]:
            ax.set_visible(False)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"history": {name: [list(p) for p in pts] for name, pts in self.history.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {
            name: [(int(s), float(v)) for s, v in points]
            for name, points in state_dict.get("history", {}).items()
        }
