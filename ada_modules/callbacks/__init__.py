"""Lightning Callbacks, one per file, drop-in for any ``Trainer`` (profilers, monitors)."""
