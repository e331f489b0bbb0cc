"""Block plans for sparse prefill: which key blocks each query block attends to.

A plan is a boolean ``block_mask`` of shape ``(batch, heads, query_blocks, key_blocks)``. The
queries are the *last* ``q_len`` positions of the ``k_len`` keys (``q_len == k_len`` in a plain
prefill, ``q_len < k_len`` for a later chunk of a chunked prefill): query ``i`` sits at absolute
position ``k_len - q_len + i``. Query block ``r`` holds queries ``[r * block_size, (r + 1) *
block_size)`` (counted from the first query), key block ``c`` holds keys ``[c * block_size, (c + 1)
* block_size)`` (counted from key 0); the last block of each may be ragged. Causality is applied
per element inside the kernel, so a plan may select a block that is only partly causal.

Every policy (AdaCal and the baselines) implements :class:`SparsePrefillPolicy` and returns a
:class:`BlockPlan`; :func:`~ada_modules.kernels.sparse_prefill.sparse_prefill_attention` runs it.

Example:
    >>> mask = causal_block_mask(1, 2, 200, 200, block_size=64)
    >>> mask.shape, plan_density(mask, 200, 200, block_size=64)
    (torch.Size([1, 2, 4, 4]), 1.0)
"""

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ada_modules.errors import InputError
from ada_modules.kernels.sparse_prefill import causal_block_mask, check_block_size, num_blocks

__all__ = [
    "BlockPlan",
    "SparsePrefillPolicy",
    "causal_block_mask",
    "check_block_size",
    "diagonal_block_mask",
    "num_blocks",
    "plan_density",
]


def plan_density(
    block_mask: torch.Tensor,
    q_len: int,
    k_len: int,
    block_size: int,
    key_padding_mask: torch.Tensor | None = None,
) -> float:
    """Computed blocks over causal blocks (1.0 for the dense plan), over the whole batch and heads.

    Blocks of the mask outside the causal region are not counted: they cost nothing. With a
    ``key_padding_mask`` (boolean ``(batch, k_len)``, ``True`` for real keys), key blocks made
    only of padding are left out of both counts, as the kernel skips them.

    Example:
        >>> mask = causal_block_mask(2, 1, 64, 64, block_size=16)
        >>> mask[1, :, :, 1:] = False  # the second element keeps only its first key block
        >>> padding = torch.ones(2, 64, dtype=torch.bool)
        >>> padding[0, 48:] = False  # the first element's last key block is padding
        >>> plan_density(mask, 64, 64, 16), plan_density(mask, 64, 64, 16, padding)
        (0.7, 0.6842105263157895)
    """
    batch, heads = block_mask.shape[:2]
    causal = causal_block_mask(1, 1, q_len, k_len, block_size, block_mask.device)[0]
    if block_mask.shape[-2:] != causal.shape[-2:]:
        raise InputError(
            f"block_mask has {tuple(block_mask.shape[-2:])} blocks, expected "
            f"{tuple(causal.shape[-2:])} for q_len={q_len}, k_len={k_len}, block_size={block_size}"
        )
    counted = causal.expand(batch, -1, -1, -1)
    if key_padding_mask is not None:
        padded = torch.nn.functional.pad(key_padding_mask, (0, -k_len % block_size))
        real = padded.view(batch, -1, block_size).any(-1)  # (batch, key blocks)
        counted = counted & real[:, None, None, :]
    computed = (block_mask & counted).sum().item()
    return computed / (counted.sum().item() * heads)


@dataclass
class BlockPlan:
    """What a policy decided for one attention call.

    Attributes:
        block_mask: Boolean ``(batch, heads, query_blocks, key_blocks)``; see the module docs.
        block_size: Side of a block, a power of two >= 16.
        regime: Per batch element, the task regime the policy dispatched to (AdaCal:
            ``"structure"`` or ``"retrieval"``); ``None`` for policies without dispatch.
        probe_flops: Multiply-adds the policy spent on its probe (0 for static plans).
        stats: Per-head tensors the policy computed (``(batch, heads)`` each, e.g. ``entropy``,
            ``concentration``, ``mid_mass``, ``mid_coverage``, ``query_aware``), for logging.
    """

    block_mask: torch.Tensor
    block_size: int
    regime: list[str] | None = None
    probe_flops: int = 0
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class SparsePrefillPolicy(Protocol):
    """Chooses a block plan from the queries and keys of one attention call (one layer).

    Args of ``plan``:
        query: ``(batch, q_heads, q_len, head_dim)``.
        key: ``(batch, kv_heads, k_len, head_dim)``; ``q_heads`` is a multiple of ``kv_heads``
            (grouped-query attention: query head ``h`` reads key head ``h // (q_heads // kv_heads)``).
        key_padding_mask: Boolean ``(batch, k_len)``, ``True`` where the key is a real token
            (``None``: no padding).
        scaling: Softmax scale of the attention scores.
    """

    block_size: int
    min_sparse_length: int
    """Prompts with fewer keys than this (and every decode step) take the dense path."""

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None,
        scaling: float,
    ) -> BlockPlan: ...


def diagonal_block_mask(
    q_len: int, k_len: int, block_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """The key blocks that hold the queries' own positions, per query block: ``(q_blocks, k_blocks)``.

    Query block ``r`` spans absolute positions ``k_len - q_len + r * block_size`` to its last
    query; its diagonal blocks are the key blocks holding those positions (one block, or two when
    ``k_len - q_len`` is not a multiple of ``block_size``). A plan that keeps them gives every real
    query at least its own key, so no softmax row is empty.

    Example:
        >>> diagonal_block_mask(3, 5, block_size=16).int().tolist()  # one ragged block each
        [[1]]
        >>> diagonal_block_mask(32, 40, block_size=16).int().tolist()
        [[1, 1, 0], [0, 1, 1]]
    """
    check_block_size(block_size)
    if q_len > k_len:
        raise InputError(f"q_len ({q_len}) may not exceed k_len ({k_len})")
    offset = k_len - q_len
    rows = torch.arange(num_blocks(q_len, block_size), device=device)
    cols = torch.arange(num_blocks(k_len, block_size), device=device)
    first = (offset + rows * block_size) // block_size
    last = (offset + torch.clamp((rows + 1) * block_size, max=q_len) - 1) // block_size
    return (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])
