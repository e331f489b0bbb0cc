"""KV study baselines: round-trip bounds, exact bit counts, the drifting-channel premise, metrics."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from ada_modules.errors import InputError
from ada_modules.kv import (
    attention_output,
    attention_relative_mse,
    groupwise_keys,
    groupwise_values,
    pre_rope_per_channel_keys,
    static_per_channel,
)
from ada_modules.kv.kv_study import _rope

BITS = (2, 3, 4, 8)


def hf_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE as a Llama model applies it: cos/sin from LlamaRotaryEmbedding, apply_rotary_pos_emb."""
    heads, head_dim = x.shape[1], x.shape[-1]
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        rope_theta=base,
    )
    position_ids = positions.expand(x.shape[0], -1) if positions.dim() == 1 else positions
    cos, sin = LlamaRotaryEmbedding(config)(x.float(), position_ids)
    return apply_rotary_pos_emb(x.float(), x.float(), cos, sin)[1]


def group_scale(x: torch.Tensor, bits: int, dim: int, group: int) -> torch.Tensor:
    """Per-group (max - min) / (2**bits - 1), broadcast back to every element of ``x``."""
    dim %= x.dim()
    shape = list(x.shape)
    shape[dim : dim + 1] = [shape[dim] // group, group]
    grouped = x.reshape(shape)
    scale = (grouped.amax(dim + 1) - grouped.amin(dim + 1)) / (2**bits - 1)
    return scale.repeat_interleave(group, dim=dim)


def drifting_keys(tokens: int = 1024, channel: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre- and post-RoPE keys with mean 15 on the low-frequency pair (channel, channel + D/2)."""
    gen = torch.Generator().manual_seed(0)
    pre = torch.randn(1, 2, tokens, 64, generator=gen)
    pre[..., channel] += 15.0
    pre[..., channel + 32] += 15.0
    return pre, hf_rope(pre, torch.arange(tokens))


# ----------------------------------------------------------------------------------------------
# Round trip
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_groupwise_round_trip_within_half_a_scale(bits):
    x = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(bits))
    keys, values = groupwise_keys(x, bits), groupwise_values(x, bits)
    assert keys.values.shape == values.values.shape == x.shape
    assert keys.values.dtype == values.values.dtype == torch.float32
    assert ((keys.values - x).abs() <= group_scale(x, bits, -2, 32) / 2 + 1e-5).all()
    assert ((values.values - x).abs() <= group_scale(x, bits, -1, 32) / 2 + 1e-5).all()


@pytest.mark.parametrize("bits", BITS)
def test_static_per_channel_round_trip_within_half_a_scale(bits):
    x = torch.randn(2, 3, 50, 16, generator=torch.Generator().manual_seed(bits))
    q = static_per_channel(x, bits)
    assert ((q.values - x).abs() <= group_scale(x, bits, -2, 50) / 2 + 1e-5).all()


@pytest.mark.parametrize("bits", BITS)
def test_pre_rope_round_trip_within_half_a_scale_per_rotated_pair(bits):
    x = torch.randn(2, 2, 40, 16, generator=torch.Generator().manual_seed(bits))
    q = pre_rope_per_channel_keys(x, bits)
    err = (q.values - hf_rope(x, torch.arange(40))).square()
    bound = (group_scale(x, bits, -2, 40) / 2).square()
    # A rotation keeps the error norm of each channel pair (i, i + D/2).
    assert (err[..., :8] + err[..., 8:] <= bound[..., :8] + bound[..., 8:] + 1e-5).all()


def test_pre_rope_is_static_per_channel_then_hf_rope():
    x = torch.randn(2, 2, 24, 32, generator=torch.Generator().manual_seed(1))
    positions = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(2))
    q = pre_rope_per_channel_keys(x, 3, positions, base=500000.0)
    expected = hf_rope(static_per_channel(x, 3).values, positions, base=500000.0)
    torch.testing.assert_close(q.values, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_rope_helper_matches_transformers(base):
    x = torch.randn(2, 3, 17, 64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(100, 117)
    torch.testing.assert_close(_rope(x, positions, base), hf_rope(x, positions, base))
    batched = torch.stack([positions, positions * 7])
    torch.testing.assert_close(_rope(x, batched, base), hf_rope(x, batched, base))


def test_fp16_input_keeps_its_dtype():
    x = torch.randn(1, 2, 32, 64).half()
    for q in (
        groupwise_keys(x, 2),
        groupwise_values(x, 2),
        static_per_channel(x, 2),
        pre_rope_per_channel_keys(x, 2),
    ):
        assert q.values.dtype == torch.float16 and q.values.shape == x.shape


# ----------------------------------------------------------------------------------------------
# Bit accounting
# ----------------------------------------------------------------------------------------------


def test_groupwise_metadata_is_one_bit_per_element_in_fp16():
    x = torch.randn(2, 4, 64, 64).half()
    keys, values = groupwise_keys(x, 2, 32), groupwise_values(x, 2, 32)
    assert keys.metadata_bits == 2 * 4 * (64 // 32) * 64 * 2 * 16
    assert values.metadata_bits == 2 * 4 * 64 * (64 // 32) * 2 * 16
    assert keys.metadata_bits_per_element == values.metadata_bits_per_element == 1.0
    assert keys.bits_per_element == values.bits_per_element == 3.0
    assert groupwise_keys(x, 2, 64).metadata_bits_per_element == 0.5
    assert groupwise_keys(x.float(), 2, 32).metadata_bits_per_element == 2.0  # fp32 side info


def test_static_metadata_is_32_bits_per_channel_in_fp16():
    x = torch.randn(2, 3, 100, 64)
    for quantizer in (static_per_channel, pre_rope_per_channel_keys):
        assert quantizer(x.half(), 4).metadata_bits == 2 * 3 * 64 * 32
        assert quantizer(x.bfloat16(), 4).metadata_bits == 2 * 3 * 64 * 32
        assert quantizer(x, 4).metadata_bits == 2 * 3 * 64 * 64
        assert quantizer(x, 4).num_elements == x.numel()


@pytest.mark.parametrize("bits", BITS)
def test_code_bits_count_packed_words(bits):
    x = torch.randn(1, 2, 32, 64)
    for quantizer in (
        groupwise_keys,
        groupwise_values,
        static_per_channel,
        pre_rope_per_channel_keys,
    ):
        assert quantizer(x, bits).code_bits_per_element == bits
    # 16 channels of 3 bits take a 2-bit word and a (half-empty) 1-bit word: 4 bits per element.
    assert static_per_channel(torch.randn(1, 1, 8, 16), 3).code_bits == 8 * 2 * 32


# ----------------------------------------------------------------------------------------------
# The premise: a drifting post-RoPE channel breaks static per-channel scales
# ----------------------------------------------------------------------------------------------


def test_static_per_channel_is_much_worse_on_a_drifting_channel():
    pre, post = drifting_keys()
    queries = torch.randn(1, 4, 8, 64, generator=torch.Generator().manual_seed(1))
    values = torch.randn(1, 2, 1024, 64, generator=torch.Generator().manual_seed(2))
    keys = {
        "static": static_per_channel(post, 2).values,
        "groupwise": groupwise_keys(post, 2).values,
        "pre_rope": pre_rope_per_channel_keys(pre, 2).values,
    }
    pair = {name: (k - post)[..., [20, 52]].square().mean() for name, k in keys.items()}
    att = {
        name: attention_relative_mse(queries, post, values, k, values) for name, k in keys.items()
    }
    # On the drifting pair the static scale spans the whole sweep (~40) instead of the noise.
    assert pair["static"] > 10 * pair["groupwise"] and pair["static"] > 10 * pair["pre_rope"]
    assert att["static"] > 4 * att["groupwise"] and att["static"] > 2 * att["pre_rope"]


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def test_attention_output_matches_sdpa_with_repeat_kv():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=gen) for h, n in [(6, 3), (2, 10), (2, 10)])
    out = attention_output(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert out.shape == (2, 6, 3, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, sdpa(q, repeat_kv(k, 3), repeat_kv(v, 3)))
    scaled = attention_output(q.half(), k.half(), v.half(), scale=0.5)
    assert scaled.dtype == torch.float32
    torch.testing.assert_close(
        scaled, sdpa(q, repeat_kv(k, 3), repeat_kv(v, 3), scale=0.5), atol=5e-3, rtol=5e-3
    )


def test_attention_relative_mse_is_a_ratio_of_sums():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=gen), *torch.randn(2, 2, 2, 7, 8, generator=gen)
    assert attention_relative_mse(q, k, v, k, v).item() == 0.0
    # Scaling the values by 1.1 scales every output by 1.1: error 0.1² of the norm.
    torch.testing.assert_close(attention_relative_mse(q, k, v, k, 1.1 * v), torch.tensor(0.01))
    assert attention_relative_mse(q, k, v, k + 0.1 * torch.randn_like(k), v) > 0
    out = attention_output(q, k, v)
    err = (out - attention_output(q, 2 * k, v)).square().sum()
    torch.testing.assert_close(attention_relative_mse(q, k, v, 2 * k, v), err / out.square().sum())


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "quantizer", [groupwise_keys, groupwise_values, static_per_channel, pre_rope_per_channel_keys]
)
def test_quantizers_reject_bad_input(quantizer):
    x = torch.randn(1, 2, 32, 32)
    with pytest.raises(InputError, match="bits.*5"):
        quantizer(x, 5)
    with pytest.raises(InputError, match="NaN/Inf"):
        quantizer(x.index_fill(-1, torch.tensor([3]), float("nan")), 2)
    with pytest.raises(InputError, match="NaN/Inf"):
        quantizer(x.index_fill(-2, torch.tensor([0]), float("inf")), 2)
    with pytest.raises(InputError, match=r"\(2, 32, 32\)"):
        quantizer(x[0], 2)
    with pytest.raises(InputError, match="int64"):
        quantizer(x.long(), 2)


def test_group_size_must_divide_tokens_or_channels():
    with pytest.raises(InputError, match="tokens, got 40"):
        groupwise_keys(torch.randn(1, 2, 40, 32), 2)
    with pytest.raises(InputError, match="head dim, got 48"):
        groupwise_values(torch.randn(1, 2, 40, 48), 2)


def test_pre_rope_rejects_bad_positions_and_base():
    x = torch.randn(2, 2, 8, 16)
    with pytest.raises(InputError, match=r"positions.*\(8,\) or \(2, 8\).*\(9,\)"):
        pre_rope_per_channel_keys(x, 2, torch.arange(9))
    with pytest.raises(InputError, match="base.*-1"):
        pre_rope_per_channel_keys(x, 2, base=-1.0)
    with pytest.raises(InputError, match="even head_dim, got 15"):
        pre_rope_per_channel_keys(torch.randn(1, 1, 8, 15), 2)


def test_attention_metrics_reject_bad_input():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(InputError, match=r"keys_hat.*\(1, 2, 6, 8\).*\(1, 2, 5, 8\)"):
        attention_relative_mse(q, k, v, k[:, :, :5], v)
    with pytest.raises(InputError, match=r"values_hat.*\(1, 2, 6, 4\)"):
        attention_relative_mse(q, k, v, k, v[..., :4])
    with pytest.raises(InputError, match="keys_hat must be finite, got NaN/Inf"):
        attention_relative_mse(q, k, v, k / 0, v)
    with pytest.raises(InputError, match="queries must be finite, got NaN/Inf"):
        attention_output(q * float("nan"), k, v)
    with pytest.raises(InputError, match=r"multiple of kv_heads.*\(1, 3, 2, 8\)"):
        attention_output(torch.randn(1, 3, 2, 8), k, v)
    with pytest.raises(InputError, match=r"same shape.*\(1, 2, 5, 8\)"):
        attention_output(q, k, v[:, :, :5])
    with pytest.raises(InputError, match="scale.*-1"):
        attention_output(q, k, v, scale=-1.0)
    with pytest.raises(InputError, match="all zeros"):
        attention_relative_mse(q, k, torch.zeros_like(v), k, v)
