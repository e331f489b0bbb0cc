"""Lightning Strategies (AdERA's compressed FSDP2 all-gather) and the FSDP2 sharding helper."""

from ada_modules.strategies.adera import (
    MIN_TORCH_VERSION,
    AdERAAllGather,
    require_custom_all_gather,
)
from ada_modules.strategies.adera_budget import ValueCacheBudget
from ada_modules.strategies.adera_cost_model import CostModel
from ada_modules.strategies.adera_install import install_adera_all_gather, verify_exponent_caches
from ada_modules.strategies.adera_stats import GatherStats
from ada_modules.strategies.adera_strategy import AdERAStrategy
from ada_modules.strategies.adera_trace import GatherRecord, trace_from_records
from ada_modules.strategies.sharding import (
    ShardSpec,
    find_blocks,
    is_sharded,
    shard_module,
    sharding_mesh,
)

__all__ = [
    "MIN_TORCH_VERSION",
    "AdERAAllGather",
    "AdERAStrategy",
    "CostModel",
    "GatherRecord",
    "GatherStats",
    "ShardSpec",
    "ValueCacheBudget",
    "find_blocks",
    "is_sharded",
    "shard_module",
    "sharding_mesh",
    "install_adera_all_gather",
    "require_custom_all_gather",
    "trace_from_records",
    "verify_exponent_caches",
]
