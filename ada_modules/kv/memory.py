"""KV-cache memory: the bytes any transformers cache holds, and what a packed cache will take.

- :func:`cache_nbytes` counts the bytes a filled cache really holds (for ``kv_bytes_per_token``):
  a cache with its own ``nbytes()`` (:class:`~ada_modules.kv.KIVICache`,
  :class:`~ada_modules.kv.AdaKVQCache`), transformers' ``DynamicCache``/``StaticCache``, and
  transformers' ``QuantizedCache`` (quanto, HQQ and fp8 backends: quantized tensors, their
  scales and zero points, and the full-precision residual part).
- :func:`kv_memory` predicts the bytes per token and the ratio to an FP16 cache of the packed
  KIVI/AdaKVQ layout for given average code bits, group size, residual window, sequence length
  and scale dtype, before building anything, so that a setting can be picked to meet a memory
  target. It follows the layout :class:`~ada_modules.kv.KIVICache` stores (int32 words of packed
  codes, one scale and one zero point per group, the residual window at full precision) and
  equals the cache's :meth:`~ada_modules.kv.KIVICache.nbytes` byte for byte (``window="exact"``).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Literal

import torch
from transformers import Cache

from ada_modules.errors import InputError
from ada_modules.kernels.kv_quant import SUPPORTED_BITS, packed_words

__all__ = ["KVMemory", "cache_nbytes", "kv_memory"]

_LAYER_STATE_ATTRIBUTES = ("keys", "values", "_quantized_keys", "_quantized_values")
"""Where transformers' cache layers keep their states: ``keys``/``values`` (``DynamicLayer``,
``StaticLayer``, and the full-precision residual part of a ``QuantizedLayer``) and
``_quantized_keys``/``_quantized_values`` (``BaseQuantizedLayer``: a quanto ``QBitsTensor``, an HQQ
``(codes, meta)`` pair, or an fp8 ``(codes, scale)`` pair)."""


def _held_nbytes(obj: Any, seen: set[int]) -> int:
    """Bytes of the tensors held by ``obj``: a tensor, a tensor subclass, or containers of them.

    A tensor subclass that implements ``__tensor_flatten__`` (quanto's ``QBitsTensor`` and its
    ``PackedTensor``) is counted through its inner tensors (packed codes, scales, shifts), not by
    its logical shape. Lists, tuples and dicts (HQQ's ``meta`` with ``scale`` and ``zero``) are
    walked; anything else (ints, dtypes, shapes, strings) holds no tensor bytes. Each object is
    counted once.
    """
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if type(obj) is not torch.Tensor and callable(flatten):
            names, _ = flatten()
            return sum(_held_nbytes(getattr(obj, name), seen) for name in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_held_nbytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_held_nbytes(v, seen) for v in obj)
    return 0


def cache_nbytes(cache: Cache) -> int:
    """Exact bytes a KV cache holds.

    A cache with its own ``nbytes()`` (:class:`~ada_modules.kv.KIVICache`,
    :class:`~ada_modules.kv.AdaKVQCache`: codes, scales, zero points and residual windows) reports
    itself. Any other cache is counted from its layers' states: ``keys`` and ``values``
    (``DynamicCache``, ``StaticCache``, and the full-precision residual part of transformers'
    ``QuantizedCache``) plus a quantized layer's ``_quantized_keys`` and ``_quantized_values``,
    whatever the backend stores there: quanto's ``QBitsTensor`` (packed codes + scale + shift,
    counted through ``__tensor_flatten__``), HQQ's ``(codes, meta)`` (codes + ``meta["scale"]`` +
    ``meta["zero"]``), fp8's ``(codes, scale)``.

    Examples:
        >>> from transformers import DynamicCache
        >>> cache = DynamicCache()
        >>> _ = cache.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), layer_idx=0)
        >>> cache_nbytes(cache)  # 2 tensors x 80 fp32 elements
        640
    """
    if callable(getattr(cache, "nbytes", None)):
        return int(cache.nbytes())
    total = 0
    for layer in getattr(cache, "layers", ()):
        seen: set[int] = set()
        for name in _LAYER_STATE_ATTRIBUTES:
            total += _held_nbytes(getattr(layer, name, None), seen)
    return total


# ----------------------------------------------------------------------------------------------
# Predicted memory of the packed layout
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVMemory:
    """Bytes a packed KV cache holds for one sequence (batch 1), from :func:`kv_memory`.

    Attributes:
        seq_len: Tokens held.
        packed_tokens: Tokens in the packed history.
        window_tokens: Tokens in the full-precision residual window.
        nbytes: Bytes held by all layers (codes + scales + zero points + window). Fractional only
            when ``bits`` is a fractional average.
        bytes_per_token: ``nbytes / seq_len``.
        fp16_bytes_per_token: Bytes per token of an FP16 cache of the same model shape.
        ratio: ``bytes_per_token / fp16_bytes_per_token``.
        bits_per_element: Mean stored bits per cached key/value element, window included.
        packed_bits_per_element: Stored bits per element of the packed history alone (codes +
            metadata): what ``bits_per_element`` tends to as ``seq_len`` grows.
    """

    seq_len: int
    packed_tokens: int
    window_tokens: int
    nbytes: float
    bytes_per_token: float
    fp16_bytes_per_token: int
    ratio: float
    bits_per_element: float
    packed_bits_per_element: float


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_power_of_two(name: str, value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, Integral)
        or value < 1
        or value & (value - 1)
    ):
        raise InputError(f"{name} must be a positive power of two, got {value!r}")
    return int(value)


def _code_bytes(name: str, bits: Any, num_layers: int | None, head_dim: int) -> list[float]:
    """Bytes of the packed codes of one token and head, per layer (``None``: layers unknown)."""
    count = 1 if num_layers is None else num_layers
    if isinstance(bits, bool) or isinstance(bits, str):
        raise InputError(
            f"{name} must be a number of bits in [2, 8] or a list of widths from "
            f"{SUPPORTED_BITS}, got {bits!r}"
        )
    if isinstance(bits, Integral):
        if bits not in SUPPORTED_BITS:
            raise InputError(f"{name} as an integer must be one of {SUPPORTED_BITS}, got {bits!r}")
        return [4.0 * packed_words(head_dim, int(bits))] * count
    if isinstance(bits, Real):
        if not (math.isfinite(bits) and 2 <= bits <= 8):
            raise InputError(
                f"{name} as an average must be a finite number in [2, 8], got {bits!r}"
            )
        if head_dim % 32:
            raise InputError(
                f"{name}={bits!r} is a fractional average, whose packed size depends on the mix "
                f"of widths at head_dim={head_dim} (not a multiple of 32, so codes are padded to "
                f"int32 words): give a list of per-layer widths from {SUPPORTED_BITS}"
            )
        return [float(bits) * head_dim / 8] * count
    if not isinstance(bits, Sequence) or not bits:
        raise InputError(
            f"{name} must be a number of bits in [2, 8] or a non-empty list of widths from "
            f"{SUPPORTED_BITS}, got {bits!r}"
        )
    if num_layers is not None and len(bits) != num_layers:
        raise InputError(
            f"{name} must have one width per layer (num_layers={num_layers}), got {len(bits)}: "
            f"{list(bits)!r}"
        )
    widths = []
    for i, b in enumerate(bits):
        if isinstance(b, bool) or not isinstance(b, Integral) or b not in SUPPORTED_BITS:
            raise InputError(f"{name}[{i}] must be one of {SUPPORTED_BITS}, got {b!r}")
        widths.append(4.0 * packed_words(head_dim, int(b)))
    return widths


def _itemsize(name: str, dtype: Any) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"{name} must be a floating torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def kv_memory(
    bits: float | Sequence[int] = 2,
    value_bits: float | Sequence[int] | None = None,
    *,
    group_size: int = 32,
    value_group_size: int | None = None,
    residual_length: int = 32,
    seq_len: int = 2048,
    window: Literal["full", "exact"] = "full",
    scale_dtype: torch.dtype = torch.float16,
    residual_dtype: torch.dtype | None = None,
    head_dim: int = 128,
    num_kv_heads: int = 8,
    num_layers: int | None = None,
) -> KVMemory:
    """Bytes per token and ratio to FP16 of a packed KIVI/AdaKVQ cache, from its settings.

    The layout is :class:`~ada_modules.kv.KIVICache`'s: per token, head and layer, keys and values
    take ``packed_words(head_dim, b)`` int32 words of codes; keys carry one scale and one zero
    point per channel and group of ``group_size`` tokens, values one per token and group of
    ``value_group_size`` channels (both of ``scale_dtype``); the tokens in the residual window are
    kept at full precision (``residual_dtype``).

    Args:
        bits: Key code bits: one width of (2, 3, 4, 8); an average over layers such as ``2.5``
            (a mix of those widths, e.g. half the layers at 2 and half at 3 bits; it needs
            ``head_dim`` a multiple of 32, where no width is padded, so that only the average
            matters); or a list of per-layer widths (an AdaKVQ allocation).
        value_bits: Value code bits, likewise; ``None``: the same as ``bits``.
        group_size: Tokens per key group ``G`` (a power of two).
        value_group_size: Channels per value group (a power of two dividing ``head_dim``);
            ``None``: ``group_size``.
        residual_length: The residual window ``R`` (a multiple of ``group_size``, as the cache
            requires), or ``0`` for no window: every token packed, which gives the cost of the
            packed history alone.
        seq_len: Tokens held.
        window: ``"full"``: the window holds ``R`` tokens and the other ``seq_len - R`` are packed
            (KIVI's accounting; an upper bound of what the cache holds at about ``seq_len``
            tokens, since it flushes a block as soon as the window reaches ``R`` tokens).
            ``"exact"``: the window holds ``seq_len mod R`` tokens, the rest is packed: exactly
            what :meth:`~ada_modules.kv.KIVICache.nbytes` reports after ``seq_len`` tokens.
            Key metadata is counted per token (``1 / group_size`` of a group each), which is
            exact whenever the packed tokens are a multiple of ``group_size`` (always so with
            ``"exact"``; with ``"full"`` or no window when ``seq_len`` is).
        scale_dtype: Dtype of scales and zero points (the cache stores them in the states'
            dtype).
        residual_dtype: Dtype of the window; ``None``: ``scale_dtype``.
        head_dim: Channels per head.
        num_kv_heads: Key/value heads per layer.
        num_layers: Layers; ``None``: the length of a per-layer ``bits`` list, else 32 (the
            defaults describe Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128).

    Returns:
        A :class:`KVMemory`.

    Raises:
        InputError: If an argument is out of range, naming it.

    Examples:
        >>> m = kv_memory(2.5, group_size=32, residual_length=32, seq_len=2048)
        >>> round(m.ratio, 4), m.packed_bits_per_element  # 2.5-bit codes + 32 / 32 metadata bits
        (0.231, 3.5)
        >>> round(kv_memory(2.5, group_size=64, residual_length=0).ratio, 4)
        0.1875
    """
    head_dim = _check_int("head_dim", head_dim, 1)
    num_kv_heads = _check_int("num_kv_heads", num_kv_heads, 1)
    if num_layers is not None:
        num_layers = _check_int("num_layers", num_layers, 1)
    else:
        lists = [
            b for b in (bits, value_bits) if isinstance(b, Sequence) and not isinstance(b, str)
        ]
        num_layers = len(lists[0]) if lists and lists[0] else 32
    key_codes = _code_bytes("bits", bits, num_layers, head_dim)
    value_codes = (
        key_codes
        if value_bits is None
        else _code_bytes("value_bits", value_bits, num_layers, head_dim)
    )
    group_size = _check_power_of_two("group_size", group_size)
    if value_group_size is None:
        value_group_size = group_size
    value_group_size = _check_power_of_two("value_group_size", value_group_size)
    if head_dim % value_group_size:
        raise InputError(
            f"value_group_size={value_group_size} must divide head_dim={head_dim} (values are "
            "grouped over the channels of a head)"
        )
    residual_length = _check_int("residual_length", residual_length, 0)
    if residual_length % group_size:
        raise InputError(
            f"residual_length must be 0 or a multiple of group_size={group_size}, got "
            f"{residual_length}"
        )
    seq_len = _check_int("seq_len", seq_len, 1)
    if window not in ("full", "exact"):
        raise InputError(f"window must be 'full' or 'exact', got {window!r}")
    scale_size = _itemsize("scale_dtype", scale_dtype)
    window_size = _itemsize(
        "residual_dtype", scale_dtype if residual_dtype is None else residual_dtype
    )

    if residual_length == 0:
        window_tokens = 0
    elif window == "full":
        window_tokens = min(residual_length, seq_len)
    else:
        window_tokens = seq_len % residual_length
    packed_tokens = seq_len - window_tokens
    # Per packed token and head: codes, then a scale and a zero point per group.
    key_meta = 2 * scale_size * head_dim / group_size
    value_meta = 2 * scale_size * head_dim / value_group_size
    packed_per_token = num_kv_heads * sum(
        k + v + key_meta + value_meta for k, v in zip(key_codes, value_codes, strict=True)
    )
    window_per_token = num_layers * num_kv_heads * 2 * head_dim * window_size
    nbytes = packed_tokens * packed_per_token + window_tokens * window_per_token
    if nbytes == round(nbytes):
        nbytes = float(round(nbytes))
    elements_per_token = num_layers * num_kv_heads * 2 * head_dim
    fp16_per_token = elements_per_token * 2
    return KVMemory(
        seq_len=seq_len,
        packed_tokens=packed_tokens,
        window_tokens=window_tokens,
        nbytes=nbytes,
        bytes_per_token=nbytes / seq_len,
        fp16_bytes_per_token=fp16_per_token,
        ratio=nbytes / seq_len / fp16_per_token,
        bits_per_element=8 * nbytes / (seq_len * elements_per_token),
        packed_bits_per_element=8 * packed_per_token / elements_per_token,
    )
