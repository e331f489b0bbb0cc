"""LightningDataModules whose data is generated from a seed (no files, no downloads).

Every sequence task shares :class:`CharTokenizer`, so one model fits all of them, and derives from
:class:`SequenceTaskDataModule`, so their batches have the same keys.
"""

from ada_modules.data.arithmetic import ArithmeticDataModule, addition_scratchpad
from ada_modules.data.digits import DigitsDataModule
from ada_modules.data.env_tasks import EnvTaskDataModule
from ada_modules.data.recall import RecallDataModule
from ada_modules.data.sequence_task import SequenceCollator, SequenceExample, SequenceTaskDataModule
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.data.tokenizer import CharTokenizer

__all__ = [
    "ArithmeticDataModule",
    "CharTokenizer",
    "DigitsDataModule",
    "EnvTaskDataModule",
    "RecallDataModule",
    "SequenceCollator",
    "SequenceExample",
    "SequenceTaskDataModule",
    "SplitDataModule",
    "addition_scratchpad",
]
