"""Packed KV quantization and decode attention: kernels vs references, invariants, bad input.

On a machine without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` so that
``impl="triton"`` runs the kernels on CPU tensors (small shapes only).
"""

import pytest
import torch

from ada_modules.kernels import kv_quant
from ada_modules.kernels.kv_quant import (
    SUPPORTED_BITS,
    PackedTensor,
    QuantizedKV,
    decode_attention,
    decode_attention_reference,
    dequantize,
    dequantize_reference,
    pack_codes,
    packed_words,
    quantize_keys,
    quantize_keys_reference,
    quantize_values,
    quantize_values_reference,
    unpack_codes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]


def _assert_packed_equal(a: PackedTensor, b: PackedTensor) -> None:
    assert (a.bits, a.group_size, a.kind, a.head_dim) == (b.bits, b.group_size, b.kind, b.head_dim)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("head_dim", [1, 16, 33, 128])
def test_pack_unpack_is_exact(bits, head_dim):
    gen = torch.Generator().manual_seed(bits * 1000 + head_dim)
    codes = torch.randint(0, 2**bits, (3, 5, head_dim), generator=gen)
    codes[0, 0] = 2**bits - 1  # all bits set: the sign bit of a word is used for 2 and 4 bits
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.int32
    assert packed.shape == (3, 5, packed_words(head_dim, bits))
    assert torch.equal(unpack_codes(packed, bits, head_dim), codes.int())


def test_packed_sizes_are_exact_bits_per_element():
    # 3 bits = a 2-bit and a 1-bit plane: exactly 3 bits per element when head_dim % 32 == 0.
    for bits in SUPPORTED_BITS:
        assert packed_words(128, bits) * 32 == 128 * bits
    assert pack_codes(torch.tensor([[3] * 16]), 2).item() == -1  # all 32 bits set


# ----------------------------------------------------------------------------------------------
# Quantize / dequantize
# ----------------------------------------------------------------------------------------------

QUANT_CASES = [
    # (kind, shape, group)
    ("key", (1, 2, 48, 40), 16),
    ("key", (1, 2, 64, 128), 32),
    ("key", (5, 32, 16), 32),
    ("value", (2, 1, 7, 40), 8),
    ("value", (1, 2, 33, 64), 32),
    ("value", (4, 1, 16), 16),
]


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize(("kind", "shape", "group"), QUANT_CASES, ids=str)
def test_quantize_kernel_matches_reference(seed, kind, shape, group, bits, dtype):
    x = (2 * torch.randn(shape, device=DEVICE) + 0.5).to(dtype)
    fn, ref = (
        (quantize_keys, quantize_keys_reference)
        if kind == "key"
        else (quantize_values, quantize_values_reference)
    )
    packed = fn(x, bits, group, impl="triton")
    expected = ref(x, bits, group)
    _assert_packed_equal(packed, expected)
    assert packed.scale.dtype == dtype
    assert torch.equal(dequantize(packed, impl="triton"), dequantize_reference(packed))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("kind", ["key", "value"])
def test_roundtrip_error_is_at_most_half_a_step(seed, impl, bits, kind):
    x = 3 * torch.randn(2, 2, 64, 32, device=DEVICE)
    fn = quantize_keys if kind == "key" else quantize_values
    packed = fn(x, bits, 16, impl=impl)
    err = (x - dequantize(packed, impl=impl)).abs()
    axis = -2 if kind == "key" else -1
    step = packed.scale.repeat_interleave(16, dim=axis)
    assert (err <= step / 2 * (1 + 1e-5) + 1e-6).all()
    codes = unpack_codes(packed.codes, bits, 32)
    assert codes.min() == 0 and codes.max() == 2**bits - 1  # group min and max are codes 0, top


@pytest.mark.parametrize("impl", IMPLS)
def test_constant_groups_dequantize_exactly(impl):
    x = torch.full((1, 1, 32, 32), 1.25, device=DEVICE)
    for fn in (quantize_keys, quantize_values):
        packed = fn(x, 2, 32, impl=impl)
        assert (packed.scale == 0).all()
        assert torch.equal(dequantize(packed, impl=impl), x)


