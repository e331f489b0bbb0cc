"""Choosing between a Triton kernel and its torch reference.

Every public kernel function takes ``impl: Impl = "auto"`` and calls :func:`resolve_impl` once with
its tensor arguments. This module imports neither triton nor CUDA at import time, so it works on
machines without a GPU and where triton is not installed (macOS, Windows).
"""

import functools
import importlib
import os
from typing import Literal, get_args

import torch

from ada_modules.errors import InputError

__all__ = ["FLOAT_DTYPES", "Impl", "interpreter_enabled", "resolve_impl", "triton_available"]

Impl = Literal["auto", "triton", "torch"]
"""How a kernel function runs: ``"auto"`` (Triton for CUDA tensors, torch otherwise), ``"triton"``
or ``"torch"`` (the reference)."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The floating dtypes the kernels take (float64 tensors go to dense torch paths, or are refused)."""

_TRUE_VALUES = frozenset({"1", "true", "on", "yes"})


@functools.cache
def triton_available() -> bool:
    """Return whether triton can be imported here (it is installed and loads).

    Examples:
        >>> isinstance(triton_available(), bool)
        True
    """
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """Return whether ``TRITON_INTERPRET`` is set, i.e. Triton kernels run on CPU tensors.

    Triton reads the variable once, when it is first imported, so set it before that (the test suite
    does so in ``tests/conftest.py``).

    Examples:
        >>> isinstance(interpreter_enabled(), bool)
        True
    """
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE_VALUES


def resolve_impl(impl: Impl, *tensors: torch.Tensor) -> Literal["triton", "torch"]:
    """Decide whether a kernel function runs its Triton kernel or its torch reference.

    Args:
        impl: ``"auto"`` picks Triton when triton is available and every tensor is on a CUDA
            device, and torch otherwise. ``"triton"`` insists on the kernel and fails clearly when it
            cannot run. ``"torch"`` always picks the reference.
        *tensors: The tensor arguments of the kernel function; they must share one device.

    Returns:
        ``"triton"`` or ``"torch"``.

    Raises:
        TypeError: If no tensor is given.
        ValueError: If ``impl`` is not one of the allowed values, the tensors are on different
            devices, or ``impl="triton"`` is asked for on a non-CUDA device while the Triton
            interpreter is off.
        RuntimeError: If ``impl="triton"`` is asked for and triton cannot be imported.

    Examples:
        >>> resolve_impl("auto", torch.zeros(2, 3))
        'torch'
        >>> resolve_impl("torch", torch.zeros(2, 3))
        'torch'
    """
    if not tensors:
        raise InputError("resolve_impl needs at least one tensor")
    if impl not in get_args(Impl):
        raise InputError(f"impl must be one of {get_args(Impl)}, got {impl!r}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise InputError(f"expected all tensors on one device, got {names}")
    if impl == "torch":
        return "torch"
    on_cuda = all(d.type == "cuda" for d in devices)
    if impl == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("impl='triton' needs the triton package, which cannot be imported here")
    if not on_cuda and not interpreter_enabled():
        (device,) = devices
        raise InputError(
            f"impl='triton' needs CUDA tensors, got tensors on {device}; to run the kernel on CPU "
            "set TRITON_INTERPRET=1 in the environment before triton is imported, or use impl='torch'"
        )
    return "triton"
