"""Learning-rate schedules usable from YAML through ``LRSchedulerCallable``."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ada_modules.checks import is_finite_real
from ada_modules.errors import InputError

__all__ = ["WarmupCosineLR"]


class WarmupCosineLR(LRScheduler):
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` times the base rate.

    The first step uses ``base_lr / warmup_steps`` and step ``warmup_steps - 1`` the full rate. Step
    it once per optimizer step (``interval: step``). After ``total_steps`` the rate stays at
    ``min_lr_ratio * base_lr``.

    Args:
        optimizer: The wrapped optimizer.
        warmup_steps: Steps of linear warm-up.
        total_steps: Step at which the cosine reaches its minimum (warm-up included).
        min_lr_ratio: Final rate as a fraction of each group's initial rate.
        last_epoch: Index of the last step, for resuming (``-1`` starts afresh).

    Raises:
        ValueError: If ``warmup_steps``, ``total_steps`` or ``min_lr_ratio`` is out of range.

    Examples:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        >>> sched = WarmupCosineLR(opt, warmup_steps=10, total_steps=100)
        >>> opt.step(); sched.step()
        >>> group = opt.param_groups[0]
        >>> round(group["lr"], 6)
        0.0002
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise InputError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if not isinstance(total_steps, int) or total_steps <= warmup_steps:
            raise InputError(
                f"total_steps must be an integer > warmup_steps={warmup_steps}, got {total_steps!r}"
            )
        if not (is_finite_real(min_lr_ratio) and 0.0 <= min_lr_ratio <= 1.0):
            raise InputError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, last_epoch)

    def lr_factor(self, step: int) -> float:
        """Multiplier of the base rate after ``step`` optimizer steps."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def get_lr(self) -> list[float]:
        factor = self.lr_factor(self.last_epoch)
        return [base_lr * factor for base_lr in self.base_lrs]
