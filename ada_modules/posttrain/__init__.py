"""Post-training objectives: advantages, distillation targets, environments (AVSD, AEM, ABC-Align)."""

from ada_modules.posttrain import abc, advantages, avsd, envs
from ada_modules.posttrain.abc import (
    ESTIMATORS,
    SemiSupervisedEstimate,
    SemiSupervisedWeights,
    combine_losses,
    dpo_margin,
    estimate_mean,
    margin_gradients,
    preference_loss,
    semi_supervised_weights,
)
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
    "ESTIMATORS",
    "SemiSupervisedEstimate",
    "SemiSupervisedWeights",
    "abc",
    "combine_losses",
    "dpo_margin",
    "estimate_mean",
    "margin_gradients",
    "preference_loss",
    "semi_supervised_weights",
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
