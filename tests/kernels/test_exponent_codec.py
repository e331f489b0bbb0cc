"""Exponent-reuse codec: exactness, byte accounting, fixed-size payloads, Triton vs torch, bad input.

On a machine without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` so that
``impl="triton"`` runs the kernels on CPU tensors (slowly: the Triton tests use small shapes).
"""

import math

import pytest
import torch

from ada_modules.kernels.exponent_codec import (
    HEADER_NBYTES,
    chunk_counts,
    decode,
    decode_from,
    encode,
    encode_into,
    encoded_nbytes,
    extract_exponents,
    payload_nbytes,
    raw_nbytes,
    read_header,
    stream_nbytes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32]
INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
RATES = [0.0, 0.01, 0.1, 0.5, 1.0]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(INT_VIEW[x.dtype])


def _perturbed_cache(x: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    """The exponents of ``x`` with a fraction ``p`` of them replaced by a different value."""
    cache = extract_exponents(x)
    changed = torch.rand(x.numel(), generator=gen) < p
    shift = torch.randint(1, 256, (x.numel(),), generator=gen, dtype=torch.int32)
    other = ((cache.to(torch.int32) + shift) % 256).to(torch.uint8)
    return torch.where(changed.to(cache.device), other.to(cache.device), cache)


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """±0, subnormals, ±Inf, NaNs with several payloads, extremes of the normal range."""
    if dtype == torch.bfloat16:
        patterns = [0x0000, 0x8000, 0x0001, 0x807F, 0x0040, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1]
        patterns += [0x7F81, 0x7FFF, 0xFFFF, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]
        bits = torch.tensor(patterns, dtype=torch.int32)
        return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(dtype)
    patterns = [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00400000, 0x7F800000]
    patterns += [0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF]
    patterns += [0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000, 0x12345678]
    bits = torch.tensor(patterns, dtype=torch.int64)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(dtype)


def _expected_stream_nbytes(changed: torch.Tensor, chunk_size: int) -> int:
    """Per chunk, the cheapest exact form, computed element by element (independent of the codec)."""
    total = 0
    for start in range(0, changed.numel(), chunk_size):
        chunk = changed[start : start + chunk_size]
        length, count = chunk.numel(), int(chunk.sum())
        if count:
            total += min(math.ceil(length / 8) + count, length)
    return total


def _roundtrip(x, cache, chunk_size, impl="torch"):
    payload = encode(x, cache, chunk_size=chunk_size, impl=impl)
    y, new_cache = decode(payload, cache, impl=impl)
    assert torch.equal(_bits(y), _bits(x))
    assert torch.equal(new_cache, extract_exponents(x))
    return payload


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", RATES)
@pytest.mark.parametrize("numel", [1, 1023, 1024, 1025, 3 * 1024, 5001])
def test_roundtrip_is_exact_and_sized_by_the_formula(dtype, p, numel):
    gen = torch.Generator().manual_seed(numel + int(100 * p))
    x = (
        torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-3, 3, (numel,), generator=gen)
    ).to(dtype)
    cache = _perturbed_cache(x, p, gen)
    payload = _roundtrip(x.to(DEVICE), cache.to(DEVICE), chunk_size=1024)

    changed = extract_exponents(x) != cache
    expected_stream = _expected_stream_nbytes(changed, 1024)
    assert read_header(payload).stream_nbytes == expected_stream
    assert payload.numel() == encoded_nbytes(numel, dtype, expected_stream, 1024)
    plane_bytes = {torch.bfloat16: 1, torch.float32: 3}[dtype] * numel
    assert (
        payload.numel()
        == HEADER_NBYTES + 2 * math.ceil(numel / 1024) + plane_bytes + expected_stream
    )
    assert stream_nbytes(chunk_counts(x, cache), numel) == expected_stream


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_values_and_exponent_extremes(dtype):
    gen = torch.Generator().manual_seed(0)
    x = _edge_values(dtype).repeat(40)  # 680+ elements, several chunks of 64
    for cache in (
        torch.zeros(x.numel(), dtype=torch.uint8),
        torch.full((x.numel(),), 0xFF, dtype=torch.uint8),
        torch.randint(0, 256, (x.numel(),), generator=gen, dtype=torch.int32).to(torch.uint8),
        extract_exponents(x),
    ):
        _roundtrip(x, cache, chunk_size=64)


