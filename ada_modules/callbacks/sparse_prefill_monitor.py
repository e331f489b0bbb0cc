"""A Callback that logs what sparse prefill attention computed during validation and test."""

import contextlib
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from ada_modules.attention.interface import (
    SPARSE_PREFILL_POLICIES,
    SparsePrefillLog,
    policy_from_config,
    record_sparse_prefill,
    set_sparse_prefill_policy,
)
from ada_modules.errors import InputError

__all__ = ["SparsePrefillMonitor"]


class SparsePrefillMonitor(Callback):
    """Logs the density, probe overhead and dispatch of sparse prefill calls per eval loop.

    While a validation, test or predict loop runs, every attention call of a model whose
    ``attn_implementation`` is a sparse prefill name (``"adacal"``, ``"sparse_a_shape"``, ...,
    see :mod:`ada_modules.attention.interface`) is recorded; at the end of the loop the callback
    logs ``{stage}/attention_density`` (computed over causal blocks, mean over sparse calls),
    ``{stage}/probe_overhead`` (probe over dense attention multiply-adds),
    ``{stage}/retrieval_fraction`` (AdaCal: share of prompts dispatched to the retrieval regime),
    ``{stage}/sparse_calls`` and ``{stage}/dense_fallbacks`` (decode steps and short prompts).
    The last loop's record stays in :attr:`log`.

    With ``attn_implementation``, the evaluation loops run with that attention function and the
    policy built from ``sparse_prefill`` (training keeps the model's own attention, restored
    when each loop ends). This is how one checkpoint trained with SDPA is tested with each
    policy: ``ada test --ckpt_path`` restores the module's saved hyperparameters, including its
    ``attn_implementation``, but not the callbacks of the test's config.

    Args:
        attn_implementation: A sparse prefill name to evaluate with, or ``None`` (only log).
        sparse_prefill: Keyword arguments of that policy (the config's ``sparse_prefill``).
        model_attribute: Attribute of the LightningModule holding the Hugging Face model (``""``:
            the LightningModule itself).

    Raises:
        InputError: If ``attn_implementation`` is not a sparse prefill name or the options do not
            fit its policy.

    Example::

        from lightning.pytorch import Trainer
        from ada_modules.callbacks import SparsePrefillMonitor

        monitor = SparsePrefillMonitor("adacal", {"block_size": 32, "min_sparse_length": 512})
        Trainer(callbacks=[monitor]).test(module, datamodule)  # e.g. a CausalLMModule

    In YAML: ``trainer.callbacks: [{class_path: ada_modules.callbacks.SparsePrefillMonitor,
    init_args: {attn_implementation: adacal}}]``.
    """

    def __init__(
        self,
        attn_implementation: str | None = None,
        sparse_prefill: dict[str, Any] | None = None,
        model_attribute: str = "model",
    ) -> None:
        if attn_implementation is None and sparse_prefill is not None:
            raise InputError("sparse_prefill needs attn_implementation")
        if attn_implementation is not None:
            if attn_implementation not in SPARSE_PREFILL_POLICIES:
                raise InputError(
                    f"attn_implementation must be one of {sorted(SPARSE_PREFILL_POLICIES)} or "
                    f"None, got {attn_implementation!r}"
                )
            policy_from_config(attn_implementation, sparse_prefill)  # fail now, not at test
        self.attn_implementation = attn_implementation
        self.sparse_prefill = sparse_prefill
        self.model_attribute = model_attribute
        self.log: SparsePrefillLog | None = None
        self._loop: contextlib.ExitStack | None = None

    def _model(self, pl_module: LightningModule) -> nn.Module:
        if not self.model_attribute:
            return pl_module
        return getattr(pl_module, self.model_attribute)

    def _start(self, pl_module: LightningModule) -> None:
        self._stop()
        self._loop = contextlib.ExitStack()
        if self.attn_implementation is not None:
            model = self._model(pl_module)
            previous = model.config._attn_implementation
            policy = policy_from_config(self.attn_implementation, self.sparse_prefill)
            # each undo is registered before its change, so a failure leaves the model as it was
            self._loop.callback(model.set_attn_implementation, previous)
            model.set_attn_implementation(self.attn_implementation)
            self._loop.callback(set_sparse_prefill_policy, model, None)
            set_sparse_prefill_policy(model, policy)
        self.log = self._loop.enter_context(record_sparse_prefill())

    def _stop(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _finish(self, stage: str, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()
        if self.log is None or trainer.sanity_checking:
            return
        for name, value in self.log.summary().items():
            pl_module.log(f"{stage}/{name}", value, sync_dist=True)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(pl_module)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("val", trainer, pl_module)

    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(pl_module)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("test", trainer, pl_module)

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(pl_module)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()
