"""Plain ``nn.Module`` building blocks usable without Lightning (residual connectivity, NCA cells, ...)."""
