"""AdERA's cluster projection: replay an all-gather trace at 8-128 GPUs against three baselines.

Reads a trace recorded by a real run (``--trace T.json``, :class:`Trace` JSON of
:mod:`ada_modules.strategies.adera_sim`) or builds one from a model description (the default,
``--synthetic``: a Mixtral-8x7B-shaped MoE, 32 layers, ``d_model`` 4096, 8 SwiGLU experts of
hidden 14336, top-2, 4096 tokens per GPU, bf16 parameters, fp32 gradient reduce-scatter; forward
exponent change rates 13% at step 0, 1.8% at step 50, 0.9% at step 300: this project's measured
curve). ``--rates-from-trace`` keeps the synthetic model but takes the per-step change rates of
the trace (e.g. measured on the tiny CPU MoE), so a small run's statistics project onto a
realistic model.

For each hardware profile (``--profiles``; public NVLink/InfiniBand/HBM figures, see
``PROFILES``) it prints one markdown table per profile: ``P`` in {8, 16, 32, 64, 128}, flat ring
and hierarchical (8 GPUs per node) all-gather, the raw all-gather time per step, AdERA's bytes
ratio and its ceiling ``1/r``, and AdERA's all-gather and step speedups over the raw all-gather,
an entropy-coded lossless compressor and a lossy int8 all-gather. Tables use the trace's last
step (steady state); a second table shows how the speedup over raw moves with the change rate
over the trace's steps (hierarchical, P=64).

Calibration: unless ``--no-calibrate``, two gloo processes on 127.0.0.1 measure the all-gather
latency/bandwidth and time the exponent codec on CPU (``measure_cpu_gloo``); the calibrated CPU
profile is printed. Then (unless ``--no-validate``) the same two processes emulate FSDP2 steps of
a 2-block MoE (4 bf16 groups of 64K and 1M elements, gathered forward and again backward, a
fixed matmul workload after each gather, an fp32 reduce-scatter after each backward gather; the
forward change rate falls 13% -> 5% -> 1.8% -> 0.9% over the steps): each step runs a raw pass and
an AdERA pass (the real codec, ``encode_into``/``decode_from``, fixed-capacity payloads) over the
same weights. The recorded trace (``emulated_trace.json``) is replayed by ``calibration_error``
under two profiles: the micro-benchmark one, and one fitted to the run's own per-gather times
(``HardwareProfile.fit_trace``); each prints the measured and predicted ``adera - raw`` step time
and the relative error (acceptance: within +-20%). A ``--trace`` with measured ``raw``/``adera``
step times is checked the same way.

Writes ``adera_sim.json`` (all rows) and ``adera_sim.png`` (speedup vs ``P``) to ``--out``.
``--quick`` uses a 4-layer model and a smaller calibration (seconds). Reports only; no assertion
on the numbers.

    python bench/adera_sim.py                       # synthetic trace, all presets
    python bench/adera_sim.py --trace run/trace.json --rates-from-trace
    python bench/adera_sim.py --quick --out /tmp/adera_sim
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import matplotlib
import torch
import torch.distributed as dist

from ada_modules.kernels.exponent_codec import decode_from, encode_into, extract_exponents
from ada_modules.strategies.adera_sim import (
    PROFILES,
    Baselines,
    GatherEvent,
    HardwareProfile,
    Trace,
    adera_payload_bytes,
    calibration_error,
    change_rate_curve,
    measure_cpu_gloo,
    project,
    projection_table,
    run_gloo_ranks,
    synthetic_moe_trace,
)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_PROFILES = ("h100_nvlink4_ib400", "h200_nvlink4_ib400", "a100_nvlink3_ib200")


def _synthetic(args: argparse.Namespace, rates: dict[int, float] | None) -> Trace:
    return synthetic_moe_trace(
        num_layers=4 if args.quick else args.layers,
        d_model=args.d_model,
        d_ff=args.d_ff,
        num_experts=args.experts,
        top_k=args.top_k,
        expert_matrices=args.expert_matrices,
        tokens_per_gpu=args.tokens_per_gpu,
        dtype=args.dtype,
        steps=sorted(rates) if rates else (0, 50, 300),
        change_rates=rates,
    )


# Emulated FSDP2 step on 2 gloo processes ---------------------------------------------------

# Groups of the emulated model: (name, unsharded bf16 elements), gathered in this order forward
# and in reverse backward, like MoELMModule's FSDP2 units (two blocks, each with its experts).
_EMULATED_GROUPS = (
    ("model.blocks.0", 2**16),
    ("model.blocks.0.moe.experts", 2**20),
    ("model.blocks.1", 2**16),
    ("model.blocks.1.moe.experts", 2**20),
)
_EMULATED_RATES = (0.13, 0.05, 0.018, 0.009)  # forward change rate per emulated step


def _emulate_worker(rank: int, port: int, steps: int, compute_reps: int, results) -> None:
    """Per step: update the shards, then one raw pass and one AdERA pass over the same weights.

    A pass gathers every group forward, then backward in reverse (AdERA: cache already current,
    so no exponent changed) followed by a fp32 reduce-scatter of the group's gradient, with a
    fixed matmul workload after every gather. Times every gather, compute and the whole pass.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        generator = torch.Generator().manual_seed(0)
        full = {
            name: torch.randn(n, generator=generator).bfloat16() for name, n in _EMULATED_GROUPS
        }
        shards = {name: full[name].chunk(2)[rank].clone() for name, _ in _EMULATED_GROUPS}
        cache = {name: extract_exponents(full[name]) for name, _ in _EMULATED_GROUPS}
        grads = {name: torch.randn(n, generator=generator) for name, n in _EMULATED_GROUPS}
        a = torch.randn(96, 96, generator=generator)
        flip_gen = torch.Generator().manual_seed(100 + rank)
        order = [(name, "forward") for name, _ in _EMULATED_GROUPS]
        order += [(name, "backward") for name, _ in reversed(_EMULATED_GROUPS)]
        records = []
        for step in range(steps + 1):  # step 0 warms up
            rate = _EMULATED_RATES[min(step, len(_EMULATED_RATES) - 1)]
            for name, _ in _EMULATED_GROUPS:
                flip = torch.rand(shards[name].numel(), generator=flip_gen) < rate
                shards[name][flip] = shards[name][flip] * 2
            changed = {}
            for name, _ in _EMULATED_GROUPS:
                n = shards[name].numel()
                mine = cache[name][rank * n : (rank + 1) * n]
                changed[name] = float((extract_exponents(shards[name]) != mine).float().mean())
            passes = {}
            for method in ("raw", "adera"):
                events = []
                dist.barrier()
                pass_start = time.perf_counter()
                for name, phase in order:
                    shard = shards[name]
                    n = shard.numel()
                    out = torch.empty(2 * n, dtype=torch.bfloat16)
                    t0 = time.perf_counter()
                    codec_s = 0.0
                    if method == "raw":
                        dist.all_gather_single(out, shard)
                    else:
                        mine = cache[name][rank * n : (rank + 1) * n]
                        # Agreed by both ranks: from the step's nominal rate, not the local one.
                        nominal = rate if phase == "forward" else 0.0
                        expected = adera_payload_bytes(n, "bf16", nominal) - adera_payload_bytes(
                            n, "bf16", 0.0
                        )
                        capacity = math.ceil(Baselines().capacity_slack * expected) + 64
                        t_codec = time.perf_counter()
                        buffer, spill = encode_into(shard, mine, capacity)
                        codec_s = time.perf_counter() - t_codec
                        if spill.numel():
                            raise RuntimeError("exception capacity overflow in the emulation")
                        gathered = torch.empty(2 * buffer.numel(), dtype=torch.uint8)
                        dist.all_gather_single(gathered, buffer)
                        t_codec = time.perf_counter()
                        for r, payload in enumerate(gathered.chunk(2)):
                            part = slice(r * n, (r + 1) * n)
                            decode_from(
                                payload,
                                cache[name][part],
                                n,
                                torch.bfloat16,
                                out=out[part],
                                cache_out=cache[name][part],
                            )
                        codec_s += time.perf_counter() - t_codec
                    t1 = time.perf_counter()
                    for _ in range(compute_reps):
                        a = torch.tanh(a @ a)
                    t2 = time.perf_counter()
                    if phase == "backward":
                        rs_out = torch.empty(n, dtype=torch.float32)
                        dist.reduce_scatter_tensor(rs_out, grads[name])
                    t3 = time.perf_counter()
                    events.append(
                        (name, phase, 2 * n, changed[name], t1 - t0, t2 - t1, t3 - t2, codec_s)
                    )
                passes[method] = (time.perf_counter() - pass_start, events)
            if step:
                records.append(passes)
        results.put((rank, records))
    finally:
        dist.destroy_process_group()


