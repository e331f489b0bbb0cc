"""The dense attention our attention functions fall back to: SDPA, or the model's own eager one.

``attn_implementation="adacal"`` (and the other sparse names) and ``"quantized_kv"`` hand the calls
their fast paths do not cover to :func:`dense_attention_forward`. transformers' SDPA attention
ignores attention sinks (GPT-OSS's ``s_aux``) and refuses logit softcapping (Gemma 2), so for those
calls it runs the ``eager_attention_forward`` of the module's own modeling file, which implements
them, with the boolean mask our registered SDPA mask builder made turned into an additive one.

Example:
    >>> import torch
    >>> from transformers import Gemma2Config, Gemma2ForCausalLM
    >>> config = Gemma2Config(vocab_size=8, hidden_size=16, num_hidden_layers=1, head_dim=8,
    ...     num_attention_heads=2, num_key_value_heads=2, intermediate_size=32)
    >>> attention = Gemma2ForCausalLM(config).model.layers[0].self_attn
    >>> q = k = v = torch.randn(1, 2, 5, 8)
    >>> out, _ = dense_attention_forward(attention, q, k, v, None, softcap=50.0)  # Gemma 2's eager
    >>> out.shape
    torch.Size([1, 5, 2, 8])
"""

import sys
from typing import Any

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ada_modules.errors import InputError

__all__ = ["EAGER_ONLY_FEATURES", "dense_attention_forward", "eager_only_features"]

EAGER_ONLY_FEATURES = ("softcap", "s_aux")
"""Attention keyword arguments SDPA cannot honour (logit softcapping, attention sinks)."""


def eager_only_features(kwargs: dict[str, Any]) -> list[str]:
    """The features of :data:`EAGER_ONLY_FEATURES` an attention call asks for."""
    return [name for name in EAGER_ONLY_FEATURES if kwargs.get(name) is not None]


def _additive_mask(
    mask: torch.Tensor | None, query: torch.Tensor, k_len: int, causal: bool
) -> torch.Tensor | None:
    """An additive float mask (0 visible, the dtype's minimum hidden) from an SDPA mask.

    ``None`` (the mask builder skipped a causal mask without padding) becomes the causal mask SDPA
    would apply with ``is_causal``: aligned at the top left, query ``i`` sees keys ``0..i`` (a
    static cache's first prefill: the slots past the prompt stay hidden). Eager attention does
    not add it itself.
    """
    hidden = torch.finfo(query.dtype).min
    if mask is None:
        if not causal or query.shape[-2] == 1:
            return None
        rows = torch.arange(query.shape[-2], device=query.device)[:, None]
        mask = torch.arange(k_len, device=query.device)[None, :] <= rows
    if mask.dtype != torch.bool:
        return mask.to(query.dtype)
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~mask, hidden
    )


def dense_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention, or the module's eager attention for softcapping and sinks.

    Args:
        module: The attention module; its modeling file's ``eager_attention_forward`` runs the
            calls with :data:`EAGER_ONLY_FEATURES`.
        query: ``(batch, heads, q_len, head_dim)``.
        key: ``(batch, kv_heads, k_len, head_dim)``.
        value: Like ``key``.
        attention_mask: SDPA boolean mask ``(batch, 1, q_len, k_len)``, an additive float mask,
            or ``None`` (causal, no padding).
        dropout: Dropout probability.
        scaling: Softmax scale (default ``head_dim ** -0.5``).
        **kwargs: The attention module's other arguments (``softcap``, ``s_aux``,
            ``sliding_window``, ...).

    Returns:
        ``(attn_output, attn_weights)`` with ``attn_output`` of shape
        ``(batch, q_len, heads, head_dim)``.

    Raises:
        ValueError: If a call needs eager attention and the module's modeling file has none.
    """
    features = eager_only_features(kwargs)
    if not features:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise InputError(
            f"{type(module).__name__} asks for {features}, which SDPA attention cannot do, and "
            f"its module {type(module).__module__} has no eager_attention_forward to run instead"
        )
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    mask = _additive_mask(attention_mask, query, key.shape[-2], causal)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
