"""Per-gather records of AdERA's all-gathers, and their conversion into a simulator trace.

With ``trace`` set, :class:`~ada_modules.strategies.adera.AdERAAllGather` appends a
:class:`GatherRecord` per call; ``AdERAStrategy(trace_path=...)`` groups them by training step and
writes :func:`trace_from_records`'s :class:`~ada_modules.strategies.adera_sim.Trace` at the end of
fit, which :mod:`ada_modules.strategies.adera_sim` replays at 8-128 GPUs.
"""

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ada_modules.errors import InputError

if TYPE_CHECKING:
    from ada_modules.strategies.adera_sim import Trace

__all__ = ["GatherRecord", "trace_from_records"]


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


def trace_from_records(
    steps: "Iterable[tuple[list[GatherRecord], float, float, float]]",
    world_size: int,
    method: "Literal['raw', 'adera'] | Sequence[str]",
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
    gather (no cache: every exponent is new). ``method`` names how the steps sent their gathers,
    ``"raw"`` or ``"adera"``, or per step (``AdERAStrategy(alternate_steps=True)``);
    ``measured_step_s[m]`` is the mean step time of the steps of method ``m``
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
        raise InputError("no training step was recorded")
    methods = [method] * len(per_step) if isinstance(method, str) else list(method)
    if len(methods) != len(per_step) or not set(methods) <= {"raw", "adera"}:
        raise InputError(
            f"method must be 'raw', 'adera' or one of them per step ({len(per_step)}), "
            f"got {method!r}"
        )
    for values, name in zip(per_step, methods, strict=True):
        values["method"] = name
    measured = {
        name: statistics.mean(s["step_s"] for s in per_step if s["method"] == name)
        for name in dict.fromkeys(methods)
    }
    info = dict(meta or {})
    info.update(steps=per_step, skipped_groups=sorted(skipped))
    return Trace(
        events=events,
        world_size=world_size,
        other_s=sum(s["other_s"] for s in per_step) / len(per_step),
        measured_step_s=measured,
        meta=info,
    )