def _emulated_trace(steps: int, compute_reps: int, profile: HardwareProfile) -> Trace:
    """Run the emulation on 2 gloo processes and turn rank 0's records into a :class:`Trace`."""
    records = run_gloo_ranks(_emulate_worker, steps, compute_reps)
    events = []
    step_s = {"raw": [], "adera": []}
    for step, (passes0, passes1) in enumerate(zip(records[0], records[1], strict=True)):
        for method in ("raw", "adera"):
            step_s[method].append(max(passes0[method][0], passes1[method][0]))
        raw_events, adera_events = passes0["raw"][1], passes0["adera"][1]
        for order, (raw_e, adera_e) in enumerate(zip(raw_events, adera_events, strict=True)):
            name, phase, numel, _, gather_s, compute_s, _, _ = raw_e
            events.append(
                GatherEvent(
                    group=name,
                    numel=numel,
                    dtype="bf16",
                    change_rate=adera_e[3] if phase == "forward" else 0.0,
                    order=order,
                    phase=phase,
                    compute_s=compute_s,
                    step=step,
                    reduce_scatter_numel=numel if phase == "backward" else 0,
                    gather_s=gather_s,
                    adera_gather_s=adera_e[4],
                    codec_s=adera_e[7],
                    adera_compute_s=adera_e[5],
                )
            )
    return Trace(
        events=events,
        world_size=2,
        measured_step_s={m: statistics.median(v) for m, v in step_s.items()},
        profile=profile,
        meta={"emulated": True, "groups": dict(_EMULATED_GROUPS), "rates": _EMULATED_RATES},
    )


