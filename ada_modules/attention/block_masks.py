"""Block-mask builders shared by the sparse prefill policies.

Each returns a boolean ``(batch, heads, query_blocks, key_blocks)`` mask in the layout of
:mod:`ada_modules.attention.plan` (or, for the selection helpers, a mask to be OR-ed into one):
the dense fallback for short prompts and decode steps, the diagonal blocks of each query block,
sink + local windows, vertical-slash masks, top-count and gamma-coverage selections, and the
budget search that meets a target density.
"""

from collections.abc import Callable

import torch

from ada_modules.attention.plan import (
    BlockPlan,
    causal_block_mask,
    diagonal_block_mask,
    num_blocks,
)
from ada_modules.attention.probe import coverage_count

__all__ = [
    "coverage_select",
    "dense_fallback",
    "first_real_block",
    "fit_budget",
    "row_diagonal_blocks",
    "sink_local_block_mask",
    "top_count_select",
    "vertical_slash_block_mask",
]


def dense_fallback(
    query: torch.Tensor, key: torch.Tensor, block_size: int, min_sparse_length: int
) -> BlockPlan | None:
    """The dense causal plan for a decode step or a prompt under ``min_sparse_length`` keys,
    else ``None`` (plan sparsely)."""
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if q_len > 1 and k_len >= min_sparse_length:
        return None
    mask = causal_block_mask(batch, heads, q_len, k_len, block_size, query.device)
    return BlockPlan(block_mask=mask, block_size=block_size)


def first_real_block(
    key_padding_mask: torch.Tensor | None, batch: int, block_size: int, device: torch.device
) -> torch.Tensor:
    """``(batch,)``: the block of each element's first real key (0 without padding)."""
    if key_padding_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return key_padding_mask.int().argmax(-1) // block_size


