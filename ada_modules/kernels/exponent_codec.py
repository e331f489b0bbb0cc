"""Lossless exponent-reuse codec for bf16/fp32 shards (AdERA's all-gather payload).

A float is split into the bits that are always sent (sign and mantissa) and its 8-bit exponent.
The receiver keeps the exponents of the previous gather (the *cache*, one ``uint8`` per element),
so only the exponents that changed since then have to travel. Every bit is rebuilt exactly:
``±0``, subnormals, ``±Inf`` and NaN payloads need no special case (exponents ``0x00`` and ``0xFF``
are ordinary values).

**Planes** (always sent), per element, little-endian bytes:

* bf16 (``s e8 m7``): one byte ``(s << 7) | m7``;
* fp32 (``s e8 m23``): a 2-byte plane with mantissa bits 0–15 (low byte first) followed by a 1-byte
  plane ``(s << 7) | m[22:16]``, i.e. 3 bytes per element.

**Exceptions**, per chunk of ``chunk_size`` elements (a power of two; the last chunk may be shorter,
with ``L`` elements), where ``c`` elements changed their exponent; the chunk is stored in the
cheapest of three exact forms (ties go to the later one):

* ``SAME`` (``c == 0``): 0 bytes;
* ``BITMAP``: ``ceil(L / 8)`` bytes of change bits (bit ``j % 8`` of byte ``j // 8`` is element
  ``j``) followed by the ``c`` new exponents in element order: ``ceil(L / 8) + c`` bytes, used when
  that is less than ``L``;
* ``RAW``: all ``L`` exponents of the chunk: ``L`` bytes.

The chunk's form follows from ``(c, L)``, so a payload stores only ``c`` per chunk (``uint16``),
and the chunks' exception bytes are concatenated into one *stream* of ``E`` bytes.

**Payload layout** (``uint8``)::

    header (32 B) | counts (2 B per chunk) | planes (1 or 3 B per element) | exception area

The header holds a magic byte ``0xAD``, the format version, a dtype code (1 = bf16, 2 = fp32),
``log2(chunk_size)``, then little-endian ``int64`` ``numel``, ``E`` and the capacity of the
exception area. :func:`encode` sizes the exception area exactly (capacity ``E``).
:func:`encode_into` gives a buffer of a *fixed* size, :func:`payload_nbytes`, that every rank can
compute in advance from ``numel``, the dtype and an agreed ``capacity_bytes``: the first
``min(E, capacity)`` stream bytes go into the buffer and the remaining ``max(E - capacity, 0)``
bytes into a separate *spill* tensor, which the caller ships separately (AdERA's all-gather sends
spills in a second, rare all-gather). Decoding with the buffer and its spill is exact.

Each operation has the three parts of the kernel pattern (see :mod:`ada_modules.kernels`):
Triton kernels ``_exponent_*_kernel``, the torch references :func:`encode_into_reference` /
:func:`decode_from_reference` (the specification) and the dispatching :func:`encode_into`,
:func:`decode_from`, :func:`encode` and :func:`decode` (``impl="auto"``). Both work on integer
views of the floats, so the kernels also run under the Triton interpreter.

Examples:
    >>> x = torch.randn(3000).bfloat16()
    >>> cache = extract_exponents(x)  # what every rank holds after the last gather
    >>> y = x * 1.001  # a small update: few exponents change
    >>> payload = encode(y, cache)
    >>> payload.numel() < raw_nbytes(y.numel(), y.dtype)
    True
    >>> z, new_cache = decode(payload, cache)
    >>> torch.equal(z.view(torch.int16), y.view(torch.int16)), torch.equal(new_cache, extract_exponents(y))
    (True, True)
"""

# Triton reads argument annotations as types and specialisations, so kernel arguments stay bare.
# ruff: noqa: ANN001

import math

import torch

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import Impl, resolve_impl, triton_available
from ada_modules.kernels._payload import (
    HEADER_NBYTES,
    PayloadHeader,
    check_buffer,
    check_spill,
    header_bytes,
    parse_header,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HEADER_NBYTES",
    "SUPPORTED_DTYPES",
    "PayloadHeader",
    "chunk_counts",
    "chunk_stream_nbytes",
    "decode",
    "decode_from",
    "decode_from_reference",
    "encode",
    "encode_into",
    "encode_into_reference",
    "encoded_nbytes",
    "extract_exponents",
    "payload_nbytes",
    "raw_nbytes",
    "read_header",
    "stream_nbytes",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
"""Parameter dtypes the codec handles (others have no byte-aligned sign+mantissa split)."""
DEFAULT_CHUNK_SIZE = 1024
"""Elements per exception chunk: 128 bitmap bytes and 2 count bytes per chunk."""

_MAGIC = 0xAD
_PLANE_BYTES = {torch.bfloat16: 1, torch.float32: 3}
_MIN_CHUNK, _MAX_CHUNK = 16, 32768  # count fits a uint16; bitmap rows are whole bytes


# ----------------------------------------------------------------------------------------------
# Argument checks and byte accounting
# ----------------------------------------------------------------------------------------------


def _check_dtype(dtype: torch.dtype, name: str = "x", codec: str = "exponent") -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise InputError(
            f"{name} has dtype {dtype}; the {codec} codec supports only torch.bfloat16 and "
            "torch.float32 (fp16/fp8/integer shards must be sent raw)"
        )


def _check_chunk_size(chunk_size: int) -> None:
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int)
        or not _MIN_CHUNK <= chunk_size <= _MAX_CHUNK
        or chunk_size & (chunk_size - 1)
    ):
        raise InputError(
            f"chunk_size must be a power of two in [{_MIN_CHUNK}, {_MAX_CHUNK}], got {chunk_size!r}"
        )


