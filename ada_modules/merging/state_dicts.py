"""State dicts as the merge methods see them: checks, task vectors and linear layers.

A state dict is a ``Mapping[str, Tensor]``. A *linear layer* ``L`` is a 2-D ``L.weight`` of shape
``(out, in)`` with an optional 1-D ``L.bias`` of size ``out`` (a top-level layer has the keys
``weight`` and ``bias`` and the name ``""``). Its *augmented weight* is ``W~ = [W | b]``, shape
``(out, in + 1)`` with a bias, acting on the augmented input ``x~ = [x; 1]``. Only floating-point
tensors are merged; integer and boolean tensors (counters, masks) are copied from the base.

Examples:
    >>> import torch
    >>> base = {"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2), "steps": torch.tensor(0)}
    >>> tuned = {**base, "fc.weight": torch.ones(2, 3)}
    >>> linear_layers(base)
    ['fc']
    >>> task_vectors(base, [tuned])[0]["fc.weight"].sum().item()
    6.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ada_modules.errors import InputError

__all__ = [
    "augmented_weight",
    "check_compatible",
    "check_weights",
    "compute_dtype",
    "is_mergeable",
    "key",
    "linear_layers",
    "retie",
    "set_augmented_weight",
    "task_vectors",
    "tied_keys",
    "untie",
    "untie_members",
]

StateDict = Mapping[str, torch.Tensor]


def key(layer: str, leaf: str) -> str:
    """The state-dict key of ``leaf`` (``"weight"``, ``"bias"``) in ``layer``.

    >>> key("features.1", "weight"), key("", "bias")
    ('features.1.weight', 'bias')
    """
    return f"{layer}.{leaf}" if layer else leaf


def is_mergeable(tensor: torch.Tensor) -> bool:
    """Whether merges combine this tensor (floating point) or copy it from the base (the rest)."""
    return tensor.is_floating_point()


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype merges compute in: float64 for float64 tensors, float32 for narrower ones."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _describe(role: str, name: str | int) -> str:
    return f"{role} {name!r}" if isinstance(name, str) else f"{role} {name}"


def check_compatible(
    base: StateDict,
    others: Sequence[StateDict],
    names: Sequence[str] | None = None,
    *,
    role: str = "specialist",
) -> None:
    """Check that every state dict in ``others`` has the base's keys, shapes and dtypes.

    A key the base ties to an earlier one (:func:`tied_keys`) may be missing when the earlier key
    is there: a tied model saved with ``save_pretrained`` stores the tensor once.

    Args:
        base: The reference state dict.
        others: The state dicts to merge with it.
        names: A name per state dict for the messages (default: its index).
        role: What the others are, for the messages (``"specialist"``, ``"member"``).

    Raises:
        InputError: Naming the first mismatching model and key.

    Examples:
        >>> import torch
        >>> base = {"features.1.weight": torch.zeros(64, 64)}
        >>> other = {"features.1.weight": torch.zeros(64, 65)}
        >>> check_compatible(base, [other], names=["rot90"])
        Traceback (most recent call last):
        ...
        ada_modules.errors.InputError: specialist 'rot90': key 'features.1.weight' has shape (64, 65), the base has (64, 64)
    """
    if not isinstance(base, Mapping) or not base:
        raise InputError(f"the base must be a non-empty state dict, got {type(base).__name__}")
    if isinstance(others, Mapping) or not isinstance(others, Sequence):
        raise InputError(f"the {role}s must be a list of state dicts, got {type(others).__name__}")
    if names is not None and len(names) != len(others):
        raise InputError(f"{len(names)} names given for {len(others)} {role}s")
    for name, tensor in base.items():
        if not isinstance(tensor, torch.Tensor):
            raise InputError(
                f"the base: key {name!r} must be a tensor, got {type(tensor).__name__}"
            )
    tied = tied_keys(base)
    for index, other in enumerate(others):
        who = _describe(role, names[index] if names is not None else index)
        if not isinstance(other, Mapping):
            raise InputError(f"{who} must be a state dict, got {type(other).__name__}")
        for name, reference in base.items():
            if name not in other:
                if tied.get(name) in other:
                    continue  # a tie stored once, under its first key (as save_pretrained does)
                raise InputError(f"{who}: key {name!r} is missing (the base has it)")
            tensor = other[name]
            if not isinstance(tensor, torch.Tensor):
                raise InputError(
                    f"{who}: key {name!r} must be a tensor, got {type(tensor).__name__}"
                )
            if tensor.shape != reference.shape:
                raise InputError(
                    f"{who}: key {name!r} has shape {tuple(tensor.shape)}, the base has "
                    f"{tuple(reference.shape)}"
                )
            if tensor.dtype != reference.dtype:
                raise InputError(
                    f"{who}: key {name!r} has dtype {tensor.dtype}, the base has {reference.dtype}"
                )
        extra = [name for name in other if name not in base]
        if extra:
            raise InputError(f"{who}: key {extra[0]!r} is not in the base")


def check_weights(
    weights: Sequence[float] | None, count: int, what: str = "specialists"
) -> list[float]:
    """The merge weights as floats (default: 1 each), checked against the number of models.

    >>> check_weights(None, 2), check_weights([0.5, 1], 2)
    ([1.0, 1.0], [0.5, 1.0])
    """
    if weights is None:
        return [1.0] * count
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence):
        raise InputError(f"weights must be a list of numbers, got {weights!r}")
    if len(weights) != count:
        raise InputError(f"weights has {len(weights)} entries for {count} {what}: {list(weights)}")
    for value in weights:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(f"weights must be numbers, got {value!r} in {list(weights)}")
        if value != value or value in (float("inf"), float("-inf")):
            raise InputError(f"weights must be finite, got {value!r} in {list(weights)}")
    return [float(value) for value in weights]


def task_vectors(
    base: StateDict, specialists: Sequence[StateDict]
) -> list[dict[str, torch.Tensor]]:
    """``τ_i = θ_i − θ_0`` for every floating-point tensor (in float32, or float64 for float64).

    Integer and boolean tensors have no task vector: merges copy them from the base. A tie of
    the base stored once in a specialist (:func:`check_compatible`) has its vector under each key.
    """
    check_compatible(base, specialists)
    tied = tied_keys(base)
    return [
        {
            name: (tuned[name] if name in tuned else tuned[tied[name]]).to(compute_dtype(tensor))
            - tensor.to(compute_dtype(tensor))
            for name, tensor in base.items()
            if is_mergeable(tensor)
        }
        for tuned in specialists
    ]


def linear_layers(state_dict: StateDict) -> list[str]:
    """Names ``L`` with a 2-D floating ``L.weight`` (and, if any, a 1-D ``L.bias`` of its size).

    The test is on shapes alone, so an embedding table counts too; the merges that use
    activation statistics only treat layers that have statistics.
    """
    layers = []
    for name, tensor in state_dict.items():
        if not (name == "weight" or name.endswith(".weight")):
            continue
        if tensor.ndim != 2 or not is_mergeable(tensor):
            continue
        layer = name[: -len("weight")].rstrip(".")
        bias = state_dict.get(key(layer, "bias"))
        if bias is not None and (bias.ndim != 1 or bias.shape[0] != tensor.shape[0]):
            continue
        layers.append(layer)
    return layers


def augmented_weight(state_dict: StateDict, layer: str) -> torch.Tensor:
    """``W~ = [W | b]`` in float64 (``W`` alone when the layer has no bias).

    >>> import torch
    >>> augmented_weight({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}, "").shape
    torch.Size([2, 4])
    """
    weight = state_dict[key(layer, "weight")].to(torch.float64)
    bias = state_dict.get(key(layer, "bias"))
    if bias is None:
        return weight
    return torch.cat([weight, bias.to(device=weight.device, dtype=torch.float64)[:, None]], dim=1)


def set_augmented_weight(
    target: dict[str, torch.Tensor], reference: StateDict, layer: str, value: torch.Tensor
) -> None:
    """Write ``W~`` back into ``target`` as ``L.weight`` (and ``L.bias``), in ``reference``'s dtypes."""
    weight = reference[key(layer, "weight")]
    target[key(layer, "weight")] = value[:, : weight.shape[1]].to(weight.dtype).contiguous()
    bias_key = key(layer, "bias")
    if bias_key in reference:
        target[bias_key] = value[:, weight.shape[1]].to(reference[bias_key].dtype).contiguous()


