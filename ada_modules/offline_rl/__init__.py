"""Offline reinforcement learning over candidate sets (AIQL / A²IQL): IQL's losses, the
Plackett-Luce likelihood of picks, a per-candidate scoring actor, aggregate and per-candidate
critics, and reward predictors with uncertainty for cross-objective adaptation. The
LightningModule is :class:`ada_modules.models.CandidateSelectionModule`."""

from ada_modules.offline_rl.losses import (
    advantage_weights,
    expectile_loss,
    plackett_luce_log_likelihood,
    sample_plackett_luce,
    subsample_candidates,
)
from ada_modules.offline_rl.networks import (
    AggregateCritic,
    CandidateScorer,
    PerCandidateCritic,
    ValueNetwork,
)
from ada_modules.offline_rl.reward_predictors import (
    BayesianLinearRewardPredictor,
    EnsembleRewardPredictor,
    conservative_bonus,
)

__all__ = [
    "AggregateCritic",
    "BayesianLinearRewardPredictor",
    "CandidateScorer",
    "EnsembleRewardPredictor",
    "PerCandidateCritic",
    "ValueNetwork",
    "advantage_weights",
    "conservative_bonus",
    "expectile_loss",
    "plackett_luce_log_likelihood",
    "sample_plackett_luce",
    "subsample_candidates",
]
