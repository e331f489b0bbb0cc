"""KV caches for transformers' ``generate`` (``Cache`` subclasses: AdaKVQ, ADKV and their baselines)."""

from ada_modules.kv.kivi import KIVICache as KIVICache
from ada_modules.kv.kivi import per_layer_bits as per_layer_bits
from ada_modules.kv.quantized_layer import QUANTIZED_KV_ATTENTION as QUANTIZED_KV_ATTENTION
from ada_modules.kv.quantized_layer import LazyDequantizedStates as LazyDequantizedStates
from ada_modules.kv.quantized_layer import QuantizedKVLayer as QuantizedKVLayer
from ada_modules.kv.quantized_layer import quantized_kv_attention as quantized_kv_attention
from ada_modules.kv.aad import NORMALIZATIONS as NORMALIZATIONS
from ada_modules.kv.aad import AADAccumulator as AADAccumulator
from ada_modules.kv.aad import AADProfile as AADProfile
from ada_modules.kv.aad import average_attention_distance as average_attention_distance
from ada_modules.kv.bit_allocation import ALLOCATION_METHODS as ALLOCATION_METHODS
from ada_modules.kv.bit_allocation import SUPPORTED_BITS as SUPPORTED_BITS
from ada_modules.kv.bit_allocation import BitAllocation as BitAllocation
from ada_modules.kv.bit_allocation import allocate_bits as allocate_bits
from ada_modules.kv.bit_allocation import bits_per_element as bits_per_element
from ada_modules.kv.bit_allocation import solve_allocation as solve_allocation
