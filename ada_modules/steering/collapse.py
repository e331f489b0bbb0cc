"""Generation-collapse measures for steered outputs: repetition, compressibility, parse failures."""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

from ada_modules.errors import InputError

__all__ = ["compression_ratio", "repeated_ngram_fraction", "unparseable_fraction"]


def repeated_ngram_fraction(text: str, n: int = 2) -> float:
    """The fraction of a text's character ``n``-grams that repeat an earlier one (0: none).

    Example:
        >>> repeated_ngram_fraction("abcd"), repeated_ngram_fraction("aaaa")
        (0.0, 1.0)
    """
    if n < 1:
        raise InputError(f"n must be >= 1, got {n!r}")
    grams = [text[i : i + n] for i in range(len(text) - n + 1)]
    if len(grams) < 2:
        return 0.0
    return (len(grams) - len(set(grams))) / (len(grams) - 1)


def compression_ratio(text: str) -> float:
    """``len(zlib(text)) / len(text)``: low for degenerate, repetitive text (1.0 for empty text).

    Example:
        >>> compression_ratio("a" * 200) < 0.1 < compression_ratio("the quick brown fox")
        True
    """
    raw = text.encode()
    if not raw:
        return 1.0
    return len(zlib.compress(raw, 9)) / len(raw)


def unparseable_fraction(texts: Sequence[str], pattern: str) -> float:
    """The fraction of ``texts`` that do not fully match the regular expression ``pattern``.

    Example:
        >>> unparseable_fraction(["A3", "B7", "AAA"], r"[AB]\\d")
        0.3333333333333333
    """
    if not texts:
        raise InputError("texts must hold at least one text, got none")
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise InputError(
            f"pattern {pattern!r} is not a valid regular expression: {error}"
        ) from error
    return sum(compiled.fullmatch(t) is None for t in texts) / len(texts)
