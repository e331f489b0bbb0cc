"""Post-training objectives: advantages, distillation targets, environments (AVSD, AEM, ABC-Align)."""

from ada_modules.posttrain import advantages, envs
from ada_modules.posttrain.advantages import (
    ADVANTAGE_ESTIMATORS,
    RolloutStats,
    aem_advantages,
    clip_cov_mask,
    dr_grpo_advantages,
    grpo_advantages,
    register_advantage,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "RolloutStats",
    "advantages",
    "aem_advantages",
    "clip_cov_mask",
    "dr_grpo_advantages",
    "envs",
    "grpo_advantages",
    "register_advantage",
]
