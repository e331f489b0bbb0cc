"""Lossless value-reuse codec for bf16/fp32 shards: small integer deltas in Exp-Golomb bit planes.

The receiver keeps the whole previous value of every element (the *cache*, same dtype as the
shard), so only how each element's bits moved has to travel. Between two optimizer steps most
elements move by a few units in the last place or not at all: their bit patterns, read as
``B``-bit unsigned integers (``B`` = 16 for bf16, 32 for fp32), differ by a small number. Every bit
is rebuilt exactly (``±0``, subnormals, ``±Inf`` and NaN payloads are ordinary bit patterns).

**Per element**: ``d = (bits(x) - bits(cache)) mod 2**B`` read as a signed ``B``-bit integer, then
zigzagged to ``z = 2d`` (``d >= 0``) or ``-2d - 1``, so ``0 <= z < 2**B`` and small moves either
way give small ``z``. ``l(z)`` is the bit length of ``z`` (0 for ``z = 0``).

**Per chunk** of ``chunk_size`` elements (a power of two; the last chunk may hold ``L < chunk``),
the cheapest of these exact forms, chosen from the chunk's histogram of ``l``:

* ``SAME`` (every ``z = 0``): 0 bytes;
* ``RAW``: the ``L`` new values, ``B / 8`` little-endian bytes each;
* ``EG(k)`` for ``k`` in ``[0, B]``: Exp-Golomb of order ``k``, stored as *bit planes*, each a bit
  array (bit ``i % 8`` of byte ``i // 8`` is its ``i``-th entry) padded to whole bytes, in order:

  1. ``k`` planes of the low bits of ``z``, plane ``b`` holding bit ``b`` of every element;
  2. with ``q = z >> k`` and ``m = l(q)``, the *unary* planes ``U_j`` for ``j = 0, 1, ...,
     B - k - 1`` while ``S_j = {elements with m >= j}`` is not empty: one entry per element of
     ``S_j``, in element order, set when ``m > j``;
  3. the *mantissa* planes ``M_j`` for ``j = 2, ..., B - k`` while ``S_j`` is not empty: one entry
     per element of ``S_j``, in element order, holding bit ``j - 2`` of ``q`` (the bits below
     ``q``'s leading one).

  An element costs ``k + 1`` bits if ``q = 0`` and ``k + 2m`` bits otherwise (``m < B - k``), so
  a chunk whose elements mostly moved by a few units costs a few bits per element.

The decoder learns the sizes of the ``U`` planes as it reads them (``|S_{j+1}|`` is the number of
entries set in ``U_j``), so a chunk stores only its form and its byte size: one little-endian
``uint32`` per chunk, ``form << 24 | size`` with form 0 = ``SAME``, 1 = ``RAW``, ``2 + k`` =
``EG(k)``. Ties go to the lowest ``k``, and to ``RAW`` when ``EG`` is not strictly smaller.

**Payload layout** (``uint8``)::

    header (32 B) | chunk words (4 B per chunk) | stream area

The header holds a magic byte ``0xDE``, the format version, a dtype code (1 = bf16, 2 = fp32),
``log2(chunk_size)``, then little-endian ``int64`` ``numel``, the stream bytes ``E`` and the
capacity of the stream area. The capacity/spill protocol is the exponent codec's
(:mod:`ada_modules.kernels.exponent_codec`): :func:`encode_into` fills a buffer of a size every
rank knows in advance (:func:`payload_nbytes`) and returns the stream bytes beyond the capacity as
a separate *spill*; :func:`encode` sizes the stream area exactly.

The torch functions :func:`encode_into_reference` / :func:`decode_from_reference` are the
specification; :func:`encode_into`, :func:`decode_from`, :func:`encode` and :func:`decode`
dispatch (``impl="auto"``: the Triton kernels on CUDA tensors, the reference otherwise).

Examples:
    >>> cache = (0.02 * torch.randn(4096)).bfloat16()  # every rank holds the last gathered value
    >>> x = (cache.float() - 1e-4 * torch.randn(4096).sign()).bfloat16()  # one optimizer step
    >>> payload = encode(x, cache)
    >>> payload.numel() < 0.5 * raw_nbytes(x.numel(), x.dtype)
    True
    >>> torch.equal(decode(payload, cache).view(torch.int16), x.view(torch.int16))
    True
"""

# Triton reads argument annotations as types and specialisations, so kernel arguments stay bare.
# ruff: noqa: ANN001

import math
from typing import NamedTuple

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
from ada_modules.kernels.exponent_codec import (
    SUPPORTED_DTYPES,
    _check_chunk_size,
    _check_dtype,
    _check_nonnegative_int,
    _check_out,
    _chunk_lengths,
    _dummy_spill,
    _int_view,
    raw_nbytes,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HEADER_NBYTES",
    "SUPPORTED_DTYPES",
    "ChunkForms",
    "PayloadHeader",
    "chunk_forms",
    "decode",
    "decode_from",
    "decode_from_reference",
    "encode",
    "encode_into",
    "encode_into_reference",
    "encoded_nbytes",
    "form_sizes",
    "payload_nbytes",
    "raw_nbytes",
    "read_header",
]

