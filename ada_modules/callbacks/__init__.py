"""Lightning Callbacks, one per file, drop-in for any ``Trainer`` (profilers, monitors)."""

from ada_modules.callbacks.connectivity_monitor import ConnectivityMonitor as ConnectivityMonitor
