"""Argument checks shared by the maze and Sudoku generators and their DataModules (aNCA data)."""

import numpy as np

from ada_modules.errors import InputError

__all__ = ["check_rng", "is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is a Python or NumPy integer (``bool`` does not count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_rng(rng: object) -> np.random.Generator:
    """``rng`` itself if it is a ``numpy.random.Generator``; otherwise an ``InputError``."""
    if not isinstance(rng, np.random.Generator):
        raise InputError(
            f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {rng!r}"
        )
    return rng
