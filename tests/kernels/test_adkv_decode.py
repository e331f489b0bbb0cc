"""ADKV decode kernels: Triton == torch reference (bitwise for the dequantizer), bad input.

On a machine without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` so that
``impl="triton"`` runs the kernels on CPU tensors (tiny shapes only: the interpreter is slow).
"""

from dataclasses import replace

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.kernels import (
    ADKVTensor,
    adkv_decode_attention,
    adkv_decode_attention_reference,
    adkv_dequantize,
    adkv_dequantize_reference,
)
from ada_modules.kv.adkv import ADKVParams, adkv_encode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _params(bits: int, kind: str, heads: int, dim: int, seed: int) -> ADKVParams:
    """Shared (the defaults), per-head (stride 0 along the channels) or per-channel parameters."""
    shared = ADKVParams.default(bits)
    if kind == "shared":
        return shared
    g = torch.Generator().manual_seed(seed)
    lead = (heads, dim) if kind == "per_channel" else (heads, 1)
    table = shared.multipliers.to(torch.int64) + torch.randint(
        -2, 3, (*lead, 2 ** (bits - 1)), generator=g
    )
    table[..., 0] = table[..., 0].clamp_max(0)  # every table can shrink and grow the step
    table[..., -1] = table[..., -1].clamp_min(0)
    alpha = torch.randint(0, 64, lead, generator=g).to(torch.uint8)
    return ADKVParams(bits, alpha, table.to(torch.int8), torch.tensor(1.0))


