"""Value-reuse (delta) codec: the format by hand, exactness of every form, byte accounting checked
element by element, fixed-size payloads with spills, Triton vs torch, bad input.

On a machine without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` so that
``impl="triton"`` runs the kernels on CPU tensors (slowly: the Triton tests use small shapes).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_modules.kernels import delta_codec as dc

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32]
INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
WIDTH = {torch.bfloat16: 16, torch.float32: 32}
EDGE_BITS = {
    # ±0, subnormals, ±Inf, NaNs with payloads, the ends of the normal range, ±1.
    torch.bfloat16: [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7FFF]
    + [0xFFFF, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80],
    torch.float32: [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000]
    + [0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F7FFFFF, 0x3F800000],
}


def _from_bits(bits: list[int] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    width = WIDTH[dtype]
    b = torch.as_tensor(bits, dtype=torch.int64) % (1 << width)
    signed = torch.where(b >= 1 << (width - 1), b - (1 << width), b)
    return signed.to(INT_VIEW[dtype]).view(dtype)


def _to_bits(x: torch.Tensor) -> list[int]:
    width = WIDTH[x.dtype]
    return [v % (1 << width) for v in x.reshape(-1).view(INT_VIEW[x.dtype]).tolist()]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(INT_VIEW[a.dtype]), b.reshape(-1).view(INT_VIEW[b.dtype]))


def _expected_sizes(x: torch.Tensor, cache: torch.Tensor, chunk_size: int) -> list[list[int]]:
    """Every form's bytes per chunk, from the format's description, element by element in Python."""
    width = WIDTH[x.dtype]
    zs = []
    for u, c in zip(_to_bits(x), _to_bits(cache), strict=True):
        d = (u - c) % (1 << width)
        d = d - (1 << width) if d >= 1 << (width - 1) else d
        zs.append(2 * d if d >= 0 else -2 * d - 1)
    rows = []
    for start in range(0, len(zs), chunk_size):
        chunk = zs[start : start + chunk_size]
        length = len(chunk)
        same = 0 if not any(chunk) else -1
        row = [same, length * width // 8]
        for k in range(width + 1):
            m = [(z >> k).bit_length() for z in chunk]
            size = k * math.ceil(length / 8)
            size += sum(math.ceil(sum(v >= j for v in m) / 8) for j in range(width - k))
            size += sum(math.ceil(sum(v >= j for v in m) / 8) for j in range(2, width - k + 1))
            row.append(size)
        rows.append(row)
    return rows


def _nudged(x: torch.Tensor, gen: torch.Generator, spread: int) -> torch.Tensor:
    """``x`` with each element's bits moved by a random integer in ``[-spread, spread]``."""
    bits = torch.tensor(_to_bits(x), dtype=torch.int64)
    step = torch.randint(-spread, spread + 1, (x.numel(),), generator=gen)
    return _from_bits(bits + step, x.dtype)