def test_packed_tensor_concatenates_along_tokens(seed):
    x = torch.randn(2, 64, 32)
    whole = quantize_keys(x, 3, 32)
    parts = PackedTensor.cat([quantize_keys(x[:, :32], 3, 32), quantize_keys(x[:, 32:], 3, 32)])
    _assert_packed_equal(whole, parts)
    assert parts.nbytes() == 2 * 64 * 3 * 4 + 2 * 2 * 2 * 32 * 4  # codes + fp32 scale and zero
    with pytest.raises(ValueError, match="bit width"):
        PackedTensor.cat([whole, quantize_keys(x, 2, 32)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_quantize_kernel_matches_reference_on_cuda(bits, dtype):
    x = torch.randn(4, 8, 256, 128, device="cuda").to(dtype)
    _assert_packed_equal(quantize_keys(x, bits, 32), quantize_keys_reference(x, bits, 32))
    _assert_packed_equal(quantize_values(x, bits, 32), quantize_values_reference(x, bits, 32))


# ----------------------------------------------------------------------------------------------
# Decode attention
# ----------------------------------------------------------------------------------------------

DECODE_CASES = [
    # (batch, kv_heads, gqa, head_dim, segment tokens [(n, kbits, vbits, kgroup, vgroup)], residual)
    (1, 1, 1, 16, [(32, 2, 2, 32, 16)], 0),
    (2, 2, 2, 32, [(32, 2, 4, 32, 8), (64, 4, 2, 16, 8)], 7),
    (3, 2, 4, 40, [(48, 8, 3, 16, 8)], 31),
    (2, 1, 4, 64, [], 5),
    (1, 2, 1, 32, [(16, 3, 3, 16, 32), (0, 2, 2, 16, 32), (16, 2, 8, 16, 32)], 1),
    (1, 1, 2, 16, [(32, 3, 3, 16, 16)], 3),  # a 1-bit plane wider than the 16 channels
]


def _decode_inputs(case, dtype, masked, gen):
    batch, kv_heads, gqa, head_dim, seg_specs, residual = case
    segments = []
    for n, kb, vb, kg, vg in seg_specs:
        k = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(DEVICE, dtype)
        v = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(DEVICE, dtype)
        segments.append(
            QuantizedKV(quantize_keys_reference(k, kb, kg), quantize_values_reference(v, vb, vg))
        )
    rk = rv = None
    if residual:
        rk = torch.randn(batch, kv_heads, residual, head_dim, generator=gen).to(DEVICE, dtype)
        rv = torch.randn(batch, kv_heads, residual, head_dim, generator=gen).to(DEVICE, dtype)
    q = (2 * torch.randn(batch, kv_heads * gqa, head_dim, generator=gen)).to(DEVICE, dtype)
    total = sum(s[0] for s in seg_specs) + residual
    mask = None
    if masked:  # left padding of a different length per row
        mask = torch.ones(batch, total, dtype=torch.bool, device=DEVICE)
        for b in range(batch):
            mask[b, : (7 * b) % total] = False
    return q, segments, rk, rv, mask


@pytest.mark.triton
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}H{c[1]}x{c[2]}D{c[3]}")
def test_decode_kernel_matches_reference(case, masked, num_splits):
    gen = torch.Generator().manual_seed(7)
    q, segments, rk, rv, mask = _decode_inputs(case, torch.float32, masked, gen)
    out = decode_attention(q, segments, rk, rv, mask, num_splits=num_splits, impl="triton")
    expected = decode_attention_reference(q, segments, rk, rv, mask)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_log_sum_exps_per_part(impl):
    gen = torch.Generator().manual_seed(5)
    q, segments, rk, rv, mask = _decode_inputs(DECODE_CASES[4], torch.float32, True, gen)
    out, lse = decode_attention(q, segments, rk, rv, mask, num_splits=2, return_lse=True, impl=impl)
    assert lse.shape == (1, 2, len(segments) + 1)
    assert torch.isneginf(lse[..., 1]).all()  # the empty segment
    # The log-sum-exp over all keys of the dense computation, split by part.
    keys = torch.cat([dequantize(s.keys).float() for s in segments] + [rk], dim=-2)
    scores = torch.einsum("bhd,bhtd->bht", q, keys) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    expected = torch.stack(
        [part.logsumexp(-1) for part in scores.split([16, 0, 16, 1], dim=-1)], dim=-1
    )
    torch.testing.assert_close(lse, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, decode_attention_reference(q, segments, rk, rv, mask))


@pytest.mark.triton
def test_decode_kernel_half_precision_inputs():
    gen = torch.Generator().manual_seed(3)
    q, segments, rk, rv, mask = _decode_inputs(DECODE_CASES[2], torch.float16, True, gen)
    out = decode_attention(q, segments, rk, rv, mask, impl="triton")
    assert out.dtype == torch.float16
    expected = decode_attention_reference(q, segments, rk, rv, mask)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-3, atol=2e-3)


