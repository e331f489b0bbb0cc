"""ADKV quantizer: replay exactness, round-trip quality, metadata accounting, bad input."""

import math

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.kernels.adkv_decode import (
    EXPONENT_LIMIT,
    MAX_SEGMENT_OCTAVES,
    STEP_RESOLUTION,
    adkv_dequantize_reference,
    step_from_exponent,
)
from ada_modules.kv import static_per_channel
from ada_modules.kv.adkv import ADKVEncoder, ADKVParams, adkv_dequantize_sequential, adkv_encode

BITS = (2, 3, 4, 8)


def _drifting(tokens: int = 300, heads: int = 2, dim: int = 16, seed: int = 0) -> torch.Tensor:
    """Gaussian channels plus one large sinusoidal channel pair per head (post-RoPE drift)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, heads, tokens, dim, generator=g)
    t = torch.arange(tokens, dtype=torch.float32)
    x[..., dim // 2 - 1] += 12 * torch.cos(t * 0.01)
    x[..., dim - 1] += 12 * torch.sin(t * 0.01)
    return x


def _rel_mse(y: torch.Tensor, x: torch.Tensor) -> float:
    return float(((y - x) ** 2).sum() / (x**2).sum())


def test_step_grid_is_exact_powers_of_two_at_octaves() -> None:
    e = torch.arange(-EXPONENT_LIMIT, EXPONENT_LIMIT + 1, STEP_RESOLUTION)
    assert torch.equal(step_from_exponent(e), torch.ldexp(torch.ones(len(e)), e / 8))
    ratios = step_from_exponent(torch.arange(1, 80)) / step_from_exponent(torch.arange(0, 79))
    assert bool(((ratios - 2 ** (1 / 8)).abs() < 0.01).all())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("period", [1, 7, 64, 1000])
def test_sequential_and_prefix_sum_decode_agree_bitwise(bits: int, period: int) -> None:
    x = _drifting(tokens=90) * 3
    packed = adkv_encode(x, ADKVParams.default(bits), keyframe_period=period)
    assert torch.equal(adkv_dequantize_sequential(packed), adkv_dequantize_reference(packed))


def test_decode_agrees_bitwise_with_per_channel_parameters() -> None:
    g = torch.Generator().manual_seed(1)
    multipliers = torch.randint(-8, 12, (2, 16, 8), generator=g).to(torch.int8)
    multipliers[..., 0] = -3  # every table needs an entry <= 0 and one >= 0
    multipliers[..., -1] = 9
    params = ADKVParams(
        bits=4,
        alpha_code=torch.randint(0, 256, (2, 16), generator=g, dtype=torch.uint8),
        multipliers=multipliers,
        init_gain=torch.rand(2, 16, generator=g) + 0.1,
    )
    packed = adkv_encode(_drifting(), params, keyframe_period=40)
    assert torch.equal(adkv_dequantize_sequential(packed), adkv_dequantize_reference(packed))


def test_replay_matches_the_encoders_reconstruction() -> None:
    """The decoder's state is the encoder's: the codes the encoder picks are the nearest levels
    to the input given the decoded centre and step, so the error is within half a step."""
    x = _drifting(tokens=200)
    packed = adkv_encode(x, ADKVParams.default(8), keyframe_period=50)
    y = adkv_dequantize_reference(packed)
    assert _rel_mse(y, x) < 1e-3


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_is_small_and_tracks_drift(bits: int) -> None:
    x = _drifting(tokens=400)
    y = adkv_dequantize_reference(adkv_encode(x, ADKVParams.default(bits), 128))
    bound = {2: 0.05, 3: 0.02, 4: 0.006, 8: 1e-4}[bits]
    assert _rel_mse(y, x) < bound
    # The drifting channels (amplitude 12) are tracked: their error is below that of one scale
    # and zero per channel for the whole sequence at the same bits, well below up to 4 bits (at 8
    # bits a static step of range / 255 is already fine).
    static = static_per_channel(x, bits).values
    drift = (..., [7, 15])
    factor = 1.0 if bits == 8 else 0.5
    assert float(((y - x)[drift] ** 2).mean()) < factor * float(((static - x)[drift] ** 2).mean())


def test_streaming_blocks_after_the_first_do_not_change_the_codes() -> None:
    x = _drifting(tokens=130)
    whole = ADKVEncoder(ADKVParams.default(3), keyframe_period=32)
    whole.append(x[:, :, :32])
    whole.append(x[:, :, 32:])
    pieces = ADKVEncoder(ADKVParams.default(3), keyframe_period=32)
    for start, stop in [(0, 32), (32, 33), (33, 70), (70, 130)]:
        pieces.append(x[:, :, start:stop])
    for name in ("codes", "keyframe_centre", "keyframe_exponent"):
        assert torch.equal(getattr(whole.packed, name), getattr(pieces.packed, name))


def test_metadata_does_not_grow_with_context_except_keyframes() -> None:
    params = ADKVParams.default(2)
    short = adkv_encode(_drifting(tokens=1024, dim=32), params, keyframe_period=512)
    long = adkv_encode(_drifting(tokens=4096, dim=32), params, keyframe_period=512)
    assert short.parameter_nbytes() == long.parameter_nbytes() == 1 + 2  # shared alpha, table
    # fp16 centre + int16 exponent per channel per keyframe: 4 bytes.
    assert short.keyframe_nbytes() == 1 * 2 * 2 * 32 * 4
    assert long.keyframe_nbytes() == 1 * 2 * 8 * 32 * 4
    assert long.code_nbytes() == 4 * short.code_nbytes() == 2 * 4096 * 32 * 2 // 8
    bits_per_element = 8 * long.keyframe_nbytes() / (2 * 4096 * 32)
    assert bits_per_element == pytest.approx(32 / 512)


def test_beam_reorder_maps_codes_keyframes_and_state() -> None:
    x = torch.cat([_drifting(tokens=40, seed=s) for s in range(3)])
    enc = ADKVEncoder(ADKVParams.default(4), keyframe_period=16)
    enc.append(x[:, :, :20])
    order = torch.tensor([2, 0, 1])
    enc.map_batch(lambda t: t.index_select(0, order))
    enc.append(x[order][:, :, 20:])
    ref = ADKVEncoder(ADKVParams.default(4), keyframe_period=16)
    ref.append(x[:, :, :20])
    ref.append(x[:, :, 20:])
    assert torch.equal(enc.packed.codes, ref.packed.codes[order])
    assert torch.equal(
        adkv_dequantize_reference(enc.packed), adkv_dequantize_reference(ref.packed)[order]
    )


def test_ema_rule_is_a_multiplier_table_with_its_fixed_point_at_the_optimal_step() -> None:
    params = ADKVParams.ema(2, beta=1.0)
    # beta = 1: log s_t = log(kappa |x - mu|) = log s_{t-1} + log(kappa |v|)
    kappa = 2.0 ** -(0.683 * -1 + 0.317 * math.log2(1.5))
    expected = [round(8 * math.log2(kappa * v)) for v in (0.5, 1.5)]
    assert params.multipliers.tolist() == expected
    # On unit Gaussian data the step settles near the optimal 2-bit step (about 1.0).
    x = torch.randn(1, 1, 4000, 64, generator=torch.Generator().manual_seed(0))
    enc = ADKVEncoder(ADKVParams.ema(2, beta=0.25, alpha=0.01), keyframe_period=4000)
    enc.append(x)
    settled = step_from_exponent(enc._state["exponent"]).median()
    assert 0.6 < float(settled) < 1.6


def test_step_stays_within_segment_bounds_on_adversarial_input() -> None:
    """A stream whose scale jumps by 2**30 must not push the exponent past the segment bound."""
    x = torch.randn(1, 1, 200, 16)
    x[:, :, 100:] *= 2.0**30
    packed = adkv_encode(x, ADKVParams.jayant(2, [-1, 8]), keyframe_period=200)
    y = adkv_dequantize_reference(packed)
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y, adkv_dequantize_sequential(packed))
    limit = STEP_RESOLUTION * MAX_SEGMENT_OCTAVES
    enc = ADKVEncoder(ADKVParams.jayant(2, [-1, 8]), keyframe_period=200)
    enc.append(x)
    drift = enc._state["exponent"] - enc._state["key_exponent"]
    assert int(drift.abs().max()) <= limit


@pytest.mark.parametrize("bits", [1, 5, 16, 2.0, True, "2"])
def test_unsupported_bits_are_rejected(bits: object) -> None:
    with pytest.raises(InputError, match="bits must be one of"):
        ADKVParams.default(bits)


@pytest.mark.parametrize("period", [0, -3, 1.5, None, True])
def test_keyframe_period_below_one_is_rejected(period: object) -> None:
    with pytest.raises(InputError, match="keyframe_period must be an int >= 1"):
        ADKVEncoder(ADKVParams.default(2), keyframe_period=period)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_rejected_and_nothing_is_written(bad: float) -> None:
    enc = ADKVEncoder(ADKVParams.default(2), keyframe_period=8)
    enc.append(torch.randn(1, 1, 8, 16))
    before = enc.packed.codes.clone()
    x = torch.randn(1, 1, 8, 16)
    x[0, 0, 3, 5] = bad
    with pytest.raises(InputError, match="NaN/Inf"):
        enc.append(x)
    assert torch.equal(enc.packed.codes, before) and enc.num_tokens == 8


def test_mismatched_stream_shapes_are_rejected() -> None:
    enc = ADKVEncoder(ADKVParams.default(2))
    enc.append(torch.randn(1, 2, 4, 16))
    with pytest.raises(InputError, match="head_dim 32, the stream has 16"):
        enc.append(torch.randn(1, 2, 4, 32))
    with pytest.raises(InputError, match="batch and heads"):
        enc.append(torch.randn(2, 2, 4, 16))


def test_invalid_multiplier_tables_are_rejected() -> None:
    with pytest.raises(InputError, match="entry <= 0 and one >= 0"):
        ADKVParams.jayant(2, [1, 3])
    with pytest.raises(InputError, match="4 entries"):
        ADKVParams.jayant(3, [-1, 2])


def test_params_round_trip_through_a_file(tmp_path) -> None:
    params = ADKVParams.ema(4, beta=0.1, alpha=0.2).for_shape(2, 16)
    torch.save(params.state_dict(), tmp_path / "p.pt")
    loaded = ADKVParams.load(tmp_path / "p.pt")
    assert loaded.bits == 4
    assert torch.equal(loaded.multipliers, params.multipliers)
    assert torch.equal(loaded.alpha_code, params.alpha_code)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: ADKVParams.jayant(2, [300, -1]), r"multipliers must lie in \[-128, 127\]"),
        (lambda: ADKVParams.jayant(2, [1.5, -1]), "multipliers must be a list of integers"),
        (lambda: ADKVParams.ema(2, kappa=float("inf")), "kappa must be a finite number > 0"),
        (lambda: ADKVParams.ema(2, kappa=1e-30), r"kappa=1e-30 .* outside \[-128, 127\]"),
        (lambda: ADKVParams.ema(2, beta=float("nan")), r"beta must lie in \(0, 1\]"),
    ],
)
def test_step_rules_that_do_not_fit_the_int8_table_are_named(build, match) -> None:
    """They raised torch's "value cannot be converted to type int8 without overflow"."""
    with pytest.raises(InputError, match=match):
        build()
