"""Lightning Callbacks, one per file, drop-in for any ``Trainer`` (profilers, monitors)."""

from ada_modules.callbacks.aad_profiler import AADProfiler
from ada_modules.callbacks.connectivity_monitor import ConnectivityMonitor

__all__ = ["AADProfiler", "ConnectivityMonitor"]
