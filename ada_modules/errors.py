"""The one exception type for bad input given to this library.

Every component validates its arguments (in ``__init__``, or where the value is first seen) and
raises :class:`InputError` naming the argument, the value and what is allowed. It subclasses both
``ValueError`` and ``TypeError``, so ``except ValueError`` keeps working; the ``ada`` command turns
it into one line on stderr and exit code 2, while any other exception (a bug) keeps its traceback.

Example:
    >>> from ada_modules.errors import InputError
    >>> try:
    ...     raise InputError("key_bits must be an int or a list of ints, got 2.0")
    ... except ValueError as error:
    ...     print(error)
    key_bits must be an int or a list of ints, got 2.0
"""

__all__ = ["InputError"]


class InputError(ValueError, TypeError):
    """A value given to an ada-modules component is not allowed; the message names it."""
