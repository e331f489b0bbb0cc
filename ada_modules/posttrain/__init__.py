"""Post-training objectives: advantages, distillation targets, environments (AVSD, AEM, ABC-Align)."""

from ada_modules.posttrain import advantages, avsd, envs
from ada_modules.posttrain.advantages import (
    ADVANTAGE_ESTIMATORS,
    RolloutStats,
    aem_advantages,
    clip_cov_mask,
    dr_grpo_advantages,
    grpo_advantages,
    register_advantage,
)
from ada_modules.posttrain.avsd import (
    AVSDTarget,
    ViewPool,
    avsd_target,
    generalized_jsd,
    pool_views,
    sampled_token_advantages,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AVSDTarget",
    "RolloutStats",
    "ViewPool",
    "advantages",
    "avsd",
    "avsd_target",
    "aem_advantages",
    "clip_cov_mask",
    "dr_grpo_advantages",
    "envs",
    "generalized_jsd",
    "grpo_advantages",
    "pool_views",
    "register_advantage",
    "sampled_token_advantages",
]