def _storage(tensor: torch.Tensor) -> tuple:
    """Where a tensor's values live: equal for views of the same memory with the same layout."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def tied_keys(state_dict: StateDict) -> dict[str, str]:
    """Keys whose tensor is the same tensor as an earlier key's (tied weights, e.g. a language
    model's ``lm_head.weight`` and ``model.embed_tokens.weight``): ``{later: first}``.

    Examples:
        >>> shared = torch.zeros(3, 2)
        >>> tied_keys({"embed.weight": shared, "head.weight": shared, "b": torch.zeros(3)})
        {'head.weight': 'embed.weight'}
    """
    first: dict[tuple, str] = {}
    tied = {}
    for name, tensor in state_dict.items():
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        identity = _storage(tensor)
        if identity in first:
            tied[name] = first[identity]
        else:
            first[identity] = name
    return tied


def untie(
    state: Mapping[str, Any], tied: Mapping[str, str], *, layers: bool = False
) -> dict[str, Any]:
    """``state`` without the later keys of ``tied`` (from :func:`tied_keys`); with ``layers``,
    ``state`` is per layer (activation statistics) and loses the layers whose weight is one.

    Examples:
        >>> untie({"embed.weight": 1, "head.weight": 1}, {"head.weight": "embed.weight"})
        {'embed.weight': 1}
        >>> untie({"embed": 1, "head": 2}, {"head.weight": "embed.weight"}, layers=True)
        {'embed': 1}
    """
    if layers:
        return {layer: value for layer, value in state.items() if key(layer, "weight") not in tied}
    return {name: value for name, value in state.items() if name not in tied}


def untie_members(
    base: StateDict,
    members: Sequence[StateDict],
    names: Sequence[str | int] | None = None,
    *,
    role: str = "specialist",
) -> tuple[dict[str, str], dict[str, torch.Tensor], Sequence[StateDict]]:
    """The ties of ``base`` (:func:`tied_keys`), and ``base`` and ``members`` without their later
    keys, so that a merge treats each tied tensor once (then :func:`retie` shares the result).
    ``names`` and ``role`` name the members in messages, as for :func:`check_compatible`.

    Raises:
        InputError: If a member holds different tensors under the keys of one of the base's ties
            (it was trained untied; merged into the tied base, one of them would be lost).

    Examples:
        >>> shared = torch.zeros(2)
        >>> model = {"e": shared, "h": shared}
        >>> tied, base, members = untie_members(model, [model])
        >>> tied, list(base), [list(m) for m in members]
        ({'h': 'e'}, ['e'], [['e']])
    """
    tied = tied_keys(base)
    if not tied:
        return tied, dict(base), members
    if isinstance(members, Mapping) or not isinstance(members, Sequence):
        # not a list of state dicts: the merge's own checks name it
        return tied, untie(base, tied), members
    for index, member in enumerate(members):
        if not isinstance(member, Mapping):
            continue  # check_compatible names it
        for later, first in tied.items():
            a, b = member.get(later), member.get(first)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not _same(a, b):
                who = _describe(role, index if names is None else names[index])
                raise InputError(
                    f"{who}: keys {later!r} and {first!r} hold different tensors, but the base "
                    "ties them (one tensor); merge models that are tied alike"
                )
    untied = [untie(member, tied) if isinstance(member, Mapping) else member for member in members]
    return tied, untie(base, tied), untied


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values (NaN equal to NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if _storage(a) == _storage(b):  # one tensor under two keys (state_dict() makes new objects)
        return True
    return bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b).all())


def retie(merged: dict[str, torch.Tensor], tied: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """Put back the later keys of ``tied`` into ``merged``, each the very tensor of its first key.

    >>> shared = retie({"embed.weight": torch.ones(2)}, {"head.weight": "embed.weight"})
    >>> shared["head.weight"] is shared["embed.weight"]
    True
    """
    for later, first in tied.items():
        merged[later] = merged[first]
    return merged
