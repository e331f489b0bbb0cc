"""Block-sparse causal prefill attention: the kernel that runs a sparse-prefill block plan.

A plan (see :mod:`ada_modules.attention.plan`) is a boolean ``block_mask`` of shape ``(batch,
q_heads, ceil(q_len / block_size), ceil(k_len / block_size))``. The queries are the *last*
``q_len`` positions of the ``k_len`` keys, so query ``i`` sits at absolute position
``k_len - q_len + i`` (``q_len < k_len``: a later chunk of a chunked prefill). Query ``i`` of head
``h`` attends to key ``j`` iff

* the block ``(i // block_size, j // block_size)`` is selected in ``block_mask[b, h]``,
* ``j <= k_len - q_len + i`` (causal), and
* ``key_padding_mask[b, j]`` is ``True`` (when a padding mask is given).

The softmax runs over the attended keys only, in fp32; a query with no attended key gets a zero
output (not NaN). Grouped-query attention: query head ``h`` reads key/value head
``h // (q_heads // kv_heads)``.

**Kernel.** :func:`block_mask_to_indices` turns the plan into, per ``(batch, head, query
block)``, the ascending list of selected key blocks and its length (after dropping blocks above
the causal diagonal and blocks made only of padding: they cost nothing). ``_sparse_prefill_kernel``
runs one program per ``(query tile, batch * q_head)`` (the heaviest query tiles, the last ones,
first), walks that list with an online softmax in base 2 (``exp2``, the scale folded with
``log2(e)``), ``tl.dot`` for ``Q K^T`` and ``P V``, and applies the causal, padding and
ragged-edge masks per element. Query tiles (``BLOCK_M`` rows) and key tiles (``BLOCK_N`` keys)
divide ``block_size`` and are the largest that fit the device's shared memory (smaller ones after
an out-of-resources error; the choice is remembered). Head dims that are not a power of two are
padded (masked loads). fp32 inputs use IEEE fp32 dots (no TF32), so the kernel matches the
reference to rounding.

Each operation has the three parts of the kernel pattern (see :mod:`ada_modules.kernels`):
``_<name>_kernel`` (Triton), ``<name>_reference`` (torch, the specification) and
``<name>(..., impl="auto")``.

Example:
    >>> from ada_modules.kernels.sparse_prefill import causal_block_mask
    >>> q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    >>> plan = causal_block_mask(1, 4, 40, 40, block_size=16)  # the dense causal plan
    >>> out = sparse_prefill_attention(q, k, v, plan, block_size=16)
    >>> sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    >>> torch.allclose(out, sdpa, atol=1e-5)
    True
"""

# Triton reads argument annotations as types and specialisations, so kernel arguments stay bare.
# ruff: noqa: ANN001

import math

import torch

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import FLOAT_DTYPES, Impl, resolve_impl, triton_available

__all__ = [
    "block_mask_to_indices",
    "causal_block_mask",
    "check_block_size",
    "num_blocks",
    "sparse_prefill_attention",
    "sparse_prefill_attention_reference",
]


_REFERENCE_CHUNK_ELEMENTS = 1 << 24
"""Score elements (``batch * q_heads * queries * keys``) the reference holds at once: 64 MiB of
fp32 scores (plus masks of a byte each); whole query blocks, at least one per chunk."""


# ----------------------------------------------------------------------------------------------
# Block geometry (re-exported by ada_modules.attention.plan, whose policies build the plans)
# ----------------------------------------------------------------------------------------------


