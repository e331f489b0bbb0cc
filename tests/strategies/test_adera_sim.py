import dataclasses
import math
import random

import pytest

from ada_modules.strategies.adera_sim import (
    METHODS,
    PROFILES,
    Baselines,
    GatherEvent,
    HardwareProfile,
    Trace,
    adera_payload_bytes,
    all_gather_time,
    change_rate_curve,
    gather_cost,
    project,
    projection_table,
    simulate,
    simulate_step,
    synthetic_moe_trace,
)

TOY = HardwareProfile(
    "toy",
    gpus_per_node=8,
    intra_bandwidth=100.0,
    intra_latency=1.0,
    inter_bandwidth=10.0,
    inter_latency=2.0,
)


def _event(numel=2**20, rate=0.02, order=0, phase="forward", compute=1e-3, **kwargs):
    return GatherEvent("g", numel, "bf16", rate, order, phase, compute, **kwargs)


# Alpha-beta arithmetic on hand-computed cases ------------------------------------------------


@pytest.mark.parametrize(
    ("world_size", "topology", "expected"),
    [
        (1, "ring", 0.0),
        (8, "ring", 7 * (1 + 50 / 100)),  # one node: NVLink
        (8, "hierarchical", 7 * (1 + 50 / 100)),
        (32, "ring", 31 * (2 + 50 / 10)),  # flat ring waits for the slowest (inter-node) hop
        (32, "hierarchical", 3 * (2 + 50 / 10) + 7 * (1 + 4 * 50 / 100)),
    ],
)
def test_all_gather_time_hand_computed(world_size, topology, expected):
    assert all_gather_time(50, world_size, TOY, topology) == pytest.approx(expected)


def test_efficiency_scales_the_bandwidth():
    slow = dataclasses.replace(TOY, intra_efficiency=0.5)
    assert all_gather_time(100, 4, slow, "ring") == pytest.approx(3 * (1 + 100 / 50))


def test_payload_bytes_follow_the_codec_format():
    # p = 0: header + counts + one plane byte per element; p = 1: every chunk RAW.
    assert adera_payload_bytes(10_000, "bf16", 0.0) == 32 + 2 * 10 + 10_000
    assert adera_payload_bytes(10_000, "fp32", 1.0) == 32 + 2 * 10 + 3 * 10_000 + 10_000
    # Small p: nearly every 1024-chunk has a change, so ~bitmap (128 B) + p * 1024 per chunk.
    p = 0.05
    expected_stream = 4 * (128 + p * 1024)
    stream = adera_payload_bytes(4096, "bf16", p) - adera_payload_bytes(4096, "bf16", 0.0)
    assert stream == pytest.approx(expected_stream, rel=1e-6)
    # Dense changes make a chunk RAW (1024 B) rather than bitmap + exponents (> 1024 B).
    assert adera_payload_bytes(4096, "bf16", 0.95) - 4136 == pytest.approx(4096, rel=1e-3)


def test_payload_bytes_grow_with_the_change_rate():
    sizes = [adera_payload_bytes(2**16, "bf16", p) for p in (0.0, 0.001, 0.01, 0.1, 0.5, 1.0)]
    assert sizes == sorted(sizes) and sizes[-1] <= 2 * 2**16 + 32 + 2 * 64


def test_raw_cost_and_method_ratios():
    event = _event(numel=8 * 2**20, rate=0.0)
    profile = PROFILES["h100_nvlink4_ib400"]
    raw = gather_cost(event, 16, profile, "ring", "raw")
    assert raw.payload_bytes == raw.raw_bytes == 2**20 and raw.codec_s == 0  # 2^19 elements
    int8 = gather_cost(event, 16, profile, "ring", "int8")
    assert int8.ratio == pytest.approx((1 + 4 / 256) / 2)
    entropy = gather_cost(event, 16, profile, "ring", "entropy")
    assert entropy.ratio == pytest.approx(0.67)
    adera = gather_cost(event, 16, profile, "ring", "adera", mode="always")
    assert 0.5 < adera.ratio < 0.51


def test_auto_mode_skips_small_groups_and_unprofitable_ones():
    profile = PROFILES["h100_nvlink4_ib400"]
    small = _event(numel=4096)
    assert not gather_cost(small, 64, profile, "ring", "adera").compressed
    assert gather_cost(small, 64, profile, "ring", "adera", mode="always").compressed
    big = _event(numel=2**28, rate=0.01)
    # Across nodes the wire dominates: compress. Inside one NVLink node the codec does not pay.
    assert gather_cost(big, 64, profile, "ring", "adera").compressed
    assert not gather_cost(big, 8, profile, "ring", "adera").compressed
    assert not gather_cost(big, 8, profile, "ring", "adera", mode="always").total_s < (
        gather_cost(big, 8, profile, "ring", "raw").total_s
    )


