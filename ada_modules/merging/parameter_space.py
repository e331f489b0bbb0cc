"""Merges computed on parameters alone: task arithmetic, TIES and DARE.

With task vectors ``τ_i = θ_i − θ_0`` and weights ``w_i`` (default 1), per tensor and entrywise:

- **Task arithmetic**: ``θ = θ_0 + Σ w_i τ_i`` (divided by ``Σ w_i`` with ``normalize``).
- **TIES**: trim each ``τ_i`` to its ``k = max(1, ⌊density·n + ½⌋)`` largest-magnitude entries
  (``τ̂_i``), elect the sign ``s = sign(Σ w_i τ̂_i)``, keep the entries that agree with it
  (``m_i = [sign(w_i τ̂_i) = s ≠ 0]``) and add their disjoint mean ``Σ w_i τ̂_i m_i / Σ w_i m_i``
  (``normalize``, where the denominator is not 0) or their sum ``Σ w_i τ̂_i m_i``.
- **DARE**: drop each entry with probability ``1 − density`` and rescale the kept ones by
  ``1 / density``, then add as task arithmetic, or with ``consensus="ties"`` elect signs and
  take the disjoint mean as TIES does.

Merges compute in float32 (float64 for float64 tensors) and return a new state dict with the base's
dtypes; integer and boolean tensors are copied from the base. The inputs are not modified.

Examples:
    >>> import torch
    >>> base = {"w": torch.tensor([0.0, 0.0, 0.0])}
    >>> a, b = {"w": torch.tensor([1.0, -2.0, 0.5])}, {"w": torch.tensor([3.0, 1.0, -0.25])}
    >>> task_arithmetic(base, [a, b])["w"].tolist()
    [4.0, -1.0, 0.25]
    >>> ties(base, [a, b], density=2 / 3)["w"].tolist()
    [2.0, -2.0, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from ada_modules.errors import InputError
from ada_modules.merging.state_dicts import (
    check_compatible,
    check_weights,
    compute_dtype,
    is_mergeable,
    retie,
    untie_members,
)

__all__ = ["dare", "task_arithmetic", "ties"]

StateDict = Mapping[str, torch.Tensor]


def _check_density(density: float) -> float:
    if isinstance(density, bool) or not isinstance(density, int | float) or not 0 < density <= 1:
        raise InputError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def _apply(
    base: StateDict,
    specialists: Sequence[StateDict],
    weights: Sequence[float] | None,
    combine: Callable[[list[torch.Tensor], list[float]], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """``θ_0 + combine(task vectors of one tensor, weights)`` for every floating tensor (a tied
    tensor once, under its first key)."""
    check_compatible(base, specialists)
    weights = check_weights(weights, len(specialists))
    tied, base, specialists = untie_members(base, specialists)
    merged = {}
    for name, tensor in base.items():
        if not is_mergeable(tensor):
            merged[name] = tensor.clone()
            continue
        dtype = compute_dtype(tensor)
        start = tensor.to(dtype)
        deltas = [s[name].to(dtype) - start for s in specialists]
        merged[name] = (start + combine(deltas, weights)).to(tensor.dtype)
    return retie(merged, tied)


def _weighted_sum(
    deltas: list[torch.Tensor], weights: list[float], normalize: bool
) -> torch.Tensor:
    total = sum(w * d for w, d in zip(weights, deltas, strict=True))
    if normalize:
        if sum(weights) == 0:
            raise InputError(f"normalize divides by the sum of the weights, which is 0: {weights}")
        total = total / sum(weights)
    return total


def _trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the ``max(1, ⌊density·n + ½⌋)`` largest-magnitude entries, zero the rest."""
    n = delta.numel()
    k = min(n, max(1, math.floor(density * n + 0.5)))
    if k == n:
        return delta
    flat = delta.flatten()
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[flat.abs().topk(k).indices] = True
    return torch.where(keep, flat, torch.zeros_like(flat)).view_as(delta)