def _cases(
    dtype: torch.dtype, numel: int, seed: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    base = (0.02 * torch.randn(numel, generator=gen)).to(dtype)
    edges = _from_bits(EDGE_BITS[dtype], dtype)
    flipped = base.clone()
    flipped[::5] = -flipped[::5]
    return {
        "unchanged": (base, base.clone()),
        "small moves": (_nudged(base, gen, 3), base),
        "sign flips": (flipped, base),
        "edge values": (torch.cat([edges, base[: numel - edges.numel()]]), _nudged(base, gen, 2)),
        "unrelated": (base, (torch.randn(numel, generator=gen) * 1e3).to(dtype)),
    }


def test_a_hand_encoded_chunk():
    # 16 bf16 elements; element 0 moved up by one unit (z = 2), element 3 down by one (z = 1).
    cache = torch.linspace(1, 2, 16).bfloat16()
    bits = _to_bits(cache)
    bits[0] += 1
    bits[3] -= 1
    x = _from_bits(bits, torch.bfloat16)
    payload = dc.encode(x, cache, chunk_size=16)
    # EG(0): U_0 over all 16 (elements 0 and 3 set) = [0b1001, 0]; U_1 over {0, 3}: element 0 has
    # m = 2 > 1 = [0b01]; U_2 over {0}: m > 2 is false = [0]; M_2 over {0}: bit 0 of q = 2 = [0].
    # EG(1) also takes 5 bytes (low plane [0b1000, 0], U_0 [1, 0], U_1 [0]): the lower k wins.
    word = payload[dc.HEADER_NBYTES : dc.HEADER_NBYTES + 4].tolist()
    assert word == [5, 0, 0, 2]  # size 5, form 2 + k with k = 0
    assert payload[dc.HEADER_NBYTES + 4 :].tolist() == [0b1001, 0, 0b01, 0, 0]
    assert dc.form_sizes(x, cache, chunk_size=16)[0, :4].tolist() == [-1, 32, 5, 5]
    assert _same_bits(dc.decode(payload, cache), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_size", [16, 64, 1024])
def test_roundtrip_is_exact_and_sizes_match_an_element_by_element_count(dtype, chunk_size):
    for name, (x, cache) in _cases(dtype, 203, seed=chunk_size).items():
        sizes = dc.form_sizes(x, cache, chunk_size)
        assert sizes.tolist() == _expected_sizes(x, cache, chunk_size), name
        payload = dc.encode(x, cache, chunk_size=chunk_size)
        forms = dc.chunk_forms(x, cache, chunk_size)
        assert payload.numel() == dc.encoded_nbytes(203, dtype, int(forms.size.sum()), chunk_size)
        assert _same_bits(dc.decode(payload, cache), x), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_encoder_picks_the_smallest_form_of_each_chunk(dtype):
    for name, (x, cache) in _cases(dtype, 640, seed=3).items():
        sizes = dc.form_sizes(x, cache, 64)
        forms = dc.chunk_forms(x, cache, 64)
        valid = torch.where(sizes < 0, torch.iinfo(torch.int64).max, sizes)
        assert torch.equal(forms.size, valid.min(1).values), name
        assert torch.equal(valid.gather(1, forms.form[:, None]).squeeze(1), forms.size), name
    x, cache = _cases(dtype, 640, seed=3)["small moves"]
    assert (dc.chunk_forms(x, cache, 64).form >= 2).all()  # Exp-Golomb beats RAW on small moves


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_form_roundtrips_and_has_its_stated_size(dtype):
    width = WIDTH[dtype]
    for name, (x, cache) in _cases(dtype, 100, seed=4).items():
        u, c = dc._bits(x), dc._bits(cache)
        z = dc._zigzag_delta(u, c, width)
        sizes = dc.form_sizes(x, cache, 32)
        for form in range(1, width + 3):
            forms = dc.ChunkForms(torch.full((4,), form), sizes[:, form])
            stream = dc._encode_stream(z, u, forms, 32, width)
            assert stream.numel() == int(sizes[:, form].sum()), (name, form)
            z_back, raw, raw_bits = dc._decode_stream(stream, forms, 100, 32, width)
            rebuilt = torch.where(raw, raw_bits, dc._undo_zigzag_delta(z_back, c, width))
            assert torch.equal(rebuilt, u), (name, form)


def test_every_bf16_bit_pattern_roundtrips():
    x = _from_bits(list(range(1 << 16)), torch.bfloat16)
    for cache in (x.roll(1), _from_bits([0x3F80] * (1 << 16), torch.bfloat16)):
        assert _same_bits(dc.decode(dc.encode(x, cache), cache), x)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
    chunk_size=st.sampled_from([16, 32, 64]),
    capacity_fraction=st.floats(0, 1.2),
)
def test_fuzzed_bit_patterns_with_spills(dtype, data, chunk_size, capacity_fraction):
    width = WIDTH[dtype]
    pattern = st.one_of(st.integers(0, (1 << width) - 1), st.sampled_from(EDGE_BITS[dtype]))
    numel = data.draw(st.integers(1, 150))
    cache_bits = data.draw(st.lists(pattern, min_size=numel, max_size=numel))
    moves = data.draw(
        st.lists(
            st.one_of(st.integers(-4, 4), st.integers(-(1 << width), 1 << width)),
            min_size=numel,
            max_size=numel,
        )
    )
    cache = _from_bits(cache_bits, dtype)
    x = _from_bits([c + m for c, m in zip(cache_bits, moves, strict=True)], dtype)
    total = int(dc.chunk_forms(x, cache, chunk_size).size.sum())
    capacity = int(capacity_fraction * total)
    buffer, spill = dc.encode_into(x, cache, capacity, chunk_size=chunk_size)
    assert buffer.numel() == dc.payload_nbytes(numel, dtype, capacity, chunk_size)
    assert spill.numel() == max(total - capacity, 0)
    assert _same_bits(dc.decode_from(buffer, cache, numel, dtype, spill=spill), x)


def test_decode_in_place_into_the_cache_and_empty_shards():
    cache = torch.randn(300)
    x = cache + 1e-6 * torch.randn(300)
    buffer, spill = dc.encode_into(x, cache, 16)
    kept = cache.clone()
    out = dc.decode_from(buffer, cache, 300, torch.float32, spill=spill, out=cache)
    assert out.data_ptr() == cache.data_ptr() and _same_bits(cache, x) and not _same_bits(kept, x)
    empty = torch.zeros(0, dtype=torch.bfloat16)
    assert dc.decode(dc.encode(empty, empty), empty).numel() == 0


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_reference_bitwise(dtype):
    numel = 90  # a short last chunk of 26
    for name, (x, cache) in _cases(dtype, numel, seed=9).items():
        x, cache = x.to(DEVICE), cache.to(DEVICE)
        total = int(dc.chunk_forms(x, cache, 64).size.sum())
        for capacity in (total // 2, total + 3):
            ref = dc.encode_into(x, cache, capacity, chunk_size=64, impl="torch")
            tri = dc.encode_into(x, cache, capacity, chunk_size=64, impl="triton")
            assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1]), (name, capacity)
            y = dc.decode_from(ref[0], cache, numel, dtype, spill=ref[1], impl="triton")
            assert _same_bits(y, x), (name, capacity)
    assert torch.equal(
        dc.encode(x, cache, chunk_size=64, impl="triton"),
        dc.encode(x, cache, chunk_size=64, impl="torch"),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32, torch.float64])