# The step model ---------------------------------------------------------------------------


def test_prefetch_overlap_hand_computed():
    # Gathers of 4 s (400 bf16 elements / 2 ranks = 400 B at 100 B/s), computes of 5 s.
    profile = HardwareProfile("toy", 8, 100.0, 0.0, 100.0, 0.0)
    events = [_event(numel=400, order=i, compute=5.0) for i in range(3)]
    # AG0 0-4, C0 4-9, AG1 4-8, C1 9-14, AG2 9-13, C2 14-19.
    assert simulate_step(events, 2, profile, "ring", "raw").step_s == pytest.approx(19.0)
    comm_bound = [_event(numel=400, order=i, compute=1.0) for i in range(3)]
    # AG0 0-4, C0 4-5, AG1 4-8, C1 8-9, AG2 8-12 (ready at C1 start), C2 12-13.
    assert simulate_step(comm_bound, 2, profile, "ring", "raw").step_s == pytest.approx(13.0)
    serial = dataclasses.replace(profile, overlap=False)
    assert simulate_step(comm_bound, 2, serial, "ring", "raw").step_s == pytest.approx(15.0)


def test_reduce_scatter_uses_the_channel_after_the_backward_compute():
    profile = HardwareProfile("toy", 8, 100.0, 0.0, 100.0, 0.0, overlap=True)
    events = [
        _event(numel=400, order=0, phase="backward", compute=1.0, reduce_scatter_numel=200),
    ]
    # AG 0-4, compute 4-5, reduce-scatter of 100 fp32 elements per rank (400 B) 5-9.
    result = simulate_step(events, 2, profile, "ring", "raw", other_s=0.5)
    assert result.step_s == pytest.approx(9.5)


def test_flops_turn_into_compute_time_on_a_gpu_profile():
    profile = dataclasses.replace(PROFILES["h100_nvlink4_ib400"], codec_interference=0.0)
    event = _event(numel=2**20, compute=123.0, flops=989e12 * 0.4 * 1e-3)
    result = simulate_step([event], 8, profile, "ring", "raw")
    assert result.compute_s == pytest.approx(1e-3)


def test_step_time_is_monotone_in_bandwidth():
    trace = synthetic_moe_trace(num_layers=2, d_model=512, d_ff=2048, steps=(300,))
    base = PROFILES["h100_nvlink4_ib400"]
    for method in METHODS:
        previous_gather, previous_step = math.inf, math.inf
        for scale in (0.25, 0.5, 1.0, 2.0, 4.0):
            profile = dataclasses.replace(
                base,
                inter_bandwidth=base.inter_bandwidth * scale,
                intra_bandwidth=base.intra_bandwidth * scale,
            )
            # "always": the auto rule's 5% margin may switch a group back to raw, by design.
            result = simulate(trace, 32, profile, "hierarchical", method, mode="always")
            assert result.gather_s <= previous_gather and result.step_s <= previous_step
            previous_gather, previous_step = result.gather_s, result.step_s


def test_adera_gains_grow_as_the_network_slows():
    trace = synthetic_moe_trace(num_layers=2, d_model=1024, d_ff=4096, steps=(300,))
    base = PROFILES["h100_nvlink4_ib400"]
    speedups = []
    for scale in (4.0, 1.0, 0.25):
        profile = dataclasses.replace(base, inter_bandwidth=base.inter_bandwidth * scale)
        (row,) = project(trace, profile, [64], ["ring"])
        speedups.append(row.gather_speedup("raw"))
    assert speedups == sorted(speedups) and speedups[-1] > 1.5


# Ceiling -----------------------------------------------------------------------------------


def test_projection_never_exceeds_one_over_the_compression_ratio():
    rng = random.Random(0)
    for _ in range(40):
        base = PROFILES[rng.choice(sorted(PROFILES))]
        profile = dataclasses.replace(
            base,
            inter_bandwidth=base.inter_bandwidth * 10 ** rng.uniform(-2, 1),
            encode_throughput=base.encode_throughput * 10 ** rng.uniform(-1, 3),
            decode_throughput=base.decode_throughput * 10 ** rng.uniform(-1, 3),
            codec_launch_s=rng.choice([0.0, 1e-5]),
            overlap=rng.random() < 0.5,
        )
        trace = synthetic_moe_trace(
            num_layers=1,
            d_model=rng.choice([256, 1024]),
            d_ff=rng.choice([512, 4096]),
            dtype=rng.choice(["bf16", "fp32"]),
            steps=(rng.choice([0, 50, 300]),),
        )
        mode = rng.choice(["auto", "always"])
        for row in project(trace, profile, [8, 64], mode=mode):
            assert row.gather_speedup("raw") <= max(1.0, row.ceiling) * (1 + 1e-9)
            assert row.ceiling <= (2.0 if trace.events[0].dtype == "bf16" else 4 / 3)


