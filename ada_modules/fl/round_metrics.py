"""Attack round complexity: rounds to reach and stay near a target, and the deviation after.

Examples:
    >>> accuracy = [0.9, 0.7, 0.51, 0.46, 0.47, 0.44, 0.45, 0.3]
    >>> rounds_to_reach_and_stay(accuracy, target=0.45, band=0.05, window=3)
    3
    >>> round(deviation_after(accuracy, target=0.45, start=3), 4)
    0.038
    >>> rounds_to_reach_and_stay([0.9, 0.45, 0.9, 0.8], target=0.45, band=0.05, window=2) is None
    True
"""

from collections.abc import Sequence

from ada_modules.errors import InputError

__all__ = ["deviation_after", "rounds_to_reach_and_stay"]


def rounds_to_reach_and_stay(
    values: Sequence[float], target: float, band: float, window: int = 5
) -> int | None:
    """The first index ``R`` with ``|values[t] - target| <= band`` for ``t`` in ``[R, R + window)``.

    ``None`` when no ``window`` consecutive values are in the band (a run that only passes through
    the band, or overshoots it, does not count). :func:`deviation_after` from ``R`` measures how
    well it stays after.
    """
    if not band > 0:
        raise InputError(f"band must be > 0, got {band!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InputError(f"window must be an integer >= 1, got {window!r}")
    run = 0
    for index, value in enumerate(values):
        run = run + 1 if abs(value - target) <= band else 0
        if run == window:
            return index - window + 1
    return None


def deviation_after(values: Sequence[float], target: float, start: int | None) -> float | None:
    """Mean ``|values[t] - target|`` over ``t >= start`` (``None`` when ``start`` is ``None``)."""
    if start is None:
        return None
    tail = values[start:]
    if not tail:
        raise InputError(f"start={start} is past the last of {len(values)} values")
    return sum(abs(v - target) for v in tail) / len(tail)
