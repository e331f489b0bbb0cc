"""Sparse prefill as a transformers attention function: ``attn_implementation="adacal"``.

Importing :mod:`ada_modules.attention` registers one attention function per policy with
transformers' ``AttentionInterface`` (and transformers' SDPA mask builder under the same name
with ``AttentionMaskInterface``, so padded batches get their mask):

========================== ===============================================================
``attn_implementation``    policy (:mod:`ada_modules.attention`)
========================== ===============================================================
``"adacal"``               :class:`~ada_modules.attention.AdaCalPolicy`
``"sparse_a_shape"``       :class:`~ada_modules.attention.AShapePolicy` (sink + local)
``"sparse_vertical_slash"`` :class:`~ada_modules.attention.VerticalSlashPolicy`
``"sparse_flexprefill"``   :class:`~ada_modules.attention.FlexPrefillPolicy`
``"sparse_block_topk"``    :class:`~ada_modules.attention.BlockTopKPolicy`
``"sparse_dense"``         :class:`~ada_modules.attention.DensePolicy` (our kernel, full plan)
========================== ===============================================================

The policy is built from the model config's ``sparse_prefill`` attribute (a dict of the policy's
keyword arguments; absent: the defaults), once per attention module, or set on a model with
:func:`set_sparse_prefill_policy`. A call takes the sparse path only for a prefill (more than one
query) of at least ``policy.min_sparse_length`` keys without gradients or dropout, on the keys
its queries can see (a static cache's empty slots past the prompt are cut off); decode steps,
short prompts and training run dense attention, and so do calls that need more than causal
attention with key padding (a sliding window, logit softcapping, attention sinks, a non-causal
module, or a mask that is not causal with key padding, such as packed documents'
block-diagonal one: a warning says so). Dense attention is transformers' SDPA, or the model's
own eager attention for softcapping and sinks, which SDPA cannot do
(:func:`~ada_modules.attention.dense_fallback.dense_attention_forward`). The sparse path plans
the call's blocks, runs :func:`~ada_modules.kernels.sparse_prefill.sparse_prefill_attention`
(Triton on CUDA, the torch reference on CPU), and reports the plan to every active
:func:`record_sparse_prefill`.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> import ada_modules.attention  # registers the attention functions
    >>> config = LlamaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1,
    ...                      num_attention_heads=2, intermediate_size=64,
    ...                      attn_implementation="adacal",
    ...                      sparse_prefill={"block_size": 16, "min_sparse_length": 64})
    >>> model = LlamaForCausalLM(config).eval()
    >>> with torch.no_grad(), record_sparse_prefill() as log:
    ...     logits = model(torch.randint(0, 32, (2, 80))).logits
    >>> len(log.calls), 0 < log.calls[0].density <= 1
    (1, True)
"""

import contextlib
import json
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ada_modules.attention.adacal import AdaCalPolicy
from ada_modules.attention.baselines import (
    AShapePolicy,
    BlockTopKPolicy,
    DensePolicy,
    FlexPrefillPolicy,
    VerticalSlashPolicy,
)
from ada_modules.attention.dense_fallback import EAGER_ONLY_FEATURES, dense_attention_forward
from ada_modules.attention.dispatch import TaskDispatcher
from ada_modules.attention.plan import SparsePrefillPolicy, plan_density
from ada_modules.errors import InputError
from ada_modules.kernels.sparse_prefill import sparse_prefill_attention

__all__ = [
    "SPARSE_PREFILL_POLICIES",
    "SparsePrefillCall",
    "SparsePrefillLog",
    "policy_from_config",
    "record_sparse_prefill",
    "set_sparse_prefill_policy",
    "sparse_prefill_forward",
]

SPARSE_PREFILL_POLICIES: dict[str, type] = {
    "adacal": AdaCalPolicy,
    "sparse_a_shape": AShapePolicy,
    "sparse_vertical_slash": VerticalSlashPolicy,
    "sparse_flexprefill": FlexPrefillPolicy,
    "sparse_block_topk": BlockTopKPolicy,
    "sparse_dense": DensePolicy,
}
"""``attn_implementation`` name -> policy class; each name is registered with transformers."""

_POLICY_ATTRIBUTE = "_sparse_prefill_policy"
_CONFIG_POLICY_ATTRIBUTE = "_sparse_prefill_config_policy"


