"""AdERAStrategy: Lightning's FSDP2 ``ModelParallelStrategy`` with AdERA's all-gather installed.

Examples:
    >>> strategy = AdERAStrategy(mode="always", min_numel=1024)
    >>> strategy.mode, strategy.stats.gathers
    ('always', 0)
"""

import math
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.constants import default_pg_timeout

from ada_modules.errors import InputError
from ada_modules.kernels import exponent_codec as codec
from ada_modules.kernels._dispatch import Impl
from ada_modules.strategies.adera import (
    AdERAAllGather,
    Mode,
    Reuse,
    require_custom_all_gather,
)
from ada_modules.strategies.adera_budget import budget_for
from ada_modules.strategies.adera_cost_model import CostModel
from ada_modules.strategies.adera_install import install_adera_all_gather, verify_exponent_caches
from ada_modules.strategies.adera_stats import GatherStats
from ada_modules.strategies.adera_trace import GatherRecord, trace_from_records
from ada_modules.strategies.sharding import check_shard_spec, is_sharded, shard_module

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from torch.optim import Optimizer

__all__ = ["AdERAStrategy"]


class AdERAStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) with AdERA's compressed all-gather installed.

    The LightningModule shards itself in ``configure_model`` with ``fully_shard`` (as for
    ``ModelParallelStrategy``); after that, every ``FSDPModule`` gets its own
    :class:`~ada_modules.strategies.adera.AdERAAllGather`. Parameters and losses are bitwise identical to
    ``ModelParallelStrategy`` with the same arguments. Each training step logs (under ``train/``)
    the exponent reuse rate, the bytes ratio of compressed gathers, the number of compressed
    gathers and the codec/communication wall time accumulated since the previous step.

    After a checkpoint is loaded the exponent caches are dropped (the next gather of each group is
    sent raw and rebuilds them) and checked across ranks at the next training step, so a resumed
    run stays exact.

    With ``trace_path``, every all-gather of every training step is timed on every rank (also in
    mode ``"never"``, where the gathers are the default ones, so a raw run can be compared with an
    AdERA run), and at the end of fit rank 0 writes a simulator trace
    (:class:`~ada_modules.strategies.adera_sim.Trace` JSON, see :func:`trace_from_records`): per
    gather its group, size, dtype, exponent change rate, phase, wall time, codec time and the
    compute until the next gather, plus the mean step time under ``measured_step_s["raw"]`` (mode
    ``"never"``) or ``["adera"]``, or both with ``alternate_steps``. Recording costs a few
    ``perf_counter`` calls per gather, and for groups that keep no cache one exponent comparison
    after the timed gather.

    Args:
        data_parallel_size: As for ``ModelParallelStrategy``.
        tensor_parallel_size: As for ``ModelParallelStrategy``.
        save_distributed_checkpoint: As for ``ModelParallelStrategy``.
        process_group_backend: As for ``ModelParallelStrategy``.
        timeout: As for ``ModelParallelStrategy``.
        mode: ``"auto"`` (compress a group when the cost model predicts a saving), ``"always"`` or
            ``"never"``.
        reuse: What every rank caches per group: ``"exponent"`` (one byte per element),
            ``"value"`` (the previous value: far fewer bytes sent for 2× (bf16) or 4× (fp32) the
            cache memory) or ``"auto"`` (value caches while ``value_cache_bytes`` lasts); see
            :class:`~ada_modules.strategies.AdERAAllGather`.
        value_cache_bytes: With ``reuse="auto"``, the bytes of value caches per rank.
        min_numel: Groups with fewer elements are never compressed.
        margin: Relative saving the cost model must predict in ``"auto"`` mode.
        calibrate: In ``"auto"`` mode, measure latency, bandwidth and codec speed at setup (a few
            collectives, identical result on every rank); otherwise use :class:`~ada_modules.strategies.adera_cost_model.CostModel`'s
            defaults with ``margin``.
        chunk_size: Elements per exception chunk of the codec.
        shadow: Debug: also run the default all-gather and raise on any difference.
        check_caches: Debug: compare the exponent caches across ranks after every training step.
        log_stats: Log the per-step statistics with ``LightningModule.log_dict``.
        impl: Codec implementation: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or
            ``"torch"``; checked here, so a Triton codec that cannot run on this machine fails at
            construction rather than at the first compressed gather
            (see :func:`~ada_modules.strategies.adera.check_impl`).
        alternate_steps: Benchmark aid: compress only on odd training steps and send every gather
            raw on even ones (the caches stay current), so that one run measures both kinds of
            step under the same machine load; ``trace_path`` then records both (the records say
            which gathers were compressed). Training is unchanged: both kinds are exact.
        trace_path: Write a simulator trace of the training steps to this JSON file at the end of
            fit (rank 0; parent folders are created). ``None``: record nothing.
        shard: For a LightningModule that does not shard itself: the blocks to wrap with
            ``fully_shard`` (class names such as ``"TransformerBlock"`` or qualified-name patterns
            such as ``"net.*"``, see :func:`~ada_modules.strategies.sharding.find_blocks`), then
            its direct submodules as roots, like FSDP1's auto-wrap policy. Applied when the
            module's ``configure_model`` is not overridden or left the module unsharded.

    Raises:
        InputError: For a bad argument (a ``ValueError``), e.g. ``impl="cuda"``.
        RuntimeError: At setup, if this torch has no FSDP2 custom all-gather (torch < 2.9).

    Examples:
        >>> strategy = AdERAStrategy(mode="always", min_numel=1024)
        >>> strategy.stats.gathers
        0
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        *,
        mode: Mode = "auto",
        reuse: Reuse = "exponent",
        value_cache_bytes: int | None = None,
        min_numel: int = 1 << 16,
        margin: float = 0.05,
        calibrate: bool = True,
        chunk_size: int = codec.DEFAULT_CHUNK_SIZE,
        shadow: bool = False,
        check_caches: bool = False,
        log_stats: bool = True,
        impl: Impl = "auto",
        alternate_steps: bool = False,
        trace_path: str | None = None,
        shard: list[str] | None = None,
    ) -> None:
        if trace_path is not None and (not isinstance(trace_path, str) or not trace_path):
            raise InputError(f"trace_path must be None or a non-empty path, got {trace_path!r}")
        if shard is not None:
            check_shard_spec(shard)
        for name, flag in (("calibrate", calibrate), ("shadow", shadow)):
            if not isinstance(flag, bool):
                raise InputError(f"{name} must be true or false, got {flag!r}")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        CostModel(margin=margin)  # validates margin
        # Validate the all-gather arguments now rather than at setup.
        AdERAAllGather(
            mode=mode,
            reuse=reuse,
            value_cache_budget=budget_for(reuse, value_cache_bytes),
            min_numel=min_numel,
            chunk_size=chunk_size,
            impl=impl,
        )
        self.mode: Mode = mode
        self.reuse: Reuse = reuse
        self.value_cache_bytes = value_cache_bytes
        self.min_numel = min_numel
        self.margin = margin
        self.calibrate = calibrate
        self.chunk_size = chunk_size
        self.shadow = shadow
        self.check_caches = check_caches
        self.log_stats = log_stats
        self.impl: Impl = impl
        self.alternate_steps = alternate_steps
        self.trace_path = trace_path
        self.shard = list(shard) if shard is not None else None
        self.cost_model: CostModel | None = None
        self.comms: dict[str, AdERAAllGather] = {}
        self._verify_next = False
        self._trace_records: list[GatherRecord] = []
        self._trace_steps: list[tuple[list[GatherRecord], float, float, float]] = []
        self._step_start: float | None = None
        self._step_methods: list[str] = []
        self._backward_end: float | None = None

    @property
    def stats(self) -> GatherStats:
        """Statistics summed over all groups since the last step's log (a fresh object)."""
        total = GatherStats()
        for comm in self.comms.values():
            total.add(comm.stats)
        return total

    def setup_environment(self) -> None:
        """Build the device mesh; with ``shard``, give an unsharding module its ``configure_model``.

        ``ModelParallelStrategy`` requires ``configure_model`` to be overridden; for a module
        that does not override it, the strategy supplies one that shards by ``shard``.
        """
        super().setup_environment()
        module = self.lightning_module
        if self.shard is not None and not is_overridden("configure_model", module):
            shard = self.shard

            def configure_model() -> None:
                shard_module(module, module.device_mesh, shard)

            module.configure_model = configure_model

    def setup(self, trainer: "Trainer") -> None:
        """Set up FSDP2 as ``ModelParallelStrategy`` does, then install the AdERA all-gathers."""
        require_custom_all_gather()
        module = self.lightning_module
        if self.shard is not None:
            shard_module(module, self.device_mesh, self.shard)
        if not is_sharded(module):
            raise InputError(
                f"{type(module).__name__} does not shard itself in configure_model, and "
                "AdERAStrategy needs FSDP2 modules: pass shard=[...] (block class names or "
                "name patterns, e.g. shard=['Linear'] or shard=['net.*']) or call "
                "ada_modules.strategies.shard_module(self, self.device_mesh) in configure_model"
            )
        super().setup(trainer)
        if self.mode == "auto" and self.calibrate:
            # Value reuse (or "auto", which may pick it) is timed with the slower value codec.
            self.cost_model = CostModel.calibrate(
                device=self.root_device,
                margin=self.margin,
                impl=self.impl,
                reuse="exponent" if self.reuse == "exponent" else "value",
            )
        else:
            self.cost_model = CostModel(margin=self.margin)
        self.comms = install_adera_all_gather(
            self.model,
            mode=self.mode,
            reuse=self.reuse,
            value_cache_bytes=self.value_cache_bytes,
            cost_model=self.cost_model,
            min_numel=self.min_numel,
            chunk_size=self.chunk_size,
            shadow=self.shadow,
            impl=self.impl,
        )
        if self.trace_path is not None:
            self._trace_records.clear()
            self._trace_steps.clear()
            self._step_methods.clear()
            for comm in self.comms.values():
                comm.trace = self._trace_records

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's training step, then log and reset the AdERA statistics."""
        if self.trace_path is not None:  # gathers before this (validation) are not recorded
            self._trace_records.clear()
            self._backward_end = None
            self._step_start = time.perf_counter()
        if self.alternate_steps:
            for comm in self.comms.values():
                comm.enabled = self.lightning_module.global_step % 2 == 1
        output = super().training_step(*args, **kwargs)
        if self.check_caches or self._verify_next:
            verify_exponent_caches(self.comms.values(), device=self.root_device)
            self._verify_next = False
        if self.log_stats and self.comms:
            stats = self.stats
            values = {
                "train/adera_reuse_rate": stats.reuse_rate,
                "train/adera_bytes_ratio": stats.bytes_ratio,
                "train/adera_compressed_bytes_ratio": stats.compressed_bytes_ratio,
                "train/adera_compressed_gathers": float(stats.compressed_gathers),
                "train/adera_codec_time_s": stats.codec_time_s,
                "train/adera_cache_bytes": float(sum(c.cache_nbytes for c in self.comms.values())),
                "train/adera_comm_time_s": stats.comm_time_s,
            }
            values = {k: v for k, v in values.items() if not math.isnan(v)}
            self.lightning_module.log_dict(values, on_step=True, on_epoch=False)
        for comm in self.comms.values():
            comm.stats.reset()
        return output

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Note when the backward pass ended (for the trace)."""
        super().post_backward(closure_loss)
        if self.trace_path is not None:
            self._backward_end = time.perf_counter()

    def optimizer_step(
        self, optimizer: "Optimizer", closure: Callable[[], Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Step as ``ModelParallelStrategy`` does; with ``trace_path``, close the step's record."""
        output = super().optimizer_step(optimizer, closure, *args, **kwargs)
        if self.trace_path is not None and self._step_start is not None:
            end = time.perf_counter()
            backward_end = self._backward_end if self._backward_end is not None else end
            self._trace_steps.append(
                (list(self._trace_records), self._step_start, backward_end, end)
            )
            enabled = all(comm.enabled for comm in self.comms.values())
            self._step_methods.append("raw" if self.mode == "never" or not enabled else "adera")
            self._trace_records.clear()
            self._step_start = None
        return output

    def on_train_end(self) -> None:
        """With ``trace_path``: rank 0 writes the trace of the recorded training steps."""
        super().on_train_end()
        if self.trace_path is None or not self._trace_steps or self.global_rank != 0:
            return
        ranks = [r.ranks for records, *_ in self._trace_steps for r in records]
        trace = trace_from_records(
            self._trace_steps,
            world_size=max(ranks, default=self.world_size),
            method=self._step_methods,
            meta={
                "mode": self.mode,
                "reuse": self.reuse,
                "alternate_steps": self.alternate_steps,
                "min_numel": self.min_numel,
                "chunk_size": self.chunk_size,
                "torch": torch.__version__,
                "device": str(self.root_device),
            },
        )
        path = Path(self.trace_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        trace.to_json(path)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load as ``ModelParallelStrategy`` does and drop the exponent caches (they are rebuilt)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        for comm in self.comms.values():
            comm.reset_cache()
        self._verify_next = True
        return checkpoint
