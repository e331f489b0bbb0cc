"""Trace-driven cost model of AdERA's compressed FSDP2 all-gather at 8-128 GPUs.

A :class:`Trace` records, per parameter all-gather of a training step, what the model needs:
the group's size and dtype, the measured fraction of exponents that changed since the previous
gather, the order and phase (forward/backward) of the gather and the compute that follows it
until the next gather. :func:`simulate_step` replays the trace for ``P`` ranks under a
:class:`HardwareProfile` with one of six ways to send the parameters (:data:`METHODS`):

- ``"raw"``: the plain all-gather (what FSDP2 sends);
- ``"adera"``: AdERA's lossless payload (sign+mantissa planes, plus the changed exponents), with
  its encode/decode time;
- ``"entropy"``: a lossless entropy coder of the exponents (DietGPU / nvCOMP-ANS / ZipNN-style),
  ratio and throughput from public figures (see :class:`Baselines`); its sizes are data-dependent,
  so it also pays one latency-only all-gather of the sizes;
- ``"int8"``: a lossy block-int8 weight all-gather (ZeRO++ qwZ-like);
- ``"adera_value"``: AdERA with ``reuse="value"`` (:mod:`ada_modules.kernels.delta_codec`), its
  bytes ratio measured on real snapshots (:class:`Baselines`), its codec at the profile's
  throughputs;
- ``"xor_delta"``: a lossless compressor of the XOR with the previous copy (ZipNN's delta mode,
  XOR + zstd), ratio measured on the same snapshots, throughput that of the entropy coder; like
  it, one latency-only all-gather of the sizes.

What is modelled, exactly:

- **All-gather, alpha-beta.** A shard of ``S`` bytes per rank. Flat ring over ``P`` ranks:
  ``(P-1) * (alpha + S / beta)``, with ``alpha``/``beta`` of NVLink when the ring stays in one node
  (``P <= gpus_per_node``), else of the inter-node network (every ring step waits for the
  slowest hop). Hierarchical, ``N = P / g`` nodes of ``g`` GPUs: an inter-node ring among the
  ``N`` GPUs of each local rank, then an intra-node ring of the ``N * S`` gathered bytes:
  ``(N-1) * (alpha_ib + S / beta_ib) + (g-1) * (alpha_nvl + N * S / beta_nvl)``. ``beta`` is
  the link bandwidth per GPU and direction times the profile's efficiency.
- **Payload bytes.** AdERA: the codec's format (:mod:`ada_modules.kernels.exponent_codec`):
  a 32-byte header, 2 count bytes per chunk of 1024 elements, 1 (bf16) or 3 (fp32) plane bytes
  per element and an exception area. A chunk whose ``c`` elements changed exponent costs 0 bytes
  (``c = 0``), ``ceil(L/8) + c`` (bitmap + packed exponents) or ``L`` (RAW), whichever is smaller;
  ``c`` is binomial with the measured change rate, and the exception area is sized
  ``capacity_slack`` times its expectation (fixed-size payloads agreed in advance).
- **Codec time.** Encode of the rank's shard and decode of all ``P`` shards, at the profile's
  throughputs, plus a fixed launch cost per call (``1 + P`` calls: the all-gather decodes each
  rank's shard separately), on the all-gather's critical path (FSDP2 runs the custom
  all-gather on its all-gather stream; encode-ahead after the optimizer step is *not* assumed).
  Chunks without any changed exponent (a fraction ``(1 - p)^1024``) cost ``codec_same_factor``
  times a chunk with changes. A fraction ``codec_interference`` of the codec time is also charged to the compute stream (the
  codec's kernels compete with the GEMMs for HBM bandwidth).
- **Overlap (FSDP2 prefetch, depth 1).** One compute stream and one communication channel, each
  serial. The all-gather of gather ``i+1`` may start when the compute after gather ``i`` starts
  (and the channel is free); the compute after gather ``i`` starts when gather ``i`` has finished
  and the previous compute has ended. In the backward pass, the gradients of a group are
  reduce-scattered (raw, ``reduce_dtype``) on the same channel once the group's backward compute
  ends. Step time = end of the last compute or communication + ``Trace.other_s`` (optimizer step,
  data loading: unchanged by the method). With ``overlap=False`` (the CPU/gloo profile: the codec
  runs on the calling thread) everything is serial: the sum of all gathers, computes and
  reduce-scatters.
- **Decision (``mode="auto"``).** A group is compressed only when its modelled AdERA all-gather
  time is below ``(1 - margin)`` times the raw one and it has at least ``min_numel`` elements;
  ``mode="always"`` compresses every group (what the CPU calibration run measures).

Not modelled: congestion between concurrent jobs, NCCL protocol switches (LL/LL128/Simple),
the exception-overflow second all-gather (rare by design), the memory of the caches (the value
cache holds the unsharded group on every rank), and how the two delta methods' ratios move with
the step (fixed at their measured steady state).

Calibration (:mod:`ada_modules.strategies.adera_calibration`): :meth:`HardwareProfile.fit_trace`
fits a CPU/gloo profile to timed gathers (of a micro-benchmark, or of a recorded run), and
``calibration_error`` replays a recorded run and compares the predicted ``adera - raw`` step time
with the measured one.

Invariants (checked on every projection): AdERA's projected all-gather speedup over ``"raw"``
never exceeds ``raw bytes / AdERA bytes`` (1 / compression ratio), and its step speedup never
exceeds ``1 / min_i r_i`` over its gathers.

Examples:
    >>> trace = synthetic_moe_trace(num_layers=2, steps=(300,))  # Mixtral-sized layers
    >>> profile = HardwareProfile.preset("h100_nvlink4_ib400")
    >>> raw = simulate_step(trace.events, 64, profile, "hierarchical", "raw")
    >>> adera = simulate_step(trace.events, 64, profile, "hierarchical", "adera")
    >>> adera.gather_s < raw.gather_s
    True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ada_modules.errors import InputError

__all__ = [
    "MEASURED_CHANGE_RATES",
    "METHODS",
    "PROFILES",
    "TOPOLOGIES",
    "Baselines",
    "GatherCost",
    "GatherEvent",
    "HardwareProfile",
    "ProjectionRow",
    "StepResult",
    "Trace",
    "adera_payload_bytes",
    "all_gather_time",
    "change_rate_curve",
    "gather_cost",
    "project",
    "projection_table",
    "simulate",
    "simulate_step",
    "synthetic_moe_trace",
]

Method = Literal["raw", "adera", "entropy", "int8", "adera_value", "xor_delta"]
Topology = Literal["ring", "hierarchical"]
METHODS: tuple[str, ...] = ("raw", "adera", "entropy", "int8", "adera_value", "xor_delta")
TOPOLOGIES: tuple[str, ...] = ("ring", "hierarchical")
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes per element of the parameter dtypes the trace may hold."""
PLANE_BYTES = {"bf16": 1, "fp32": 3}
"""Bytes of sign+mantissa per element that AdERA always sends."""
HEADER_BYTES = 32
COUNT_BYTES = 2
CHUNK = 1024
"""Payload layout constants of :mod:`ada_modules.kernels.exponent_codec` (header, per-chunk
count, chunk size in elements)."""
_WORLD_SIZES = (8, 16, 32, 64, 128)
_GB = 1e9


