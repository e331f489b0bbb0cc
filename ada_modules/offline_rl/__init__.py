"""Offline reinforcement learning (AIQL / A2IQL)."""
