"""Model merging methods and their baselines (AMARIS)."""
