"""A guard shared by the task modules: refuse a checkpoint trained with other structural settings."""

from collections.abc import Iterable, Mapping
from typing import Any

from ada_modules.errors import InputError

__all__ = ["check_checkpoint_hparams"]


def check_checkpoint_hparams(
    checkpoint: Mapping[str, Any], hparams: Mapping[str, Any], keys: Iterable[str]
) -> None:
    """Raise an ``InputError`` naming the first of ``keys`` whose value in the checkpoint's
    hyperparameters differs from ``hparams`` (settings whose weights have the same names, so
    ``load_state_dict`` would not notice, or would fail without saying why).

    Examples:
        >>> check_checkpoint_hparams({"hyper_parameters": {"kind": "a"}}, {"kind": "a"}, ["kind"])
        >>> check_checkpoint_hparams({"hyper_parameters": {"kind": "a"}}, {"kind": "b"}, ["kind"])
        Traceback (most recent call last):
        ...
        ada_modules.errors.InputError: the checkpoint was trained with kind='a', this model has kind='b'; set model.init_args.kind to match
    """
    saved = checkpoint.get("hyper_parameters", {})
    for key in keys:
        if key in saved and saved[key] != hparams[key]:
            raise InputError(
                f"the checkpoint was trained with {key}={saved[key]!r}, this model has "
                f"{key}={hparams[key]!r}; set model.init_args.{key} to match"
            )
