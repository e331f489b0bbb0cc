"""Baseline sparse prefill policies (static and dynamic), and the block-mask builders they share.

Every policy implements :class:`~ada_modules.attention.plan.SparsePrefillPolicy`: keyword-only
constructor arguments with defaults, attributes ``block_size`` and ``min_sparse_length``, and
``plan(query, key, *, key_padding_mask, scaling) -> BlockPlan``. Every plan keeps the diagonal
blocks of each query block (:func:`~ada_modules.attention.plan.diagonal_block_mask`), so no real
query is left without keys, and prompts shorter than ``min_sparse_length`` keys (and decode steps,
one query) get the dense causal plan (:func:`dense_fallback`).

- :class:`DensePolicy`: the causal plan (the reference arm, run by the same kernel).
- :class:`AShapePolicy`: static sink + local window (StreamingLLM, MInference's A-shape).
- :class:`VerticalSlashPolicy`: MInference's vertical-slash heads with fixed budgets, at block
  granularity: the top key blocks by the probe's vertical scores, and the top block diagonals by
  its slash scores.
- :class:`FlexPrefillPolicy`: FlexPrefill's per-head choice between query-aware block selection
  and vertical-slash, with gamma-coverage budgets.
- :class:`BlockTopKPolicy`: MInference's block-sparse heads: per query block the top-k key blocks
  by pooled ``q . k``.

``target_density`` (A-shape, vertical-slash, block top-k) replaces the fixed budget by the one
whose plan density (:func:`~ada_modules.attention.plan.plan_density`, per head) is nearest the
target at this length, to compare arms at matched density (:func:`fit_budget`).

Example:
    >>> q, k = torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    >>> plan = AShapePolicy(block_size=32, min_sparse_length=0).plan(
    ...     q, k, key_padding_mask=None, scaling=0.25)
    >>> plan.block_mask[0, 0, -1].int().tolist()  # sink block, then the local window
    [1, 0, 0, 0, 0, 0, 1, 1]
"""

from collections.abc import Callable

import torch

from ada_modules.attention.plan import (
    BlockPlan,
    causal_block_mask,
    check_block_size,
    diagonal_block_mask,
    num_blocks,
)
from ada_modules.attention.probe import (
    check_attention_inputs,
    check_count,
    check_fraction,
    coverage_count,
    js_divergence,
    last_block_probe,
    pooled_block_flops,
    pooled_block_scores,
    real_key_blocks,
)
from ada_modules.errors import InputError

__all__ = [
    "AShapePolicy",
    "BlockTopKPolicy",
    "DensePolicy",
    "FlexPrefillPolicy",
    "VerticalSlashPolicy",
    "coverage_select",
    "dense_fallback",
    "first_real_block",
    "fit_budget",
    "row_diagonal_blocks",
    "sink_local_block_mask",
    "top_count_select",
    "vertical_slash_block_mask",
]


# ----------------------------------------------------------------------------------------------
# Block-mask builders
# ----------------------------------------------------------------------------------------------


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
        high = torch.where(reached, middle, high)
        low = torch.where(reached, low, middle + 1)
    below = (low - 1).clamp_min(0)
    below_nearer = (density(below) - target_density).abs() < (density(low) - target_density).abs()
    return torch.where(below_nearer, below, low)


def _check_target(target_density: object) -> float | None:
    return None if target_density is None else check_fraction(target_density, "target_density")


# ----------------------------------------------------------------------------------------------
# Policies
# ----------------------------------------------------------------------------------------------


class DensePolicy:
    """The dense causal plan (every causal block), run by the same kernel as the sparse arms.

    Example:
        >>> q = torch.randn(1, 2, 100, 16)
        >>> DensePolicy(block_size=32).plan(q, q, key_padding_mask=None, scaling=0.25).block_mask.shape
        torch.Size([1, 2, 4, 4])
    """

    def __init__(self, *, block_size: int = 64, min_sparse_length: int = 1024) -> None:
        self.block_size = check_block_size(block_size)
        self.min_sparse_length = check_count(min_sparse_length, "min_sparse_length")

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> BlockPlan:
        """The causal block mask for this call's shapes."""
        check_attention_inputs(query, key, key_padding_mask, scaling)
        batch, heads, q_len, _ = query.shape
        mask = causal_block_mask(batch, heads, q_len, key.shape[2], self.block_size, query.device)
        return BlockPlan(block_mask=mask, block_size=self.block_size)


