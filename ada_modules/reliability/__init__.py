"""The reliability layer: LLM reliability techniques as channel-coding operators (issue 25).

An LLM sampled at temperature ``T`` is a noisy channel: simulated ones
(:mod:`~ada_modules.reliability.channel`) and a Hugging Face model
(:mod:`~ada_modules.reliability.lm_channel`). Retry, voting, self-consistency, best-of-N,
self-refine and adaptive stopping are operators over a channel
(:mod:`~ada_modules.reliability.operators`), with closed forms for voting, averaging and
refinement (:mod:`~ada_modules.reliability.closed_forms`); a cost-aware kNN router picks an option
per query (:mod:`~ada_modules.reliability.router`).

Examples:
    >>> import torch
    >>> from ada_modules.reliability import DiversityCombining, SimulatedChannel
    >>> channel = SimulatedChannel([0.7] * 100, correlation=0.0)
    >>> g = torch.Generator().manual_seed(0)
    >>> vote = DiversityCombining(num_samples=5)
    >>> outcomes = [vote(channel, item, truth=0, generator=g) for item in range(100)]
    >>> sum(o.is_correct(0) for o in outcomes) > 70, outcomes[0].cost
    (True, 5.0)
"""

from ada_modules.reliability.channel import (
    Channel,
    Critic,
    Samples,
    SimulatedChannel,
    SimulatedCritic,
    SimulatedVerifier,
    Verifier,
)
from ada_modules.reliability.closed_forms import (
    averaging_threshold,
    effective_samples,
    inverse_variance_mse,
    is_contractive,
    majority_vote_accuracy,
    optimal_vote_weight,
    refinement_accuracy,
    refinement_fixed_point,
    refinement_helps,
    rounds_to_converge,
    uniform_mse,
    weighted_mse,
)
from ada_modules.reliability.lm_channel import CausalLMChannel
from ada_modules.reliability.operators import (
    DiversityCombining,
    GeneratorCritic,
    HybridRetransmission,
    Operator,
    Outcome,
    RatelessSampling,
    RedundantVerification,
    leader_confidence,
    plurality,
)
from ada_modules.reliability.router import (
    FixedOption,
    FrontierPoint,
    HashedNgramEmbedder,
    KNNRouter,
    cost_at_matched_quality,
    fixed_options,
    pareto_front,
    realised_point,
)

__all__ = [
    "CausalLMChannel",
    "Channel",
    "Critic",
    "DiversityCombining",
    "FixedOption",
    "FrontierPoint",
    "GeneratorCritic",
    "HashedNgramEmbedder",
    "HybridRetransmission",
    "KNNRouter",
    "Operator",
    "Outcome",
    "RatelessSampling",
    "RedundantVerification",
    "Samples",
    "SimulatedChannel",
    "SimulatedCritic",
    "SimulatedVerifier",
    "Verifier",
    "averaging_threshold",
    "cost_at_matched_quality",
    "effective_samples",
    "fixed_options",
    "inverse_variance_mse",
    "is_contractive",
    "leader_confidence",
    "majority_vote_accuracy",
    "optimal_vote_weight",
    "pareto_front",
    "plurality",
    "realised_point",
    "refinement_accuracy",
    "refinement_fixed_point",
    "refinement_helps",
    "rounds_to_converge",
    "uniform_mse",
    "weighted_mse",
]
