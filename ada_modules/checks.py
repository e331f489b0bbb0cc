"""What the argument checks count as an integer and as a real number.

A Python or NumPy number counts (``numpy.int64(3)`` is an integer, ``numpy.float32(0.5)`` a real
number); a ``bool`` does not, though Python makes ``True`` an ``int``: a flag is never a size,
a count or a rate here.

Examples:
    >>> import numpy as np
    >>> from ada_modules.checks import check_finite_real, is_finite_real, is_int
    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    >>> is_finite_real(0.5), is_finite_real(np.float32(2)), is_finite_real(float("nan"))
    (True, True, False)
    >>> check_finite_real("lr", float("inf"))
    Traceback (most recent call last):
        ...
    ada_modules.errors.InputError: lr must be finite, got inf
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from ada_modules.errors import InputError

__all__ = ["check_finite_real", "is_finite_real", "is_int", "is_real"]


def is_int(value: object) -> bool:
    """Whether ``value`` is a Python or NumPy integer other than a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a Python or NumPy real number other than a bool (NaN and inf count)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def is_finite_real(value: object) -> bool:
    """Whether ``value`` is a real number (see :func:`is_real`) other than NaN and +-inf."""
    return is_real(value) and math.isfinite(value)


def check_finite_real(name: str, value: object) -> float:
    """``value`` as a float, or an :class:`InputError` naming ``name`` if it is not a finite real."""
    if not is_real(value):
        raise InputError(f"{name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise InputError(f"{name} must be finite, got {value!r}")
    return float(value)
