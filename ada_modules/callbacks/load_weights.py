"""Start ``fit`` from the weights of a checkpoint: fine-tuning, as opposed to resuming."""

from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ada_modules.errors import InputError

__all__ = ["LoadWeights"]


class LoadWeights(Callback):
    """Loads a checkpoint's model weights when ``fit`` starts, and nothing else.

    ``ckpt_path`` resumes a run (optimizer state, epoch and step counters); fine-tuning a trained
    model on new data wants only its weights, with a fresh optimizer and schedule. The file may be
    a Lightning checkpoint (its ``state_dict``) or a plain state dict saved with ``torch.save``. It
    is read in ``on_fit_start`` (so a config can name a checkpoint that an earlier run of the same
    sweep is still writing) and loaded with ``load_state_dict(strict=strict)``.

    Args:
        path: The checkpoint file.
        strict: Require the keys of the checkpoint and the model to match exactly.

    Raises:
        InputError: When ``fit`` starts, if the file is missing, if ``fit`` also resumes from a
            ``ckpt_path``, or if the weights do not fit the model (naming the first bad key).

    Example::

        trainer = Trainer(callbacks=[LoadWeights("runs/base/checkpoints/last.ckpt")])
        trainer.fit(model, datamodule=specialist_data)

        # in YAML
        trainer:
          callbacks:
            - class_path: ada_modules.callbacks.LoadWeights
              init_args: {path: runs/base/checkpoints/last.ckpt}
    """

    def __init__(self, path: str, strict: bool = True) -> None:
        if not isinstance(path, str | Path) or not str(path):
            raise InputError(f"path must be a checkpoint file path, got {path!r}")
        self.path = Path(path)
        self.strict = strict

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is not None:
            raise InputError(
                f"LoadWeights({str(self.path)!r}) starts from weights only, but fit also resumes "
                f"from ckpt_path={trainer.ckpt_path!r}; use one of the two"
            )
        if not self.path.is_file():
            raise InputError(f"LoadWeights: checkpoint not found: {self.path}")
        checkpoint = torch.load(self.path, map_location="cpu", weights_only=False)
        state = checkpoint.get("state_dict", checkpoint)
        own = pl_module.state_dict()
        for key, value in state.items():
            if key in own and own[key].shape != value.shape:
                raise InputError(
                    f"LoadWeights: {key!r} has shape {tuple(value.shape)} in {self.path}, the "
                    f"model's is {tuple(own[key].shape)}"
                )
        missing = [key for key in own if key not in state]
        unexpected = [key for key in state if key not in own]
        if self.strict and (missing or unexpected):
            what = f"missing key {missing[0]!r}" if missing else f"unexpected key {unexpected[0]!r}"
            raise InputError(f"LoadWeights: {self.path} does not fit the model: {what}")
        pl_module.load_state_dict(state, strict=False)  # checked above: nothing half-loaded
