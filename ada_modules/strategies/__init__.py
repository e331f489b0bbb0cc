"""Lightning Strategies (e.g. AdERA's compressed FSDP2 all-gather)."""

from ada_modules.strategies.adera import (
    MIN_TORCH_VERSION,
    AdERAAllGather,
    AdERAStrategy,
    CostModel,
    GatherStats,
    install_adera_all_gather,
    require_custom_all_gather,
    verify_exponent_caches,
)

__all__ = [
    "MIN_TORCH_VERSION",
    "AdERAAllGather",
    "AdERAStrategy",
    "CostModel",
    "GatherStats",
    "install_adera_all_gather",
    "require_custom_all_gather",
    "verify_exponent_caches",
]
