"""``torch.optim.Optimizer`` subclasses, their reference baselines, param-group helpers and
learning-rate schedules usable from YAML by class path."""

from ada_modules.optim.lr_schedulers import WarmupCosineLR

__all__ = ["WarmupCosineLR"]
