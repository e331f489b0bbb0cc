"""KV quantizer study (issue 15): baseline fake quantizers and the attention-output error.

Every quantizer takes states ``(batch, heads, tokens, head_dim)`` and a bit width in
:data:`~ada_modules.kernels.kv_quant.SUPPORTED_BITS`, quantizes and dequantizes them (asymmetric
min/max, the rounding of :mod:`ada_modules.kernels.kv_quant`) and returns a
:class:`QuantizedStates`: the dequantized tensor plus the exact bits a cache would hold.

- Codes are counted as packed: ``packed_words(head_dim, bits) * 32`` bits per token row, so 3-bit
  codes of head dim 64 cost 3 bits per element.
- Side info (one scale and one zero point per group) is counted in the dtype it is stored in, the
  dtype of the input as in :mod:`~ada_modules.kernels.kv_quant`: 16 bits each for fp16/bf16
  states (the usual accounting, e.g. 1 bit per element for groups of 32), 32 bits each for fp32.

Baselines: :func:`groupwise_keys` / :func:`groupwise_values` (KIVI), :func:`static_per_channel`
(one scale per channel over the whole sequence) and :func:`pre_rope_per_channel_keys` (per channel
before RoPE, then RoPE: the KVQuant-style reference). Metrics: :func:`attention_output` and
:func:`attention_relative_mse` (decode queries attending to all keys, grouped-query attention).

Examples:
    >>> k, v, q = torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32), torch.randn(1, 4, 1, 32)
    >>> k_hat, v_hat = groupwise_keys(k, 4), groupwise_values(v, 4)
    >>> k_hat.bits_per_element  # 4 code bits + 2 * 32 / 32 bits of fp32 scale and zero
    6.0
    >>> bool(attention_relative_mse(q, k, v, k_hat.values, v_hat.values) < 0.05)
    True
"""

import math
from dataclasses import dataclass
from numbers import Real

import torch

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import FLOAT_DTYPES
from ada_modules.kernels.kv_quant import (
    SUPPORTED_BITS,
    dequantize,
    packed_words,
    quantize_keys,
    quantize_values,
)

__all__ = [
    "QuantizedStates",
    "attention_output",
    "attention_relative_mse",
    "groupwise_keys",
    "groupwise_values",
    "pre_rope_per_channel_keys",
    "static_per_channel",
]


