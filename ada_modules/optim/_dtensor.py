"""Helpers for optimizers whose parameters may be ``DTensor``s (FSDP2's ``fully_shard``, tensor parallel).

Operations that need a whole tensor (a Newton–Schulz polar factor, column norms) run on
:meth:`~torch.distributed.tensor.DTensor.full_tensor` and keep the local part of the result with
:func:`shard_like`; element-wise operations stay on the local shards. Every rank computes the same
full result from the same gathered input, so the sharded update equals the unsharded one.

``torch.distributed.tensor`` is not imported here: a ``DTensor`` can only exist once that module
has been imported, so :func:`is_dtensor` looks it up in ``sys.modules`` (no import cost, and no
failure on builds without ``torch.distributed``).
"""

import sys
from typing import Any

from torch import Tensor

__all__ = ["is_dtensor", "plain", "shard_like"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def plain(t: Tensor) -> Tensor:
    """``t`` as an ordinary tensor: the full (gathered or reduced) value of a ``DTensor``.

    For a 0-d ``DTensor`` (a dual norm, a ``Partial`` sum) this is one all-reduce; every rank gets
    the same value. Ordinary tensors are returned as they are.
    """
    return t.full_tensor() if is_dtensor(t) else t


def shard_like(full: Tensor, like: Tensor, src_rank: int | None = None) -> Tensor:
    """The full tensor ``full`` distributed as ``like`` (a ``DTensor`` of the same global shape).

    With ``src_rank=None`` there is no communication: every rank holds the same ``full`` and keeps
    its own part of it. With a rank, that rank's ``full`` is scattered (for values that may differ
    between ranks, such as random draws). Pending ``Partial`` placements of ``like``, as on some
    gradients, become ``Replicate``. If ``like`` is an ordinary tensor, ``full`` is returned
    unchanged.
    """
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import Replicate, distribute_tensor

    placements = [Replicate() if p.is_partial() else p for p in like.placements]
    return distribute_tensor(full, like.device_mesh, placements, src_data_rank=src_rank)
