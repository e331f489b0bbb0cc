"""Baseline sparse prefill policies, static and dynamic, on the same block-sparse kernel.

Every policy implements :class:`~ada_modules.attention.plan.SparsePrefillPolicy`: keyword-only
constructor arguments with defaults, attributes ``block_size`` and ``min_sparse_length``, and
``plan(query, key, *, key_padding_mask, scaling) -> BlockPlan``. Every plan keeps the diagonal
blocks of each query block (:func:`~ada_modules.attention.plan.diagonal_block_mask`), so no real
query is left without keys, and prompts shorter than ``min_sparse_length`` keys (and decode steps,
one query) get the dense causal plan (:func:`~ada_modules.attention.block_masks.dense_fallback`).

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
target at this length, to compare arms at matched density (:func:`~ada_modules.attention.block_masks.fit_budget`).

Example:
    >>> q, k = torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    >>> plan = AShapePolicy(block_size=32, min_sparse_length=0).plan(
    ...     q, k, key_padding_mask=None, scaling=0.25)
    >>> plan.block_mask[0, 0, -1].int().tolist()  # sink block, then the local window
    [1, 0, 0, 0, 0, 0, 1, 1]
"""

import torch

from ada_modules.attention.block_masks import (
    coverage_select,
    dense_fallback,
    first_real_block,
    fit_budget,
    sink_local_block_mask,
    top_count_select,
    vertical_slash_block_mask,
)
from ada_modules.attention.plan import (
    BlockPlan,
    causal_block_mask,
    check_block_size,
    diagonal_block_mask,
)
from ada_modules.attention.probe import (
    check_attention_inputs,
    check_count,
    check_fraction,
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
]


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
