"""Bytes held by any transformers KV cache, packed or not."""

from transformers import Cache

__all__ = ["cache_nbytes"]


def cache_nbytes(cache: Cache) -> int:
    """Exact bytes a KV cache holds.

    A cache with its own ``nbytes()`` (:class:`~ada_modules.kv.KIVICache`,
    :class:`~ada_modules.kv.AdaKVQCache`: codes, scales, zero points and residual windows) reports
    itself; any other cache (``DynamicCache``, ``StaticCache``) is counted from its layers' key and
    value tensors.

    Examples:
        >>> import torch
        >>> from transformers import DynamicCache
        >>> cache = DynamicCache()
        >>> _ = cache.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), layer_idx=0)
        >>> cache_nbytes(cache)  # 2 tensors x 80 fp32 elements
        640
    """
    if callable(getattr(cache, "nbytes", None)):
        return int(cache.nbytes())
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is not None and tensor.numel():
                total += tensor.numel() * tensor.element_size()
    return total