def _packed(
    bits: int,
    shape: tuple[int, int, int, int],
    period: int,
    kind: str = "shared",
    scale: float = 1.0,
    seed: int = 0,
) -> ADKVTensor:
    """ADKV codes of Gaussian states with one drifting channel, encoded by the python encoder."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 0] += torch.linspace(-4, 4, shape[2])
    packed = adkv_encode(x * scale, _params(bits, kind, shape[1], shape[3], seed), period)
    return packed.map(lambda t: t.to(DEVICE))


def _on_device(packed: ADKVTensor) -> ADKVTensor:
    return replace(
        packed,
        alpha_code=packed.alpha_code.to(DEVICE),
        multipliers=packed.multipliers.to(DEVICE),
    )


# ----------------------------------------------------------------------------------------------
# Dequantize
# ----------------------------------------------------------------------------------------------

DEQUANT_CASES = [
    # (shape, period, parameters, scale): BLOCK_T is min(8, next_pow2(period))
    ((1, 2, 37, 16), 16, "shared", 1e3),  # partial last segment, 2 tiles per segment
    ((2, 1, 37, 48), 5, "per_channel", 1e-3),  # period < BLOCK_T, head_dim not a power of two
    ((1, 2, 45, 16), 20, "per_head", 1.0),  # partial last tile of every segment
]


@pytest.mark.triton
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("shape", "period", "kind", "scale"), DEQUANT_CASES, ids=str)
def test_dequantize_kernel_is_bitwise_the_reference(bits, shape, period, kind, scale):
    packed = _on_device(_packed(bits, shape, period, kind, scale, seed=bits))
    out = adkv_dequantize(packed, impl="triton")
    ref = adkv_dequantize_reference(packed)
    assert out.dtype == torch.float32 and out.shape == shape
    assert torch.equal(out, ref)


@pytest.mark.triton
def test_dequantize_kernel_over_several_channel_blocks():
    packed = _on_device(_packed(4, (1, 1, 12, 160), 8, "per_channel"))  # 128 + 32 channels
    assert torch.equal(adkv_dequantize(packed, impl="triton"), adkv_dequantize_reference(packed))


def test_dequantize_torch_impl_is_the_reference():
    packed = _on_device(_packed(2, (1, 2, 9, 16), 4))
    assert torch.equal(adkv_dequantize(packed, impl="torch"), adkv_dequantize_reference(packed))


# ----------------------------------------------------------------------------------------------
# Decode attention
# ----------------------------------------------------------------------------------------------


def _attention_inputs(
    key_bits: int,
    value_bits: int,
    batch: int,
    kv_heads: int,
    tokens: int,
    dim: int,
    period: int,
    residual: int,
    kind: str = "shared",
) -> tuple[ADKVTensor, ADKVTensor, torch.Tensor, torch.Tensor]:
    shape = (batch, kv_heads, tokens, dim)
    keys = _on_device(_packed(key_bits, shape, period, kind, seed=1))
    values = _on_device(_packed(value_bits, shape, period, kind, seed=2))
    g = torch.Generator().manual_seed(3)
    window = [torch.randn(batch, kv_heads, residual, dim, generator=g).to(DEVICE) for _ in "kv"]
    return keys, values, *window


@pytest.mark.triton
@pytest.mark.parametrize(
    ("dtype", "bits", "heads", "dim", "period", "residual", "num_splits", "kind"),
    [
        # GQA 2, a residual window, 2 tiles per segment (BLOCK_T = 8)
        (torch.float32, (4, 2), 4, 16, 16, 5, None, "shared"),
        # runs of 2 segments per program
        (torch.float16, (3, 8), 4, 16, 16, 3, 2, "per_head"),
        # no GQA, period < BLOCK_T, one program per row over 8 segments
        (torch.float32, (2, 4), 2, 48, 5, 0, 1, "per_channel"),
    ],
    ids=str,
)
def test_decode_attention_kernel_matches_reference(
    dtype, bits, heads, dim, period, residual, num_splits, kind
):
    keys, values, rk, rv = _attention_inputs(*bits, 1, 2, 37, dim, period, residual, kind)
    query = torch.randn(1, heads, dim, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    window = (rk, rv) if residual else (None, None)
    out = adkv_decode_attention(query, keys, values, *window, num_splits=num_splits, impl="triton")
    ref = adkv_decode_attention_reference(query, keys, values, *window)
    assert out.dtype == dtype and out.shape == query.shape
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.triton
def test_decode_attention_kernel_with_left_padding_and_an_empty_row():
    keys, values, rk, rv = _attention_inputs(4, 4, 2, 2, 37, 16, 16, 4)
    query = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones(2, 41, dtype=torch.bool, device=DEVICE)
    mask[0, :21] = False  # left padding over a keyframe and into the next segment
    mask[1] = False  # nothing to attend to: zeros
    out = adkv_decode_attention(query, keys, values, rk, rv, mask, scale=0.3, impl="triton")
    ref = adkv_decode_attention_reference(query, keys, values, rk, rv, mask, scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.triton
def test_decode_attention_kernel_with_the_residual_window_only():
    g = torch.Generator().manual_seed(6)
    rk, rv = (torch.randn(1, 2, 40, 16, generator=g).to(DEVICE) for _ in "kv")
    query = torch.randn(1, 8, 16, generator=g).to(DEVICE)
    out = adkv_decode_attention(query, None, None, rk, rv, num_splits=2, impl="triton")
    ref = adkv_decode_attention_reference(query, None, None, rk, rv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_attention_reference_is_softmax_over_the_decoded_keys():
    keys, values, rk, rv = _attention_inputs(4, 4, 1, 1, 10, 16, 4, 2)
    query = torch.randn(1, 2, 16, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    k = torch.cat([adkv_dequantize_reference(keys), rk], dim=-2)[0, 0]
    v = torch.cat([adkv_dequantize_reference(values), rv], dim=-2)[0, 0]
    want = torch.softmax(query[0] @ k.T / 4, dim=-1) @ v
    out = adkv_decode_attention(query, keys, values, rk, rv, impl="torch")
    torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> dict:
    """Packed keys/values (batch 1, 2 kv heads, 12 tokens, head_dim 16), a window and a query."""
    keys, values, rk, rv = _attention_inputs(4, 4, 1, 2, 12, 16, 4, 3)
    return {
        "keys": keys,
        "values": values,
        "rk": rk,
        "rv": rv,
        "query": torch.randn(1, 4, 16, device=DEVICE),
        "other_period": _on_device(_packed(4, (1, 2, 12, 16), 6, seed=2)),
        "shorter": _on_device(_packed(4, (1, 2, 10, 16), 4, seed=2)),
        "wide": _on_device(_packed(4, (1, 2, 12, 32), 4, seed=2)),
    }


BAD_INPUT = [
    pytest.param(
        "keys must have .* head_dim=16",
        lambda s: adkv_decode_attention(s["query"], s["wide"], s["wide"]),
        id="head_dim",
    ),
    pytest.param(
        r"query heads \(3\) must be a multiple of key/value heads \(2\)",
        lambda s: adkv_decode_attention(s["query"][:, :3], s["keys"], s["values"]),
        id="gqa",
    ),
    pytest.param(
        "keys and values must hold the same tokens, got 12 and 10",
        lambda s: adkv_decode_attention(s["query"], s["keys"], s["shorter"]),
        id="tokens",
    ),
    pytest.param(
        "keys and values must share keyframe_period, got 4 and 6",
        lambda s: adkv_decode_attention(s["query"], s["keys"], s["other_period"]),
        id="period",
    ),
    pytest.param(
        r"key_mask must be a bool tensor of shape \(batch, keys\) = \(1, 15\)",
        lambda s: adkv_decode_attention(
            s["query"],
            s["keys"],
            s["values"],
            s["rk"],
            s["rv"],
            torch.ones(1, 12, dtype=torch.bool),
        ),
        id="key_mask",
    ),
    pytest.param(
        "keys and values must be given together",
        lambda s: adkv_decode_attention(s["query"], s["keys"], None),
        id="values-missing",
    ),
    pytest.param(
        "keys must be an ADKVTensor, got Tensor",
        lambda s: adkv_decode_attention(s["query"], s["rk"], s["rv"]),
        id="not-packed",
    ),
    pytest.param(
        "needs packed keys/values or a residual window",
        lambda s: adkv_decode_attention(s["query"], None, None),
        id="nothing",
    ),
    pytest.param(
        "residual_keys must have batch=1, 2 kv heads",
        lambda s: adkv_decode_attention(
            s["query"], s["keys"], s["values"], s["rk"][:, :1], s["rv"][:, :1]
        ),
        id="residual-heads",
    ),
    pytest.param(
        "num_splits must be a positive integer",
        lambda s: adkv_decode_attention(s["query"], s["keys"], s["values"], num_splits=0),
        id="num_splits",
    ),
    pytest.param(
        r"keys.multipliers must broadcast to \(heads, head_dim, 2\*\*\(bits-1\)\)",
        lambda s: adkv_decode_attention(
            s["query"],
            replace(s["keys"], multipliers=torch.zeros(3, 8, dtype=torch.int8)),
            s["values"],
        ),
        id="multipliers",
    ),
    pytest.param(
        "packed.keyframe_period must be an int >= 1, got 0",
        lambda s: adkv_dequantize(replace(s["keys"], keyframe_period=0)),
        id="period-zero",
    ),
    pytest.param(
        "packed: codes have 3 words per token, expected 2",
        lambda s: adkv_dequantize(replace(s["keys"], codes=s["keys"].codes[..., [0, 1, 1]])),
        id="words",
    ),
    pytest.param(
        "impl must be one of", lambda s: adkv_dequantize(s["keys"], impl="cuda"), id="impl"
    ),
]


@pytest.mark.parametrize(("match", "call"), BAD_INPUT)
def test_bad_input_raises_input_error_naming_it(small, match, call):
    with pytest.raises(InputError, match=match):
        call(small)
