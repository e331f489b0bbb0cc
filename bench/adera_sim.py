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
an entropy-coded lossless compressor and a lossy int8 all-gather; then AdERA with value reuse
(``reuse="value"``) over raw and over a lossless XOR-delta compressor (ZipNN's delta mode), both
with the bytes ratios measured by ``bench/adera_peers.py`` (``Baselines``). Tables use the trace's last
step (steady state); a second table shows how the speedup over raw moves with the change rate
over the trace's steps (hierarchical, P=64).

Calibration: unless ``--no-calibrate``, two gloo processes on 127.0.0.1 time AdERA's all-gather
itself (raw and compressed, on synthetic shards of ``--dtype``: ``measure_gloo_gathers``) and
``HardwareProfile.fit_trace`` turns the timings into a CPU profile, which is printed. A ``--trace``
with measured ``raw``/``adera`` step times (e.g. merged by ``bench/adera_repro.py``) is then
replayed by ``calibration_error`` under that profile and under one fitted to the trace's own
gathers; each prints the measured and predicted ``adera - raw`` step time and the relative error
(acceptance: within +-20%). The recorded CPU runs themselves are in ``bench/adera_repro.py``.

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
import time
from pathlib import Path

import matplotlib

from ada_modules.strategies.adera_calibration import calibration_error, measure_gloo_gathers
from ada_modules.strategies.adera_sim import (
    PROFILES,
    HardwareProfile,
    Trace,
    change_rate_curve,
    project,
    projection_table,
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
        timed = measure_gloo_gathers(args.dtype, repeats=4 if args.quick else 16)
        cpu_profile = HardwareProfile.fit_trace(timed, name=f"cpu_gloo_{args.dtype}")
        print(f"## CPU/gloo profile (AdERA's all-gather timed on 2 processes, {args.dtype})\n")
        print(
            "| latency us | bandwidth GB/s | codec GB/s | codec launch us | unchanged-chunk factor |"
        )
        print("| ---: | ---: | ---: | ---: | ---: |")
        print(
            f"| {1e6 * cpu_profile.intra_latency:.1f} | {cpu_profile.intra_bandwidth / 1e9:.3f} | "
            f"{cpu_profile.encode_throughput / 1e9:.3f} | {1e6 * cpu_profile.codec_launch_s:.1f} | "
            f"{cpu_profile.codec_same_factor:.2f} |"
        )
        print()
    calibration = {}
    if recorded is not None and {"raw", "adera"} <= set(recorded.measured_step_s):
        profiles = {}
        if cpu_profile is not None:
            profiles["micro-benchmark"] = cpu_profile
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
