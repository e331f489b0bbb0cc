"""Triton kernels, each beside its torch reference and one dispatching function.

A kernel file ``kernels/<name>.py`` holds ``_<name>_kernel`` (``@triton.jit``), ``<name>_reference``
(plain torch, the specification) and ``<name>(..., impl="auto")``, which runs the kernel on CUDA
tensors and the reference otherwise (see :func:`resolve_impl`). Importing this package does not
need triton or a GPU; without triton every function runs its reference.

Example:
    >>> import torch
    >>> from ada_modules.kernels import dequantize_int8_absmax, quantize_int8_absmax
    >>> q, scale = quantize_int8_absmax(torch.randn(8, 32))
    >>> dequantize_int8_absmax(q, scale).shape
    torch.Size([8, 32])
"""

from ada_modules.kernels._dispatch import Impl, interpreter_enabled, resolve_impl, triton_available
from ada_modules.kernels.adkv_decode import (
    ADKVTensor,
    adkv_decode_attention,
    adkv_decode_attention_reference,
    adkv_dequantize,
    adkv_dequantize_reference,
)
from ada_modules.kernels.int8_absmax import (
    dequantize_int8_absmax,
    dequantize_int8_absmax_reference,
    quantize_int8_absmax,
    quantize_int8_absmax_reference,
)
from ada_modules.kernels.kv_quant import (
    PackedTensor,
    QuantizedKV,
    decode_attention,
    decode_attention_reference,
    dequantize,
    dequantize_reference,
    quantize_keys,
    quantize_keys_reference,
    quantize_values,
    quantize_values_reference,
)
from ada_modules.kernels.routed_sum import routed_sum, routed_sum_reference
from ada_modules.kernels.sparse_prefill import (
    block_mask_to_indices,
    sparse_prefill_attention,
    sparse_prefill_attention_reference,
)

__all__ = [
    "Impl",
    "dequantize_int8_absmax",
    "dequantize_int8_absmax_reference",
    "interpreter_enabled",
    "quantize_int8_absmax",
    "quantize_int8_absmax_reference",
    "resolve_impl",
    "triton_available",
    # kv_quant
    "PackedTensor",
    "QuantizedKV",
    "decode_attention",
    "decode_attention_reference",
    "dequantize",
    "dequantize_reference",
    "quantize_keys",
    "quantize_keys_reference",
    "quantize_values",
    "quantize_values_reference",
    # adkv_decode
    "ADKVTensor",
    "adkv_decode_attention",
    "adkv_decode_attention_reference",
    "adkv_dequantize",
    "adkv_dequantize_reference",
    # routed_sum
    "routed_sum",
    "routed_sum_reference",
    # sparse_prefill
    "block_mask_to_indices",
    "sparse_prefill_attention",
    "sparse_prefill_attention_reference",
]
