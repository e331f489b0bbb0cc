"""ADKV codes: the stored format, its decode by prefix sums, and decode attention over it.

ADKV (adaptive delta quantization of the KV cache) codes each channel of a ``(batch, heads,
tokens, head_dim)`` stream with a backward-adaptive quantizer: a predicted centre ``mu`` and a
step ``s`` per channel are updated from the *decoded* value only, so the decoder replays them from
the codes and no per-group scales or zero points are stored. The encoder is in
:mod:`ada_modules.kv.adkv`; this module fixes the format and decodes it.

**Codes.** A ``b``-bit code ``c`` in ``[0, 2**b)`` stands for the mid-rise level
``v = c - 2**(b-1) + 1/2`` (``2v`` is an odd integer), and token ``t`` decodes to
``x_t = mu_{t-1} + s_{t-1} * v_t``. Codes are packed along the channels with
:func:`~ada_modules.kernels.kv_quant.pack_codes` (the layout of the KIVI cache).

**Step.** ``s = 2**(e / 8)`` on a grid of eighth-octaves, held as an integer exponent ``e``;
exactly, ``s(e) = STEP_MANTISSA[e % 8] * 2**(e // 8 - 7)`` (a 7-bit mantissa table, so every step
is an exact fp32 number). After each token ``e += multipliers[j]`` where ``j = |2v| // 2`` is the
code's magnitude index and ``multipliers`` a per-channel int table of ``2**(b-1)`` entries
(Jayant's multiplicative rule in eighth-octaves).

**Centre.** An exponential moving average of the decoded values,
``mu_t = mu_{t-1} + alpha * (x_t - mu_{t-1}) = mu_{t-1} + alpha * s_{t-1} * v_t`` with
``alpha = (alpha_code + 1) / 256``. It is kept in fixed point relative to the last keyframe
``(mu_P, e_P)``: ``mu_t = mu_P + a_t * s(e_P) * 2**-16`` with the integer accumulator
``a_t = sum (alpha_code + 1) * STEP_MANTISSA[r] * (2v) * 2**q`` over the segment's tokens so far,
where ``e_{t-1} - e_P = 8q + r`` (a shift right, i.e. floor, when ``q < 0``). All state updates
are integer additions, so a sequential decoder and a prefix-sum decoder (``cumsum`` of ``e`` and
``a``, in any order) give **bitwise equal** fp32 outputs.

**Keyframes.** Every ``keyframe_period`` tokens (and at token 0) the state is stored:
``mu_P`` in fp16, ``e_P`` in int16. Segments between keyframes decode independently (random
access, parallel decode); the encoder keeps ``e`` within ``e_P ± 8 * MAX_SEGMENT_OCTAVES`` and
``± EXPONENT_LIMIT`` by its choice of codes, so the decoder never clamps.

**Kernels.** :func:`adkv_dequantize` decodes with one program per (row, keyframe segment, block
of channels), in tiles of tokens: exclusive ``tl.cumsum`` of the exponent increments and of the
integer centre increments, the running sums carried from tile to tile, so its output is bitwise
that of :func:`adkv_dequantize_reference`. :func:`adkv_decode_attention` is the fused "ADKV-GEMV"
for one new query per head: every program decodes the keys and values of a run of whole keyframe
segments in registers, keeps an online softmax for all the query heads of its kv head, and the
partial outputs (with the residual window's, from
:func:`~ada_modules.kernels.kv_quant.decode_attention`'s kernel) are merged by their log-sum-exp.

Each operation has the three parts of the kernel pattern (see :mod:`ada_modules.kernels`):
``_<name>_kernel`` (Triton), ``<name>_reference`` (torch, the specification) and
``<name>(..., impl="auto")``.

Examples:
    >>> step_from_exponent(torch.tensor([0, 8, -8, 4]))
    tensor([1.0000, 2.0000, 0.5000, 1.4141])
"""

# Triton reads argument annotations as types and specialisations, so kernel arguments stay bare.
# ruff: noqa: ANN001

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import FLOAT_DTYPES, Impl, resolve_impl, triton_available
from ada_modules.kernels.kv_quant import (
    SUPPORTED_BITS,
    _ceil_div,
    _num_splits,
    decode_attention_reference,
    packed_words,
    unpack_codes,
)

__all__ = [
    "CENTRE_FRACTION_BITS",
    "EXPONENT_LIMIT",
    "MAX_SEGMENT_OCTAVES",
    "STEP_MANTISSA",
    "STEP_RESOLUTION",
    "ADKVTensor",
    "adkv_decode_attention",
    "adkv_decode_attention_reference",
    "adkv_dequantize",
    "adkv_dequantize_reference",
    "centre_increment",
    "step_from_exponent",
]


STEP_RESOLUTION = 8
"""Step exponents count eighth-octaves: ``s = 2**(e / STEP_RESOLUTION)``."""

STEP_MANTISSA = tuple(round(128 * 2 ** (k / STEP_RESOLUTION)) for k in range(STEP_RESOLUTION))
"""``round(128 * 2**(k/8))``: ``s(e) = STEP_MANTISSA[e % 8] * 2**(e // 8 - 7)`` exactly."""

CENTRE_FRACTION_BITS = 16
"""The centre accumulator counts units of ``s(e_P) * 2**-16`` (``e_P``: the keyframe's exponent)."""

MAX_SEGMENT_OCTAVES = 16
"""Within a keyframe segment the step stays within ``2**±16`` of the keyframe's step."""

