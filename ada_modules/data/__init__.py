"""LightningDataModules whose data is generated from a seed (no files, no downloads).

Every sequence task shares :class:`CharTokenizer`, so one model fits all of them, and derives from
:class:`SequenceTaskDataModule`, so their batches have the same keys. KV-cache data for ADKV:
:class:`RopeDriftDataModule` generates keys with drifting RoPE outlier channels, and
:class:`CapturedKVDataModule` serves the keys, values and queries that :func:`capture_kv` records
from a Hugging Face model.

Operator-learning data for AOT-POT: :class:`PDEDataModule` serves windows of trajectories of one
or several PDE families (advection, diffusion, Burgers, Allen-Cahn, KdV; 2D advection and
diffusion), solved pseudo-spectrally by :func:`solve_pde`.

Federated rounds for ASAP: :class:`FederatedDataModule` shares another DataModule's training
split among clients (IID or Dirichlet label skew) and serves every client's batches per round.

Preference pairs for ABC-Align: :class:`PreferenceDataModule` serves a few human-labelled and many
AI-judge-labelled pairs of a :class:`PreferenceWorld` (digit strings, a known true preference, a
judge with a tunable accuracy and length bias).

Warehouse consolidation for AIQL: :class:`ConsolidationSimulator` (a batched, seeded backlog of
orders; pick K per epoch) and :class:`ConsolidationLogsDataModule` (offline logs of noisy
heuristics under a source and a target objective; fresh episodes for evaluation).

Procedural shapes for AHPA: :class:`ShapesDataModule` serves seeded images of five shapes in two
colour families (10 classes) drawn by :func:`generate_shapes`.

Puzzles for aNCA: :class:`MazeDataModule` and :class:`SudokuDataModule` serve seeded mazes
(:mod:`~ada_modules.data.mazes`, :func:`generate_maze`) and Sudoku puzzles
(:mod:`~ada_modules.data.sudoku`, :func:`generate_sudoku`) as per-cell image tensors, scored by
:func:`maze_solved` and :func:`sudoku_solved`.
"""

from ada_modules.data.arithmetic import ArithmeticDataModule, addition_scratchpad
from ada_modules.data.consolidation import ConsolidationSimulator, ConsolidationState
from ada_modules.data.consolidation_logs import (
    ConsolidationLogs,
    ConsolidationLogsDataModule,
    collect_logs,
)
from ada_modules.data.digit_domains import DIGIT_DOMAINS, DigitDomainsDataModule
from ada_modules.data.digits import DigitsDataModule
from ada_modules.data.env_tasks import EnvTaskDataModule
from ada_modules.data.federated import FederatedDataModule
from ada_modules.data.kv_capture import (
    CAPTURE_ATTENTION,
    CapturedKV,
    CapturedKVDataModule,
    capture_attention,
    capture_kv,
    load_captured_kv,
    save_captured_kv,
)
from ada_modules.data.mazes import Maze, generate_maze, maze_solved, maze_tensors, shortest_path
from ada_modules.data.modality_conflict import (
    ITEM_KINDS,
    ModalityConflictDataModule,
    ModalityConflictItems,
    make_conflict_items,
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
from ada_modules.data.preference_world import (
    PreferenceDataModule,
    PreferencePairs,
    PreferenceWorld,
)
from ada_modules.data.puzzle_datamodules import MazeDataModule, SudokuDataModule
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
from ada_modules.data.shapes import ShapesDataModule, generate_shapes
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.data.sudoku import (
    count_solutions,
    generate_sudoku,
    solved_grid,
    sudoku_answer,
    sudoku_solved,
    sudoku_tensors,
)
from ada_modules.data.task_domains import TaskDomainsDataModule
from ada_modules.data.tokenizer import CharTokenizer

__all__ = [
    "ITEM_KINDS",
    "ModalityConflictDataModule",
    "ModalityConflictItems",
    "make_conflict_items",
    "ConsolidationLogs",
    "ConsolidationLogsDataModule",
    "ConsolidationSimulator",
    "ConsolidationState",
    "collect_logs",
    "ArithmeticDataModule",
    "CAPTURE_ATTENTION",
    "CapturedKV",
    "CapturedKVDataModule",
    "CharTokenizer",
    "DIGIT_DOMAINS",
    "FederatedDataModule",
    "DigitDomainsDataModule",
    "DigitsDataModule",
    "EnvTaskDataModule",
    "Maze",
    "MazeDataModule",
    "NeedleRecallDataModule",
    "PDE_FAMILIES",
    "PDEDataModule",
    "PDEDivergenceError",
    "PDETrajectories",
    "PlantedAttention",
    "PlantedAttentionDataModule",
    "PreferenceDataModule",
    "PreferencePairs",
    "PreferenceWorld",
    "RecallDataModule",
    "ReliabilityItems",
    "ReliabilityItemsDataModule",
    "RopeDriftDataModule",
    "RopeDriftSample",
    "SequenceCollator",
    "SequenceExample",
    "SequenceTaskDataModule",
    "ShapesDataModule",
    "SplitDataModule",
    "SudokuDataModule",
    "TaskDomainsDataModule",
    "TaskItemsDataModule",
    "addition_scratchpad",
    "apply_rope",
    "capture_attention",
    "capture_kv",
    "count_solutions",
    "drift_statistics",
    "evolve_pde",
    "generate_shapes",
    "generate_maze",
    "generate_sudoku",
    "load_captured_kv",
    "maze_solved",
    "maze_tensors",
    "planted_attention",
    "rope_drift_kv",
    "save_captured_kv",
    "shortest_path",
    "solve_pde",
    "solved_grid",
    "sudoku_answer",
    "sudoku_solved",
    "sudoku_tensors",
]
