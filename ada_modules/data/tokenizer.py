"""A fixed-vocabulary character tokenizer shared by every sequence task."""

from collections.abc import Iterable

from ada_modules.errors import InputError

__all__ = ["CharTokenizer"]

_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
_CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*=:;,.?!>|#[]()\n"


class CharTokenizer:
    """Maps each character to one token; the vocabulary is fixed and identical everywhere.

    The vocabulary is the special tokens ``<pad>`` (id 0), ``<bos>`` (1) and ``<eos>`` (2) followed
    by digits, lower- and upper-case ASCII letters and a few punctuation characters. Because the
    vocabulary never depends on the data, a model built for one task works for every task.

    Examples:
        >>> tok = CharTokenizer()
        >>> ids = tok.encode("ab:cd", add_bos=True, add_eos=True)
        >>> ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        True
        >>> tok.decode(ids)
        'ab:cd'
    """

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    characters: str = _CHARACTERS

    def __init__(self) -> None:
        self._id_of = {ch: i + len(_SPECIAL_TOKENS) for i, ch in enumerate(_CHARACTERS)}
        self._tokens = (*_SPECIAL_TOKENS, *_CHARACTERS)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return len(self._tokens)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Turn ``text`` into token ids, optionally framed by ``<bos>`` and ``<eos>``.

        Raises:
            ValueError: If ``text`` contains a character outside the vocabulary.
        """
        try:
            ids = [self._id_of[ch] for ch in text]
        except KeyError as err:
            raise InputError(
                f"text contains {err.args[0]!r}, which is not in the CharTokenizer vocabulary"
            ) from None
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], stop_at_eos: bool = True) -> str:
        """Turn token ids back into text, dropping special tokens.

        Args:
            ids: Token ids (a list or a 1-D tensor).
            stop_at_eos: Ignore everything from the first ``<eos>`` on.
        """
        chars = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i >= len(_SPECIAL_TOKENS):
                chars.append(self._tokens[i])
        return "".join(chars)

    def __len__(self) -> int:
        return self.vocab_size
