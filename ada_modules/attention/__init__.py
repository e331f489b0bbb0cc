"""Sparse prefill attention: block plans, probes, AdaCal and its baselines.

- :mod:`~ada_modules.attention.plan`: the shared contract, :class:`BlockPlan` and the
  :class:`SparsePrefillPolicy` protocol (``plan(query, key, *, key_padding_mask, scaling)``),
- :mod:`~ada_modules.attention.probe`: the last-block probe, pooled block scores and the per-head
  metrics (entropy, concentration, mid-zone mass and coverage),
- :mod:`~ada_modules.attention.baselines`: :class:`DensePolicy`, :class:`AShapePolicy`,
  :class:`VerticalSlashPolicy`, :class:`FlexPrefillPolicy`, :class:`BlockTopKPolicy`,
- :mod:`~ada_modules.attention.adacal`: :class:`AdaCalPolicy` (head activation, mid-zone
  augmentation, task dispatch) and its :class:`AdaCalConfig`,
- :mod:`~ada_modules.attention.dispatch`: :class:`TaskDispatcher`, the coarse task dispatch,
- :mod:`~ada_modules.attention.interface`: importing this package registers one transformers
  attention function per policy (``attn_implementation="adacal"``, ``"sparse_a_shape"``, ...).
"""

from ada_modules.attention.adacal import (
    AdaCalConfig,
    AdaCalPolicy,
    RegimeParams,
    RetrievalParams,
    StructureParams,
)
from ada_modules.attention.baselines import (
    AShapePolicy,
    BlockTopKPolicy,
    DensePolicy,
    FlexPrefillPolicy,
    VerticalSlashPolicy,
)
from ada_modules.attention.dispatch import DISPATCH_FEATURES, REGIMES, TaskDispatcher
from ada_modules.attention.interface import (
    SPARSE_PREFILL_POLICIES,
    SparsePrefillCall,
    SparsePrefillLog,
    policy_from_config,
    record_sparse_prefill,
    set_sparse_prefill_policy,
    sparse_prefill_forward,
)
from ada_modules.attention.plan import (
    BlockPlan,
    SparsePrefillPolicy,
    causal_block_mask,
    check_block_size,
    diagonal_block_mask,
    num_blocks,
    plan_density,
)
from ada_modules.attention.probe import (
    ProbeResult,
    concentration,
    coverage_count,
    last_block_probe,
    mid_zone_coverage,
    mid_zone_mass,
    normalized_entropy,
    pooled_block_scores,
)

__all__ = [
    "DISPATCH_FEATURES",
    "REGIMES",
    "SPARSE_PREFILL_POLICIES",
    "AShapePolicy",
    "AdaCalConfig",
    "AdaCalPolicy",
    "BlockPlan",
    "BlockTopKPolicy",
    "DensePolicy",
    "FlexPrefillPolicy",
    "ProbeResult",
    "RegimeParams",
    "RetrievalParams",
    "SparsePrefillCall",
    "SparsePrefillLog",
    "SparsePrefillPolicy",
    "StructureParams",
    "TaskDispatcher",
    "VerticalSlashPolicy",
    "causal_block_mask",
    "check_block_size",
    "concentration",
    "coverage_count",
    "diagonal_block_mask",
    "last_block_probe",
    "mid_zone_coverage",
    "mid_zone_mass",
    "normalized_entropy",
    "num_blocks",
    "plan_density",
    "policy_from_config",
    "pooled_block_scores",
    "record_sparse_prefill",
    "set_sparse_prefill_policy",
    "sparse_prefill_forward",
]
