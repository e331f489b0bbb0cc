import dataclasses

import pytest

from ada_modules.strategies.adera_calibration import calibration_error, measure_gloo_gathers
from ada_modules.strategies.adera_sim import (
    GatherEvent,
    HardwareProfile,
    Trace,
    simulate,
    synthetic_moe_trace,
)


def _event() -> GatherEvent:
    return GatherEvent("g", 2**16, "bf16", 0.01, 0, "forward", 1e-3)


def test_calibration_error_of_a_trace_made_by_the_model_is_zero():
    cpu = HardwareProfile.calibrate(2e-4, 0.4e9, 3e7, 4e7, codec_launch_s=3e-4)
    base = synthetic_moe_trace(num_layers=2, d_model=64, d_ff=128, steps=(0, 50, 300))
    events = [dataclasses.replace(e, compute_s=e.flops / 5e10) for e in base.events]
    trace = Trace(events, world_size=2, other_s=0.01, profile=cpu)
    measured = {m: simulate(trace, 2, cpu, "ring", m, "always").step_s for m in ("raw", "adera")}
    trace = dataclasses.replace(trace, measured_step_s=measured)
    result = calibration_error(trace)
    assert abs(result.relative_error) < 1e-9 and abs(result.error_of_step) < 1e-9
    # A 10% slower measured AdERA step shows up as an error of the difference.
    off = dataclasses.replace(
        trace, measured_step_s={"raw": measured["raw"], "adera": measured["adera"] * 1.1}
    )
    assert abs(calibration_error(off).relative_error) > 0.05


def test_calibration_error_needs_a_profile_and_both_measurements():
    with pytest.raises(ValueError, match="needs a profile"):
        calibration_error(Trace([_event()], 2, measured_step_s={"raw": 1.0, "adera": 1.0}))
    cpu = HardwareProfile.calibrate(1e-4, 1e9, 2e8, 3e8)
    with pytest.raises(ValueError, match="lacks"):
        calibration_error(Trace([_event()], 2, profile=cpu))


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_micro_benchmark_times_both_modes_and_fits_a_profile(dtype):
    trace = measure_gloo_gathers(dtype, shard_numels=(1024, 4096), change_rate=0.1, repeats=2)
    raw = [e for e in trace.events if e.gather_s is not None]
    compressed = [e for e in trace.events if e.adera_gather_s is not None]
    # 2 sizes x 2 timed rounds x (forward, backward) per mode.
    assert len(raw) == len(compressed) == 8
    assert {e.numel for e in trace.events} == {2048, 8192}  # whole groups of 2 ranks
    assert all(e.dtype == dtype and e.codec_s > 0 for e in compressed)
    # Forward gathers see about 10% changed exponents, backward re-gathers none.
    forward = [e.change_rate for e in compressed if e.phase == "forward"]
    assert all(0.04 < r < 0.2 for r in forward)
    assert all(e.change_rate == 0 for e in compressed if e.phase == "backward")
    profile = HardwareProfile.fit_trace(trace)
    assert profile.encode_throughput > 0 and not profile.overlap


def test_micro_benchmark_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be"):
        measure_gloo_gathers("fp16")
    with pytest.raises(ValueError, match="two or more positive sizes"):
        measure_gloo_gathers(shard_numels=(4096,))
    with pytest.raises(ValueError, match="change_rate must be in"):
        measure_gloo_gathers(change_rate=0.9)
    with pytest.raises(ValueError, match="repeats must be"):
        measure_gloo_gathers(repeats=0)