def _disjoint(deltas: list[torch.Tensor], weights: list[float], normalize: bool) -> torch.Tensor:
    """TIES' sign election and disjoint merge of (already trimmed or dropped) task vectors."""
    weighted = [w * d for w, d in zip(weights, deltas, strict=True)]
    sign = torch.sign(sum(weighted))
    masks = [(torch.sign(x) == sign) & (sign != 0) for x in weighted]
    total = sum(
        torch.where(m, x, torch.zeros_like(x)) for m, x in zip(masks, weighted, strict=True)
    )
    if not normalize:
        return total
    mass = sum(m.to(total.dtype) * w for m, w in zip(masks, weights, strict=True))
    return torch.where(
        mass != 0, total / torch.where(mass != 0, mass, 1.0), torch.zeros_like(total)
    )


def task_arithmetic(
    base: StateDict,
    specialists: Sequence[StateDict],
    weights: Sequence[float] | None = None,
    normalize: bool = False,
) -> dict[str, torch.Tensor]:
    """``θ_0 + Σ w_i τ_i`` (divided by ``Σ w_i`` when ``normalize``).

    >>> import torch
    >>> base, tuned = {"w": torch.zeros(2)}, {"w": torch.tensor([2.0, 4.0])}
    >>> task_arithmetic(base, [tuned], weights=[0.5])["w"].tolist()
    [1.0, 2.0]
    """
    return _apply(base, specialists, weights, lambda d, w: _weighted_sum(d, w, normalize))


def ties(
    base: StateDict,
    specialists: Sequence[StateDict],
    weights: Sequence[float] | None = None,
    density: float = 0.5,
    normalize: bool = True,
) -> dict[str, torch.Tensor]:
    """TIES-merging: trim each task vector to its top ``density`` fraction by magnitude (per
    tensor), elect signs by the weighted sum, merge the agreeing entries (see the module).

    >>> import torch
    >>> base = {"w": torch.zeros(2)}
    >>> ties(base, [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, -1.0])}], density=1.0)["w"].tolist()
    [2.0, 2.0]
    """
    density = _check_density(density)
    return _apply(
        base,
        specialists,
        weights,
        lambda d, w: _disjoint([_trim(x, density) for x in d], w, normalize),
    )


def dare(
    base: StateDict,
    specialists: Sequence[StateDict],
    weights: Sequence[float] | None = None,
    density: float = 0.5,
    consensus: Literal["ties"] | None = None,
    rescale: bool = True,
    generator: torch.Generator | None = None,
    normalize: bool = False,
) -> dict[str, torch.Tensor]:
    """DARE: keep each task-vector entry with probability ``density`` (rescaled by
    ``1 / density`` when ``rescale``), then task arithmetic, or TIES' sign election and disjoint
    merge with ``consensus="ties"``.

    The masks are drawn with ``generator`` (on its device) tensor by tensor in the base's key
    order, specialists in order, so a seeded generator reproduces a merge.

    >>> import torch
    >>> base, tuned = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    >>> dare(base, [tuned], density=1.0)["w"].tolist()
    [1.0, 1.0, 1.0, 1.0]
    """
    density = _check_density(density)
    if consensus not in ("ties", None):
        raise InputError(f"consensus must be 'ties' or None, got {consensus!r}")

    def drop(delta: torch.Tensor) -> torch.Tensor:
        device = generator.device if generator is not None else delta.device
        keep = (
            torch.rand(delta.shape, generator=generator, device=device).to(delta.device) < density
        )
        kept = torch.where(keep, delta, torch.zeros_like(delta))
        return kept / density if rescale else kept

    def combine(deltas: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        dropped = [drop(d) for d in deltas]
        if consensus == "ties":
            return _disjoint(dropped, weights, normalize)
        return _weighted_sum(dropped, weights, normalize)

    return _apply(base, specialists, weights, combine)
