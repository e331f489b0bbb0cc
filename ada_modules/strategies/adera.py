"""AdERA's compressed FSDP2 all-gather: exact weights from sign+mantissa and an exponent cache.

Usable without Lightning
(:func:`~ada_modules.strategies.adera_install.install_adera_all_gather` after ``fully_shard``);
:class:`~ada_modules.strategies.AdERAStrategy` installs it for a Lightning ``Trainer``.

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

With ``reuse="value"`` the cache holds the group's whole previous value instead (its dtype's bytes
per element rather than one), and the payload is :mod:`ada_modules.kernels.delta_codec`'s: small
integer moves of each element's bits since the last gather, in Exp-Golomb bit planes, so an element
that did not move costs about a bit and one that moved a few units in the last place a few bits.

Gathers are sent raw in mode ``"never"``, for groups smaller than ``min_numel``, for dtypes other
than bf16/fp32 (with a one-time warning), for the first gather of a group (no cache yet), and in
mode ``"auto"`` when the :class:`~ada_modules.strategies.adera_cost_model.CostModel` predicts no
saving. A group keeps an exponent cache (refreshed from the output of its raw gathers) unless it
is never compressed: mode ``"never"``, below ``min_numel``, another dtype, or in mode ``"auto"``
a group that would not pay even if no exponent changed.

Examples:
    >>> comm = AdERAAllGather(mode="always", min_numel=0)
    >>> comm.stats.gathers, comm.mode
    (0, 'always')
"""

import math
import time
import warnings
from collections import deque
from dataclasses import asdict
from types import ModuleType
from typing import Literal, get_args

import torch
import torch.distributed as dist

from ada_modules.checks import is_finite_real
from ada_modules.errors import InputError
from ada_modules.kernels import delta_codec
from ada_modules.kernels import exponent_codec as codec
from ada_modules.kernels._dispatch import Impl, resolve_impl, triton_available
from ada_modules.strategies.adera_budget import ValueCacheBudget
from ada_modules.strategies.adera_cost_model import CostModel
from ada_modules.strategies.adera_stats import GatherStats
from ada_modules.strategies.adera_trace import GatherRecord

try:  # FSDP2's custom-comm interface: torch >= 2.9
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
except ImportError:  # pragma: no cover - exercised only on old torch
    _AllGatherBase = object

__all__ = [
    "MIN_TORCH_VERSION",
    "AdERAAllGather",
    "Mode",
    "Reuse",
    "check_impl",
    "require_custom_all_gather",
]

# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single (same arguments).
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

MIN_TORCH_VERSION = "2.9"
"""The first torch release with ``FSDPModule.set_custom_all_gather``."""

Mode = Literal["auto", "always", "never"]
"""When a group's all-gather is compressed: cost-model decision, always, or never."""
Reuse = Literal["exponent", "value", "auto"]
"""What the receivers cache: each element's exponent (1 byte), its whole previous value, or the
value while a shared :class:`~ada_modules.strategies.adera_budget.ValueCacheBudget` allows."""

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


def check_impl(impl: object) -> Impl:
    """Validate a codec ``impl`` where it is given, not at the first compressed gather.

    The all-gather runs on CUDA tensors when CUDA is available and on CPU tensors otherwise, so
    ``impl="triton"`` is checked as :func:`~ada_modules.kernels.resolve_impl` will check it then:
    triton must be importable, and without CUDA the Triton interpreter must be on
    (``TRITON_INTERPRET=1``). No CUDA tensor is created (that would initialise CUDA before Lightning
    launches its processes).

    Args:
        impl: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``impl``.

    Raises:
        InputError: If ``impl`` is not an allowed value, or is ``"triton"`` and Triton cannot run
            here.

    Examples:
        >>> check_impl("torch")
        'torch'
        >>> try:
        ...     check_impl("cuda")
        ... except InputError as error:
        ...     print(str(error).partition(" (")[2].partition(")")[0])  # the allowed values
        'auto', 'triton', 'torch'
    """
    allowed = get_args(Impl)
    if not isinstance(impl, str) or impl not in allowed:
        raise InputError(
            f'impl must be one of {allowed}, got {impl!r} ("auto" runs the Triton codec on CUDA '
            "devices and the torch codec otherwise)"
        )
    if impl != "triton":
        return impl
    if not triton_available():
        problem = "the triton package cannot be imported here"
    elif torch.cuda.is_available():
        return impl
    else:
        try:  # the gathers will run on CPU tensors: resolve_impl decides as it will then
            resolve_impl(impl, torch.empty(0))
        except ValueError as error:
            problem = f"no CUDA device is available ({error})"
        else:
            return impl
    raise InputError(
        f"impl='triton' cannot run the AdERA codec on this machine: {problem}; allowed: {allowed}, "
        "use impl='auto' (Triton on CUDA, torch otherwise) or impl='torch'"
    )


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