def row_diagonal_blocks(
    q_len: int, k_len: int, block_size: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` ``(q_blocks,)``: first and last key block holding a query of each row."""
    offset = k_len - q_len
    rows = torch.arange(num_blocks(q_len, block_size), device=device)
    lo = (offset + rows * block_size) // block_size
    hi = (offset + torch.clamp((rows + 1) * block_size, max=q_len) - 1) // block_size
    return lo, hi


def sink_local_block_mask(
    q_len: int,
    k_len: int,
    block_size: int,
    sink_blocks: int,
    local_blocks: int,
    first_block: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The static A-shape plan: ``(batch or 1, 1, q_blocks, k_blocks)``.

    Each query block keeps ``sink_blocks`` blocks from ``first_block`` (per batch element, the
    first real block; default 0), the ``local_blocks`` blocks ending at its last diagonal block,
    and its diagonal blocks; all within the causal region.

    Example:
        >>> sink_local_block_mask(128, 128, 32, sink_blocks=1, local_blocks=1)[0, 0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    """
    if first_block is None:
        first_block = torch.zeros(1, dtype=torch.long, device=device)
    causal = causal_block_mask(1, 1, q_len, k_len, block_size, first_block.device)[0, 0]
    diagonal = diagonal_block_mask(q_len, k_len, block_size, first_block.device)
    _, hi = row_diagonal_blocks(q_len, k_len, block_size, first_block.device)
    cols = torch.arange(causal.shape[-1], device=first_block.device)
    first = first_block[:, None, None]
    sink = (cols >= first) & (cols < first + sink_blocks)
    local = cols > (hi[:, None] - local_blocks)
    return (((sink | local) & causal) | diagonal).unsqueeze(1)


def vertical_slash_block_mask(
    vertical: torch.Tensor, slash: torch.Tensor, q_len: int, k_len: int, block_size: int
) -> torch.Tensor:
    """Block plan ``(B, H, q_blocks, k_blocks)`` from selected verticals and block diagonals.

    Args:
        vertical: Boolean ``(B, H, k_blocks)``: key blocks every query block keeps.
        slash: Boolean ``(B, H, k_blocks)``: block offsets ``j``; query block ``r`` keeps the key
            blocks ``j`` blocks before each of its diagonal blocks.
    """
    device = vertical.device
    lo, hi = row_diagonal_blocks(q_len, k_len, block_size, device)
    cols = torch.arange(vertical.shape[-1], device=device)
    mask = vertical[:, :, None, :]
    for diagonal in (lo, hi):
        offset = diagonal[:, None] - cols  # (q_blocks, k_blocks)
        mask = mask | (slash[:, :, offset.clamp_min(0)] & (offset >= 0))
    causal = causal_block_mask(1, 1, q_len, k_len, block_size, device)
    return (mask & causal) | diagonal_block_mask(q_len, k_len, block_size, device)


def top_count_select(
    scores: torch.Tensor, count: torch.Tensor | int, allowed: torch.Tensor
) -> torch.Tensor:
    """Boolean mask of the ``count`` highest ``scores`` (``(..., N)``) among ``allowed``.

    ``count`` broadcasts against ``scores.shape[:-1]``; ties go to the lower index.

    Example:
        >>> allowed = torch.tensor([True, True, False, True])
        >>> top_count_select(torch.tensor([0.1, 0.5, 0.9, 0.3]), 2, allowed).int().tolist()
        [0, 1, 0, 1]
    """
    masked = scores.float().masked_fill(~allowed, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    count = torch.as_tensor(count, device=scores.device)
    return (rank < count.unsqueeze(-1)) & allowed


def coverage_select(
    p: torch.Tensor,
    gamma: float | torch.Tensor,
    allowed: torch.Tensor,
    min_count: int | torch.Tensor = 1,
    max_count: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The fewest ``allowed`` entries of ``p`` (``(..., N)``) holding ``gamma`` of its allowed
    mass, their number clamped to ``[min_count, max_count]`` (FlexPrefill's ``score_cover``).

    Example:
        >>> p = torch.tensor([0.5, 0.1, 0.3, 0.1])
        >>> coverage_select(p, 0.8, torch.ones(4, dtype=torch.bool)).int().tolist()
        [1, 0, 1, 0]
    """
    count = coverage_count(p * allowed, gamma)
    count = torch.maximum(count, torch.as_tensor(min_count, device=p.device))
    if max_count is not None:
        count = torch.minimum(count, torch.as_tensor(max_count, device=p.device))
    return top_count_select(p, count, allowed)


def fit_budget(
    build: Callable[[torch.Tensor], torch.Tensor],
    max_budget: int,
    target_density: float,
    causal: torch.Tensor,
    shape: tuple[int, int],
) -> torch.Tensor:
    """Per ``(batch, head)``, the budget in ``[0, max_budget]`` whose plan density is nearest
    ``target_density`` (ties: the denser one).

    Args:
        build: Budget tensor ``shape`` (long) -> block mask ``(*shape, q_blocks, k_blocks)``;
            its selections must be nested as the budget grows (density non-decreasing).
        max_budget: Largest budget tried.
        target_density: Target computed blocks over causal blocks, per head.
        causal: Boolean ``(q_blocks, k_blocks)`` causal region.
        shape: ``(batch, heads)`` of the budgets.

    A bisection finds the smallest budget reaching the target, then keeps it or the one below,
    whichever is nearer; with budgets that add at most one block per query block per step, the
    density is then within half a block per query block of the target (when reachable).
    """
    causal_count = causal.sum().float()

    def density(budget: torch.Tensor) -> torch.Tensor:
        return (build(budget) & causal).sum((-2, -1)).float() / causal_count

    low = torch.zeros(shape, dtype=torch.long, device=causal.device)
    high = torch.full(shape, max_budget, dtype=torch.long, device=causal.device)
    while bool((low < high).any()):
        middle = (low + high) // 2
        reached = density(middle) >= target_density
        done = reached | (low >= high)  # converged entries stay put
        high = torch.where(reached, middle, high)
        low = torch.where(done, low, middle + 1)
    below = (low - 1).clamp_min(0)
    below_nearer = (density(below) - target_density).abs() < (density(low) - target_density).abs()
    return torch.where(below_nearer, below, low)