def _print_validation(trace: Trace, profile: HardwareProfile) -> None:
    """Per group: measured vs modelled gather times of the emulated run (mean over steps)."""
    from ada_modules.strategies.adera_sim import gather_cost

    print("## Emulated FSDP2 steps on 2 gloo processes: measured vs modelled gathers (ms)\n")
    print(
        "| group | phase | elements | change rate | raw meas | raw model | AdERA meas | AdERA model |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    keys = sorted({(e.order, e.group, e.phase) for e in trace.events})
    for order, group, phase in keys:
        chosen = [e for e in trace.events if e.order == order]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        raw_model = mean([gather_cost(e, 2, profile, "ring", "raw").total_s for e in chosen])
        adera_model = mean(
            [gather_cost(e, 2, profile, "ring", "adera", mode="always").total_s for e in chosen]
        )
        print(
            f"| {group} | {phase} | {chosen[0].numel} | "
            f"{100 * mean([e.change_rate for e in chosen]):.2f}% | "
            f"{1e3 * mean([e.gather_s for e in chosen]):.2f} | {1e3 * raw_model:.2f} | "
            f"{1e3 * mean([e.adera_gather_s for e in chosen]):.2f} | {1e3 * adera_model:.2f} |"
        )
    print()


def _print_calibration(trace: Trace, profile: HardwareProfile, label: str):
    """Print and return :func:`calibration_error` of ``trace`` under ``profile``."""
    result = calibration_error(trace, profile)
    print(f"## Calibration on the recorded run: profile {label}\n")
    print(
        f"latency {1e6 * profile.intra_latency:.0f} us, bandwidth "
        f"{profile.intra_bandwidth / 1e9:.3f} GB/s, encode {profile.encode_throughput / 1e9:.3f} "
        f"GB/s, decode {profile.decode_throughput / 1e9:.3f} GB/s, codec launch "
        f"{1e6 * profile.codec_launch_s:.0f} us\n"
    )
    print("| | raw step s | AdERA step s | AdERA - raw s |")
    print("| --- | ---: | ---: | ---: |")
    for name, times, diff in (
        ("measured", result.measured_s, result.measured_diff_s),
        ("predicted", result.predicted_s, result.predicted_diff_s),
    ):
        print(f"| {name} | {times['raw']:.4f} | {times['adera']:.4f} | {diff:+.4f} |")
    print(
        f"\nrelative error of the difference: {100 * result.relative_error:+.1f}% "
        f"(acceptance: within +-20%); error / raw step: {100 * result.error_of_step:+.1f}%\n"
    )
    return result


def _plot(rows_by_profile: dict[str, list], path: Path) -> None:
    baselines = ("raw", "entropy", "int8")
    fig, axes = plt.subplots(1, len(baselines), figsize=(5 * len(baselines), 4), sharey=True)
    for ax, baseline in zip(axes, baselines, strict=True):
        for name, rows in rows_by_profile.items():
            for topology, style in (("ring", "--"), ("hierarchical", "-")):
                chosen = [r for r in rows if r.topology == topology]
                ax.plot(
                    [r.world_size for r in chosen],
                    [r.gather_speedup(baseline) for r in chosen],
                    style,
                    marker="o",
                    label=f"{name} {topology}",
                )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (P)")
        ax.set_title(f"AdERA all-gather speedup vs {baseline}")
    axes[0].set_ylabel("speedup (baseline time / AdERA time)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=None, help="trace JSON of a real run")
    parser.add_argument(
        "--synthetic", action="store_true", help="build the trace from the model flags (default)"
    )
    parser.add_argument(
        "--rates-from-trace",
        action="store_true",
        help="synthetic model with the change-rate curve of --trace",
    )
    parser.add_argument("--quick", action="store_true", help="4-layer model, small calibration")
    parser.add_argument("--out", type=Path, default=Path("bench_out/adera_sim"))
    parser.add_argument("--profiles", nargs="+", default=list(DEFAULT_PROFILES))
    parser.add_argument("--no-calibrate", action="store_true", help="skip the gloo calibration")
    parser.add_argument(
        "--no-validate",
        action="store_true",
        help="skip the emulated FSDP2 steps on 2 gloo processes that check the calibration",
    )
    parser.add_argument("--validate-steps", type=int, default=8)
    parser.add_argument("--mode", choices=("auto", "always"), default="auto")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--d-ff", type=int, default=14336)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-matrices", type=int, default=3, help="3 SwiGLU, 2 GELU")
    parser.add_argument("--tokens-per-gpu", type=int, default=4096)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    unknown = set(args.profiles) - set(PROFILES)
    if unknown:
        parser.error(f"unknown profiles {sorted(unknown)}; choose from {sorted(PROFILES)}")
    if args.rates_from_trace and args.trace is None:
        parser.error("--rates-from-trace needs --trace")
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)

    recorded = Trace.from_json(args.trace) if args.trace is not None else None
    if recorded is None or args.synthetic or args.rates_from_trace:
        rates = change_rate_curve(recorded) if args.rates_from_trace else None
        trace = _synthetic(args, rates)
        source = "synthetic" + (f" with change rates of {args.trace}" if rates else "")
    else:
        trace = recorded
        source = str(args.trace)
    steady = trace.steps[-1]
    if any(e.flops is None for e in trace.events):
        print(
            "Note: some events have no FLOPs, so their recorded compute_s (the recording "
            "machine's) is used on every profile; prefer --rates-from-trace for a CPU trace.\n"
        )
    print(f"# AdERA projection ({source}; steady state = step {steady}, mode {args.mode})\n")
    print(
        "Speedup = baseline time / AdERA time. 'AdERA bytes' is AdERA's payload over the raw "
        "bytes of all gathers of the step (backward re-gathers included); 'ceiling' = 1/r. "
        "entropy = DietGPU/ZipNN-style lossless exponent coder (ratio 0.67 bf16, 400 GB/s); "
        "int8 = ZeRO++ qwZ-like lossy block-int8.\n"
    )
    rows_by_profile = {}
    for name in args.profiles:
        profile = HardwareProfile.preset(name)
        rows = project(trace, profile, mode=args.mode, steps=[steady])
        rows_by_profile[name] = rows
        print(f"## {name}\n")
        print(projection_table(rows))
        print()

    profile = HardwareProfile.preset(args.profiles[0])
    print(f"## Speedup over raw vs change rate ({args.profiles[0]}, hierarchical, P=64)\n")
    print("| step | change rate | AdERA bytes | AG x raw | step x raw |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    curve = change_rate_curve(trace)
    by_step = {}
    for step in trace.steps:
        (row,) = project(trace, profile, [64], ["hierarchical"], args.mode, steps=[step])
        by_step[step] = row
        print(
            f"| {step} | {100 * curve.get(step, 0.0):.2f}% | {row.ratio:.3f} | "
            f"{row.gather_speedup('raw'):.2f} | {row.step_speedup('raw'):.3f} |"
        )
    print()

    cpu_profile = None
    if not args.no_calibrate:
        sizes = (2**12, 2**18, 2**20) if args.quick else (2**12, 2**16, 2**20, 2**22)
        measured = measure_cpu_gloo(
            sizes=sizes, repeats=3 if args.quick else 7, codec_numel=2**18 if args.quick else 2**21
        )
        cpu_profile = HardwareProfile.calibrate(**measured)
        print("## CPU/gloo calibration (2 processes on 127.0.0.1)\n")
        print("| latency us | bandwidth GB/s | encode GB/s | decode GB/s | codec launch us |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        print(
            f"| {1e6 * measured['latency_s']:.1f} | {measured['bandwidth'] / 1e9:.3f} | "
            f"{measured['encode_throughput'] / 1e9:.3f} | "
            f"{measured['decode_throughput'] / 1e9:.3f} | {1e6 * measured['codec_launch_s']:.1f} |"
        )
        print()
    if cpu_profile is not None and not args.no_validate:
        steps = 3 if args.quick else args.validate_steps
        emulated = _emulated_trace(steps, compute_reps=40, profile=cpu_profile)
        emulated.to_json(args.out / "emulated_trace.json")
        _print_validation(emulated, cpu_profile)
        recorded = recorded if recorded is not None else emulated
    calibration = {}
    if recorded is not None and {"raw", "adera"} <= set(recorded.measured_step_s):
        profiles = {}
        if recorded.profile or cpu_profile:
            profiles["micro-benchmark"] = recorded.profile or cpu_profile
        if any(e.gather_s is not None for e in recorded.events):
            profiles["fitted to the run's gathers"] = HardwareProfile.fit_trace(recorded)
        if not profiles:
            print("The trace has measured step times but no profile: run without --no-calibrate.")
        for label, use in profiles.items():
            calibration[label] = _print_calibration(recorded, use, label)

    _plot(rows_by_profile, args.out / "adera_sim.png")
    payload = {
        "source": source,
        "mode": args.mode,
        "steady_step": steady,
        "rows": [dataclasses.asdict(r) for rows in rows_by_profile.values() for r in rows],
        "change_rate_rows": {str(s): dataclasses.asdict(r) for s, r in by_step.items()},
        "cpu_profile": None if cpu_profile is None else dataclasses.asdict(cpu_profile),
        "calibration": {k: dataclasses.asdict(v) for k, v in calibration.items()},
        "model": trace.meta.get("model"),
    }
    (args.out / "adera_sim.json").write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out / 'adera_sim.png'} and {args.out / 'adera_sim.json'}")
    print(f"elapsed {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
