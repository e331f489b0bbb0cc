"""Packed low-bit KV quantization (the KIVI scheme) and decode attention over packed keys/values.

**Quantizer.** Asymmetric min/max quantization to ``bits`` in {2, 3, 4, 8}: a group of values with
minimum ``mn`` and maximum ``mx`` gets ``scale = (mx - mn) / (2**bits - 1)`` and ``zero = mn``, both
stored in the dtype of the input (fp16/bf16/fp32), and codes
``c = clamp(floor((x - zero) / scale + 1/2), 0, 2**bits - 1)`` computed from the *stored*
``scale``/``zero`` (a group with ``scale == 0`` gets codes 0). Dequantization is
``c * scale + zero``. Keys are grouped **per channel over groups of ``G`` tokens** (one scale/zero
per ``(G tokens, channel)``), values **per token over groups of ``G`` channels** (KIVI, Liu et al.
2024). In fp32 the round-trip error of every element is at most ``scale / 2`` (up to rounding of
the fp32 arithmetic).

**Packing.** Codes are packed along the channel (last) axis into int32 words, so packed tensors
of consecutive token blocks concatenate along the token axis. A ``b``-bit code is split into
bit planes of width 2, 4 or 8 bits (3 bits = a 2-bit plane for bits 0–1 plus a 1-bit plane for
bit 2, so 3-bit storage costs exactly 3 bits per element when the head dim is a multiple of 32).
A plane of width ``w`` holds ``32 // w`` channels per word: channel ``d`` sits in word ``d // (32 //
w)`` at bit ``(d % (32 // w)) * w``. The planes of one token are stored one after the other
along the last axis: ``codes.shape[-1] == packed_words(head_dim, bits)``. Words are signed
int32; their bit pattern is what counts.

**Decode attention.** :func:`decode_attention` computes, for one new query per head, softmax
attention over keys/values stored as a list of packed :class:`QuantizedKV` segments (each with its
own key and value bit widths) followed by a full-precision residual window, with grouped-query
attention (``Hq`` query heads share ``Hkv`` key/value heads, ``Hq % Hkv == 0``) and an optional
boolean key mask (left padding). The Triton path splits every segment into chunks of tokens
(split-K, "flash decoding"), computes a partial output and its log-sum-exp per chunk with an online
softmax, reading packed codes and dequantizing them in registers, and merges all partials with a
log-sum-exp weighted sum. Softmax attention does not depend on the order of the keys, so segments
may be pooled by bit width as long as ``key_mask`` follows the same order.

Each operation has the three parts of the kernel pattern (see :mod:`ada_modules.kernels`):
``_<name>_kernel`` (Triton), ``<name>_reference`` (torch, the specification) and
``<name>(..., impl="auto")``.

Examples:
    >>> k = torch.randn(2, 4, 64, 32)  # (batch, kv heads, tokens, head dim)
    >>> packed = quantize_keys(k, bits=2, group_size=32)
    >>> packed.codes.shape, packed.scale.shape  # 32 channels of 2 bits fill 2 int32 words
    (torch.Size([2, 4, 64, 2]), torch.Size([2, 4, 2, 32]))
    >>> bool(((dequantize(packed) - k).abs() <= packed.scale.repeat_interleave(32, -2) / 2 + 1e-6).all())
    True
"""

# Triton reads argument annotations as types and specialisations, so kernel arguments stay bare.
# ruff: noqa: ANN001

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import FLOAT_DTYPES, Impl, resolve_impl, triton_available

__all__ = [
    "SUPPORTED_BITS",
    "PackedTensor",
    "QuantizedKV",
    "decode_attention",
    "decode_attention_reference",
    "dequantize",
    "dequantize_reference",
    "pack_codes",
    "packed_words",
    "quantize_keys",
    "quantize_keys_reference",
    "quantize_values",
    "quantize_values_reference",
    "unpack_codes",
]

SUPPORTED_BITS = (2, 3, 4, 8)
"""Bit widths the quantizer, the packing and the kernels support."""

_PLANES: dict[int, tuple[int, ...]] = {2: (2,), 3: (2, 1), 4: (4,), 8: (8,)}
Kind = Literal["key", "value"]


def _check_bits(bits: int, name: str = "bits") -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise InputError(f"{name} must be one of {SUPPORTED_BITS}, got {bits!r}")


def _check_group_size(group_size: int, name: str = "group_size") -> None:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 1
        or group_size & (group_size - 1)
    ):
        raise InputError(f"{name} must be a positive power of two, got {group_size!r}")


