"""``torch.optim.Optimizer`` subclasses, their reference baselines and param-group helpers."""
