"""One layer of a packed low-bit KV cache: a full-precision residual window over packed history.

:class:`QuantizedKVLayer` is a transformers ``CacheLayerMixin``. New tokens go into a
full-precision *residual window*; whenever the window holds ``residual_length`` tokens or more,
the oldest whole blocks of ``residual_length`` tokens are quantized **once** with
:func:`~ada_modules.kernels.kv_quant.quantize_keys` (per channel over groups of
``key_group_size`` tokens) and :func:`~ada_modules.kernels.kv_quant.quantize_values` (per token
over groups of ``value_group_size`` channels) and appended to the packed history; history is never
dequantized and re-quantized (unlike transformers' ``QuantizedLayer``, which re-quantizes the
whole cache at every flush).

**Bits per block.** Every flushed block of ``residual_length`` tokens gets its own
``(key_bits, value_bits)`` from :meth:`QuantizedKVLayer.choose_block_bits`, which returns the
layer's ``key_bits``/``value_bits`` here and can be overridden (AdaKVQ's dynamic allocation).
The packed history is a list of :class:`~ada_modules.kernels.kv_quant.QuantizedKV` *segments*:
consecutive blocks with equal bit widths share one segment (``segments``), and
``block_bits`` records the bits of every flushed block in order.

**What attention sees.** ``update`` returns keys/values for any attention function of a
transformers model: the packed history dequantized, then the residual window and the new tokens
at full precision. Once there is packed history, they are :class:`LazyDequantizedStates` wrapper
tensors that dequantize only when an operation reads them. With the standard attention functions
(``"sdpa"``, ``"eager"``) every decode step therefore dequantizes the whole history of the layer
(O(tokens) time, and one layer's transient copy in peak memory); the *stored* cache stays packed,
which is what :meth:`QuantizedKVLayer.nbytes` counts. With ``attn_implementation="quantized_kv"``
(:func:`quantized_kv_attention`, registered on import), decode steps read the packed codes with
:func:`~ada_modules.kernels.kv_quant.decode_attention` (the fused split-K Triton kernel on CUDA)
and never build the dequantized copy; prefill still uses SDPA.
"""

from collections.abc import Callable
from numbers import Integral
from typing import Any

import torch
from torch.utils._pytree import tree_map
from transformers import AttentionInterface
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ada_modules.attention.dense_fallback import dense_attention_forward, eager_only_features
from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import FLOAT_DTYPES, Impl
from ada_modules.kernels.adkv_decode import ADKVTensor, adkv_decode_attention, adkv_dequantize
from ada_modules.kernels.kv_quant import (
    SUPPORTED_BITS,
    PackedTensor,
    QuantizedKV,
    decode_attention,
    dequantize,
    quantize_keys,
    quantize_values,
)

__all__ = [
    "QUANTIZED_KV_ATTENTION",
    "LazyDequantizedStates",
    "QuantizedKVLayer",
    "check_bits",
    "check_group_size",
    "quantized_kv_attention",
]


def check_group_size(name: str, value: object) -> None:
    """Raise :class:`~ada_modules.errors.InputError` naming ``name`` unless ``value`` is a
    positive power of two (an ``int``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise InputError(f"{name} must be a positive power of two, got {value!r}")


def check_bits(name: str, value: object) -> None:
    """Raise :class:`~ada_modules.errors.InputError` naming ``name`` unless ``value`` is a
    supported bit width: an ``int`` (not a ``bool`` or a ``float``) in :data:`SUPPORTED_BITS`."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value not in SUPPORTED_BITS:
        raise InputError(
            f"{name} must be one of {SUPPORTED_BITS} (an int), got {value!r} "
            f"({type(value).__name__})"
        )


