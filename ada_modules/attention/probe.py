"""Cheap attention probes and the per-head metrics that sparse prefill policies decide from.

Two estimates of where each query head attends, both far cheaper than the full attention:

- :func:`last_block_probe` (FlexPrefill's and MInference's probe): the exact, causal and
  padding-masked softmax attention of the *last* ``block_size`` real queries over all keys, in
  fp32 (``block_size * k_len * head_dim`` multiply-adds per head). It gives per key block the
  mean attention mass of those rows (``block_probs``, the probe distribution ``p`` over key
  blocks), per key the mean attention (``vertical``) and per diagonal offset the mean mass
  (``slash``).
- :func:`pooled_block_scores` (FlexPrefill's query-aware estimate, MInference's block index):
  for every query block, a softmax over key blocks of mean-pooled query block . mean-pooled key
  block. It is query specific but blurs single-token matches (a key is one of ``block_size`` in
  its mean).

Metrics of a distribution ``p`` over ``N`` valid key blocks (AdaCal, reconstructed):

- :func:`normalized_entropy` ``-sum p log p / log N`` in ``[0, 1]`` (0: one block, 1: uniform),
- :func:`coverage_count` the fewest blocks whose mass reaches ``gamma``, and
  :func:`concentration` that count over ``N`` (FlexPrefill's ``score_cover_topk``),
- :func:`zone_masks`, :func:`mid_zone_mass` and :func:`mid_zone_coverage`: the *mid zone* is every
  valid block except the first ``sink_blocks`` (the attention sink) and the ``local_blocks``
  blocks that end at the diagonal block (the recent window, diagonal included). Its mass is what
  a static sink + local (A-shape) plan cannot see; the mid-zone coverage of a selection is the
  share of that mass the selection keeps.

Padding keys never carry mass; with left padding the sink is the first *real* key block.

Example:
    >>> q, k = torch.randn(1, 2, 128, 16), torch.randn(1, 1, 128, 16)
    >>> probe = last_block_probe(q, k, block_size=32)
    >>> probe.block_probs.shape, torch.allclose(probe.block_probs.sum(-1), torch.ones(1, 2))
    (torch.Size([1, 2, 4]), True)
    >>> normalized_entropy(torch.tensor([0.25, 0.25, 0.25, 0.25])).item()
    1.0
    >>> coverage_count(torch.tensor([0.6, 0.3, 0.1]), gamma=0.9).item()
    2
"""

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch
import torch.nn.functional as F

from ada_modules.attention.plan import causal_block_mask, check_block_size, num_blocks
from ada_modules.errors import InputError

__all__ = [
    "ProbeResult",
    "check_attention_inputs",
    "check_count",
    "check_fraction",
    "concentration",
    "coverage_count",
    "js_divergence",
    "last_block_probe",
    "mid_zone_coverage",
    "mid_zone_mass",
    "normalized_entropy",
    "pooled_block_flops",
    "pooled_block_scores",
    "pooled_keys",
    "real_key_blocks",
    "zone_masks",
]

_COVER_TOLERANCE = 1e-6
"""Relative slack of a gamma-coverage test, so that rounding in a cumulative sum never asks for
one more block (e.g. gamma = 1 over fp32 masses that sum to 0.9999999)."""


# ----------------------------------------------------------------------------------------------
# Argument checks (shared by the policies)
# ----------------------------------------------------------------------------------------------


