"""ADKV KV cache for transformers' ``generate``: delta-coded history behind a residual window.

:class:`ADKVLayer` is a :class:`~ada_modules.kv.quantized_layer.QuantizedKVLayer` whose flushed
blocks are appended to two streaming :class:`~ada_modules.kv.adkv.ADKVEncoder` (keys and values,
post-RoPE, per channel along the tokens) instead of group-wise packed segments: the history holds
packed codes, one keyframe per ``keyframe_period`` tokens and per-channel parameters, so its
metadata does not grow with the context beyond the keyframes. :class:`ADKVCache` is a
transformers ``Cache`` with one such layer per decoder layer.

Left padding: a row's pad tokens would enter its streams like any others, and a run of
near-constant pads shrinks the step until the first real tokens are coded far too coarsely. Tell
the cache the prompt's padding (:meth:`ADKVCache.mark_padding`, with the attention mask passed to
``generate``) and the pads are coded as real tokens of the same positions from the row with the
fewest pads, so the codec reaches each row's first real token in a state real data leaves it in.
Pads are masked in attention, so what they hold does not change any real token's output.

Attention works as for the KIVI cache: the usual attention functions see the history dequantized
(prefix sums, :func:`~ada_modules.kernels.adkv_decode.adkv_dequantize`); with
``attn_implementation="quantized_kv"`` a decode step runs the fused ADKV decode attention
(:func:`~ada_modules.kernels.adkv_decode.adkv_decode_attention`, Triton on CUDA) on the codes.
"""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import Cache, PreTrainedConfig

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import FLOAT_DTYPES, Impl
from ada_modules.kernels.adkv_decode import ADKVTensor, adkv_decode_attention, adkv_dequantize
from ada_modules.kv.adkv import ADKVEncoder, ADKVParams, check_keyframe_period, load_adkv_params
from ada_modules.kv.kivi import check_layer_index, full_attention_layers, per_layer_bits
from ada_modules.kv.quantized_layer import QuantizedKVLayer

__all__ = ["MIN_FIRST_BLOCK", "MIN_MIRRORED", "ADKVCache", "ADKVLayer", "ADKVSegment"]

MIN_MIRRORED = 16
"""Fewest real tokens a padded donor row mirrors onto its pads (fewer only if it has fewer)."""

MIN_FIRST_BLOCK = 16
"""Fewest tokens of the first flush: the first step size comes from their spread (one token has
none: with a ``residual_length`` of 1, 8-bit ADKV had a relative logit error of 1.02 over 40
tokens of a tiny Llama; waiting for 16 tokens, 0.012)."""


class ADKVSegment(NamedTuple):
    """The ADKV history of one layer: keys and values of the same tokens."""

    keys: ADKVTensor
    values: ADKVTensor

    @property
    def num_tokens(self) -> int:
        """Number of tokens held."""
        return self.keys.num_tokens

    def nbytes(self) -> int:
        """Exact bytes of both streams (codes, keyframes, per-channel parameters)."""
        return self.keys.nbytes() + self.values.nbytes()


