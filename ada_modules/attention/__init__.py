"""Attention functions registered with transformers' ``AttentionInterface`` (AdaCal and baselines)."""
