"""Argument checks shared by the maze and Sudoku generators and their DataModules (aNCA data)."""

from collections.abc import Sequence

import numpy as np

from ada_modules.checks import is_int
from ada_modules.errors import InputError

__all__ = ["check_box", "check_maze_size", "check_rng", "is_int"]


def check_rng(rng: object) -> np.random.Generator:
    """``rng`` itself if it is a ``numpy.random.Generator``; otherwise an ``InputError``."""
    if not isinstance(rng, np.random.Generator):
        raise InputError(
            f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {rng!r}"
        )
    return rng


def check_box(value: object, allowed: Sequence[int]) -> int:
    """``value`` as an int if it is one of the ``allowed`` box sides; otherwise an ``InputError``."""
    if not is_int(value) or value not in allowed:
        raise InputError(f"box must be one of {', '.join(map(str, allowed))}, got {value!r}")
    return int(value)  # type: ignore[arg-type]


def check_maze_size(name: str, value: object) -> int:
    """``value`` as an int if it is an odd maze side >= 5; otherwise an ``InputError``."""
    if not is_int(value) or value < 5 or value % 2 == 0:  # type: ignore[operator]
        raise InputError(f"{name} must be an odd integer >= 5, got {value!r}")
    return int(value)  # type: ignore[arg-type]