def test_unsupported_dtypes_are_named(dtype):
    x = torch.zeros(8, dtype=dtype)
    with pytest.raises(ValueError, match=str(dtype)):
        dc.encode(x, x)


def test_bad_cache_chunk_and_capacity():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="cache must hold the previous values in the shard's"):
        dc.encode(x, x.bfloat16())
    with pytest.raises(ValueError, match="cache must have 100 elements"):
        dc.encode(x, x[:99])
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        dc.encode(x, x, chunk_size=1000)
    with pytest.raises(ValueError, match="capacity_bytes must be a non-negative int"):
        dc.encode_into(x, x, -1)


def test_bad_buffers_and_spills():
    cache = torch.randn(100)
    x = -cache
    buffer, spill = dc.encode_into(x, cache, 10)
    with pytest.raises(ValueError, match="expected 100 of torch.bfloat16"):
        dc.decode_from(buffer, cache.bfloat16(), 100, torch.bfloat16, spill=spill)
    with pytest.raises(ValueError, match="header implies"):
        dc.decode_from(buffer[:-1], cache, 100, torch.float32, spill=spill)
    with pytest.raises(ValueError, match="delta-codec header"):
        dc.decode_from(torch.zeros_like(buffer), cache, 100, torch.float32)
    with pytest.raises(ValueError, match=f"spill must hold the {spill.numel()} stream bytes"):
        dc.decode_from(buffer, cache, 100, torch.float32, spill=spill[:-1])
    kept = cache.clone()
    with pytest.raises(ValueError, match="spill must hold"):
        dc.decode_from(buffer, cache, 100, torch.float32, out=cache)
    assert torch.equal(cache, kept)  # nothing half-written
