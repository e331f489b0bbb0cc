"""Checking the simulator against this machine: a micro-benchmark and a recorded run.

:func:`calibration_error` replays a recorded CPU/gloo run (a
:class:`~ada_modules.strategies.adera_sim.Trace` holding the measured ``raw`` and ``adera`` step
times) under a :class:`~ada_modules.strategies.adera_sim.HardwareProfile` and compares the
predicted ``adera - raw`` step time with the measured one. The profile can come from

- :func:`measure_gloo_gathers`, a micro-benchmark independent of the run: two gloo processes time
  :class:`~ada_modules.strategies.AdERAAllGather` itself (raw and compressed) on synthetic shards,
  and :meth:`HardwareProfile.fit_trace` fits the profile to those gathers;
- :meth:`HardwareProfile.fit_trace` of other recorded runs (e.g. other seeds: a held-out check);
- :meth:`HardwareProfile.fit_trace` of the run itself (tests only how the step model composes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ada_modules.errors import InputError
from ada_modules.strategies.adera_sim import Baselines, HardwareProfile, Trace, simulate
from ada_modules.strategies.adera_trace import trace_from_records

__all__ = ["CalibrationResult", "calibration_error", "measure_gloo_gathers", "run_gloo_ranks"]


@dataclass(frozen=True)
class CalibrationResult:
    """Predicted vs measured step times of a recorded run (see :func:`calibration_error`).

    Attributes:
        predicted_s: Modelled step time per method (``"raw"``, ``"adera"``).
        measured_s: Measured step time per method.
        predicted_diff_s: Modelled ``adera - raw`` step time.
        measured_diff_s: Measured ``adera - raw`` step time.
        relative_error: ``(predicted_diff - measured_diff) / |measured_diff|``; the acceptance
            bound is ``|relative_error| <= 0.2``. Unstable when the measured difference is near 0;
            then read ``error_of_step``.
        error_of_step: ``(predicted_diff - measured_diff) / measured raw step time``.
    """

    predicted_s: dict[str, float]
    measured_s: dict[str, float]
    predicted_diff_s: float
    measured_diff_s: float
    relative_error: float
    error_of_step: float


def calibration_error(
    trace: Trace,
    profile: HardwareProfile | None = None,
    mode: Literal["auto", "always"] = "always",
    baselines: Baselines | None = None,
) -> CalibrationResult:
    """Replay ``trace`` at its own world size under ``profile`` and compare with the measurement.

    The trace must hold ``measured_step_s["raw"]`` and ``["adera"]``; ``profile`` defaults to the
    trace's own calibrated profile; the topology is a ring (the recorded run is on one machine).

    Raises:
        ValueError: If the measurement or the profile is missing.

    Examples:
        >>> from ada_modules.strategies.adera_sim import GatherEvent
        >>> cpu = HardwareProfile.calibrate(1e-4, 1e9, 2e8, 3e8)
        >>> events = [GatherEvent("g", 2**20, "bf16", 0.02, i, "forward", 1e-2) for i in range(2)]
        >>> model = {m: simulate(Trace(events, 2), 2, cpu, "ring", m, "always").step_s
        ...          for m in ("raw", "adera")}
        >>> result = calibration_error(Trace(events, 2, measured_step_s=model, profile=cpu))
        >>> abs(result.relative_error) < 1e-9
        True
    """
    profile = profile or trace.profile
    if profile is None:
        raise InputError("calibration_error needs a profile: pass one or record it in the trace")
    missing = {"raw", "adera"} - set(trace.measured_step_s)
    if missing:
        raise InputError(f"trace.measured_step_s lacks {sorted(missing)}")
    predicted = {
        m: simulate(trace, trace.world_size, profile, "ring", m, mode, baselines).step_s
        for m in ("raw", "adera")
    }
    measured = {m: trace.measured_step_s[m] for m in ("raw", "adera")}
    predicted_diff = predicted["adera"] - predicted["raw"]
    measured_diff = measured["adera"] - measured["raw"]
    error = predicted_diff - measured_diff
    return CalibrationResult(
        predicted_s=predicted,
        measured_s=measured,
        predicted_diff_s=predicted_diff,
        measured_diff_s=measured_diff,
        relative_error=error / abs(measured_diff) if measured_diff else math.inf,
        error_of_step=error / measured["raw"],
    )


def measure_gloo_gathers(
    dtype: Literal["bf16", "fp32"] = "bf16",
    shard_numels: Sequence[int] = (2**12, 2**14, 2**16),
    change_rate: float = 0.05,
    repeats: int = 8,
) -> Trace:
    """Time AdERA's all-gather on synthetic shards in two gloo processes (a micro-benchmark).

    Two forked processes on 127.0.0.1 (one thread each) build, per shard size, one
    :class:`~ada_modules.strategies.AdERAAllGather` in mode ``"never"`` (FSDP2's all-gather) and
    one in mode ``"always"`` (torch codec). Each of ``repeats`` rounds, after two warm-up rounds,
    changes the exponents of about ``change_rate`` of the shard's random weights and gathers
    twice, as FSDP2 does before the forward (the changes) and before the backward (none). A
    barrier precedes every gather, so no rank waits for the other's compute. Rank 0's records
    become the events of the returned trace (:func:`trace_from_records`, one gather per step:
    ``gather_s`` of mode ``"never"``, ``adera_gather_s`` and ``codec_s`` of mode ``"always"``, no
    compute), ready for
    :meth:`HardwareProfile.fit_trace`: a profile of this machine that has not seen any training
    run.

    Args:
        dtype: Parameter dtype of the shards.
        shard_numels: Elements per rank's shard; at least two sizes.
        change_rate: Fraction of exponents that change between consecutive rounds.
        repeats: Timed rounds per size and mode.

    Raises:
        ValueError: For a bad argument.
        RuntimeError: If a process fails.
    """
    if dtype not in ("bf16", "fp32"):
        raise InputError(f"dtype must be 'bf16' or 'fp32', got {dtype!r}")
    if len(set(shard_numels)) < 2 or min(shard_numels) < 1:
        raise InputError(f"shard_numels needs two or more positive sizes, got {shard_numels!r}")
    if not 0 <= change_rate <= 0.5:
        raise InputError(f"change_rate must be in [0, 0.5], got {change_rate!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InputError(f"repeats must be a positive int, got {repeats!r}")
    config = (dtype, [int(n) for n in shard_numels], change_rate, repeats)
    records = run_gloo_ranks(_gather_worker, config)[0]
    # One "step" per gather, ending when the gather returns: no compute, no rest.
    return trace_from_records(
        [([r], r.start_s, r.ready_s, r.ready_s) for r in records],
        world_size=2,
        method=["adera" if r.compressed else "raw" for r in records],
        meta={
            "micro_benchmark": {
                "dtype": dtype,
                "shard_numels": config[1],
                "change_rate": change_rate,
                "repeats": repeats,
            }
        },
    )


def run_gloo_ranks(
    target: Any, *args: Any, world_size: int = 2, timeout: float = 600.0
) -> dict[int, Any]:
    """Run ``target(rank, port, *args, queue)`` in ``world_size`` forked processes on 127.0.0.1.

    Each process puts ``(rank, result)`` on the queue (``port`` is free for its gloo rendezvous);
    returns the results by rank.

    Raises:
        RuntimeError: If a process exits with a non-zero code.
    """
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("fork")
    queue = context.Queue()
    processes = [
        context.Process(target=target, args=(rank, port, *args, queue))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=timeout) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        if process.exitcode != 0:
            raise RuntimeError(f"gloo benchmark process exited with {process.exitcode}")
    return results


def _gather_worker(rank: int, port: int, config: tuple, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from ada_modules.strategies.adera import AdERAAllGather

    dtype_name, shard_numels, change_rate, repeats = config
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    # Each round doubles a fresh random subset (fraction q) of the base weights: an element's
    # exponent changes between rounds when it is in exactly one of the two subsets, 2q(1-q).
    q = (1 - math.sqrt(1 - 2 * change_rate)) / 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.group.WORLD
    records = []
    try:
        generator = torch.Generator().manual_seed(rank)
        for numel in shard_numels:
            base = 0.02 * torch.randn(numel, generator=generator)
            for mode in ("never", "always"):
                comm = AdERAAllGather(mode=mode, min_numel=0, impl="torch", name=f"{mode}/{numel}")
                output = torch.empty(2 * numel, dtype=dtype)
                shard = output.view(2, numel)[rank]
                for round_ in range(repeats + 2):
                    if round_ == 2:  # two warm-up rounds: the first builds the cache
                        comm.trace = []
                    weights = base.clone()
                    weights[torch.rand(numel, generator=generator) < q] *= 2
                    shard.copy_(weights)
                    for phase in ("forward", "backward"):
                        dist.barrier()
                        comm(output, shard, group)
                        if comm.trace:
                            records.append(dataclasses.replace(comm.trace.pop(), phase=phase))
        results.put((rank, records))
    finally:
        dist.destroy_process_group()