def test_every_bf16_bit_pattern_roundtrips():
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    _roundtrip(x, _perturbed_cache(x, 0.3, gen), chunk_size=256)


def test_random_fp32_bit_patterns_roundtrip():
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-(1 << 31), 1 << 31, (20000,), generator=gen, dtype=torch.int64)
    x = x.to(torch.int32).view(torch.float32)
    _roundtrip(x, _perturbed_cache(x, 0.2, gen), chunk_size=512)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_form_is_chosen_by_exact_size(chunk_size):
    # A chunk with c changes costs min(chunk/8 + c, chunk): BITMAP below the crossover, RAW from it.
    crossover = chunk_size - chunk_size // 8
    x = torch.ones(4 * chunk_size)
    cache = extract_exponents(x)
    for chunk, count in enumerate([0, 1, crossover - 1, crossover]):
        cache[chunk * chunk_size : chunk * chunk_size + count] = 0
    counts = chunk_counts(x, cache, chunk_size)
    assert counts.tolist() == [0, 1, crossover - 1, crossover]
    expected = 0 + (chunk_size // 8 + 1) + (chunk_size // 8 + crossover - 1) + chunk_size
    assert stream_nbytes(counts, x.numel(), chunk_size) == expected
    _roundtrip(x, cache, chunk_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fixed_size_payload_with_spill_is_exact(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2500, generator=gen).to(dtype)
    cache = _perturbed_cache(x, 0.2, gen)
    total = stream_nbytes(chunk_counts(x, cache, 256), x.numel(), 256)
    for capacity in (0, 1, total - 1, total, total + 100):
        buffer, spill = encode_into(x, cache, capacity, chunk_size=256)
        assert buffer.numel() == payload_nbytes(x.numel(), dtype, capacity, 256)
        assert spill.numel() == max(total - capacity, 0)
        y, new_cache = decode_from(buffer, cache, x.numel(), dtype, spill=spill)
        assert torch.equal(_bits(y), _bits(x))
        assert torch.equal(new_cache, extract_exponents(x))
    buffer, spill = encode_into(x, cache, total - 1, chunk_size=256)
    with pytest.raises(ValueError, match="spill must hold the 1 exception bytes"):
        decode_from(buffer, cache, x.numel(), dtype)


def test_decode_into_slices_and_in_place_cache():
    x = torch.randn(3000).bfloat16()
    cache = _perturbed_cache(x, 0.1, torch.Generator().manual_seed(4))
    out = torch.zeros(2, 3000, dtype=torch.bfloat16)
    buffer, spill = encode_into(x, cache, 100)
    y, new_cache = decode_from(
        buffer, cache, 3000, x.dtype, spill=spill, out=out[1], cache_out=cache
    )
    assert y.data_ptr() == out[1].data_ptr() and new_cache is cache
    assert torch.equal(_bits(out[1]), _bits(x)) and not out[0].any()
    assert torch.equal(cache, extract_exponents(x))


def test_empty_shard():
    x = torch.empty(0)
    y, new_cache = decode(encode(x, extract_exponents(x)), extract_exponents(x))
    assert y.numel() == 0 and new_cache.numel() == 0


def test_ratio_bounds_at_full_reuse():
    x = torch.randn(1 << 16)
    for dtype, ceiling in ((torch.bfloat16, 0.5), (torch.float32, 0.75)):
        payload = encode(x.to(dtype), extract_exponents(x.to(dtype)))
        ratio = payload.numel() / raw_nbytes(x.numel(), dtype)
        assert ceiling < ratio < ceiling + 0.002


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", RATES)
def test_triton_matches_reference_bitwise(dtype, p):
    gen = torch.Generator().manual_seed(int(100 * p))
    numel = 333  # odd: a short last chunk of 64
    x = torch.cat(
        [
            _edge_values(dtype),
            torch.randn(numel - 17 - (dtype == torch.float32), generator=gen).to(dtype),
        ]
    )
    cache = _perturbed_cache(x, p, gen)
    x, cache = x.to(DEVICE), cache.to(DEVICE)
    total = stream_nbytes(chunk_counts(x, cache, 64), numel, 64)
    for capacity in (0, total // 2, total + 3):
        ref = encode_into(x, cache, capacity, chunk_size=64, impl="torch")
        tri = encode_into(x, cache, capacity, chunk_size=64, impl="triton")
        assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
        y_ref, c_ref = decode_from(ref[0], cache, numel, dtype, spill=ref[1], impl="torch")
        y_tri, c_tri = decode_from(ref[0], cache, numel, dtype, spill=ref[1], impl="triton")
        assert torch.equal(_bits(y_tri), _bits(x)) and torch.equal(_bits(y_ref), _bits(x))
        assert torch.equal(c_tri, c_ref)
    assert torch.equal(
        encode(x, cache, chunk_size=64, impl="triton"),
        encode(x, cache, chunk_size=64, impl="torch"),
    )


@pytest.mark.triton
def test_triton_default_chunk_size_and_in_place_decode():
    x = torch.randn(2100).to(DEVICE)
    cache = _perturbed_cache(x.cpu(), 0.05, torch.Generator().manual_seed(5)).to(DEVICE)
    buffer, spill = encode_into(x, cache, 16, impl="triton")
    out = torch.empty_like(x)
    decode_from(
        buffer, cache, x.numel(), x.dtype, spill=spill, out=out, cache_out=cache, impl="triton"
    )
    assert torch.equal(_bits(out), _bits(x)) and torch.equal(cache, extract_exponents(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.int32, torch.float64])
def test_unsupported_dtypes_are_named(dtype):
    x = torch.zeros(8, dtype=dtype)
    with pytest.raises(ValueError, match=str(dtype)):
        encode(x, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=str(dtype)):
        payload_nbytes(8, dtype, 0)


def test_bad_cache_chunk_and_capacity():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="cache must have 100 elements"):
        encode(x, torch.zeros(99, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cache must have dtype torch.uint8"):
        encode(x, torch.zeros(100, dtype=torch.int32))
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        encode(x, extract_exponents(x), chunk_size=1000)
    with pytest.raises(ValueError, match="capacity_bytes must be a non-negative int"):
        encode_into(x, extract_exponents(x), -1)


def test_bad_buffers():
    x = torch.randn(100)
    buffer, _ = encode_into(x, extract_exponents(x), 0)
    with pytest.raises(ValueError, match="expected 100 of torch.bfloat16"):
        decode_from(buffer, extract_exponents(x), 100, torch.bfloat16)
    with pytest.raises(ValueError, match="header implies"):
        decode_from(buffer[:-1], extract_exponents(x), 100, torch.float32)
    with pytest.raises(ValueError, match="exponent-codec header"):
        decode_from(torch.zeros_like(buffer), extract_exponents(x), 100, torch.float32)


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        encode(x, extract_exponents(x), impl="triton")


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_decode_with_a_parsed_header(impl):
    x = torch.randn(700).bfloat16()
    cache = _perturbed_cache(x, 0.3, torch.Generator().manual_seed(6))
    buffer, spill = encode_into(x, cache, 50, chunk_size=64)
    header = read_header(buffer[:HEADER_NBYTES].clone())
    y, _ = decode_from(buffer, cache, 700, x.dtype, spill=spill, header=header, impl=impl)
    assert torch.equal(_bits(y), _bits(x))
    with pytest.raises(ValueError, match="expected 700 of torch.float32"):
        decode_from(buffer, cache, 700, torch.float32, spill=spill, header=header, impl=impl)