class ADKVLayer(QuantizedKVLayer):
    """One ADKV cache layer: full-precision residual window over delta-coded history.

    Args:
        key_params: Parameters of the key stream (:class:`~ada_modules.kv.adkv.ADKVParams`), or a
            bit width for the uncalibrated defaults.
        value_params: Likewise for the values.
        residual_length: Tokens kept at full precision; blocks of this size are flushed (the first
            flush waits for at least :data:`MIN_FIRST_BLOCK` tokens).
        keyframe_period: Tokens between keyframes.
        impl: Kernel implementation (``"auto"``: Triton on CUDA tensors, torch otherwise).

    Attributes:
        pending_padding: Left-pad tokens per prompt (``(prompts,)``; per row once the layer
            holds states) marked by :meth:`mark_padding` and not all replaced yet; ``None`` when
            there are none.

    Examples:
        >>> layer = ADKVLayer(key_params=2, value_params=4, residual_length=16, keyframe_period=32)
        >>> k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
        >>> keys, values = layer.update(k, v)
        >>> keys.shape, layer.get_seq_length(), layer.history.num_tokens, layer.keys.shape[-2]
        (torch.Size([1, 2, 40, 16]), 40, 32, 8)
    """

    state_dtypes = (*FLOAT_DTYPES, torch.float64)  # codes float64 states, decodes in float32

    def __init__(
        self,
        key_params: ADKVParams | int = 2,
        value_params: ADKVParams | int = 2,
        residual_length: int = 32,
        keyframe_period: int = 512,
        impl: Impl = "auto",
    ) -> None:
        key_params = _params("key_params", key_params)
        value_params = _params("value_params", value_params)
        super().__init__(
            key_bits=key_params.bits,
            value_bits=value_params.bits,
            key_group_size=1,
            value_group_size=1,
            residual_length=residual_length,
            impl=impl,
        )
        self.key_params = key_params
        self.value_params = value_params
        self.keyframe_period = check_keyframe_period(keyframe_period)
        self.pending_padding: torch.Tensor | None = None
        self._prompt_length = 0
        self._donor_filled = False
        self._new_encoders()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(key_bits={self.key_bits}, value_bits={self.value_bits}, "
            f"residual_length={self.residual_length}, keyframe_period={self.keyframe_period})"
        )

    def _new_encoders(self) -> None:
        self.key_encoder = ADKVEncoder(self.key_params, self.keyframe_period)
        self.value_encoder = ADKVEncoder(self.value_params, self.keyframe_period)

    @property
    def history(self) -> ADKVSegment | None:
        """The delta-coded history, or ``None`` before the first flush."""
        return self.segments[0] if self.segments else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check the parameters fit the states' heads and head dim; set up the window."""
        heads, head_dim = key_states.shape[1], key_states.shape[-1]
        for name, params in (("key_params", self.key_params), ("value_params", self.value_params)):
            try:
                torch.broadcast_shapes(params.alpha_code.shape, (heads, head_dim))
                torch.broadcast_shapes(params.multipliers.shape[:-1], (heads, head_dim))
            except RuntimeError:
                raise InputError(
                    f"{name} are per channel of shape {tuple(params.alpha_code.shape)}, which "
                    f"does not fit the model's (kv_heads, head_dim) = {(heads, head_dim)}: "
                    "calibrate on K/V of this model"
                ) from None
        super().lazy_initialization(key_states, value_states)

    def mark_padding(self, attention_mask: torch.Tensor) -> None:
        """Tell the layer which of the coming tokens are left padding (call before the prefill).

        The *donor* is the row with the fewest pads (the longest prompt). If it has pads, the
        tokens stay in the full-precision window until it has shown ``max(residual_length,
        MIN_MIRRORED)`` real tokens (or all it has); then its pads are replaced by its first real
        tokens, mirrored about the first one (pad ``P - 1 - j`` takes real token ``j``, folding
        back and forth when there are more pads than real tokens), and every other row's pads by
        the donor's tokens at the same positions, as they arrive. The pads stay masked in
        attention.

        Args:
            attention_mask: ``(batch, length)`` of 0/1 (or bool), the prompts' mask as passed to
                ``generate``: zeros then ones in every row, at least one real token per row.
                When the states come with ``k`` times as many rows (``generate`` repeats each
                prompt for beams and ``num_return_sequences``), each row is repeated ``k`` times.

        Raises:
            InputError: If the layer already holds tokens, or the mask is not a left-padding mask.

        Examples:
            >>> layer = ADKVLayer(4, 4, residual_length=16)
            >>> layer.mark_padding(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
            >>> layer.pending_padding.tolist()
            [2, 0]
        """
        self._check_empty()
        self._set_padding(left_padding(attention_mask), attention_mask.shape[-1])

    def _check_empty(self) -> None:
        if self.cumulative_length:
            raise InputError(
                f"mark_padding must come before the first update; the layer holds "
                f"{self.cumulative_length} tokens (reset it for a new batch)"
            )

    def _set_padding(self, pads: torch.Tensor | None, prompt_length: int) -> None:
        self.pending_padding, self._prompt_length, self._donor_filled = pads, prompt_length, False

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new states (see :meth:`QuantizedKVLayer.update`); NaN/Inf states are rejected
        before anything is stored, since they could not be delta-coded."""
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if not bool(torch.isfinite(states).all()):
                raise InputError(
                    f"{name} has {int((~torch.isfinite(states)).sum())} NaN/Inf values; the ADKV "
                    "cache stores only finite states"
                )
        pads, batch = self.pending_padding, key_states.shape[0]
        if pads is not None and batch % pads.shape[0]:
            raise InputError(
                f"mark_padding was given a mask of {pads.shape[0]} rows; the states have {batch}, "
                "not a multiple (mark the mask of the prompts given to generate)"
            )
        return super().update(key_states, value_states, *args, **kwargs)

    def _prepare_flush(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Hold the window back until the donor row has shown enough real tokens; then replace
        the pads in the window (see :meth:`mark_padding`)."""
        if self.pending_padding is None:
            if not self.block_bits and keys.shape[-2] < MIN_FIRST_BLOCK:
                return keys, values, 0  # the first block sets the first step: not from 1 token
            return super()._prepare_flush(keys, values)
        pads = _per_row(self.pending_padding, keys.shape[0]).to(keys.device)
        seen, donor = self.cumulative_length, int(pads.argmin())
        donor_pads = int(pads[donor])
        source_keys, source_values = keys[donor : donor + 1], values[donor : donor + 1]
        if not self._donor_filled:  # nothing is flushed before: the window starts at token 0
            # a padded donor mirrors at least MIN_MIRRORED real tokens (all it has, if fewer)
            block = max(self.residual_length, MIN_MIRRORED) if donor_pads else 0
            if seen - donor_pads < min(self._prompt_length - donor_pads, block):
                return keys, values, 0
            index = mirrored_padding_index(pads[donor : donor + 1], seen)[0]
            source_keys, source_values = source_keys[..., index, :], source_values[..., index, :]
            self._donor_filled = True
        # every row's pads, the donor's own included, take the donor's tokens at their positions
        position = torch.arange(seen - keys.shape[-2], seen, device=keys.device)
        is_pad = (position < pads[:, None])[:, None, :, None]
        keys = torch.where(is_pad, source_keys, keys)
        values = torch.where(is_pad, source_values, values)
        if seen >= int(pads.max()):
            self.pending_padding = None
        return super()._prepare_flush(keys, values)

    def _flush(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append whole blocks to the key and value streams (encoded once, never re-coded)."""
        self.key_encoder.append(keys)
        self.value_encoder.append(values)
        blocks = keys.shape[-2] // self.residual_length
        self.block_bits.extend([(self.key_bits, self.value_bits)] * blocks)
        self.segments = [ADKVSegment(self.key_encoder.packed, self.value_encoder.packed)]

    def dequantized_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The history decoded: keys and values ``(batch, kv_heads, packed, head_dim)``."""
        if not self.segments:
            return self.keys[..., :0, :], self.values[..., :0, :]
        seg = self.segments[0]
        dtype = self.keys.dtype
        return (
            adkv_dequantize(seg.keys, impl=self.impl).to(dtype),
            adkv_dequantize(seg.values, impl=self.impl).to(dtype),
        )

    def attend(
        self,
        query: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        scale: float | None = None,
        num_splits: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor:
        """One decode step's attention read from the codes (fused ADKV decode attention)."""
        if not self.is_initialized or self.cumulative_length == 0:
            raise InputError("attend needs a cache that holds at least one token")
        if return_lse:
            raise InputError("ADKVLayer.attend does not return log-sum-exps")
        seg = self.history
        return adkv_decode_attention(
            query,
            None if seg is None else seg.keys,
            None if seg is None else seg.values,
            self.keys,
            self.values,
            key_mask,
            scale,
            impl=self.impl,
        )

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.pending_padding is not None:
            pads = self.pending_padding
            if self.is_initialized:
                pads = _per_row(pads, self.keys.shape[0])
            self.pending_padding = fn(pads)
        if not self.is_initialized:
            return
        self.key_encoder.map_batch(fn)
        self.value_encoder.map_batch(fn)
        if self.segments:
            self.segments = [ADKVSegment(self.key_encoder.packed, self.value_encoder.packed)]
        self.keys = fn(self.keys)
        self.values = fn(self.values)

    def reset(self) -> None:
        """Drop every token and any marked padding; the next update starts afresh (new keyframe
        0)."""
        super().reset()
        self._set_padding(None, 0)
        self._new_encoders()

    def nbytes(self) -> int:
        """Exact bytes held: codes + keyframes + per-channel parameters + the residual window."""
        if not self.is_initialized:
            return 0
        window = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        return window + sum(s.nbytes() for s in self.segments)


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Left-pad tokens per row of a ``(batch, length)`` 0/1 mask (``None`` when there are none).

    Raises:
        InputError: If the mask is not 2-D 0/1, a row has a real token before a pad, or a row
            has no real token.
    """
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else None
        raise InputError(
            f"attention_mask must be a (batch, length) tensor, got "
            f"{f'shape {shape}' if shape is not None else type(attention_mask).__name__}"
        )
    mask = attention_mask.detach().cpu()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise InputError("attention_mask must hold only 0 and 1 (or bool)")
    mask = mask.to(torch.int64)
    ragged = (mask[:, 1:] < mask[:, :-1]).any(1)
    if bool(ragged.any()):
        rows = ragged.nonzero().flatten().tolist()
        raise InputError(
            f"attention_mask rows {rows[:8]} have a pad after a real token; only left padding "
            "(zeros, then ones) can be marked"
        )
    empty = mask.sum(1) == 0
    if bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise InputError(f"attention_mask rows {rows[:8]} have no real token")
    pads = mask.shape[1] - mask.sum(1)
    return pads if bool(pads.any()) else None


def _per_row(pads: torch.Tensor, batch: int) -> torch.Tensor:
    """Pads per prompt repeated for ``batch`` rows, as ``generate`` repeats the prompts."""
    return pads if pads.shape[0] == batch else pads.repeat_interleave(batch // pads.shape[0])


def mirrored_padding_index(pads: torch.Tensor, length: int) -> torch.Tensor:
    """For each row, the source position of every token: pads take the row's real tokens
    mirrored about the first one (folding back and forth), real tokens themselves.

    Examples:
        >>> mirrored_padding_index(torch.tensor([0, 2, 5]), 7).tolist()
        [[0, 1, 2, 3, 4, 5, 6], [3, 2, 2, 3, 4, 5, 6], [5, 5, 6, 6, 5, 5, 6]]
    """
    position = torch.arange(length, device=pads.device)
    pads = pads[:, None]
    real = length - pads
    fold = (pads - 1 - position) % (2 * real)  # distance from the first real token, folded
    mirrored = pads + torch.where(fold < real, fold, 2 * real - 1 - fold)
    return torch.where(position < pads, mirrored, position)


def _params(name: str, value: object) -> ADKVParams:
    if isinstance(value, ADKVParams):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return ADKVParams.default(value)
    raise InputError(f"{name} must be ADKVParams or a bit width, got {value!r}")


class ADKVCache(Cache):
    """ADKV KV cache for ``generate``: one :class:`ADKVLayer` per decoder layer.

    Args:
        config: The model config (decoder layers; all must be full attention). When ``None``,
            ``num_layers`` gives the number of layers.
        key_bits: Key code bits (2, 3, 4, 8), one for all layers or one per layer; used with the
            uncalibrated default parameters, or to pick the bit width in a ``params`` file.
        value_bits: Value code bits, likewise.
        params: A calibration file (written by
            :class:`~ada_modules.models.ADKVCalibrationModule`, read with
            :func:`~ada_modules.kv.adkv.load_adkv_params`) or ``None`` for the defaults. A file
            with one calibrated layer serves every layer.
        residual_length: Tokens kept at full precision (``R``); flushed blocks have this size.
        keyframe_period: Tokens between keyframes (random access; metadata ``32 / period`` bits
            per element).
        num_layers: Number of layers when no ``config`` is given.
        impl: Kernel implementation.

    Raises:
        InputError: For an unsupported bit width, a keyframe period below 1, a non-full-attention
            layer, or a ``params`` file without the requested bits or with too few layers.

    Examples:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2,
        ...                      num_attention_heads=2, num_key_value_heads=1,
        ...                      intermediate_size=64)
        >>> model = LlamaForCausalLM(config).eval()
        >>> cache = ADKVCache(config, key_bits=2, value_bits=4, residual_length=16)
        >>> out = model.generate(torch.randint(0, 32, (2, 40)), max_new_tokens=3, do_sample=False,
        ...                      cache=cache, pad_token_id=0)
        >>> cache.get_seq_length(), cache.layers[0].history.num_tokens
        (42, 32)
        >>> cache.nbytes() < cache.fp_nbytes()
        True
    """

    def __init__(
        self,
        config: PreTrainedConfig | None = None,
        key_bits: int | list[int] = 2,
        value_bits: int | list[int] = 2,
        params: str | Path | None = None,
        residual_length: int = 32,
        keyframe_period: int = 512,
        num_layers: int | None = None,
        impl: Impl = "auto",
    ) -> None:
        check_keyframe_period(keyframe_period)
        if config is not None:
            _, layers_in_config = full_attention_layers(config, "ADKVCache")
            if num_layers is not None and num_layers != layers_in_config:
                raise InputError(
                    f"num_layers={num_layers} disagrees with the config's {layers_in_config} layers"
                )
            num_layers = layers_in_config
        elif num_layers is None:
            raise InputError("ADKVCache needs a config or num_layers to know the number of layers")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise InputError(f"num_layers must be a positive integer, got {num_layers!r}")
        kb = per_layer_bits("key_bits", key_bits, num_layers)
        vb = per_layer_bits("value_bits", value_bits, num_layers)
        key_params = _layer_params(params, "keys", kb)
        value_params = _layer_params(params, "values", vb)
        layers = [
            ADKVLayer(k, v, residual_length, keyframe_period, impl)
            for k, v in zip(key_params, value_params, strict=True)
        ]
        super().__init__(layers=layers)

    def mark_padding(self, attention_mask: torch.Tensor) -> None:
        """Tell every layer which prompt tokens are left padding (see
        :meth:`ADKVLayer.mark_padding`); call before ``generate`` with the same mask.

        Examples:
            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> config = LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2,
            ...                      num_attention_heads=2, num_key_value_heads=1,
            ...                      intermediate_size=64)
            >>> model = LlamaForCausalLM(config).eval()
            >>> ids = torch.randint(1, 32, (2, 40))
            >>> mask = torch.ones_like(ids)
            >>> mask[1, :24] = 0  # row 1: 24 pads, then 16 real tokens
            >>> cache = ADKVCache(config, key_bits=4, value_bits=4, residual_length=16)
            >>> cache.mark_padding(mask)
            >>> out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
            ...                      cache=cache, pad_token_id=0)
            >>> cache.layers[0].history.num_tokens, cache.layers[0].pending_padding
            (32, None)
        """
        for layer in self.layers:
            layer._check_empty()
        pads = left_padding(attention_mask)  # once for all layers, before any changes
        for layer in self.layers:
            layer._set_padding(pads, attention_mask.shape[-1])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update``, naming a layer the cache was not built with."""
        check_layer_index(self, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        """Exact bytes held by all layers (codes, keyframes, parameters, residual windows)."""
        return sum(layer.nbytes() for layer in self.layers)

    def fp_nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of a full-precision cache (of ``dtype``, default the states' dtype) for the
        same tokens."""
        return sum(layer.fp_nbytes(dtype) for layer in self.layers)


def _layer_params(
    path: str | Path | None, kind: str, bits: Sequence[int]
) -> list[ADKVParams | int]:
    """Per-layer parameters: the defaults for ``bits``, or those calibrated in ``path``."""
    if path is None:
        return list(bits)
    out: list[ADKVParams | int] = []
    loaded: dict[int, list[ADKVParams]] = {}
    for layer, b in enumerate(bits):
        if b not in loaded:
            loaded[b] = load_adkv_params(path, b)[kind]
        per_layer = loaded[b]
        if len(per_layer) not in (1, len(bits)):
            raise InputError(
                f"{path} holds {len(per_layer)} calibrated layers of {kind}; the model has "
                f"{len(bits)} (calibrate on every layer, or on one to share it)"
            )
        out.append(per_layer[0] if len(per_layer) == 1 else per_layer[layer])
    return out