def check_block_size(block_size: object, name: str = "block_size") -> int:
    """Return ``block_size`` if it is a power of two >= 16, else raise :class:`InputError`."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 16
        or block_size & (block_size - 1)
    ):
        raise InputError(f"{name} must be a power of two >= 16, got {block_size!r}")
    return block_size


def num_blocks(length: int, block_size: int) -> int:
    """Number of blocks of ``block_size`` covering ``length`` positions (the last may be ragged)."""
    return math.ceil(length / block_size)


def causal_block_mask(
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    block_size: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The dense causal plan: every key block that holds a key visible to some query of the block.

    Returns:
        Boolean tensor ``(batch, heads, ceil(q_len / block_size), ceil(k_len / block_size))``.
    """
    check_block_size(block_size)
    if q_len > k_len:
        raise InputError(f"q_len ({q_len}) may not exceed k_len ({k_len})")
    offset = k_len - q_len
    rows = torch.arange(num_blocks(q_len, block_size), device=device)
    cols = torch.arange(num_blocks(k_len, block_size), device=device)
    last_query = offset + torch.clamp((rows + 1) * block_size, max=q_len) - 1
    mask = cols[None, :] * block_size <= last_query[:, None]
    return mask.expand(batch, heads, -1, -1).clone()


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def _check_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int,
    key_padding_mask: torch.Tensor | None,
    scaling: float | None,
) -> float:
    """Validate the arguments of the sparse prefill functions; return the softmax scale."""
    check_block_size(block_size)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InputError(
                f"{name} must be a 4-d tensor (batch, heads, length, head_dim), got {_describe(t)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise InputError(f"{name} must have dtype in {FLOAT_DTYPES}, got {t.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise InputError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype} and "
            f"{value.dtype}"
        )
    if value.shape != key.shape:
        raise InputError(
            f"value must have the shape of key {tuple(key.shape)}, got {tuple(value.shape)}"
        )
    batch, q_heads, q_len, head_dim = query.shape
    k_batch, kv_heads, k_len, k_dim = key.shape
    if k_batch != batch:
        raise InputError(f"key has batch {k_batch}, expected the query's batch {batch}")
    if k_dim != head_dim:
        raise InputError(f"key has head_dim {k_dim}, expected the query's head_dim {head_dim}")
    if kv_heads == 0 or q_heads % kv_heads:
        raise InputError(
            f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})"
        )
    if q_len > k_len:
        raise InputError(
            f"query length ({q_len}) may not exceed key length ({k_len}): the queries are the "
            "last positions of the keys"
        )
    expected = (batch, q_heads, num_blocks(q_len, block_size), num_blocks(k_len, block_size))
    if (
        not isinstance(block_mask, torch.Tensor)
        or block_mask.dtype != torch.bool
        or tuple(block_mask.shape) != expected
    ):
        raise InputError(
            "block_mask must be a bool tensor (batch, q_heads, ceil(q_len / block_size), "
            f"ceil(k_len / block_size)) = {expected} for block_size={block_size}, got "
            f"{_describe(block_mask)}"
        )
    if key_padding_mask is not None and (
        not isinstance(key_padding_mask, torch.Tensor)
        or key_padding_mask.dtype != torch.bool
        or tuple(key_padding_mask.shape) != (batch, k_len)
    ):
        raise InputError(
            f"key_padding_mask must be a bool tensor (batch, k_len) = {(batch, k_len)}, got "
            f"{_describe(key_padding_mask)}"
        )
    if scaling is None:
        return head_dim**-0.5
    if (
        isinstance(scaling, bool)
        or not isinstance(scaling, int | float)
        or not math.isfinite(scaling)
    ):
        raise InputError(f"scaling must be a finite number or None, got {scaling!r}")
    return float(scaling)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def sparse_prefill_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: torch.Tensor,
    *,
    block_size: int,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Block-sparse causal attention as a dense masked softmax, in torch (the specification).

    Runs over chunks of whole query blocks (about 2**24 scores at a time), each against the keys
    its last query can see; grouped-query heads share their key/value head's tensor (no copies).

    Args:
        query: ``(batch, q_heads, q_len, head_dim)``, fp32/fp16/bf16.
        key: ``(batch, kv_heads, k_len, head_dim)``, same dtype; ``q_heads % kv_heads == 0`` and
            ``q_len <= k_len``.
        value: Same shape and dtype as ``key``.
        block_mask: Bool ``(batch, q_heads, ceil(q_len / block_size), ceil(k_len / block_size))``.
        block_size: Side of a block, a power of two >= 16.
        key_padding_mask: Optional bool ``(batch, k_len)``, ``True`` for a real key.
        scaling: Softmax scale; ``head_dim ** -0.5`` when ``None``.

    Returns:
        ``(batch, q_heads, q_len, head_dim)`` in ``query.dtype``; zeros for a query that attends
        to no key.

    Raises:
        InputError: If a shape, dtype or value is not allowed (the message names it).

    Example:
        >>> q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16)
        >>> mask = torch.tensor([[False, False], [True, True]]).expand(1, 2, 2, 2)
        >>> out = sparse_prefill_attention_reference(q, k, v, mask, block_size=16)
        >>> out.shape, bool(out[:, :, :16].eq(0).all())  # query block 0 selects no key block
        (torch.Size([1, 2, 20, 16]), True)
    """
    scale = _check_args(query, key, value, block_mask, block_size, key_padding_mask, scaling)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    offset = k_len - q_len
    device = query.device
    out = torch.zeros(query.shape, dtype=query.dtype, device=device)
    if out.numel() == 0:
        return out
    key32, value32 = key.float(), value.float()
    per_block = batch * q_heads * block_size * k_len
    rows_per_chunk = max(1, _REFERENCE_CHUNK_ELEMENTS // per_block)
    for r0 in range(0, num_blocks(q_len, block_size), rows_per_chunk):
        q_lo = r0 * block_size
        q_hi = min(q_len, (r0 + rows_per_chunk) * block_size)
        k_hi = offset + q_hi  # no query of the chunk sees a later key
        n = q_hi - q_lo
        q = query[:, :, q_lo:q_hi].float().mul(scale)
        q = q.reshape(batch, kv_heads, group * n, head_dim)  # GQA: the group's rows together
        scores = torch.matmul(q, key32[:, :, :k_hi].transpose(-1, -2))
        scores = scores.view(batch, q_heads, n, k_hi)

        # Masked-out elements: blocks not selected (every block repeated block_size x block_size
        # times, then cut to the chunk), keys after the query, padding.
        blocks = block_mask[:, :, r0 : r0 + rows_per_chunk, : num_blocks(k_hi, block_size)]
        r, c = blocks.shape[2:]
        dropped = blocks.logical_not()[:, :, :, None, :, None]
        dropped = dropped.expand(-1, -1, r, block_size, c, block_size).contiguous()  # a copy
        dropped = dropped.view(batch, q_heads, r * block_size, c * block_size)[..., :n, :k_hi]
        rows = torch.arange(q_lo, q_hi, device=device)
        dropped |= torch.arange(k_hi, device=device) > offset + rows[:, None]
        if key_padding_mask is not None:
            dropped |= key_padding_mask[:, None, None, :k_hi].logical_not()
        has_key = dropped.logical_not().any(dim=-1, keepdim=True)
        scores.masked_fill_(dropped, float("-inf"))
        del dropped

        probs = torch.softmax(scores, dim=-1)  # NaN on rows without keys, zeroed below
        del scores
        probs = probs.view(batch, kv_heads, group * n, k_hi)
        chunk = torch.matmul(probs, value32[:, :, :k_hi]).view(batch, q_heads, n, head_dim)
        out[:, :, q_lo:q_hi] = torch.where(has_key, chunk, 0.0)
    return out


# ----------------------------------------------------------------------------------------------
# Block lists
# ----------------------------------------------------------------------------------------------


def block_mask_to_indices(block_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected key blocks of every query block, as padded ascending lists.

    Args:
        block_mask: Bool ``(..., query_blocks, key_blocks)``.

    Returns:
        ``(indices, counts)``: int32 ``(..., query_blocks, width)`` with the selected key block
        numbers of each row in ascending order in its first ``counts[...]`` entries (the rest is
        padding, not to be read), ``width = max(1, counts.max())``; and int32 counts
        ``(..., query_blocks)``.

    Raises:
        InputError: If ``block_mask`` is not a bool tensor of at least 2 dims.

    Example:
        >>> mask = torch.tensor([[True, False, True], [False, False, False]])
        >>> indices, counts = block_mask_to_indices(mask)
        >>> indices[0].tolist(), counts.tolist()
        ([0, 2], [2, 0])
    """
    if (
        not isinstance(block_mask, torch.Tensor)
        or block_mask.dtype != torch.bool
        or block_mask.dim() < 2
    ):
        raise InputError(
            f"block_mask must be a bool tensor (..., query_blocks, key_blocks), got "
            f"{_describe(block_mask)}"
        )
    counts = block_mask.sum(dim=-1, dtype=torch.int32)
    width = max(1, int(counts.max().item())) if counts.numel() else 1
    # Stable sort of "not selected": the selected columns come first, in ascending order.
    order = torch.sort(block_mask.logical_not().to(torch.uint8), dim=-1, stable=True).indices
    indices = order[..., :width].to(torch.int32)
    if indices.shape[-1] < width:  # no key blocks at all
        indices = block_mask.new_zeros((*block_mask.shape[:-1], width), dtype=torch.int32)
    return indices.contiguous(), counts


