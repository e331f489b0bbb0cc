"""Silence third-party notices that say nothing about the user's run.

The ``ada`` command calls :func:`silence_third_party_noise` before it imports Lightning; call it
yourself at the top of a script for the same quiet output. Set ``ADA_VERBOSE=1`` to keep
everything. What it hides: Lightning's advertising tips (litlogger, litmodels), its notice that
tensorboardX is not a dependency, and the deprecations that Lightning's own code triggers with
recent torch (``LeafSpec``) and jsonargparse (``add_instantiator`` and others), and the note that
a checkpoint's ``TrainingCurves`` state is not restored by ``ada test`` (``ada`` adds that callback
to ``fit`` only). Warnings about the user's own code or config are kept.

Example:
    >>> from ada_modules.quiet import silence_third_party_noise
    >>> silence_third_party_noise()
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["silence_third_party_noise"]

# Lightning's rank_zero_info/rank_zero_warn go through these loggers.
_LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
)
_NOISE_MESSAGES = ("💡 Tip:",)
# Regular expressions matched against the start of warnings' messages.
_NOISE_WARNINGS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Starting from v1\.9\.0, `tensorboardX` has been removed",
    # Lightning's CLI calls jsonargparse functions deprecated since jsonargparse 4.49.
    r"\s*(``\w+(\.\w+)?``|skip_none parameter) was deprecated in v4\.",
    # `ada test --ckpt_path` of an `ada fit` checkpoint: `ada` adds TrainingCurves to fit only.
    r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be "
    r"provided during `Trainer` instantiation\. Please add the following callbacks: "
    r'\["TrainingCurves\{[^}]*\}"\]\.$',
)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(noise in message for noise in _NOISE_MESSAGES)


def silence_third_party_noise() -> None:
    """Install the filters (idempotent); does nothing when ``ADA_VERBOSE`` is set to ``1``."""
    if os.environ.get("ADA_VERBOSE") == "1":
        return
    for message in _NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=Warning)
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise())
