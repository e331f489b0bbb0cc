"""Activation steering (AMPS): steering vectors from contrastive activations applied with forward
hooks on transformers decoders (see :func:`decoder_layers`), the Modality Contribution Ratio,
instance-aware strengths and generation-collapse measures. The LightningModule is
:class:`ada_modules.models.ModalitySteeringModule`."""

from ada_modules.steering.collapse import (
    compression_ratio,
    repeated_ngram_fraction,
    unparseable_fraction,
)
from ada_modules.steering.hooks import capture_hidden_states, decoder_layers, steer
from ada_modules.steering.mcr import (
    answer_divergence,
    attention_share,
    modality_contribution_ratio,
)
from ada_modules.steering.strength import StrengthPredictor, mcr_scaled_strength
from ada_modules.steering.vectors import SteeringVector

__all__ = [
    "SteeringVector",
    "StrengthPredictor",
    "answer_divergence",
    "attention_share",
    "capture_hidden_states",
    "compression_ratio",
    "decoder_layers",
    "mcr_scaled_strength",
    "modality_contribution_ratio",
    "repeated_ngram_fraction",
    "steer",
    "unparseable_fraction",
]
