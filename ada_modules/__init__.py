"""ada-modules: Lightning components for seventeen adaptive techniques.

Importing the package is cheap: it does not import transformers, triton or the subpackages.
Import what you use, e.g. ``from ada_modules.callbacks import ...``.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
