"""Lightning Callbacks, one per file, drop-in for any ``Trainer`` (profilers, monitors, bars)."""

from ada_modules.callbacks.aad_profiler import AADProfiler
from ada_modules.callbacks.activation_stats import ActivationStatsCallback
from ada_modules.callbacks.adkv_calibration import ADKVCalibration
from ada_modules.callbacks.connectivity_monitor import ConnectivityMonitor
from ada_modules.callbacks.load_weights import LoadWeights
from ada_modules.callbacks.progress_bar import BudgetProgressBar
from ada_modules.callbacks.sparse_prefill_monitor import SparsePrefillMonitor
from ada_modules.callbacks.summary import fit_summary
from ada_modules.callbacks.training_curves import TrainingCurves

__all__ = [
    "AADProfiler",
    "ActivationStatsCallback",
    "ADKVCalibration",
    "BudgetProgressBar",
    "ConnectivityMonitor",
    "LoadWeights",
    "SparsePrefillMonitor",
    "TrainingCurves",
    "fit_summary",
]
