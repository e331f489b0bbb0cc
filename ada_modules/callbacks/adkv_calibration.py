"""Calibrate an ADKV KV cache on the keys and values of the model just trained.

:class:`ADKVCalibration` runs when ``fit`` ends: it feeds a few training batches through the
fitted Hugging Face model, captures every layer's post-RoPE keys, values and queries
(:func:`~ada_modules.data.capture_kv`), and fits
:class:`~ada_modules.models.ADKVCalibrationModule` on them with its own small ``Trainer``. The
calibrated parameters go to ``<dirpath>/adkv_params.pt``, which an
:class:`~ada_modules.kv.ADKVCache` reads with ``params=...`` when the model is tested, e.g. in the
variants of a sweep (``{fit_dir}/adkv/adkv_params.pt``).
"""

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ada_modules.checks import is_finite_real
from ada_modules.errors import InputError

__all__ = ["ADKVCalibration"]


class ADKVCalibration(Callback):
    """Calibrate ADKV parameters on K/V captured from the fitted model (at the end of ``fit``).

    Args:
        dirpath: Folder for ``captured_kv.pt``, ``adkv_params.pt`` and ``calibration.json``: the
            held-out attention-output error before and after calibration, and per layer the
            drift measurement of the captured keys (:func:`~ada_modules.data.drift_statistics`,
            and the key error of static per-channel against group-wise 2-bit quantization: is
            the drift ADKV tracks present in this model?).
        bits: Bit widths to calibrate (one parameter set per width, layer, keys and values).
        num_batches: Training batches whose sequences are captured (each trimmed to its
            shortest sequence, so that no padding is captured).
        num_queries: Positions at the end of each sequence used as queries.
        max_steps: Calibration steps.
        keyframe_period: Keyframe period the calibration assumes (use the cache's).
        lr: Adam learning rate of the calibration.

    Examples:
        >>> ADKVCalibration("runs/adkv", bits=[2, 4], max_steps=100)
        ADKVCalibration(dirpath='runs/adkv', bits=[2, 4], max_steps=100)
    """

    def __init__(
        self,
        dirpath: str | Path,
        bits: list[int] | int = 2,
        num_batches: int = 2,
        num_queries: int = 8,
        max_steps: int = 200,
        keyframe_period: int = 512,
        lr: float = 0.05,
    ) -> None:
        for name, value in (
            ("num_batches", num_batches),
            ("num_queries", num_queries),
            ("max_steps", max_steps),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive int, got {value!r}")
        # checked now rather than when the fit ends (the kv package imports transformers)
        from ada_modules.kv.adkv import check_keyframe_period
        from ada_modules.kv.quantized_layer import check_bits

        widths = list(bits) if isinstance(bits, list | tuple) else [bits]
        if not widths:
            raise InputError("bits must be a width or a non-empty list of widths, got []")
        for width in widths:
            check_bits("bits", width)
        check_keyframe_period(keyframe_period)
        if not (is_finite_real(lr) and lr > 0):
            raise InputError(f"lr must be a finite number > 0, got {lr!r}")
        self.dirpath = Path(dirpath)
        self.bits = [int(width) for width in widths]
        self.num_batches = num_batches
        self.num_queries = num_queries
        self.max_steps = max_steps
        self.keyframe_period = keyframe_period
        self.lr = lr

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dirpath={str(self.dirpath)!r}, bits={self.bits}, "
            f"max_steps={self.max_steps})"
        )

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Capture K/V on rank 0, calibrate, write the files; the other ranks wait."""
        if trainer.is_global_zero:
            self.calibrate(trainer, pl_module)
        trainer.strategy.barrier("adkv_calibration")

    def calibrate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """Capture, calibrate and save; return the held-out errors written to
        ``calibration.json``."""
        from ada_modules.data import CapturedKVDataModule, capture_kv, save_captured_kv
        from ada_modules.models import ADKVCalibrationModule

        model = getattr(pl_module, "model", None)
        if model is None or not hasattr(model, "config"):
            raise InputError(
                f"ADKVCalibration needs a LightningModule whose .model is a transformers model, "
                f"got {type(pl_module).__name__}"
            )
        captured = None
        datamodule = trainer.datamodule
        loader = trainer.train_dataloader if datamodule is None else datamodule.train_dataloader()
        was_training = model.training
        model.eval()
        try:
            for i, batch in enumerate(loader):
                if i == self.num_batches:
                    break
                length = int(batch["attention_mask"].sum(1).min())
                ids = batch["input_ids"][:, :length].to(pl_module.device)
                layers = capture_kv(model, ids)
                captured = layers if captured is None else _concat(captured, layers)
        finally:
            model.train(was_training)
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = self.dirpath / "captured_kv.pt"
        save_captured_kv(path, captured)
        first = captured[0]
        data = CapturedKVDataModule(
            path, num_queries=self.num_queries, fractions=(0.7, 0.2, 0.1), batch_size=8
        )
        calibration = ADKVCalibrationModule(
            num_heads=first.keys.shape[1],
            head_dim=first.keys.shape[-1],
            bits=self.bits,
            num_layers=len(captured),
            keyframe_period=self.keyframe_period,
            lr=self.lr,
            params_path=str(self.dirpath / "adkv_params.pt"),
        )
        inner = Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=self.max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            check_val_every_n_epoch=None,
            val_check_interval=self.max_steps,
        )
        with torch.inference_mode(False), torch.enable_grad():
            inner.fit(calibration, data)
        metrics = {k: float(v) for k, v in inner.callback_metrics.items() if k.startswith("val/")}
        metrics["drift"] = [_drift(layer.keys) for layer in captured]
        (self.dirpath / "calibration.json").write_text(json.dumps(metrics, indent=1))
        return metrics


def _drift(keys: torch.Tensor) -> dict[str, float]:
    """How much the captured keys drift: range ratios and static vs group-wise key error."""
    from ada_modules.data import drift_statistics
    from ada_modules.kv import groupwise_keys, static_per_channel

    stats = drift_statistics(keys, group_size=32)
    tokens = keys.shape[-2] // 32 * 32
    k = keys[..., :tokens, :].half()

    def error(q: torch.Tensor) -> float:
        return float(((q.float() - k.float()) ** 2).sum() / (k.float() ** 2).sum())

    return {
        "outlier_range_ratio": float(stats["outlier_ratio_mean"]),
        "median_range_ratio": float(stats["median_ratio"]),
        "static_key_rel_mse_2bit": error(static_per_channel(k, 2).values),
        "groupwise_key_rel_mse_2bit": error(groupwise_keys(k, 2, 32).values),
    }


def _concat(a: list, b: list) -> list:
    """Concatenate two captures along the batch, trimmed to their common length."""
    from ada_modules.data import CapturedKV

    length = min(a[0].keys.shape[-2], b[0].keys.shape[-2])
    return [
        CapturedKV(
            *(
                torch.cat([getattr(x, n)[..., :length, :], getattr(y, n)[..., :length, :]])
                for n in ("keys", "values", "queries")
            )
        )
        for x, y in zip(a, b, strict=True)
    ]