class AShapePolicy:
    """Static sink + local window (A-shape, StreamingLLM), no probe.

    Each query block keeps the ``sink_blocks`` first real key blocks, the ``local_blocks`` key
    blocks ending at its diagonal, and its diagonal blocks. With ``target_density`` the local
    width is the one whose plan density at this length is nearest the target (see
    :meth:`local_width`), so the static arm can be compared with others at matched density.

    Args:
        block_size: Block side (power of two >= 16). 64: MInference's and our kernel's tile.
        sink_blocks: Sink blocks (>= 0). One block holds the few sink tokens LLMs attend to.
        local_blocks: Local window in blocks, diagonal included (>= 1). Two blocks (128 tokens at
            64) keep every query's previous 64 tokens at least.
        target_density: Optional density in ``(0, 1]``; replaces ``local_blocks``.
        min_sparse_length: Fewer keys than this take the dense plan. 1024: below that a block
            plan saves little (FlexPrefill showed no gain even at 4K, its issue #12).
    """

    def __init__(
        self,
        *,
        block_size: int = 64,
        sink_blocks: int = 1,
        local_blocks: int = 2,
        target_density: float | None = None,
        min_sparse_length: int = 1024,
    ) -> None:
        self.block_size = check_block_size(block_size)
        self.sink_blocks = check_count(sink_blocks, "sink_blocks")
        self.local_blocks = check_count(local_blocks, "local_blocks", minimum=1)
        self.target_density = _check_target(target_density)
        self.min_sparse_length = check_count(min_sparse_length, "min_sparse_length")

    def local_width(self, q_len: int, k_len: int) -> int:
        """The local window (blocks) used at these lengths: ``local_blocks``, or the width whose
        unpadded plan density is nearest ``target_density``."""
        if self.target_density is None:
            return self.local_blocks
        causal = causal_block_mask(1, 1, q_len, k_len, self.block_size)[0, 0]

        def build(width: torch.Tensor) -> torch.Tensor:
            return sink_local_block_mask(
                q_len, k_len, self.block_size, self.sink_blocks, int(width.item())
            )[0]

        width = fit_budget(build, causal.shape[-1], self.target_density, causal, (1, 1))
        return max(int(width.item()), 1)

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> BlockPlan:
        """Sink + local plan; the sink follows left padding (first real key block)."""
        check_attention_inputs(query, key, key_padding_mask, scaling)
        dense = dense_fallback(query, key, self.block_size, self.min_sparse_length)
        if dense is not None:
            return dense
        batch, heads, q_len, _ = query.shape
        k_len = key.shape[2]
        first = first_real_block(key_padding_mask, batch, self.block_size, query.device)
        width = self.local_width(q_len, k_len)
        mask = sink_local_block_mask(q_len, k_len, self.block_size, self.sink_blocks, width, first)
        return BlockPlan(
            block_mask=mask.expand(-1, heads, -1, -1).clone(), block_size=self.block_size
        )