DEFAULT_CHUNK_SIZE = 1024
"""Elements per chunk: one 4-byte chunk word per 1024 elements."""
SAME, RAW = 0, 1
"""Chunk form codes; ``EG(k)`` is ``2 + k``."""

_MAGIC = 0xDE
_WIDTH = {torch.bfloat16: 16, torch.float32: 32}


class ChunkForms(NamedTuple):
    """Per chunk: the chosen ``form`` code and its stream ``size`` in bytes (int64 tensors)."""

    form: torch.Tensor
    size: torch.Tensor

    @property
    def offsets(self) -> torch.Tensor:
        """Where each chunk's bytes start in the stream (exclusive prefix sum of ``size``)."""
        return torch.cumsum(self.size, 0) - self.size


# ----------------------------------------------------------------------------------------------
# Argument checks and byte accounting
# ----------------------------------------------------------------------------------------------


def _check_shard_and_cache(x: torch.Tensor, cache: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(cache, torch.Tensor):
        raise InputError(
            f"x and cache must be torch.Tensors, got {type(x).__name__} and {type(cache).__name__}"
        )
    _check_dtype(x.dtype, codec="delta")
    _check_cache(cache, x.numel(), x.dtype, x.device)


def _check_cache(cache: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> None:
    if cache.dtype != dtype:
        raise InputError(
            f"cache must hold the previous values in the shard's dtype {dtype}, got {cache.dtype}"
        )
    if cache.numel() != numel:
        raise InputError(f"cache must have {numel} elements (one per element), got {cache.numel()}")
    if cache.device != device:
        raise InputError(f"cache must be on {device}, got {cache.device}")


def encoded_nbytes(
    numel: int, dtype: torch.dtype, stream_nbytes: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> int:
    """Exact bytes of a payload: header, chunk words and ``stream_nbytes``.

    Examples:
        >>> encoded_nbytes(4096, torch.bfloat16, stream_nbytes=0)  # 32 + 4 chunks * 4
        48
    """
    _check_nonnegative_int(numel, "numel")
    _check_dtype(dtype, "dtype", codec="delta")
    _check_chunk_size(chunk_size)
    _check_nonnegative_int(stream_nbytes, "stream_nbytes")
    return HEADER_NBYTES + 4 * math.ceil(numel / chunk_size) + stream_nbytes


def payload_nbytes(
    numel: int, dtype: torch.dtype, capacity_bytes: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> int:
    """Size of an :func:`encode_into` buffer: known in advance from its arguments alone.

    Examples:
        >>> payload_nbytes(4096, torch.float32, capacity_bytes=512)  # 32 + 16 + 512
        560
    """
    _check_nonnegative_int(capacity_bytes, "capacity_bytes")
    return encoded_nbytes(numel, dtype, capacity_bytes, chunk_size)


# ----------------------------------------------------------------------------------------------
# Element transform (torch)
# ----------------------------------------------------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a flat bf16/fp32 tensor as non-negative int64."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).to(torch.int64) & 0xFFFF
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _zigzag_delta(u: torch.Tensor, c: torch.Tensor, width: int) -> torch.Tensor:
    d = (u - c) % (1 << width)
    return torch.where(d >= 1 << (width - 1), 2 * ((1 << width) - d) - 1, 2 * d)


def _undo_zigzag_delta(z: torch.Tensor, c: torch.Tensor, width: int) -> torch.Tensor:
    d = torch.where(z % 2 == 1, -((z + 1) // 2), z // 2)
    return (c + d) % (1 << width)


def _bit_length(z: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative int64 values below 2**33 (exact through float64)."""
    return torch.frexp(z.to(torch.float64)).exponent.to(torch.int64)


def _from_bits(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.where(u >= 1 << 15, u - (1 << 16), u).to(torch.int16).view(dtype)
    return torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32).view(dtype)


# ----------------------------------------------------------------------------------------------
# Form sizes
# ----------------------------------------------------------------------------------------------


def _level_counts(tail: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``counts[c, k, j] = |S_j|`` of chunk ``c`` under ``EG(k)``, for ``j`` in ``[0, width]``.

    ``tail[c, i]`` is the number of elements of chunk ``c`` with ``l(z) >= i`` (``i`` in
    ``[0, width]``); ``m >= j`` iff ``l >= j + k`` for ``j >= 1``, and ``S_0`` is every element.
    """
    ks = torch.arange(width + 1, device=tail.device)
    js = torch.arange(width + 1, device=tail.device)
    idx = ks[:, None] + js[None, :]
    padded = torch.cat([tail, torch.zeros_like(tail)], dim=1)  # tail is 0 beyond width
    counts = padded[:, idx]  # (chunks, k, j)
    counts[:, :, 0] = lengths[:, None]
    return counts


def _plane_sizes(counts: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes of every plane, ``(chunks, k, 3 * width + 1)``: the ``width`` low-bit slots, the
    ``width`` unary slots ``U_0 .. U_{width-1}`` and the ``width + 1`` mantissa slots
    ``M_0 .. M_width`` (``M_0``, ``M_1`` and the slots a form does not use are 0)."""
    ks = torch.arange(width + 1, device=counts.device)
    slot = torch.arange(width, device=counts.device)
    row = (lengths[:, None, None] + 7) // 8
    low = torch.where(slot[None, None, :] < ks[None, :, None], row, 0)  # (chunks, k, width)
    nbytes = (counts + 7) // 8
    unary = torch.where(slot[None, None, :] < width - ks[None, :, None], nbytes[:, :, :width], 0)
    level = torch.arange(width + 1, device=counts.device)
    mantissa = torch.where(
        (level[None, None, :] >= 2) & (level[None, None, :] <= width - ks[None, :, None]),
        nbytes,
        0,
    )
    return torch.cat([low, unary, mantissa], dim=2)


def _chunk_tails(z: torch.Tensor, numel: int, chunk_size: int, width: int) -> torch.Tensor:
    """``tail[c, i]``: elements of chunk ``c`` with ``l(z) >= i``, ``i`` in ``[0, width]``."""
    n_chunks = math.ceil(numel / chunk_size)
    chunk = torch.arange(numel, device=z.device) // chunk_size
    hist = torch.bincount(chunk * (width + 1) + _bit_length(z), minlength=n_chunks * (width + 1))
    hist = hist.view(n_chunks, width + 1)
    return hist.flip(1).cumsum(1).flip(1)


def _sizes_from_tails(tail: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes of every form per chunk, ``(chunks, width + 3)``: ``SAME``, ``RAW``, ``EG(0..width)``
    (``SAME`` is ``-1``, i.e. impossible, unless every ``z`` is 0)."""
    counts = _level_counts(tail, lengths, width)
    eg = _plane_sizes(counts, lengths, width).sum(2)
    same = torch.where(tail[:, 1] == 0, 0, -1)
    raw = lengths * (width // 8)
    return torch.cat([same[:, None], raw[:, None], eg], dim=1)


def form_sizes(
    x: torch.Tensor, cache: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Exact stream bytes of every form for every chunk of ``x`` against ``cache``.

    Returns:
        int64 ``(chunks, B + 3)``: column 0 ``SAME`` (0 bytes, or ``-1`` where some element moved),
        column 1 ``RAW``, column ``2 + k`` ``EG(k)``.

    Examples:
        >>> x = torch.ones(64)
        >>> form_sizes(x, x, chunk_size=64)[0, :4].tolist()  # SAME, RAW, EG(0), EG(1)
        [0, 256, 8, 16]
    """
    _check_shard_and_cache(x, cache)
    _check_chunk_size(chunk_size)
    width = _WIDTH[x.dtype]
    z = _zigzag_delta(_bits(x.reshape(-1)), _bits(cache.reshape(-1)), width)
    lengths = _chunk_lengths(x.numel(), chunk_size, x.device)
    return _sizes_from_tails(_chunk_tails(z, x.numel(), chunk_size, width), lengths, width)


def _choose(sizes: torch.Tensor) -> ChunkForms:
    """The smallest form per chunk: ``SAME`` if possible, else the lowest-``k`` smallest ``EG``
    if strictly below ``RAW``, else ``RAW``."""
    eg = sizes[:, 2:]
    best, k = eg.min(1)  # min returns the first (lowest k) of equal values
    form = torch.where(best < sizes[:, 1], 2 + k, RAW)
    form = torch.where(sizes[:, 0] == 0, SAME, form)
    size = torch.where(form == SAME, 0, torch.where(form == RAW, sizes[:, 1], best))
    return ChunkForms(form, size)


def chunk_forms(
    x: torch.Tensor, cache: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> ChunkForms:
    """The form the encoder picks for each chunk and its stream bytes.

    Examples:
        >>> x = torch.arange(64.0)
        >>> chunk_forms(x, x, chunk_size=64).form.tolist(), chunk_forms(x, -x, chunk_size=64).form.tolist()
        ([0], [1])
    """
    return _choose(form_sizes(x, cache, chunk_size))


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
        >>> read_header(encode(x, x))
        PayloadHeader(numel=100, dtype=torch.float32, chunk_size=1024, stream_nbytes=0, capacity_bytes=0)
    """
    return parse_header(buffer, _MAGIC, "a delta-codec")


def _check_buffer(
    buffer: torch.Tensor,
    cache: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    header: PayloadHeader | None,
) -> PayloadHeader:
    _check_dtype(dtype, "dtype", codec="delta")
    _check_nonnegative_int(numel, "numel")
    if header is None:
        header = read_header(buffer)
    check_buffer(buffer, numel, dtype, header, payload_nbytes)
    _check_cache(cache, numel, dtype, buffer.device)
    return header


def _check_spill(spill: torch.Tensor | None, header: PayloadHeader, device: torch.device) -> None:
    check_spill(spill, header, device, "stream")


def _chunk_words(forms: ChunkForms) -> torch.Tensor:
    word = forms.form << 24 | forms.size
    return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1).reshape(-1)


def _read_chunk_words(buffer: torch.Tensor, n_chunks: int) -> ChunkForms:
    raw = buffer[HEADER_NBYTES : HEADER_NBYTES + 4 * n_chunks].to(torch.int64).view(-1, 4)
    word = raw[:, 0] | raw[:, 1] << 8 | raw[:, 2] << 16 | raw[:, 3] << 24
    return ChunkForms(word >> 24, word & 0xFFFFFF)


# ----------------------------------------------------------------------------------------------
# Torch reference (the specification)
# ----------------------------------------------------------------------------------------------


class _Planes:
    """Where the planes of each chunk start, as the encoder and decoder walk them (torch).

    Each :meth:`place` puts one plane in every chunk that has entries in it (the elements
    ``idx``, ascending), right after the chunk's previous plane, and returns each entry's bit
    position in the stream.
    """

    def __init__(self, cursor: torch.Tensor, chunk_size: int) -> None:
        self.cursor = cursor.clone()  # byte where each chunk's next plane starts
        self.chunk_size = chunk_size

    def place(self, idx: torch.Tensor) -> torch.Tensor:
        chunk = idx // self.chunk_size
        count = torch.bincount(chunk, minlength=self.cursor.numel())
        rank = (
            torch.arange(idx.numel(), device=idx.device) - (torch.cumsum(count, 0) - count)[chunk]
        )
        bit = 8 * self.cursor[chunk] + rank
        self.cursor += (count + 7) // 8
        return bit

    def place_low_bits(self, k: torch.Tensor, lengths: torch.Tensor) -> list:
        """The ``k`` full planes of each ``EG(k)`` chunk: per plane ``b``, the elements of the
        chunks with ``k > b`` and their bit positions."""
        k_of = k.repeat_interleave(lengths)
        idx = (k_of > 0).nonzero().squeeze(1)
        chunk = idx // self.chunk_size
        row = (lengths + 7) // 8
        base = 8 * self.cursor[chunk] + idx - chunk * self.chunk_size
        planes = []
        b = 0
        while idx.numel():
            planes.append((idx, base + 8 * b * row[chunk]))
            deeper = k_of[idx] > b + 1
            idx, chunk, base = idx[deeper], chunk[deeper], base[deeper]
            b += 1
        self.cursor += k.clamp(min=0) * row
        return planes


def _stream_layout(forms: ChunkForms, numel: int, chunk_size: int) -> tuple[torch.Tensor, ...]:
    """``(offsets, lengths, k)``: per chunk its stream offset, its elements and its ``EG`` order
    (``-1`` for ``SAME``/``RAW``)."""
    offsets = forms.offsets
    lengths = _chunk_lengths(numel, chunk_size, forms.form.device)
    k = torch.where(forms.form >= 2, forms.form - 2, -1)
    return offsets, lengths, k


def _raw_positions(
    forms: ChunkForms, offsets: torch.Tensor, lengths: torch.Tensor, chunk_size: int, nbytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements of ``RAW`` chunks and where their first byte is in the stream."""
    idx = (forms.form == RAW).repeat_interleave(lengths).nonzero().squeeze(1)
    chunk = idx // chunk_size
    return idx, offsets[chunk] + nbytes * (idx - chunk * chunk_size)


def _encode_stream(
    z: torch.Tensor, u: torch.Tensor, forms: ChunkForms, chunk_size: int, width: int
) -> torch.Tensor:
    """The stream bytes of every chunk in its given form (torch)."""
    numel, device = z.numel(), z.device
    offsets, lengths, k = _stream_layout(forms, numel, chunk_size)
    bits = torch.zeros(8 * int(forms.size.sum()), dtype=torch.uint8, device=device)
    planes = _Planes(offsets, chunk_size)
    for b, (element, pos) in enumerate(planes.place_low_bits(k, lengths)):
        bits[pos] = ((z[element] >> b) & 1).to(torch.uint8)
    k_of = k.repeat_interleave(lengths)
    idx = (k_of >= 0).nonzero().squeeze(1)
    q = z >> k_of.clamp(min=0)
    m = _bit_length(q)
    mantissa = idx[m[idx] >= 2]
    for j in range(width):  # unary planes: U_j over S_j = {m >= j}, where j < width - k
        idx = idx[j < width - k_of[idx]]
        if not idx.numel():
            break
        above = m[idx] > j
        bits[planes.place(idx)] = above.to(torch.uint8)
        idx = idx[above]
    for j in range(2, width + 1):  # mantissa planes: M_j over S_j, bit j - 2 of q
        if not mantissa.numel():
            break
        bits[planes.place(mantissa)] = ((q[mantissa] >> (j - 2)) & 1).to(torch.uint8)
        mantissa = mantissa[m[mantissa] > j]
    weights = (1 << torch.arange(8, device=device)).to(torch.uint8)
    stream = (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8)
    nbytes = width // 8
    idx, start = _raw_positions(forms, offsets, lengths, chunk_size, nbytes)
    for byte in range(nbytes):
        stream[start + byte] = ((u[idx] >> (8 * byte)) & 0xFF).to(torch.uint8)
    return stream


def _decode_stream(
    stream: torch.Tensor, forms: ChunkForms, numel: int, chunk_size: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z, raw_mask, raw_bits)`` of every element from the stream (torch)."""
    device = stream.device
    offsets, lengths, k = _stream_layout(forms, numel, chunk_size)
    bits = ((stream[:, None] >> torch.arange(8, device=device, dtype=torch.uint8)) & 1).reshape(-1)
    bits = bits.to(torch.int64)
    planes = _Planes(offsets, chunk_size)
    low = torch.zeros(numel, dtype=torch.int64, device=device)
    for b, (element, pos) in enumerate(planes.place_low_bits(k, lengths)):
        low[element] |= bits[pos] << b
    k_of = k.repeat_interleave(lengths)
    idx = (k_of >= 0).nonzero().squeeze(1)
    m = torch.zeros(numel, dtype=torch.int64, device=device)
    for j in range(width):
        idx = idx[j < width - k_of[idx]]
        if not idx.numel():
            break
        above = bits[planes.place(idx)]
        m[idx] += above
        idx = idx[above == 1]
    q = torch.where(m > 0, torch.ones_like(m) << (m - 1).clamp(min=0), 0)
    mantissa = (m >= 2).nonzero().squeeze(1)
    for j in range(2, width + 1):
        if not mantissa.numel():
            break
        q[mantissa] |= bits[planes.place(mantissa)] << (j - 2)
        mantissa = mantissa[m[mantissa] > j]
    z = torch.where(k_of >= 0, (q << k_of.clamp(min=0)) | low, 0)
    raw = (forms.form == RAW).repeat_interleave(lengths)
    raw_bits = torch.zeros(numel, dtype=torch.int64, device=device)
    nbytes = width // 8
    idx, start = _raw_positions(forms, offsets, lengths, chunk_size, nbytes)
    for byte in range(nbytes):
        raw_bits[idx] |= stream[start + byte].to(torch.int64) << (8 * byte)
    return z, raw, raw_bits


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
        cache: The previous values the receivers hold: same dtype and number of elements.
        capacity_bytes: Bytes of the buffer's stream area.
        chunk_size: Elements per chunk.

    Returns:
        ``(buffer, spill)``: ``buffer`` has :func:`payload_nbytes` bytes; ``spill`` the
        ``max(E - capacity_bytes, 0)`` stream bytes that did not fit.

    Examples:
        >>> x = torch.tensor([1.0, 2.0, 3.0])
        >>> buf, spill = encode_into_reference(x, x, capacity_bytes=0)
        >>> buf.numel(), spill.numel()  # header + 1 chunk word; nothing moved
        (36, 0)
    """
    _check_shard_and_cache(x, cache)
    _check_nonnegative_int(capacity_bytes, "capacity_bytes")
    _check_chunk_size(chunk_size)
    numel, dtype, device = x.numel(), x.dtype, x.device
    width = _WIDTH[dtype]
    u = _bits(x.reshape(-1))
    z = _zigzag_delta(u, _bits(cache.reshape(-1)), width)
    lengths = _chunk_lengths(numel, chunk_size, device)
    forms = _choose(_sizes_from_tails(_chunk_tails(z, numel, chunk_size, width), lengths, width))
    stream = _encode_stream(z, u, forms, chunk_size, width)
    return _assemble(stream, forms, numel, dtype, chunk_size, capacity_bytes)


def _assemble(
    stream: torch.Tensor,
    forms: ChunkForms,
    numel: int,
    dtype: torch.dtype,
    chunk_size: int,
    capacity: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    total, device = stream.numel(), stream.device
    kept = min(total, capacity)
    buffer = torch.zeros(
        payload_nbytes(numel, dtype, capacity, chunk_size), dtype=torch.uint8, device=device
    )
    buffer[:HEADER_NBYTES] = _header_bytes(numel, dtype, chunk_size, total, capacity).to(device)
    words = _chunk_words(forms).to(torch.uint8)
    pos = HEADER_NBYTES + words.numel()
    buffer[HEADER_NBYTES:pos] = words
    buffer[pos : pos + kept] = stream[:kept]
    return buffer, stream[kept:].clone()


def decode_from_reference(
    buffer: torch.Tensor,
    cache: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    *,
    spill: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    header: PayloadHeader | None = None,
) -> torch.Tensor:
    """Rebuild the exact shard from a buffer, its spill and ``cache``, in torch.

    Args:
        buffer: A payload from :func:`encode_into` or :func:`encode`.
        cache: The previous values the payload was encoded against.
        numel: Elements of the shard.
        dtype: ``torch.bfloat16`` or ``torch.float32``.
        spill: The spill returned with the buffer (``None`` when it was empty).
        out: Optional contiguous tensor of ``numel`` elements of ``dtype`` for the shard; may be
            ``cache`` itself (the cache then holds the new values).
        header: The buffer's header if already parsed (:func:`read_header`), else it is read.

    Returns:
        The flat shard (``out`` when given), which is also the receivers' next cache.

    Examples:
        >>> x = torch.tensor([1.0, -0.0, float("nan")])
        >>> cache = torch.zeros(3)
        >>> buffer, spill = encode_into_reference(x, cache, 4)
        >>> y = decode_from_reference(buffer, cache, 3, x.dtype, spill=spill)
        >>> y.view(torch.int32).tolist() == x.view(torch.int32).tolist(), spill.numel()
        (True, 8)
    """
    header = _check_buffer(buffer, cache, numel, dtype, header)
    _check_spill(spill, header, buffer.device)
    _check_out(out, numel, dtype, "out")
    width = _WIDTH[dtype]
    n_chunks = math.ceil(numel / header.chunk_size)
    forms = _read_chunk_words(buffer, n_chunks)
    pos = HEADER_NBYTES + 4 * n_chunks
    kept = min(header.stream_nbytes, header.capacity_bytes)
    stream = buffer[pos : pos + kept]
    if spill is not None:
        stream = torch.cat([stream, spill])
    z, raw, raw_bits = _decode_stream(stream, forms, numel, header.chunk_size, width)
    u = torch.where(raw, raw_bits, _undo_zigzag_delta(z, _bits(cache.reshape(-1)), width))
    x = _from_bits(u, dtype)
    if out is None:
        return x
    out.view(-1).copy_(x)
    return out.view(-1)


# ----------------------------------------------------------------------------------------------
# Triton kernels: one program per chunk
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from ada_modules.kernels.exponent_codec import _load_stream, _store_stream

    @triton.jit
    def _load_u(x_ptr, offs, mask, IS_BF16: tl.constexpr):
        u = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int64)
        if IS_BF16:
            u = u & 0xFFFF
        else:
            u = u & 0xFFFFFFFF
        return u

    @triton.jit
    def _zigzag(u, c, WIDTH: tl.constexpr):
        d = (u - c) & ((1 << WIDTH) - 1)
        return tl.where(d >= (1 << (WIDTH - 1)), 2 * ((1 << WIDTH) - d) - 1, 2 * d)

    @triton.jit
    def _bit_length_tl(v):
        n = tl.zeros_like(v)
        for s in tl.static_range(6):
            shift = 32 >> s
            t = v >> shift
            big = t > 0
            n = tl.where(big, n + shift, n)
            v = tl.where(big, t, v)
        return n + (v > 0).to(tl.int64)

    @triton.jit
    def _delta_tail_kernel(
        x_ptr,
        cache_ptr,
        tail_ptr,
        numel,
        IS_BF16: tl.constexpr,
        WIDTH: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        chunk = tl.program_id(0).to(tl.int64)
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        mask = offs < numel
        z = _zigzag(
            _load_u(x_ptr, offs, mask, IS_BF16), _load_u(cache_ptr, offs, mask, IS_BF16), WIDTH
        )
        ell = _bit_length_tl(z)
        for i in tl.static_range(WIDTH + 1):
            count = tl.sum(((ell >= i) & mask).to(tl.int64), axis=0)
            tl.store(tail_ptr + chunk * (WIDTH + 1) + i, count)

    @triton.jit
    def _write_plane(
        active,
        bit,
        cursor,
        scratch_ptr,
        buf_ptr,
        spill_ptr,
        exc_base,
        capacity,
        chunk,
        CHUNK: tl.constexpr,
    ):
        # Compact the active entries through this chunk's scratch row, then pack 8 per byte.
        flags = active.to(tl.int32)
        rank = tl.cumsum(flags, 0) - flags
        n = tl.sum(flags, axis=0)
        tl.store(scratch_ptr + chunk * CHUNK + rank, bit.to(tl.uint8), mask=active)
        tl.debug_barrier()
        byte_cols = tl.arange(0, CHUNK // 8)
        pos = byte_cols[:, None] * 8 + tl.arange(0, 8)[None, :]
        vals = tl.load(scratch_ptr + chunk * CHUNK + pos, mask=pos < n, other=0).to(tl.int32)
        packed = tl.sum(vals << tl.arange(0, 8)[None, :], axis=1)
        n_bytes = (n + 7) // 8
        _store_stream(
            buf_ptr, spill_ptr, exc_base, capacity, cursor + byte_cols, packed, byte_cols < n_bytes
        )
        tl.debug_barrier()
        return cursor + n_bytes

    @triton.jit
    def _read_plane(active, cursor, buf_ptr, spill_ptr, exc_base, capacity):
        flags = active.to(tl.int32)
        rank = tl.cumsum(flags, 0) - flags
        n = tl.sum(flags, axis=0)
        byte = _load_stream(buf_ptr, spill_ptr, exc_base, capacity, cursor + rank // 8, active)
        bit = ((byte >> (rank % 8)) & 1).to(tl.int64)
        return tl.where(active, bit, 0), cursor + (n + 7) // 8

    @triton.jit
    def _delta_encode_kernel(
        x_ptr,
        cache_ptr,
        form_ptr,
        offsets_ptr,
        scratch_ptr,
        buf_ptr,
        spill_ptr,
        numel,
        exc_base,
        capacity,
        IS_BF16: tl.constexpr,
        WIDTH: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        chunk = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, CHUNK)
        offs = chunk * CHUNK + cols
        mask = offs < numel
        u = _load_u(x_ptr, offs, mask, IS_BF16)
        z = _zigzag(u, _load_u(cache_ptr, offs, mask, IS_BF16), WIDTH)
        form = tl.load(form_ptr + chunk)
        cursor = tl.load(offsets_ptr + chunk)
        for byte in tl.static_range(WIDTH // 8):  # RAW: the new values' bytes
            addr = cursor + (WIDTH // 8) * cols + byte
            value = (u >> (8 * byte)) & 0xFF
            _store_stream(buf_ptr, spill_ptr, exc_base, capacity, addr, value, mask & (form == 1))
        is_eg = form >= 2
        k = tl.where(is_eg, form - 2, 0)
        for b in range(0, k):  # EG(k): low bits of z
            cursor = _write_plane(
                mask,
                (z >> b) & 1,
                cursor,
                scratch_ptr,
                buf_ptr,
                spill_ptr,
                exc_base,
                capacity,
                chunk,
                CHUNK,
            )
        q = z >> k
        m = tl.where(mask, _bit_length_tl(q), -1)
        j = 0
        while is_eg & (j < WIDTH - k) & (tl.sum((m >= j).to(tl.int32), axis=0) > 0):  # unary
            cursor = _write_plane(
                m >= j,
                m > j,
                cursor,
                scratch_ptr,
                buf_ptr,
                spill_ptr,
                exc_base,
                capacity,
                chunk,
                CHUNK,
            )
            j += 1
        j = 2
        while is_eg & (tl.sum((m >= j).to(tl.int32), axis=0) > 0):  # mantissa
            cursor = _write_plane(
                m >= j,
                (q >> (j - 2)) & 1,
                cursor,
                scratch_ptr,
                buf_ptr,
                spill_ptr,
                exc_base,
                capacity,
                chunk,
                CHUNK,
            )
            j += 1

    @triton.jit
    def _delta_decode_kernel(
        buf_ptr,
        spill_ptr,
        cache_ptr,
        form_ptr,
        offsets_ptr,
        out_ptr,
        numel,
        exc_base,
        capacity,
        IS_BF16: tl.constexpr,
        WIDTH: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        chunk = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, CHUNK)
        offs = chunk * CHUNK + cols
        mask = offs < numel
        c = _load_u(cache_ptr, offs, mask, IS_BF16)
        form = tl.load(form_ptr + chunk)
        cursor = tl.load(offsets_ptr + chunk)
        raw = tl.zeros((CHUNK,), dtype=tl.int64)
        for byte in tl.static_range(WIDTH // 8):
            addr = cursor + (WIDTH // 8) * cols + byte
            value = _load_stream(buf_ptr, spill_ptr, exc_base, capacity, addr, mask & (form == 1))
            raw = raw | (value.to(tl.int64) << (8 * byte))
        is_eg = form >= 2
        k = tl.where(is_eg, form - 2, 0)
        low = tl.zeros((CHUNK,), dtype=tl.int64)
        for b in range(0, k):
            bit, cursor = _read_plane(mask, cursor, buf_ptr, spill_ptr, exc_base, capacity)
            low = low | (bit << b)
        m = tl.where(mask & is_eg, 0, -1).to(tl.int64)
        j = 0
        while is_eg & (j < WIDTH - k) & (tl.sum((m >= j).to(tl.int32), axis=0) > 0):
            bit, cursor = _read_plane(m >= j, cursor, buf_ptr, spill_ptr, exc_base, capacity)
            m = m + bit
            j += 1
        q = tl.where(m > 0, tl.full((CHUNK,), 1, tl.int64) << tl.maximum(m - 1, 0), 0)
        j = 2
        while is_eg & (tl.sum((m >= j).to(tl.int32), axis=0) > 0):
            bit, cursor = _read_plane(m >= j, cursor, buf_ptr, spill_ptr, exc_base, capacity)
            q = q | (bit << (j - 2))
            j += 1
        z = tl.where(is_eg, (q << k) | low, 0)
        d = tl.where((z & 1) != 0, -((z + 1) >> 1), z >> 1)
        u = tl.where(form == 1, raw, (c + d) & ((1 << WIDTH) - 1))
        if IS_BF16:
            bits = tl.where(u >= 32768, u - 65536, u).to(tl.int16)
        else:
            bits = tl.where(u >= 2147483648, u - 4294967296, u).to(tl.int32)
        tl.store(out_ptr + offs, bits, mask=mask)


def _forms_triton(flat: torch.Tensor, cache: torch.Tensor, chunk_size: int) -> ChunkForms:
    numel, width = flat.numel(), _WIDTH[flat.dtype]
    n_chunks = math.ceil(numel / chunk_size)
    tails = torch.zeros(n_chunks, width + 1, dtype=torch.int64, device=flat.device)
    if n_chunks:
        _delta_tail_kernel[(n_chunks,)](
            _int_view(flat),
            _int_view(cache),
            tails,
            numel,
            IS_BF16=flat.dtype == torch.bfloat16,
            WIDTH=width,
            CHUNK=chunk_size,
            num_warps=4,
        )
    lengths = _chunk_lengths(numel, chunk_size, flat.device)
    return _choose(_sizes_from_tails(tails, lengths, width))


def _encode_into_triton(
    flat: torch.Tensor, cache: torch.Tensor, capacity: int | None, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    numel, dtype, device = flat.numel(), flat.dtype, flat.device
    forms = _forms_triton(flat, cache, chunk_size)
    offsets = forms.offsets
    total = int(forms.size.sum())  # host sync: the spill's length (and, for `encode`, the capacity)
    capacity = total if capacity is None else capacity
    buffer = torch.zeros(
        payload_nbytes(numel, dtype, capacity, chunk_size), dtype=torch.uint8, device=device
    )
    spill = torch.zeros(max(total - capacity, 0), dtype=torch.uint8, device=device)
    buffer[:HEADER_NBYTES] = _header_bytes(numel, dtype, chunk_size, total, capacity).to(device)
    words = _chunk_words(forms).to(torch.uint8)
    exc_base = HEADER_NBYTES + words.numel()
    buffer[HEADER_NBYTES:exc_base] = words
    n_chunks = forms.form.numel()
    if n_chunks:
        scratch = torch.empty(n_chunks * chunk_size, dtype=torch.uint8, device=device)
        _delta_encode_kernel[(n_chunks,)](
            _int_view(flat),
            _int_view(cache),
            forms.form,
            offsets,
            scratch,
            buffer,
            _dummy_spill(spill, device),
            numel,
            exc_base,
            capacity,
            IS_BF16=dtype == torch.bfloat16,
            WIDTH=_WIDTH[dtype],
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
) -> torch.Tensor:
    numel, dtype, chunk_size, device = header.numel, header.dtype, header.chunk_size, buffer.device
    n_chunks = math.ceil(numel / chunk_size)
    forms = _read_chunk_words(buffer, n_chunks)
    offsets = forms.offsets
    x = out if out is not None else torch.empty(numel, dtype=dtype, device=device)
    if n_chunks:
        _delta_decode_kernel[(n_chunks,)](
            buffer,
            _dummy_spill(spill, device),
            _int_view(cache),
            forms.form,
            offsets,
            _int_view(x),
            numel,
            HEADER_NBYTES + 4 * n_chunks,
            header.capacity_bytes,
            IS_BF16=dtype == torch.bfloat16,
            WIDTH=_WIDTH[dtype],
            CHUNK=chunk_size,
            num_warps=4,
        )
    return x


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
        cache: The previous values the receivers hold: same dtype, number of elements and device.
        capacity_bytes: Bytes of the buffer's stream area; stream bytes beyond it go to the spill.
        chunk_size: Elements per chunk (power of two in [16, 32768]).
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``(buffer, spill)``: ``buffer`` is ``uint8`` with exactly
        ``payload_nbytes(x.numel(), x.dtype, capacity_bytes, chunk_size)`` bytes; ``spill`` holds
        the ``max(E - capacity_bytes, 0)`` stream bytes that did not fit.

    Raises:
        ValueError: For an unsupported dtype, a cache of another dtype, length or device, a bad
            ``capacity_bytes``/``chunk_size``, or an ``impl`` that cannot run.

    Examples:
        >>> cache = torch.randn(5000)
        >>> x = cache + 1e-6 * torch.randn(5000)
        >>> buf, spill = encode_into(x, cache, capacity_bytes=4 * 5000)
        >>> buf.numel() == payload_nbytes(5000, torch.float32, 4 * 5000), spill.numel()
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
    header: PayloadHeader | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Rebuild the exact shard from an :func:`encode_into` buffer, its spill and ``cache``.

    Args:
        buffer: The payload.
        cache: The previous values the payload was encoded against.
        numel: Elements of the shard.
        dtype: ``torch.bfloat16`` or ``torch.float32``.
        spill: The spill returned with the buffer (``None`` or empty when nothing spilled).
        out: Optional contiguous tensor of ``numel`` elements of ``dtype`` for the shard; may be
            ``cache`` itself.
        header: The buffer's header if the caller already parsed it; otherwise it is read.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        The flat shard (``out`` when given): the receivers' next cache.

    Raises:
        ValueError: If the header does not match ``numel``/``dtype``, the buffer or spill has the
            wrong size, the cache is wrong, or ``impl`` cannot run.

    Examples:
        >>> x = torch.randn(100).bfloat16()
        >>> cache = torch.zeros(100, dtype=torch.bfloat16)  # a stale cache: everything moved
        >>> buf, spill = encode_into(x, cache, capacity_bytes=40)  # too small: the rest spills
        >>> y = decode_from(buf, cache, 100, torch.bfloat16, spill=spill)
        >>> spill.numel() > 0, torch.equal(y.view(torch.int16), x.view(torch.int16))
        (True, True)
    """
    header = _check_buffer(buffer, cache, numel, dtype, header)
    spill = spill if spill is not None and spill.numel() else None
    _check_spill(spill, header, buffer.device)
    _check_out(out, numel, dtype, "out")
    if resolve_impl(impl, buffer, cache) == "torch":
        return decode_from_reference(
            buffer, cache, numel, dtype, spill=spill, out=out, header=header
        )
    return _decode_from_triton(
        buffer, cache.reshape(-1), header, spill, None if out is None else out.view(-1)
    )


def encode(
    x: torch.Tensor,
    cache: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Encode ``x`` against ``cache`` into a payload whose stream area holds the whole stream.

    Same arguments as :func:`encode_into` without the capacity; never spills.

    Examples:
        >>> x = torch.randn(2048)
        >>> encode(x, x).numel()  # header + 2 chunk words: nothing moved
        40
    """
    _check_shard_and_cache(x, cache)
    _check_chunk_size(chunk_size)
    if resolve_impl(impl, x, cache) == "torch":
        total = int(chunk_forms(x, cache, chunk_size).size.sum())
        return encode_into_reference(x, cache, total, chunk_size=chunk_size)[0]
    return _encode_into_triton(x.reshape(-1), cache.reshape(-1), None, chunk_size)[0]


def decode(payload: torch.Tensor, cache: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """Decode an :func:`encode` payload (its header gives the size and dtype).

    Examples:
        >>> cache = torch.tensor([0.5, -3.0, 1.0])
        >>> decode(encode(torch.tensor([0.5, -3.0, float("-inf")]), cache), cache).tolist()
        [0.5, -3.0, -inf]
    """
    header = read_header(payload)
    return decode_from(payload, cache, header.numel, header.dtype, impl=impl)
