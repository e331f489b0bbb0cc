"""KIVI: a packed 2/3/4/8-bit KV cache with a full-precision residual window (the baseline).

KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache")
quantizes keys per channel over groups of tokens and values per token over groups of channels,
keeping the most recent tokens at full precision. :class:`KIVICache` is a transformers ``Cache``
made of one :class:`~ada_modules.kv.quantized_layer.QuantizedKVLayer` per decoder layer, so it goes
straight into ``model.generate(..., cache=KIVICache(model.config, key_bits=2, value_bits=2))``.
Bit widths may differ per layer and between keys and values (lists), which is what a mixed-
precision allocation such as AdaKVQ needs; storage is really packed (int32 words), and
:meth:`KIVICache.nbytes` reports the exact bytes held.

Attention: with the model's usual ``attn_implementation`` (``"sdpa"``, ``"eager"``), each decode
step dequantizes the layer's packed history for the attention call (a transient copy; the stored
cache stays packed). With ``attn_implementation="quantized_kv"``
(:func:`~ada_modules.kv.quantized_layer.quantized_kv_attention`), decode steps read the packed codes
directly with the fused split-K kernel of :func:`~ada_modules.kernels.kv_quant.decode_attention`
(Triton on CUDA, its torch reference elsewhere).

Differences from transformers' ``QuantizedCache`` (quanto/HQQ backends): history is quantized once
when its block leaves the residual window and never re-quantized; keys are grouped per channel
(KIVI), not along the head dim; codes are packed by our own kernels
(:mod:`ada_modules.kernels.kv_quant`), so no extra package is needed.
"""

from collections.abc import Sequence
from numbers import Integral

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import Impl
from ada_modules.kernels.kv_quant import SUPPORTED_BITS
from ada_modules.kv.quantized_layer import QuantizedKVLayer, check_bits, check_group_size

__all__ = [
    "KIVICache",
    "bits_argument",
    "check_layer_index",
    "full_attention_layers",
    "per_layer_bits",
]


def bits_argument(name: str, bits: object) -> int | list[int]:
    """Validate a bits argument: one width of (2, 3, 4, 8), or a non-empty list of such widths.

    Raises:
        InputError: Naming ``name``, for anything else (a ``float`` such as ``2.0``, a string, a
            ``bool``, an empty list, an unsupported width).

    Examples:
        >>> bits_argument("key_bits", 2), bits_argument("key_bits", (2, 4))
        (2, [2, 4])
    """
    allowed = f"one of {SUPPORTED_BITS} (an int) or a list with one such int per layer"
    if isinstance(bits, bool | str | bytes) or not isinstance(bits, Integral | Sequence):
        raise InputError(f"{name} must be {allowed}, got {bits!r} ({type(bits).__name__})")
    if isinstance(bits, Integral):
        check_bits(name, bits)
        return int(bits)
    if not bits:
        raise InputError(f"{name} must be {allowed}, got an empty {type(bits).__name__}")
    for i, b in enumerate(bits):
        check_bits(f"{name}[{i}]", b)
    return [int(b) for b in bits]


def per_layer_bits(name: str, bits: int | Sequence[int], num_layers: int) -> list[int]:
    """Expand ``bits`` (one width for all layers, or one per layer) to a validated list.

    Raises:
        InputError: If a width is unsupported or not an int, or the list length is not
            ``num_layers``.

    Examples:
        >>> per_layer_bits("key_bits", 2, 3), per_layer_bits("key_bits", [2, 4], 2)
        ([2, 2, 2], [2, 4])
    """
    bits = bits_argument(name, bits)
    if isinstance(bits, int):
        return [bits] * num_layers
    if len(bits) != num_layers:
        raise InputError(
            f"{name} must be one bit width or a list of one per layer ({num_layers}), got "
            f"{len(bits)} values: {bits}"
        )
    return bits


def full_attention_layers(
    config: PreTrainedConfig, cache_name: str
) -> tuple[PreTrainedConfig, int]:
    """The decoder text config and its number of layers, all of which must be full attention.

    Raises:
        InputError: Naming ``cache_name``, if the config has other layer types (sliding window,
            linear attention, ...).
    """
    config = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(config)
    unsupported = sorted(set(layer_types) - {"full_attention"})
    if unsupported:
        raise InputError(
            f"{cache_name} supports only full-attention layers, the config has {unsupported}"
        )
    return config, len(layer_types)


def check_layer_index(cache: Cache, layer_idx: int) -> None:
    """Name a ``layer_idx`` past the layers ``cache`` was built with (transformers raised an
    ``IndexError`` from inside ``generate``)."""
    if not 0 <= layer_idx < len(cache.layers):
        raise InputError(
            f"{type(cache).__name__} was built with {len(cache.layers)} layers and the model "
            f"updated layer {layer_idx}: build it from the model's config (or with its num_layers)"
        )


