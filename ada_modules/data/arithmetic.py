"""Multi-digit addition with a digit-by-digit scratchpad."""

import random

from ada_modules.data.sequence_task import SequenceExample, SequenceTaskDataModule
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError

__all__ = ["ArithmeticDataModule", "addition_scratchpad"]

_ANSWER_MARKER = ">"


def addition_scratchpad(a: int, b: int) -> str:
    """The completion for ``a+b=``: one step per digit from the right, then ``>`` and the sum.

    Each step ``x+y+c=s`` adds digit ``x`` of ``a``, digit ``y`` of ``b`` (0 beyond a number's
    length) and the carry ``c`` from the previous step; ``s`` is their sum, whose tens digit is the
    next carry.

    Examples:
        >>> addition_scratchpad(57, 8)
        '7+8+0=15,5+0+1=6>65'
    """
    if a < 0 or b < 0:
        raise InputError(f"a and b must be non-negative, got a={a}, b={b}")
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(digits_a), len(digits_b))):
        x = int(digits_a[i]) if i < len(digits_a) else 0
        y = int(digits_b[i]) if i < len(digits_b) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total}")
        carry = total // 10
    return ",".join(steps) + _ANSWER_MARKER + str(a + b)


class ArithmeticDataModule(SequenceTaskDataModule):
    """Addition of two multi-digit numbers, answered with a step-by-step scratchpad.

    The prompt is ``a+b=``; the completion is :func:`addition_scratchpad` of ``a`` and ``b``
    followed by the end token, so its length grows with the number of digits. Each operand has a
    number of digits drawn uniformly from ``min_digits..max_digits``. :meth:`reward` checks only the
    final answer after ``>``. Each batch has a ``digits`` tensor (the number of scratchpad steps).

    ``numerals`` writes the prompt's digits with other characters while the scratchpad and the
    answer stay in digits: the same task read from input tokens of its own (a shifted input
    domain for merging studies, as rotated images are for classifiers).

    Args:
        min_digits: Fewest digits of an operand.
        max_digits: Most digits of an operand.
        numerals: The ten characters written for the digits 0-9 in the prompt, in order
            (``"abcdefghij"`` writes the prompt ``57+8=`` as ``fh+i=``). Distinct characters of the tokenizer's vocabulary,
            none of ``+=,>``.
        seed: Seed of the three example streams; equal seeds give equal data. ``None`` takes
            the seed of ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset), so a sweep's
            seeds vary the data too.
        num_train: Number of training examples.
        num_val: Number of validation examples.
        num_test: Number of test (and predict) examples.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        ValueError: If an argument is out of range, naming the argument.

    Examples:
        >>> dm = ArithmeticDataModule(min_digits=2, max_digits=3, num_val=8, num_test=8)
        >>> dm.setup("test")
        >>> dm.reward("4+1+0=5>5", "5")
        1.0
        >>> ArithmeticDataModule(numerals="abcdefghij").make_example(random.Random(0)).prompt  # 63+4=
        'gd+e='
    """

    def __init__(
        self,
        min_digits: int = 1,
        max_digits: int = 3,
        numerals: str = "0123456789",
        seed: int | None = None,
        num_train: int = 10_000,
        num_val: int = 256,
        num_test: int = 256,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed,
            num_train=num_train,
            num_val=num_val,
            num_test=num_test,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        if not isinstance(min_digits, int) or min_digits < 1:
            raise InputError(f"min_digits must be an integer >= 1, got {min_digits!r}")
        if not isinstance(max_digits, int) or not min_digits <= max_digits <= 32:
            raise InputError(
                f"max_digits must be an integer in [min_digits={min_digits}, 32], got {max_digits!r}"
            )
        vocabulary = set(CharTokenizer.characters) - set("+=,>")
        if (
            not isinstance(numerals, str)
            or len(numerals) != 10
            or len(set(numerals)) != 10
            or not set(numerals) <= vocabulary
        ):
            raise InputError(
                f"numerals must be 10 distinct characters of the tokenizer's vocabulary, none of "
                f"'+=,>', got {numerals!r}"
            )
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.numerals = numerals
        self._write = str.maketrans("0123456789", numerals)
        self.save_hyperparameters()

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)

    def make_example(self, rng: random.Random) -> SequenceExample:
        """Draw ``a`` and ``b`` and write out their scratchpad."""
        a, b = self._operand(rng), self._operand(rng)
        completion = addition_scratchpad(a, b)
        return SequenceExample(
            prompt=f"{a}+{b}=".translate(self._write),
            completion=completion,
            answer=str(a + b),
            metadata={"digits": max(len(str(a)), len(str(b)))},
        )

    def extract_answer(self, completion: str) -> str:
        """The text after the last ``>`` of ``completion`` (empty if there is none)."""
        head, marker, tail = completion.rpartition(_ANSWER_MARKER)
        return tail if marker else ""
