"""AdaCal: adaptive calibration of sparse prefill (task dispatch + head-wise profiling).

AdaCal (reconstructed from its abstract; no paper text or code is public) plans the key blocks
of one attention call from a cheap probe, spending extra computation only where the probe says
it is needed. Every threshold below is a field of :class:`AdaCalConfig`.

1. **Probe** (:func:`~ada_modules.attention.probe.last_block_probe`): the exact attention of the
   last ``block_size`` queries, as FlexPrefill and MInference do. Per head it gives the block
   distribution ``p``, whose *normalized entropy* ``H``, *concentration* (fewest blocks covering
   ``gamma``, over the valid blocks) and *mid-zone mass* (mass outside the ``sink_blocks`` first
   and the ``local_blocks`` last blocks) are the head's physical profile.
2. **Task dispatch** (coarse, per batch element): four features aggregated over the heads
   (:data:`DISPATCH_FEATURES`, see :meth:`AdaCalPolicy.dispatch_features`) go to a
   :class:`TaskDispatcher` (a threshold rule, or a logistic regression fitted on labelled
   inputs), which labels the input *structure*-dominant (code, tables, templates: local and
   periodic patterns) or *retrieval*-intensive (needles, key-value lookups: peaky mid-context
   verticals). The regime selects the :class:`RegimeParams` used below: structure suppresses
   expansion (lower ``gamma``, no augmentation), retrieval enhances long-range coverage (higher
   ``gamma``, mid-zone augmentation, a larger minimum budget).
3. **Head activation.** A head with ``H < tau_entropy`` whose sink + local zones hold at least
   ``gamma`` of ``p`` gets the static sink + local plan (no index build). Every other head is
   *activated*: it adds, per query block, the fewest key blocks holding ``gamma`` of a row score
   built from two predictions of that query block's attention. The probe carried over to the
   row (exact, but measured on the last queries only), as verticals (same key blocks: sinks,
   hubs, needles) and as slashes (same offsets from the row's diagonal: periodic structure),
   mixed by the head's slash share (mass of its 8 strongest far diagonals over that plus its 8
   strongest mid-zone keys). And, averaged in with equal weight only when FlexPrefill's test
   trusts it (``sqrt(JS) < tau_pooled`` between its last-block row and ``p``), the pooled
   estimate (:func:`~ada_modules.attention.probe.pooled_block_scores`: query specific, but blind
   to single-token matches; an untrusted, diffuse estimate would only inflate the coverage set).
   The selection is clamped to ``[min_budget, max_density * causal blocks of the row]``.
4. **Augmentation** (activated heads, regimes with ``augment``): if the plan's last query block
   keeps less than ``tau_coverage`` of the mid-zone mass of ``p``, the mid-zone blocks with the
   most probe mass are added to every query block (where causal) until the coverage reaches
   ``tau_coverage`` or ``max_extra_blocks`` blocks were added.

Every plan also keeps the sink, the local window and the diagonal blocks. ``BlockPlan.stats``
holds per head ``entropy``, ``concentration``, ``mid_mass``, ``mid_coverage`` (after
augmentation) and ``query_aware`` (activated); ``BlockPlan.regime`` the regime per element. A
probe that is not finite (NaN or Inf queries or keys) profiles nothing: the call gets the dense
causal plan (no regime, no stats), so its output is NaN where dense attention's is.

Example:
    >>> q, k = torch.randn(2, 4, 256, 16), torch.randn(2, 2, 256, 16)
    >>> policy = AdaCalPolicy(block_size=32, min_sparse_length=0)
    >>> plan = policy.plan(q, k, key_padding_mask=None, scaling=0.25)
    >>> plan.block_mask.shape, len(plan.regime), sorted(plan.stats)
    (torch.Size([2, 4, 8, 8]), 2, ['concentration', 'entropy', 'mid_coverage', 'mid_mass', 'query_aware'])
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ada_modules.attention.block_masks import (
    coverage_select,
    dense_fallback,
    row_diagonal_blocks,
    sink_local_block_mask,
    top_count_select,
)
from ada_modules.attention.dispatch import REGIMES, TaskDispatcher
from ada_modules.attention.plan import BlockPlan, causal_block_mask, check_block_size
from ada_modules.attention.probe import (
    ProbeResult,
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
    "AdaCalConfig",
    "AdaCalPolicy",
    "RegimeParams",
    "RetrievalParams",
    "StructureParams",
]

_TOP_TOKENS = 8
"""Keys (verticals) or diagonals (slashes) summed to measure how peaked a head's long-range
attention is: a needle or a short retrieved span is a few tokens."""


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class RegimeParams:
    """What a task regime allows a head (see the module docs).

    Attributes:
        gamma: Coverage target in ``(0, 1]``: of the row scores for activated heads, and of the
            probe mass the sink + local zones must hold for a head to stay static.
        tau_coverage: Mid-zone coverage in ``[0, 1]`` that augmentation aims for.
        max_extra_blocks: Most mid-zone blocks augmentation adds per head (>= 0).
        augment: Whether activated heads are augmented at all.
        min_budget: Fewest blocks an activated head selects per query block (>= 1), on top of
            the sink, local and diagonal blocks.
    """

    name: ClassVar[str] = "regime"

    gamma: float
    tau_coverage: float
    max_extra_blocks: int
    augment: bool
    min_budget: int

    def __post_init__(self) -> None:
        self.gamma = check_fraction(self.gamma, f"{self.name}.gamma")
        self.tau_coverage = check_fraction(
            self.tau_coverage, f"{self.name}.tau_coverage", allow_zero=True
        )
        self.max_extra_blocks = check_count(self.max_extra_blocks, f"{self.name}.max_extra_blocks")
        if not isinstance(self.augment, bool):
            raise InputError(f"{self.name}.augment must be a bool, got {self.augment!r}")
        self.min_budget = check_count(self.min_budget, f"{self.name}.min_budget", minimum=1)


@dataclass
class StructureParams(RegimeParams):
    """Structure-dominant inputs: suppress expansion.

    ``gamma=0.85`` (below FlexPrefill's 0.9: local and periodic heads are concentrated, their
    tails are noise), no augmentation, and a tight cap of 2 blocks should it be switched on.
    """

    name: ClassVar[str] = "structure"

    gamma: float = 0.85
    tau_coverage: float = 0.5
    max_extra_blocks: int = 2
    augment: bool = False
    min_budget: int = 1


@dataclass
class RetrievalParams(RegimeParams):
    """Retrieval-intensive inputs: enhance long-range coverage.

    ``gamma=0.95`` keeps the tail where needles live, augmentation until 90% of the mid-zone
    mass is kept (at most 8 blocks, 512 tokens at block 64, per head), and at least 2 selected
    blocks per query block.
    """

    name: ClassVar[str] = "retrieval"

    gamma: float = 0.95
    tau_coverage: float = 0.9
    max_extra_blocks: int = 8
    augment: bool = True
    min_budget: int = 2


def _regime_params(value: object, kind: type[RegimeParams]) -> RegimeParams:
    """``value`` as ``kind``: ``None`` gives the defaults, a mapping overrides some of them."""
    if value is None:
        return kind()
    if isinstance(value, RegimeParams):
        return value
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise InputError(f"{kind.name} has no field(s) {unknown}; known: {sorted(names)}")
        return kind(**value)
    raise InputError(f"{kind.name} must be a {kind.__name__}, a dict or None, got {value!r}")


@dataclass
class AdaCalConfig:
    """Every threshold of :class:`AdaCalPolicy` (the policy takes the same keyword arguments).

    Attributes:
        block_size: Block side, a power of two >= 16 (64: our kernel's tile, MInference's block),
            also the number of probe rows.
        min_sparse_length: Fewer keys than this take the dense plan (1024; FlexPrefill's users saw
            no gain at 4K, so sparse planning is for long prompts).
        sink_blocks: Sink zone in blocks (>= 0); 1 block holds the sink tokens.
        local_blocks: Local zone in blocks, diagonal included (>= 1); 2 blocks keep at least the
            previous ``block_size`` tokens of every query.
        tau_entropy: Normalized entropy in ``[0, 1]`` under which a head may stay static. 0.5:
            a head spread over more than ``sqrt(N)`` blocks' worth of entropy is not local.
        max_density: Per-head budget in ``(0, 1]``: an activated head selects at most this share
            of each query block's causal blocks (on top of sink, local and diagonal blocks).
            1.0 (no cap): a diffuse head needs about ``gamma`` of its blocks, and capping it at
            0.5 halved its recall on planted data; set it to bound the worst-case cost.
        tau_pooled: Threshold in ``[0, 1]`` on ``sqrt(JS)`` (natural log) between the pooled
            estimate of the last query block and the probe, under which the pooled estimate
            joins the row score. 0.3, looser than FlexPrefill's 0.1: here it is only averaged
            in, not used alone; on planted data it cut density by ~15% at equal recall vs 1.0.
        peak_mass: Probe mass in ``(0, 1]`` the 8 strongest mid-zone keys of a head must hold
            for the head to count as *peaky* (a dispatch feature). 0.1 = 6 of 64 probe rows'
            worth of attention on a few keys; uniform attention over 1024 keys gives 0.008.
        regime: ``"auto"`` (dispatch per element), or ``"structure"``/``"retrieval"`` for all.
        structure: :class:`StructureParams` (a dict overrides some defaults).
        retrieval: :class:`RetrievalParams` (a dict overrides some defaults).
    """

    block_size: int = 64
    min_sparse_length: int = 1024
    sink_blocks: int = 1
    local_blocks: int = 2
    tau_entropy: float = 0.5
    max_density: float = 1.0
    tau_pooled: float = 0.3
    peak_mass: float = 0.1
    regime: str = "auto"
    structure: StructureParams = field(default_factory=StructureParams)
    retrieval: RetrievalParams = field(default_factory=RetrievalParams)

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        check_count(self.min_sparse_length, "min_sparse_length")
        check_count(self.sink_blocks, "sink_blocks")
        check_count(self.local_blocks, "local_blocks", minimum=1)
        self.tau_entropy = check_fraction(self.tau_entropy, "tau_entropy", allow_zero=True)
        self.max_density = check_fraction(self.max_density, "max_density")
        self.tau_pooled = check_fraction(self.tau_pooled, "tau_pooled", allow_zero=True)
        self.peak_mass = check_fraction(self.peak_mass, "peak_mass")
        if self.regime not in ("auto", *REGIMES):
            raise InputError(
                f"regime must be 'auto', 'structure' or 'retrieval', got {self.regime!r}"
            )
        self.structure = _regime_params(self.structure, StructureParams)
        self.retrieval = _regime_params(self.retrieval, RetrievalParams)


# ----------------------------------------------------------------------------------------------
# The policy
# ----------------------------------------------------------------------------------------------


def _normalize_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True).clamp_min(1e-30)


def _probe_rows(
    probe: ProbeResult,
    allowed: torch.Tensor,
    slash_share: torch.Tensor,
    q_len: int,
    k_len: int,
    block_size: int,
) -> torch.Tensor:
    """The probe's prediction for every query block, ``(B, H, q_blocks, k_blocks)``.

    The probe measured the last queries only; an earlier query block inherits it in two ways:
    as verticals (the same key blocks: sinks, hubs, needles) and as slashes (the same block
    offsets from its own diagonal block: local windows, periodic structure). Each is
    renormalised over the row's allowed blocks and mixed by ``slash_share`` ``(B, H, 1, 1)``.
    """
    vertical = _normalize_rows(probe.block_probs[:, :, None, :] * allowed)
    _, last = row_diagonal_blocks(q_len, k_len, block_size, allowed.device)
    offset = last[:, None] - torch.arange(allowed.shape[-1], device=allowed.device)
    slash = probe.slash_blocks[:, :, offset.clamp_min(0)] * (offset >= 0)
    slash = _normalize_rows(slash * allowed)
    return (1 - slash_share) * vertical + slash_share * slash


class AdaCalPolicy:
    """AdaCal's sparse prefill policy (see the module docs for the algorithm).

    The keyword arguments are the fields of :class:`AdaCalConfig` (flat, so a YAML config reads
    ``tau_entropy: 0.4`` and ``retrieval: {gamma: 0.97}``; a nested dict overrides only the
    fields it names), plus ``dispatcher`` (default: the :class:`TaskDispatcher` rule).

    Example (YAML, e.g. a study config)::

        policy:
          class_path: ada_modules.attention.AdaCalPolicy
          init_args:
            block_size: 64
            tau_entropy: 0.5
            retrieval: {gamma: 0.95, tau_coverage: 0.9}
    """

    def __init__(
        self,
        *,
        block_size: int = 64,
        min_sparse_length: int = 1024,
        sink_blocks: int = 1,
        local_blocks: int = 2,
        tau_entropy: float = 0.5,
        max_density: float = 1.0,
        tau_pooled: float = 0.3,
        peak_mass: float = 0.1,
        regime: str = "auto",
        structure: StructureParams | dict[str, Any] | None = None,
        retrieval: RetrievalParams | dict[str, Any] | None = None,
        dispatcher: TaskDispatcher | None = None,
    ) -> None:
        config = AdaCalConfig(
            block_size=block_size,
            min_sparse_length=min_sparse_length,
            sink_blocks=sink_blocks,
            local_blocks=local_blocks,
            tau_entropy=tau_entropy,
            max_density=max_density,
            tau_pooled=tau_pooled,
            peak_mass=peak_mass,
            regime=regime,
            structure=structure,
            retrieval=retrieval,
        )
        if dispatcher is not None and not isinstance(dispatcher, TaskDispatcher):
            raise InputError(f"dispatcher must be a TaskDispatcher or None, got {dispatcher!r}")
        self.config = config
        self.dispatcher = dispatcher if dispatcher is not None else TaskDispatcher()

    @classmethod
    def from_config(
        cls, config: AdaCalConfig, dispatcher: TaskDispatcher | None = None
    ) -> "AdaCalPolicy":
        """The policy of ``config``."""
        if not isinstance(config, AdaCalConfig):
            raise InputError(f"config must be an AdaCalConfig, got {config!r}")
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls(**fields, dispatcher=dispatcher)

    @property
    def block_size(self) -> int:
        """Block side of the plans."""
        return self.config.block_size

    @property
    def min_sparse_length(self) -> int:
        """Prompts with fewer keys take the dense plan."""
        return self.config.min_sparse_length

    def _long_range_peaks(self, probe: ProbeResult) -> tuple[torch.Tensor, torch.Tensor]:
        """``(vertical, slash)`` ``(B, H)``: mass of the 8 strongest mid-zone keys and of the 8
        strongest diagonals beyond the local window, in the probe."""
        config = self.config
        _, mid = probe.zones(config.sink_blocks, config.local_blocks)
        k_len = probe.vertical.shape[-1]
        top = min(_TOP_TOKENS, k_len)
        mid_keys = mid.repeat_interleave(config.block_size, -1)[..., :k_len]
        vertical = (probe.vertical * mid_keys).topk(top, -1).values.sum(-1)
        far = torch.arange(k_len, device=mid.device) >= config.local_blocks * config.block_size
        slash = (probe.slash * far).topk(top, -1).values.sum(-1)
        return vertical, slash

    @staticmethod
    def _slash_share(vertical: torch.Tensor, slash: torch.Tensor) -> torch.Tensor:
        both = vertical + slash
        return torch.where(both > 0, slash / both.clamp_min(1e-30), 0.5)

    def _features(
        self, probe: ProbeResult, vertical: torch.Tensor, slash: torch.Tensor
    ) -> torch.Tensor:
        """:data:`DISPATCH_FEATURES` ``(B, 4)`` from the probe and its long-range peaks."""
        config = self.config
        peaky = (vertical >= config.peak_mass) & (vertical > slash)
        return torch.stack(
            [
                probe.entropy().mean(1),
                probe.mid_mass(config.sink_blocks, config.local_blocks).mean(1),
                peaky.float().mean(1),
                self._slash_share(vertical, slash).mean(1),
            ],
            dim=-1,
        )

    def dispatch_features(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> torch.Tensor:
        """``(batch, 4)`` dispatch features (:data:`DISPATCH_FEATURES`), means over query heads:

        - ``entropy``: normalized entropy of the probe's block distribution;
        - ``mid_mass``: its mid-zone mass;
        - ``peaky_heads``: share of heads whose 8 strongest mid-zone keys (probe verticals) hold
          at least ``peak_mass`` and more than their 8 strongest far diagonals (slashes beyond
          the local window): every probe query reads the same few mid-context keys;
        - ``slash_ratio``: those 8 slashes' mass over slashes + verticals (0.5 when both are 0):
          near 1 for periodic structure (each query reads its own ``i - P``), near 0 for lookups.

        A calibration collects these with labels and fits :meth:`TaskDispatcher.fit`.
        """
        scaling = check_attention_inputs(query, key, key_padding_mask, scaling)
        probe = last_block_probe(
            query,
            key,
            block_size=self.config.block_size,
            key_padding_mask=key_padding_mask,
            scaling=scaling,
        )
        return self._features(probe, *self._long_range_peaks(probe))

    def _retrieval(self, features: torch.Tensor) -> torch.Tensor:
        if self.config.regime != "auto":
            value = self.config.regime == "retrieval"
            return torch.full((features.shape[0],), value, device=features.device)
        return self.dispatcher.predict(features).to(features.device)

    def _element_params(self, retrieval: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each :class:`RegimeParams` field as a ``(B, 1)`` tensor, from each element's regime."""
        structure, chosen = self.config.structure, self.config.retrieval
        return {
            f.name: torch.where(
                retrieval,
                torch.tensor(getattr(chosen, f.name), device=retrieval.device),
                torch.tensor(getattr(structure, f.name), device=retrieval.device),
            )
            for f in dataclasses.fields(RegimeParams)
        }

    def _augment(
        self,
        probe: ProbeResult,
        mask: torch.Tensor,
        mid: torch.Tensor,
        active: torch.Tensor,
        params: dict[str, torch.Tensor],
        causal: torch.Tensor,
    ) -> torch.Tensor:
        """Add mid-zone blocks to ``mask`` in place (see the module docs); return the mid-zone
        coverage ``(B, H)`` of the probe rows' query block after it."""
        config = self.config
        heads, k_blocks = mask.shape[1], mask.shape[-1]
        last_row = (probe.last_query // config.block_size)[:, None, None, None]
        kept = mask.gather(2, last_row.expand(-1, heads, 1, k_blocks))[:, :, 0]
        coverage = probe.mid_coverage(kept, config.sink_blocks, config.local_blocks)
        wanted = active & params["augment"] & (coverage < params["tau_coverage"])
        if not bool(wanted.any()):
            return coverage
        mid_p = probe.block_probs * mid
        need = params["tau_coverage"] * mid_p.sum(-1) - (mid_p * kept).sum(-1)
        gains = mid_p * ~kept
        sorted_gains = torch.sort(gains, dim=-1, descending=True).values
        before = torch.cumsum(sorted_gains, -1) - sorted_gains
        count = ((before < need[..., None]) & (sorted_gains > 0)).sum(-1)
        count = torch.where(wanted, torch.minimum(count, params["max_extra_blocks"]), 0)
        extra = top_count_select(gains, count, gains > 0)
        mask |= extra[:, :, None, :] & causal
        return probe.mid_coverage(kept | extra, config.sink_blocks, config.local_blocks)

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        scaling: float | None = None,
    ) -> BlockPlan:
        """Probe, dispatch, then activate and augment heads (see the module docs)."""
        scaling = check_attention_inputs(query, key, key_padding_mask, scaling)
        config = self.config
        size = config.block_size
        dense = dense_fallback(query, key, size, config.min_sparse_length)
        if dense is not None:
            return dense
        batch, heads, q_len, head_dim = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        device = query.device
        probe = last_block_probe(
            query, key, block_size=size, key_padding_mask=key_padding_mask, scaling=scaling
        )
        peaks = self._long_range_peaks(probe)
        features = self._features(probe, *peaks)
        if not bool(torch.isfinite(features).all()):  # NaN or Inf queries or keys: as dense
            return BlockPlan(causal_block_mask(batch, heads, q_len, k_len, size, device), size)
        retrieval = self._retrieval(features)[:, None]  # (B, 1)

        params = self._element_params(retrieval)
        p = probe.block_probs
        entropy = probe.entropy()
        sink_local, mid = probe.zones(config.sink_blocks, config.local_blocks)
        static = (entropy < config.tau_entropy) & ((p * sink_local).sum(-1) >= params["gamma"])
        active = ~static
        base = sink_local_block_mask(
            q_len, k_len, size, config.sink_blocks, config.local_blocks, probe.first_block
        )
        mask = base.expand(-1, heads, -1, -1).clone()
        causal = causal_block_mask(1, 1, q_len, k_len, size, device)
        k_blocks = causal.shape[-1]
        flops = probe.flops
        if bool(active.any()):
            pooled = pooled_block_scores(query, key, size, key_padding_mask, scaling)
            flops += pooled_block_flops(batch, heads, kv_heads, q_len, k_len, head_dim, size)
            real = real_key_blocks(key_padding_mask, batch, k_len, size, device)
            allowed = causal & real[:, None, None, :]
            share = self._slash_share(*peaks)[:, :, None, None]
            rows = _probe_rows(probe, allowed, share, q_len, k_len, size)
            cap = (config.max_density * allowed.sum(-1)).floor().long().clamp_min(1)
            last_row = (probe.last_query // size)[:, None, None, None]
            estimate = pooled.gather(2, last_row.expand(-1, heads, 1, k_blocks))[:, :, 0]
            trusted = js_divergence(estimate, p).sqrt() < config.tau_pooled
            score = torch.where(trusted[:, :, None, None], (pooled + rows) / 2, rows)
            selected = coverage_select(
                score,
                params["gamma"][:, :, None],
                allowed,
                params["min_budget"][:, :, None],
                cap,
            )
            mask |= selected & active[:, :, None, None]
        coverage = self._augment(probe, mask, mid, active, params, causal)
        return BlockPlan(
            block_mask=mask,
            block_size=size,
            regime=[REGIMES[int(r)] for r in retrieval[:, 0].tolist()],
            probe_flops=flops,
            stats={
                "entropy": entropy,
                "concentration": probe.concentration(params["gamma"]),
                "mid_mass": (p * mid).sum(-1),
                "mid_coverage": coverage,
                "query_aware": active,
            },
        )
