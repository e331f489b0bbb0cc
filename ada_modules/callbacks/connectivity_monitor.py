"""Log the learned residual connectivity of ANCRe routers during training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ada_modules.errors import InputError
from ada_modules.nn.ancre import find_routers
from ada_modules.nn.ancre_router import ConnectivityRouter

__all__ = ["ConnectivityMonitor", "render_connectivity"]


def render_connectivity(matrix: torch.Tensor, title: str = "") -> np.ndarray:
    """An RGB image ``(height, width, 3)``, ``uint8``, of a connectivity matrix.

    Rows are the routed layers (block inputs or shortcuts), columns the source states ``x_0..x_K``.

    Examples:
        >>> render_connectivity(torch.eye(3, 4)).dtype
        dtype('uint8')
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows, cols = matrix.shape
    fig, ax = plt.subplots(figsize=(1.5 + 0.25 * cols, 1.2 + 0.25 * rows), dpi=80)
    image = ax.imshow(matrix.numpy(), cmap="viridis", aspect="auto")
    ax.set_xlabel("source state j")
    ax.set_ylabel("layer i")
    if title:
        ax.set_title(title, fontsize=8)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return rgb


class ConnectivityMonitor(Callback):
    """Every ``every_n_steps`` training steps, logs each router's connectivity matrix.

    For every :class:`~ada_modules.nn.ancre_router.ConnectivityRouter` in the LightningModule
    (named by its module path, e.g. ``model.model.connectivity``) it logs, through each of the
    trainer's loggers (like ``LearningRateMonitor``), the entropy (nats) of each layer's normalised
    coefficient row as ``connectivity/<router>/entropy_<i>`` and their mean as
    ``connectivity/<router>/entropy``, and, with ``log_images=True``, an image of the matrix:
    through ``logger.log_image`` (W&B), ``logger.experiment.add_image`` (TensorBoard), or else as
    a PNG file in ``<logger.log_dir or default_root_dir>/connectivity/``.

    Args:
        every_n_steps: Logging period in optimizer steps.
        log_images: Also log images of the matrices.

    Raises:
        ValueError: If ``every_n_steps`` is not a positive integer.

    Example::

        from lightning.pytorch import Trainer
        from ada_modules.callbacks import ConnectivityMonitor

        trainer = Trainer(callbacks=[ConnectivityMonitor(every_n_steps=100)])

    Examples:
        >>> ConnectivityMonitor(every_n_steps=50).every_n_steps
        50
    """

    def __init__(self, every_n_steps: int = 100, log_images: bool = True) -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise InputError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
        if every_n_steps < 1:
            raise InputError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.log_images = log_images
        self.last_logged_step = -1

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step == self.last_logged_step:
            return
        self.last_logged_step = step
        for name, router in find_routers(pl_module):
            self._log_router(trainer, name or "router", router, step)

    def _log_router(
        self,
        trainer: Trainer,
        name: str,
        router: ConnectivityRouter,
        step: int,
    ) -> None:
        entropies = router.entropies()
        metrics = {f"connectivity/{name}/entropy_{i}": v for i, v in enumerate(entropies.tolist())}
        metrics[f"connectivity/{name}/entropy"] = entropies.mean().item()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if not self.log_images or trainer.sanity_checking:
            return
        key = f"connectivity/{name}"
        image = render_connectivity(router.connectivity(), f"{name} step {step}")
        written = False
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key=key, images=[image], step=step)
                written = True
            elif hasattr(getattr(logger, "experiment", None), "add_image"):
                logger.experiment.add_image(key, image, step, dataformats="HWC")
                written = True
        if not written and trainer.is_global_zero:
            root = trainer.loggers[0].log_dir if trainer.loggers else None
            folder = Path(root or trainer.default_root_dir) / "connectivity"
            folder.mkdir(parents=True, exist_ok=True)
            from PIL import Image

            Image.fromarray(image).save(folder / f"{name.replace('.', '_')}_step{step}.png")

    def state_dict(self) -> dict[str, Any]:
        return {"last_logged_step": self.last_logged_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_logged_step = int(state_dict["last_logged_step"])
