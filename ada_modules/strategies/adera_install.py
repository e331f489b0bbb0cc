"""Putting AdERA on a sharded model: one all-gather per FSDP module, and the cross-rank cache check.

Examples:
    >>> from torch import nn
    >>> install_adera_all_gather(nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    ada_modules.errors.InputError: module has no FSDP module: apply fully_shard before installing AdERA
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ada_modules.errors import InputError
from ada_modules.strategies.adera import AdERAAllGather, require_custom_all_gather
from ada_modules.strategies.adera_budget import budget_for

__all__ = ["install_adera_all_gather", "verify_exponent_caches"]


def install_adera_all_gather(
    module: nn.Module, value_cache_bytes: int | None = None, **kwargs: object
) -> dict[str, AdERAAllGather]:
    """Give every FSDP module under ``module`` (itself included) its own :class:`AdERAAllGather`.

    Args:
        module: A model already sharded with ``fully_shard``.
        value_cache_bytes: With ``reuse="auto"``: the bytes of value caches all groups together
            may hold on each rank (one :class:`~ada_modules.strategies.adera_budget.ValueCacheBudget`
            shared by the instances; groups claim it in gather order).
        **kwargs: Arguments of :class:`AdERAAllGather` (``name`` is set to the module's name).

    Returns:
        The installed instances by module name (``""`` for ``module`` itself).

    Raises:
        RuntimeError: If this torch has no custom all-gather.
        ValueError: If no FSDP module is found.
    """
    require_custom_all_gather()
    from torch.distributed.fsdp import FSDPModule

    budget = budget_for(kwargs.get("reuse", "exponent"), value_cache_bytes)
    if budget is not None:
        kwargs["value_cache_budget"] = budget
    comms: dict[str, AdERAAllGather] = {}
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            comm = AdERAAllGather(name=name, **kwargs)
            sub.set_custom_all_gather(comm)
            comms[name] = comm
    if not comms:
        raise InputError("module has no FSDP module: apply fully_shard before installing AdERA")
    return comms


def verify_exponent_caches(
    comms: Iterable[AdERAAllGather],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Check that every rank of ``group`` holds the same exponent caches (collective).

    One ``all_reduce`` of two ``int64`` per instance: each rank's checksums and their negatives
    are reduced with MAX; the caches agree when the maximum equals the minimum everywhere.

    Args:
        comms: The instances of this rank, in the same order on every rank.
        group: Process group (default: the world).
        device: Device of the reduced tensor (default: that of the first cache, else CPU); CUDA
            for NCCL groups.

    Raises:
        RuntimeError: Naming the groups whose caches differ across ranks.
    """
    comms = list(comms)
    if device is None:
        caches = [c._cache for c in comms if c._cache is not None]
        device = caches[0].device if caches else "cpu"
    sums = torch.tensor([c.cache_checksum() for c in comms], dtype=torch.int64, device=device)
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = both[: len(comms)], -both[len(comms) :]
    bad = [c.name or "<root>" for c, hi, lo in zip(comms, highest, lowest, strict=True) if hi != lo]
    if bad:
        raise RuntimeError(
            f"AdERA exponent caches differ across ranks for groups {bad}; the weights of the next "
            "gathers would be wrong (reset the caches or resume from a checkpoint)"
        )