def test_decode_reference_equals_softmax_attention_on_dequantized_states(seed):
    k, v = torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    seg = QuantizedKV(quantize_keys(k[:, :, :32], 4, 32), quantize_values(v[:, :, :32], 4, 32))
    keys = torch.cat([dequantize(seg.keys), k[:, :, 32:]], dim=-2)
    values = torch.cat([dequantize(seg.values), v[:, :, 32:]], dim=-2)
    q = torch.randn(2, 4, 1, 32)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, enable_gqa=True
    ).squeeze(2)
    out = decode_attention(q.squeeze(2), [seg], k[:, :, 32:], v[:, :, 32:])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_masked_keys_do_not_matter(seed):
    k, v = torch.randn(1, 1, 33, 16), torch.randn(1, 1, 33, 16)
    mask = torch.ones(1, 33, dtype=torch.bool)
    mask[0, 3:9] = False
    out = decode_attention(torch.randn(1, 2, 16), [], k, v, mask)
    k2, v2 = k.clone(), v.clone()
    k2[..., 3:9, :] = 100.0
    v2[..., 3:9, :] = -100.0
    torch.testing.assert_close(
        decode_attention(out.new_ones(1, 2, 16), [], k2, v2, mask),
        decode_attention(out.new_ones(1, 2, 16), [], k, v, mask),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [1, 4])
def test_decode_kernel_matches_reference_on_cuda(gqa):
    gen = torch.Generator().manual_seed(0)
    case = (4, 8, gqa, 128, [(2048, 2, 2, 32, 32), (512, 4, 4, 32, 32)], 17)
    q, segments, rk, rv, mask = _decode_inputs(case, torch.float16, True, gen)
    out = decode_attention(q, segments, rk, rv, mask)
    expected = decode_attention_reference(q, segments, rk, rv, mask)
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=2e-3)


# ----------------------------------------------------------------------------------------------
# Dispatch and bad input
# ----------------------------------------------------------------------------------------------


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the Triton path ran for a CPU tensor")

    for name in ("_quantize_triton", "_dequantize_triton", "_decode_attention_triton"):
        monkeypatch.setattr(kv_quant, name, fail)
    k = torch.randn(1, 1, 32, 16)
    seg = QuantizedKV(quantize_keys(k, 2, 32), quantize_values(k, 2, 16))
    dequantize(seg.keys)
    decode_attention(torch.randn(1, 1, 16), [seg])


@pytest.mark.triton
def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"cpu.*TRITON_INTERPRET=1"):
        quantize_keys(torch.randn(32, 16), 2, impl="triton")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: quantize_keys(torch.randn(32, 16), 5), "bits must be one of .* got 5"),
        (lambda: quantize_values(torch.randn(4, 16), 1), "got 1"),
        (lambda: quantize_keys(torch.randn(48, 16), 2, 32), "group_size=32 must divide .* 48"),
        (lambda: quantize_values(torch.randn(4, 40), 2, 32), "group_size=32 .* head dim, got 40"),
        (lambda: quantize_values(torch.randn(4, 48), 2, 24), "power of two, got 24"),
        (lambda: quantize_keys(torch.randn(16), 2, 16), r"got \(16,\)"),
        (lambda: pack_codes(torch.zeros(3, 4), 6), "got 6"),
    ],
    ids=["key_bits", "value_bits", "key_group", "value_group", "power_of_two", "1-d", "pack"],
)
def test_bad_input_names_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_dtype_and_impl():
    with pytest.raises(TypeError, match="torch.int64"):
        quantize_keys(torch.zeros(32, 16, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="'cuda'"):
        quantize_keys(torch.randn(32, 16), 2, impl="cuda")


def test_decode_attention_rejects_mismatched_shapes():
    k = torch.randn(2, 2, 32, 16)
    seg = QuantizedKV(quantize_keys(k, 2, 32), quantize_values(k, 2, 16))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        decode_attention(torch.randn(2, 3, 16), [seg])
    with pytest.raises(ValueError, match="batch=3"):
        decode_attention(torch.randn(3, 2, 16), [seg])
    with pytest.raises(ValueError, match=r"key_mask .* \(2, 33\)"):
        decode_attention(
            torch.randn(2, 2, 16),
            [seg],
            k[:, :, :1],
            k[:, :, :1],
            key_mask=torch.ones(2, 32, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="at least one segment"):
        decode_attention(torch.randn(2, 2, 16), [])
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(torch.randn(2, 2, 16), [seg], num_splits=0)
    with pytest.raises(ValueError, match="kind 'key'"):
        QuantizedKV(seg.values, seg.keys)
