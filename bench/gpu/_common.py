"""Pieces shared by the GPU benchmark scripts of this folder (imported by them, not run).

The scripts run as ``python bench/gpu/<slug>.py``, so this folder is on ``sys.path``.
"""

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Guard:
    """Global time budget: sections and rows ask it before starting."""

    budget_s: float
    start: float = field(default_factory=time.perf_counter)
    skipped: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def ok(self, what: str, need_s: float) -> bool:
        """Whether ``need_s`` seconds are left for ``what``; records it as skipped otherwise."""
        if self.budget_s - self.elapsed() >= need_s:
            return True
        self.skipped.append(what)
        print(f"[time guard] skipped {what} ({self.elapsed():.0f} s of {self.budget_s:.0f} s used)")
        return False


def sync(device: torch.device) -> None:
    """Wait for queued work on ``device``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