def _head_dim(config: PreTrainedConfig) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    return head_dim


class KIVICache(Cache):
    """Packed low-bit KV cache with a full-precision residual window, for ``generate``.

    Args:
        config: The model config (decoder layers, head dim). Every layer must be full attention.
            When ``None``, ``num_layers`` (or per-layer bit lists) give the number of layers.
        key_bits: Key bits, one of 2, 3, 4, 8: one for all layers or a list with one per layer.
        value_bits: Value bits, likewise.
        key_group_size: Tokens per key group (per-channel quantization), a power of two.
        value_group_size: Channels per value group (per-token quantization), a power of two that
            divides the head dim.
        residual_length: Tokens kept at full precision (``R``); flushed blocks have this size. A
            multiple of ``key_group_size``.
        num_layers: Number of layers when no ``config`` is given.
        impl: Kernel implementation (``"auto"``: Triton on CUDA tensors, torch otherwise).

    Attributes:
        layers: One :class:`~ada_modules.kv.quantized_layer.QuantizedKVLayer` per decoder layer;
            ``layers[i].key_bits``/``value_bits`` are layer ``i``'s widths and
            ``layers[i].block_bits`` the widths of each block it flushed.

    Raises:
        InputError: (a ``ValueError`` and ``TypeError``) If an argument is out of range or of the
            wrong type, naming it and the value (e.g. ``key_bits=2.0``: widths are ints), the
            config has non-full-attention layers, or ``value_group_size`` does not divide the
            head dim.

    Examples:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2,
        ...                      num_attention_heads=2, num_key_value_heads=1,
        ...                      intermediate_size=64)
        >>> model = LlamaForCausalLM(config).eval()
        >>> cache = KIVICache(config, key_bits=[2, 4], value_bits=2, residual_length=32)
        >>> out = model.generate(torch.randint(0, 32, (2, 40)), max_new_tokens=3, do_sample=False,
        ...                      cache=cache, pad_token_id=0)
        >>> cache.get_seq_length(), [layer.key_bits for layer in cache.layers]
        (42, [2, 4])
        >>> cache.nbytes() < cache.fp_nbytes()
        True
    """

    layer_class: type[QuantizedKVLayer] = QuantizedKVLayer
    """The layer type built for each decoder layer (a subclass may swap in its own)."""

    def __init__(
        self,
        config: PreTrainedConfig | None = None,
        key_bits: int | list[int] = 2,
        value_bits: int | list[int] = 2,
        key_group_size: int = 32,
        value_group_size: int = 32,
        residual_length: int = 32,
        num_layers: int | None = None,
        impl: Impl = "auto",
    ) -> None:
        key_bits = bits_argument("key_bits", key_bits)
        value_bits = bits_argument("value_bits", value_bits)
        check_group_size("key_group_size", key_group_size)
        check_group_size("value_group_size", value_group_size)
        if config is not None:
            config, layers_in_config = full_attention_layers(config, type(self).__name__)
            if num_layers is not None and num_layers != layers_in_config:
                raise InputError(
                    f"num_layers={num_layers} disagrees with the config's {layers_in_config} layers"
                )
            num_layers = layers_in_config
            head_dim = _head_dim(config)
            if head_dim is not None and head_dim % value_group_size:
                raise InputError(
                    f"value_group_size={value_group_size!r} must divide the head dim ({head_dim})"
                )
        elif num_layers is None:
            for bits in (key_bits, value_bits):
                if not isinstance(bits, int):
                    num_layers = len(bits)
                    break
            else:
                raise InputError(
                    "KIVICache needs a config, num_layers, or per-layer lists of bits to know the "
                    "number of layers"
                )
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise InputError(f"num_layers must be a positive integer, got {num_layers!r}")
        kb = per_layer_bits("key_bits", key_bits, num_layers)
        vb = per_layer_bits("value_bits", value_bits, num_layers)
        layers = [
            self.layer_class(
                key_bits=k,
                value_bits=v,
                key_group_size=key_group_size,
                value_group_size=value_group_size,
                residual_length=residual_length,
                impl=impl,
            )
            for k, v in zip(kb, vb, strict=True)
        ]
        super().__init__(layers=layers)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update``, naming a layer the cache was not built with."""
        check_layer_index(self, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes(self) -> int:
        """Exact bytes held by all layers: codes + scales + zero points + residual windows."""
        return sum(layer.nbytes() for layer in self.layers)

    def fp_nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of a full-precision cache (of ``dtype``, default the states' dtype) for the
        same tokens."""
        return sum(layer.fp_nbytes(dtype) for layer in self.layers)