@dataclass
class SparsePrefillCall:
    """One attention call that took the sparse path.

    Attributes:
        layer_idx: The attention module's ``layer_idx`` (``-1`` if it has none).
        q_len: Queries of the call.
        k_len: Keys of the call.
        density: Computed blocks over causal blocks (:func:`plan_density`).
        regime: Per batch element, the regime the policy dispatched to, or ``None``.
        probe_flops: Multiply-adds of the policy's probe.
        dense_flops: Multiply-adds of dense causal attention for the same call.
    """

    layer_idx: int
    q_len: int
    k_len: int
    density: float
    regime: list[str] | None
    probe_flops: int
    dense_flops: int


@dataclass
class SparsePrefillLog:
    """What :func:`record_sparse_prefill` collected: sparse calls and dense fallbacks."""

    calls: list[SparsePrefillCall] = field(default_factory=list)
    dense_fallbacks: int = 0

    def summary(self) -> dict[str, float]:
        """Mean density, probe overhead and retrieval fraction over the sparse calls.

        Keys: ``attention_density``, ``probe_overhead`` (probe over dense attention multiply-adds),
        ``retrieval_fraction`` (of dispatched batch elements; only when a policy dispatches),
        ``sparse_calls`` and ``dense_fallbacks``.
        """
        out: dict[str, float] = {
            "sparse_calls": float(len(self.calls)),
            "dense_fallbacks": float(self.dense_fallbacks),
        }
        if self.calls:
            out["attention_density"] = sum(c.density for c in self.calls) / len(self.calls)
            probe = sum(c.probe_flops for c in self.calls)
            out["probe_overhead"] = probe / sum(c.dense_flops for c in self.calls)
            regimes = [r for c in self.calls for r in (c.regime or [])]
            if regimes:
                out["retrieval_fraction"] = regimes.count("retrieval") / len(regimes)
        return out


_ACTIVE_LOGS: list[SparsePrefillLog] = []


@contextlib.contextmanager
def record_sparse_prefill() -> Iterator[SparsePrefillLog]:
    """Collect every sparse prefill call made inside the ``with`` block (nestable).

    Example:
        >>> with record_sparse_prefill() as log:
        ...     pass
        >>> log.summary()
        {'sparse_calls': 0.0, 'dense_fallbacks': 0.0}
    """
    log = SparsePrefillLog()
    _ACTIVE_LOGS.append(log)
    try:
        yield log
    finally:
        _ACTIVE_LOGS.remove(log)


def policy_from_config(name: str, options: dict[str, Any] | None) -> SparsePrefillPolicy:
    """Build the policy of attention implementation ``name`` from a config's ``sparse_prefill``.

    For ``"adacal"``, ``dispatch_path`` (a JSON file written by a dispatch calibration, e.g.
    ``ada fit -c cli_configs/adacal/study.yaml``) loads the fitted task dispatcher.

    Raises:
        InputError: If ``name`` has no policy or the options do not fit the policy.
    """
    if name not in SPARSE_PREFILL_POLICIES:
        raise InputError(
            f"no sparse prefill policy named {name!r}; known: {sorted(SPARSE_PREFILL_POLICIES)}"
        )
    if options is not None and not isinstance(options, dict):
        raise InputError(f"config.sparse_prefill must be a dict, got {options!r}")
    options = dict(options or {})
    dispatch_path = options.pop("dispatch_path", None)
    if dispatch_path is not None:
        if name != "adacal":
            raise InputError(f"dispatch_path applies to 'adacal' only, not {name!r}")
        path = Path(dispatch_path)
        if not path.is_file():
            raise InputError(f"dispatch_path {str(path)!r} is not a file")
        try:
            state = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise InputError(f"dispatch_path {str(path)!r} is not JSON: {error}") from error
        try:
            options["dispatcher"] = TaskDispatcher.from_dict(state)
        except InputError as error:
            raise InputError(f"dispatch_path {str(path)!r}: {error}") from error
    try:
        return SPARSE_PREFILL_POLICIES[name](**options)
    except TypeError as error:
        raise InputError(f"config.sparse_prefill does not fit {name!r}: {error}") from error


