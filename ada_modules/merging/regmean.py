"""RegMean (Jin et al., 2022, arXiv 2212.09849): merge linear layers so that the merged layer's
outputs match each member's on that member's own inputs, in the least-squares sense.

For a linear layer with augmented weights ``W~_i`` (``[W | b]``) and Gram matrices
``G_i = Σ x~ x~ᵀ`` of each member's inputs (``count_i · covariance_i``), the minimiser of
``Σ_i ‖X~_i W~ᵀ − X~_i W~_iᵀ‖²`` is

    ``W~ᵀ = (Σ_i G_i)⁻¹ Σ_i G_i W~_iᵀ``.

As in the paper, the off-diagonal entries of each ``G_i`` are scaled by ``alpha`` (which keeps
the sum invertible for ``alpha < 1``); ``ridge`` adds ``ridge · mean(diag(Σ G_i)) · I``. Layers
without statistics in every member, and all other floating tensors, get the plain mean of the
members; integer and boolean tensors come from the base.

The base model may itself be a member (with statistics of its inputs on core data): the merge
then also keeps the base's behaviour on that data, weighted by its sample count.

Examples:
    >>> import torch
    >>> from ada_modules.merging.stats import ActivationStats
    >>> x = torch.randn(32, 3, dtype=torch.float64)
    >>> member = {"weight": torch.randn(2, 3)}
    >>> stats = {"": ActivationStats(x.T @ x, 32, has_bias=False)}
    >>> merged = regmean(member, [member], [stats])
    >>> torch.allclose(merged["weight"], member["weight"], atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ada_modules.errors import InputError
from ada_modules.merging.state_dicts import (
    augmented_weight,
    check_compatible,
    compute_dtype,
    is_mergeable,
    linear_layers,
    retie,
    set_augmented_weight,
    untie,
    untie_members,
)
from ada_modules.merging.stats import (
    ActivationStats,
    check_stats,
    check_stats_fit,
    require_layers_with_stats,
)

__all__ = ["regmean"]

StateDict = Mapping[str, torch.Tensor]


def _scaled_gram(stats: ActivationStats, alpha: float, device: torch.device) -> torch.Tensor:
    gram = stats.second_moment_sum.to(device)
    diagonal = torch.diag(torch.diagonal(gram))
    return alpha * gram + (1 - alpha) * diagonal


def regmean(
    base: StateDict,
    members: Sequence[StateDict],
    member_stats: Sequence[Mapping[str, ActivationStats]],
    alpha: float = 0.5,
    ridge: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Merge ``members`` with RegMean; ``base`` gives the keys, dtypes and integer tensors.

    Args:
        base: The reference state dict (its floating tensors are not merged unless it is also
            one of the members).
        members: The state dicts to merge (may include the base).
        member_stats: Per member, :class:`~ada_modules.merging.ActivationStats` of its linear
            layers' inputs on its own data.
        alpha: Scale of the Gram matrices' off-diagonal entries, in ``[0, 1]``.
        ridge: Adds ``ridge · mean(diag) · I`` to the summed Gram matrix.

    Tied weights (one tensor under several keys of ``base``, e.g. a language model's embedding
    and output head) are merged once, under their first key, as :func:`~.recipe.merge` does:
    the statistics of a layer whose weight is a later key are not used, and every key of the tie
    gets the one merged tensor.

    Raises:
        InputError: Incompatible state dicts, statistics that do not fit a layer or are not
            PSD, a singular summed Gram matrix (naming the layer), or a member not tied as the
            base is.
    """
    check_compatible(base, members, role="member")
    if not members:
        raise InputError("regmean needs at least one member")
    if isinstance(member_stats, Mapping) or len(member_stats) != len(members):
        raise InputError(
            f"member_stats must be a list with one statistics mapping per member ({len(members)})"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
        raise InputError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(ridge, bool) or not isinstance(ridge, int | float) or not ridge >= 0:
        raise InputError(f"ridge must be a number >= 0, got {ridge!r}")
    for index, stats in enumerate(member_stats):
        check_stats(stats, ridge, count=False)
        check_stats_fit(base, stats, f"member {index}'s")
    tied, base, members = untie_members(base, members, role="member")
    member_stats = [untie(stats, tied, layers=True) for stats in member_stats]

    merged = {}
    for name, tensor in base.items():
        if not is_mergeable(tensor):
            merged[name] = tensor.clone()
            continue
        dtype = compute_dtype(tensor)
        mean = sum(m[name].to(dtype) for m in members) / len(members)
        merged[name] = mean.to(tensor.dtype)

    layers = [layer for layer in linear_layers(base) if all(layer in s for s in member_stats)]
    require_layers_with_stats(layers, "regmean")
    for layer in layers:
        weights = [augmented_weight(m, layer) for m in members]
        device = weights[0].device
        grams = [_scaled_gram(stats[layer], alpha, device) for stats in member_stats]
        total = sum(grams)
        if ridge > 0:
            total = total + ridge * torch.diagonal(total).mean() * torch.eye(
                total.shape[0], dtype=total.dtype, device=device
            )
        factor, info = torch.linalg.cholesky_ex(total)
        # A rank-deficient matrix rarely fails Cholesky in floating point: it gets a pivot at
        # rounding level instead, so treat pivots that small as singular too.
        tiny = total.shape[0] * torch.finfo(total.dtype).eps * torch.diagonal(total).max()
        if int(info) != 0 or bool(torch.diagonal(factor).min() ** 2 <= tiny):
            samples = sum(stats[layer].count for stats in member_stats)
            dim = total.shape[0]
            few = f"; at least {dim} samples are needed" if samples < dim else ""
            raise InputError(
                f"layer {layer!r}: the members' summed Gram matrix is singular ({samples} samples "
                f"in all for {dim} inputs{few}; or collinear inputs, or inputs that are always "
                f"zero, such as dead ReLU units); set ridge > 0 (alpha < 1 helps unless an input is "
                f"always zero), got ridge={ridge}, alpha={alpha}"
            )
        rhs = sum(g @ w.T for g, w in zip(grams, weights, strict=True))
        solution = torch.cholesky_solve(rhs, factor)
        set_augmented_weight(merged, base, layer, solution.T)
    return retie(merged, tied)
