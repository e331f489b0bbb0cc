"""Per-step counters of AdERA's all-gathers (:class:`GatherStats`).

Every :class:`~ada_modules.strategies.adera.AdERAAllGather` accumulates one; ``AdERAStrategy``
sums them over the groups, logs them every training step and resets them.

Examples:
    >>> stats = GatherStats(tracked_elements=1000, changed_exponents=20, bytes_sent=55, raw_bytes=100)
    >>> stats.reuse_rate, stats.bytes_ratio
    (0.98, 0.55)
"""

import math
from dataclasses import asdict, dataclass, fields

__all__ = ["GatherStats"]


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
