"""A Callback that profiles each layer's Average Attention Distance during validation and test."""

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from ada_modules.callbacks.training_curves import log_dir_of
from ada_modules.errors import InputError
from ada_modules.kv.aad import AADAccumulator, AADProfile

__all__ = ["AADProfiler"]

_LOOPS = ("validation", "test")


class AADProfiler(Callback):
    """Measures the Average Attention Distance (AAD) of a Hugging Face causal LM on eval batches.

    On each of the first ``max_batches`` batches of the chosen evaluation loops the callback runs
    one extra forward pass of the wrapped model with ``output_attentions=True`` (switching the
    model to eager attention for that pass only, then back), and accumulates the AAD of every
    layer, head and real token position with :class:`~ada_modules.kv.AADAccumulator` (padding on
    either side is handled through the batch's mask). At the end of the loop it writes
    ``{dirpath}/{filename}.json`` (an :class:`~ada_modules.kv.AADProfile`: per-layer mean and
    fluctuation, per-head means, full per-position arrays), optionally ``{filename}.png`` (per-layer
    normalised AAD with error bars = std over positions, and a layer x position heatmap), and logs
    ``aad/layer_{i}`` (normalised mean) and ``aad/layer_{i}_std`` for every layer. The profile is
    also kept in :attr:`profile`. The sanity-check validation pass is skipped.

    The model is ``getattr(pl_module, model_attribute)`` (or ``pl_module`` itself when
    ``model_attribute`` is ``""``) and must accept ``input_ids``, ``attention_mask`` and
    ``output_attentions`` and return ``.attentions`` — any ``transformers`` causal LM, e.g. the one
    of :class:`~ada_modules.models.CausalLMModule`. With several processes each rank profiles its own
    batches, rank 0 writes its files and the logged values are averaged over the ranks.

    Args:
        dirpath: Folder of the JSON and PNG files; ``None`` uses ``trainer.log_dir`` (or
            ``trainer.default_root_dir``) plus ``/aad``.
        filename: Base name of the files, without suffix.
        loops: Evaluation loops to profile: ``"validation"`` (``fit`` and ``validate``) and/or
            ``"test"``.
        max_batches: Calibration batches per loop run (``None``: all).
        input_key: Batch key of the token ids (``"prompt_ids"``: the left-padded prompts that a KV
            cache sees; ``"input_ids"``: prompt and completion, right-padded).
        mask_key: Batch key of the matching attention mask (``None``: no padding).
        model_attribute: Attribute of the LightningModule holding the Hugging Face model.
        normalize: Normalisation of the profiled AAD, ``"position"`` or ``"max"``.
        sink_tokens: Leave out keys at the first ``sink_tokens`` positions.
        renormalize: Rescale the remaining attention after leaving out the sinks.
        plot: Also write the PNG (needs matplotlib).

    Raises:
        ValueError: If an argument is out of range, naming it.

    Example::

        from lightning.pytorch import Trainer
        from ada_modules.callbacks import AADProfiler

        trainer = Trainer(callbacks=[AADProfiler(dirpath="profiles", max_batches=4)])
        trainer.validate(model, datamodule=dm)  # writes profiles/aad_profile.{json,png}

    Examples:
        >>> profiler = AADProfiler(dirpath="profiles", max_batches=2, sink_tokens=1)
        >>> profiler.loops
        ('validation', 'test')
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "aad_profile",
        loops: Sequence[Literal["validation", "test"]] = ("validation", "test"),
        max_batches: int | None = None,
        input_key: str = "prompt_ids",
        mask_key: str | None = "prompt_mask",
        model_attribute: str = "model",
        normalize: Literal["position", "max"] = "position",
        sink_tokens: int = 0,
        renormalize: bool = True,
        plot: bool = True,
    ) -> None:
        super().__init__()
        loops = tuple(loops)
        if not loops or any(loop not in _LOOPS for loop in loops):
            raise InputError(f"loops must be a non-empty subset of {_LOOPS}, got {loops!r}")
        if max_batches is not None and (
            isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
        ):
            raise InputError(f"max_batches must be a positive integer or None, got {max_batches!r}")
        if not filename or "/" in filename:
            raise InputError(f"filename must be a non-empty base name, got {filename!r}")
        self.dirpath = dirpath
        self.filename = filename
        self.loops = loops
        self.max_batches = max_batches
        self.input_key = input_key
        self.mask_key = mask_key
        self.model_attribute = model_attribute
        self.plot = plot
        self.accumulator = AADAccumulator(normalize, sink_tokens, renormalize)
        self.profile: AADProfile | None = None

    # -- the measurement ---------------------------------------------------------------------

    def _model(self, pl_module: LightningModule) -> nn.Module:
        model = (
            getattr(pl_module, self.model_attribute, None) if self.model_attribute else pl_module
        )
        if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
            raise InputError(
                f"AADProfiler needs a transformers model at pl_module.{self.model_attribute or ''}"
                f", got {type(model).__name__}"
            )
        return model

    @torch.no_grad()
    def profile_batch(self, model: nn.Module, batch: dict[str, Any]) -> None:
        """Run ``model`` on ``batch`` with attention weights and add them to the accumulator."""
        if self.input_key not in batch:
            raise KeyError(f"batch has no {self.input_key!r} (input_key); keys: {sorted(batch)}")
        mask = batch[self.mask_key] if self.mask_key is not None else None
        previous = model.config._attn_implementation
        was_training = model.training
        model.eval()
        if previous != "eager":
            model.set_attn_implementation("eager")
        try:
            out = model(
                input_ids=batch[self.input_key],
                attention_mask=mask,
                output_attentions=True,
                use_cache=False,
            )
        finally:
            if previous != "eager":
                model.set_attn_implementation(previous)
            model.train(was_training)
        self.accumulator.update(list(out.attentions), mask)

    def _active(self, trainer: Trainer, loop: str) -> bool:
        return loop in self.loops and not trainer.sanity_checking

    def _on_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, loop: str
    ) -> None:
        if not self._active(trainer, loop):
            return
        if self.max_batches is not None and self.accumulator.num_batches >= self.max_batches:
            return
        self.profile_batch(self._model(pl_module), batch)

    def _on_epoch_end(self, trainer: Trainer, pl_module: LightningModule, loop: str) -> None:
        if not self._active(trainer, loop) or not self.accumulator.num_batches:
            return
        model = self._model(pl_module)
        self.profile = self.accumulator.compute(
            metadata={
                "loop": loop,
                "global_step": trainer.global_step,
                "ckpt_path": None if trainer.ckpt_path is None else str(trainer.ckpt_path),
                "model": type(model).__name__,
                "input_key": self.input_key,
            }
        )
        means, stds = self.profile.layer_mean(), self.profile.layer_std()
        for layer, (mean, std) in enumerate(zip(means.tolist(), stds.tolist(), strict=True)):
            pl_module.log(f"aad/layer_{layer}", mean, sync_dist=True)
            pl_module.log(f"aad/layer_{layer}_std", std, sync_dist=True)
        if trainer.is_global_zero:
            folder = self._folder(trainer)
            folder.mkdir(parents=True, exist_ok=True)
            self.profile.to_json(folder / f"{self.filename}.json")
            if self.plot:
                plot_profile(self.profile, folder / f"{self.filename}.png")

    def _folder(self, trainer: Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        # not trainer.log_dir: a collective call, which rank zero alone would wait on for ever
        return Path(log_dir_of(trainer) or trainer.default_root_dir) / "aad"

    # -- Lightning hooks ---------------------------------------------------------------------

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active(trainer, "validation"):
            self.accumulator.reset()

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active(trainer, "test"):
            self.accumulator.reset()

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._on_batch_end(trainer, pl_module, batch, batch_idx, "validation")

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._on_batch_end(trainer, pl_module, batch, batch_idx, "test")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._on_epoch_end(trainer, pl_module, "validation")

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._on_epoch_end(trainer, pl_module, "test")

    @property
    def state_key(self) -> str:
        # By what it writes and when, so that two profilers (say, one per loop) can share a Trainer
        return self._generate_state_key(
            dirpath=self.dirpath, filename=self.filename, loops=self.loops
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "accumulator": self.accumulator.state_dict(),
            "profile": None if self.profile is None else self.profile.to_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.accumulator.load_state_dict(state_dict["accumulator"])
        profile = state_dict.get("profile")
        self.profile = None if profile is None else AADProfile.from_dict(profile)


def plot_profile(profile: AADProfile, path: str | Path) -> None:
    """Write a PNG: per-layer normalised AAD (error bars: std over positions) and a heatmap.

    The heatmap shows the head-mean normalised AAD of each layer (rows) at each real position
    (columns); positions where it is undefined are blank.
    """
    from matplotlib.figure import Figure

    means, stds = profile.layer_mean().numpy(), profile.layer_std().numpy()
    curve = profile.position_curve().numpy()
    layers = range(profile.num_layers)
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    bars, heat = fig.subplots(1, 2, width_ratios=[1, 2.2])
    bars.errorbar(list(layers), means, yerr=stds, fmt="o-", capsize=4)
    for layer, values in enumerate(profile.head_mean().numpy()):
        bars.scatter([layer] * len(values), values, s=10, color="0.6", zorder=0)
    bars.set_xlabel("layer")
    bars.set_ylabel(f"normalised AAD ({profile.normalize})")
    bars.set_xticks(list(layers))
    bars.set_title("mean over positions ± std (grey: heads)")
    image = heat.imshow(curve, aspect="auto", interpolation="nearest", cmap="viridis")
    heat.set_xlabel("token position")
    heat.set_ylabel("layer")
    heat.set_yticks(list(layers))
    heat.set_title("head-mean normalised AAD per position")
    fig.colorbar(image, ax=heat)
    fig.savefig(path, dpi=110)
