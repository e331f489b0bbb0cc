"""Argument checks shared by the steering modules."""

from __future__ import annotations

from collections.abc import Callable
from numbers import Real

import torch
from torch import Tensor

from ada_modules.errors import InputError


def check_real(name: str, value: object, allowed: str, valid: Callable[[float], bool]) -> float:
    """``value`` as a float if it is a real scalar that ``valid`` accepts, else an ``InputError``.

    A real scalar is a number other than a bool (``int``, ``float``, ``numpy.float32``, ...) or a
    one-element real tensor; ``allowed`` describes the valid values in the message.
    """
    if isinstance(value, Tensor):
        real = value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
    else:
        real = isinstance(value, Real) and not isinstance(value, bool)
    if not (real and valid(float(value))):
        raise InputError(f"{name} must be {allowed}, got {value!r}")
    return float(value)
