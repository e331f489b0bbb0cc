"""Fisher merging (Matena & Raffel, 2022): a per-entry average of the members' parameters weighted
by their diagonal Fisher information,

    ``θ = Σ_i w_i (F_i + eps) θ_i / Σ_i w_i (F_i + eps)``.

Adding ``eps`` to every Fisher value (a floor, as in the paper's code) avoids 0/0 and makes entries
where every ``F_i`` is 0 the ``w``-weighted mean of the members. Fisher values much smaller than
``eps`` are therefore close to ignored: pick ``eps`` below their scale. Floating tensors without a
Fisher value in any member (buffers such as running means) also get the weighted mean; integer
and boolean tensors come from the first member. Diagonal Fishers come from
:func:`~ada_modules.merging.collect_fisher`.

Examples:
    >>> import torch
    >>> a, b = {"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([3.0, 3.0])}
    >>> fa, fb = {"w": torch.tensor([3.0, 0.0])}, {"w": torch.tensor([1.0, 0.0])}
    >>> fisher_merge([a, b], [fa, fb], eps=0.0)["w"].tolist()
    [1.5, nan]
    >>> fisher_merge([a, b], [fa, fb])["w"].tolist()
    [1.5, 2.0]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ada_modules.errors import InputError
from ada_modules.merging.state_dicts import (
    check_compatible,
    check_weights,
    is_mergeable,
    retie,
    untie,
    untie_members,
)

__all__ = ["fisher_merge"]

StateDict = Mapping[str, torch.Tensor]


def _check_fishers(members: Sequence[StateDict], fishers: Sequence[StateDict]) -> None:
    if isinstance(fishers, Mapping) or len(fishers) != len(members):
        raise InputError(f"fishers must be a list with one Fisher dict per member ({len(members)})")
    reference = members[0]
    for index, fisher in enumerate(fishers):
        if not isinstance(fisher, Mapping):
            raise InputError(f"fishers[{index}] must be a dict of tensors, got {fisher!r}")
        for name, value in fisher.items():
            if name not in reference or not is_mergeable(reference[name]):
                raise InputError(
                    f"fishers[{index}]: key {name!r} is not a floating tensor of the members"
                )
            if not isinstance(value, torch.Tensor) or value.shape != reference[name].shape:
                shape = (
                    tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                )
                raise InputError(
                    f"fishers[{index}]: key {name!r} has shape {shape}, the parameter has "
                    f"{tuple(reference[name].shape)}"
                )
            if not bool(torch.isfinite(value).all()) or bool((value < 0).any()):
                raise InputError(
                    f"fishers[{index}]: key {name!r} has negative or non-finite values"
                )
    for name in reference:
        present = [name in fisher for fisher in fishers]
        if any(present) and not all(present):
            raise InputError(
                f"fishers[{present.index(False)}] lacks key {name!r}, which others have"
            )


def fisher_merge(
    members: Sequence[StateDict],
    fishers: Sequence[StateDict],
    weights: Sequence[float] | None = None,
    eps: float = 1e-8,
) -> dict[str, torch.Tensor]:
    """``Σ w_i (F_i + eps) θ_i / Σ w_i (F_i + eps)`` entrywise, in float64.

    Args:
        members: The state dicts to merge (may include the base, with its Fisher on core data).
        fishers: Per member, diagonal Fisher values for (some of) its floating tensors.
        weights: Non-negative weight per member (default 1), not all 0.
        eps: Floor added to every Fisher value, >= 0.

    Tied weights (one tensor under several keys of the first member, e.g. a language model's
    embedding and output head) are merged once, under their first key (with the Fisher values of
    that key, as ``collect_fisher`` names a tied parameter, or else of the later key), and every
    key of the tie gets the one merged tensor.

    Raises:
        InputError: Incompatible members or Fisher dicts, bad weights or ``eps``, or a member not
            tied as the first one is.
    """
    if isinstance(members, Mapping) or not isinstance(members, Sequence) or not members:
        raise InputError("members must be a non-empty list of state dicts")
    # name the others by their index in members (check_compatible would count from 0)
    check_compatible(members[0], members[1:], names=list(range(1, len(members))), role="member")
    weights = check_weights(weights, len(members), "members")
    if any(w < 0 for w in weights) or sum(weights) == 0:
        raise InputError(f"weights must be >= 0 and not all 0, got {weights}")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps >= 0:
        raise InputError(f"eps must be a number >= 0, got {eps!r}")
    _check_fishers(members, fishers)
    names = list(range(1, len(members)))
    tied, reference, others = untie_members(members[0], members[1:], names=names, role="member")
    members = [reference, *others]
    # a tie's Fisher values under its later key only (not as collect_fisher names it) still count
    fishers = [
        {
            **{first: f[later] for later, first in tied.items() if later in f and first not in f},
            **untie(f, tied),
        }
        for f in fishers
    ]
    merged = {}
    for name, tensor in members[0].items():
        if not is_mergeable(tensor):
            merged[name] = tensor.clone()
            continue
        values = [m[name].to(torch.float64) for m in members]
        if name in fishers[0]:
            scales = [
                w * (f[name].to(values[0]) + eps) for w, f in zip(weights, fishers, strict=True)
            ]
        else:
            scales = [torch.full_like(values[0], w) for w in weights]
        numerator = sum(s * v for s, v in zip(scales, values, strict=True))
        merged[name] = (numerator / sum(scales)).to(tensor.dtype)
    return retie(merged, tied)