def _check_nonnegative_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{name} must be a non-negative int, got {value!r}")


def _check_shard_and_cache(x: torch.Tensor, cache: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(cache, torch.Tensor):
        raise InputError(
            f"x and cache must be torch.Tensors, got {type(x).__name__} and {type(cache).__name__}"
        )
    _check_dtype(x.dtype)
    _check_cache(cache, x.numel(), x.device)


def _check_cache(cache: torch.Tensor, numel: int, device: torch.device) -> None:
    if cache.dtype != torch.uint8:
        raise InputError(f"cache must have dtype torch.uint8, got {cache.dtype}")
    if cache.numel() != numel:
        raise InputError(f"cache must have {numel} elements (one per element), got {cache.numel()}")
    if cache.device != device:
        raise InputError(f"cache must be on {device}, got {cache.device}")


def raw_nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of ``numel`` elements of ``dtype`` sent uncompressed.

    Examples:
        >>> raw_nbytes(1000, torch.bfloat16), raw_nbytes(1000, torch.float32)
        (2000, 4000)
    """
    _check_nonnegative_int(numel, "numel")
    return numel * torch.empty((), dtype=dtype).element_size()


def _fixed_nbytes(numel: int, dtype: torch.dtype, chunk_size: int) -> int:
    return HEADER_NBYTES + 2 * math.ceil(numel / chunk_size) + _PLANE_BYTES[dtype] * numel


def encoded_nbytes(
    numel: int, dtype: torch.dtype, stream_nbytes: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> int:
    """Exact bytes of an :func:`encode` payload: header, counts, planes and ``stream_nbytes``.

    Examples:
        >>> encoded_nbytes(4096, torch.bfloat16, stream_nbytes=0)  # 32 + 4 chunks * 2 + 4096
        4136
    """
    _check_nonnegative_int(numel, "numel")
    _check_dtype(dtype, "dtype")
    _check_chunk_size(chunk_size)
    _check_nonnegative_int(stream_nbytes, "stream_nbytes")
    return _fixed_nbytes(numel, dtype, chunk_size) + stream_nbytes


def payload_nbytes(
    numel: int, dtype: torch.dtype, capacity_bytes: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> int:
    """Size of an :func:`encode_into` buffer: known in advance from its arguments alone.

    Examples:
        >>> payload_nbytes(4096, torch.float32, capacity_bytes=512)  # 32 + 8 + 3 * 4096 + 512
        12840
    """
    _check_nonnegative_int(capacity_bytes, "capacity_bytes")
    return encoded_nbytes(numel, dtype, capacity_bytes, chunk_size)


def _chunk_lengths(numel: int, chunk_size: int, device: torch.device) -> torch.Tensor:
    n_chunks = math.ceil(numel / chunk_size)
    lengths = torch.full((n_chunks,), chunk_size, dtype=torch.int64, device=device)
    if n_chunks:
        lengths[-1] = numel - (n_chunks - 1) * chunk_size
    return lengths


def _chunk_layout(
    counts: torch.Tensor, numel: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per chunk: ``(lengths, is_raw, sizes, offsets)`` of the exception stream, all int64."""
    counts = counts.to(torch.int64)
    lengths = _chunk_lengths(numel, chunk_size, counts.device)
    bitmap_size = (lengths + 7) // 8 + counts
    is_raw = (counts > 0) & (bitmap_size >= lengths)
    sizes = torch.where(counts == 0, 0, torch.where(is_raw, lengths, bitmap_size))
    offsets = torch.cumsum(sizes, -1) - sizes
    return lengths, is_raw, sizes, offsets


def chunk_stream_nbytes(
    counts: torch.Tensor, numel: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Exception bytes of each chunk (int64, shaped like ``counts``; leading dims are shards).

    No host synchronisation: use it to size the streams of many shards at once.

    Examples:
        >>> chunk_stream_nbytes(torch.tensor([[0, 3, 1000], [1, 0, 0]]), 2048 + 1000).tolist()
        [[0, 131, 1000], [129, 0, 0]]
    """
    _check_chunk_size(chunk_size)
    n_chunks = math.ceil(numel / chunk_size)
    if counts.shape[-1:] != (n_chunks,):
        raise InputError(
            f"counts must end with a dimension of {n_chunks} chunks, got shape {tuple(counts.shape)}"
        )
    return _chunk_layout(counts, numel, chunk_size)[2]


def stream_nbytes(counts: torch.Tensor, numel: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """Exact exception-stream bytes ``E`` for per-chunk change counts (see :func:`chunk_counts`).

    Examples:
        >>> stream_nbytes(torch.tensor([0, 3, 1000]), 2048 + 1000)  # SAME, BITMAP 128 + 3, RAW 1000
        1131
    """
    return int(chunk_stream_nbytes(counts, numel, chunk_size).sum())


# ----------------------------------------------------------------------------------------------
# Bit fields (torch)
# ----------------------------------------------------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a flat bf16/fp32 tensor as int32 (bf16 zero-extended, fp32 as is)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).to(torch.int32) & 0xFFFF
    return x.view(torch.int32)


def _exponent_shift(dtype: torch.dtype) -> int:
    return 7 if dtype == torch.bfloat16 else 23


def extract_exponents(x: torch.Tensor) -> torch.Tensor:
    """The 8-bit exponent field of every element of a bf16/fp32 tensor, flat, as ``uint8``.

    This is the exponent cache after a gather of ``x``.

    Examples:
        >>> extract_exponents(torch.tensor([1.0, -2.0, 0.0, float("inf")])).tolist()
        [127, 128, 0, 255]
    """
    _check_dtype(x.dtype)
    ints = x.reshape(-1).view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)
    return ((ints >> _exponent_shift(x.dtype)) & 0xFF).to(torch.uint8)


def _changed_positions(changed: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the changed elements (ascending) and per-chunk change counts (int64)."""
    idx = changed.nonzero().squeeze(1)
    n_chunks = math.ceil(changed.numel() / chunk_size)
    return idx, torch.bincount(idx // chunk_size, minlength=n_chunks)


def chunk_counts(
    x: torch.Tensor, cache: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Per chunk, how many elements of ``x`` have an exponent different from ``cache`` (int64).

    Examples:
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0] * 8)
        >>> chunk_counts(x, extract_exponents(x * 2), chunk_size=16).tolist()
        [16, 16]
    """
    _check_shard_and_cache(x, cache)
    _check_chunk_size(chunk_size)
    return _changed_positions(extract_exponents(x) != cache.reshape(-1), chunk_size)[1]


def _rank_in_chunk(chunk_of: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For items sorted by chunk, their index among the items of their chunk."""
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(chunk_of.numel(), device=chunk_of.device) - starts[chunk_of]


def _chunk_cells(
    chunks: torch.Tensor, width: torch.Tensor, cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, col)`` of the first ``width[c]`` cells of each chunk ``c`` in ``chunks`` (row-major)."""
    grid = torch.arange(cols, device=chunks.device)[None, :] < width[chunks][:, None]
    row, col = grid.nonzero(as_tuple=True)
    return chunks[row], col


# ----------------------------------------------------------------------------------------------
# Header
# ----------------------------------------------------------------------------------------------


def _header_bytes(
    numel: int, dtype: torch.dtype, chunk_size: int, stream: torch.Tensor | int, capacity: int
) -> torch.Tensor:
    return header_bytes(_MAGIC, numel, dtype, chunk_size, stream, capacity)


def read_header(buffer: torch.Tensor) -> PayloadHeader:
    """Parse a payload header (one small device-to-host copy).

    Raises:
        ValueError: If ``buffer`` is not a ``uint8`` tensor starting with a valid header.

    Examples:
        >>> x = torch.zeros(100)
        >>> read_header(encode(x, extract_exponents(x)))
        PayloadHeader(numel=100, dtype=torch.float32, chunk_size=1024, stream_nbytes=0, capacity_bytes=0)
    """
    return parse_header(buffer, _MAGIC, "an exponent-codec")


def _check_buffer(
    buffer: torch.Tensor,
    cache: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    header: PayloadHeader | None,
) -> PayloadHeader:
    _check_dtype(dtype, "dtype")
    _check_nonnegative_int(numel, "numel")
    if header is None:
        header = read_header(buffer)
    check_buffer(buffer, numel, dtype, header, payload_nbytes)
    _check_cache(cache, numel, buffer.device)
    return header


def _check_spill(spill: torch.Tensor | None, header: PayloadHeader, device: torch.device) -> None:
    check_spill(spill, header, device, "exception")


def _check_out(out: torch.Tensor | None, numel: int, dtype: torch.dtype, name: str) -> None:
    if out is not None and (out.dtype != dtype or out.numel() != numel or not out.is_contiguous()):
        raise InputError(
            f"{name} must be a contiguous tensor of {numel} elements of {dtype}, got "
            f"{out.numel()} of {out.dtype}"
        )


# ----------------------------------------------------------------------------------------------
# Torch reference (the specification)
# ----------------------------------------------------------------------------------------------


def _planes_reference(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return (((u >> 8) & 0x80) | (u & 0x7F)).to(torch.uint8)
    low = torch.stack([u & 0xFF, (u >> 8) & 0xFF], dim=-1).reshape(-1)
    high = ((u >> 24) & 0x80) | ((u >> 16) & 0x7F)
    return torch.cat([low, high]).to(torch.uint8)


def encode_into_reference(
    x: torch.Tensor,
    cache: torch.Tensor,
    capacity_bytes: int,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` against ``cache`` into a fixed-size buffer and a spill, in plain torch.

    Args:
        x: bf16 or fp32 tensor (flattened).
        cache: ``uint8`` exponents the receivers hold, one per element of ``x``.
        capacity_bytes: Bytes of the buffer's exception area.
        chunk_size: Elements per exception chunk.

    Returns:
        ``(buffer, spill)``: ``buffer`` has :func:`payload_nbytes` bytes; ``spill`` the
        ``max(E - capacity_bytes, 0)`` exception bytes that did not fit.

    Examples:
        >>> x = torch.tensor([1.0, 2.0, 3.0])
        >>> buf, spill = encode_into_reference(x, extract_exponents(x), capacity_bytes=0)
        >>> buf.numel(), spill.numel()  # header + 1 count + 3 * 3 plane bytes
        (43, 0)
    """
    _check_shard_and_cache(x, cache)
    _check_nonnegative_int(capacity_bytes, "capacity_bytes")
    _check_chunk_size(chunk_size)
    numel, dtype, device = x.numel(), x.dtype, x.device
    u = _bits(x.reshape(-1))
    exps = ((u >> _exponent_shift(dtype)) & 0xFF).to(torch.uint8)
    changed = exps != cache.reshape(-1)
    idx, counts = _changed_positions(changed, chunk_size)
    lengths, is_raw, sizes, offsets = _chunk_layout(counts, numel, chunk_size)
    n_bytes = (lengths + 7) // 8
    total = int(sizes.sum())
    stream = torch.zeros(total, dtype=torch.uint8, device=device)
    # RAW chunks: every exponent of the chunk.
    chunk, col = _chunk_cells(is_raw.nonzero().squeeze(1), lengths, chunk_size)
    stream[offsets[chunk] + col] = exps[chunk * chunk_size + col]
    # BITMAP chunks: change bits (bit j % 8 of byte j // 8), then the new exponents in order.
    is_bitmap = (counts > 0) & ~is_raw
    chunk, col = _chunk_cells(is_bitmap.nonzero().squeeze(1), n_bytes, chunk_size // 8)
    padded = torch.nn.functional.pad(changed, (0, -numel % 8)).view(-1, 8).to(torch.int32)
    weights = 1 << torch.arange(8, device=device, dtype=torch.int32)
    bitmap = (padded * weights).sum(1).to(torch.uint8)  # byte k: elements 8k .. 8k + 7
    stream[offsets[chunk] + col] = bitmap[chunk * (chunk_size // 8) + col]
    in_bitmap = is_bitmap[idx // chunk_size]
    idx = idx[in_bitmap]
    chunk = idx // chunk_size
    rank = _rank_in_chunk(chunk, torch.where(is_bitmap, counts, 0))
    stream[offsets[chunk] + n_bytes[chunk] + rank] = exps[idx]

    kept = min(total, capacity_bytes)
    size = payload_nbytes(numel, dtype, capacity_bytes, chunk_size)
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    buffer[:HEADER_NBYTES] = _header_bytes(numel, dtype, chunk_size, total, capacity_bytes).to(
        device
    )
    meta = torch.stack([counts & 0xFF, counts >> 8], dim=-1).reshape(-1).to(torch.uint8)
    pos = HEADER_NBYTES
    buffer[pos : pos + meta.numel()] = meta
    pos += meta.numel()
    planes = _planes_reference(u, dtype)
    buffer[pos : pos + planes.numel()] = planes
    pos += planes.numel()
    buffer[pos : pos + kept] = stream[:kept]
    return buffer, stream[kept:].clone()


_SIGN32 = -(1 << 31)


def decode_from_reference(
    buffer: torch.Tensor,
    cache: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    *,
    spill: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    cache_out: torch.Tensor | None = None,
    header: PayloadHeader | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild the exact shard and its exponents from a buffer, its spill and ``cache``, in torch.

    Args:
        buffer: A payload from :func:`encode_into` or :func:`encode`.
        cache: The ``uint8`` exponents the payload was encoded against.
        numel: Elements of the shard.
        dtype: ``torch.bfloat16`` or ``torch.float32``.
        spill: The spill returned with the buffer (``None`` when it was empty).
        out: Optional contiguous tensor of ``numel`` elements of ``dtype`` to write the shard into.
        cache_out: Optional ``uint8`` tensor for the new exponents; may be ``cache`` itself.
        header: The buffer's header if already parsed (:func:`read_header`), else it is read.

    Returns:
        ``(x, new_cache)``: the flat shard (``out`` when given) and its exponents.

    Examples:
        >>> x = torch.tensor([1.0, -0.0, float("nan")])
        >>> cache = torch.zeros(3, dtype=torch.uint8)
        >>> buffer, spill = encode_into_reference(x, cache, 8)
        >>> y, new_cache = decode_from_reference(buffer, cache, 3, x.dtype, spill=spill)
        >>> y.view(torch.int32).tolist() == x.view(torch.int32).tolist(), new_cache.tolist()
        (True, [127, 0, 255])
    """
    header = _check_buffer(buffer, cache, numel, dtype, header)
    _check_spill(spill, header, buffer.device)
    _check_out(out, numel, dtype, "out")
    _check_out(cache_out, numel, torch.uint8, "cache_out")
    chunk_size, device = header.chunk_size, buffer.device
    n_chunks = math.ceil(numel / chunk_size)
    pos = HEADER_NBYTES
    meta = buffer[pos : pos + 2 * n_chunks].to(torch.int64).view(-1, 2)
    counts = meta[:, 0] | meta[:, 1] << 8
    pos += 2 * n_chunks
    planes = buffer[pos : pos + _PLANE_BYTES[dtype] * numel].to(torch.int32)
    pos += planes.numel()
    kept = min(header.stream_nbytes, header.capacity_bytes)
    stream = (
        buffer[pos : pos + kept] if spill is None else torch.cat([buffer[pos : pos + kept], spill])
    )

    lengths, is_raw, _, offsets = _chunk_layout(counts, numel, chunk_size)
    n_bytes = (lengths + 7) // 8
    exps = cache.reshape(-1).clone()
    # RAW chunks: every exponent of the chunk.
    chunk, col = _chunk_cells(is_raw.nonzero().squeeze(1), lengths, chunk_size)
    exps[chunk * chunk_size + col] = stream[offsets[chunk] + col]
    # BITMAP chunks: unpack the change bits, then take the new exponents in order.
    bitmap_chunks = ((counts > 0) & ~is_raw).nonzero().squeeze(1)
    chunk, col = _chunk_cells(bitmap_chunks, n_bytes, chunk_size // 8)
    byte = stream[offsets[chunk] + col].to(torch.int32)
    bits = (byte[:, None] >> torch.arange(8, device=device, dtype=torch.int32)) & 1
    row, bit = bits.nonzero(as_tuple=True)
    chunk = chunk[row]
    idx = chunk * chunk_size + 8 * col[row] + bit  # ascending: chunks, bytes and bits in order
    rank = _rank_in_chunk(chunk, torch.bincount(chunk, minlength=n_chunks))
    exps[idx] = stream[offsets[chunk] + n_bytes[chunk] + rank]

    e = exps.to(torch.int32)
    if dtype == torch.bfloat16:
        u = ((planes & 0x80) << 8) | (e << 7) | (planes & 0x7F)
        bits_out = u.to(torch.int16)  # keeps the low 16 bits
    else:
        low = planes[: 2 * numel].view(-1, 2)
        high = planes[2 * numel :]
        magnitude = (e << 23) | ((high & 0x7F) << 16) | (low[:, 1] << 8) | low[:, 0]
        sign = torch.tensor(_SIGN32, dtype=torch.int32, device=device)
        bits_out = torch.where((high & 0x80) != 0, magnitude | sign, magnitude)
    x = bits_out.view(dtype)
    if out is not None:
        out.view(-1).copy_(x)
        x = out
    if cache_out is not None:
        cache_out.view(-1).copy_(exps)
        exps = cache_out
    return x, exps


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _load_bits(x_ptr, offs, mask, IS_BF16: tl.constexpr):
        # One return of one dtype (int32): Triton's compiler rejects returns of different dtypes.
        u = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32)
        if IS_BF16:
            u = u & 0xFFFF
        return u

    @triton.jit
    def _exponent_count_kernel(
        x_ptr, cache_ptr, counts_ptr, numel, IS_BF16: tl.constexpr, CHUNK: tl.constexpr
    ):
        chunk = tl.program_id(0).to(tl.int64)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offs < numel
        u = _load_bits(x_ptr, offs, mask, IS_BF16)
        exps = (u >> (7 if IS_BF16 else 23)) & 0xFF
        cached = tl.load(cache_ptr + offs, mask=mask, other=0).to(tl.int32)
        changed = (exps != cached) & mask
        tl.store(counts_ptr + chunk, tl.sum(changed.to(tl.int32), axis=0))

    @triton.jit
    def _store_stream(buf_ptr, spill_ptr, exc_base, capacity, addr, value, mask):
        # Stream byte `addr` lives in the buffer's exception area if it fits, else in the spill.
        in_buf = addr < capacity
        tl.store(buf_ptr + exc_base + addr, value.to(tl.uint8), mask=mask & in_buf)
        tl.store(spill_ptr + (addr - capacity), value.to(tl.uint8), mask=mask & ~in_buf)

    @triton.jit
    def _load_stream(buf_ptr, spill_ptr, exc_base, capacity, addr, mask):
        in_buf = addr < capacity
        a = tl.load(buf_ptr + exc_base + addr, mask=mask & in_buf, other=0)
        b = tl.load(spill_ptr + (addr - capacity), mask=mask & ~in_buf, other=0)
        return tl.where(in_buf, a, b).to(tl.int32)

    @triton.jit
    def _chunk_info(counts_ptr, offsets_ptr, chunk, numel, CHUNK: tl.constexpr):
        count = tl.load(counts_ptr + chunk).to(tl.int64)
        offset = tl.load(offsets_ptr + chunk)
        length = tl.minimum(numel - chunk * CHUNK, CHUNK)
        n_bytes = (length + 7) // 8
        is_raw = (count > 0) & (n_bytes + count >= length)
        is_bitmap = (count > 0) & (n_bytes + count < length)
        return offset, n_bytes, is_raw, is_bitmap

    @triton.jit
    def _exponent_encode_kernel(
        x_ptr,
        cache_ptr,
        counts_ptr,
        offsets_ptr,
        buf_ptr,
        spill_ptr,
        numel,
        plane_base,
        exc_base,
        capacity,
        IS_BF16: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        chunk = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, CHUNK)
        offs = chunk * CHUNK + cols
        mask = offs < numel
        u = _load_bits(x_ptr, offs, mask, IS_BF16)
        if IS_BF16:
            exps = (u >> 7) & 0xFF
            tl.store(
                buf_ptr + plane_base + offs,
                (((u >> 8) & 0x80) | (u & 0x7F)).to(tl.uint8),
                mask=mask,
            )
        else:
            exps = (u >> 23) & 0xFF
            tl.store(buf_ptr + plane_base + 2 * offs, (u & 0xFF).to(tl.uint8), mask=mask)
            tl.store(buf_ptr + plane_base + 2 * offs + 1, ((u >> 8) & 0xFF).to(tl.uint8), mask=mask)
            high = ((u >> 24) & 0x80) | ((u >> 16) & 0x7F)
            tl.store(buf_ptr + plane_base + 2 * numel + offs, high.to(tl.uint8), mask=mask)
        cached = tl.load(cache_ptr + offs, mask=mask, other=0).to(tl.int32)
        changed = ((exps != cached) & mask).to(tl.int32)
        offset, n_bytes, is_raw, is_bitmap = _chunk_info(
            counts_ptr, offsets_ptr, chunk, numel, CHUNK
        )
        _store_stream(buf_ptr, spill_ptr, exc_base, capacity, offset + cols, exps, mask & is_raw)
        bitmap = tl.sum(tl.reshape(changed, (CHUNK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
        byte_cols = tl.arange(0, CHUNK // 8)
        _store_stream(
            buf_ptr,
            spill_ptr,
            exc_base,
            capacity,
            offset + byte_cols,
            bitmap,
            (byte_cols < n_bytes) & is_bitmap,
        )
        rank = tl.cumsum(changed, 0) - changed
        _store_stream(
            buf_ptr,
            spill_ptr,
            exc_base,
            capacity,
            offset + n_bytes + rank,
            exps,
            (changed != 0) & is_bitmap,
        )

    @triton.jit
    def _exponent_decode_kernel(
        buf_ptr,
        spill_ptr,
        cache_ptr,
        counts_ptr,
        offsets_ptr,
        out_ptr,
        cache_out_ptr,
        numel,
        plane_base,
        exc_base,
        capacity,
        IS_BF16: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        chunk = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, CHUNK)
        offs = chunk * CHUNK + cols
        mask = offs < numel
        offset, n_bytes, is_raw, is_bitmap = _chunk_info(
            counts_ptr, offsets_ptr, chunk, numel, CHUNK
        )
        cached = tl.load(cache_ptr + offs, mask=mask, other=0).to(tl.int32)
        raw_exps = _load_stream(
            buf_ptr, spill_ptr, exc_base, capacity, offset + cols, mask & is_raw
        )
        byte = _load_stream(
            buf_ptr, spill_ptr, exc_base, capacity, offset + cols // 8, mask & is_bitmap
        )
        bit = (byte >> (cols % 8)) & 1
        rank = tl.cumsum(bit, 0) - bit
        new_exps = _load_stream(
            buf_ptr, spill_ptr, exc_base, capacity, offset + n_bytes + rank, mask & (bit != 0)
        )
        exps = tl.where(is_raw, raw_exps, tl.where(bit != 0, new_exps, cached))
        if IS_BF16:
            sm = tl.load(buf_ptr + plane_base + offs, mask=mask, other=0).to(tl.int32)
            u = ((sm & 0x80) << 8) | (exps << 7) | (sm & 0x7F)
            bits = tl.where(u >= 32768, u - 65536, u).to(tl.int16)
        else:
            lo = tl.load(buf_ptr + plane_base + 2 * offs, mask=mask, other=0).to(tl.int32)
            mid = tl.load(buf_ptr + plane_base + 2 * offs + 1, mask=mask, other=0).to(tl.int32)
            high = tl.load(buf_ptr + plane_base + 2 * numel + offs, mask=mask, other=0).to(tl.int32)
            magnitude = (exps << 23) | ((high & 0x7F) << 16) | (mid << 8) | lo
            bits = tl.where((high & 0x80) != 0, magnitude - 2147483647 - 1, magnitude)
        tl.store(out_ptr + offs, bits, mask=mask)
        tl.store(cache_out_ptr + offs, exps.to(tl.uint8), mask=mask)


def _int_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def _dummy_spill(spill: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    return (
        spill
        if spill is not None and spill.numel()
        else torch.zeros(1, dtype=torch.uint8, device=device)
    )


def _counts_triton(flat: torch.Tensor, cache: torch.Tensor, chunk_size: int) -> torch.Tensor:
    n_chunks = math.ceil(flat.numel() / chunk_size)
    counts = torch.empty(n_chunks, dtype=torch.int32, device=flat.device)
    if n_chunks:
        _exponent_count_kernel[(n_chunks,)](
            _int_view(flat),
            cache,
            counts,
            flat.numel(),
            IS_BF16=flat.dtype == torch.bfloat16,
            CHUNK=chunk_size,
            num_warps=4,
        )
    return counts


def _encode_into_triton(
    flat: torch.Tensor, cache: torch.Tensor, capacity: int | None, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    numel, dtype, device = flat.numel(), flat.dtype, flat.device
    counts = _counts_triton(flat, cache, chunk_size)
    _, _, sizes, offsets = _chunk_layout(counts, numel, chunk_size)
    total = int(sizes.sum())  # host sync: the spill's length (and, for `encode`, the capacity)
    capacity = total if capacity is None else capacity
    spill_len = max(total - capacity, 0)
    buffer = torch.zeros(
        payload_nbytes(numel, dtype, capacity, chunk_size), dtype=torch.uint8, device=device
    )
    spill = torch.empty(spill_len, dtype=torch.uint8, device=device)
    buffer[:HEADER_NBYTES] = _header_bytes(numel, dtype, chunk_size, total, capacity).to(device)
    meta_end = HEADER_NBYTES + 2 * counts.numel()
    buffer[HEADER_NBYTES:meta_end] = (
        torch.stack([counts & 0xFF, counts >> 8], -1).reshape(-1).to(torch.uint8)
    )
    if counts.numel():
        _exponent_encode_kernel[(counts.numel(),)](
            _int_view(flat),
            cache,
            counts,
            offsets,
            buffer,
            _dummy_spill(spill, device),
            numel,
            meta_end,
            meta_end + _PLANE_BYTES[dtype] * numel,
            capacity,
            IS_BF16=dtype == torch.bfloat16,
            CHUNK=chunk_size,
            num_warps=4,
        )
    return buffer, spill


def _decode_from_triton(
    buffer: torch.Tensor,
    cache: torch.Tensor,
    header: PayloadHeader,
    spill: torch.Tensor | None,
    out: torch.Tensor | None,
    cache_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    numel, dtype, chunk_size, device = header.numel, header.dtype, header.chunk_size, buffer.device
    n_chunks = math.ceil(numel / chunk_size)
    meta = buffer[HEADER_NBYTES : HEADER_NBYTES + 2 * n_chunks].to(torch.int32).view(-1, 2)
    counts = meta[:, 0] | meta[:, 1] << 8
    offsets = _chunk_layout(counts, numel, chunk_size)[3]
    x = out if out is not None else torch.empty(numel, dtype=dtype, device=device)
    new_cache = (
        cache_out if cache_out is not None else torch.empty(numel, dtype=torch.uint8, device=device)
    )
    plane_base = HEADER_NBYTES + 2 * n_chunks
    if n_chunks:
        _exponent_decode_kernel[(n_chunks,)](
            buffer,
            _dummy_spill(spill, device),
            cache,
            counts,
            offsets,
            _int_view(x),
            new_cache,
            numel,
            plane_base,
            plane_base + _PLANE_BYTES[dtype] * numel,
            header.capacity_bytes,
            IS_BF16=dtype == torch.bfloat16,
            CHUNK=chunk_size,
            num_warps=4,
        )
    return x, new_cache


# ----------------------------------------------------------------------------------------------
# Public, dispatching functions
# ----------------------------------------------------------------------------------------------


def encode_into(
    x: torch.Tensor,
    cache: torch.Tensor,
    capacity_bytes: int,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` against ``cache`` into a buffer of a size every rank knows in advance.

    Args:
        x: bf16 or fp32 tensor (flattened; any shape).
        cache: ``uint8`` exponents the receivers hold, one per element of ``x``, same device.
        capacity_bytes: Bytes of the buffer's exception area; exception bytes beyond it go to the
            spill.
        chunk_size: Elements per exception chunk (power of two in [16, 32768]).
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``(buffer, spill)``: ``buffer`` is ``uint8`` with exactly
        ``payload_nbytes(x.numel(), x.dtype, capacity_bytes, chunk_size)`` bytes; ``spill`` holds
        the ``max(E - capacity_bytes, 0)`` stream bytes that did not fit (usually none).

    Raises:
        ValueError: For an unsupported dtype (fp16, fp8, integers), a cache of the wrong dtype,
            length or device, a bad ``capacity_bytes``/``chunk_size``, or an ``impl`` that cannot
            run (see :func:`~ada_modules.kernels.resolve_impl`).

    Examples:
        >>> x = torch.randn(5000)
        >>> buf, spill = encode_into(x, extract_exponents(x), capacity_bytes=64)
        >>> buf.numel() == payload_nbytes(5000, torch.float32, 64), spill.numel()
        (True, 0)
    """
    _check_shard_and_cache(x, cache)
    _check_nonnegative_int(capacity_bytes, "capacity_bytes")
    _check_chunk_size(chunk_size)
    if resolve_impl(impl, x, cache) == "torch":
        return encode_into_reference(x, cache, capacity_bytes, chunk_size=chunk_size)
    return _encode_into_triton(x.reshape(-1), cache.reshape(-1), capacity_bytes, chunk_size)


def decode_from(
    buffer: torch.Tensor,
    cache: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    *,
    spill: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    cache_out: torch.Tensor | None = None,
    header: PayloadHeader | None = None,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rebuild the exact shard and its exponents from an :func:`encode_into` buffer and spill.

    Args:
        buffer: The payload.
        cache: The ``uint8`` exponents the payload was encoded against.
        numel: Elements of the shard.
        dtype: ``torch.bfloat16`` or ``torch.float32``.
        spill: The spill returned with the buffer (``None`` or empty when nothing spilled).
        out: Optional contiguous tensor of ``numel`` elements of ``dtype`` to write the shard into.
        cache_out: Optional ``uint8`` tensor for the new exponents; may be ``cache`` itself.
        header: The buffer's header if the caller already parsed it (e.g. the headers of many
            buffers read with one device-to-host copy); otherwise it is read from ``buffer``.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``(x, new_cache)``: the flat shard (``out`` when given) and its exponents (the updated
        cache; ``cache_out`` when given).

    Raises:
        ValueError: If the header does not match ``numel``/``dtype``, the buffer or spill has the
            wrong size, the cache is wrong, or ``impl`` cannot run.

    Examples:
        >>> x = torch.randn(100).bfloat16()
        >>> cache = torch.zeros(100, dtype=torch.uint8)  # stale cache: every exponent changed
        >>> buf, spill = encode_into(x, cache, capacity_bytes=40)  # too small: 60 bytes spill
        >>> y, _ = decode_from(buf, cache, 100, torch.bfloat16, spill=spill)
        >>> spill.numel(), torch.equal(y.view(torch.int16), x.view(torch.int16))
        (60, True)
    """
    header = _check_buffer(buffer, cache, numel, dtype, header)
    _check_spill(spill if spill is None or spill.numel() else None, header, buffer.device)
    spill = spill if spill is not None and spill.numel() else None
    _check_out(out, numel, dtype, "out")
    _check_out(cache_out, numel, torch.uint8, "cache_out")
    if resolve_impl(impl, buffer, cache) == "torch":
        return decode_from_reference(
            buffer, cache, numel, dtype, spill=spill, out=out, cache_out=cache_out, header=header
        )
    return _decode_from_triton(
        buffer,
        cache.reshape(-1),
        header,
        spill,
        None if out is None else out.view(-1),
        None if cache_out is None else cache_out.view(-1),
    )


def encode(
    x: torch.Tensor,
    cache: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Encode ``x`` against ``cache`` into a payload of exactly :func:`encoded_nbytes` bytes.

    Same arguments as :func:`encode_into` without the capacity: the exception area holds the
    whole stream, so there is never a spill.

    Examples:
        >>> x = torch.randn(2048)
        >>> encode(x, extract_exponents(x)).numel()  # header + 2 counts + 3 bytes per element
        6180
    """
    _check_shard_and_cache(x, cache)
    _check_chunk_size(chunk_size)
    if resolve_impl(impl, x, cache) == "torch":
        total = stream_nbytes(chunk_counts(x, cache, chunk_size), x.numel(), chunk_size)
        return encode_into_reference(x, cache, total, chunk_size=chunk_size)[0]
    return _encode_into_triton(x.reshape(-1), cache.reshape(-1), None, chunk_size)[0]


def decode(
    payload: torch.Tensor,
    cache: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    cache_out: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode an :func:`encode` payload (its header gives the size and dtype).

    Examples:
        >>> x = torch.tensor([0.5, -3.0, float("-inf")])
        >>> y, new_cache = decode(encode(x, torch.zeros(3, dtype=torch.uint8)), torch.zeros(3, dtype=torch.uint8))
        >>> y.tolist(), new_cache.tolist()
        ([0.5, -3.0, -inf], [126, 128, 255])
    """
    header = read_header(payload)
    return decode_from(
        payload, cache, header.numel, header.dtype, out=out, cache_out=cache_out, impl=impl
    )