def check_fraction(value: object, name: str, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float in ``(0, 1]`` (``[0, 1]`` with ``allow_zero``), else raise."""
    interval = "[0, 1]" if allow_zero else "(0, 1]"
    if (
        isinstance(value, bool)
        or not isinstance(value, Real)
        or not (0 <= value if allow_zero else 0 < value)
        or not value <= 1
    ):
        raise InputError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def check_count(value: object, name: str, minimum: int = 0) -> int:
    """Return ``value`` if it is an int ``>= minimum``, else raise :class:`InputError`."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise InputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _describe(x: object) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def check_attention_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scaling: float | None,
) -> float:
    """Validate the arguments of :meth:`SparsePrefillPolicy.plan`; return the softmax scale.

    ``scaling=None`` means ``1 / sqrt(head_dim)``.
    """
    for name, tensor in (("query", query), ("key", key)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise InputError(
                f"{name} must be a 4-d tensor (batch, heads, length, head_dim), got "
                f"{_describe(tensor)}"
            )
        if not tensor.is_floating_point():
            raise InputError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    batch, q_heads, q_len, head_dim = query.shape
    k_batch, kv_heads, k_len, k_dim = key.shape
    if k_batch != batch or k_dim != head_dim:
        raise InputError(
            f"key {tuple(key.shape)} must match the query's batch and head_dim {(batch, head_dim)}"
        )
    if kv_heads == 0 or q_heads % kv_heads:
        raise InputError(
            f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})"
        )
    if q_len == 0 or q_len > k_len:
        raise InputError(
            f"query length ({q_len}) must be in [1, key length ({k_len})]: the queries are the "
            "last positions of the keys"
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
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scaling, bool) or not isinstance(scaling, Real) or not scaling > 0:
        raise InputError(f"scaling must be a positive number, got {scaling!r}")
    if not math.isfinite(scaling):
        raise InputError(f"scaling must be finite, got {scaling!r}")
    return float(scaling)


# ----------------------------------------------------------------------------------------------
# Metrics of a distribution over key blocks
# ----------------------------------------------------------------------------------------------


