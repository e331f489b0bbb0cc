"""The memory budget that decides which AdERA groups cache whole values (``reuse="auto"``).

A value cache holds a group's whole previous all-gather output on every rank (its dtype's bytes per
element), an exponent cache one byte per element. Value reuse sends far fewer bytes
(:mod:`ada_modules.kernels.delta_codec`), so with ``reuse="auto"`` each group asks one shared
:class:`ValueCacheBudget`, at its first tracked gather, for its value cache: it gets value reuse
if the cache fits what is left, exponent reuse otherwise. Every rank sees the gathers in the same
order with the same sizes, so every rank makes the same choices.

Examples:
    >>> budget = ValueCacheBudget(nbytes=1000)
    >>> budget.claim(600), budget.claim(600), budget.claim(400), budget.used
    (True, False, True, 1000)
"""

from dataclasses import dataclass

from ada_modules.errors import InputError

__all__ = ["ValueCacheBudget", "budget_for"]


@dataclass
class ValueCacheBudget:
    """Bytes of value caches that the groups sharing this budget may hold on each rank.

    Attributes:
        nbytes: The budget.
        used: Bytes claimed so far.
    """

    nbytes: int
    used: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise InputError(f"value cache budget must be a non-negative int, got {self.nbytes!r}")

    def claim(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` if they fit what is left; return whether they did."""
        if self.used + nbytes > self.nbytes:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` claimed earlier."""
        self.used -= nbytes


def budget_for(reuse: str, value_cache_bytes: int | None) -> ValueCacheBudget | None:
    """The budget ``reuse="auto"`` shares among a model's groups; ``None`` for the other modes.

    Raises:
        InputError: If ``reuse="auto"`` comes without ``value_cache_bytes`` or another mode with it.

    Examples:
        >>> budget_for("auto", 1 << 20), budget_for("value", None)
        (ValueCacheBudget(nbytes=1048576, used=0), None)
    """
    if (reuse == "auto") != (value_cache_bytes is not None):
        raise InputError(
            "reuse='auto' needs value_cache_bytes, and only reuse='auto' takes it; got "
            f"reuse={reuse!r} with value_cache_bytes={value_cache_bytes!r}"
        )
    return None if value_cache_bytes is None else ValueCacheBudget(value_cache_bytes)
