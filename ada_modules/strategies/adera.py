"""AdERA's compressed FSDP2 all-gather: exact weights from sign+mantissa and an exponent cache.

:class:`AdERAStrategy` is Lightning's ``ModelParallelStrategy`` with :class:`AdERAAllGather`
installed on every FSDP module; the rest of this module is usable without Lightning
(:func:`install_adera_all_gather` after ``fully_shard``).

:class:`AdERAAllGather` implements FSDP2's custom all-gather protocol
(:meth:`FSDPModule.set_custom_all_gather`, torch >= 2.9): FSDP2 copies the shards of one parameter
group into a flat buffer (``input_tensor``, in the parameter dtype, a view of this rank's slice of
``output_tensor``) and calls ``comm(output_tensor, input_tensor, group, async_op)`` before the
forward and again before the backward (with ``reshard_after_forward=True``); ``comm.allocate``
provides ``output_tensor``. Instead of all-gathering the raw shards, every rank:

1. encodes its shard against the exponent cache (:mod:`ada_modules.kernels.exponent_codec`) into a
   buffer of a size all ranks know in advance (planes + an exception area of an agreed capacity);
2. all-gathers these buffers; exception bytes beyond the capacity (rare) travel in a second
   all-gather, sized by the largest spill, which every rank reads from the gathered headers;
3. decodes every rank's shard into ``output_tensor`` and updates the cache, so that all ranks hold
   the same cache (one ``uint8`` per element of the whole group).

The capacity for the next gather and the compress-or-not decision are functions of what every rank
decoded (the largest exception stream of the last few gathers) and of shared constants, so the
ranks agree without extra communication. The result is bitwise identical to the default
all-gather; ``shadow=True`` also runs the default all-gather and checks that.

Gathers are sent raw (and the cache is refreshed from the output) in mode ``"never"``, for groups
smaller than ``min_numel``, for dtypes other than bf16/fp32 (with a one-time warning), for the first
gather of a group (no cache yet), and in mode ``"auto"`` when the :class:`CostModel` predicts no
saving.

Examples:
    >>> comm = AdERAAllGather(mode="always", min_numel=0)
    >>> comm.stats.gathers, comm.mode
    (0, 'always')
"""

import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.constants import default_pg_timeout

from ada_modules.kernels import exponent_codec as codec
from ada_modules.kernels._dispatch import Impl

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from torch.optim import Optimizer

    from ada_modules.strategies.adera_sim import Trace

try:  # FSDP2's custom-comm interface: torch >= 2.9
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
except ImportError:  # pragma: no cover - exercised only on old torch
    _AllGatherBase = object

__all__ = [
    "MIN_TORCH_VERSION",
    "AdERAAllGather",
    "AdERAStrategy",
    "CostModel",
    "GatherRecord",
    "GatherStats",
    "Mode",
    "install_adera_all_gather",
    "require_custom_all_gather",
    "trace_from_records",
    "verify_exponent_caches",
]

# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single (same arguments).
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

MIN_TORCH_VERSION = "2.9"
"""The first torch release with ``FSDPModule.set_custom_all_gather``."""

Mode = Literal["auto", "always", "never"]
"""When a group's all-gather is compressed: cost-model decision, always, or never."""

_WARNED_DTYPES: set[torch.dtype] = set()


def require_custom_all_gather() -> None:
    """Raise a clear error when this torch has no FSDP2 custom all-gather.

    Raises:
        RuntimeError: If ``FSDPModule.set_custom_all_gather`` is missing (torch < 2.9).

    Examples:
        >>> require_custom_all_gather()  # torch 2.14 here: no error
    """
    from torch.distributed.fsdp import FSDPModule

    if _AllGatherBase is object or not hasattr(FSDPModule, "set_custom_all_gather"):
        raise RuntimeError(
            f"AdERA needs FSDP2's custom all-gather (FSDPModule.set_custom_all_gather), available "
            f"from torch {MIN_TORCH_VERSION}; this is torch {torch.__version__}"
        )


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