@dataclass
class QuantizedStates:
    """Fake-quantized states and the exact bits their quantized form takes.

    Attributes:
        values: The dequantized tensor, same shape and dtype as the input.
        code_bits: Total bits of the codes as stored (packed int32 words).
        metadata_bits: Total bits of the side info (scales, zero points), in their stored dtype.
        num_elements: Number of quantized elements.

    Examples:
        >>> s = QuantizedStates(torch.zeros(2, 4), code_bits=16, metadata_bits=8, num_elements=8)
        >>> s.code_bits_per_element, s.metadata_bits_per_element, s.bits_per_element
        (2.0, 1.0, 3.0)
    """

    values: torch.Tensor
    code_bits: int
    metadata_bits: int
    num_elements: int

    @property
    def code_bits_per_element(self) -> float:
        """Code bits per element."""
        return self.code_bits / self.num_elements

    @property
    def metadata_bits_per_element(self) -> float:
        """Side-info bits per element."""
        return self.metadata_bits / self.num_elements

    @property
    def bits_per_element(self) -> float:
        """Total bits per element: codes plus side info."""
        return (self.code_bits + self.metadata_bits) / self.num_elements


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def _check_states(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise InputError(f"{name} must have dtype in {FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() != 4 or x.numel() == 0:
        raise InputError(
            f"{name} must have a non-empty shape (batch, heads, tokens, head_dim), got "
            f"{tuple(x.shape)}"
        )
    if not torch.isfinite(x).all():
        raise InputError(f"{name} must be finite, got NaN/Inf values")


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise InputError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def _code_bits(x: torch.Tensor, bits: int) -> int:
    """Bits of the packed codes of ``x``: ``packed_words(head_dim, bits)`` int32 words per row."""
    return x.numel() // x.shape[-1] * packed_words(x.shape[-1], bits) * 32


def _side_info_bits(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() * 8 for t in tensors)


# ----------------------------------------------------------------------------------------------
# Quantizers
# ----------------------------------------------------------------------------------------------


def groupwise_keys(x: torch.Tensor, bits: int, group_size: int = 32) -> QuantizedStates:
    """KIVI keys: per channel over groups of ``group_size`` tokens (:func:`quantize_keys`).

    One scale and one zero point per ``(group, channel)``, each in the dtype of ``x`` (16 bits for
    fp16/bf16: ``32 / group_size`` metadata bits per element). There is no tail group: ``tokens``
    must be a multiple of ``group_size`` (a power of two).

    Examples:
        >>> q = groupwise_keys(torch.randn(1, 2, 64, 64, dtype=torch.float16), 3)
        >>> q.values.shape, q.code_bits_per_element, q.metadata_bits_per_element
        (torch.Size([1, 2, 64, 64]), 3.0, 1.0)
    """
    _check_states("x", x)
    packed = quantize_keys(x, bits, group_size)  # checks bits and group_size
    return QuantizedStates(
        dequantize(packed),
        packed.codes.numel() * 32,
        _side_info_bits(packed.scale, packed.zero),
        x.numel(),
    )


def groupwise_values(x: torch.Tensor, bits: int, group_size: int = 32) -> QuantizedStates:
    """KIVI values: per token over groups of ``group_size`` channels (:func:`quantize_values`).

    One scale and one zero point per ``(token, channel group)``, each in the dtype of ``x`` (16 bits
    for fp16/bf16); ``head_dim`` must be a multiple of ``group_size`` (a power of two).

    Examples:
        >>> q = groupwise_values(torch.randn(1, 2, 8, 64, dtype=torch.bfloat16), 2)
        >>> q.values.dtype, q.code_bits_per_element, q.metadata_bits_per_element
        (torch.bfloat16, 2.0, 1.0)
    """
    _check_states("x", x)
    packed = quantize_values(x, bits, group_size)  # checks bits and group_size
    return QuantizedStates(
        dequantize(packed),
        packed.codes.numel() * 32,
        _side_info_bits(packed.scale, packed.zero),
        x.numel(),
    )


def _per_channel(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """Per-channel min/max quantization over all tokens: fp32 dequantized states, side-info bits."""
    levels = float(2**bits - 1)
    xf = x.float()
    mn = xf.amin(dim=-2, keepdim=True)
    mx = xf.amax(dim=-2, keepdim=True)
    scale = ((mx - mn) / levels).to(x.dtype)  # stored like kv_quant: in the dtype of x
    zero = mn.to(x.dtype)
    s, z = scale.float(), zero.float()
    codes = torch.floor((xf - z) / torch.where(s > 0, s, 1.0) + 0.5).clamp(0, levels)
    codes = torch.where(s > 0, codes, 0.0)
    return codes * s + z, _side_info_bits(scale, zero)


def static_per_channel(x: torch.Tensor, bits: int) -> QuantizedStates:
    """Static per-channel quantization: one scale and zero per (batch, head, channel), all tokens.

    Asymmetric min/max with the rounding of :mod:`~ada_modules.kernels.kv_quant`:
    ``scale = (mx - mn) / (2**bits - 1)``, ``zero = mn``, both stored in the dtype of ``x``
    (16 bits each for fp16/bf16: 32 bits per (batch, head, channel)), codes
    ``clamp(floor((x - zero) / scale + 1/2), 0, 2**bits - 1)``.

    Examples:
        >>> x = torch.tensor([[[[0.0], [1.0], [3.0], [2.0]]]])
        >>> static_per_channel(x, 2).values.flatten().tolist()
        [0.0, 1.0, 3.0, 2.0]
    """
    _check_states("x", x)
    _check_bits(bits)
    values, metadata_bits = _per_channel(x, bits)
    return QuantizedStates(values.to(x.dtype), _code_bits(x, bits), metadata_bits, x.numel())


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Hugging Face RoPE (``rotate_half``: channel ``i`` pairs with ``i + D/2``), in fp32."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=x.device).float() / head_dim))
    freqs = positions.to(x.device).float()[..., None] * inv_freq  # (..., tokens, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.dim() == 3:  # (batch, tokens, head_dim): broadcast over the heads
        emb = emb.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return x.float() * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


def pre_rope_per_channel_keys(
    keys_pre_rope: torch.Tensor,
    bits: int,
    positions: torch.Tensor | None = None,
    base: float = 10000.0,
) -> QuantizedStates:
    """Per-channel quantization of pre-RoPE keys, then RoPE (the KVQuant-style reference).

    Quantizes ``keys_pre_rope`` like :func:`static_per_channel` (scale and zero in the dtype of the
    keys, 16 bits each for fp16/bf16), then applies RoPE in the Hugging Face convention (channel
    ``i`` pairs with ``i + head_dim / 2``, ``inv_freq = base ** (-arange(0, head_dim, 2) /
    head_dim)``) in fp32, so ``values`` are post-RoPE keys comparable with the other baselines.

    Args:
        keys_pre_rope: Keys before RoPE ``(batch, heads, tokens, head_dim)``, ``head_dim`` even.
        bits: One of :data:`~ada_modules.kernels.kv_quant.SUPPORTED_BITS`.
        positions: Positions ``(tokens,)`` or ``(batch, tokens)``; ``0 .. tokens - 1`` if ``None``.
        base: RoPE base (``rope_theta``).

    Examples:
        >>> k = torch.randn(1, 2, 16, 8)
        >>> q = pre_rope_per_channel_keys(k, 8)
        >>> q.values.shape, q.metadata_bits  # 2 heads x 8 channels x (scale + zero) in fp32
        (torch.Size([1, 2, 16, 8]), 1024)
    """
    _check_states("keys_pre_rope", keys_pre_rope)
    _check_bits(bits)
    batch, _, tokens, head_dim = keys_pre_rope.shape
    if head_dim % 2:
        raise InputError(f"RoPE needs an even head_dim, got {head_dim}")
    if isinstance(base, bool) or not isinstance(base, Real) or not math.isfinite(base) or base <= 1:
        raise InputError(f"base must be a finite number > 1, got {base!r}")
    if positions is None:
        positions = torch.arange(tokens, device=keys_pre_rope.device)
    elif not isinstance(positions, torch.Tensor) or tuple(positions.shape) not in (
        (tokens,),
        (batch, tokens),
    ):
        shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
        raise InputError(
            f"positions must be a tensor of shape ({tokens},) or ({batch}, {tokens}), got {shape!r}"
        )
    elif not torch.isfinite(positions.float()).all():
        raise InputError("positions must be finite, got NaN/Inf values")
    values, metadata_bits = _per_channel(keys_pre_rope, bits)
    return QuantizedStates(
        _rope(values, positions, float(base)).to(keys_pre_rope.dtype),
        _code_bits(keys_pre_rope, bits),
        metadata_bits,
        keys_pre_rope.numel(),
    )


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------


def _check_attention_args(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None
) -> None:
    for name, t in (("queries", queries), ("keys", keys), ("values", values)):
        _check_states(name, t)
    if keys.shape != values.shape:
        raise InputError(
            f"keys and values must have the same shape, got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}"
        )
    batch, heads, _, head_dim = queries.shape
    if (batch, head_dim) != (keys.shape[0], keys.shape[-1]) or heads % keys.shape[1]:
        raise InputError(
            "queries (batch, heads, queries, head_dim) must match keys (batch, kv_heads, tokens, "
            f"head_dim) in batch and head_dim with heads a multiple of kv_heads, got "
            f"{tuple(queries.shape)} and {tuple(keys.shape)}"
        )
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, Real)
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise InputError(f"scale must be a finite positive number or None, got {scale!r}")


def _attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None
) -> torch.Tensor:
    group = queries.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # transformers' repeat_kv
    v = values.float().repeat_interleave(group, dim=1)
    scale = queries.shape[-1] ** -0.5 if scale is None else float(scale)
    probs = torch.softmax(queries.float() @ k.transpose(-1, -2) * scale, dim=-1)
    return probs @ v


def attention_output(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` in fp32, every query attending to all keys (no causal mask).

    Queries are decode queries (after the last key). Grouped-query attention: query head ``h``
    uses key/value head ``h // (heads // kv_heads)``.

    Args:
        queries: ``(batch, heads, queries, head_dim)``.
        keys: ``(batch, kv_heads, tokens, head_dim)``, ``heads`` a multiple of ``kv_heads``.
        values: Same shape as ``keys``.
        scale: Softmax scale; ``head_dim ** -0.5`` when ``None``.

    Returns:
        fp32 tensor ``(batch, heads, queries, head_dim)``.

    Examples:
        >>> k, v = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
        >>> attention_output(torch.randn(2, 6, 3, 16), k, v).shape
        torch.Size([2, 6, 3, 16])
    """
    _check_attention_args(queries, keys, values, scale)
    return _attention(queries, keys, values, scale)


def attention_relative_mse(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    keys_hat: torch.Tensor,
    values_hat: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Relative error of the attention output: ``||O - Ô||² / ||O||²`` (fp32 scalar).

    ``O`` uses ``keys``/``values`` and ``Ô`` their approximations (see :func:`attention_output`).
    Both sums run over everything (batch, heads, queries, channels): a ratio of sums, not a mean of
    per-query ratios.

    Examples:
        >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> attention_relative_mse(q, k, v, k, v).item()
        0.0
    """
    _check_attention_args(queries, keys, values, scale)
    for name, hat, ref in (("keys_hat", keys_hat, keys), ("values_hat", values_hat, values)):
        _check_states(name, hat)
        if hat.shape != ref.shape:
            raise InputError(
                f"{name} must have the shape of the reference {tuple(ref.shape)}, got "
                f"{tuple(hat.shape)}"
            )
    out = _attention(queries, keys, values, scale)
    norm = out.square().sum()
    if norm == 0:
        raise InputError("the reference attention output is all zeros (values all zero?)")
    return (out - _attention(queries, keys_hat, values_hat, scale)).square().sum() / norm