def test_a_zero_cost_codec_reaches_but_does_not_pass_the_ceiling():
    profile = HardwareProfile(
        "free codec",
        8,
        intra_bandwidth=1e9,
        intra_latency=0.0,
        inter_bandwidth=1e9,
        inter_latency=0.0,
        encode_throughput=1e30,
        decode_throughput=1e30,
    )
    events = [_event(numel=2**22, rate=0.0, compute=0.0)]
    (row,) = project(Trace(events, 1), profile, [16], ["ring"])
    assert row.gather_speedup("raw") == pytest.approx(row.ceiling, rel=1e-6)


# Trace format ------------------------------------------------------------------------------


def test_trace_json_round_trip(tmp_path):
    trace = synthetic_moe_trace(num_layers=1, d_model=64, d_ff=128, steps=(0, 50))
    trace = dataclasses.replace(
        trace,
        world_size=2,
        measured_step_s={"raw": 0.1, "adera": 0.12},
        profile=HardwareProfile.calibrate(1e-4, 1e9, 1e8, 2e8),
        events=trace.events + [_event(gather_s=1e-3, adera_gather_s=2e-3, codec_s=5e-4, step=7)],
    )
    again = Trace.from_json(trace.to_json())
    assert again == trace
    trace.to_json(tmp_path / "t.json")
    assert Trace.from_json(tmp_path / "t.json") == trace
    assert again.steps == [0, 7, 50]
    assert [e.order for e in again.step_events(0)] == list(range(5))


def test_change_rate_curve_weights_by_size_and_skips_backward():
    events = [
        _event(numel=100, rate=0.1, order=0),
        _event(numel=300, rate=0.02, order=1),
        _event(numel=1000, rate=0.0, order=2, phase="backward"),
    ]
    assert change_rate_curve(Trace(events, 2)) == {0: pytest.approx(0.04)}
    assert change_rate_curve(Trace(events, 2), min_numel=200) == {0: pytest.approx(0.02)}


def test_synthetic_trace_follows_the_measured_change_rates():
    trace = synthetic_moe_trace(num_layers=2, d_model=64, d_ff=128, steps=(0, 25, 50, 300, 1000))
    curve = change_rate_curve(trace)
    assert curve[0] == 0.13 and curve[50] == 0.018 and curve[1000] == 0.009
    assert 0.018 < curve[25] < 0.13
    backward = [e for e in trace.step_events(0) if e.phase == "backward"]
    assert all(e.change_rate == 0 for e in backward)
    experts = [e for e in trace.step_events(0) if e.group.endswith("experts")]
    assert experts[0].numel == 8 * 3 * 64 * 128


# Calibration -------------------------------------------------------------------------------


def test_adera_pays_one_codec_launch_per_encode_and_per_decoded_shard():
    launches_only = HardwareProfile.calibrate(1e-4, 1e9, 1e30, 1e30, codec_launch_s=1e-3)
    for world in (2, 8):
        cost = gather_cost(_event(numel=2**16), world, launches_only, "ring", "adera", "always")
        assert cost.codec_s == pytest.approx((1 + world) * 1e-3)


def test_calibrated_profile_is_serial_and_single_node():
    cpu = HardwareProfile.calibrate(1e-4, 1e9, 2e8, 3e8, world_size=2)
    assert cpu.gpus_per_node == 2 and not cpu.overlap and cpu.flops is None
    assert all_gather_time(1e6, 2, cpu, "ring") == pytest.approx(1e-4 + 1e-3)


# Bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "fp16"}, "dtype must be one of"),
        ({"change_rate": 1.5}, "change_rate must be in"),
        ({"numel": 0}, "numel must be a positive integer"),
        ({"phase": "sideways"}, "phase must be"),
        ({"compute_s": -1.0}, "compute_s must be >= 0"),
    ],
)
def test_bad_events(kwargs, match):
    fields = {
        "group": "g",
        "numel": 10,
        "dtype": "bf16",
        "change_rate": 0.0,
        "order": 0,
        "phase": "forward",
        "compute_s": 0.0,
    }
    with pytest.raises(ValueError, match=match):
        GatherEvent(**{**fields, **kwargs})