# ----------------------------------------------------------------------------------------------
# Trace
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatherEvent:
    """One parameter all-gather of one training step, and the compute that follows it.

    Attributes:
        group: Name of the FSDP2 parameter group (e.g. the module's qualified name).
        numel: Elements of the unsharded group (all ranks together).
        dtype: ``"bf16"`` or ``"fp32"``: the dtype in which the group is all-gathered.
        change_rate: Fraction of the group's elements whose exponent changed since the group's
            previous gather (0 for a backward re-gather of unchanged weights).
        order: Position of the gather within its step (0, 1, ...; forward before backward).
        phase: ``"forward"`` or ``"backward"``.
        compute_s: Compute time (s) from the end of this gather to the next gather's use, i.e. the
            compute of the module whose parameters were gathered.
        step: Training step the event belongs to.
        flops: FLOPs of that compute, if known (lets a GPU profile recompute ``compute_s``).
        reduce_scatter_numel: Gradient elements reduce-scattered after this compute (backward).
        gather_s: Measured wall time (s) of the plain all-gather, if measured.
        adera_gather_s: Measured wall time (s) of AdERA's all-gather (codec included), if measured.
        codec_s: Measured encode + decode time (s) of AdERA, if measured.
        adera_compute_s: Measured ``compute_s`` of the same module in the AdERA run, if measured
            (the codec may slow the compute beside or after it).
    """

    group: str
    numel: int
    dtype: str
    change_rate: float
    order: int
    phase: str
    compute_s: float
    step: int = 0
    flops: float | None = None
    reduce_scatter_numel: int = 0
    gather_s: float | None = None
    adera_gather_s: float | None = None
    codec_s: float | None = None
    adera_compute_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 1:
            raise InputError(f"numel must be a positive integer, got {self.numel!r}")
        if self.dtype not in DTYPE_BYTES:
            raise InputError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if not 0.0 <= self.change_rate <= 1.0:
            raise InputError(f"change_rate must be in [0, 1], got {self.change_rate!r}")
        if self.phase not in ("forward", "backward"):
            raise InputError(f"phase must be 'forward' or 'backward', got {self.phase!r}")
        for name in (
            "compute_s",
            "flops",
            "gather_s",
            "adera_gather_s",
            "codec_s",
            "adera_compute_s",
        ):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise InputError(f"{name} must be >= 0, got {value!r}")
        if self.reduce_scatter_numel < 0:
            raise InputError(
                f"reduce_scatter_numel must be >= 0, got {self.reduce_scatter_numel!r}"
            )


@dataclass
class Trace:
    """The all-gathers of one or more training steps, recorded at ``world_size`` ranks.

    Attributes:
        events: The gathers, in any order (sorted by ``(step, order)`` when replayed).
        world_size: Ranks of the recorded run.
        other_s: Per-step time outside the traced forward/backward (optimizer step, data).
        reduce_dtype: Dtype of the gradient reduce-scatter (``"fp32"`` or ``"bf16"``).
        measured_step_s: Measured mean step time (s) of the recorded run per method, e.g.
            ``{"raw": 0.21, "adera": 0.25}`` (what :func:`~ada_modules.strategies.adera_calibration.calibration_error` compares).
        profile: The hardware profile calibrated on the recording machine, if any.
        meta: Free-form description (model, command, date).

    Examples:
        >>> trace = Trace([GatherEvent("experts", 4096, "bf16", 0.02, 0, "forward", 1e-3)],
        ...               world_size=2)
        >>> Trace.from_json(trace.to_json()) == trace
        True
    """

    events: list[GatherEvent]
    world_size: int
    other_s: float = 0.0
    reduce_dtype: str = "fp32"
    measured_step_s: dict[str, float] = field(default_factory=dict)
    profile: HardwareProfile | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.events:
            raise InputError("events must not be empty")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise InputError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if self.world_size < 1:
            raise InputError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if self.reduce_dtype not in DTYPE_BYTES:
            raise InputError(
                f"reduce_dtype must be one of {sorted(DTYPE_BYTES)}, got {self.reduce_dtype!r}"
            )
        if not self.other_s >= 0:
            raise InputError(f"other_s must be >= 0, got {self.other_s!r}")
        unknown = set(self.measured_step_s) - set(METHODS)
        if unknown:
            raise InputError(f"measured_step_s keys must be among {METHODS}, got {sorted(unknown)}")

    @property
    def steps(self) -> list[int]:
        """The distinct steps of the trace, ascending."""
        return sorted({e.step for e in self.events})

    def step_events(self, step: int) -> list[GatherEvent]:
        """The events of ``step`` in gather order."""
        events = sorted((e for e in self.events if e.step == step), key=lambda e: e.order)
        if not events:
            raise InputError(f"step {step} is not in the trace (steps: {self.steps})")
        return events

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary."""
        return {
            "events": [dataclasses.asdict(e) for e in self.events],
            "world_size": self.world_size,
            "other_s": self.other_s,
            "reduce_dtype": self.reduce_dtype,
            "measured_step_s": dict(self.measured_step_s),
            "profile": None if self.profile is None else dataclasses.asdict(self.profile),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        """Inverse of :meth:`to_dict`."""
        profile = data.get("profile")
        return cls(
            events=[GatherEvent(**e) for e in data["events"]],
            world_size=data["world_size"],
            other_s=data.get("other_s", 0.0),
            reduce_dtype=data.get("reduce_dtype", "fp32"),
            measured_step_s=dict(data.get("measured_step_s", {})),
            profile=None if profile is None else HardwareProfile(**profile),
            meta=dict(data.get("meta", {})),
        )

    def to_json(self, path: str | Path | None = None) -> str:
        """The trace as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> Trace:
        """Read a trace from JSON text, or from a file when ``source`` is a ``Path``."""
        text = source.read_text() if isinstance(source, Path) else source
        return cls.from_dict(json.loads(text))


def change_rate_curve(trace: Trace, min_numel: int = 0) -> dict[int, float]:
    """Per step, the element-weighted mean change rate of the forward gathers.

    Only groups with at least ``min_numel`` elements count (e.g. the large expert groups).

    Examples:
        >>> events = [GatherEvent("a", 100, "bf16", 0.1, 0, "forward", 0.0),
        ...           GatherEvent("b", 300, "bf16", 0.02, 1, "forward", 0.0)]
        >>> change_rate_curve(Trace(events, world_size=2))
        {0: 0.04}
    """
    curve = {}
    for step in trace.steps:
        chosen = [
            e for e in trace.step_events(step) if e.phase == "forward" and e.numel >= min_numel
        ]
        if chosen:
            total = sum(e.numel for e in chosen)
            curve[step] = round(sum(e.change_rate * e.numel for e in chosen) / total, 12)
    return curve