class AdERAAllGather(_AllGatherBase):
    """FSDP2 custom all-gather that sends sign+mantissa planes and only the changed exponents.

    Install one instance per FSDP module with
    :func:`~ada_modules.strategies.adera_install.install_adera_all_gather` (or
    ``fsdp_module.set_custom_all_gather(AdERAAllGather(...))``). The instance keeps the cache of
    its parameter group on every rank (:attr:`cache_nbytes`: ``world_size * shard_numel`` bytes
    with ``reuse="exponent"``, the group's full size in its dtype with ``reuse="value"``) and its
    :attr:`stats`.

    Set ``trace`` to a list (several instances may share one) to append a
    :class:`~ada_modules.strategies.adera_trace.GatherRecord` per call, in call order
    (``AdERAStrategy(trace_path=...)`` does so). A group that keeps no cache then keeps a
    trace-only copy of its exponents to count the changes, outside the timed gather.

    Set ``enabled = False`` to send every gather raw for a while; tracked groups keep their caches
    current, so compression resumes exactly when it is set back (``AdERAStrategy`` does so on every
    other step with ``alternate_steps=True``).

    Args:
        mode: ``"auto"`` (compress when ``cost_model`` predicts a saving), ``"always"`` or
            ``"never"``.
        reuse: ``"exponent"`` (cache one exponent byte per element; the payload always carries
            every sign and mantissa, so at least half (bf16) or three quarters (fp32) of the raw
            bytes) or ``"value"`` (cache the previous value; the payload carries only how each
            element moved, see :mod:`ada_modules.kernels.delta_codec`: 2× (bf16) or 4× (fp32)
            the exponent cache's memory for far fewer bytes on the wire), or ``"auto"``: value
            reuse if the group's value cache fits what is left of ``value_cache_budget`` at its
            first tracked gather, exponent reuse otherwise (:attr:`reuse` then says which).
        value_cache_budget: The budget ``reuse="auto"`` draws on, shared by the groups of a model
            (:func:`~ada_modules.strategies.adera_install.install_adera_all_gather` makes one from
            ``value_cache_bytes``).
        cost_model: The model ``"auto"`` consults; identical on every rank (default:
            :class:`~ada_modules.strategies.adera_cost_model.CostModel`'s defaults). A group
            that it would not compress even without any changed exponent keeps no cache.
        min_numel: Groups with fewer elements (all ranks together) are never compressed and keep
            no cache.
        chunk_size: Elements per exception chunk of the codec.
        initial_capacity: Stream capacity of the first compressed gather, as a fraction of the
            shard's elements (``reuse="exponent"``) or raw bytes (``reuse="value"``); later
            capacities follow the decoded statistics.
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
        impl: Codec implementation: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or
            ``"torch"``; checked here (see :func:`check_impl`), so a Triton codec that cannot run
            on this machine fails at construction, not at the first compressed gather.
        name: A label for messages (e.g. the module's name).

    Raises:
        InputError: For a bad argument (a ``ValueError``).
        RuntimeError: If this torch has no custom all-gather (see :func:`require_custom_all_gather`).
    """

    def __init__(
        self,
        mode: Mode = "auto",
        *,
        reuse: Reuse = "exponent",
        value_cache_budget: ValueCacheBudget | None = None,
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
            raise InputError(f"mode must be one of {get_args(Mode)}, got {mode!r}")
        if reuse not in get_args(Reuse):
            raise InputError(f"reuse must be one of {get_args(Reuse)}, got {reuse!r}")
        if (reuse == "auto") != (value_cache_budget is not None):
            raise InputError(
                "reuse='auto' needs a value_cache_budget, and only reuse='auto' takes one; got "
                f"reuse={reuse!r} with value_cache_budget={value_cache_budget!r}"
            )
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise InputError(f"min_numel must be a non-negative int, got {min_numel!r}")
        if (
            isinstance(chunk_size, bool)
            or not isinstance(chunk_size, int)
            or not (16 <= chunk_size <= 32768 and chunk_size & (chunk_size - 1) == 0)
        ):
            raise InputError(
                f"chunk_size must be a power of two in [16, 32768], got {chunk_size!r}"
            )
        if not (is_finite_real(initial_capacity) and 0 <= initial_capacity <= 1):
            raise InputError(f"initial_capacity must be in [0, 1], got {initial_capacity!r}")
        if not (is_finite_real(headroom) and headroom >= 1):
            raise InputError(f"headroom must be a finite number >= 1, got {headroom!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InputError(f"window must be a positive int, got {window!r}")
        if isinstance(period, bool) or not isinstance(period, int) or not 1 <= period <= window:
            raise InputError(f"period must be an int in [1, window={window}], got {period!r}")
        check_impl(impl)
        self.mode: Mode = mode
        self.reuse: Reuse = reuse
        self.value_cache_budget = value_cache_budget
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
        self.enabled = True
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
            raise InputError(
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
        tracked = self._tracks(numel, dtype, world)
        if tracked and (self._cache is None or self._cache.numel() != world * numel):
            self._cache = None
            self._history.clear()
        compress = (
            self.enabled
            and tracked
            and self._cache is not None
            and self._decide(numel, dtype, world)
        )
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

    def _tracks(self, numel: int, dtype: torch.dtype, world: int) -> bool:
        """Whether the group keeps an exponent cache (and may be compressed)."""
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
        if numel * world < self.min_numel:
            return False
        claimed = 0
        if self.reuse == "auto":
            value_cache = world * codec.raw_nbytes(numel, dtype)
            claimed = value_cache if self.value_cache_budget.claim(value_cache) else 0
            self.reuse = "value" if claimed else "exponent"
        if self.mode == "auto":
            # The smallest payload (no stream byte) bounds every later one: if even that does
            # not pay, no change rate will, so the group keeps no cache.
            smallest = self._codec.payload_nbytes(numel, dtype, 0, self.chunk_size)
            pays = self.cost_model.should_compress(numel, dtype, world, smallest)
            if not pays and claimed:
                self.value_cache_budget.release(claimed)
                self.reuse = "exponent"
            return pays
        return True

    @property
    def _codec(self) -> ModuleType:
        """The codec module of this group's reuse mode (both have the same payload functions)."""
        return delta_codec if self.reuse == "value" else codec

    @property
    def cache_nbytes(self) -> int:
        """Bytes of the cache this instance holds now (0 before the first tracked gather)."""
        return 0 if self._cache is None else self._cache.numel() * self._cache.element_size()

    def _capacity(self, numel: int, dtype: torch.dtype) -> int:
        # A stream never exceeds one byte per element (exponents) or the raw shard (values).
        most = codec.raw_nbytes(numel, dtype) if self.reuse == "value" else numel
        same_phase = list(self._history)[-self.period :: -self.period]
        if same_phase:
            want = math.ceil(self.headroom * max(same_phase))
        else:
            want = math.ceil(self.initial_capacity * most)
        return min(-(-want // 64) * 64, most)

    def _decide(self, numel: int, dtype: torch.dtype, world: int) -> bool:
        if self.mode == "always":
            return True
        capacity = self._capacity(numel, dtype)
        payload = self._codec.payload_nbytes(numel, dtype, capacity, self.chunk_size)
        return self.cost_model.should_compress(numel, dtype, world, payload)

    def _record(self, streams: list[int], changed: int, numel: int) -> None:
        """Remember the largest stream for the next capacity and count the exponent changes."""
        self._history.append(max(streams))
        self.stats.tracked_elements += len(streams) * numel
        self.stats.changed_exponents += changed

    def _refresh_cache(self, output_tensor: torch.Tensor, world: int) -> None:
        if self.reuse == "value":
            self._refresh_value_cache(output_tensor, world)
            return
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

    def _refresh_value_cache(self, output_tensor: torch.Tensor, world: int) -> None:
        start = time.perf_counter()
        new = output_tensor.detach().reshape(-1)
        if self._cache is not None:
            numel = new.numel() // world
            old, cur = self._cache.view(world, numel), new.view(world, numel)
            streams = [
                int(delta_codec.chunk_forms(cur[r], old[r], self.chunk_size).size.sum())
                for r in range(world)
            ]
            self._record(streams, _changed_exponents(cur, old), numel)
            self._cache.copy_(new)
        else:
            self._cache = new.clone()
        self.stats.codec_time_s += time.perf_counter() - start

    def _compressed_gather(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup
    ) -> None:
        world, rank = group.size(), group.rank()
        numel, dtype, device = input_tensor.numel(), input_tensor.dtype, input_tensor.device
        values = self.reuse == "value"
        used = self._codec
        cache = self._cache.view(world, numel)
        capacity = self._capacity(numel, dtype)
        stats = self.stats

        start = time.perf_counter()
        buffer, spill = used.encode_into(
            input_tensor, cache[rank], capacity, chunk_size=self.chunk_size, impl=self.impl
        )
        stats.codec_time_s += time.perf_counter() - start

        start = time.perf_counter()
        gathered = torch.empty(world * buffer.numel(), dtype=torch.uint8, device=device)
        _all_gather(gathered, buffer, group=group)
        gathered = gathered.view(world, -1)
        stats.comm_time_s += time.perf_counter() - start

        start = time.perf_counter()
        # One device-to-host copy of every rank's header (and, for exponents, chunk counts).
        counts_nbytes = 0 if values else 2 * math.ceil(numel / self.chunk_size)
        prefix = gathered[:, : used.HEADER_NBYTES + counts_nbytes].cpu()
        headers = [used.read_header(prefix[r]) for r in range(world)]
        streams = [h.stream_nbytes for h in headers]
        spills = [max(s - capacity, 0) for s in streams]
        stats.codec_time_s += time.perf_counter() - start

        spill_out = self._gather_spills(spill, spills, streams, buffer.numel(), group)
        stats.compressed_raw_bytes += world * codec.raw_nbytes(numel, dtype)

        start = time.perf_counter()
        out = output_tensor.view(world, numel)
        if values:
            exponents_before = codec.extract_exponents(self._cache)
        for r in range(world):
            kwargs = {"out": cache[r]} if values else {"out": out[r], "cache_out": cache[r]}
            used.decode_from(
                gathered[r],
                cache[r],
                numel,
                dtype,
                spill=spill_out[r, : spills[r]] if spills[r] else None,
                header=headers[r],
                impl=self.impl,
                **kwargs,
            )
        if values:
            out.copy_(cache)
            changed = int((codec.extract_exponents(self._cache) != exponents_before).sum())
        else:
            meta = prefix[:, used.HEADER_NBYTES :].to(torch.int64)
            changed = int(meta[:, 0::2].sum() + (meta[:, 1::2] << 8).sum())
        self._record(streams, changed, numel)
        stats.codec_time_s += time.perf_counter() - start

    def _gather_spills(
        self,
        spill: torch.Tensor,
        spills: list[int],
        streams: list[int],
        payload_nbytes: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor | None:
        """All-gather the spills (padded to the longest) if any rank has one; count the bytes."""
        stats, world = self.stats, group.size()
        sent = world * payload_nbytes
        spill_out = None
        if max(spills) > 0:
            start = time.perf_counter()
            longest = max(spills)
            padded = torch.zeros(longest, dtype=torch.uint8, device=spill.device)
            padded[: spill.numel()] = spill
            spill_out = torch.empty(world * longest, dtype=torch.uint8, device=spill.device)
            _all_gather(spill_out, padded, group=group)
            spill_out = spill_out.view(world, longest)
            stats.comm_time_s += time.perf_counter() - start
            stats.spill_gathers += 1
            sent += world * longest
        stats.compressed_gathers += 1
        stats.exception_bytes += sum(streams)
        stats.bytes_sent += sent
        stats.compressed_bytes_sent += sent
        return spill_out

    # Cache checks -------------------------------------------------------------------------------

    def cache_checksum(self) -> int:
        """A cheap position-weighted checksum of the exponent cache (0 when there is none).

        Equal caches give equal checksums on every rank; compare them with
        :func:`~ada_modules.strategies.adera_install.verify_exponent_caches`.
        """
        if self._cache is None:
            return 0
        values = _int_bits(self._cache).to(torch.int64)
        weights = torch.arange(values.numel(), device=values.device) % 65521 + 1
        return int(((values * weights).sum() * 257 + values.sum()) % (1 << 61)) + 1

    def reset_cache(self) -> None:
        """Forget the cache: the next gather of the group is sent raw and rebuilds it."""
        self._cache = None
        self._trace_cache = None
        self._history.clear()


def _changed_exponents(new: torch.Tensor, old: torch.Tensor) -> int:
    return int((codec.extract_exponents(new) != codec.extract_exponents(old)).sum())


def _int_bits(t: torch.Tensor) -> torch.Tensor:
    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