def test_bad_arguments():
    with pytest.raises(ValueError, match="events must not be empty"):
        Trace([], world_size=2)
    with pytest.raises(ValueError, match="measured_step_s keys"):
        Trace([_event()], world_size=2, measured_step_s={"zip": 1.0})
    with pytest.raises(ValueError, match="profile must be one of"):
        HardwareProfile.preset("tpu")
    with pytest.raises(ValueError, match="topology must be one of"):
        all_gather_time(1.0, 8, TOY, "torus")
    with pytest.raises(ValueError, match="multiple of gpus_per_node=8"):
        all_gather_time(1.0, 12, TOY, "hierarchical")
    with pytest.raises(ValueError, match="method must be one of"):
        gather_cost(_event(), 8, TOY, "ring", "zstd")
    with pytest.raises(ValueError, match="intra_bandwidth must be > 0"):
        dataclasses.replace(TOY, intra_bandwidth=0.0)
    with pytest.raises(ValueError, match="capacity_slack"):
        Baselines(capacity_slack=0.5)
    with pytest.raises(ValueError, match="top_k=9"):
        synthetic_moe_trace(top_k=9)
    with pytest.raises(ValueError, match="step 3 is not in the trace"):
        Trace([_event()], 2).step_events(3)


def test_fit_trace_recovers_the_profile_that_generated_the_measurements():
    truth = HardwareProfile.calibrate(
        3e-4, 0.5e9, 6e7, 6e7, codec_launch_s=4e-4, codec_same_factor=0.4, codec_interference=0.1
    )
    events = []
    for i, (numel, rate) in enumerate([(2**16, 0.02), (2**20, 0.02), (2**20, 0.0), (2**16, 0.0)]):
        event = _event(numel=numel, rate=rate, order=i, compute=1e-2)
        raw = gather_cost(event, 2, truth, "ring", "raw")
        adera = gather_cost(event, 2, truth, "ring", "adera", mode="always")
        events.append(
            dataclasses.replace(
                event,
                gather_s=raw.total_s,
                adera_gather_s=adera.total_s,
                adera_compute_s=1e-2 + 0.1 * adera.codec_s,
            )
        )
    fitted = HardwareProfile.fit_trace(Trace(events, world_size=2))
    assert fitted.intra_latency == pytest.approx(3e-4, rel=1e-6)
    assert fitted.intra_bandwidth == pytest.approx(0.5e9, rel=1e-6)
    assert fitted.codec_same_factor == pytest.approx(0.4, rel=1e-6)
    assert fitted.codec_launch_s == pytest.approx(4e-4, rel=1e-6)  # 1 encode + P decodes
    assert fitted.codec_interference == pytest.approx(0.1, rel=1e-6)
    for e in events:
        for method in ("raw", "adera"):
            assert gather_cost(e, 2, fitted, "ring", method, "always").total_s == pytest.approx(
                gather_cost(e, 2, truth, "ring", method, "always").total_s, rel=1e-6
            )
    with pytest.raises(ValueError, match="two or more gather sizes"):
        HardwareProfile.fit_trace(Trace(events[1:3], world_size=2))


def test_unchanged_chunks_cost_the_same_factor():
    cheap = HardwareProfile.calibrate(0.0, 1e9, 1e8, 1e8, codec_same_factor=0.25)
    changed = gather_cost(_event(rate=0.5), 2, cheap, "ring", "adera", "always").codec_s
    same = gather_cost(_event(rate=0.0), 2, cheap, "ring", "adera", "always").codec_s
    assert same == pytest.approx(0.25 * changed)


def test_delta_methods_use_their_measured_ratios_and_send_little_for_unchanged_weights():
    profile = HardwareProfile.preset("h100_nvlink4_ib400")
    b = Baselines()
    moved = GatherEvent("experts", 2**24, "bf16", 0.01, 0, "forward", 0.0)
    same = dataclasses.replace(moved, change_rate=0.0, phase="backward", order=1)
    value = gather_cost(moved, 16, profile, "ring", "adera_value", mode="always")
    assert value.ratio == pytest.approx(b.capacity_slack * b.value_ratio_bf16)
    xor = gather_cost(moved, 16, profile, "ring", "xor_delta")
    assert xor.ratio == pytest.approx(b.xor_delta_ratio_bf16)
    for method in ("adera_value", "xor_delta"):
        cost = gather_cost(same, 16, profile, "ring", method, mode="always")
        assert cost.ratio <= b.capacity_slack * b.unchanged_ratio
    fp32 = dataclasses.replace(moved, dtype="fp32")
    assert gather_cost(fp32, 16, profile, "ring", "xor_delta").ratio == b.xor_delta_ratio_fp32
    trace = synthetic_moe_trace(num_layers=1, d_model=256, d_ff=512, steps=(300,))
    row = project(trace, profile, [16])[0]
    assert row.value_gather_speedup("raw") == row.gather_s["raw"] / row.gather_s["adera_value"]
    assert "value AG x xor-delta" in projection_table([row])