def set_sparse_prefill_policy(model: nn.Module, policy: SparsePrefillPolicy | None) -> int:
    """Use ``policy`` in every attention module of ``model`` (those with a ``config``).

    The model's ``attn_implementation`` must still be one of the registered sparse names (any of
    them: the policy set here wins over the config's; a warning says when it is not);
    ``None`` goes back to the config's policy. Returns the number of modules set.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> from ada_modules.attention import AShapePolicy
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32,
        ...     num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        ...     attn_implementation="sparse_a_shape"))
        >>> set_sparse_prefill_policy(model, AShapePolicy(block_size=16, local_blocks=1))
        2
    """
    if policy is not None and not isinstance(policy, SparsePrefillPolicy):
        raise InputError(f"policy must implement SparsePrefillPolicy, got {type(policy).__name__}")
    modules = [m for m in model.modules() if _is_attention(m)]
    for module in modules:
        setattr(module, _POLICY_ATTRIBUTE, policy)
    others = {m.config._attn_implementation for m in modules} - set(SPARSE_PREFILL_POLICIES)
    if policy is not None and others:
        warnings.warn(
            f"set_sparse_prefill_policy: the model's attn_implementation is {sorted(others)}, "
            f"not one of {sorted(SPARSE_PREFILL_POLICIES)}, so the policy does not run until it "
            "is (model.set_attn_implementation('adacal'), or attn_implementation= at loading)",
            stacklevel=2,
        )
    return len(modules)


def _is_attention(module: nn.Module) -> bool:
    return (
        hasattr(module, "config") and hasattr(module, "is_causal") and hasattr(module, "layer_idx")
    )


def _policy_for(module: nn.Module) -> SparsePrefillPolicy:
    """The policy set by :func:`set_sparse_prefill_policy`, else the config's (rebuilt when the
    config's implementation or options change)."""
    policy = getattr(module, _POLICY_ATTRIBUTE, None)
    if policy is not None:
        return policy
    config = module.config
    name, options = config._attn_implementation, getattr(config, "sparse_prefill", None)
    key = (name, json.dumps(options, sort_keys=True, default=str))
    cached = getattr(module, _CONFIG_POLICY_ATTRIBUTE, None)
    if cached is None or cached[0] != key:
        cached = (key, policy_from_config(name, options))
        setattr(module, _CONFIG_POLICY_ATTRIBUTE, cached)
    return cached[1]


_ROWS_PER_CHECK = 1024
_checked_mask: list[
    tuple[weakref.ref, tuple[int, int, int], tuple[int, torch.Tensor | None] | None]
]
_checked_mask = []  # the last mask checked: every layer of a forward gets the same tensor


def _causal_keys(
    attention_mask: torch.Tensor | None, q_len: int, k_len: int
) -> tuple[int, torch.Tensor | None] | None:
    """The keys of a call whose mask is causal attention with key padding, else ``None``.

    Returns ``(keys, key_padding_mask)``: the queries are the last ``q_len`` of the first ``keys``
    keys (no query sees a later one, e.g. a static cache's empty slots), and the boolean
    ``(batch, keys)`` padding mask (``None``: no padding) marks the real ones. A ``None`` mask
    (the mask builder skipped a causal mask without padding) is SDPA's ``is_causal``: query ``i``
    sees keys ``0..i``. A mask tensor gives the keys and padding from its last row (the keys up
    to the last one it sees, at least ``q_len``) and must then equal that causal mask with
    padding; packed documents, other custom masks and additive biases do not. The check reads
    the mask once per forward (the layers share it), ``_ROWS_PER_CHECK`` query rows at a time.
    """
    if attention_mask is None:
        return q_len, None
    signature = (attention_mask._version, q_len, k_len)
    if _checked_mask and _checked_mask[0][0]() is attention_mask:
        if _checked_mask[0][1] == signature:
            return _checked_mask[0][2]
    result = _check_causal_keys(attention_mask[..., :k_len], q_len)
    _checked_mask[:] = [(weakref.ref(attention_mask), signature, result)]
    return result


def _check_causal_keys(mask: torch.Tensor, q_len: int) -> tuple[int, torch.Tensor | None] | None:
    k_len = mask.shape[-1]
    last = _visible(mask[:, 0, -1:])  # (batch, 1, k_len): the keys the last query sees
    if last is None:
        return None
    last = last[:, 0]
    seen = last.any(0) * torch.arange(1, k_len + 1, device=last.device)
    keys = max(q_len, int(seen.max()))
    columns = torch.arange(k_len, device=last.device)
    for start in range(0, mask.shape[2], _ROWS_PER_CHECK):
        rows = mask[:, :, start : start + _ROWS_PER_CHECK]
        visible = _visible(rows)
        positions = torch.arange(start, start + rows.shape[2], device=last.device)
        causal = columns <= positions[:, None] + (keys - q_len)  # query i is key keys - q_len + i
        if visible is None or not torch.equal(
            visible, (last[:, None, None, :] & causal).expand_as(visible)
        ):
            return None
    return keys, last[:, :keys]