def normalized_entropy(
    p: torch.Tensor, num_valid: torch.Tensor | int | None = None
) -> torch.Tensor:
    """Entropy of ``p`` (``(..., N)``, renormalised) over ``log(num_valid)``, in ``[0, 1]``.

    ``num_valid`` (default ``N``; a tensor broadcastable to ``p.shape[:-1]``) is the number of
    blocks the distribution could use (causal, not padding). One valid block gives 0.

    Example:
        >>> normalized_entropy(torch.tensor([[1.0, 0, 0, 0], [0.5, 0.5, 0, 0]])).tolist()
        [0.0, 0.5]
    """
    p = p.float()
    total = p.sum(-1, keepdim=True)
    q = p / total.clamp_min(torch.finfo(p.dtype).tiny)
    entropy = -(q * torch.log(q.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1)
    if num_valid is None:
        num_valid = p.shape[-1]
    log_n = torch.log(torch.as_tensor(num_valid, dtype=p.dtype, device=p.device).clamp_min(1))
    out = torch.where(log_n > 0, entropy / log_n.clamp_min(1e-12), torch.zeros_like(entropy))
    return out.clamp(0.0, 1.0) + 0.0  # + 0.0 turns -0.0 into 0.0


def _sorted_cover(
    p: torch.Tensor, gamma: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(count, order)``: fewest entries of ``p`` (``>= 0``) reaching ``gamma`` of its mass, and
    the descending order (stable) they are taken in."""
    sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the entries ranked above
    target = torch.as_tensor(gamma, dtype=p.dtype, device=p.device)
    target = (target * p.sum(-1) * (1 - _COVER_TOLERANCE)).unsqueeze(-1)
    return (before < target).sum(-1), order


def coverage_count(p: torch.Tensor, gamma: float | torch.Tensor) -> torch.Tensor:
    """Fewest entries of ``p`` (``(..., N)``) whose mass reaches ``gamma`` of the total.

    ``gamma`` is in ``(0, 1]`` (or a tensor broadcastable to ``p.shape[:-1]``); an all-zero row
    needs 0 entries.

    Example:
        >>> coverage_count(torch.tensor([0.1, 0.7, 0.2]), gamma=0.7).item()
        1
    """
    if not isinstance(gamma, torch.Tensor):
        check_fraction(gamma, "gamma")
    return _sorted_cover(p.float(), gamma)[0]


def concentration(
    p: torch.Tensor, gamma: float, num_valid: torch.Tensor | int | None = None
) -> torch.Tensor:
    """:func:`coverage_count` over the number of valid blocks (default ``N``), in ``(0, 1]``.

    Small for a peaked head (a few blocks hold ``gamma`` of the mass), near ``gamma`` for a
    uniform one.
    """
    count = coverage_count(p, gamma).float()
    if num_valid is None:
        num_valid = p.shape[-1]
    return count / torch.as_tensor(num_valid, dtype=count.dtype, device=count.device).clamp_min(1)


def _as_index(value: torch.Tensor | int, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, device=like.device).unsqueeze(-1)


def zone_masks(
    num_key_blocks: int,
    sink_blocks: int,
    local_blocks: int,
    *,
    first: torch.Tensor | int = 0,
    last: torch.Tensor | int | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sink_or_local, mid)``: boolean masks over key blocks, ``(..., num_key_blocks)``.

    Args:
        num_key_blocks: ``N``.
        sink_blocks: Blocks of the sink zone, from block ``first`` on.
        local_blocks: Blocks of the local zone, ending at (and including) block ``last``.
        first: First valid block (the first real key's block); int or tensor ``(...)``.
        last: The diagonal block of the probe (default ``N - 1``); int or tensor ``(...)``.
        valid: Optional boolean ``(..., N)`` of valid blocks; both zones are restricted to it.

    Example:
        >>> sink_local, mid = zone_masks(6, sink_blocks=1, local_blocks=2)
        >>> sink_local.int().tolist(), mid.int().tolist()
        ([1, 0, 0, 0, 1, 1], [0, 1, 1, 1, 0, 0])
    """
    check_count(sink_blocks, "sink_blocks")
    check_count(local_blocks, "local_blocks")
    tensors = [t for t in (valid, first, last) if isinstance(t, torch.Tensor)]
    cols = torch.arange(num_key_blocks, device=tensors[0].device if tensors else None)
    first = _as_index(first, cols)
    last = _as_index(num_key_blocks - 1 if last is None else last, cols)
    inside = (cols >= first) & (cols <= last)
    if valid is not None:
        inside = inside & valid
    sink_or_local = inside & ((cols < first + sink_blocks) | (cols > last - local_blocks))
    return sink_or_local, inside & ~sink_or_local


def mid_zone_mass(
    p: torch.Tensor,
    sink_blocks: int,
    local_blocks: int,
    *,
    first: torch.Tensor | int = 0,
    last: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Share of the mass of ``p`` (``(..., N)``) in the mid zone (see :func:`zone_masks`).

    ``first``/``last`` broadcast against ``p.shape[:-1]``.

    Example:
        >>> mid_zone_mass(torch.tensor([0.5, 0.1, 0.2, 0.2]), sink_blocks=1, local_blocks=1).item()
        0.30000001192092896
    """
    _, mid = zone_masks(p.shape[-1], sink_blocks, local_blocks, first=first, last=last)
    p = p.float()
    return (p * mid).sum(-1) / p.sum(-1).clamp_min(torch.finfo(p.dtype).tiny)


def mid_zone_coverage(
    p: torch.Tensor,
    selected: torch.Tensor,
    sink_blocks: int,
    local_blocks: int,
    *,
    first: torch.Tensor | int = 0,
    last: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Share of the mid-zone mass of ``p`` that the boolean ``selected`` (``(..., N)``) keeps.

    1 where the mid zone holds no mass (there is nothing to miss).

    Example:
        >>> p = torch.tensor([0.4, 0.3, 0.1, 0.2])
        >>> mid_zone_coverage(p, torch.tensor([1, 1, 0, 1]).bool(), 1, 1).item()
        0.75
    """
    _, mid = zone_masks(p.shape[-1], sink_blocks, local_blocks, first=first, last=last)
    p = p.float()
    mid_mass = (p * mid).sum(-1)
    kept = (p * (mid & selected)).sum(-1)
    return torch.where(mid_mass > 0, kept / mid_mass.clamp_min(1e-30), torch.ones_like(kept))


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (natural log, in ``[0, log 2]``) of two distributions ``(..., N)``.

    Example:
        >>> round(js_divergence(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).item(), 4)
        0.6931
    """
    p, q = p.double(), q.double()
    m = (p + q) / 2

    def kl(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (torch.log(a.clamp_min(1e-300)) - torch.log(m)), 0).sum(-1)

    return ((kl(p) + kl(q)) / 2).clamp_min(0).float()


# ----------------------------------------------------------------------------------------------
# Probes
# ----------------------------------------------------------------------------------------------


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``allowed``; all-masked rows give zeros."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(torch.isfinite(top), top, 0.0))
    return weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def _block_sum(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Sum the last dim of ``x`` over consecutive blocks (the last may be ragged)."""
    length = x.shape[-1]
    x = F.pad(x, (0, num_blocks(length, block_size) * block_size - length))
    return x.unflatten(-1, (-1, block_size)).sum(-1)


def _query_is_real(
    key_padding_mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, device: torch.device
) -> torch.Tensor:
    if key_padding_mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device=device)
    return key_padding_mask[:, k_len - q_len :]


@dataclass
class ProbeResult:
    """The last-block probe of one attention call (see :func:`last_block_probe`).

    Attributes:
        block_probs: ``(batch, q_heads, k_blocks)``: mean attention mass per key block of the
            probe rows, the probe distribution ``p`` (sums to 1 per head).
        vertical: ``(batch, q_heads, k_len)``: mean attention per key.
        slash: ``(batch, q_heads, k_len)``: mean mass per diagonal offset ``d`` (query position
            minus key position).
        slash_blocks: ``(batch, q_heads, k_blocks)``: the slash mass per *block* offset ``j``
            (the key block ``j`` blocks before the query's own block): offset ``d`` falls in
            block offset ``d // block_size`` or the next one, split in proportion
            ``1 - (d % block_size) / block_size`` (the share of a block's queries for which it
            lands there; the farthest offsets stay in the last block offset).
        valid_blocks: Boolean ``(batch, k_blocks)``: blocks holding a real key visible to the
            probe.
        first_block: ``(batch,)``: first valid block (the sink, after left padding).
        last_block: ``(batch,)``: block of the last probe query (the probe's diagonal).
        last_query: ``(batch,)``: index (among the queries) of the last probe query.
        flops: Multiply-adds spent (``q . k`` products of the probe rows).
    """

    block_probs: torch.Tensor
    vertical: torch.Tensor
    slash: torch.Tensor
    slash_blocks: torch.Tensor
    valid_blocks: torch.Tensor
    first_block: torch.Tensor
    last_block: torch.Tensor
    last_query: torch.Tensor
    flops: int

    @property
    def num_valid(self) -> torch.Tensor:
        """``(batch, 1)``: number of valid key blocks (broadcasts over heads)."""
        return self.valid_blocks.sum(-1, keepdim=True)

    def entropy(self) -> torch.Tensor:
        """``(batch, q_heads)``: :func:`normalized_entropy` of ``block_probs``."""
        return normalized_entropy(self.block_probs, self.num_valid)

    def concentration(self, gamma: float | torch.Tensor) -> torch.Tensor:
        """``(batch, q_heads)``: fewest blocks covering ``gamma`` over the valid blocks.

        ``gamma`` may be a tensor broadcastable to ``(batch, q_heads)`` (one per element).
        """
        count, _ = _sorted_cover(self.block_probs, gamma)
        return count.float() / self.num_valid.clamp_min(1)

    def zones(self, sink_blocks: int, local_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sink_or_local, mid)`` masks ``(batch, 1, k_blocks)`` for this probe."""
        sink_local, mid = zone_masks(
            self.block_probs.shape[-1],
            sink_blocks,
            local_blocks,
            first=self.first_block,
            last=self.last_block,
            valid=self.valid_blocks,
        )
        return sink_local.unsqueeze(1), mid.unsqueeze(1)

    def mid_mass(self, sink_blocks: int, local_blocks: int) -> torch.Tensor:
        """``(batch, q_heads)``: mass of ``block_probs`` in the mid zone."""
        _, mid = self.zones(sink_blocks, local_blocks)
        return (self.block_probs * mid).sum(-1)

    def mid_coverage(
        self, selected: torch.Tensor, sink_blocks: int, local_blocks: int
    ) -> torch.Tensor:
        """``(batch, q_heads)``: share of the mid-zone mass in ``selected`` (``(B, H, k_blocks)``)."""
        return mid_zone_coverage(
            self.block_probs,
            selected,
            sink_blocks,
            local_blocks,
            first=self.first_block[:, None],
            last=self.last_block[:, None],
        )


def last_block_probe(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    block_size: int,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
) -> ProbeResult:
    """Attention of the last ``block_size`` real queries over all keys, summarised per head.

    The probe rows are the last ``min(block_size, q_len)`` queries up to the last real one (with
    right padding the trailing padding queries are skipped; probe rows that are padding take no
    part). Scores are ``scaling * q . k`` in fp32, masked causally (key position <= query
    position) and by ``key_padding_mask``. Grouped-query attention: query head ``h`` reads key
    head ``h // (q_heads // kv_heads)``.

    Args:
        query: ``(batch, q_heads, q_len, head_dim)``, the last ``q_len`` positions.
        key: ``(batch, kv_heads, k_len, head_dim)``.
        block_size: Key block size (a power of two >= 16) and number of probe rows.
        key_padding_mask: Boolean ``(batch, k_len)``, ``True`` for real tokens.
        scaling: Softmax scale (default ``1 / sqrt(head_dim)``).
    """
    scaling = check_attention_inputs(query, key, key_padding_mask, scaling)
    check_block_size(block_size)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    device = query.device
    offset = k_len - q_len
    rows = min(block_size, q_len)

    real_query = _query_is_real(key_padding_mask, batch, q_len, k_len, device)
    positions = torch.arange(q_len, device=device)
    last_real = torch.where(real_query, positions, -1).amax(-1)
    last_query = torch.where(last_real >= 0, last_real, q_len - 1)  # (B,)
    row_index = last_query[:, None] - rows + 1 + torch.arange(rows, device=device)  # (B, n)
    row_valid = row_index >= 0
    row_index = row_index.clamp_min(0)
    row_valid &= real_query.gather(1, row_index)

    q = query.gather(2, row_index[:, None, :, None].expand(batch, q_heads, rows, head_dim))
    q = q.float().unflatten(1, (kv_heads, q_heads // kv_heads))  # (B, Hkv, G, n, D)
    scores = (q @ key.float().unsqueeze(2).transpose(-1, -2)).flatten(1, 2) * scaling
    row_position = offset + row_index  # absolute position of each probe row, (B, n)
    key_position = torch.arange(k_len, device=device)
    allowed = key_position <= row_position[:, :, None]  # (B, n, Lk)
    if key_padding_mask is not None:
        allowed &= key_padding_mask[:, None, :]
    # Every real probe row sees its own key, so only padding rows are all masked (NaN -> 0).
    probs = torch.softmax(scores.masked_fill_(~allowed[:, None], float("-inf")), dim=-1)
    probs = probs.masked_fill_(~row_valid[:, None, :, None], 0.0)  # (B, H, n, Lk)

    n_rows = row_valid.sum(-1).clamp_min(1).float()[:, None, None]  # (B, 1, 1)
    vertical = probs.sum(2) / n_rows
    distance = (row_position[:, :, None] - key_position).clamp_min(0)  # (B, n, Lk)
    slash = (
        torch.zeros_like(vertical).scatter_add_(
            -1,
            distance.flatten(1)[:, None].expand(batch, q_heads, -1),
            probs.flatten(2),
        )
        / n_rows
    )
    k_blocks = num_blocks(k_len, block_size)
    block_offset = key_position // block_size
    share = 1 - (key_position % block_size).float() / block_size
    slash_blocks = torch.zeros(batch, q_heads, k_blocks, device=device)
    slash_blocks.index_add_(-1, block_offset, slash * share)
    slash_blocks.index_add_(-1, (block_offset + 1).clamp_max(k_blocks - 1), slash * (1 - share))

    visible = key_position <= (offset + last_query)[:, None]
    if key_padding_mask is not None:
        visible &= key_padding_mask
    valid_blocks = real_key_blocks(visible, batch, k_len, block_size)
    return ProbeResult(
        block_probs=_block_sum(vertical, block_size),
        vertical=vertical,
        slash=slash,
        slash_blocks=slash_blocks,
        valid_blocks=valid_blocks,
        first_block=valid_blocks.float().argmax(-1),
        last_block=(offset + last_query) // block_size,
        last_query=last_query,
        flops=batch * q_heads * rows * k_len * head_dim,
    )


def real_key_blocks(
    key_padding_mask: torch.Tensor | None,
    batch: int,
    k_len: int,
    block_size: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Boolean ``(batch, k_blocks)``: key blocks holding at least one real key."""
    if key_padding_mask is None:
        return torch.ones(batch, num_blocks(k_len, block_size), dtype=torch.bool, device=device)
    return _block_sum(key_padding_mask.float(), block_size) > 0


def pooled_keys(
    key: torch.Tensor, block_size: int, key_padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of the real keys of each key block: ``(batch, kv_heads, k_blocks, head_dim)``, fp32.

    Blocks made only of padding get zeros.
    """
    return _pool(key, key_padding_mask, block_size)


def _pool(x: torch.Tensor, real: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """Mean over the real positions of each block of ``x`` ``(B, H, L, D)``, in fp32.

    ``real`` is a boolean ``(B, L)`` or ``None`` (every position real). Sums accumulate in fp32
    from ``x``'s own dtype, without an fp32 copy of ``x`` (at 128K tokens that copy would be
    gigabytes per layer).
    """
    batch, _, length, _ = x.shape
    if real is not None:
        x = x * real[:, None, :, None].to(x.dtype)
    full = length // block_size
    sums = [
        x[:, :, : full * block_size].unflatten(2, (full, block_size)).sum(3, dtype=torch.float32)
    ]
    if length % block_size:
        sums.append(x[:, :, full * block_size :].sum(2, keepdim=True, dtype=torch.float32))
    if real is None:
        count = torch.full((num_blocks(length, block_size),), float(block_size), device=x.device)
        count[-1] = length - (count.numel() - 1) * block_size
        count = count.expand(batch, -1)
    else:
        count = _block_sum(real.float(), block_size)  # (B, blocks)
    return torch.cat(sums, 2) / count.clamp_min(1)[:, None, :, None]


def pooled_block_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    block_size: int,
    key_padding_mask: torch.Tensor | None = None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Per query block, a softmax over key blocks of pooled ``q . k`` (``(B, Hq, q_blocks, k_blocks)``).

    The mean of the real queries of a query block (blocks counted from the first query) times
    the mean of the real keys of a key block, times ``scaling``, over the key blocks that are
    causal for the query block (:func:`~ada_modules.attention.plan.causal_block_mask`) and hold a
    real key. A query block without a causal real key block gets a row of zeros.

    Example:
        >>> q, k = torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
        >>> scores = pooled_block_scores(q, k, block_size=32)
        >>> scores.shape, scores[0, 0, 0].tolist()[1:]  # the first block sees only itself
        (torch.Size([1, 2, 3, 3]), [0.0, 0.0])
    """
    scaling = check_attention_inputs(query, key, key_padding_mask, scaling)
    check_block_size(block_size)
    batch, q_heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    real_query = None if key_padding_mask is None else key_padding_mask[:, k_len - q_len :]
    q_pooled = _pool(query, real_query, block_size)  # (B, Hq, nQ, D)
    k_pooled = pooled_keys(key, block_size, key_padding_mask)  # (B, Hkv, nK, D)
    k_valid = real_key_blocks(key_padding_mask, batch, k_len, block_size, query.device)
    q_pooled = q_pooled.unflatten(1, (kv_heads, q_heads // kv_heads))
    scores = (q_pooled @ k_pooled.unsqueeze(2).transpose(-1, -2)).flatten(1, 2) * scaling
    causal = causal_block_mask(1, 1, q_len, k_len, block_size, query.device)
    return _masked_softmax(scores, causal & k_valid[:, None, None, :])


def pooled_block_flops(
    batch: int, q_heads: int, kv_heads: int, q_len: int, k_len: int, head_dim: int, block_size: int
) -> int:
    """Multiply-adds of :func:`pooled_block_scores`: the pooling sums plus the block products."""
    q_blocks, k_blocks = num_blocks(q_len, block_size), num_blocks(k_len, block_size)
    pooling = batch * (q_heads * q_len + kv_heads * k_len) * head_dim
    return pooling + batch * q_heads * q_blocks * k_blocks * head_dim