class VerticalSlashPolicy:
    """MInference-like vertical-slash plan with fixed budgets, from the last-block probe.

    The probe (:func:`~ada_modules.attention.probe.last_block_probe`) scores key blocks by their
    attention mass (verticals) and block diagonals by their slash mass; each head keeps its top
    ``num_vertical`` key blocks in every query block and its top ``num_slash`` block diagonals,
    plus the diagonal blocks. MInference selects token columns and diagonals (1000 verticals and
    6096 slashes at 128K); our kernel computes whole blocks, so budgets count blocks.

    Args:
        block_size: Block side and number of probe rows (MInference probes the last 64 queries).
        num_vertical: Key blocks kept in every query block (>= 0). 16 blocks = 1024 tokens at 64,
            about MInference's vertical budget.
        num_slash: Block diagonals kept (>= 0), the diagonal itself included. 16 blocks.
        target_density: Optional density in ``(0, 1]``; replaces both budgets, per head, by the
            pair ``(ceil(t / 2), floor(t / 2))`` whose density is nearest the target.
        min_sparse_length: See :class:`AShapePolicy`.
    """

    def __init__(
        self,
        *,
        block_size: int = 64,
        num_vertical: int = 16,
        num_slash: int = 16,
        target_density: float | None = None,
        min_sparse_length: int = 1024,
    ) -> None:
        self.block_size = check_block_size(block_size)
        self.num_vertical = check_count(num_vertical, "num_vertical")
        self.num_slash = check_count(num_slash, "num_slash")
        self.target_density = _check_target(target_density)
        self.min_sparse_length = check_count(min_sparse_length, "min_sparse_length")

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> BlockPlan:
        """Probe, then keep the top verticals and slashes of each head."""
        scaling = check_attention_inputs(query, key, key_padding_mask, scaling)
        dense = dense_fallback(query, key, self.block_size, self.min_sparse_length)
        if dense is not None:
            return dense
        batch, heads, q_len, _ = query.shape
        k_len = key.shape[2]
        probe = last_block_probe(
            query,
            key,
            block_size=self.block_size,
            key_padding_mask=key_padding_mask,
            scaling=scaling,
        )
        valid = probe.valid_blocks[:, None, :]
        offsets = torch.arange(valid.shape[-1], device=query.device)
        slash_allowed = (offsets <= (probe.last_block - probe.first_block)[:, None])[:, None, :]

        def build(num_vertical: torch.Tensor, num_slash: torch.Tensor) -> torch.Tensor:
            vertical = top_count_select(probe.block_probs, num_vertical, valid)
            slash = top_count_select(probe.slash_blocks, num_slash, slash_allowed)
            return vertical_slash_block_mask(vertical, slash, q_len, k_len, self.block_size)

        shape = (batch, heads)
        if self.target_density is None:
            num_vertical = torch.full(shape, self.num_vertical, device=query.device)
            num_slash = torch.full(shape, self.num_slash, device=query.device)
        else:
            causal = causal_block_mask(1, 1, q_len, k_len, self.block_size, query.device)[0, 0]
            steps = fit_budget(
                lambda t: build((t + 1) // 2, t // 2),
                2 * causal.shape[-1],
                self.target_density,
                causal,
                shape,
            )
            num_vertical, num_slash = (steps + 1) // 2, steps // 2
        return BlockPlan(
            block_mask=build(num_vertical, num_slash),
            block_size=self.block_size,
            probe_flops=probe.flops,
            stats={"num_vertical": num_vertical, "num_slash": num_slash},
        )


class FlexPrefillPolicy:
    """FlexPrefill (Lai et al., 2025), re-implemented in torch on a block plan.

    From the last-block probe, each head compares FlexPrefill's pooled estimate of the last
    query block's attention (softmax of its mean query times the mean key of every block, the
    row of :func:`~ada_modules.attention.probe.pooled_block_scores`) with the probe's true block
    distribution:

    - ``sqrt(JS) < tau`` (the pooled estimate is trustworthy): *query-aware* head, each query
      block keeps the fewest key blocks holding ``gamma`` of its pooled scores;
    - otherwise a *vertical-slash* head, with budgets from gamma-coverage of the probe's vertical
      (per key block) and slash (per block diagonal) scores.

    Budgets are clamped to ``[min_budget, max_budget]`` blocks, plus the diagonal blocks.
    Differences from FlexPrefill's code: budgets count blocks (it counts tokens for
    vertical-slash heads); query-aware coverage is per query block (it covers ``gamma * rows`` of
    the head's total), so no query block is starved; any batch size (it asserts batch 1).

    Args:
        block_size: Block side and probe rows (FlexPrefill uses 128; 64 is our kernel's tile).
        gamma: Coverage target in ``(0, 1]``; 0.9 is FlexPrefill's setting.
        tau: JS threshold (>= 0) on ``sqrt(JS)`` (natural log, at most ``sqrt(log 2) ~ 0.83``);
            0.1 is FlexPrefill's setting; 0 makes every head vertical-slash.
        min_budget: Fewest blocks per query block / per vertical and slash set (>= 1).
        max_budget: Most blocks per set (``None``: no cap).
        min_sparse_length: See :class:`AShapePolicy`.
    """

    def __init__(
        self,
        *,
        block_size: int = 64,
        gamma: float = 0.9,
        tau: float = 0.1,
        min_budget: int = 1,
        max_budget: int | None = None,
        min_sparse_length: int = 1024,
    ) -> None:
        self.block_size = check_block_size(block_size)
        self.gamma = check_fraction(gamma, "gamma")
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not tau >= 0:
            raise InputError(f"tau must be a number >= 0, got {tau!r}")
        self.tau = float(tau)
        self.min_budget = check_count(min_budget, "min_budget", minimum=1)
        if max_budget is not None and check_count(max_budget, "max_budget", minimum=1) < min_budget:
            raise InputError(f"max_budget ({max_budget}) must be >= min_budget ({min_budget})")
        self.max_budget = max_budget
        self.min_sparse_length = check_count(min_sparse_length, "min_sparse_length")

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> BlockPlan:
        """Probe, classify each head by the JS test, then select its blocks."""
        scaling = check_attention_inputs(query, key, key_padding_mask, scaling)
        dense = dense_fallback(query, key, self.block_size, self.min_sparse_length)
        if dense is not None:
            return dense
        batch, heads, q_len, head_dim = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        probe = last_block_probe(
            query,
            key,
            block_size=self.block_size,
            key_padding_mask=key_padding_mask,
            scaling=scaling,
        )
        pooled = pooled_block_scores(query, key, self.block_size, key_padding_mask, scaling)
        last_row = (probe.last_query // self.block_size)[:, None, None, None]
        estimate = pooled.gather(2, last_row.expand(-1, heads, 1, pooled.shape[-1]))[:, :, 0]
        distance = js_divergence(estimate, probe.block_probs).sqrt()
        query_aware = distance < self.tau

        causal = causal_block_mask(1, 1, q_len, k_len, self.block_size, query.device)
        allowed = causal & probe.valid_blocks[:, None, None, :]
        rows = coverage_select(pooled, self.gamma, allowed, self.min_budget, self.max_budget)
        diagonal = diagonal_block_mask(q_len, k_len, self.block_size, query.device)
        query_aware_mask = (rows & causal) | diagonal

        offsets = torch.arange(pooled.shape[-1], device=query.device)
        slash_allowed = (offsets <= (probe.last_block - probe.first_block)[:, None])[:, None, :]
        slash_scores = probe.slash_blocks * slash_allowed
        vertical = coverage_select(
            probe.block_probs,
            self.gamma,
            probe.valid_blocks[:, None, :],
            self.min_budget,
            self.max_budget,
        )
        slash = coverage_select(
            slash_scores, self.gamma, slash_allowed, self.min_budget, self.max_budget
        )
        vertical_slash_mask = vertical_slash_block_mask(
            vertical, slash, q_len, k_len, self.block_size
        )
        mask = torch.where(query_aware[:, :, None, None], query_aware_mask, vertical_slash_mask)
        flops = probe.flops + pooled_block_flops(
            batch, heads, kv_heads, q_len, k_len, head_dim, self.block_size
        )
        return BlockPlan(
            block_mask=mask,
            block_size=self.block_size,
            probe_flops=flops,
            stats={"query_aware": query_aware, "js_distance": distance},
        )


class BlockTopKPolicy:
    """MInference-like block-sparse heads: per query block the top-k key blocks by pooled scores.

    Scores are :func:`~ada_modules.attention.probe.pooled_block_scores` (mean-pooled query block
    times mean-pooled key block, MInference's ``_build_block_index``); the diagonal blocks are
    added on top of the ``top_k``.

    Args:
        block_size: Block side (64, MInference's block).
        top_k: Key blocks per query block (>= 1). 16 blocks = 1024 tokens at 64, the same
            token budget as :class:`VerticalSlashPolicy`'s verticals.
        target_density: Optional density in ``(0, 1]``; replaces ``top_k`` per head.
        min_sparse_length: See :class:`AShapePolicy`.
    """

    def __init__(
        self,
        *,
        block_size: int = 64,
        top_k: int = 16,
        target_density: float | None = None,
        min_sparse_length: int = 1024,
    ) -> None:
        self.block_size = check_block_size(block_size)
        self.top_k = check_count(top_k, "top_k", minimum=1)
        self.target_density = _check_target(target_density)
        self.min_sparse_length = check_count(min_sparse_length, "min_sparse_length")

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> BlockPlan:
        """Pooled scores, then the top-k key blocks of each query block."""
        scaling = check_attention_inputs(query, key, key_padding_mask, scaling)
        dense = dense_fallback(query, key, self.block_size, self.min_sparse_length)
        if dense is not None:
            return dense
        batch, heads, q_len, head_dim = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        pooled = pooled_block_scores(query, key, self.block_size, key_padding_mask, scaling)
        causal = causal_block_mask(1, 1, q_len, k_len, self.block_size, query.device)[0, 0]
        diagonal = diagonal_block_mask(q_len, k_len, self.block_size, query.device)
        allowed = (
            causal
            & real_key_blocks(key_padding_mask, batch, k_len, self.block_size, query.device)[
                :, None, None, :
            ]
        )

        def build(top_k: torch.Tensor) -> torch.Tensor:
            return top_count_select(pooled, top_k[:, :, None], allowed) | diagonal

        if self.target_density is None:
            top_k = torch.full((batch, heads), self.top_k, device=query.device)
        else:
            top_k = fit_budget(build, causal.shape[-1], self.target_density, causal, (batch, heads))
        return BlockPlan(
            block_mask=build(top_k),
            block_size=self.block_size,
            probe_flops=pooled_block_flops(
                batch, heads, kv_heads, q_len, k_len, head_dim, self.block_size
            ),
            stats={"top_k": top_k},
        )
