"""KV caches for transformers' ``generate`` (``Cache`` subclasses: AdaKVQ, ADKV and their baselines).

- :class:`KIVICache` (uniform packed 2/3/4/8-bit keys and values, full-precision residual window)
  and its layer :class:`QuantizedKVLayer`; importing this package registers the attention function
  ``"quantized_kv"`` (:data:`QUANTIZED_KV_ATTENTION`) with transformers, which decodes straight
  from the packed codes,
- :class:`AdaKVQCache` (per-layer bit widths from an AAD profile, per-block dynamic widths),
- :func:`average_attention_distance` and :class:`AADProfile` (how far each layer attends),
- :func:`allocate_bits` and :class:`BitAllocation` (bit widths under an average-bit budget),
- :func:`cache_nbytes` (exact bytes held by any cache, for memory metrics) and :func:`kv_memory`
  (bytes per token and ratio to FP16 of the packed layout, for given bits, groups and window),
- :mod:`~ada_modules.kv.kv_study`: baseline fake KV quantizers with exact bit counts
  (:class:`QuantizedStates`) and the attention-output error (:func:`attention_relative_mse`).
"""

from ada_modules.kv.aad import (
    NORMALIZATIONS,
    AADAccumulator,
    AADProfile,
    average_attention_distance,
)
from ada_modules.kv.adakvq import (
    DEMAND_NORMALIZATIONS,
    DEMAND_SOURCES,
    AdaKVQCache,
    AdaKVQLayer,
    block_bits_per_element,
)
from ada_modules.kv.adkv import (
    ADKVEncoder,
    ADKVParams,
    adkv_encode,
    load_adkv_params,
    save_adkv_params,
)
from ada_modules.kv.adkv_cache import ADKVCache, ADKVLayer
from ada_modules.kv.bit_allocation import (
    ALLOCATION_METHODS,
    SUPPORTED_BITS,
    BitAllocation,
    allocate_bits,
    bits_per_element,
    solve_allocation,
)
from ada_modules.kv.kivi import KIVICache, per_layer_bits
from ada_modules.kv.kv_study import (
    QuantizedStates,
    attention_output,
    attention_relative_mse,
    groupwise_keys,
    groupwise_values,
    pre_rope_per_channel_keys,
    static_per_channel,
)
from ada_modules.kv.memory import KVMemory, cache_nbytes, kv_memory
from ada_modules.kv.quantized_layer import (
    QUANTIZED_KV_ATTENTION,
    LazyDequantizedStates,
    QuantizedKVLayer,
    quantized_kv_attention,
)

__all__ = [
    "ADKVCache",
    "ADKVEncoder",
    "ADKVLayer",
    "ADKVParams",
    "ALLOCATION_METHODS",
    "DEMAND_NORMALIZATIONS",
    "DEMAND_SOURCES",
    "NORMALIZATIONS",
    "QUANTIZED_KV_ATTENTION",
    "SUPPORTED_BITS",
    "AADAccumulator",
    "AADProfile",
    "AdaKVQCache",
    "AdaKVQLayer",
    "BitAllocation",
    "KIVICache",
    "KVMemory",
    "LazyDequantizedStates",
    "QuantizedKVLayer",
    "QuantizedStates",
    "adkv_encode",
    "allocate_bits",
    "attention_output",
    "attention_relative_mse",
    "average_attention_distance",
    "bits_per_element",
    "block_bits_per_element",
    "cache_nbytes",
    "groupwise_keys",
    "groupwise_values",
    "kv_memory",
    "load_adkv_params",
    "per_layer_bits",
    "pre_rope_per_channel_keys",
    "quantized_kv_attention",
    "save_adkv_params",
    "solve_allocation",
    "static_per_channel",
]