class QuantizedKVLayer(CacheLayerMixin):
    """KV-cache layer with a full-precision residual window and packed, per-block-bit history.

    Args:
        key_bits: Default bits of flushed key blocks, one of 2, 3, 4, 8.
        value_bits: Default bits of flushed value blocks, one of 2, 3, 4, 8.
        key_group_size: Tokens per key quantization group (per channel), a power of two.
        value_group_size: Channels per value quantization group (per token), a power of two
            dividing the head dim (checked on the first update).
        residual_length: Tokens kept at full precision; also the size of a flushed block. A
            multiple of ``key_group_size``.
        impl: Kernel implementation for quantize/dequantize/decode attention (``"auto"``:
            Triton on CUDA tensors, torch otherwise).

    Attributes:
        keys: The full-precision residual keys ``(batch, kv_heads, r, head_dim)``, ``r <
            residual_length`` between updates.
        values: The residual values, same shape.
        segments: Packed history, oldest first.
        block_bits: ``(key_bits, value_bits)`` of each flushed block, oldest first.
        cumulative_length: Tokens seen (packed + residual).

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> layer = QuantizedKVLayer(key_bits=2, value_bits=4, residual_length=32)
        >>> k, v = torch.randn(1, 2, 70, 64), torch.randn(1, 2, 70, 64)
        >>> keys, values = layer.update(k, v)
        >>> keys.shape, layer.get_seq_length(), layer.block_bits, layer.keys.shape[-2]
        (torch.Size([1, 2, 70, 64]), 70, [(2, 4), (2, 4)], 6)
    """

    is_compileable = False
    is_croppable = False
    state_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    """The dtypes of the states the layer stores (checked before anything is stored)."""
    records_decode_lse = False
    """Whether :func:`quantized_kv_attention` passes each decode step's per-segment log-sum-exps
    to :meth:`observe_decode_lse` (set ``True`` in a subclass that uses them)."""

    def __init__(
        self,
        key_bits: int = 2,
        value_bits: int = 2,
        key_group_size: int = 32,
        value_group_size: int = 32,
        residual_length: int = 32,
        impl: Impl = "auto",
    ) -> None:
        super().__init__()
        check_bits("key_bits", key_bits)
        check_bits("value_bits", value_bits)
        check_group_size("key_group_size", key_group_size)
        check_group_size("value_group_size", value_group_size)
        if (
            isinstance(residual_length, bool)
            or not isinstance(residual_length, int)
            or residual_length < 1
            or residual_length % key_group_size
        ):
            multiple = (
                f"multiple of key_group_size={key_group_size}" if key_group_size > 1 else "int"
            )
            raise InputError(
                f"residual_length must be a positive {multiple}, got {residual_length!r}"
            )
        if impl not in ("auto", "triton", "torch"):
            raise InputError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
        self.key_bits = int(key_bits)
        self.value_bits = int(value_bits)
        self.key_group_size = key_group_size
        self.value_group_size = value_group_size
        self.residual_length = residual_length
        self.impl: Impl = impl
        self.segments: list[QuantizedKV] = []
        self.block_bits: list[tuple[int, int]] = []
        self.cumulative_length = 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key_bits={self.key_bits}, value_bits={self.value_bits}, "
            f"key_group_size={self.key_group_size}, value_group_size={self.value_group_size}, "
            f"residual_length={self.residual_length})"
        )

    # ------------------------------------------------------------------------------------------
    # CacheLayerMixin
    # ------------------------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Set up an empty residual window for states like ``key_states``."""
        head_dim = key_states.shape[-1]
        if head_dim % self.value_group_size:
            raise InputError(
                f"value_group_size={self.value_group_size} must divide the head dim, got "
                f"head_dim={head_dim}"
            )
        self.device = key_states.device
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self.is_initialized = True

    def choose_block_bits(
        self, block_index: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[int, int]:
        """Bits ``(key_bits, value_bits)`` of the block being flushed (override for AdaKVQ).

        Args:
            block_index: Index of the block among all blocks this layer flushed (0 = oldest).
            keys: The block's full-precision keys ``(batch, kv_heads, residual_length,
                head_dim)``.
            values: The block's values, same shape.

        Returns:
            The layer's ``(key_bits, value_bits)``.
        """
        return self.key_bits, self.value_bits

    def _flush(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize whole blocks of ``residual_length`` tokens and append them to the history."""
        r = self.residual_length
        runs: list[tuple[tuple[int, int], int, int]] = []  # (bits, start, end) of equal-bit runs
        for start in range(0, keys.shape[-2], r):
            bits = self.choose_block_bits(
                len(self.block_bits),
                keys[..., start : start + r, :],
                values[..., start : start + r, :],
            )
            check_bits("choose_block_bits()[0]", bits[0])
            check_bits("choose_block_bits()[1]", bits[1])
            self.block_bits.append((bits[0], bits[1]))
            if runs and runs[-1][0] == bits:
                runs[-1] = (bits, runs[-1][1], start + r)
            else:
                runs.append((bits, start, start + r))
        for (key_bits, value_bits), start, end in runs:
            seg = QuantizedKV(
                quantize_keys(
                    keys[..., start:end, :], key_bits, self.key_group_size, impl=self.impl
                ),
                quantize_values(
                    values[..., start:end, :], value_bits, self.value_group_size, impl=self.impl
                ),
            )
            last = self.segments[-1] if self.segments else None
            if last is not None and (last.keys.bits, last.values.bits) == (key_bits, value_bits):
                seg = QuantizedKV(
                    PackedTensor.cat([last.keys, seg.keys]),
                    PackedTensor.cat([last.values, seg.values]),
                )
                self.segments[-1] = seg
            else:
                self.segments.append(seg)

    def dequantized_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed history dequantized: keys and values ``(batch, kv_heads, packed, head_dim)``."""
        if not self.segments:
            return self.keys[..., :0, :], self.values[..., :0, :]
        keys = [dequantize(s.keys, impl=self.impl) for s in self.segments]
        values = [dequantize(s.values, impl=self.impl) for s in self.segments]
        return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new states; return all keys/values (history dequantized, the rest as given).

        Args:
            key_states: New keys ``(batch, kv_heads, new_tokens, head_dim)`` (post-RoPE).
            value_states: New values, same shape.

        Returns:
            Keys and values ``(batch, kv_heads, seen_tokens, head_dim)`` in the order of the
            tokens: the packed history dequantized, then the residual window and the new tokens
            at full precision. Once there is packed history they are
            :class:`LazyDequantizedStates`: the history is dequantized when an operation first
            reads them, and :func:`quantized_kv_attention` reads the packed codes instead.
        """
        if key_states.shape != value_states.shape:
            raise InputError(
                f"key_states and value_states must have one shape, got {tuple(key_states.shape)} "
                f"and {tuple(value_states.shape)}"
            )
        self._check_states(key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        segments = list(self.segments)  # the history before this update, as attention sees it
        window_keys = torch.cat([self.keys, key_states], dim=-2)
        window_values = torch.cat([self.values, value_states], dim=-2)
        if segments:
            keys_out = LazyDequantizedStates(segments, window_keys, "key", self.impl, self)
            values_out = LazyDequantizedStates(segments, window_values, "value", self.impl, self)
        else:
            keys_out, values_out = window_keys, window_values
        self.cumulative_length += key_states.shape[-2]
        window_keys, window_values, n_flush = self._prepare_flush(window_keys, window_values)
        if n_flush:
            self._flush(window_keys[..., :n_flush, :], window_values[..., :n_flush, :])
            window_keys = window_keys[..., n_flush:, :].clone()
            window_values = window_values[..., n_flush:, :].clone()
        self.keys, self.values = window_keys, window_values
        return keys_out, values_out

    def _check_states(self, states: torch.Tensor) -> None:
        """Refuse, before anything is stored, states the layer cannot take or that do not match
        the ones it holds (dtype, batch size, heads, head dim)."""
        name = type(self).__name__
        if states.dtype not in self.state_dtypes:
            allowed = ", ".join(str(d) for d in self.state_dtypes)
            raise InputError(
                f"{name} stores states of dtype {allowed}, got {states.dtype} (use a "
                "DynamicCache for this model, or cast it)"
            )
        if not self.cumulative_length:
            return
        held = self.keys
        if states.dtype != held.dtype:
            raise InputError(f"{name} holds {held.dtype} states, got {states.dtype}")
        if states.shape[0] != held.shape[0]:
            raise InputError(
                f"the cache holds batch size {held.shape[0]}, got states of batch size "
                f"{states.shape[0]}"
            )
        if (states.shape[1], states.shape[-1]) != (held.shape[1], held.shape[-1]):
            raise InputError(
                f"{name} holds {held.shape[1]} kv heads of dim {held.shape[-1]}, got states of "
                f"shape {tuple(states.shape)}"
            )

    def _prepare_flush(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The window to keep or flush, and how many of its leading tokens to flush (whole
        blocks of ``residual_length``); a subclass may rewrite the window or hold it back."""
        return keys, values, keys.shape[-2] // self.residual_length * self.residual_length

    def attend(
        self,
        query: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        scale: float | None = None,
        num_splits: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One decode step's attention read straight from the packed cache (no dequantized copy).

        Args:
            query: ``(batch, heads, head_dim)``, one new query per head (GQA: ``heads`` a
                multiple of the cache's kv heads).
            key_mask: Optional bool ``(batch, seen_tokens)``, ``True`` where a key is visible.
            scale: Softmax scale, ``head_dim ** -0.5`` when ``None``.
            num_splits: Split-K chunks per segment, automatic when ``None``.
            return_lse: Also return the per-segment log-sum-exps.

        Returns:
            ``(batch, heads, head_dim)`` (and the log-sum-exps), see
            :func:`~ada_modules.kernels.kv_quant.decode_attention`.
        """
        if not self.is_initialized or self.cumulative_length == 0:
            raise InputError("attend needs a cache that holds at least one token")
        return decode_attention(
            query,
            self.segments,
            self.keys,
            self.values,
            key_mask,
            scale,
            num_splits,
            return_lse=return_lse,
            impl=self.impl,
        )

    def observe_decode_lse(self, lse: torch.Tensor) -> None:
        """Receive a decode step's log-sum-exps when ``records_decode_lse`` is set (a hook).

        Called by :func:`quantized_kv_attention` after the attention of one new token, with
        ``lse`` of shape ``(batch, heads, len(segments) + 1)`` from
        :func:`~ada_modules.kernels.kv_quant.decode_attention`: one entry per packed segment of the
        history this step attended to, then the full-precision window (``-inf`` for a part without
        visible keys). ``exp(lse[..., i] - lse.logsumexp(-1))`` is the attention mass on segment
        ``i`` (e.g. the far-attention mass AdaKVQ's dynamic allocation measures).

        Raises:
            NotImplementedError: Always here; a subclass that sets ``records_decode_lse``
                implements it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} sets records_decode_lse but does not implement "
            "observe_decode_lse"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the attention mask: every seen token plus the query."""
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens held (packed history + residual window)."""
        return self.cumulative_length

    def get_max_length(self) -> int:
        """``-1``: the layer grows without a maximum."""
        return -1

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not self.is_initialized:
            return
        self.segments = [QuantizedKV(s.keys.map(fn), s.values.map(fn)) for s in self.segments]
        self.keys = fn(self.keys)
        self.values = fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search (exact: packed codes are moved, not re-quantized)."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch entries ``indices``."""
        self._map_batch(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch entry ``repeats`` times (e.g. for ``num_return_sequences``)."""
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens, if they are all in the residual window.

        Raises:
            ValueError: If ``tokens_to_remove`` is positive or reaches into packed history.
        """
        if tokens_to_remove > 0:
            raise InputError(
                f"crop takes a non-positive number of tokens to remove, got {tokens_to_remove}"
            )
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n > self.keys.shape[-2]:
            raise InputError(
                f"cannot crop {n} tokens: only the {self.keys.shape[-2]} tokens of the residual "
                "window are kept at full precision; packed history cannot be un-flushed"
            )
        self.keys = self.keys[..., : self.keys.shape[-2] - n, :]
        self.values = self.values[..., : self.values.shape[-2] - n, :]
        self.cumulative_length -= n

    def offload(self) -> None:
        """Move the layer's tensors (packed history included) to the CPU."""
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        """Move the layer's tensors back to its device."""
        if self.is_initialized and self.keys.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    def reset(self) -> None:
        """Drop every token; the next update starts afresh."""
        self.keys = self.values = None
        self.segments = []
        self.block_bits = []
        self.cumulative_length = 0
        self.is_initialized = False

    # ------------------------------------------------------------------------------------------
    # Accounting
    # ------------------------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Exact bytes held: packed codes + scales + zero points + the residual window."""
        if not self.is_initialized:
            return 0
        packed = sum(s.nbytes() for s in self.segments)
        return packed + sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def fp_nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes the same tokens take in a full-precision cache of ``dtype`` (the states' dtype)."""
        if not self.is_initialized:
            return 0
        batch, kv_heads, _, head_dim = self.keys.shape
        itemsize = torch.empty((), dtype=dtype or self.keys.dtype).element_size()
        return 2 * batch * kv_heads * self.cumulative_length * head_dim * itemsize


class LazyDequantizedStates(torch.Tensor):
    """Keys or values returned by :meth:`QuantizedKVLayer.update`, dequantized on first use.

    A wrapper tensor of shape ``(batch, kv_heads, tokens, head_dim)`` over packed segments and a
    full-precision window. Any torch operation on it dequantizes the segments once (with the
    layer's ``impl``), concatenates the window and runs on that tensor, so every attention
    function sees correct values. :func:`quantized_kv_attention` instead passes ``segments`` and
    ``window`` to :func:`~ada_modules.kernels.kv_quant.decode_attention` and never dequantizes.

    Args:
        segments: Packed history, oldest first (both keys and values).
        window: Full-precision states after the history.
        kind: ``"key"`` or ``"value"``: which half of the segments this tensor stands for.
        impl: Kernel implementation used to dequantize.
        layer: The layer whose ``update`` made it (for :func:`quantized_kv_attention`'s hook), or
            ``None``.

    Examples:
        >>> from ada_modules.kernels.kv_quant import quantize_keys, quantize_values
        >>> k = torch.randn(1, 1, 32, 16)
        >>> seg = QuantizedKV(quantize_keys(k, 8, 32), quantize_values(k, 8, 16))
        >>> lazy = LazyDequantizedStates([seg], torch.zeros(1, 1, 3, 16), "key", "torch")
        >>> lazy.shape, bool((lazy[..., :32, :] - k).abs().max() < 0.05)
        (torch.Size([1, 1, 35, 16]), True)
    """

    segments: list[QuantizedKV]
    window: torch.Tensor

    @staticmethod
    def __new__(
        cls: type["LazyDequantizedStates"],
        segments: list[QuantizedKV],
        window: torch.Tensor,
        kind: str,
        impl: Impl,
        layer: "QuantizedKVLayer | None" = None,
    ) -> "LazyDequantizedStates":
        tokens = sum(s.num_tokens for s in segments) + window.shape[-2]
        shape = (*window.shape[:-2], tokens, window.shape[-1])
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=window.dtype, device=window.device
        )

    def __init__(
        self,
        segments: list[QuantizedKV],
        window: torch.Tensor,
        kind: str,
        impl: Impl,
        layer: "QuantizedKVLayer | None" = None,
    ) -> None:
        self.segments = segments
        self.window = window
        self.kind = kind
        self.impl = impl
        self.layer = layer
        self._value: torch.Tensor | None = None

    def __repr__(self) -> str:  # noqa: D105
        return (
            f"LazyDequantizedStates(kind={self.kind!r}, shape={tuple(self.shape)}, "
            f"segments={len(self.segments)}, window={self.window.shape[-2]})"
        )

    def materialize(self) -> torch.Tensor:
        """The dequantized history and the window as one plain tensor (computed once)."""
        if self._value is None:
            parts = [
                _dequantize_part(s.keys if self.kind == "key" else s.values, self.impl)
                for s in self.segments
            ]
            parts = [p.to(self.window.dtype) for p in parts]  # ADKV decodes to fp32
            self._value = torch.cat([*parts, self.window], dim=-2)
        return self._value

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(
        cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        def unwrap(t: Any) -> Any:
            return t.materialize() if isinstance(t, LazyDequantizedStates) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def _dequantize_part(part: PackedTensor | ADKVTensor, impl: Impl) -> torch.Tensor:
    """Dequantize one half of a history segment: group-wise packed codes or ADKV codes."""
    if isinstance(part, ADKVTensor):
        return adkv_dequantize(part, impl=impl)
    return dequantize(part, impl=impl)


def _key_mask(attention_mask: torch.Tensor | None, keys: int) -> torch.Tensor | None:
    """Boolean ``(batch, keys)`` visibility of the keys for the last query, or ``None``."""
    if attention_mask is None:
        return None
    last = attention_mask[:, 0, -1, -keys:]
    if last.dtype == torch.bool:
        return last
    return last > torch.finfo(last.dtype).min / 2  # additive float mask: 0 visible, min hidden


def quantized_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function that decodes straight from a packed cache (``"quantized_kv"``).

    Registered with transformers' ``AttentionInterface`` (and SDPA's mask function) under the name
    :data:`QUANTIZED_KV_ATTENTION` when this module is imported. For one new token per sequence
    (``query`` length 1) whose keys/values come from a :class:`QuantizedKVLayer` with packed
    history, it calls :func:`~ada_modules.kernels.kv_quant.decode_attention` on the packed
    segments and the full-precision window (the fused Triton kernel on CUDA) and, when the layer
    sets ``records_decode_lse``, hands the per-segment log-sum-exps to its
    ``observe_decode_lse``; for an :class:`~ada_modules.kv.ADKVLayer` it calls the fused ADKV
    decode attention (:func:`~ada_modules.kernels.adkv_decode.adkv_decode_attention`) on the
    delta codes instead. Everything else (prefill, caches of other types, dropout, float64, and
    the logit softcapping and attention sinks the packed kernels do not implement) goes to dense
    attention (:func:`~ada_modules.attention.dense_fallback.dense_attention_forward`: SDPA, or
    the model's eager attention for softcapping and sinks).

    Args:
        module: The attention module (unused by the decode path).
        query: ``(batch, heads, q_len, head_dim)``.
        key: ``(batch, kv_heads, kv_len, head_dim)``, a :class:`LazyDequantizedStates` on the
            decode path.
        value: Like ``key``.
        attention_mask: SDPA boolean mask ``(batch, 1, q_len, kv_len)``, an additive float mask,
            or ``None``.
        dropout: Dropout probability; non-zero falls back to dense attention.
        scaling: Softmax scale.
        **kwargs: Passed on to the dense fallback.

    Returns:
        ``(attn_output, None)`` with ``attn_output`` of shape ``(batch, q_len, heads, head_dim)``.
    """
    if (
        query.shape[2] == 1
        and isinstance(key, LazyDequantizedStates)
        and isinstance(value, LazyDequantizedStates)
        and dropout == 0.0
        and query.dtype in FLOAT_DTYPES
        and not eager_only_features(kwargs)
    ):
        key_mask = _key_mask(attention_mask, key.shape[-2])
        if isinstance(key.segments[0].keys, ADKVTensor):  # one delta-coded history (ADKVLayer)
            (history,) = key.segments
            out = adkv_decode_attention(
                query[:, :, 0],
                history.keys,
                history.values,
                key.window,
                value.window,
                key_mask,
                scaling,
                impl=key.impl,
            )
            return out.unsqueeze(1), None
        record = key.layer is not None and key.layer.records_decode_lse
        out = decode_attention(
            query[:, :, 0],
            key.segments,
            key.window,
            value.window,
            key_mask,
            scaling,
            return_lse=record,
            impl=key.impl,
        )
        if record:
            out, lse = out
            key.layer.observe_decode_lse(lse)
        return out.unsqueeze(1), None
    return dense_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


QUANTIZED_KV_ATTENTION = "quantized_kv"
"""``attn_implementation`` name of :func:`quantized_kv_attention`."""

AttentionInterface.register(QUANTIZED_KV_ATTENTION, quantized_kv_attention)
AttentionMaskInterface.register(QUANTIZED_KV_ATTENTION, sdpa_mask)