def _kernel_block_mask(
    block_mask: torch.Tensor,
    q_len: int,
    k_len: int,
    block_size: int,
    key_padding_mask: torch.Tensor | None,
) -> torch.Tensor:
    """``block_mask`` without the blocks no element of which is attended: those above the causal
    diagonal and, with padding, the key blocks of padding only (they would be loaded for
    nothing)."""
    causal = causal_block_mask(1, 1, q_len, k_len, block_size, block_mask.device)
    mask = block_mask & causal
    if key_padding_mask is not None:
        key_blocks = num_blocks(k_len, block_size)
        padded = torch.nn.functional.pad(key_padding_mask, (0, key_blocks * block_size - k_len))
        has_key = padded.view(-1, key_blocks, block_size).any(dim=-1)
        mask &= has_key[:, None, None, :]
    return mask


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

if triton_available():
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    @triton.jit
    def _sparse_prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        indices_ptr,
        counts_ptr,
        pad_ptr,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_qd,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_kd,
        stride_vb,
        stride_vh,
        stride_vn,
        stride_vd,
        stride_ob,
        stride_oh,
        stride_om,
        stride_od,
        stride_pad,
        q_heads,
        q_len,
        k_len,
        query_blocks,
        width,
        qk_scale,
        GQA: tl.constexpr,
        HAS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # The last query tiles hold the most key blocks: run them first (load balance).
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // q_heads).to(tl.int64)
        h = bh % q_heads
        kv_h = (h // GQA).to(tl.int64)
        h = h.to(tl.int64)
        offset = k_len - q_len
        row = tile * BLOCK_M // BLOCK  # the plan's query block

        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_valid = offs_m < q_len
        d_valid = offs_d < HEAD_DIM
        q_pos = offset + offs_m
        first_pos = offset + tile * BLOCK_M
        rows64 = offs_m.to(tl.int64)  # pointer offsets in int64: length * stride may pass 2**31
        q = tl.load(
            q_ptr
            + b * stride_qb
            + h * stride_qh
            + rows64[:, None] * stride_qm
            + offs_d[None, :] * stride_qd,
            mask=m_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        k_base = k_ptr + b * stride_kb + kv_h * stride_kh
        v_base = v_ptr + b * stride_vb + kv_h * stride_vh

        list_row = bh.to(tl.int64) * query_blocks + row
        count = tl.load(counts_ptr + list_row)
        m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: exp2(-inf - m_i) = 0
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for i in range(0, count):
            block = tl.load(indices_ptr + list_row * width + i)
            for j in tl.static_range(BLOCK // BLOCK_N):
                start = block * BLOCK + j * BLOCK_N
                offs_n = start + tl.arange(0, BLOCK_N)
                n_valid = offs_n < k_len
                kv_mask = n_valid[:, None] & d_valid[None, :]
                keys64 = offs_n.to(tl.int64)
                k = tl.load(
                    k_base + keys64[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=kv_mask,
                    other=0.0,
                )
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                if start + BLOCK_N - 1 > first_pos:  # the tile reaches past the diagonal
                    # Also drops keys past k_len: every query position is below k_len.
                    s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
                if HAS_PAD:
                    keep = tl.load(pad_ptr + b * stride_pad + offs_n, mask=n_valid, other=0)
                    s = tl.where(keep[None, :] != 0, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(
                    v_base + keys64[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=kv_mask,
                    other=0.0,
                )
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
                m_i = m_new
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # rows without keys: zeros
        tl.store(
            o_ptr
            + b * stride_ob
            + h * stride_oh
            + rows64[:, None] * stride_om
            + offs_d[None, :] * stride_od,
            out.to(o_ptr.dtype.element_ty),
            mask=m_valid[:, None] & d_valid[None, :],
        )


_TILES = {
    # element size: (BLOCK_M, BLOCK_N, num_stages), best first
    2: ((128, 64, 3), (128, 64, 2), (64, 64, 2), (64, 32, 2), (32, 32, 1), (16, 16, 1)),
    4: ((64, 32, 2), (32, 32, 2), (32, 16, 1), (16, 16, 1)),
}
_chosen_tiles: dict[tuple[object, ...], tuple[int, int, int, int]] = {}
"""The tile shape that compiled, per (device, dtype, padded head dim, block size)."""


def _tile_configs(
    block_size: int, block_d: int, element_size: int, shared_memory: float
) -> list[tuple[int, int, int, int]]:
    """Candidate ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, best first: tiles that divide
    ``block_size`` and whose shared memory (a query tile, ``num_stages`` key and value tiles and
    the probabilities) fits in ``shared_memory`` bytes; the smallest when none does."""
    configs: list[tuple[int, int, int, int]] = []
    for block_m, block_n, stages in _TILES[element_size]:
        block_m, block_n = min(block_m, block_size), min(block_n, block_size)
        needed = (block_m * block_d + 2 * stages * block_n * block_d + block_m * block_n) * (
            element_size
        )
        num_warps = 8 if block_m * block_d >= 128 * 128 else 4
        config = (block_m, block_n, num_warps, stages)
        if needed <= shared_memory and config not in configs:
            configs.append(config)
    return configs or [(16, 16, 4, 1)]


def _sparse_prefill_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int,
    key_padding_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    mask = _kernel_block_mask(block_mask, q_len, k_len, block_size, key_padding_mask)
    indices, counts = block_mask_to_indices(mask)
    pad = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else counts
    block_d = max(16, triton.next_power_of_2(head_dim))
    tiles_key = (query.device, query.dtype, block_d, block_size)
    if tiles_key in _chosen_tiles:
        configs = [_chosen_tiles[tiles_key]]
    else:
        shared_memory = (
            torch.cuda.get_device_properties(query.device).shared_memory_per_block_optin
            if query.device.type == "cuda"
            else math.inf  # the interpreter
        )
        configs = _tile_configs(block_size, block_d, query.element_size(), shared_memory)
    for attempt, (block_m, block_n, num_warps, num_stages) in enumerate(configs):
        try:
            _sparse_prefill_kernel[(triton.cdiv(q_len, block_m), batch * q_heads)](
                query,
                key,
                value,
                out,
                indices,
                counts,
                pad,
                *query.stride(),
                *key.stride(),
                *value.stride(),
                *out.stride(),
                pad.stride(0),
                q_heads,
                q_len,
                k_len,
                counts.shape[-1],
                indices.shape[-1],
                scale * math.log2(math.e),
                GQA=q_heads // kv_heads,
                HAS_PAD=key_padding_mask is not None,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                BLOCK=block_size,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
                num_warps=num_warps,
                num_stages=num_stages,
            )
        except OutOfResources:  # the estimate of the shared memory was short: smaller tiles
            if attempt == len(configs) - 1:
                raise
            continue
        _chosen_tiles[tiles_key] = configs[attempt]
        break
    return out


def sparse_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: torch.Tensor,
    *,
    block_size: int,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Causal attention over the key blocks a plan selects (block-sparse prefill).

    Triton path: one program per (query tile, batch and query head) walks the ascending list of
    its query block's selected key blocks (:func:`block_mask_to_indices`, after dropping blocks
    above the diagonal or of padding only) with an online softmax; see the module docs. The torch
    path is :func:`sparse_prefill_attention_reference`.

    Args:
        query: ``(batch, q_heads, q_len, head_dim)``, fp32/fp16/bf16, any strides.
        key: ``(batch, kv_heads, k_len, head_dim)``, same dtype; ``q_heads % kv_heads == 0`` and
            ``q_len <= k_len`` (the queries are the last ``q_len`` positions).
        value: Same shape and dtype as ``key``.
        block_mask: Bool ``(batch, q_heads, ceil(q_len / block_size), ceil(k_len / block_size))``
            (:class:`~ada_modules.attention.plan.BlockPlan`'s ``block_mask``).
        block_size: Side of a block, a power of two >= 16.
        key_padding_mask: Optional bool ``(batch, k_len)``, ``True`` for a real key.
        scaling: Softmax scale; ``head_dim ** -0.5`` when ``None``.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``(batch, q_heads, q_len, head_dim)`` in ``query.dtype``; zeros for a query that attends
        to no key.

    Raises:
        InputError: If a shape, dtype or value is not allowed (the message names it), or ``impl``
            cannot run (also bf16 with ``impl="triton"`` under the Triton interpreter).

    Example:
        >>> q, k, v = torch.randn(2, 2, 48, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
        >>> mask = torch.rand(2, 2, 3, 4) < 0.5  # queries 16..63 of a chunked prefill
        >>> sparse_prefill_attention(q, k, v, mask, block_size=16).shape
        torch.Size([2, 2, 48, 16])
    """
    scale = _check_args(query, key, value, block_mask, block_size, key_padding_mask, scaling)
    tensors = [query, key, value, block_mask]
    if key_padding_mask is not None:
        tensors.append(key_padding_mask)
    if resolve_impl(impl, *tensors) == "torch":
        return sparse_prefill_attention_reference(
            query,
            key,
            value,
            block_mask,
            block_size=block_size,
            key_padding_mask=key_padding_mask,
            scaling=scale,
        )
    # Triton decided at import whether its kernels run in the interpreter (not JIT-compiled)
    if query.dtype == torch.bfloat16 and not isinstance(_sparse_prefill_kernel, triton.JITFunction):
        raise InputError(
            "impl='triton' cannot run torch.bfloat16 under the Triton interpreter "
            "(TRITON_INTERPRET=1: its tl.dot multiplies the bits of bf16 as integers); use "
            "impl='torch', or float16/float32"
        )
    return _sparse_prefill_triton(
        query, key, value, block_mask, block_size, key_padding_mask, scale
    )