def _visible(mask: torch.Tensor) -> torch.Tensor | None:
    """Boolean visibility of a bool or additive mask; ``None`` for an additive bias (a value other
    than 0 or at most half the dtype's minimum)."""
    if mask.dtype == torch.bool:
        return mask
    visible = mask == 0
    if not bool((visible | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
        return None
    return visible


def _unsupported_features(module: nn.Module, kwargs: dict[str, Any]) -> list[str]:
    """What an attention call asks for beyond causal attention with padding (see the module)."""
    names = ("sliding_window", *EAGER_ONLY_FEATURES)
    features = [name for name in names if kwargs.get(name) is not None]
    if not getattr(module, "is_causal", True):
        features.append("non-causal attention")
    return features


def _dense_flops(batch: int, heads: int, q_len: int, k_len: int, head_dim: int) -> int:
    causal_pairs = q_len * (k_len - q_len) + q_len * (q_len + 1) // 2
    return 2 * batch * heads * causal_pairs * head_dim


def sparse_prefill_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered under every name of :data:`SPARSE_PREFILL_POLICIES`.

    Args:
        module: The attention module (its ``config`` names the policy and its options).
        query: ``(batch, heads, q_len, head_dim)``.
        key: ``(batch, kv_heads, k_len, head_dim)``.
        value: Like ``key``.
        attention_mask: SDPA boolean mask ``(batch, 1, q_len, k_len)``, an additive float mask,
            or ``None`` (causal, SDPA's top-left alignment); the sparse path runs only when it is
            causal attention with key padding (read from its last row, checked on every row).
        dropout: Dropout probability; non-zero runs dense attention.
        scaling: Softmax scale (default ``head_dim ** -0.5``).
        **kwargs: Passed on to the dense fallback.

    Returns:
        ``(attn_output, None)`` with ``attn_output`` of shape ``(batch, q_len, heads, head_dim)``.
    """
    policy = _policy_for(module)
    q_len = query.shape[2]
    unsupported = _unsupported_features(module, kwargs)
    sparse = (
        not unsupported
        and q_len > 1
        and key.shape[2] >= policy.min_sparse_length
        and dropout == 0.0
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
    )
    keys = _causal_keys(attention_mask, q_len, key.shape[2]) if sparse else None
    if sparse and keys is None:
        unsupported.append("an attention mask other than causal with key padding")
    if unsupported:
        warnings.warn(
            f"sparse prefill does not support {unsupported} ({type(module).__name__}); "
            "this layer runs dense attention",
            stacklevel=2,
        )
    if keys is None or keys[0] < policy.min_sparse_length:
        for log in _ACTIVE_LOGS:
            log.dense_fallbacks += 1
        return dense_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    k_len, key_padding_mask = keys
    key, value = key[:, :, :k_len], value[:, :, :k_len]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    plan = policy.plan(query, key, key_padding_mask=key_padding_mask, scaling=scaling)
    out = sparse_prefill_attention(
        query,
        key,
        value,
        plan.block_mask,
        block_size=plan.block_size,
        key_padding_mask=key_padding_mask,
        scaling=scaling,
    )
    if _ACTIVE_LOGS:
        batch, heads, _, head_dim = query.shape
        call = SparsePrefillCall(
            layer_idx=getattr(module, "layer_idx", -1),
            q_len=q_len,
            k_len=k_len,
            density=plan_density(plan.block_mask, q_len, k_len, plan.block_size, key_padding_mask),
            regime=plan.regime,
            probe_flops=plan.probe_flops,
            dense_flops=_dense_flops(batch, heads, q_len, k_len, head_dim),
        )
        for log in _ACTIVE_LOGS:
            log.calls.append(call)
    return out.transpose(1, 2).contiguous(), None


for _name in SPARSE_PREFILL_POLICIES:
    AttentionInterface.register(_name, sparse_prefill_forward)
    AttentionMaskInterface.register(_name, sdpa_mask)
