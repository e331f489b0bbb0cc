"""Reliability operators and the cost-aware router."""
