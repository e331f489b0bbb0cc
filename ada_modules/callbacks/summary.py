"""A few lines that say how a fit ended: final metrics, checkpoints, logs and curves."""

from __future__ import annotations

import math
import textwrap

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from ada_modules.callbacks.training_curves import TrainingCurves, log_dir_of, split_metric_name

__all__ = ["fit_summary"]

_STAGES = ("train", "val", "test")


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def fit_summary(trainer: Trainer, width: int = 100) -> str:
    """A short multi-line summary of a finished (or interrupted) fit.

    Lines: the global step reached; the final value of each scalar in
    ``trainer.callback_metrics``, one line per stage (``train``, ``val``, ``test``, then any
    others; a metric logged both per step and per epoch is shown once, by its plain name); for
    each ``ModelCheckpoint`` the best checkpoint (with its monitored score) and the last one; the
    first logger's directory; and the PNG of each :class:`TrainingCurves` callback that wrote one.
    It reads only the Trainer's state (no collective calls), so rank zero may call it alone.

    Args:
        trainer: The Trainer after ``fit``.
        width: Wrap the metric lines at this many characters.

    Returns:
        The summary, lines joined by ``"\\n"``, without a trailing newline.

    Example::

        from ada_modules.callbacks import TrainingCurves, fit_summary

        trainer = Trainer(max_steps=2000, callbacks=[TrainingCurves(), ModelCheckpoint(...)])
        trainer.fit(model, datamodule=data)
        if trainer.is_global_zero:
            print(fit_summary(trainer))
        # Fit ended at step 2,000.
        #   train: loss=0.0412
        #   val:   exact_match=0.998, loss=0.0398
        #   best checkpoint: runs/quickstart/checkpoints/best.ckpt (val/exact_match=0.998)
        #   last checkpoint: runs/quickstart/checkpoints/last.ckpt
        #   logs: runs/quickstart/logs/version_0
        #   curves: runs/quickstart/logs/version_0/curves.png
    """
    state = " (interrupted)" if trainer.interrupted else ""
    lines = [f"Fit ended at step {trainer.global_step:,}{state}."]

    metrics = {}
    for name, value in trainer.callback_metrics.items():
        numel = getattr(value, "numel", None)
        if isinstance(value, (int, float)) or (numel is not None and numel() == 1):
            metrics[name] = float(value)
    by_stage: dict[str, list[str]] = {}
    for name in sorted(metrics):
        if name.endswith(("_step", "_epoch")) and name.rsplit("_", 1)[0] in metrics:
            continue  # shown by its plain name
        stage, short = split_metric_name(name)
        stage = stage or "other"
        by_stage.setdefault(stage, []).append(f"{short}={_number(metrics[name])}")
    for stage in (*_STAGES, "other"):
        if stage in by_stage:
            head = f"  {stage + ':':<7}"
            text = ", ".join(by_stage[stage])
            lines.extend(
                textwrap.wrap(
                    text,
                    width=width,
                    initial_indent=head,
                    subsequent_indent=" " * len(head),
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
    if not metrics:
        lines.append("  metrics: none logged")

    checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    saved = False
    for checkpoint in checkpoints:
        if checkpoint.best_model_path:
            saved = True
            if checkpoint.monitor and checkpoint.best_model_score is not None:
                score = _number(float(checkpoint.best_model_score))
                lines.append(
                    f"  best checkpoint: {checkpoint.best_model_path} "
                    f"({checkpoint.monitor}={score})"
                )
            elif checkpoint.best_model_path != checkpoint.last_model_path:
                lines.append(f"  checkpoint: {checkpoint.best_model_path}")
        if checkpoint.last_model_path:
            saved = True
            lines.append(f"  last checkpoint: {checkpoint.last_model_path}")
    if not saved:
        lines.append("  checkpoints: none saved")

    log_dir = log_dir_of(trainer)
    lines.append(f"  logs: {log_dir}" if log_dir else "  logs: none (no logger)")
    for callback in trainer.callbacks:
        if isinstance(callback, TrainingCurves) and callback.path is not None:
            lines.append(f"  curves: {callback.path}")
    return "\n".join(lines)