# ----------------------------------------------------------------------------------------------
# Hardware
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareProfile:
    """Interconnect, memory and codec figures of one kind of machine.

    Bandwidths are per GPU and per direction, in bytes/s; latencies are per ring step, in s.

    Attributes:
        name: Label of the profile.
        gpus_per_node: GPUs sharing the fast intra-node link.
        intra_bandwidth: Intra-node link bandwidth (NVLink; loopback TCP for the CPU profile).
        intra_latency: Intra-node latency per ring step.
        inter_bandwidth: Inter-node bandwidth per GPU (one NIC per GPU).
        inter_latency: Inter-node latency per ring step.
        intra_efficiency: Fraction of ``intra_bandwidth`` a ring collective achieves.
        inter_efficiency: Fraction of ``inter_bandwidth`` a ring collective achieves.
        hbm_bandwidth: Device memory bandwidth (information; the codec rates derive from it).
        encode_throughput: AdERA encode rate, in input (parameter) bytes/s.
        decode_throughput: AdERA decode rate, in output (parameter) bytes/s.
        codec_launch_s: Fixed cost per encode or decode call (kernel launches, bookkeeping).
        flops: Dense bf16 compute rate (FLOP/s) used with ``mfu`` to turn ``GatherEvent.flops``
            into compute time; ``None``: use the trace's measured ``compute_s``.
        mfu: Fraction of ``flops`` the model's compute achieves.
        overlap: FSDP2 prefetch overlap of communication and compute (``False``: serial).
        codec_interference: Fraction of the codec time that also slows the compute stream.
        codec_same_factor: Cost of coding a chunk in which no exponent changed, relative to a
            chunk with changes (the encode/decode rates above are for the latter). 1 on the GPU
            presets (an assumption); on CPU the torch reference skips the exception work for such
            chunks, and the calibration measures it.

    Examples:
        >>> h100 = HardwareProfile.preset("h100_nvlink4_ib400")
        >>> h100.gpus_per_node, h100.inter_bandwidth / 1e9
        (8, 50.0)
    """

    name: str
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    intra_efficiency: float = 1.0
    inter_efficiency: float = 1.0
    hbm_bandwidth: float | None = None
    encode_throughput: float = 1e12
    decode_throughput: float = 1e12
    codec_launch_s: float = 0.0
    flops: float | None = None
    mfu: float = 0.4
    overlap: bool = True
    codec_interference: float = 0.0
    codec_same_factor: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise InputError(f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        for name in (
            "intra_bandwidth",
            "inter_bandwidth",
            "encode_throughput",
            "decode_throughput",
            "intra_efficiency",
            "inter_efficiency",
            "mfu",
        ):
            if not getattr(self, name) > 0:
                raise InputError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "intra_latency",
            "inter_latency",
            "codec_launch_s",
            "codec_interference",
            "codec_same_factor",
        ):
            if not getattr(self, name) >= 0:
                raise InputError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.flops is not None and not self.flops > 0:
            raise InputError(f"flops must be None or > 0, got {self.flops!r}")

    @classmethod
    def preset(cls, name: str) -> HardwareProfile:
        """The named preset of :data:`PROFILES`."""
        if name not in PROFILES:
            raise InputError(f"profile must be one of {sorted(PROFILES)}, got {name!r}")
        return PROFILES[name]

    @classmethod
    def calibrate(
        cls,
        latency_s: float,
        bandwidth: float,
        encode_throughput: float,
        decode_throughput: float,
        codec_launch_s: float = 0.0,
        world_size: int = 2,
        name: str = "cpu_gloo",
        codec_same_factor: float = 1.0,
        codec_interference: float = 0.0,
    ) -> HardwareProfile:
        """A profile of ``world_size`` processes on one machine from measured numbers.

        All ranks are on one "node" (``gpus_per_node = world_size``), the measured loopback
        latency and bandwidth are the intra-node link at efficiency 1, compute comes from the
        trace (``flops=None``) and nothing overlaps (``overlap=False``: with gloo on a few shared
        cores the codec and the collective run on the CPUs that compute). The numbers come from
        :meth:`fit_trace`.

        Examples:
            >>> cpu = HardwareProfile.calibrate(1e-4, 1e9, 2e8, 3e8)
            >>> cpu.gpus_per_node, cpu.overlap
            (2, False)
        """
        return cls(
            name=name,
            gpus_per_node=world_size,
            intra_bandwidth=bandwidth,
            intra_latency=latency_s,
            inter_bandwidth=bandwidth,
            inter_latency=latency_s,
            encode_throughput=encode_throughput,
            decode_throughput=decode_throughput,
            codec_launch_s=codec_launch_s,
            overlap=False,
            codec_same_factor=codec_same_factor,
            codec_interference=codec_interference,
        )

    @classmethod
    def fit_trace(
        cls, trace: Trace, name: str = "cpu_gloo_fit", baselines: Baselines | None = None
    ) -> HardwareProfile:
        """A :meth:`calibrate` profile fitted to the per-gather measurements of a recorded run.

        The all-gather latency and bandwidth come from a least-squares fit of the events'
        ``gather_s`` against their shard bytes (``(P - 1) * (alpha + S / beta)``); the codec from
        a least-squares fit of the events' ``adera_gather_s`` minus the fitted wire time of the
        payload (or, without it, ``codec_s``; the former also holds the wait for the slower rank's
        codec, which the model charges to the codec) against the unsharded bytes in chunks with and
        without exponent changes, ``a + c1 * B * f + c0 * B * (1 - f)`` (``f``: expected fraction
        of chunks with a change): launch ``a / (1 + P)`` (one encode and ``P`` decodes), equal encode and decode rates that give the
        per-byte cost ``c1``, and ``codec_same_factor = c0 / c1``. When the events carry
        ``adera_compute_s``, ``codec_interference`` is the extra compute time of the AdERA run
        over the modelled codec time. ``baselines`` gives the payload's ``capacity_slack``. The step model (the
        composition of gathers, computes and reduce-scatters) is then what
        :func:`~ada_modules.strategies.adera_calibration.calibration_error` tests.

        Raises:
            ValueError: If the events lack the measurements or have a single gather size.

        Examples:
            >>> events = [GatherEvent("g", n, "bf16", 0.0, i, "forward", 0.0,
            ...                       gather_s=1e-4 + n / 1e9, codec_s=2e-4 + 2 * n / 1e8)
            ...           for i, n in enumerate([2**16, 2**20])]
            >>> fitted = HardwareProfile.fit_trace(Trace(events, world_size=2))
            >>> round(fitted.intra_latency * 1e6), round(fitted.intra_bandwidth / 1e9, 3)
            (100, 1.0)
        """
        world = trace.world_size
        if world < 2:
            raise InputError(f"fit_trace needs a trace of >= 2 ranks, got {world}")
        timed = [e for e in trace.events if e.gather_s is not None]
        shard_bytes = [-(-e.numel // world) * DTYPE_BYTES[e.dtype] for e in timed]
        if len(set(shard_bytes)) < 2:
            raise InputError("fit_trace needs gather_s measured at two or more gather sizes")
        latency, bandwidth = _fit_alpha_beta(
            [float(b) for b in shard_bytes], [e.gather_s / (world - 1) for e in timed]
        )
        wire = cls.calibrate(latency, bandwidth, 1.0, 1.0, world_size=world)
        slack = (baselines or Baselines()).capacity_slack
        rows, codec = [], []
        for e in trace.events:
            if e.adera_gather_s is not None:
                shard = -(-e.numel // world)
                payload = adera_payload_bytes(shard, e.dtype, e.change_rate, slack)
                codec_s = e.adera_gather_s - all_gather_time(payload, world, wire, "ring")
            elif e.codec_s is not None:
                codec_s = e.codec_s
            else:
                continue
            nbytes = float(e.numel * DTYPE_BYTES[e.dtype])
            changed = _changed_chunk_fraction(e.change_rate)
            rows.append((nbytes * changed, nbytes * (1 - changed)))
            codec.append(codec_s)
        if len({r[0] + r[1] for r in rows}) < 2:
            raise InputError("fit_trace needs codec_s or adera_gather_s at two or more sizes")
        with_changes = [r for r in rows if r[0] > 0]
        without = [r for r in rows if r[1] > 0]
        if with_changes and without:
            # codec_s = a + c1 * bytes * f + c0 * bytes * (1 - f), f = chunks with changes.
            intercept, c1, c0 = _least_squares([(1.0, r[0], r[1]) for r in rows], codec)
        else:  # one kind of chunk only: a single per-byte cost
            intercept, inverse = _fit_alpha_beta([r[0] + r[1] for r in rows], codec)
            c1 = c0 = 1 / inverse
        c1 = max(c1, 1e-15)
        # raw/enc + full/dec with enc = dec = r and raw = full / P: full * (1 + 1/P) / r.
        rate = (1 + 1 / world) / c1
        same = max(c0, 0.0) / c1
        fitted = cls.calibrate(
            latency, bandwidth, rate, rate, max(intercept, 0.0) / (1 + world), world, name, same
        )
        paired = [e for e in trace.events if e.adera_compute_s is not None]
        if not paired:
            return fitted
        # The compute slowdown in the AdERA run, as a fraction of the modelled codec time.
        codec_total = sum(
            gather_cost(e, world, fitted, "ring", "adera", "always", baselines).codec_s
            for e in paired
        )
        slowdown = sum(e.adera_compute_s - e.compute_s for e in paired)
        return dataclasses.replace(fitted, codec_interference=max(slowdown, 0.0) / codec_total)


def _gpu_profile(
    name: str,
    nvlink: float,
    nic: float,
    hbm: float,
    flops: float,
) -> HardwareProfile:
    # Assumptions shared by the GPU presets (not measured here; replace them with the numbers of
    # bench/gpu/adera.py when available):
    # - ring steps cost 3 us over NVLink and 6 us over InfiniBand;
    # - ring collectives reach 80% of the NVLink and 90% of the NIC line rate;
    # - the codec is memory-bound at 70% of HBM bandwidth, touching 2 bytes of HBM per input
    #   byte to encode (read value + cache, write planes + exceptions) and 2.5 per output byte to
    #   decode (read payload + cache, write value + cache), with 10 us of launches per call;
    # - compute reaches 40% of the dense bf16 peak (MFU) and the codec's kernels slow the
    #   compute stream by 25% of their own time while they run beside it.
    return HardwareProfile(
        name=name,
        gpus_per_node=8,
        intra_bandwidth=nvlink,
        intra_latency=3e-6,
        inter_bandwidth=nic,
        inter_latency=6e-6,
        intra_efficiency=0.8,
        inter_efficiency=0.9,
        hbm_bandwidth=hbm,
        encode_throughput=0.7 * hbm / 2.0,
        decode_throughput=0.7 * hbm / 2.5,
        codec_launch_s=10e-6,
        flops=flops,
        mfu=0.4,
        overlap=True,
        codec_interference=0.25,
    )


PROFILES: dict[str, HardwareProfile] = {
    # Public figures. A100 SXM: NVLink 3, 600 GB/s bidirectional = 300 GB/s per direction; HBM2e
    # 2.0 TB/s (80 GB part); 312 TFLOPS dense bf16; DGX A100 has one 200 Gb/s HDR InfiniBand port
    # per GPU (25 GB/s per direction).
    "a100_nvlink3_ib200": _gpu_profile("a100_nvlink3_ib200", 300e9, 25e9, 2.0e12, 312e12),
    # H100 SXM: NVLink 4, 900 GB/s bidirectional = 450 GB/s per direction; HBM3 3.35 TB/s;
    # 989 TFLOPS dense bf16; DGX H100 has one 400 Gb/s NDR port per GPU (50 GB/s per direction).
    "h100_nvlink4_ib400": _gpu_profile("h100_nvlink4_ib400", 450e9, 50e9, 3.35e12, 989e12),
    # H200 SXM: same NVLink 4 and compute as H100, HBM3e 4.8 TB/s; DGX H200 also has 8 x 400 Gb/s.
    "h200_nvlink4_ib400": _gpu_profile("h200_nvlink4_ib400", 450e9, 50e9, 4.8e12, 989e12),
    # H100 nodes joined by one 100 Gb/s Ethernet/RoCE port per GPU (12.5 GB/s): a cheaper cluster.
    "h100_nvlink4_roce100": _gpu_profile("h100_nvlink4_roce100", 450e9, 12.5e9, 3.35e12, 989e12),
}
"""Named hardware presets (public link, memory and compute figures; see the comments)."""


@dataclass(frozen=True)
class Baselines:
    """Parameters of the two compressed baselines and of AdERA's payload and decision.

    Attributes:
        entropy_ratio_bf16: Compressed/original size of an entropy coder on bf16 weights.
            Default 0.67: DietGPU's README gives bf16 at about (8 + 2.7) / 16 bits (sign and
            mantissa raw, ANS-coded exponent of ~2.7 bits), and ZipNN (arXiv 2411.05239) reports
            ~33% savings on bf16 models.
        entropy_ratio_fp32: The same for fp32: (24 + 2.7) / 32 = 0.83 (DietGPU's README: fp32
            "at best ~75%", the exponent-free floor).
        entropy_throughput: Encode and decode rate (input bytes/s) of the entropy coder on a GPU.
            Default 400e9: the middle of DietGPU's 250-600 GB/s float codec on an A100 (README);
            an assumption for other GPUs (nvCOMP's ANS is in the same range per its docs).
        entropy_cpu_throughput: The same on the calibrated CPU profile (``flops=None``), default
            0.5e9 (an assumption; only used to fill the CPU tables).
        int8_block: Elements per quantisation block of the int8 baseline (ZeRO++ qwZ quantises
            weights block-wise to int8; the block size here is an assumption).
        int8_scale_bytes: Bytes of the per-block scale (fp32).
        value_ratio_bf16: AdERA's value-reuse payload over raw bytes for a forward gather after
            an optimizer step, bf16. Default 0.224: ``bench/adera_peers.py`` on the library's
            10.5M-parameter LM at step 200 (0.19-0.33 over steps 10-200).
        value_ratio_fp32: The same for fp32: 0.607 (0.58-0.66).
        xor_delta_ratio_bf16: The best lossless XOR-delta peer (ZipNN's delta mode) on the same
            snapshots: 0.300 (0.26-0.41).
        xor_delta_ratio_fp32: The same for fp32: 0.649 (0.63-0.70).
        unchanged_ratio: Payload over raw bytes of both delta methods for a re-gather of unchanged
            weights (FSDP2's backward re-gather): 0.002 (headers and chunk words only).
        capacity_slack: AdERA's fixed exception capacity, as a multiple of the expected
            exception bytes (the payload size is agreed in advance, so it is padded).
        margin: ``mode="auto"`` compresses a group only if it saves at least this fraction.
        min_numel: Groups smaller than this are never compressed in ``mode="auto"``.

    Examples:
        >>> Baselines().entropy_ratio_bf16
        0.67
    """

    entropy_ratio_bf16: float = 0.67
    entropy_ratio_fp32: float = 0.83
    entropy_throughput: float = 400e9
    entropy_cpu_throughput: float = 0.5e9
    int8_block: int = 256
    int8_scale_bytes: int = 4
    value_ratio_bf16: float = 0.224
    value_ratio_fp32: float = 0.607
    xor_delta_ratio_bf16: float = 0.300
    xor_delta_ratio_fp32: float = 0.649
    unchanged_ratio: float = 0.002
    capacity_slack: float = 1.1
    margin: float = 0.05
    min_numel: int = 65536

    def __post_init__(self) -> None:
        ratios = (
            "entropy_ratio_bf16",
            "entropy_ratio_fp32",
            "value_ratio_bf16",
            "value_ratio_fp32",
        )
        ratios += ("xor_delta_ratio_bf16", "xor_delta_ratio_fp32", "unchanged_ratio")
        for name in ratios:
            if not 0 < getattr(self, name) <= 1:
                raise InputError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("entropy_throughput", "entropy_cpu_throughput"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.int8_block < 1 or self.int8_scale_bytes < 0:
            raise InputError("int8_block must be >= 1 and int8_scale_bytes >= 0")
        if not self.capacity_slack >= 1:
            raise InputError(f"capacity_slack must be >= 1, got {self.capacity_slack!r}")
        if not 0 <= self.margin < 1:
            raise InputError(f"margin must be in [0, 1), got {self.margin!r}")


# ----------------------------------------------------------------------------------------------
# Cost of one all-gather
# ----------------------------------------------------------------------------------------------


def all_gather_time(
    shard_bytes: float, world_size: int, profile: HardwareProfile, topology: Topology
) -> float:
    """Alpha-beta time (s) of an all-gather of ``shard_bytes`` per rank (see the module docstring).

    Raises:
        ValueError: If the topology is unknown, or hierarchical with ``world_size`` above one
            node and not a multiple of ``gpus_per_node``.

    Examples:
        >>> p = HardwareProfile("toy", 8, intra_bandwidth=100.0, intra_latency=1.0,
        ...                     inter_bandwidth=10.0, inter_latency=2.0)
        >>> all_gather_time(100, 4, p, "ring")  # 3 * (1 + 100 / 100)
        6.0
        >>> all_gather_time(100, 16, p, "ring")  # 15 * (2 + 100 / 10)
        180.0
        >>> all_gather_time(100, 16, p, "hierarchical")  # 1 * (2 + 10) + 7 * (1 + 200 / 100)
        33.0
    """
    if topology not in TOPOLOGIES:
        raise InputError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if world_size < 1:
        raise InputError(f"world_size must be >= 1, got {world_size!r}")
    intra_beta = profile.intra_bandwidth * profile.intra_efficiency
    inter_beta = profile.inter_bandwidth * profile.inter_efficiency
    g = profile.gpus_per_node
    if world_size <= g:
        return (world_size - 1) * (profile.intra_latency + shard_bytes / intra_beta)
    if topology == "ring":
        return (world_size - 1) * (profile.inter_latency + shard_bytes / inter_beta)
    if world_size % g:
        raise InputError(
            f"hierarchical all-gather needs world_size={world_size} to be a multiple of "
            f"gpus_per_node={g}"
        )
    nodes = world_size // g
    inter = (nodes - 1) * (profile.inter_latency + shard_bytes / inter_beta)
    intra = (g - 1) * (profile.intra_latency + nodes * shard_bytes / intra_beta)
    return inter + intra


def _expected_stream_bytes(numel: int, change_rate: float) -> float:
    """Expected exception bytes of ``numel`` elements in chunks of :data:`CHUNK` (binomial)."""
    full, last = divmod(numel, CHUNK)
    total = full * _expected_chunk_bytes(CHUNK, change_rate)
    if last:
        total += _expected_chunk_bytes(last, change_rate)
    return total


def _changed_chunk_fraction(change_rate: float) -> float:
    """Expected fraction of :data:`CHUNK`-element chunks with at least one changed exponent."""
    return 1.0 - (1.0 - change_rate) ** CHUNK


@functools.lru_cache(maxsize=4096)
def _expected_chunk_bytes(length: int, p: float) -> float:
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(length)
    bitmap = -(-length // 8)
    # E[min(bitmap + c, length) ; c > 0] with c ~ Binomial(length, p), summed in log space.
    log_p, log_q = math.log(p), math.log1p(-p)
    lg = math.lgamma(length + 1)
    expected = 0.0
    for c in range(1, length + 1):
        log_pmf = lg - math.lgamma(c + 1) - math.lgamma(length - c + 1) + c * log_p
        log_pmf += (length - c) * log_q
        if log_pmf > -60:
            expected += math.exp(log_pmf) * min(bitmap + c, length)
    return expected


def adera_payload_bytes(
    numel: int, dtype: str, change_rate: float, capacity_slack: float = 1.0
) -> float:
    """Bytes of AdERA's payload for a shard of ``numel`` elements at ``change_rate``.

    Header + counts + planes + ``capacity_slack`` times the expected exception bytes (capped at
    the RAW size of the exceptions, one byte per element).

    Examples:
        >>> adera_payload_bytes(4096, "bf16", 0.0)  # 32 + 4 chunks * 2 + 4096
        4136.0
        >>> adera_payload_bytes(4096, "fp32", 1.0)  # every chunk RAW: + 4096 exponent bytes
        16424.0
    """
    if dtype not in PLANE_BYTES:
        raise InputError(f"dtype must be one of {sorted(PLANE_BYTES)}, got {dtype!r}")
    fixed = HEADER_BYTES + COUNT_BYTES * -(-numel // CHUNK) + PLANE_BYTES[dtype] * numel
    stream = min(capacity_slack * _expected_stream_bytes(numel, change_rate), float(numel))
    return float(fixed) + stream


@dataclass(frozen=True)
class GatherCost:
    """Modelled cost of one all-gather under one method.

    Attributes:
        comm_s: Time on the wire (alpha-beta of the payload).
        codec_s: Encode + decode time (0 for ``"raw"``).
        payload_bytes: Bytes sent per rank.
        raw_bytes: Bytes per rank of the uncompressed shard.
        compressed: Whether the method compressed this gather.
    """

    comm_s: float
    codec_s: float
    payload_bytes: float
    raw_bytes: float
    compressed: bool

    @property
    def total_s(self) -> float:
        """Wire plus codec time."""
        return self.comm_s + self.codec_s

    @property
    def ratio(self) -> float:
        """Payload bytes over raw bytes."""
        return self.payload_bytes / self.raw_bytes


def _entropy_codec_s(
    raw_bytes: float, world_size: int, profile: HardwareProfile, topology: Topology, b: Baselines
) -> float:
    """Codec time of an entropy coder: one encode and one batched decode of all ``P`` shards
    (2 calls, as such libraries do), plus one latency-only all-gather of the data-dependent
    sizes before the data."""
    rate = b.entropy_throughput if profile.flops is not None else b.entropy_cpu_throughput
    return (
        2 * profile.codec_launch_s
        + (raw_bytes + raw_bytes * world_size) / rate
        + all_gather_time(8.0, world_size, profile, topology)
    )


def gather_cost(
    event: GatherEvent,
    world_size: int,
    profile: HardwareProfile,
    topology: Topology,
    method: Method,
    mode: Literal["auto", "always"] = "auto",
    baselines: Baselines | None = None,
) -> GatherCost:
    """Modelled cost of gathering ``event``'s group with ``method`` (see the module docstring).

    ``mode`` applies to ``"adera"`` and ``"adera_value"`` only; the other compressed methods
    always compress.

    Examples:
        >>> p = HardwareProfile.preset("h100_nvlink4_ib400")
        >>> e = GatherEvent("experts", 2**27, "bf16", 0.01, 0, "forward", 0.0)
        >>> cost = gather_cost(e, 64, p, "ring", "adera")
        >>> cost.compressed, round(cost.ratio, 3)
        (True, 0.575)
    """
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    if mode not in ("auto", "always"):
        raise InputError(f"mode must be 'auto' or 'always', got {mode!r}")
    b = baselines or Baselines()
    shard = -(-event.numel // world_size)
    raw_bytes = float(shard * DTYPE_BYTES[event.dtype])
    raw = GatherCost(
        all_gather_time(raw_bytes, world_size, profile, topology), 0.0, raw_bytes, raw_bytes, False
    )
    if method == "raw":
        return raw
    full_bytes = raw_bytes * world_size
    if method == "adera":
        payload = adera_payload_bytes(shard, event.dtype, event.change_rate, b.capacity_slack)
        changed = _changed_chunk_fraction(event.change_rate)
        codec = (1 + world_size) * profile.codec_launch_s + (
            raw_bytes / profile.encode_throughput + full_bytes / profile.decode_throughput
        ) * (changed + (1 - changed) * profile.codec_same_factor)
    elif method == "entropy":
        ratio = b.entropy_ratio_bf16 if event.dtype == "bf16" else b.entropy_ratio_fp32
        payload = ratio * raw_bytes
        codec = _entropy_codec_s(raw_bytes, world_size, profile, topology, b)
    elif method in ("adera_value", "xor_delta"):
        value = method == "adera_value"
        if event.change_rate == 0:  # a re-gather of weights that did not change
            ratio = b.unchanged_ratio
        elif value:
            ratio = b.value_ratio_bf16 if event.dtype == "bf16" else b.value_ratio_fp32
        else:
            ratio = b.xor_delta_ratio_bf16 if event.dtype == "bf16" else b.xor_delta_ratio_fp32
        if value:  # fixed-size payloads: padded like AdERA's exception area
            payload = min(b.capacity_slack * ratio, 1.0) * raw_bytes
            codec = (1 + world_size) * profile.codec_launch_s + (
                raw_bytes / profile.encode_throughput + full_bytes / profile.decode_throughput
            )
        else:
            payload = ratio * raw_bytes
            codec = _entropy_codec_s(raw_bytes, world_size, profile, topology, b)
    else:  # int8: one byte per element plus a scale per block; quantise/dequantise like a codec
        payload = shard + b.int8_scale_bytes * -(-shard // b.int8_block)
        codec = (
            2 * profile.codec_launch_s
            + raw_bytes / profile.encode_throughput
            + full_bytes / profile.decode_throughput
        )
    cost = GatherCost(
        all_gather_time(payload, world_size, profile, topology), codec, payload, raw_bytes, True
    )
    if method in ("adera", "adera_value") and mode == "auto":
        small = event.numel < b.min_numel
        if small or not cost.total_s < (1 - b.margin) * raw.total_s:
            return raw
    return cost


# ----------------------------------------------------------------------------------------------
# A step
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """Modelled time of one step under one method.

    Attributes:
        step_s: Step time (s), ``other_s`` included.
        gather_s: Sum of the all-gathers' wire + codec times.
        compute_s: Sum of the compute times (codec interference included).
        payload_bytes: Bytes sent per rank by the all-gathers.
        raw_bytes: Bytes per rank of the same all-gathers uncompressed.
        min_ratio: Smallest payload/raw ratio among the gathers.
        compressed: Gathers the method compressed.
        gathers: Number of gathers.
    """

    step_s: float
    gather_s: float
    compute_s: float
    payload_bytes: float
    raw_bytes: float
    min_ratio: float
    compressed: int
    gathers: int


def _compute_time(event: GatherEvent, profile: HardwareProfile) -> float:
    if profile.flops is not None and event.flops is not None:
        return event.flops / (profile.flops * profile.mfu)
    return event.compute_s


def simulate_step(
    events: Sequence[GatherEvent],
    world_size: int,
    profile: HardwareProfile,
    topology: Topology,
    method: Method,
    mode: Literal["auto", "always"] = "auto",
    baselines: Baselines | None = None,
    other_s: float = 0.0,
    reduce_dtype: str = "fp32",
) -> StepResult:
    """Replay one step's gathers (in ``order``) with FSDP2 prefetch (see the module docstring).

    Examples:
        >>> p = HardwareProfile("toy", 8, 100.0, 0.0, 100.0, 0.0)
        >>> events = [GatherEvent("a", 400, "bf16", 0.0, i, "forward", 5.0) for i in range(3)]
        >>> simulate_step(events, 2, p, "ring", "raw").step_s  # gathers of 4 s hidden but the first
        19.0
    """
    ordered = sorted(events, key=lambda e: e.order)
    if not ordered:
        raise InputError("events must not be empty")
    costs = [
        gather_cost(e, world_size, profile, topology, method, mode, baselines) for e in ordered
    ]
    computes = [
        _compute_time(e, profile) + profile.codec_interference * c.codec_s
        for e, c in zip(ordered, costs, strict=True)
    ]
    rs_bytes = DTYPE_BYTES[reduce_dtype]
    reduce_scatters = [
        all_gather_time(
            -(-e.reduce_scatter_numel // world_size) * rs_bytes, world_size, profile, topology
        )
        if e.reduce_scatter_numel
        else 0.0
        for e in ordered
    ]
    if profile.overlap:
        end = _overlapped(costs, computes, reduce_scatters)
    else:
        end = sum(c.total_s for c in costs) + sum(computes) + sum(reduce_scatters)
    return StepResult(
        step_s=end + other_s,
        gather_s=sum(c.total_s for c in costs),
        compute_s=sum(computes),
        payload_bytes=sum(c.payload_bytes for c in costs),
        raw_bytes=sum(c.raw_bytes for c in costs),
        min_ratio=min(c.ratio for c in costs),
        compressed=sum(c.compressed for c in costs),
        gathers=len(costs),
    )


def _overlapped(
    costs: Sequence[GatherCost], computes: Sequence[float], reduce_scatters: Sequence[float]
) -> float:
    channel = 0.0  # when the communication channel is next free
    compute_end = 0.0
    compute_starts: list[float] = []
    pending: list[tuple[float, float]] = []  # reduce-scatters: (ready time, duration)
    for i, (cost, compute, rs) in enumerate(zip(costs, computes, reduce_scatters, strict=True)):
        ready = compute_starts[i - 1] if i else 0.0  # prefetch depth 1
        # Reduce-scatters issued before this all-gather go first on the channel.
        while pending and pending[0][0] <= ready:
            rs_ready, rs_time = pending.pop(0)
            channel = max(channel, rs_ready) + rs_time
        gather_end = max(channel, ready) + cost.total_s
        channel = gather_end
        start = max(compute_end, gather_end)
        compute_starts.append(start)
        compute_end = start + compute
        if rs:
            pending.append((compute_end, rs))
    for rs_ready, rs_time in pending:
        channel = max(channel, rs_ready) + rs_time
    return max(compute_end, channel)


def simulate(
    trace: Trace,
    world_size: int,
    profile: HardwareProfile,
    topology: Topology,
    method: Method,
    mode: Literal["auto", "always"] = "auto",
    baselines: Baselines | None = None,
    steps: Iterable[int] | None = None,
) -> StepResult:
    """Mean of :func:`simulate_step` over the trace's steps (or over ``steps``)."""
    chosen = list(trace.steps if steps is None else steps)
    results = [
        simulate_step(
            trace.step_events(s),
            world_size,
            profile,
            topology,
            method,
            mode,
            baselines,
            trace.other_s,
            trace.reduce_dtype,
        )
        for s in chosen
    ]
    n = len(results)
    return StepResult(
        step_s=sum(r.step_s for r in results) / n,
        gather_s=sum(r.gather_s for r in results) / n,
        compute_s=sum(r.compute_s for r in results) / n,
        payload_bytes=sum(r.payload_bytes for r in results) / n,
        raw_bytes=sum(r.raw_bytes for r in results) / n,
        min_ratio=min(r.min_ratio for r in results),
        compressed=round(sum(r.compressed for r in results) / n),
        gathers=round(sum(r.gathers for r in results) / n),
    )


# ----------------------------------------------------------------------------------------------
# Projection
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectionRow:
    """AdERA against the three baselines at one world size, topology and profile.

    Attributes:
        profile: Profile name.
        world_size: ``P``.
        topology: ``"ring"`` or ``"hierarchical"``.
        gather_s: Per-step all-gather time (s) of each method.
        step_s: Step time (s) of each method.
        ratio: AdERA's bytes over raw bytes (all gathers of the step).
        ceiling: ``1 / ratio``: the most AdERA's all-gather can gain over raw.
        compressed: Gathers AdERA compressed, out of ``gathers``.
        gathers: Gathers per step.
    """

    profile: str
    world_size: int
    topology: str
    gather_s: dict[str, float]
    step_s: dict[str, float]
    ratio: float
    ceiling: float
    compressed: int
    gathers: int

    def gather_speedup(self, baseline: str) -> float:
        """AdERA's all-gather speedup over ``baseline`` (baseline time / AdERA time)."""
        return self.gather_s[baseline] / self.gather_s["adera"]

    def step_speedup(self, baseline: str) -> float:
        """AdERA's step speedup over ``baseline``."""
        return self.step_s[baseline] / self.step_s["adera"]

    def value_gather_speedup(self, baseline: str) -> float:
        """AdERA value reuse's all-gather speedup over ``baseline``."""
        return self.gather_s[baseline] / self.gather_s["adera_value"]

    def value_step_speedup(self, baseline: str) -> float:
        """AdERA value reuse's step speedup over ``baseline``."""
        return self.step_s[baseline] / self.step_s["adera_value"]


def project(
    trace: Trace,
    profile: HardwareProfile,
    world_sizes: Sequence[int] = _WORLD_SIZES,
    topologies: Sequence[str] = TOPOLOGIES,
    mode: Literal["auto", "always"] = "auto",
    baselines: Baselines | None = None,
    steps: Iterable[int] | None = None,
) -> list[ProjectionRow]:
    """Replay ``trace`` at every world size and topology with AdERA and the three baselines.

    Raises:
        RuntimeError: If a projection breaks the ceiling (a bug in the model, never expected).

    Examples:
        >>> trace = synthetic_moe_trace(num_layers=1, d_model=256, d_ff=512, steps=(300,))
        >>> rows = project(trace, HardwareProfile.preset("h100_nvlink4_ib400"), [16])
        >>> [r.topology for r in rows], all(r.gather_speedup("raw") <= r.ceiling for r in rows)
        (['ring', 'hierarchical'], True)
    """
    chosen = list(trace.steps if steps is None else steps)
    rows = []
    for world_size in world_sizes:
        for topology in topologies:
            results = {
                m: simulate(trace, world_size, profile, topology, m, mode, baselines, chosen)
                for m in METHODS
            }
            adera = results["adera"]
            ratio = adera.payload_bytes / adera.raw_bytes
            row = ProjectionRow(
                profile=profile.name,
                world_size=world_size,
                topology=topology,
                gather_s={m: r.gather_s for m, r in results.items()},
                step_s={m: r.step_s for m, r in results.items()},
                ratio=ratio,
                ceiling=1 / ratio,
                compressed=adera.compressed,
                gathers=adera.gathers,
            )
            _check_ceiling(row, adera.min_ratio)
            rows.append(row)
    return rows


def _check_ceiling(row: ProjectionRow, min_ratio: float) -> None:
    tolerance = 1 + 1e-9
    if row.gather_speedup("raw") > max(1.0, row.ceiling) * tolerance:
        raise RuntimeError(
            f"all-gather speedup {row.gather_speedup('raw'):.4f} over raw exceeds 1/ratio = "
            f"{row.ceiling:.4f} at P={row.world_size} ({row.topology})"
        )
    if row.step_speedup("raw") > max(1.0, 1 / min_ratio) * tolerance:
        raise RuntimeError(
            f"step speedup {row.step_speedup('raw'):.4f} over raw exceeds 1/min ratio = "
            f"{1 / min_ratio:.4f} at P={row.world_size} ({row.topology})"
        )


def projection_table(rows: Sequence[ProjectionRow]) -> str:
    """Markdown table of :func:`project`'s rows: speedups of AdERA over each baseline.

    Columns: profile, topology, ``P``, raw all-gather ms per step, AdERA's bytes ratio and
    ceiling, all-gather speedup over raw / entropy / int8, step speedup over raw / entropy / int8,
    then AdERA value reuse's all-gather speedup over raw and over the XOR-delta peer and its step
    speedup over raw and over the XOR-delta peer.
    """
    header = (
        "| profile | topology | P | raw AG ms/step | AdERA bytes | ceiling 1/r | AG x raw | "
        "AG x entropy | AG x int8 | step x raw | step x entropy | step x int8 | compressed | "
        "value AG x raw | value AG x xor-delta | value step x raw | value step x xor-delta |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: |"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"| {r.profile} | {r.topology} | {r.world_size} | {1e3 * r.gather_s['raw']:.2f} | "
            f"{r.ratio:.3f} | {r.ceiling:.2f} | {r.gather_speedup('raw'):.2f} | "
            f"{r.gather_speedup('entropy'):.2f} | {r.gather_speedup('int8'):.2f} | "
            f"{r.step_speedup('raw'):.3f} | {r.step_speedup('entropy'):.3f} | "
            f"{r.step_speedup('int8'):.3f} | {r.compressed}/{r.gathers} | "
            f"{r.value_gather_speedup('raw'):.2f} | {r.value_gather_speedup('xor_delta'):.2f} | "
            f"{r.value_step_speedup('raw'):.3f} | {r.value_step_speedup('xor_delta'):.3f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Fitting helpers
# ----------------------------------------------------------------------------------------------


def _least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Solve the normal equations of a small least-squares problem (Gaussian elimination)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * t for r, t in zip(rows, targets, strict=True)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda i: abs(a[i][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        if a[col][col] == 0:
            raise InputError("the least-squares problem is singular")
        for i in range(col + 1, k):
            factor = a[i][col] / a[col][col]
            a[i] = [x - factor * y for x, y in zip(a[i], a[col], strict=True)]
            b[i] -= factor * b[col]
    solution = [0.0] * k
    for i in reversed(range(k)):
        rest = sum(a[i][j] * solution[j] for j in range(i + 1, k))
        solution[i] = (b[i] - rest) / a[i][i]
    return solution


def _fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = alpha + S / beta``; alpha clipped at 0, beta from the slope."""
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(times) / n
    var = sum((s - mean_s) ** 2 for s in sizes)
    slope = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, times, strict=True)) / var
    slope = max(slope, 1e-15)
    return max(mean_t - slope * mean_s, 0.0), 1.0 / slope


# ----------------------------------------------------------------------------------------------
# Synthetic traces
# ----------------------------------------------------------------------------------------------

MEASURED_CHANGE_RATES: dict[int, float] = {0: 0.13, 50: 0.018, 300: 0.009}
"""Fraction of bf16 weight exponents changing per step, measured on this project's machines in a
small MLP trained with AdamW (lr 1e-3, cosine): 13% at step 0, 1.8% by step 50, below 1% after
step 300 (taken as 0.9%)."""


def _change_rate_at(step: int, curve: dict[int, float]) -> float:
    """Piecewise log-linear interpolation of ``curve`` (constant beyond its ends)."""
    points = sorted(curve.items())
    if step <= points[0][0]:
        return points[0][1]
    for (s0, p0), (s1, p1) in zip(points, points[1:], strict=False):
        if step <= s1:
            if p0 <= 0 or p1 <= 0:
                return p0 + (p1 - p0) * (step - s0) / (s1 - s0)
            return math.exp(math.log(p0) + (math.log(p1) - math.log(p0)) * (step - s0) / (s1 - s0))
    return points[-1][1]


def synthetic_moe_trace(
    num_layers: int = 32,
    d_model: int = 4096,
    d_ff: int = 14336,
    num_experts: int = 8,
    top_k: int = 2,
    expert_matrices: int = 3,
    vocab_size: int = 32000,
    tokens_per_gpu: int = 4096,
    dtype: str = "bf16",
    steps: Sequence[int] = (0, 50, 300),
    change_rates: dict[int, float] | None = None,
    other_s: float = 0.0,
) -> Trace:
    """A trace of an MoE decoder sharded as :class:`~ada_modules.models.MoELMModule` shards it.

    FSDP2 groups per layer: ``blocks.i`` (attention ``4 d^2``, router ``d E``, norms ``4 d``) and
    ``blocks.i.moe.experts`` (``E * expert_matrices * d * d_ff``; 3 matrices for SwiGLU experts
    as in Mixtral, 2 for the library's GELU experts), plus the root (embedding and head,
    ``2 V d``). Forward gathers: root, then per layer the block and its experts; the root stays
    unsharded for the backward (FSDP2 keeps the root's parameters after forward), whose gathers
    run in reverse with change rate 0 (same weights) and reduce-scatter each group's gradients
    afterwards (the root's backward compute joins the first backward gather's, its gradients the
    last reduce-scatter). Compute is given in FLOPs (``2 x`` active parameters per token forward, ``4 x``
    backward, ``tokens_per_gpu`` tokens; only ``top_k`` of the experts are active) so that a
    profile with ``flops`` turns it into time; ``compute_s`` holds the same at 1 PFLOP/s.

    ``change_rates`` maps steps to forward change rates (interpolated log-linearly); the default
    is :data:`MEASURED_CHANGE_RATES`, this project's measurement. Defaults describe a
    Mixtral-8x7B-shaped model.

    Examples:
        >>> trace = synthetic_moe_trace(num_layers=2, d_model=64, d_ff=128, steps=(0, 300))
        >>> len(trace.step_events(0)), change_rate_curve(trace)
        (9, {0: 0.13, 300: 0.009})
    """
    for name, value in (
        ("num_layers", num_layers),
        ("d_model", d_model),
        ("d_ff", d_ff),
        ("num_experts", num_experts),
        ("top_k", top_k),
        ("expert_matrices", expert_matrices),
        ("vocab_size", vocab_size),
        ("tokens_per_gpu", tokens_per_gpu),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if top_k > num_experts:
        raise InputError(f"top_k={top_k} must not exceed num_experts={num_experts}")
    curve = dict(MEASURED_CHANGE_RATES if change_rates is None else change_rates)
    if not curve:
        raise InputError("change_rates must not be empty")
    expert_numel = num_experts * expert_matrices * d_model * d_ff
    block_numel = 4 * d_model * d_model + d_model * num_experts + 4 * d_model
    root_numel = 2 * vocab_size * d_model
    active = {
        "root": 2 * vocab_size * d_model,
        "block": block_numel,
        "experts": top_k * expert_matrices * d_model * d_ff,
    }
    numel = {"root": root_numel, "block": block_numel, "experts": expert_numel}
    reference_rate = 1e15
    events: list[GatherEvent] = []
    for step in steps:
        p = _change_rate_at(step, curve)
        order = 0

        def add(kind: str, name: str, phase: str, rate: float, step: int = step) -> None:
            nonlocal order
            factor = 2 if phase == "forward" else 4
            flops = float(factor * active[kind] * tokens_per_gpu)
            events.append(
                GatherEvent(
                    group=name,
                    numel=numel[kind],
                    dtype=dtype,
                    change_rate=rate,
                    order=order,
                    phase=phase,
                    compute_s=flops / reference_rate,
                    step=step,
                    flops=flops,
                    reduce_scatter_numel=numel[kind] if phase == "backward" else 0,
                )
            )
            order += 1

        add("root", "model", "forward", p)
        for i in range(num_layers):
            add("block", f"model.blocks.{i}", "forward", p)
            add("experts", f"model.blocks.{i}.moe.experts", "forward", p)
        for i in reversed(range(num_layers)):
            add("experts", f"model.blocks.{i}.moe.experts", "backward", 0.0)
            add("block", f"model.blocks.{i}", "backward", 0.0)
        # The root is not re-gathered: its backward (the head's) runs before the last layer's
        # and its gradients are reduce-scattered with the first layer's.
        first_bwd, last_bwd = events[-2 * num_layers], events[-1]
        root_flops = 4.0 * active["root"] * tokens_per_gpu
        events[-2 * num_layers] = dataclasses.replace(
            first_bwd,
            flops=first_bwd.flops + root_flops,
            compute_s=first_bwd.compute_s + root_flops / reference_rate,
        )
        events[-1] = dataclasses.replace(
            last_bwd, reduce_scatter_numel=last_bwd.reduce_scatter_numel + root_numel
        )
    return Trace(
        events=events,
        world_size=1,
        other_s=other_s,
        meta={
            "synthetic": True,
            "model": {
                "num_layers": num_layers,
                "d_model": d_model,
                "d_ff": d_ff,
                "num_experts": num_experts,
                "top_k": top_k,
                "expert_matrices": expert_matrices,
                "vocab_size": vocab_size,
                "tokens_per_gpu": tokens_per_gpu,
                "dtype": dtype,
            },
            "change_rates": {str(k): v for k, v in curve.items()},
        },
    )