EXPONENT_LIMIT = 64 * STEP_RESOLUTION
"""Step exponents stay in ``[-EXPONENT_LIMIT, EXPONENT_LIMIT]`` (steps ``2**-64`` to ``2**64``)."""


@dataclass
class ADKVTensor:
    """ADKV codes of a ``(batch, heads, tokens, head_dim)`` stream with everything to decode them.

    Attributes:
        codes: int32 words ``(batch, heads, tokens, packed_words(head_dim, bits))``.
        keyframe_centre: fp16 ``(batch, heads, keyframes, head_dim)``: ``mu`` at each keyframe.
        keyframe_exponent: int16, same shape: the step exponent ``e`` at each keyframe.
        alpha_code: uint8 per-channel centre rates (``alpha = (alpha_code + 1) / 256``), shape
            broadcastable to ``(heads, head_dim)``.
        multipliers: int8 step-exponent increments per code magnitude, shape broadcastable to
            ``(heads, head_dim, 2**(bits-1))``.
        bits: Bits per code, one of 2, 3, 4, 8.
        head_dim: Number of channels.
        keyframe_period: Tokens per keyframe segment (keyframe ``k`` is at token ``k * period``).
    """

    codes: torch.Tensor
    keyframe_centre: torch.Tensor
    keyframe_exponent: torch.Tensor
    alpha_code: torch.Tensor
    multipliers: torch.Tensor
    bits: int
    head_dim: int
    keyframe_period: int

    @property
    def num_tokens(self) -> int:
        """Number of tokens held."""
        return self.codes.shape[-2]

    def code_nbytes(self) -> int:
        """Bytes of the packed codes."""
        return self.codes.numel() * self.codes.element_size()

    def keyframe_nbytes(self) -> int:
        """Bytes of the keyframes (they grow with ``tokens / keyframe_period``)."""
        return sum(
            t.numel() * t.element_size() for t in (self.keyframe_centre, self.keyframe_exponent)
        )

    def parameter_nbytes(self) -> int:
        """Bytes of the per-channel parameters (independent of the number of tokens and, when
        shared, of the batch)."""
        return sum(t.numel() * t.element_size() for t in (self.alpha_code, self.multipliers))

    def nbytes(self) -> int:
        """Exact bytes held: codes + keyframes + per-channel parameters."""
        return self.code_nbytes() + self.keyframe_nbytes() + self.parameter_nbytes()

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "ADKVTensor":
        """Apply ``fn`` to the per-sequence tensors (codes, keyframes), e.g. a batch
        ``index_select``; the per-channel parameters are shared and kept."""
        return ADKVTensor(
            fn(self.codes),
            fn(self.keyframe_centre),
            fn(self.keyframe_exponent),
            self.alpha_code,
            self.multipliers,
            self.bits,
            self.head_dim,
            self.keyframe_period,
        )


def step_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """The fp32 step ``STEP_MANTISSA[e % 8] * 2**(e // 8 - 7)`` of integer exponents (exact).

    Examples:
        >>> step_from_exponent(torch.tensor([16, 1])).tolist()
        [4.0, 1.09375]
    """
    exponent = exponent.to(torch.int64)
    mantissa = torch.tensor(STEP_MANTISSA, dtype=torch.float32, device=exponent.device)
    octave = torch.div(exponent, STEP_RESOLUTION, rounding_mode="floor")
    return torch.ldexp(mantissa[exponent % STEP_RESOLUTION], (octave - 7).to(torch.float32))


def centre_increment(
    alpha_code: torch.Tensor, relative_exponent: torch.Tensor, level2: torch.Tensor
) -> torch.Tensor:
    """Integer centre increment ``(alpha_code + 1) * STEP_MANTISSA[r] * level2 * 2**q``.

    Args:
        alpha_code: Per-channel rate codes (int, broadcastable).
        relative_exponent: ``e_{t-1} - e_P`` (int, ``8q + r``).
        level2: ``2v``, the odd integer level of the code.

    Returns:
        int64, in units of ``s(e_P) * 2**-16``; a right shift (floor) when ``q < 0``.

    Examples:
        >>> centre_increment(torch.tensor(255), torch.tensor([0, 8, -8]), torch.tensor(1)).tolist()
        [32768, 65536, 16384]
    """
    mantissa = torch.tensor(STEP_MANTISSA, dtype=torch.int64, device=relative_exponent.device)
    relative_exponent = relative_exponent.to(torch.int64)
    q = torch.div(relative_exponent, STEP_RESOLUTION, rounding_mode="floor")
    base = (alpha_code.to(torch.int64) + 1) * mantissa[relative_exponent % STEP_RESOLUTION]
    base = base * level2.to(torch.int64)
    return torch.where(q >= 0, base << q.clamp_min(0), base >> (-q).clamp_min(0))


