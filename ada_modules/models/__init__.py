"""LightningModules, one task each (causal LM, operator transformer, DiT, NCA solver, ...).

Techniques plug into a module through its init args (a cache factory, an attention
implementation, an optimizer), so a baseline and a technique differ by one YAML key.
"""

from ada_modules.models.abc_estimator_study import EstimatorStudyModule
from ada_modules.models.adkv_calibration import ADKVCalibrationModule
from ada_modules.models.autoencoder import (
    AutoencoderKLModule,
    PretrainedAutoencoder,
    load_autoencoder,
    tiny_autoencoder_kl,
)
from ada_modules.models.candidate_selection import CandidateSelectionModule
from ada_modules.models.causal_lm import CausalLMModule
from ada_modules.models.classifier import ImageClassifierModule
from ada_modules.models.dit import DiTModule, euler_sample
from ada_modules.models.dpo import DPOModule
from ada_modules.models.federated import FederatedSimulationModule
from ada_modules.models.frechet import frechet_distance
from ada_modules.models.image_text_qa import ImageTextQAModule
from ada_modules.models.merge import MergeModule
from ada_modules.models.modality_steering import ModalitySteeringModule
from ada_modules.models.moe import MoELMModule
from ada_modules.models.nca_solver import MazeNCAModule, SudokuNCAModule
from ada_modules.models.on_policy import OnPolicyModule
from ada_modules.models.operator_transformer import OperatorTransformerModule
from ada_modules.models.preference import PreferenceModule, RewardModelModule
from ada_modules.models.reliability_study import ReliabilityStudyModule
from ada_modules.models.self_distillation import SelfDistillationModule
from ada_modules.models.shapes_judge import ShapesJudge, ShapesJudgeModule, load_shapes_judge
from ada_modules.models.sparse_prefill_study import SparsePrefillStudyModule

__all__ = [
    "ImageTextQAModule",
    "ADKVCalibrationModule",
    "AutoencoderKLModule",
    "DiTModule",
    "euler_sample",
    "CandidateSelectionModule",
    "CausalLMModule",
    "DPOModule",
    "EstimatorStudyModule",
    "FederatedSimulationModule",
    "ImageClassifierModule",
    "MazeNCAModule",
    "MergeModule",
    "ModalitySteeringModule",
    "OnPolicyModule",
    "OperatorTransformerModule",
    "PreferenceModule",
    "PretrainedAutoencoder",
    "MoELMModule",
    "ReliabilityStudyModule",
    "RewardModelModule",
    "SelfDistillationModule",
    "ShapesJudge",
    "ShapesJudgeModule",
    "SparsePrefillStudyModule",
    "SudokuNCAModule",
    "frechet_distance",
    "load_autoencoder",
    "load_shapes_judge",
    "tiny_autoencoder_kl",
]
