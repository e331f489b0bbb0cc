"""Activation steering (AMPS)."""