def check_adkv_tensor(packed: ADKVTensor) -> None:
    """Raise :class:`~ada_modules.errors.InputError` if ``packed``'s shapes or dtypes disagree."""
    if packed.bits not in SUPPORTED_BITS:
        raise InputError(f"bits must be one of {SUPPORTED_BITS}, got {packed.bits!r}")
    if packed.codes.dim() != 4 or packed.codes.dtype != torch.int32:
        raise InputError(
            "codes must be int32 of shape (batch, heads, tokens, words), got "
            f"{packed.codes.dtype} {tuple(packed.codes.shape)}"
        )
    words = packed_words(packed.head_dim, packed.bits)
    if packed.codes.shape[-1] != words:
        raise InputError(
            f"codes have {packed.codes.shape[-1]} words per token, expected {words} for "
            f"head_dim={packed.head_dim} at {packed.bits} bits"
        )
    keyframes = -(-packed.num_tokens // packed.keyframe_period)
    expected = (*packed.codes.shape[:2], keyframes, packed.head_dim)
    for name in ("keyframe_centre", "keyframe_exponent"):
        t = getattr(packed, name)
        if tuple(t.shape) != expected:
            raise InputError(
                f"{name} must have shape (batch, heads, ceil(tokens / period), head_dim) = "
                f"{expected}, got {tuple(t.shape)}"
            )
    levels = 2 ** (packed.bits - 1)
    if packed.multipliers.shape[-1:] != (levels,):
        raise InputError(
            f"multipliers must end in {levels} entries (2**(bits-1)) for bits={packed.bits}, "
            f"got shape {tuple(packed.multipliers.shape)}"
        )


def _segment_state(packed: ADKVTensor) -> tuple[torch.Tensor, ...]:
    """Unpacked levels ``2v`` and each token's step-exponent increment ``multipliers[j]``."""
    check_adkv_tensor(packed)
    batch, heads, tokens, _ = packed.codes.shape
    codes = unpack_codes(packed.codes, packed.bits, packed.head_dim).to(torch.int64)
    level2 = 2 * codes - (2**packed.bits - 1)
    magnitude = level2.abs() // 2
    table = packed.multipliers.to(torch.int64).expand(heads, packed.head_dim, -1)
    table = table.expand(batch, heads, packed.head_dim, -1)
    increments = torch.gather(table, -1, magnitude.transpose(-1, -2)).transpose(-1, -2)
    return level2, increments


def adkv_dequantize_reference(packed: ADKVTensor) -> torch.Tensor:
    """Decode ADKV codes by prefix sums within keyframe segments, in torch (the specification).

    Per segment: ``e_{t-1} = e_P + exclusive_cumsum(multipliers[j])``, the centre accumulator
    ``a_{t-1}`` is the exclusive cumsum of :func:`centre_increment`, and
    ``x_t = (mu_P + a_{t-1} * (s(e_P) * 2**-16)) + s(e_{t-1}) * v_t`` in fp32.

    Args:
        packed: The codes and their keyframes and parameters.

    Returns:
        fp32 ``(batch, heads, tokens, head_dim)``.

    Examples:
        >>> from ada_modules.kv.adkv import ADKVParams, adkv_encode
        >>> x = torch.randn(1, 2, 40, 16)
        >>> packed = adkv_encode(x, ADKVParams.default(4), keyframe_period=16)
        >>> adkv_dequantize_reference(packed).shape
        torch.Size([1, 2, 40, 16])
    """
    level2, increments = _segment_state(packed)
    batch, heads, tokens, dim = level2.shape
    period = packed.keyframe_period
    segments = packed.keyframe_centre.shape[-2]
    pad = segments * period - tokens
    alpha = packed.alpha_code.to(torch.int64).expand(heads, dim)

    def by_segment(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.reshape(batch, heads, segments, period, dim)

    level2, increments = by_segment(level2), by_segment(increments)
    key_exp = packed.keyframe_exponent.to(torch.int64).unsqueeze(-2)
    relative = increments.cumsum(-2) - increments  # exclusive: e_{t-1} - e_P
    centre_steps = centre_increment(alpha[:, None, None, :], relative, level2)
    accumulated = centre_steps.cumsum(-2) - centre_steps  # a_{t-1}
    unit = torch.ldexp(step_from_exponent(key_exp), torch.tensor(-CENTRE_FRACTION_BITS * 1.0))
    centre = packed.keyframe_centre.float().unsqueeze(-2) + accumulated.float() * unit
    x = centre + step_from_exponent(key_exp + relative) * (level2.float() * 0.5)
    return x.reshape(batch, heads, segments * period, dim)[:, :, :tokens]


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without growing it."""
    if len(shape) > len(target):
        return False
    return all(s in (1, n) for s, n in zip(reversed(shape), reversed(target), strict=False))


def _check_packed(packed: object, name: str) -> None:
    """:func:`check_adkv_tensor` plus the type, the period and the parameters' shapes; errors
    name ``name``."""
    if not isinstance(packed, ADKVTensor):
        raise InputError(f"{name} must be an ADKVTensor, got {type(packed).__name__}")
    period = packed.keyframe_period
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise InputError(f"{name}.keyframe_period must be an int >= 1, got {period!r}")
    try:
        check_adkv_tensor(packed)
    except InputError as err:
        raise InputError(f"{name}: {err}") from None
    heads, dim, levels = packed.codes.shape[1], packed.head_dim, 2 ** (packed.bits - 1)
    for attr, dims, target in (
        ("alpha_code", "(heads, head_dim)", (heads, dim)),
        ("multipliers", "(heads, head_dim, 2**(bits-1))", (heads, dim, levels)),
    ):
        shape = tuple(getattr(packed, attr).shape)
        if not _broadcasts(shape, target):
            raise InputError(f"{name}.{attr} must broadcast to {dims} = {target}, got {shape}")


def _check_decode_args(
    query: torch.Tensor,
    keys: ADKVTensor | None,
    values: ADKVTensor | None,
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
    if (keys is None) != (values is None):
        raise InputError("keys and values must be given together (or both be None)")
    if (residual_keys is None) != (residual_values is None):
        raise InputError("residual_keys and residual_values must be given together")
    layouts = []
    if keys is not None:
        _check_packed(keys, "keys")
        _check_packed(values, "values")
        if keys.num_tokens != values.num_tokens:
            raise InputError(
                f"keys and values must hold the same tokens, got {keys.num_tokens} and "
                f"{values.num_tokens}"
            )
        if keys.keyframe_period != values.keyframe_period:
            raise InputError(
                "keys and values must share keyframe_period, got "
                f"{keys.keyframe_period} and {values.keyframe_period}"
            )
        layouts.append(("keys", tuple(keys.codes.shape[:2]), keys.head_dim))
        layouts.append(("values", tuple(values.codes.shape[:2]), values.head_dim))
    if residual_keys is not None:
        if (
            not isinstance(residual_keys, torch.Tensor)
            or not isinstance(residual_values, torch.Tensor)
            or residual_keys.dim() != 4
            or residual_keys.shape != residual_values.shape
            or not (residual_keys.is_floating_point() and residual_values.is_floating_point())
        ):
            got = [
                f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                for t in (residual_keys, residual_values)
            ]
            raise InputError(
                "residual_keys and residual_values must be float tensors of one shape (batch, "
                f"kv_heads, tokens, head_dim), got {got[0]} and {got[1]}"
            )
        layouts.append(("residual_keys", tuple(residual_keys.shape[:2]), residual_keys.shape[-1]))
    if not layouts:
        raise InputError("decode attention needs packed keys/values or a residual window")
    kv_heads = layouts[0][1][1]
    for name, lead, dim in layouts:
        if lead != (batch, kv_heads) or dim != head_dim:
            raise InputError(
                f"{name} must have batch={batch}, {kv_heads} kv heads and head_dim={head_dim} "
                f"like the query and the first key/value tensor, got leading dims {lead} and "
                f"head_dim {dim}"
            )
    if kv_heads == 0 or heads % kv_heads:
        raise InputError(
            f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})"
        )
    total = keys.num_tokens if keys is not None else 0
    if residual_keys is not None:
        total += residual_keys.shape[-2]
    if key_mask is not None and (
        not isinstance(key_mask, torch.Tensor)
        or key_mask.dtype != torch.bool
        or key_mask.shape != (batch, total)
    ):
        got = (
            f"{key_mask.dtype} {tuple(key_mask.shape)}"
            if isinstance(key_mask, torch.Tensor)
            else type(key_mask).__name__
        )
        raise InputError(
            f"key_mask must be a bool tensor of shape (batch, keys) = {(batch, total)}, got {got}"
        )
    return total


# ----------------------------------------------------------------------------------------------
# Decode attention: reference
# ----------------------------------------------------------------------------------------------


def adkv_decode_attention_reference(
    query: torch.Tensor,
    keys: ADKVTensor | None,
    values: ADKVTensor | None,
    residual_keys: torch.Tensor | None = None,
    residual_values: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention of one query per head over ADKV keys/values and a residual, in torch.

    The specification of :func:`adkv_decode_attention`: decode the packed keys and values
    (:func:`adkv_dequantize_reference`), append the residual window and compute
    ``softmax(q k^T * scale) v`` in fp32 with grouped-query attention, as
    :func:`~ada_modules.kernels.kv_quant.decode_attention_reference` does.

    Args:
        query: ``(batch, heads, head_dim)``.
        keys: ADKV keys with leading dims ``(batch, kv_heads)``, or ``None`` (no packed history).
        values: ADKV values of the same tokens and keyframe period, or ``None`` with ``keys``.
        residual_keys: Full-precision keys ``(batch, kv_heads, tokens, head_dim)`` or ``None``.
        residual_values: Full-precision values, same shape, or ``None``.
        key_mask: Optional bool ``(batch, keys)``, ``True`` where a key may be attended to, in the
            order packed then residual.
        scale: Softmax scale; ``head_dim ** -0.5`` when ``None``.

    Returns:
        ``(batch, heads, head_dim)`` in the dtype of ``query``; a row whose keys are all masked
        gets zeros.

    Examples:
        >>> from ada_modules.kv.adkv import ADKVParams, adkv_encode
        >>> k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
        >>> pk, pv = (adkv_encode(x, ADKVParams.default(4), keyframe_period=8) for x in (k, v))
        >>> adkv_decode_attention_reference(torch.randn(1, 4, 16), pk, pv).shape
        torch.Size([1, 4, 16])
    """
    _check_decode_args(query, keys, values, residual_keys, residual_values, key_mask)
    k, v = [], []
    if keys is not None:
        k.append(adkv_dequantize_reference(keys))
        v.append(adkv_dequantize_reference(values))
    if residual_keys is not None:
        k.append(residual_keys.float())
        v.append(residual_values.float())
    return decode_attention_reference(
        query, [], torch.cat(k, dim=-2), torch.cat(v, dim=-2), key_mask, scale
    )


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl

    from ada_modules.kernels.kv_quant import _decode_attention_kernel

    @triton.jit
    def _unpack_tile(
        row_ptrs,
        d,
        mask,
        BITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        # Channels d [BLOCK_D] (any slice: ADKV tiles channels) of each token, one load per code,
        # in kv_quant's packing: row_ptrs [BLOCK_T] point to each token's words. Returns the codes
        # [BLOCK_T, BLOCK_D] as int32.
        if BITS == 3:
            w0 = tl.load(row_ptrs[:, None] + (d // 16)[None, :], mask=mask, other=0)
            c = (w0 >> ((d % 16) * 2)[None, :]) & 3
            N0: tl.constexpr = (HEAD_DIM + 15) // 16
            w1 = tl.load(row_ptrs[:, None] + N0 + (d // 32)[None, :], mask=mask, other=0)
            c = c | (((w1 >> (d % 32)[None, :]) & 1) << 2)
        else:
            PER: tl.constexpr = 32 // BITS
            w = tl.load(row_ptrs[:, None] + (d // PER)[None, :], mask=mask, other=0)
            c = (w >> ((d % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
        return c

    def _int32_bytes(values: tuple[int, ...]) -> int:
        """Four bytes packed little-endian into one int32 (signed, as the kernels compute)."""
        word = sum(v << (8 * i) for i, v in enumerate(values))
        return word - 2**32 if word >= 2**31 else word

    # STEP_MANTISSA as a byte table in two int32 words (every entry is < 256).
    _MANTISSA_LOW = tl.constexpr(_int32_bytes(STEP_MANTISSA[:4]))
    _MANTISSA_HIGH = tl.constexpr(_int32_bytes(STEP_MANTISSA[4:]))
    _UNIT_OFFSET = tl.constexpr(CENTRE_FRACTION_BITS * STEP_RESOLUTION)  # s(e - 128) = s(e) / 2**16

    @triton.jit
    def _step_mantissa(r):
        # STEP_MANTISSA[r] for r in [0, 8), as int32: byte r % 4 of the low or the high word.
        word = tl.where(r < 4, _MANTISSA_LOW, _MANTISSA_HIGH)
        return (word >> ((r & 3) << 3)) & 255

    @triton.jit
    def _step(e):
        # s(e) = STEP_MANTISSA[e % 8] * 2**(e // 8 - 7), exact: the power of two is built from its
        # fp32 bit pattern (not exp2, which may be approximate). `& 7` and `>> 3` are the floor
        # modulo and division also for e < 0.
        power = (((e >> 3) - 7 + 127) << 23).to(tl.float32, bitcast=True)
        return _step_mantissa(e & 7).to(tl.float32) * power

    @triton.jit
    def _keyframe(centre_ptr, exponent_ptr, index, d, d_mask, HEAD_DIM: tl.constexpr):
        # Keyframe `index` (row * segments + segment): mu_P (fp32), e_P (int32) and the unit
        # s(e_P) * 2**-16 of the centre accumulator, per channel d.
        offsets = index * HEAD_DIM + d
        centre = tl.load(centre_ptr + offsets, mask=d_mask, other=0.0).to(tl.float32)
        exponent = tl.load(exponent_ptr + offsets, mask=d_mask, other=0).to(tl.int32)
        return centre, exponent, _step(exponent - _UNIT_OFFSET)

    @triton.jit
    def _channel_tables(
        alpha_ptr,
        alpha_stride_h,
        alpha_stride_d,
        mult_ptr,
        mult_stride_h,
        mult_stride_d,
        head,
        d,
        d_mask,
    ):
        # alpha_code + 1 (int32) and pointers to each channel's multiplier table (stride 0 where
        # the parameters are shared).
        alpha = tl.load(
            alpha_ptr + head * alpha_stride_h + d * alpha_stride_d, mask=d_mask, other=0
        )
        return alpha.to(tl.int32) + 1, mult_ptr + head * mult_stride_h + d * mult_stride_d

    @triton.jit
    def _adkv_decode_tile(
        row_ptrs,
        d,
        mask,
        alpha1,
        mult_ptrs,
        mult_stride_l,
        key_centre,
        key_exponent,
        unit,
        e_run,
        a_run,
        BITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        # Decode a tile [BLOCK_T, BLOCK_D] of one segment: row_ptrs [BLOCK_T] point to each token's
        # words, e_run / a_run [BLOCK_D] are e - e_P and the centre accumulator before the tile.
        # Returns the fp32 tile and the two sums after it. Masked tokens only ever come last in a
        # segment, so the sums they add are never used.
        c = _unpack_tile(row_ptrs, d, mask, BITS, HEAD_DIM)
        level2 = 2 * c - ((1 << BITS) - 1)  # 2v, odd
        inc = tl.load(
            mult_ptrs[None, :] + (tl.abs(level2) >> 1) * mult_stride_l, mask=mask, other=0
        )
        inc = inc.to(tl.int32)
        relative = e_run[None, :] + tl.cumsum(inc, axis=0) - inc  # e_{t-1} - e_P, exclusive
        q = relative >> 3
        # (alpha_code + 1) * STEP_MANTISSA[r] * 2v < 2**8 * 2**8 * 2**8 fits int32; shifted, int64.
        base = (alpha1[None, :] * _step_mantissa(relative & 7) * level2).to(tl.int64)
        steps = tl.where(q >= 0, base << tl.maximum(q, 0), base >> tl.maximum(-q, 0))
        accumulated = a_run[None, :] + tl.cumsum(steps, axis=0) - steps  # a_{t-1}
        centre = key_centre[None, :] + accumulated.to(tl.float32) * unit[None, :]
        x = centre + _step(key_exponent[None, :] + relative) * (level2.to(tl.float32) * 0.5)
        return x, e_run + tl.sum(inc, axis=0), a_run + tl.sum(steps, axis=0)

    @triton.jit
    def _adkv_dequantize_kernel(
        codes_ptr,
        centre_ptr,
        exponent_ptr,
        alpha_ptr,
        mult_ptr,
        out_ptr,
        n_tokens,
        period,
        heads,
        alpha_stride_h,
        alpha_stride_d,
        mult_stride_h,
        mult_stride_d,
        mult_stride_l,
        BITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        N_WORDS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        segment = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)  # batch * heads + head
        d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        key_centre, key_exponent, unit = _keyframe(
            centre_ptr, exponent_ptr, row * tl.cdiv(n_tokens, period) + segment, d, d_mask, HEAD_DIM
        )
        alpha1, mult_ptrs = _channel_tables(
            alpha_ptr,
            alpha_stride_h,
            alpha_stride_d,
            mult_ptr,
            mult_stride_h,
            mult_stride_d,
            row % heads,
            d,
            d_mask,
        )
        e_run = tl.zeros((BLOCK_D,), dtype=tl.int32)
        a_run = tl.zeros((BLOCK_D,), dtype=tl.int64)
        start = segment * period
        end = tl.minimum(start + period, n_tokens)
        for t0 in range(start, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            mask = (t < end)[:, None] & d_mask[None, :]
            x, e_run, a_run = _adkv_decode_tile(
                codes_ptr + (row * n_tokens + t) * N_WORDS,
                d,
                mask,
                alpha1,
                mult_ptrs,
                mult_stride_l,
                key_centre,
                key_exponent,
                unit,
                e_run,
                a_run,
                BITS,
                HEAD_DIM,
            )
            out = out_ptr + (row * n_tokens + t)[:, None] * HEAD_DIM + d[None, :]
            tl.store(out, x, mask=mask)

    @triton.jit
    def _adkv_decode_attention_kernel(
        q_ptr,
        k_codes_ptr,
        k_centre_ptr,
        k_exponent_ptr,
        k_alpha_ptr,
        k_mult_ptr,
        v_codes_ptr,
        v_centre_ptr,
        v_exponent_ptr,
        v_alpha_ptr,
        v_mult_ptr,
        mask_ptr,
        out_ptr,
        lse_ptr,
        n_tokens,
        period,
        segments_per_split,
        total_splits,
        mask_stride,
        kv_heads,
        sm_scale,
        k_alpha_stride_h,
        k_alpha_stride_d,
        k_mult_stride_h,
        k_mult_stride_d,
        k_mult_stride_l,
        v_alpha_stride_h,
        v_alpha_stride_d,
        v_mult_stride_h,
        v_mult_stride_d,
        v_mult_stride_l,
        GQA: tl.constexpr,
        HAS_MASK: tl.constexpr,
        KEY_BITS: tl.constexpr,
        VALUE_BITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        KEY_WORDS: tl.constexpr,
        VALUE_WORDS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        split = tl.program_id(0)  # a run of whole keyframe segments
        row = tl.program_id(1).to(tl.int64)  # batch * kv_heads + kv head
        batch = row // kv_heads
        kv_head = row % kv_heads
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_mask = h < GQA
        d_mask = d < HEAD_DIM
        q_rows = batch * kv_heads * GQA + kv_head * GQA + h  # the query heads of this kv head
        q = tl.load(
            q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        k_alpha1, k_mult_ptrs = _channel_tables(
            k_alpha_ptr,
            k_alpha_stride_h,
            k_alpha_stride_d,
            k_mult_ptr,
            k_mult_stride_h,
            k_mult_stride_d,
            kv_head,
            d,
            d_mask,
        )
        v_alpha1, v_mult_ptrs = _channel_tables(
            v_alpha_ptr,
            v_alpha_stride_h,
            v_alpha_stride_d,
            v_mult_ptr,
            v_mult_stride_h,
            v_mult_stride_d,
            kv_head,
            d,
            d_mask,
        )
        m_i = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        n_segments = tl.cdiv(n_tokens, period)
        first = split * segments_per_split
        for segment in range(first, tl.minimum(first + segments_per_split, n_segments)):
            k_centre, k_exponent, k_unit = _keyframe(
                k_centre_ptr, k_exponent_ptr, row * n_segments + segment, d, d_mask, HEAD_DIM
            )
            v_centre, v_exponent, v_unit = _keyframe(
                v_centre_ptr, v_exponent_ptr, row * n_segments + segment, d, d_mask, HEAD_DIM
            )
            k_e = tl.zeros((BLOCK_D,), dtype=tl.int32)
            k_a = tl.zeros((BLOCK_D,), dtype=tl.int64)
            v_e = tl.zeros((BLOCK_D,), dtype=tl.int32)
            v_a = tl.zeros((BLOCK_D,), dtype=tl.int64)
            start = segment * period
            end = tl.minimum(start + period, n_tokens)
            for t0 in range(start, end, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                valid = t < end
                mask = valid[:, None] & d_mask[None, :]
                k, k_e, k_a = _adkv_decode_tile(
                    k_codes_ptr + (row * n_tokens + t) * KEY_WORDS,
                    d,
                    mask,
                    k_alpha1,
                    k_mult_ptrs,
                    k_mult_stride_l,
                    k_centre,
                    k_exponent,
                    k_unit,
                    k_e,
                    k_a,
                    KEY_BITS,
                    HEAD_DIM,
                )
                v, v_e, v_a = _adkv_decode_tile(
                    v_codes_ptr + (row * n_tokens + t) * VALUE_WORDS,
                    d,
                    mask,
                    v_alpha1,
                    v_mult_ptrs,
                    v_mult_stride_l,
                    v_centre,
                    v_exponent,
                    v_unit,
                    v_e,
                    v_a,
                    VALUE_BITS,
                    HEAD_DIM,
                )
                if HAS_MASK:
                    keep = tl.load(mask_ptr + batch * mask_stride + t, mask=valid, other=0)
                    valid = valid & (keep != 0)
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale
                s = tl.where(valid[None, :], s, -1.0e30)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
                m_i = m_new
        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        out_rows = q_rows * total_splits + split
        tl.store(
            out_ptr + out_rows[:, None] * HEAD_DIM + d[None, :],
            out,
            mask=h_mask[:, None] & d_mask[None, :],
        )
        tl.store(lse_ptr + out_rows, lse, mask=h_mask)


def _channel_parameters(packed: ADKVTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``alpha_code`` as ``(heads, head_dim)`` and ``multipliers`` as ``(heads, head_dim, levels)``
    views (stride 0 along what is shared)."""
    heads, dim = packed.codes.shape[1], packed.head_dim
    return (
        packed.alpha_code.expand(heads, dim),
        packed.multipliers.expand(heads, dim, 2 ** (packed.bits - 1)),
    )


def _tile_shape(period: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_D, num_warps)`` of a decode tile: one warp lane per channel (up to 128
    channels per program), so that the prefix sums along the tokens stay within a thread, and at
    most 8 tokens per tile (fewer for shorter segments)."""
    block_d = max(16, min(128, triton.next_power_of_2(head_dim)))
    return min(8, triton.next_power_of_2(period)), block_d, max(1, block_d // 32)


def _adkv_dequantize_triton(packed: ADKVTensor) -> torch.Tensor:
    batch, heads, tokens, words = packed.codes.shape
    dim = packed.head_dim
    out = torch.empty((batch, heads, tokens, dim), dtype=torch.float32, device=packed.codes.device)
    if out.numel():
        alpha, mult = _channel_parameters(packed)
        block_t, block_d, num_warps = _tile_shape(packed.keyframe_period, dim)
        grid = (packed.keyframe_centre.shape[-2], batch * heads, triton.cdiv(dim, block_d))
        _adkv_dequantize_kernel[grid](
            packed.codes.contiguous(),
            packed.keyframe_centre.contiguous(),
            packed.keyframe_exponent.contiguous(),
            alpha,
            mult,
            out,
            tokens,
            packed.keyframe_period,
            heads,
            *alpha.stride(),
            *mult.stride(),
            BITS=packed.bits,
            HEAD_DIM=dim,
            N_WORDS=words,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            num_warps=num_warps,
            enable_fp_fusion=False,  # no fma contraction: bitwise equal to the reference
        )
    return out


def adkv_dequantize(packed: ADKVTensor, impl: Impl = "auto") -> torch.Tensor:
    """Decode ADKV codes to fp32 ``(batch, heads, tokens, head_dim)``.

    Triton path: one program per (row, keyframe segment, block of channels); tokens in tiles,
    exclusive prefix sums of the integer state carried from tile to tile. Bitwise equal to
    :func:`adkv_dequantize_reference` (integer state, the same float formula, no fma
    contraction).

    Args:
        packed: The codes with their keyframes and per-channel parameters.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        fp32 ``(batch, heads, tokens, head_dim)``.

    Raises:
        InputError: If ``packed`` is not a consistent :class:`ADKVTensor` or ``impl`` cannot run.

    Examples:
        >>> from ada_modules.kv.adkv import ADKVParams, adkv_encode
        >>> packed = adkv_encode(torch.randn(1, 2, 37, 16), ADKVParams.default(3), 16)
        >>> torch.equal(adkv_dequantize(packed), adkv_dequantize_reference(packed))
        True
    """
    _check_packed(packed, "packed")
    tensors = (
        packed.codes,
        packed.keyframe_centre,
        packed.keyframe_exponent,
        packed.alpha_code,
        packed.multipliers,
    )
    if resolve_impl(impl, *tensors) == "torch":
        return adkv_dequantize_reference(packed)
    return _adkv_dequantize_triton(packed)


def _segments_per_split(segments: int, programs: int, period: int, num_splits: int | None) -> int:
    if num_splits is not None:
        return _ceil_div(segments, min(num_splits, segments))
    # Enough programs to fill a large GPU (~132 SMs, several programs each); beyond that, runs of
    # about 512 tokens, so that short periods do not multiply the partial outputs.
    return max(1, min(_ceil_div(512, period), segments * programs // 1024))


def _merge_partials(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum the partial outputs ``(..., splits, d)`` weighted by ``exp(lse)`` (normalised)."""
    top = lse.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = torch.exp(lse - top)
    denom = weights.sum(-1, keepdim=True)
    return ((weights.unsqueeze(-1) * out).sum(-2) / torch.where(denom > 0, denom, 1.0)).to(dtype)


def _adkv_decode_attention_triton(
    query: torch.Tensor,
    keys: ADKVTensor | None,
    values: ADKVTensor | None,
    residual_keys: torch.Tensor | None,
    residual_values: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    scale: float,
    num_splits: int | None,
) -> torch.Tensor:
    batch, heads, head_dim = query.shape
    kv_heads = (keys.codes if keys is not None else residual_keys).shape[1]
    rows = batch * kv_heads
    packed_tokens = keys.num_tokens if keys is not None else 0
    residual_tokens = residual_keys.shape[-2] if residual_keys is not None else 0
    segments = _ceil_div(packed_tokens, keys.keyframe_period) if packed_tokens else 0
    segments_per_split = (
        _segments_per_split(segments, rows, keys.keyframe_period, num_splits) if segments else 1
    )
    splits = _ceil_div(segments, segments_per_split)
    if residual_tokens:
        residual_splits = _num_splits(residual_tokens, rows, 32, num_splits)
        residual_per_split = _ceil_div(_ceil_div(residual_tokens, residual_splits), 32) * 32
        residual_splits = _ceil_div(residual_tokens, residual_per_split)
    else:
        residual_splits = residual_per_split = 0
    total_splits = max(splits + residual_splits, 1)
    q = query.contiguous()
    out = torch.zeros((batch, heads, total_splits, head_dim), device=q.device, dtype=torch.float32)
    lse = torch.full((batch, heads, total_splits), float("-inf"), device=q.device)
    mask = key_mask.to(torch.int8).contiguous() if key_mask is not None else q
    gqa = heads // kv_heads
    common = {"GQA": gqa, "HAS_MASK": key_mask is not None, "HEAD_DIM": head_dim}
    mask_stride = key_mask.shape[1] if key_mask is not None else 0
    if splits:
        block_t, _, num_warps = _tile_shape(keys.keyframe_period, head_dim)
        k_alpha, k_mult = _channel_parameters(keys)
        v_alpha, v_mult = _channel_parameters(values)
        _adkv_decode_attention_kernel[(splits, rows)](
            q,
            keys.codes.contiguous(),
            keys.keyframe_centre.contiguous(),
            keys.keyframe_exponent.contiguous(),
            k_alpha,
            k_mult,
            values.codes.contiguous(),
            values.keyframe_centre.contiguous(),
            values.keyframe_exponent.contiguous(),
            v_alpha,
            v_mult,
            mask,
            out,
            lse,
            packed_tokens,
            keys.keyframe_period,
            segments_per_split,
            total_splits,
            mask_stride,
            kv_heads,
            scale,
            *k_alpha.stride(),
            *k_mult.stride(),
            *v_alpha.stride(),
            *v_mult.stride(),
            KEY_BITS=keys.bits,
            VALUE_BITS=values.bits,
            KEY_WORDS=keys.codes.shape[-1],
            VALUE_WORDS=values.codes.shape[-1],
            BLOCK_H=triton.next_power_of_2(gqa),
            BLOCK_T=block_t,
            BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=num_warps,
            **common,
        )
    if residual_tokens:
        rk, rv = residual_keys.contiguous(), residual_values.contiguous()
        _decode_attention_kernel[(rows, residual_splits)](
            q,
            rk,
            rk,
            rk,
            rv,
            rv,
            rv,
            mask,
            out,
            lse,
            residual_tokens,
            residual_per_split,
            splits,
            total_splits,
            packed_tokens,
            mask_stride,
            kv_heads,
            scale,
            KEY_BITS=0,
            VALUE_BITS=0,
            KEY_GROUP=1,
            VALUE_GROUP=1,
            KEY_WORDS=1,
            VALUE_WORDS=1,
            BLOCK_H=max(16, triton.next_power_of_2(gqa)),  # tl.dot needs >= 16
            BLOCK_T=32,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            num_warps=4,
            **common,
        )
    return _merge_partials(out, lse, query.dtype)


def adkv_decode_attention(
    query: torch.Tensor,
    keys: ADKVTensor | None,
    values: ADKVTensor | None,
    residual_keys: torch.Tensor | None = None,
    residual_values: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Attention of one new query per head over ADKV keys/values plus an FP residual window.

    Triton path (fused "ADKV-GEMV", split-K): every program takes one (batch, kv head, run of
    whole keyframe segments), decodes its keys and values in registers by prefix sums from each
    keyframe, scores all the query heads that share the kv head and keeps an online softmax; the
    residual window runs :func:`~ada_modules.kernels.kv_quant.decode_attention`'s kernel, and all
    partial outputs are merged by their log-sum-exp.

    Args:
        query: ``(batch, heads, head_dim)``; ``heads`` a multiple of the kv heads.
        keys: ADKV keys with leading dims ``(batch, kv_heads)``, or ``None`` (no packed history).
        values: ADKV values of the same tokens and keyframe period (the bit widths may differ),
            or ``None`` with ``keys``.
        residual_keys: Full-precision keys ``(batch, kv_heads, tokens, head_dim)`` or ``None``.
        residual_values: Full-precision values, same shape, or ``None``.
        key_mask: Optional bool ``(batch, keys)``: ``True`` where a key may be attended to, in the
            order packed then residual (e.g. ``False`` on left padding).
        scale: Softmax scale; ``head_dim ** -0.5`` when ``None``.
        num_splits: Chunks (split-K) of the packed history, each a run of whole keyframe
            segments, and of the residual window; chosen from the sizes when ``None``.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``(batch, heads, head_dim)`` in the dtype of ``query``; zeros where every key is masked.

    Raises:
        InputError: If shapes disagree (batch, kv heads, head dim, tokens, period, mask), an
            argument has the wrong type or dtype, or ``impl`` cannot run.

    Examples:
        >>> from ada_modules.kv.adkv import ADKVParams, adkv_encode
        >>> k, v = torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
        >>> pk, pv = (adkv_encode(x[:, :, :32], ADKVParams.default(2), 16) for x in (k, v))
        >>> out = adkv_decode_attention(torch.randn(2, 4, 32), pk, pv, k[:, :, 32:], v[:, :, 32:])
        >>> out.shape
        torch.Size([2, 4, 32])
    """
    _check_decode_args(query, keys, values, residual_keys, residual_values, key_mask)
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise InputError(f"num_splits must be a positive integer or None, got {num_splits!r}")
    tensors = [query]
    for p in (keys, values) if keys is not None else ():
        tensors += [p.codes, p.keyframe_centre, p.keyframe_exponent, p.alpha_code, p.multipliers]
    if residual_keys is not None:
        tensors += [residual_keys, residual_values]
    if key_mask is not None:
        tensors.append(key_mask)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if resolve_impl(impl, *tensors) == "torch":
        return adkv_decode_attention_reference(
            query, keys, values, residual_keys, residual_values, key_mask, scale
        )
    return _adkv_decode_attention_triton(
        query, keys, values, residual_keys, residual_values, key_mask, scale, num_splits
    )