@dataclass
class GatherStats:
    """Counters accumulated over all-gathers; read and :meth:`reset` them once per step.

    Byte counts add up what every rank contributes to a gather (the fixed-size payloads, plus the
    padded spills when there are any). Exponent counts cover the gathers that had a cache.

    Attributes:
        gathers: All-gathers seen.
        compressed_gathers: Those sent as codec payloads.
        spill_gathers: Compressed gathers that needed the second (spill) all-gather.
        elements: Elements gathered (whole group, all ranks).
        tracked_elements: Elements compared against a cache.
        changed_exponents: Of those, exponents that differed from the cache.
        bytes_sent: Bytes all ranks contributed, compressed or not.
        raw_bytes: Bytes the default all-gather would have contributed.
        compressed_bytes_sent: ``bytes_sent`` of compressed gathers only.
        compressed_raw_bytes: ``raw_bytes`` of compressed gathers only.
        exception_bytes: Exact exception-stream bytes of compressed gathers (all ranks); the rest
            of their payloads is planes, headers, counts and unused capacity.
        codec_time_s: Wall time in encoding, decoding and cache updates.
        comm_time_s: Wall time in the all-gathers.
    """

    gathers: int = 0
    compressed_gathers: int = 0
    spill_gathers: int = 0
    elements: int = 0
    tracked_elements: int = 0
    changed_exponents: int = 0
    bytes_sent: int = 0
    raw_bytes: int = 0
    compressed_bytes_sent: int = 0
    compressed_raw_bytes: int = 0
    exception_bytes: int = 0
    codec_time_s: float = 0.0
    comm_time_s: float = 0.0

    @property
    def reuse_rate(self) -> float:
        """Fraction of tracked exponents equal to the cache (NaN before any tracked gather)."""
        return (
            1.0 - self.changed_exponents / self.tracked_elements
            if self.tracked_elements
            else math.nan
        )

    @property
    def bytes_ratio(self) -> float:
        """``bytes_sent / raw_bytes`` over all gathers (NaN before any gather)."""
        return self.bytes_sent / self.raw_bytes if self.raw_bytes else math.nan

    @property
    def compressed_bytes_ratio(self) -> float:
        """``bytes_sent / raw_bytes`` over compressed gathers only (NaN if there were none)."""
        return (
            self.compressed_bytes_sent / self.compressed_raw_bytes
            if self.compressed_raw_bytes
            else math.nan
        )

    def add(self, other: "GatherStats") -> None:
        """Add ``other``'s counters to these (e.g. to sum over groups)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def reset(self) -> None:
        """Zero every counter."""
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())

    def as_dict(self) -> dict[str, float]:
        """Counters and derived rates, e.g. for ``LightningModule.log_dict``.

        Examples:
            >>> GatherStats(tracked_elements=100, changed_exponents=3).as_dict()["reuse_rate"]
            0.97
        """
        out: dict[str, float] = asdict(self)
        out.update(
            reuse_rate=self.reuse_rate,
            bytes_ratio=self.bytes_ratio,
            compressed_bytes_ratio=self.compressed_bytes_ratio,
        )
        return out


@dataclass(frozen=True)
class GatherRecord:
    """One all-gather as recorded for a simulator trace (see ``AdERAAllGather.trace``).

    Times are ``time.perf_counter()`` readings of this rank.

    Attributes:
        group: Name of the parameter group (the FSDP module's name; ``"<root>"`` for the root).
        numel: Elements of the whole group (all ranks).
        dtype: Gathered dtype: ``"bf16"``, ``"fp32"``, or ``str(dtype)`` for any other.
        phase: ``"backward"`` when called from inside autograd's backward, else ``"forward"``.
        start_s: When the gather was called.
        end_s: When the gathered weights were in the output (the gather's wall time is
            ``end_s - start_s``: encode, all-gather(s), decode and cache update).
        ready_s: When the call returned; after ``end_s`` only the trace's own bookkeeping ran
            (counting the exponent changes of a group that keeps no cache), which is not compute.
        codec_s: Of the wall time, encode + decode + cache-update time.
        compressed: Whether it was sent as codec payloads.
        spilled: Whether a spill all-gather followed.
        bytes_sent: Bytes all ranks contributed.
        raw_bytes: Bytes the default all-gather would have contributed.
        changed: Exponents that differ from the previous gather of the group (all ranks); ``None``
            for the first gather of a group (nothing to compare with).
        ranks: Size of the process group of the gather.
    """

    group: str
    numel: int
    dtype: str
    phase: str
    start_s: float
    end_s: float
    ready_s: float
    codec_s: float
    compressed: bool
    spilled: bool
    bytes_sent: int
    raw_bytes: int
    changed: int | None
    ranks: int = 1


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


# ----------------------------------------------------------------------------------------------
# Cost model
# ----------------------------------------------------------------------------------------------


def _check_positive(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta model of a ring all-gather, with and without the codec.

    For ``P`` ranks and a shard of ``b`` bytes, the raw all-gather takes
    ``(P - 1) * (latency_s + b / bandwidth_Bps)``; the compressed one takes the same with the payload
    size, plus encoding the shard (``codec_latency_s + b / encode_Bps``) and decoding all ``P``
    shards (``P * codec_latency_s + P * b / decode_Bps``). A group is compressed when that is at most
    ``1 - margin`` of the raw time. Every rank must use the same constants (see :meth:`calibrate`),
    since the decision changes the size of what is sent.

    Args:
        latency_s: Per-step latency of the ring (alpha), seconds.
        bandwidth_Bps: Per-rank bandwidth (beta), bytes per second.
        encode_Bps: Encoder throughput in bytes of input shard per second.
        decode_Bps: Decoder throughput in bytes of output shard per second.
        codec_latency_s: Fixed cost of one encode or decode call, seconds.
        margin: Required relative saving, in [0, 1).

    Examples:
        >>> nvlink = CostModel(latency_s=10e-6, bandwidth_Bps=150e9, encode_Bps=1e12, decode_Bps=1e12)
        >>> nvlink.should_compress(shard_numel=2**24, dtype=torch.bfloat16, world_size=8, payload_nbytes=2**24 + 2**21)
        True
        >>> nvlink.should_compress(shard_numel=2**10, dtype=torch.bfloat16, world_size=8, payload_nbytes=1400)
        False
    """

    latency_s: float = 20e-6
    bandwidth_Bps: float = 25e9
    encode_Bps: float = 400e9
    decode_Bps: float = 400e9
    codec_latency_s: float = 10e-6
    margin: float = 0.05

    def __post_init__(self) -> None:
        for name in ("latency_s", "bandwidth_Bps", "encode_Bps", "decode_Bps", "codec_latency_s"):
            _check_positive(getattr(self, name), name)
        if isinstance(self.margin, bool) or not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin!r}")

    def raw_time(self, shard_nbytes: int, world_size: int) -> float:
        """Seconds of the default ring all-gather of ``shard_nbytes`` per rank."""
        return (world_size - 1) * (self.latency_s + shard_nbytes / self.bandwidth_Bps)

    def compressed_time(self, shard_nbytes: int, payload_nbytes: int, world_size: int) -> float:
        """Seconds of encode + all-gather of ``payload_nbytes`` per rank + decode of every shard."""
        encode = self.codec_latency_s + shard_nbytes / self.encode_Bps
        decode = world_size * (self.codec_latency_s + shard_nbytes / self.decode_Bps)
        return encode + self.raw_time(payload_nbytes, world_size) + decode

    def should_compress(
        self, shard_numel: int, dtype: torch.dtype, world_size: int, payload_nbytes: int
    ) -> bool:
        """Whether the compressed all-gather is predicted to save at least ``margin``."""
        shard_nbytes = codec.raw_nbytes(shard_numel, dtype)
        return self.compressed_time(shard_nbytes, payload_nbytes, world_size) <= (
            1 - self.margin
        ) * self.raw_time(shard_nbytes, world_size)

    @classmethod
    def calibrate(
        cls,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        *,
        margin: float = 0.05,
        numel: int = 1 << 20,
        repeats: int = 3,
        impl: Impl = "auto",
    ) -> "CostModel":
        """Measure alpha, beta and the codec's speed here; every rank of ``group`` gets the same model.

        Collective: all ranks of ``group`` must call it. Each timing is the median of ``repeats``;
        the slowest rank's timings are used (an ``all_reduce`` of MAX), so the model is identical
        on every rank.

        Args:
            group: Process group (default: the world).
            device: Where to time (the device the parameters live on).
            margin: Passed to the model.
            numel: bf16 elements per shard for the bandwidth and codec timings.
            repeats: Timings per quantity.
            impl: Codec implementation to time.
        """
        device = torch.device(device)
        world = dist.get_world_size(group)

        def timed(fn: Callable[[], object]) -> float:
            samples = []
            for _ in range(repeats + 1):  # the first call warms up
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                samples.append(time.perf_counter() - start)
            return sorted(samples[1:])[len(samples[1:]) // 2]

        small = torch.zeros(64, dtype=torch.uint8, device=device)
        small_out = torch.empty(64 * world, dtype=torch.uint8, device=device)
        big = torch.zeros(2 * numel, dtype=torch.uint8, device=device)
        big_out = torch.empty(2 * numel * world, dtype=torch.uint8, device=device)
        x = torch.randn(numel, device=device).bfloat16()
        cache = codec.extract_exponents(x * 1.01)  # a few percent of exponents change
        buffer, spill = codec.encode_into(x, cache, numel // 4, impl=impl)
        t = torch.tensor(
            [
                timed(lambda: _all_gather(small_out, small, group=group)),
                timed(lambda: _all_gather(big_out, big, group=group)),
                timed(lambda: codec.encode_into(x, cache, numel // 4, impl=impl)),
                timed(
                    lambda: codec.decode_from(buffer, cache, numel, x.dtype, spill=spill, impl=impl)
                ),
            ],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        t_small, t_big, t_enc, t_dec = t.tolist()
        hops = max(world - 1, 1)
        latency = max(t_small / hops, 1e-9)
        bandwidth = 2 * numel / max(t_big / hops - latency, 1e-12)
        # The codec's fixed cost is folded into its throughput (measured at `numel` elements).
        return cls(
            latency_s=latency,
            bandwidth_Bps=bandwidth,
            encode_Bps=2 * numel / t_enc,
            decode_Bps=2 * numel / t_dec,
            codec_latency_s=1e-9,
            margin=margin,
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# The all-gather
# ----------------------------------------------------------------------------------------------


class AdERAAllGather(_AllGatherBase):
    """FSDP2 custom all-gather that sends sign+mantissa planes and only the changed exponents.

    Install one instance per FSDP module with :func:`install_adera_all_gather` (or
    ``fsdp_module.set_custom_all_gather(AdERAAllGather(...))``). The instance keeps the exponent
    cache of its parameter group (``world_size * shard_numel`` bytes on every rank) and its
    :attr:`stats`.

    Set ``trace`` to a list (several instances may share one) to append a :class:`GatherRecord`
    per call, in call order (:class:`AdERAStrategy` does so with ``trace_path``). A group that
    keeps no cache (mode ``"never"``, below ``min_numel``) then keeps a trace-only copy of its
    exponents to count the changes, outside the timed gather.

    Args:
        mode: ``"auto"`` (compress when ``cost_model`` predicts a saving), ``"always"`` or
            ``"never"``.
        cost_model: The model ``"auto"`` consults; identical on every rank (default:
            :class:`CostModel` with its default constants).
        min_numel: Groups with fewer elements (all ranks together) are never compressed and keep
            no cache.
        chunk_size: Elements per exception chunk of the codec.
        initial_capacity: Exception-area capacity of the first compressed gather, as a fraction of
            the shard's elements (later capacities follow the decoded statistics).
        headroom: Capacity = ``headroom`` times the largest exception stream (over all ranks) of
            the gathers ``period``, ``2 * period``, ... back within the last ``window`` gathers,
            rounded up to 64 bytes.
        window: Gathers remembered for the capacity.
        period: Gathers per cycle of a group: 2 under FSDP2's default forward + backward
            re-gather (``reshard_after_forward=True``), so a forward gather is sized from earlier
            forward gathers and a backward re-gather (no exponent changes) from earlier backward
            ones; 1 sizes every gather from all recent ones. A wrong guess costs a spill gather,
            never exactness.
        shadow: Also run the default all-gather and raise if the outputs differ in any bit.
        impl: Codec implementation (``"auto"``: Triton on CUDA, torch otherwise).
        name: A label for messages (e.g. the module's name).

    Raises:
        ValueError: For a bad argument.
        RuntimeError: If this torch has no custom all-gather (see :func:`require_custom_all_gather`).
    """

    def __init__(
        self,
        mode: Mode = "auto",
        *,
        cost_model: CostModel | None = None,
        min_numel: int = 1 << 16,
        chunk_size: int = codec.DEFAULT_CHUNK_SIZE,
        initial_capacity: float = 0.2,
        headroom: float = 1.25,
        window: int = 4,
        period: int = 2,
        shadow: bool = False,
        impl: Impl = "auto",
        name: str = "",
    ) -> None:
        require_custom_all_gather()
        if mode not in get_args(Mode):
            raise ValueError(f"mode must be one of {get_args(Mode)}, got {mode!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be a non-negative int, got {min_numel!r}")
        if (
            isinstance(chunk_size, bool)
            or not isinstance(chunk_size, int)
            or not (16 <= chunk_size <= 32768 and chunk_size & (chunk_size - 1) == 0)
        ):
            raise ValueError(
                f"chunk_size must be a power of two in [16, 32768], got {chunk_size!r}"
            )
        if not 0 <= initial_capacity <= 1:
            raise ValueError(f"initial_capacity must be in [0, 1], got {initial_capacity!r}")
        if not headroom >= 1:
            raise ValueError(f"headroom must be >= 1, got {headroom!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if isinstance(period, bool) or not isinstance(period, int) or not 1 <= period <= window:
            raise ValueError(f"period must be an int in [1, window={window}], got {period!r}")
        self.mode: Mode = mode
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.min_numel = min_numel
        self.chunk_size = chunk_size
        self.initial_capacity = initial_capacity
        self.headroom = headroom
        self.period = period
        self.shadow = shadow
        self.impl: Impl = impl
        self.name = name
        self.stats = GatherStats()
        self.last_compressed: bool | None = None
        self.trace: list[GatherRecord] | None = None
        self._cache: torch.Tensor | None = None
        self._trace_cache: torch.Tensor | None = None
        self._history: deque[int] = deque(maxlen=window)

    # FSDP2 protocol -----------------------------------------------------------------------------

    def allocate(
        self, size: "tuple[int, ...]", *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Allocate FSDP2's all-gather output (a plain ``torch.empty``)."""
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        """All-gather ``input_tensor`` of every rank into ``output_tensor``; synchronous (returns
        ``None``, which FSDP2 accepts for ``async_op=True`` too)."""
        world = group.size()
        numel, dtype = input_tensor.numel(), input_tensor.dtype
        if output_tensor.numel() != world * numel:
            raise ValueError(
                f"output_tensor must have world_size * input numel = {world * numel} elements, "
                f"got {output_tensor.numel()}"
            )
        reference = None
        if self.shadow:
            reference = torch.empty_like(output_tensor)
            _all_gather(reference, input_tensor.clone(), group=group)

        stats = self.stats
        before = GatherStats(**asdict(stats)) if self.trace is not None else None
        call_start = time.perf_counter()
        stats.gathers += 1
        stats.elements += world * numel
        raw = codec.raw_nbytes(numel, dtype) * world
        stats.raw_bytes += raw
        tracked = self._tracks(numel * world, dtype)
        if tracked and (self._cache is None or self._cache.numel() != world * numel):
            self._cache = None
            self._history.clear()
        compress = tracked and self._cache is not None and self._decide(numel, dtype, world)
        self.last_compressed = compress
        if compress:
            self._compressed_gather(output_tensor, input_tensor, group)
        else:
            start = time.perf_counter()
            _all_gather(output_tensor, input_tensor, group=group)
            stats.comm_time_s += time.perf_counter() - start
            stats.bytes_sent += raw
            if tracked:
                self._refresh_cache(output_tensor, world)
        if before is not None:
            self._append_record(before, call_start, output_tensor, world, tracked)
        if reference is not None and not torch.equal(
            _int_bits(output_tensor), _int_bits(reference)
        ):
            raise RuntimeError(
                f"AdERA shadow check failed for group {self.name!r}: the decoded all-gather "
                "differs from the default one"
            )

    # Internals ----------------------------------------------------------------------------------

    def _append_record(
        self,
        before: GatherStats,
        start: float,
        output_tensor: torch.Tensor,
        world: int,
        tracked: bool,
    ) -> None:
        end = time.perf_counter()
        stats, dtype = self.stats, output_tensor.dtype
        changed: int | None = None
        if tracked:
            if stats.tracked_elements > before.tracked_elements:
                changed = stats.changed_exponents - before.changed_exponents
            self._trace_cache = None
        elif dtype in codec.SUPPORTED_DTYPES:
            new = codec.extract_exponents(output_tensor.detach().reshape(-1))
            if self._trace_cache is not None and self._trace_cache.numel() == new.numel():
                changed = int((new != self._trace_cache).sum())
            self._trace_cache = new
        self.trace.append(
            GatherRecord(
                group=self.name or "<root>",
                numel=output_tensor.numel(),
                dtype=_DTYPE_NAMES.get(dtype, str(dtype)),
                # Inside autograd's backward (FSDP2's pre-backward re-gather) a graph task runs.
                phase="backward" if torch._C._current_graph_task_id() != -1 else "forward",
                start_s=start,
                end_s=end,
                ready_s=time.perf_counter(),
                codec_s=stats.codec_time_s - before.codec_time_s,
                compressed=stats.compressed_gathers > before.compressed_gathers,
                spilled=stats.spill_gathers > before.spill_gathers,
                bytes_sent=stats.bytes_sent - before.bytes_sent,
                raw_bytes=stats.raw_bytes - before.raw_bytes,
                changed=changed,
                ranks=world,
            )
        )

    def _tracks(self, group_numel: int, dtype: torch.dtype) -> bool:
        if self.mode == "never":
            return False
        if dtype not in codec.SUPPORTED_DTYPES:
            if dtype not in _WARNED_DTYPES:
                _WARNED_DTYPES.add(dtype)
                warnings.warn(
                    f"AdERA compresses only bf16/fp32 all-gathers; groups of {dtype} are sent raw",
                    stacklevel=3,
                )
            return False
        return group_numel >= self.min_numel

    def _capacity(self, numel: int) -> int:
        same_phase = list(self._history)[-self.period :: -self.period]
        if same_phase:
            want = math.ceil(self.headroom * max(same_phase))
        else:
            want = math.ceil(self.initial_capacity * numel)
        return min(-(-want // 64) * 64, numel)  # a stream never exceeds one byte per element

    def _decide(self, numel: int, dtype: torch.dtype, world: int) -> bool:
        if self.mode == "always":
            return True
        payload = codec.payload_nbytes(numel, dtype, self._capacity(numel), self.chunk_size)
        return self.cost_model.should_compress(numel, dtype, world, payload)

    def _record(self, streams: list[int], changed: int, numel: int) -> None:
        """Remember the largest stream for the next capacity and count the exponent changes."""
        self._history.append(max(streams))
        self.stats.tracked_elements += len(streams) * numel
        self.stats.changed_exponents += changed

    def _refresh_cache(self, output_tensor: torch.Tensor, world: int) -> None:
        start = time.perf_counter()
        new = codec.extract_exponents(output_tensor)
        if self._cache is not None:
            numel = output_tensor.numel() // world
            changed = (new != self._cache).view(world, numel)
            n_chunks = math.ceil(numel / self.chunk_size)
            padded = torch.zeros(
                world, n_chunks * self.chunk_size, dtype=torch.bool, device=new.device
            )
            padded[:, :numel] = changed
            counts = padded.view(world, n_chunks, -1).sum(-1)
            sizes = codec.chunk_stream_nbytes(counts, numel, self.chunk_size).sum(-1)
            *streams, changed = torch.cat([sizes, counts.sum().reshape(1)]).tolist()
            self._record(streams, changed, numel)
        self._cache = new
        self.stats.codec_time_s += time.perf_counter() - start

    def _compressed_gather(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        world, rank = group.size(), group.rank()
        numel, dtype, device = input_tensor.numel(), input_tensor.dtype, input_tensor.device
        cache = self._cache.view(world, numel)
        capacity = self._capacity(numel)
        stats = self.stats

        start = time.perf_counter()
        buffer, spill = codec.encode_into(
            input_tensor, cache[rank], capacity, chunk_size=self.chunk_size, impl=self.impl
        )
        stats.codec_time_s += time.perf_counter() - start

        start = time.perf_counter()
        gathered = torch.empty(world * buffer.numel(), dtype=torch.uint8, device=device)
        _all_gather(gathered, buffer, group=group)
        gathered = gathered.view(world, -1)
        stats.comm_time_s += time.perf_counter() - start

        start = time.perf_counter()
        # One device-to-host copy of every rank's header and chunk counts.
        n_chunks = math.ceil(numel / self.chunk_size)
        prefix = gathered[:, : codec.HEADER_NBYTES + 2 * n_chunks].cpu()
        headers = [codec.read_header(prefix[r]) for r in range(world)]
        meta = prefix[:, codec.HEADER_NBYTES :].to(torch.int64)
        streams = [h.stream_nbytes for h in headers]
        self._record(streams, int(meta[:, 0::2].sum() + (meta[:, 1::2] << 8).sum()), numel)
        spills = [max(s - capacity, 0) for s in streams]
        stats.codec_time_s += time.perf_counter() - start

        sent = world * buffer.numel()
        if max(spills) > 0:
            start = time.perf_counter()
            longest = max(spills)
            padded = torch.zeros(longest, dtype=torch.uint8, device=device)
            padded[: spill.numel()] = spill
            spill_out = torch.empty(world * longest, dtype=torch.uint8, device=device)
            _all_gather(spill_out, padded, group=group)
            spill_out = spill_out.view(world, longest)
            stats.comm_time_s += time.perf_counter() - start
            stats.spill_gathers += 1
            sent += world * longest
        stats.compressed_gathers += 1
        stats.exception_bytes += sum(streams)
        stats.bytes_sent += sent
        stats.compressed_bytes_sent += sent
        stats.compressed_raw_bytes += world * codec.raw_nbytes(numel, dtype)

        start = time.perf_counter()
        out = output_tensor.view(world, numel)
        for r in range(world):
            codec.decode_from(
                gathered[r],
                cache[r],
                numel,
                dtype,
                spill=spill_out[r, : spills[r]] if spills[r] else None,
                out=out[r],
                cache_out=cache[r],
                header=headers[r],
                impl=self.impl,
            )
        stats.codec_time_s += time.perf_counter() - start

    # Cache checks -------------------------------------------------------------------------------

    def cache_checksum(self) -> int:
        """A cheap position-weighted checksum of the exponent cache (0 when there is none).

        Equal caches give equal checksums on every rank; compare them with
        :func:`verify_exponent_caches`.
        """
        if self._cache is None:
            return 0
        values = self._cache.to(torch.int64)
        weights = torch.arange(values.numel(), device=values.device) % 65521 + 1
        return int(((values * weights).sum() * 257 + values.sum()) % (1 << 61)) + 1

    def reset_cache(self) -> None:
        """Forget the cache: the next gather of the group is sent raw and rebuilds it."""
        self._cache = None
        self._trace_cache = None
        self._history.clear()


def _int_bits(t: torch.Tensor) -> torch.Tensor:
    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def install_adera_all_gather(module: nn.Module, **kwargs: object) -> dict[str, AdERAAllGather]:
    """Give every FSDP module under ``module`` (itself included) its own :class:`AdERAAllGather`.

    Args:
        module: A model already sharded with ``fully_shard``.
        **kwargs: Arguments of :class:`AdERAAllGather` (``name`` is set to the module's name).

    Returns:
        The installed instances by module name (``""`` for ``module`` itself).

    Raises:
        RuntimeError: If this torch has no custom all-gather.
        ValueError: If no FSDP module is found.
    """
    require_custom_all_gather()
    from torch.distributed.fsdp import FSDPModule

    comms: dict[str, AdERAAllGather] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            comm = AdERAAllGather(name=name, **kwargs)
            sub.set_custom_all_gather(comm)
            comms[name] = comm
    if not comms:
        raise ValueError("module has no FSDP module: apply fully_shard before installing AdERA")
    return comms


def verify_exponent_caches(
    comms: Iterable[AdERAAllGather],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Check that every rank of ``group`` holds the same exponent caches (collective).

    One ``all_reduce`` of two ``int64`` per instance: each rank's checksums and their negatives
    are reduced with MAX; the caches agree when the maximum equals the minimum everywhere.

    Args:
        comms: The instances of this rank, in the same order on every rank.
        group: Process group (default: the world).
        device: Device of the reduced tensor (default: that of the first cache, else CPU); CUDA
            for NCCL groups.

    Raises:
        RuntimeError: Naming the groups whose caches differ across ranks.
    """
    comms = list(comms)
    if device is None:
        caches = [c._cache for c in comms if c._cache is not None]
        device = caches[0].device if caches else "cpu"
    sums = torch.tensor([c.cache_checksum() for c in comms], dtype=torch.int64, device=device)
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = both[: len(comms)], -both[len(comms) :]
    bad = [c.name or "<root>" for c, hi, lo in zip(comms, highest, lowest, strict=True) if hi != lo]
    if bad:
        raise RuntimeError(
            f"AdERA exponent caches differ across ranks for groups {bad}; the weights of the next "
            "gathers would be wrong (reset the caches or resume from a checkpoint)"
        )


def trace_from_records(
    steps: "Iterable[tuple[list[GatherRecord], float, float, float]]",
    world_size: int,
    method: Literal["raw", "adera"],
    meta: dict[str, Any] | None = None,
) -> "Trace":
    """Turn recorded training steps into a simulator :class:`~ada_modules.strategies.adera_sim.Trace`.

    Each step is ``(records, start_s, backward_end_s, end_s)``: the step's
    :class:`GatherRecord` in call order and ``perf_counter`` readings at the start of the training
    step, at the end of its backward and at the end of its optimizer step. Per gather, the event's
    ``compute_s`` is the time from the gather's ``ready_s`` to the next gather's start (the last
    one's: to the end of the backward), so it holds the compute and the gradient reduce-scatters
    that ran in between (``reduce_scatter_numel`` is left 0); ``other_s`` (mean over steps) is the
    rest of the step: before the first gather and after the backward (optimizer step). A
    compressed gather's wall time goes to ``adera_gather_s`` (with ``codec_s``), any other's, less
    its cache update, to ``gather_s``. ``change_rate`` is ``changed / numel``, or 1 for a first
    gather (no cache: every exponent is new). ``measured_step_s[method]`` is the mean step time
    (``end_s - start_s``, less the trace's own bookkeeping, ``ready_s - end_s`` of every gather);
    ``meta["steps"]`` holds per-step times and byte counts. Gathers of other
    dtypes than bf16/fp32 are left out (named in ``meta["skipped_groups"]``).

    Examples:
        >>> record = GatherRecord("experts", 4096, "bf16", "forward", 1.0, 1.25, 1.25, 0.0,
        ...                       False, False, 16384, 16384, 41)
        >>> trace = trace_from_records([([record], 0.5, 2.0, 2.5)], world_size=2, method="raw")
        >>> event = trace.events[0]
        >>> event.gather_s, event.compute_s, trace.other_s, trace.measured_step_s
        (0.25, 0.75, 1.0, {'raw': 2.0})
        >>> round(event.change_rate, 4)
        0.01
    """
    from ada_modules.strategies.adera_sim import GatherEvent, Trace

    events: list[GatherEvent] = []
    per_step: list[dict[str, float]] = []
    skipped: set[str] = set()
    for step, (records, start_s, backward_end_s, end_s) in enumerate(steps):
        kept = [r for r in records if r.dtype in ("bf16", "fp32")]
        skipped.update(r.group for r in records if r.dtype not in ("bf16", "fp32"))
        for order, record in enumerate(kept):
            following = kept[order + 1].start_s if order + 1 < len(kept) else backward_end_s
            wall = record.end_s - record.start_s
            events.append(
                GatherEvent(
                    group=record.group,
                    numel=record.numel,
                    dtype=record.dtype,
                    change_rate=1.0 if record.changed is None else record.changed / record.numel,
                    order=order,
                    phase=record.phase,
                    compute_s=max(following - record.ready_s, 0.0),
                    step=step,
                    gather_s=None if record.compressed else max(wall - record.codec_s, 0.0),
                    adera_gather_s=wall if record.compressed else None,
                    codec_s=record.codec_s if record.compressed else None,
                )
            )
        compressed = [r for r in records if r.compressed]
        first = records[0].start_s if records else backward_end_s
        overhead = sum(r.ready_s - r.end_s for r in records)
        per_step.append(
            {
                "step_s": end_s - start_s - overhead,
                "trace_overhead_s": overhead,
                "other_s": max(first - start_s, 0.0) + max(end_s - backward_end_s, 0.0),
                "gathers": len(records),
                "compressed_gathers": len(compressed),
                "spill_gathers": sum(r.spilled for r in records),
                "bytes_sent": sum(r.bytes_sent for r in records),
                "raw_bytes": sum(r.raw_bytes for r in records),
                "compressed_bytes_sent": sum(r.bytes_sent for r in compressed),
                "compressed_raw_bytes": sum(r.raw_bytes for r in compressed),
            }
        )
    if not per_step:
        raise ValueError("no training step was recorded")
    info = dict(meta or {})
    info.update(steps=per_step, skipped_groups=sorted(skipped), method=method)
    return Trace(
        events=events,
        world_size=world_size,
        other_s=sum(s["other_s"] for s in per_step) / len(per_step),
        measured_step_s={method: sum(s["step_s"] for s in per_step) / len(per_step)},
        meta=info,
    )


# ----------------------------------------------------------------------------------------------
# The Lightning strategy
# ----------------------------------------------------------------------------------------------


class AdERAStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) with AdERA's compressed all-gather installed.

    The LightningModule shards itself in ``configure_model`` with ``fully_shard`` (as for
    ``ModelParallelStrategy``); after that, every ``FSDPModule`` gets its own
    :class:`AdERAAllGather`. Parameters and losses are bitwise identical to
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
    ``"never"``) or ``["adera"]``. Recording costs a few ``perf_counter`` calls per gather, and for
    groups that keep no cache one exponent comparison after the timed gather.

    Args:
        data_parallel_size: As for ``ModelParallelStrategy``.
        tensor_parallel_size: As for ``ModelParallelStrategy``.
        save_distributed_checkpoint: As for ``ModelParallelStrategy``.
        process_group_backend: As for ``ModelParallelStrategy``.
        timeout: As for ``ModelParallelStrategy``.
        mode: ``"auto"`` (compress a group when the cost model predicts a saving), ``"always"`` or
            ``"never"``.
        min_numel: Groups with fewer elements are never compressed.
        margin: Relative saving the cost model must predict in ``"auto"`` mode.
        calibrate: In ``"auto"`` mode, measure latency, bandwidth and codec speed at setup (a few
            collectives, identical result on every rank); otherwise use :class:`CostModel`'s
            defaults with ``margin``.
        chunk_size: Elements per exception chunk of the codec.
        shadow: Debug: also run the default all-gather and raise on any difference.
        check_caches: Debug: compare the exponent caches across ranks after every training step.
        log_stats: Log the per-step statistics with ``LightningModule.log_dict``.
        impl: Codec implementation (``"auto"``: Triton on CUDA, torch otherwise).
        trace_path: Write a simulator trace of the training steps to this JSON file at the end of
            fit (rank 0; parent folders are created). ``None``: record nothing.

    Raises:
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
        min_numel: int = 1 << 16,
        margin: float = 0.05,
        calibrate: bool = True,
        chunk_size: int = codec.DEFAULT_CHUNK_SIZE,
        shadow: bool = False,
        check_caches: bool = False,
        log_stats: bool = True,
        impl: Impl = "auto",
        trace_path: str | None = None,
    ) -> None:
        if trace_path is not None and (not isinstance(trace_path, str) or not trace_path):
            raise ValueError(f"trace_path must be None or a non-empty path, got {trace_path!r}")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        CostModel(margin=margin)  # validates margin
        # Validate the all-gather arguments now rather than at setup.
        AdERAAllGather(mode=mode, min_numel=min_numel, chunk_size=chunk_size, impl=impl)
        self.mode: Mode = mode
        self.min_numel = min_numel
        self.margin = margin
        self.calibrate = calibrate
        self.chunk_size = chunk_size
        self.shadow = shadow
        self.check_caches = check_caches
        self.log_stats = log_stats
        self.impl: Impl = impl
        self.trace_path = trace_path
        self.cost_model: CostModel | None = None
        self.comms: dict[str, AdERAAllGather] = {}
        self._verify_next = False
        self._trace_records: list[GatherRecord] = []
        self._trace_steps: list[tuple[list[GatherRecord], float, float, float]] = []
        self._step_start: float | None = None
        self._backward_end: float | None = None

    @property
    def stats(self) -> GatherStats:
        """Statistics summed over all groups since the last step's log (a fresh object)."""
        total = GatherStats()
        for comm in self.comms.values():
            total.add(comm.stats)
        return total

    def setup(self, trainer: "Trainer") -> None:
        """Set up FSDP2 as ``ModelParallelStrategy`` does, then install the AdERA all-gathers."""
        require_custom_all_gather()
        super().setup(trainer)
        if self.mode == "auto" and self.calibrate:
            self.cost_model = CostModel.calibrate(
                device=self.root_device, margin=self.margin, impl=self.impl
            )
        else:
            self.cost_model = CostModel(margin=self.margin)
        self.comms = install_adera_all_gather(
            self.model,
            mode=self.mode,
            cost_model=self.cost_model,
            min_numel=self.min_numel,
            chunk_size=self.chunk_size,
            shadow=self.shadow,
            impl=self.impl,
        )
        if self.trace_path is not None:
            self._trace_records.clear()
            self._trace_steps.clear()
            for comm in self.comms.values():
                comm.trace = self._trace_records

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's training step, then log and reset the AdERA statistics."""
        if self.trace_path is not None:  # gathers before this (validation) are not recorded
            self._trace_records.clear()
            self._backward_end = None
            self._step_start = time.perf_counter()
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
            method="raw" if self.mode == "never" else "adera",
            meta={
                "mode": self.mode,
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