def packed_words(head_dim: int, bits: int) -> int:
    """Number of int32 words that hold ``head_dim`` codes of ``bits`` bits (all bit planes).

    Examples:
        >>> packed_words(128, 2), packed_words(128, 3), packed_words(128, 4), packed_words(16, 3)
        (8, 12, 16, 2)
    """
    _check_bits(bits)
    return sum(-(-head_dim // (32 // w)) for w in _PLANES[bits])


# ----------------------------------------------------------------------------------------------
# Containers
# ----------------------------------------------------------------------------------------------


@dataclass
class PackedTensor:
    """Packed codes of a ``(..., tokens, head_dim)`` tensor with their scales and zero points.

    Attributes:
        codes: int32 words, shape ``(..., tokens, packed_words(head_dim, bits))``.
        scale: Per-group scales in the dtype of the quantized tensor: ``(..., tokens // group_size,
            head_dim)`` for keys, ``(..., tokens, head_dim // group_size)`` for values.
        zero: Per-group zero points (the group minimum), shaped like ``scale``.
        bits: Bits per code, one of :data:`SUPPORTED_BITS`.
        group_size: Tokens per group (keys) or channels per group (values).
        kind: ``"key"`` (per-channel groups over tokens) or ``"value"`` (per-token groups over
            channels).
        head_dim: Number of channels (the last dimension before packing).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    kind: Kind
    head_dim: int

    @property
    def num_tokens(self) -> int:
        """Number of tokens held."""
        return self.codes.shape[-2]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the quantized tensor (and of ``scale`` and ``zero``)."""
        return self.scale.dtype

    def nbytes(self) -> int:
        """Exact bytes held: codes + scales + zero points."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "PackedTensor":
        """Apply ``fn`` to ``codes``, ``scale`` and ``zero`` (e.g. a batch ``index_select``)."""
        return PackedTensor(
            fn(self.codes),
            fn(self.scale),
            fn(self.zero),
            self.bits,
            self.group_size,
            self.kind,
            self.head_dim,
        )

    @staticmethod
    def cat(parts: Sequence["PackedTensor"]) -> "PackedTensor":
        """Concatenate packed tensors of the same kind, bits and group size along the tokens."""
        first = parts[0]
        for p in parts[1:]:
            if (p.kind, p.bits, p.group_size, p.head_dim) != (
                first.kind,
                first.bits,
                first.group_size,
                first.head_dim,
            ):
                raise InputError(
                    "can only concatenate packed tensors of one kind, bit width, group size and "
                    f"head dim, got {(p.kind, p.bits, p.group_size, p.head_dim)} after "
                    f"{(first.kind, first.bits, first.group_size, first.head_dim)}"
                )
        return PackedTensor(
            torch.cat([p.codes for p in parts], dim=-2),
            torch.cat([p.scale for p in parts], dim=-2),
            torch.cat([p.zero for p in parts], dim=-2),
            first.bits,
            first.group_size,
            first.kind,
            first.head_dim,
        )


@dataclass
class QuantizedKV:
    """One segment of a quantized KV cache: packed keys and values of the same tokens.

    Attributes:
        keys: From :func:`quantize_keys`, leading dims ``(batch, kv_heads)``.
        values: From :func:`quantize_values`, same leading dims and tokens.
    """

    keys: PackedTensor
    values: PackedTensor

    def __post_init__(self) -> None:
        if self.keys.kind != "key" or self.values.kind != "value":
            raise InputError(
                f"QuantizedKV needs keys of kind 'key' and values of kind 'value', got "
                f"{self.keys.kind!r} and {self.values.kind!r}"
            )
        if self.keys.codes.shape[:-1] != self.values.codes.shape[:-1]:
            raise InputError(
                "keys and values must have the same leading dims and tokens, got "
                f"{tuple(self.keys.codes.shape[:-1])} and {tuple(self.values.codes.shape[:-1])}"
            )

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the segment."""
        return self.keys.num_tokens

    def nbytes(self) -> int:
        """Exact bytes held by both packed tensors."""
        return self.keys.nbytes() + self.values.nbytes()


# ----------------------------------------------------------------------------------------------
# Packing (torch; the kernels pack and unpack in registers)
# ----------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**bits)`` along the last axis into int32 words.

    Args:
        codes: Integer tensor ``(..., head_dim)``.
        bits: One of :data:`SUPPORTED_BITS`.

    Returns:
        int32 tensor ``(..., packed_words(head_dim, bits))``.

    Examples:
        >>> pack_codes(torch.tensor([[1, 2, 3]]), bits=2).tolist()  # 1 + (2 << 2) + (3 << 4)
        [[57]]
    """
    _check_bits(bits)
    head_dim = codes.shape[-1]
    codes = codes.to(torch.int64)
    words = []
    code_shift = 0
    for w in _PLANES[bits]:
        per = 32 // w
        n_words = -(-head_dim // per)
        plane = (codes >> code_shift) & ((1 << w) - 1)
        plane = torch.nn.functional.pad(plane, (0, n_words * per - head_dim))
        plane = plane.reshape(*codes.shape[:-1], n_words, per)
        shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * w
        words.append((plane << shifts).sum(-1))
        code_shift += w
    packed = torch.cat(words, dim=-1)
    # Reinterpret the unsigned 32-bit pattern as a signed int32.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_codes(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int32 words back to int32 codes ``(..., head_dim)``.

    Examples:
        >>> codes = torch.randint(0, 8, (3, 40))
        >>> torch.equal(unpack_codes(pack_codes(codes, 3), 3, 40), codes.int())
        True
    """
    _check_bits(bits)
    if packed.shape[-1] != packed_words(head_dim, bits):
        raise InputError(
            f"packed has {packed.shape[-1]} words per row, expected "
            f"packed_words({head_dim}, {bits}) = {packed_words(head_dim, bits)}"
        )
    packed = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(*packed.shape[:-1], head_dim, dtype=torch.int64, device=packed.device)
    start = code_shift = 0
    for w in _PLANES[bits]:
        per = 32 // w
        n_words = -(-head_dim // per)
        words = packed[..., start : start + n_words]
        shifts = torch.arange(per, device=packed.device, dtype=torch.int64) * w
        plane = (words.unsqueeze(-1) >> shifts) & ((1 << w) - 1)
        plane = plane.reshape(*packed.shape[:-1], n_words * per)[..., :head_dim]
        out |= plane << code_shift
        start += n_words
        code_shift += w
    return out.to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def _check_states(x: torch.Tensor, bits: int, group_size: int, kind: Kind) -> None:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise InputError(f"x must have dtype in {FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() < 2:
        raise InputError(f"x must have shape (..., tokens, head_dim), got {tuple(x.shape)}")
    _check_bits(bits)
    _check_group_size(group_size)
    tokens, head_dim = x.shape[-2:]
    if kind == "key" and tokens % group_size:
        raise InputError(
            f"keys are grouped over tokens: group_size={group_size} must divide the number of "
            f"tokens, got {tokens}"
        )
    if kind == "value" and head_dim % group_size:
        raise InputError(
            f"values are grouped over channels: group_size={group_size} must divide the head "
            f"dim, got {head_dim}"
        )


def _check_packed(packed: PackedTensor) -> None:
    if not isinstance(packed, PackedTensor):
        raise InputError(f"packed must be a PackedTensor, got {type(packed).__name__}")
    _check_bits(packed.bits, "packed.bits")
    _check_group_size(packed.group_size, "packed.group_size")
    if packed.codes.dtype != torch.int32:
        raise InputError(f"packed.codes must be int32, got {packed.codes.dtype}")
    words = packed_words(packed.head_dim, packed.bits)
    if packed.codes.shape[-1] != words:
        raise InputError(
            f"packed.codes has {packed.codes.shape[-1]} words per token, expected {words} "
            f"for head_dim={packed.head_dim} at {packed.bits} bits"
        )
    tokens = packed.codes.shape[-2]
    lead = packed.codes.shape[:-2]
    g = packed.group_size
    want = (
        (*lead, tokens // g, packed.head_dim)
        if packed.kind == "key"
        else (*lead, tokens, packed.head_dim // g)
    )
    for name, t in (("scale", packed.scale), ("zero", packed.zero)):
        if tuple(t.shape) != want:
            raise InputError(f"packed.{name} must have shape {want}, got {tuple(t.shape)}")


# ----------------------------------------------------------------------------------------------
# Quantize / dequantize: reference
# ----------------------------------------------------------------------------------------------


def _quantize_reference(x: torch.Tensor, bits: int, group_size: int, kind: Kind) -> PackedTensor:
    levels = float(2**bits - 1)
    *lead, tokens, head_dim = x.shape
    xf = x.float()
    if kind == "key":  # (..., tokens // g, g, head_dim): reduce over the tokens of a group
        grouped = xf.reshape(*lead, tokens // group_size, group_size, head_dim)
        axis = -2
    else:  # (..., tokens, head_dim // g, g): reduce over the channels of a group
        grouped = xf.reshape(*lead, tokens, head_dim // group_size, group_size)
        axis = -1
    mn = grouped.amin(dim=axis)
    mx = grouped.amax(dim=axis)
    scale = ((mx - mn) / torch.full_like(mx, levels)).to(x.dtype)
    zero = mn.to(x.dtype)
    s = scale.float().unsqueeze(axis)
    z = zero.float().unsqueeze(axis)
    y = torch.floor((grouped - z) / torch.where(s > 0, s, 1.0) + 0.5).clamp_(0, levels)
    codes = torch.where(s > 0, y, 0.0).to(torch.int64).reshape(*lead, tokens, head_dim)
    return PackedTensor(pack_codes(codes, bits), scale, zero, bits, group_size, kind, head_dim)


def quantize_keys_reference(x: torch.Tensor, bits: int, group_size: int) -> PackedTensor:
    """Quantize keys per channel over groups of ``group_size`` tokens, in torch (the spec).

    Args:
        x: Keys ``(..., tokens, head_dim)``; ``tokens`` a multiple of ``group_size``.
        bits: One of :data:`SUPPORTED_BITS`.
        group_size: Tokens per group, a power of two.

    Returns:
        The packed keys.

    Examples:
        >>> p = quantize_keys_reference(torch.tensor([[0.0], [1.0], [3.0], [2.0]]), 2, 4)
        >>> unpack_codes(p.codes, 2, 1).flatten().tolist(), p.scale.item(), p.zero.item()
        ([0, 1, 3, 2], 1.0, 0.0)
    """
    _check_states(x, bits, group_size, "key")
    return _quantize_reference(x, bits, group_size, "key")


def quantize_values_reference(x: torch.Tensor, bits: int, group_size: int) -> PackedTensor:
    """Quantize values per token over groups of ``group_size`` channels, in torch (the spec).

    Args:
        x: Values ``(..., tokens, head_dim)``; ``head_dim`` a multiple of ``group_size``.
        bits: One of :data:`SUPPORTED_BITS`.
        group_size: Channels per group, a power of two.

    Returns:
        The packed values.

    Examples:
        >>> p = quantize_values_reference(torch.tensor([[0.0, 1.0, 3.0, 2.0]]), 2, 4)
        >>> unpack_codes(p.codes, 2, 4).tolist(), p.scale.tolist()
        ([[0, 1, 3, 2]], [[1.0]])
    """
    _check_states(x, bits, group_size, "value")
    return _quantize_reference(x, bits, group_size, "value")


def dequantize_reference(packed: PackedTensor) -> torch.Tensor:
    """Dequantize packed keys or values, in torch (the specification): ``codes * scale + zero``.

    Args:
        packed: From :func:`quantize_keys` or :func:`quantize_values`.

    Returns:
        Tensor ``(..., tokens, head_dim)`` in ``packed.dtype``.

    Examples:
        >>> x = torch.randn(3, 8, 64)
        >>> dequantize_reference(quantize_values_reference(x, 8, 32)).shape
        torch.Size([3, 8, 64])
    """
    codes = unpack_codes(packed.codes, packed.bits, packed.head_dim).float()
    g = packed.group_size
    if packed.kind == "key":
        scale = packed.scale.float().repeat_interleave(g, dim=-2)
        zero = packed.zero.float().repeat_interleave(g, dim=-2)
    else:
        scale = packed.scale.float().repeat_interleave(g, dim=-1)
        zero = packed.zero.float().repeat_interleave(g, dim=-1)
    return (codes * scale + zero).to(packed.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_plane_store(
        codes,
        out_row_ptrs,
        tok_mask,
        CODE_SHIFT: tl.constexpr,
        W: tl.constexpr,
        WORD_OFFSET: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # codes: [BLOCK_T, BLOCK_D] int32; out_row_ptrs: [BLOCK_T] pointers to each token's words.
        PER: tl.constexpr = 32 // W
        N_WORDS: tl.constexpr = (HEAD_DIM + PER - 1) // PER
        plane = (codes >> CODE_SHIFT) & ((1 << W) - 1)
        plane = tl.reshape(plane, (BLOCK_T, BLOCK_D // PER, PER))
        shifts = tl.arange(0, PER) * W
        # Disjoint bits: the (wrapping) int32 sum equals the bitwise OR.
        words = tl.sum(plane << shifts[None, None, :], axis=2)
        j = tl.arange(0, BLOCK_D // PER)
        mask = tok_mask[:, None] & (j < N_WORDS)[None, :]
        tl.store(out_row_ptrs[:, None] + WORD_OFFSET + j[None, :], words, mask=mask)

    @triton.jit
    def _unpack_plane(
        row_ptrs,
        tok_mask,
        W: tl.constexpr,
        WORD_OFFSET: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # The W-bit plane's codes [BLOCK_T, BLOCK_D] (int32), each word read once (contiguously)
        # and split by shifts; the inverse of _pack_plane_store.
        PER: tl.constexpr = 32 // W
        N_WORDS: tl.constexpr = (HEAD_DIM + PER - 1) // PER
        j = tl.arange(0, BLOCK_D // PER)
        words = tl.load(
            row_ptrs[:, None] + WORD_OFFSET + j[None, :],
            mask=tok_mask[:, None] & (j < N_WORDS)[None, :],
            other=0,
        )
        shifts = tl.arange(0, PER) * W
        codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << W) - 1)
        return tl.reshape(codes, (row_ptrs.shape[0], BLOCK_D))

    @triton.jit
    def _unpack_rows(
        row_ptrs,
        tok_mask,
        BITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # All channels [0, BLOCK_D) of each token: row_ptrs [BLOCK_T] point to each token's words,
        # tok_mask [BLOCK_T] marks the valid ones. Returns the codes [BLOCK_T, BLOCK_D] as int32.
        if BITS == 3:
            N0: tl.constexpr = (HEAD_DIM + 15) // 16
            c = _unpack_plane(row_ptrs, tok_mask, 2, 0, HEAD_DIM, BLOCK_D)
            c = c | (_unpack_plane(row_ptrs, tok_mask, 1, N0, HEAD_DIM, BLOCK_D) << 2)
        else:
            c = _unpack_plane(row_ptrs, tok_mask, BITS, 0, HEAD_DIM, BLOCK_D)
        return c

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        codes_ptr,
        scale_ptr,
        zero_ptr,
        n_tokens,
        IS_KEY: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        N_WORDS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        tok_mask = t < n_tokens
        mask = tok_mask[:, None] & (d < HEAD_DIM)[None, :]
        x = tl.load(
            x_ptr + row * n_tokens * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        meta_ty = scale_ptr.dtype.element_ty
        levels = (1 << BITS) - 1.0
        if IS_KEY:
            NG: tl.constexpr = BLOCK_T // GROUP
            x3 = tl.reshape(x, (NG, GROUP, BLOCK_D))
            m3 = tl.reshape(mask, (NG, GROUP, BLOCK_D))
            mn = tl.min(tl.where(m3, x3, float("inf")), axis=1)
            mx = tl.max(tl.where(m3, x3, float("-inf")), axis=1)
            scale = tl.math.div_rn(mx - mn, levels).to(meta_ty)
            zero = mn.to(meta_ty)
            g = tl.program_id(1) * NG + tl.arange(0, NG)
            g_mask = (g < n_tokens // GROUP)[:, None] & (d < HEAD_DIM)[None, :]
            meta_off = row * (n_tokens // GROUP) * HEAD_DIM + g[:, None] * HEAD_DIM + d[None, :]
            tl.store(scale_ptr + meta_off, scale, mask=g_mask)
            tl.store(zero_ptr + meta_off, zero, mask=g_mask)
            s = scale.to(tl.float32)[:, None, :]
            z = zero.to(tl.float32)[:, None, :]
        else:
            NG: tl.constexpr = BLOCK_D // GROUP
            N_GROUPS: tl.constexpr = HEAD_DIM // GROUP
            x3 = tl.reshape(x, (BLOCK_T, NG, GROUP))
            m3 = tl.reshape(mask, (BLOCK_T, NG, GROUP))
            mn = tl.min(tl.where(m3, x3, float("inf")), axis=2)
            mx = tl.max(tl.where(m3, x3, float("-inf")), axis=2)
            scale = tl.math.div_rn(mx - mn, levels).to(meta_ty)
            zero = mn.to(meta_ty)
            g = tl.arange(0, NG)
            g_mask = tok_mask[:, None] & (g < N_GROUPS)[None, :]
            meta_off = row * n_tokens * N_GROUPS + t[:, None] * N_GROUPS + g[None, :]
            tl.store(scale_ptr + meta_off, scale, mask=g_mask)
            tl.store(zero_ptr + meta_off, zero, mask=g_mask)
            s = scale.to(tl.float32)[:, :, None]
            z = zero.to(tl.float32)[:, :, None]
        positive = s > 0.0
        y = tl.floor(tl.math.div_rn(x3 - z, tl.where(positive, s, 1.0)) + 0.5)
        y = tl.minimum(tl.maximum(y, 0.0), levels)
        y = tl.where(positive & m3, y, 0.0)
        codes = tl.reshape(y.to(tl.int32), (BLOCK_T, BLOCK_D))
        out_rows = codes_ptr + row * n_tokens * N_WORDS + t * N_WORDS
        if BITS == 3:
            _pack_plane_store(codes, out_rows, tok_mask, 0, 2, 0, HEAD_DIM, BLOCK_T, BLOCK_D)
            N0: tl.constexpr = (HEAD_DIM + 15) // 16
            _pack_plane_store(codes, out_rows, tok_mask, 2, 1, N0, HEAD_DIM, BLOCK_T, BLOCK_D)
        else:
            _pack_plane_store(codes, out_rows, tok_mask, 0, BITS, 0, HEAD_DIM, BLOCK_T, BLOCK_D)

    @triton.jit
    def _dequant_tile(
        codes_ptr,
        scale_ptr,
        zero_ptr,
        row,
        t0,
        n_tokens,
        IS_KEY: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        N_WORDS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Dequantized tile [BLOCK_T, BLOCK_D] (fp32) of row `row`, tokens t0 + [0, BLOCK_T) with
        # t0 a multiple of BLOCK_T: each scale and zero point is read once and broadcast.
        t = t0 + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        tok_mask = t < n_tokens
        c = _unpack_rows(
            codes_ptr + row * n_tokens * N_WORDS + t * N_WORDS, tok_mask, BITS, HEAD_DIM, BLOCK_D
        )
        c = c.to(tl.float32)
        if IS_KEY:
            # Groups of GROUP tokens: NG of them in the tile (1 when the tile lies in one group).
            NG: tl.constexpr = (BLOCK_T + GROUP - 1) // GROUP
            g = t0 // GROUP + tl.arange(0, NG)
            off = row * (n_tokens // GROUP) * HEAD_DIM + g[:, None] * HEAD_DIM + d[None, :]
            meta_mask = (g < n_tokens // GROUP)[:, None] & (d < HEAD_DIM)[None, :]
            s = tl.load(scale_ptr + off, mask=meta_mask, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + off, mask=meta_mask, other=0.0).to(tl.float32)
            c3 = tl.reshape(c, (NG, BLOCK_T // NG, BLOCK_D))
            x = tl.reshape(c3 * s[:, None, :] + z[:, None, :], (BLOCK_T, BLOCK_D))
        else:
            # Groups of GROUP channels of each token.
            N_GROUPS: tl.constexpr = HEAD_DIM // GROUP
            NG: tl.constexpr = BLOCK_D // GROUP
            g = tl.arange(0, NG)
            off = row * n_tokens * N_GROUPS + t[:, None] * N_GROUPS + g[None, :]
            meta_mask = tok_mask[:, None] & (g < N_GROUPS)[None, :]
            s = tl.load(scale_ptr + off, mask=meta_mask, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + off, mask=meta_mask, other=0.0).to(tl.float32)
            c3 = tl.reshape(c, (BLOCK_T, NG, GROUP))
            x = tl.reshape(c3 * s[:, :, None] + z[:, :, None], (BLOCK_T, BLOCK_D))
        return x

    @triton.jit
    def _dequantize_kernel(
        codes_ptr,
        scale_ptr,
        zero_ptr,
        out_ptr,
        n_tokens,
        IS_KEY: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        N_WORDS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        t0 = tl.program_id(1) * BLOCK_T
        t = t0 + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        x = _dequant_tile(
            codes_ptr,
            scale_ptr,
            zero_ptr,
            row,
            t0,
            n_tokens,
            IS_KEY,
            BITS,
            GROUP,
            HEAD_DIM,
            N_WORDS,
            BLOCK_T,
            BLOCK_D,
        )
        mask = (t < n_tokens)[:, None] & (d < HEAD_DIM)[None, :]
        out = out_ptr + row * n_tokens * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :]
        tl.store(out, x.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_kv_tile(
        codes_ptr,
        scale_ptr,
        zero_ptr,
        row,
        t0,
        n_tokens,
        IS_KEY: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        N_WORDS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # BITS == 0: full precision, codes_ptr points to a contiguous (rows, n_tokens, HEAD_DIM).
        if BITS == 0:
            t = t0 + tl.arange(0, BLOCK_T)
            d = tl.arange(0, BLOCK_D)
            mask = (t < n_tokens)[:, None] & (d < HEAD_DIM)[None, :]
            ptrs = codes_ptr + row * n_tokens * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :]
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            x = _dequant_tile(
                codes_ptr,
                scale_ptr,
                zero_ptr,
                row,
                t0,
                n_tokens,
                IS_KEY,
                BITS,
                GROUP,
                HEAD_DIM,
                N_WORDS,
                BLOCK_T,
                BLOCK_D,
            )
        return x

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,
        k_codes_ptr,
        k_scale_ptr,
        k_zero_ptr,
        v_codes_ptr,
        v_scale_ptr,
        v_zero_ptr,
        mask_ptr,
        out_ptr,
        lse_ptr,
        n_tokens,
        tokens_per_split,
        split_offset,
        total_splits,
        mask_offset,
        mask_stride,
        kv_heads,
        sm_scale,
        GQA: tl.constexpr,
        HAS_MASK: tl.constexpr,
        KEY_BITS: tl.constexpr,
        VALUE_BITS: tl.constexpr,
        KEY_GROUP: tl.constexpr,
        VALUE_GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        KEY_WORDS: tl.constexpr,
        VALUE_WORDS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # (batch, kv head)
        split = tl.program_id(1)
        batch = row // kv_heads
        kv_head = row % kv_heads
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_mask = h < GQA
        d_mask = d < HEAD_DIM
        q_heads = kv_head * GQA + h  # query heads of this kv head
        q_rows = batch * kv_heads * GQA + q_heads
        q = tl.load(
            q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)

        m_i = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_tokens)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            valid = t < end
            if HAS_MASK:
                keep = tl.load(
                    mask_ptr + batch * mask_stride + mask_offset + t, mask=valid, other=0
                )
                valid = valid & (keep != 0)
            k = _load_kv_tile(
                k_codes_ptr,
                k_scale_ptr,
                k_zero_ptr,
                row,
                t0,
                n_tokens,
                True,
                KEY_BITS,
                KEY_GROUP,
                HEAD_DIM,
                KEY_WORDS,
                BLOCK_T,
                BLOCK_D,
            )
            v = _load_kv_tile(
                v_codes_ptr,
                v_scale_ptr,
                v_zero_ptr,
                row,
                t0,
                n_tokens,
                False,
                VALUE_BITS,
                VALUE_GROUP,
                HEAD_DIM,
                VALUE_WORDS,
                BLOCK_T,
                BLOCK_D,
            )
            s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_H, BLOCK_T]
            s = tl.where(valid[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        slot = split_offset + split
        out_rows = q_rows * total_splits + slot
        tl.store(
            out_ptr + out_rows[:, None] * HEAD_DIM + d[None, :],
            out,
            mask=h_mask[:, None] & d_mask[None, :],
        )
        tl.store(lse_ptr + out_rows, lse, mask=h_mask)


def _block_d(head_dim: int, group_size: int) -> int:
    return max(triton.next_power_of_2(head_dim), 32, group_size)


def _quantize_triton(x: torch.Tensor, bits: int, group_size: int, kind: Kind) -> PackedTensor:
    *lead, tokens, head_dim = x.shape
    rows = x.reshape(-1, tokens, head_dim).contiguous()
    n_rows = rows.shape[0]
    n_words = packed_words(head_dim, bits)
    codes = torch.empty((n_rows, tokens, n_words), dtype=torch.int32, device=x.device)
    if kind == "key":
        meta_shape = (n_rows, tokens // group_size, head_dim)
        block_t = max(group_size, 16)
    else:
        meta_shape = (n_rows, tokens, head_dim // group_size)
        block_t = 16
    scale = torch.empty(meta_shape, dtype=x.dtype, device=x.device)
    zero = torch.empty(meta_shape, dtype=x.dtype, device=x.device)
    block_d = _block_d(head_dim, group_size)
    if n_rows and tokens:
        _quantize_kernel[(n_rows, triton.cdiv(tokens, block_t))](
            rows,
            codes,
            scale,
            zero,
            tokens,
            IS_KEY=kind == "key",
            BITS=bits,
            GROUP=group_size,
            HEAD_DIM=head_dim,
            N_WORDS=n_words,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return PackedTensor(
        codes.reshape(*lead, tokens, n_words),
        scale.reshape(*lead, *meta_shape[1:]),
        zero.reshape(*lead, *meta_shape[1:]),
        bits,
        group_size,
        kind,
        head_dim,
    )


def _dequantize_triton(packed: PackedTensor) -> torch.Tensor:
    *lead, tokens, n_words = packed.codes.shape
    head_dim = packed.head_dim
    codes = packed.codes.reshape(-1, tokens, n_words).contiguous()
    n_rows = codes.shape[0]
    out = torch.empty((n_rows, tokens, head_dim), dtype=packed.dtype, device=codes.device)
    block_t = 16
    if n_rows and tokens:
        _dequantize_kernel[(n_rows, triton.cdiv(tokens, block_t))](
            codes,
            packed.scale.contiguous(),
            packed.zero.contiguous(),
            out,
            tokens,
            IS_KEY=packed.kind == "key",
            BITS=packed.bits,
            GROUP=packed.group_size,
            HEAD_DIM=head_dim,
            N_WORDS=n_words,
            BLOCK_T=block_t,
            BLOCK_D=_block_d(head_dim, packed.group_size),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out.reshape(*lead, tokens, head_dim)


def quantize_keys(
    x: torch.Tensor, bits: int, group_size: int = 32, impl: Impl = "auto"
) -> PackedTensor:
    """Quantize and pack keys per channel over groups of ``group_size`` tokens (KIVI keys).

    Args:
        x: Keys ``(..., tokens, head_dim)``, fp32/fp16/bf16; ``tokens`` a multiple of
            ``group_size``.
        bits: One of :data:`SUPPORTED_BITS`.
        group_size: Tokens per group, a power of two.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        A :class:`PackedTensor` of kind ``"key"``.

    Raises:
        TypeError: If ``x`` is not a float tensor.
        ValueError: If ``bits`` is unsupported, ``group_size`` is not a power of two or does not
            divide the number of tokens, or ``impl`` cannot run.

    Examples:
        >>> quantize_keys(torch.randn(2, 32, 16), bits=4).codes.shape
        torch.Size([2, 32, 2])
    """
    _check_states(x, bits, group_size, "key")
    if resolve_impl(impl, x) == "torch":
        return _quantize_reference(x, bits, group_size, "key")
    return _quantize_triton(x, bits, group_size, "key")


def quantize_values(
    x: torch.Tensor, bits: int, group_size: int = 32, impl: Impl = "auto"
) -> PackedTensor:
    """Quantize and pack values per token over groups of ``group_size`` channels (KIVI values).

    Args:
        x: Values ``(..., tokens, head_dim)``, fp32/fp16/bf16; ``head_dim`` a multiple of
            ``group_size``.
        bits: One of :data:`SUPPORTED_BITS`.
        group_size: Channels per group, a power of two.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        A :class:`PackedTensor` of kind ``"value"``.

    Raises:
        TypeError: If ``x`` is not a float tensor.
        ValueError: If ``bits`` is unsupported, ``group_size`` is not a power of two or does not
            divide the head dim, or ``impl`` cannot run.

    Examples:
        >>> quantize_values(torch.randn(2, 5, 64), bits=3).codes.shape  # 4 + 2 words
        torch.Size([2, 5, 6])
    """
    _check_states(x, bits, group_size, "value")
    if resolve_impl(impl, x) == "torch":
        return _quantize_reference(x, bits, group_size, "value")
    return _quantize_triton(x, bits, group_size, "value")


def dequantize(packed: PackedTensor, impl: Impl = "auto") -> torch.Tensor:
    """Dequantize packed keys or values: ``codes * scale + zero`` in ``packed.dtype``.

    Args:
        packed: From :func:`quantize_keys` or :func:`quantize_values`.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        Tensor ``(..., tokens, head_dim)``.

    Raises:
        TypeError: If ``packed`` is not a :class:`PackedTensor` with int32 codes.
        ValueError: If its shapes are inconsistent or ``impl`` cannot run.

    Examples:
        >>> x = torch.randn(4, 64, 32)
        >>> bool((dequantize(quantize_keys(x, 8)) - x).abs().max() < 0.05)
        True
    """
    _check_packed(packed)
    if resolve_impl(impl, packed.codes, packed.scale, packed.zero) == "torch":
        return dequantize_reference(packed)
    return _dequantize_triton(packed)


# ----------------------------------------------------------------------------------------------
# Decode attention
# ----------------------------------------------------------------------------------------------


def _check_decode_args(
    query: torch.Tensor,
    segments: Sequence[QuantizedKV],
    residual_keys: torch.Tensor | None,
    residual_values: torch.Tensor | None,
    key_mask: torch.Tensor | None,
) -> int:
    """Validate the decode-attention arguments; return the total number of keys."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise InputError(f"query must have shape (batch, heads, head_dim), got {shape}")
    if query.dtype not in FLOAT_DTYPES:
        raise InputError(f"query must have dtype in {FLOAT_DTYPES}, got {query.dtype}")
    batch, heads, head_dim = query.shape
    if (residual_keys is None) != (residual_values is None):
        raise InputError("residual_keys and residual_values must be given together")
    layouts = []
    for i, seg in enumerate(segments):
        if not isinstance(seg, QuantizedKV):
            raise InputError(f"segments[{i}] must be a QuantizedKV, got {type(seg).__name__}")
        _check_packed(seg.keys)
        _check_packed(seg.values)
        lead = tuple(seg.keys.codes.shape[:-2])
        layouts.append((f"segments[{i}]", lead, seg.keys.head_dim))
    if residual_keys is not None:
        if residual_keys.dim() != 4 or residual_keys.shape != residual_values.shape:
            raise InputError(
                "residual_keys and residual_values must share a shape (batch, kv_heads, tokens, "
                f"head_dim), got {tuple(residual_keys.shape)} and {tuple(residual_values.shape)}"
            )
        layouts.append(("residual_keys", tuple(residual_keys.shape[:2]), residual_keys.shape[-1]))
    if not layouts:
        raise InputError("decode attention needs at least one segment or a residual window")
    kv_heads = layouts[0][1][-1] if len(layouts[0][1]) == 2 else -1
    for name, lead, dim in layouts:
        if len(lead) != 2 or lead[0] != batch or lead[1] != kv_heads or dim != head_dim:
            raise InputError(
                f"{name} must have batch={batch}, {kv_heads} kv heads and head_dim={head_dim} "
                f"like the first key/value tensor and the query, got leading dims {lead} and "
                f"head_dim {dim}"
            )
    if heads % kv_heads:
        raise InputError(
            f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})"
        )
    total = sum(s.num_tokens for s in segments)
    if residual_keys is not None:
        total += residual_keys.shape[-2]
    if key_mask is not None and (key_mask.dtype != torch.bool or key_mask.shape != (batch, total)):
        raise InputError(
            f"key_mask must be a bool tensor of shape (batch, keys) = {(batch, total)}, got "
            f"{key_mask.dtype} {tuple(key_mask.shape)}"
        )
    return total


def decode_attention_reference(
    query: torch.Tensor,
    segments: Sequence[QuantizedKV],
    residual_keys: torch.Tensor | None = None,
    residual_values: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one query per head over packed segments and a residual, in torch.

    The specification of :func:`decode_attention`: dequantize every segment
    (:func:`dequantize_reference`), concatenate the residual window, repeat the key/value heads
    for grouped-query attention and compute ``softmax(q k^T * scale) v`` in fp32.

    Args:
        query: ``(batch, heads, head_dim)``.
        segments: Packed key/value segments with leading dims ``(batch, kv_heads)``.
        residual_keys: Full-precision keys ``(batch, kv_heads, tokens, head_dim)`` or ``None``.
        residual_values: Full-precision values, same shape, or ``None``.
        key_mask: Optional bool ``(batch, keys)``, ``True`` where a key may be attended to, in the
            order segments then residual.
        scale: Softmax scale; ``head_dim ** -0.5`` when ``None``.
        return_lse: Also return the log-sum-exp of the scaled scores of each part.

    Returns:
        ``(batch, heads, head_dim)`` in the dtype of ``query``. A row whose keys are all masked
        gets zeros. With ``return_lse``, a pair ``(output, lse)`` where ``lse`` (fp32) has shape
        ``(batch, heads, len(segments) + 1)``: one log-sum-exp per segment, then the residual
        window's; ``-inf`` where a part has no visible key. ``exp(lse[..., i] -
        lse.logsumexp(-1))`` is the attention mass on part ``i``.

    Examples:
        >>> k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
        >>> seg = QuantizedKV(quantize_keys(k, 8), quantize_values(v, 8, 16))
        >>> decode_attention_reference(torch.randn(1, 4, 16), [seg]).shape
        torch.Size([1, 4, 16])
    """
    _check_decode_args(query, segments, residual_keys, residual_values, key_mask)
    keys = [dequantize_reference(s.keys).float() for s in segments]
    values = [dequantize_reference(s.values).float() for s in segments]
    if residual_keys is not None:
        keys.append(residual_keys.float())
        values.append(residual_values.float())
    k = torch.cat(keys, dim=-2)
    v = torch.cat(values, dim=-2)
    heads = query.shape[1]
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bhd,bhtd->bht", query.float(), k) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bht,bhtd->bhd", probs, v).to(query.dtype)
    if not return_lse:
        return out
    sizes = [s.num_tokens for s in segments]
    sizes.append(residual_keys.shape[-2] if residual_keys is not None else 0)
    lse = torch.stack([part.logsumexp(dim=-1) for part in scores.split(sizes, dim=-1)], dim=-1)
    return out, lse


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _DecodePart(NamedTuple):
    """One launch of the decode kernel: a packed segment or the full-precision window."""

    index: int  # position among the segments, then the residual window
    tokens: int
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scale, zero (or the states)
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    meta: dict[str, int]  # the kernel's constexpr bit widths, group sizes and words per token


def _num_splits(n_tokens: int, programs: int, block_t: int, num_splits: int | None) -> int:
    max_splits = max(1, _ceil_div(n_tokens, block_t))
    if num_splits is not None:
        return max(1, min(num_splits, max_splits))
    # Enough programs to fill a large GPU (~132 SMs, a few programs each), chunks of >= 4 tiles.
    want = max(1, _ceil_div(512, max(programs, 1)))
    return max(1, min(want, max(1, n_tokens // (4 * block_t)), max_splits))


def _decode_attention_triton(
    query: torch.Tensor,
    segments: Sequence[QuantizedKV],
    residual_keys: torch.Tensor | None,
    residual_values: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    scale: float,
    num_splits: int | None,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    batch, heads, head_dim = query.shape
    parts: list[_DecodePart] = []
    for index, seg in enumerate(segments):
        k, v = seg.keys, seg.values
        parts.append(
            _DecodePart(
                index,
                seg.num_tokens,
                (k.codes.contiguous(), k.scale.contiguous(), k.zero.contiguous()),
                (v.codes.contiguous(), v.scale.contiguous(), v.zero.contiguous()),
                {
                    "KEY_BITS": k.bits,
                    "VALUE_BITS": v.bits,
                    "KEY_GROUP": k.group_size,
                    "VALUE_GROUP": v.group_size,
                    "KEY_WORDS": k.codes.shape[-1],
                    "VALUE_WORDS": v.codes.shape[-1],
                },
            )
        )
    if residual_keys is not None and residual_keys.shape[-2] > 0:
        rk, rv = residual_keys.contiguous(), residual_values.contiguous()
        full_precision = {"KEY_BITS": 0, "VALUE_BITS": 0, "KEY_GROUP": 1, "VALUE_GROUP": 1}
        parts.append(
            _DecodePart(
                len(segments),
                rk.shape[-2],
                (rk, rk, rk),
                (rv, rv, rv),
                {**full_precision, "KEY_WORDS": 1, "VALUE_WORDS": 1},
            )
        )
    kv_heads = segments[0].keys.codes.shape[1] if segments else residual_keys.shape[1]
    parts = [part for part in parts if part.tokens]  # empty segments hold no keys
    gqa = heads // kv_heads
    block_t = 32
    programs = batch * kv_heads
    # Split plan per part: tokens per split (a multiple of block_t) and the number of splits.
    plans = []
    for part in parts:
        n_split = _num_splits(part.tokens, programs, block_t, num_splits)
        per_split = _ceil_div(_ceil_div(part.tokens, n_split), block_t) * block_t
        plans.append((per_split, _ceil_div(part.tokens, per_split)))
    total_splits = max(sum(n for _, n in plans), 1)
    q = query.contiguous()
    out = torch.zeros((batch, heads, total_splits, head_dim), device=q.device, dtype=torch.float32)
    lse = torch.full((batch, heads, total_splits), float("-inf"), device=q.device)
    mask = key_mask.to(torch.int8).contiguous() if key_mask is not None else q
    mask_stride = key_mask.shape[1] if key_mask is not None else 0
    split_offset = mask_offset = 0
    for part, (per_split, n_split) in zip(parts, plans, strict=True):
        _decode_attention_kernel[(programs, n_split)](
            q,
            *part.keys,
            *part.values,
            mask,
            out,
            lse,
            part.tokens,
            per_split,
            split_offset,
            total_splits,
            mask_offset,
            mask_stride,
            kv_heads,
            scale,
            GQA=gqa,
            HAS_MASK=key_mask is not None,
            HEAD_DIM=head_dim,
            BLOCK_H=max(16, triton.next_power_of_2(gqa)),
            BLOCK_T=block_t,
            BLOCK_D=max(32, triton.next_power_of_2(head_dim)),  # >= 32: one 1-bit-plane word
            num_warps=4,
            **part.meta,
        )
        split_offset += n_split
        mask_offset += part.tokens
    # Merge the partial outputs with their log-sum-exps.
    top = lse.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = torch.exp(lse - top)
    denom = weights.sum(-1, keepdim=True)
    merged = (weights.unsqueeze(-1) * out).sum(-2) / torch.where(denom > 0, denom, 1.0)
    merged = merged.to(query.dtype)
    if not return_lse:
        return merged
    part_lse = lse.new_full((batch, heads, len(segments) + 1), float("-inf"))
    start = 0
    for part, (_, n_split) in zip(parts, plans, strict=True):
        part_lse[..., part.index] = lse[..., start : start + n_split].logsumexp(dim=-1)
        start += n_split
    return merged, part_lse


def decode_attention(
    query: torch.Tensor,
    segments: Sequence[QuantizedKV],
    residual_keys: torch.Tensor | None = None,
    residual_values: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    impl: Impl = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query per head over packed KV segments plus an FP residual window.

    Triton path: one launch per segment (and one for the residual window), each split into
    ``num_splits`` chunks of tokens; every program handles one ``(batch, kv head, chunk)`` with all
    the query heads that share the kv head, dequantizes the packed keys/values in registers and
    keeps an online softmax; the partial outputs are merged by their log-sum-exp.

    Args:
        query: ``(batch, heads, head_dim)``; ``heads`` a multiple of the kv heads.
        segments: :class:`QuantizedKV` segments with leading dims ``(batch, kv_heads)``; each may
            have its own key and value bit widths and group sizes.
        residual_keys: Full-precision keys ``(batch, kv_heads, tokens, head_dim)`` or ``None``.
        residual_values: Full-precision values, same shape, or ``None``.
        key_mask: Optional bool ``(batch, keys)``: ``True`` where a key may be attended to, in the
            order segments then residual (e.g. ``False`` on left padding).
        scale: Softmax scale; ``head_dim ** -0.5`` when ``None``.
        num_splits: Chunks per segment (split-K); chosen from the sizes when ``None``.
        return_lse: Also return one log-sum-exp per segment and for the window (see
            :func:`decode_attention_reference`), e.g. to measure the attention mass on old blocks.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``(batch, heads, head_dim)`` in the dtype of ``query``; with ``return_lse`` the pair
        ``(output, lse)``, ``lse`` of shape ``(batch, heads, len(segments) + 1)``.

    Raises:
        TypeError: If an argument has the wrong type or dtype.
        ValueError: If shapes disagree (batch, kv heads, head dim, mask) or ``impl`` cannot run.

    Examples:
        >>> k, v = torch.randn(2, 2, 64, 32), torch.randn(2, 2, 64, 32)
        >>> seg = QuantizedKV(quantize_keys(k[:, :, :32], 2), quantize_values(v[:, :, :32], 2))
        >>> out = decode_attention(torch.randn(2, 4, 32), [seg], k[:, :, 32:], v[:, :, 32:])
        >>> out.shape
        torch.Size([2, 4, 32])
    """
    _check_decode_args(query, segments, residual_keys, residual_values, key_mask)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise InputError(f"num_splits must be a positive integer or None, got {num_splits!r}")
    tensors = [query]
    for s in segments:
        tensors += [s.keys.codes, s.keys.scale, s.values.codes, s.values.scale]
    if residual_keys is not None:
        tensors += [residual_keys, residual_values]
    if key_mask is not None:
        tensors.append(key_mask)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if resolve_impl(impl, *tensors) == "torch":
        return decode_attention_reference(
            query, segments, residual_keys, residual_values, key_mask, scale, return_lse
        )
    return _decode_attention_triton(
        query, segments, residual_keys, residual_values, key_mask, scale, num_splits, return_lse
    )
