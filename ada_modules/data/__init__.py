"""LightningDataModules whose data is generated from a seed (no files, no downloads).

Every sequence task shares :class:`CharTokenizer`, so one model fits all of them, and derives from
:class:`SequenceTaskDataModule`, so their batches have the same keys. KV-cache data for ADKV:
:class:`RopeDriftDataModule` generates keys with drifting RoPE outlier channels, and
:class:`CapturedKVDataModule` serves the keys, values and queries that :func:`capture_kv` records
from a Hugging Face model.

Operator-learning data for AOT-POT: :class:`PDEDataModule` serves windows of trajectories of one
or several PDE families (advection, diffusion, Burgers, Allen-Cahn, KdV; 2D advection and
diffusion), solved pseudo-spectrally by :func:`solve_pde`.
"""

from ada_modules.data.arithmetic import ArithmeticDataModule, addition_scratchpad
from ada_modules.data.digit_domains import DIGIT_DOMAINS, DigitDomainsDataModule
from ada_modules.data.digits import DigitsDataModule
from ada_modules.data.env_tasks import EnvTaskDataModule
from ada_modules.data.kv_capture import (
    CAPTURE_ATTENTION,
    CapturedKV,
    CapturedKVDataModule,
    capture_attention,
    capture_kv,
    load_captured_kv,
    save_captured_kv,
)
from ada_modules.data.needle import NeedleRecallDataModule
from ada_modules.data.pde import (
    PDE_FAMILIES,
    PDEDataModule,
    PDEDivergenceError,
    PDETrajectories,
    evolve_pde,
    solve_pde,
)
from ada_modules.data.planted_attention import (
    PlantedAttention,
    PlantedAttentionDataModule,
    planted_attention,
)
from ada_modules.data.recall import RecallDataModule
from ada_modules.data.reliability_items import (
    ReliabilityItems,
    ReliabilityItemsDataModule,
    TaskItemsDataModule,
)
from ada_modules.data.rope_drift import (
    RopeDriftDataModule,
    RopeDriftSample,
    apply_rope,
    drift_statistics,
    rope_drift_kv,
)
from ada_modules.data.sequence_task import SequenceCollator, SequenceExample, SequenceTaskDataModule
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.data.task_domains import TaskDomainsDataModule
from ada_modules.data.tokenizer import CharTokenizer

__all__ = [
    "ArithmeticDataModule",
    "CAPTURE_ATTENTION",
    "CapturedKV",
    "CapturedKVDataModule",
    "CharTokenizer",
    "DIGIT_DOMAINS",
    "DigitDomainsDataModule",
    "DigitsDataModule",
    "EnvTaskDataModule",
    "NeedleRecallDataModule",
    "PDE_FAMILIES",
    "PDEDataModule",
    "PDEDivergenceError",
    "PDETrajectories",
    "PlantedAttention",
    "PlantedAttentionDataModule",
    "RecallDataModule",
    "ReliabilityItems",
    "ReliabilityItemsDataModule",
    "RopeDriftDataModule",
    "RopeDriftSample",
    "SequenceCollator",
    "SequenceExample",
    "SequenceTaskDataModule",
    "SplitDataModule",
    "TaskDomainsDataModule",
    "TaskItemsDataModule",
    "addition_scratchpad",
    "apply_rope",
    "capture_attention",
    "capture_kv",
    "drift_statistics",
    "evolve_pde",
    "load_captured_kv",
    "planted_attention",
    "rope_drift_kv",
    "save_captured_kv",
    "solve_pde",
]
