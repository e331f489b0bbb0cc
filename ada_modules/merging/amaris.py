"""AMARIS: add a specialist's change to a linear layer only along the input directions where the
specialist's inputs vary much more than the base's, under a budget on how far the base's outputs
may move.

Reconstruction (our reading of the technique, with the notation of :mod:`.state_dicts`): take a
linear layer with base weight ``W~₀`` (``[W | b]``) and a specialist's change ``ΔW~``. Let
``Σ_b = E_base[x~ x~ᵀ]`` be the second moment of the layer's inputs on core (base) data and
``Σ_s`` that on the specialist's domain.

1. *Generalized eigenproblem.* Solve ``Σ_s u = γ Σ_b u`` (:func:`generalized_eigh`): the columns
   ``u_j`` of ``U`` satisfy ``Uᵀ Σ_b U = I`` and ``Uᵀ Σ_s U = diag(γ)``, with ``γ`` sorted
   descending. In the coordinates ``c = Uᵀ x~``, base inputs are white (``E_b[c cᵀ] = I``) and
   specialist inputs have variance ``γ_j`` along coordinate ``j``: ``γ_j`` is how much the
   specialist's inputs use that direction per unit of the base's use.
2. *Decomposition of the change.* Because ``U Uᵀ Σ_b = I``, every input splits as
   ``x~ = Σ_j (Σ_b u_j)(u_jᵀ x~)``, so ``ΔW~ x~ = Σ_j v_j c_j`` with ``v_j = ΔW~ Σ_b u_j``. Let
   ``a_j = ‖v_j‖²``.
3. *Gate.* Keep the change only along chosen coordinates: ``ΔW~ P`` with
   ``P = Σ_b U diag(g) Uᵀ``, gates ``g_j ∈ [0, 1]`` (for 0/1 gates ``P`` is the oblique projector
   onto the chosen directions, along the others). As the coordinates are uncorrelated under
   both distributions, the cross terms vanish:

   - base-output deviation ``E_b‖ΔW~ P x~‖² = Σ_j g_j² a_j``,
   - specialist capture ``E_s‖ΔW~ P x~‖² = Σ_j g_j² γ_j a_j`` (``Σ_j γ_j a_j`` for the full
     change).
4. *Budget.* Maximise the capture subject to a deviation of at most ``budget`` times the base's
   output energy ``E_b‖W~₀ x~‖² = tr(W~₀ Σ_b W~₀ᵀ)`` (:func:`select_directions`). With
   ``t_j = g_j² a_j ∈ [0, a_j]`` this is a fractional knapsack (maximise ``Σ γ_j t_j`` subject to
   ``Σ t_j ≤ B``), which the greedy choice by descending ``γ`` solves exactly: whole directions
   while they fit, then one fractional gate ``g = √(remaining / a_j)`` that spends the budget
   exactly, then none. Directions with ``γ_j ≤ min_gamma`` (default 1: the specialist's inputs
   use them no more than the base's) are never chosen.
5. *Merge.* ``W~ = W~₀ + s · Σ_i ΔW~_i P_i`` (``ΔW~_i`` scaled by the specialist's weight before
   gating), each of ``n`` specialists getting ``budget / n``. The deviations of the gated changes
   do not simply add up (there are cross terms between specialists), so the summed change
   ``D = Σ_i ΔW~_i P_i`` is checked as a whole: if its predicted deviation ``tr(D Σ_b Dᵀ)``
   exceeds the budget, it is scaled by ``s = √(budget / predicted) < 1`` so that it meets the
   budget exactly (``s = 1`` otherwise, and always for one specialist).

With ``ridge > 0``, ``Σ_b`` is regularised as ``Σ_b + ridge · (tr(Σ_b) / d) · I`` for the
eigenproblem and the predicted deviations (which are then over-estimates of the deviation under
``Σ_b``); the base energy uses ``Σ_b`` itself. The default is no ridge: a ``Σ_b`` that is not
positive definite (too few samples, inputs that are always zero) is an error that says so. :func:`output_deviation` measures the realised relative deviation
under any statistics, e.g. held-out core data.

Examples:
    >>> import torch
    >>> from ada_modules.merging.stats import ActivationStats
    >>> g = torch.Generator().manual_seed(0)
    >>> base = {"fc.weight": torch.randn(3, 4, generator=g)}
    >>> tuned = {"fc.weight": base["fc.weight"] + torch.randn(3, 4, generator=g)}
    >>> x = torch.randn(64, 4, generator=g, dtype=torch.float64)
    >>> core = {"fc": ActivationStats(x.T @ x, 64, has_bias=False)}
    >>> shifted = {"fc": ActivationStats(4 * x.T @ x, 64, has_bias=False)}
    >>> merged, report = amaris(base, [tuned], [shifted], core, budget=0.05)
    >>> deviation = output_deviation(base, merged, core)["fc"]
    >>> bool(deviation <= 0.05 * (1 + 1e-6)), report["layers"]["fc"]["specialists"][0]["rank"] > 0
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ada_modules.checks import is_finite_real
from ada_modules.errors import InputError
from ada_modules.merging.parameter_space import task_arithmetic
from ada_modules.merging.state_dicts import (
    augmented_weight,
    check_compatible,
    check_weights,
    linear_layers,
    retie,
    set_augmented_weight,
    untie_members,
)
from ada_modules.merging.stats import (
    ActivationStats,
    check_stats,
    check_stats_fit,
    require_layers_with_stats,
)

__all__ = [
    "LayerReport",
    "amaris",
    "amaris_layer",
    "generalized_eigh",
    "output_deviation",
    "select_directions",
]

StateDict = Mapping[str, torch.Tensor]


@dataclass
class LayerReport:
    """What AMARIS did to one layer for one specialist (JSON-serialisable with ``asdict``).

    Attributes:
        rank: Number of directions kept (gate > 0).
        gammas: Their generalized eigenvalues ``γ``, descending.
        gates: Their gates (1, except possibly the last, fractional one).
        predicted_deviation: ``Σ g² a``, the predicted ``E_b‖ΔW~ P x~‖²``.
        deviation_budget: The allowed deviation, ``budget · base_energy``.
        base_energy: ``tr(W~₀ Σ_b W~₀ᵀ) = E_b‖W~₀ x~‖²``.
        capture_fraction: ``Σ g² γ a / Σ γ a``: the share of the full change's specialist output
            energy that is kept (1 when the change has none).
    """

    rank: int
    gammas: list[float]
    gates: list[float]
    predicted_deviation: float
    deviation_budget: float
    base_energy: float
    capture_fraction: float


def _square(name: str, matrix: torch.Tensor) -> torch.Tensor:
    if (
        not isinstance(matrix, torch.Tensor)
        or matrix.ndim != 2
        or matrix.shape[0] != matrix.shape[1]
    ):
        shape = tuple(matrix.shape) if isinstance(matrix, torch.Tensor) else type(matrix).__name__
        raise InputError(f"{name} must be a square matrix, got {shape}")
    matrix = matrix.to(torch.float64)
    if not bool(torch.isfinite(matrix).all()):
        raise InputError(f"{name} has non-finite entries")
    return (matrix + matrix.T) / 2


def generalized_eigh(
    sigma_s: torch.Tensor, sigma_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``Σ_s u = γ Σ_b u`` for symmetric ``Σ_s`` and symmetric positive definite ``Σ_b``.

    With ``Σ_b = L Lᵀ`` (Cholesky) it diagonalises ``L⁻¹ Σ_s L⁻ᵀ = V diag(γ) Vᵀ`` and returns
    ``U = L⁻ᵀ V``, in float64, ``γ`` descending: ``Uᵀ Σ_b U = I`` and ``Uᵀ Σ_s U = diag(γ)``.

    Raises:
        InputError: Shapes that differ or are not square, non-finite entries, or a ``Σ_b`` that
            is not positive definite.

    Examples:
        >>> import torch
        >>> gammas, u = generalized_eigh(torch.diag(torch.tensor([2.0, 6.0])), 2 * torch.eye(2))
        >>> gammas.round(decimals=6).tolist()
        [3.0, 1.0]
        >>> torch.allclose(u.T @ (2 * torch.eye(2, dtype=torch.float64)) @ u, torch.eye(2, dtype=torch.float64))
        True
    """
    sigma_s, sigma_b = _square("sigma_s", sigma_s), _square("sigma_b", sigma_b)
    if sigma_s.shape != sigma_b.shape:
        raise InputError(
            f"sigma_s has shape {tuple(sigma_s.shape)}, sigma_b has {tuple(sigma_b.shape)}"
        )
    sigma_s = sigma_s.to(sigma_b.device)
    factor, info = torch.linalg.cholesky_ex(sigma_b)
    if int(info) != 0:
        raise InputError(
            f"sigma_b must be positive definite, but its Cholesky factorisation fails at column "
            f"{int(info) - 1} of {sigma_b.shape[0]}: the base's inputs span fewer directions "
            f"than the layer has (too few samples, or inputs that are constant, always zero or "
            f"drawn from few distinct vectors); set ridge > 0 to regularise, e.g. 1e-6"
        )
    half = torch.linalg.solve_triangular(factor, sigma_s, upper=False)  # L⁻¹ Σ_s
    whitened = torch.linalg.solve_triangular(factor, half.T, upper=False)  # L⁻¹ Σ_s L⁻ᵀ
    gammas, vectors = torch.linalg.eigh((whitened + whitened.T) / 2)
    gammas, vectors = gammas.flip(0), vectors.flip(1)
    return gammas, torch.linalg.solve_triangular(factor.T, vectors, upper=True)


def select_directions(
    gammas: torch.Tensor, costs: torch.Tensor, budget_abs: float, min_gamma: float = 1.0
) -> torch.Tensor:
    """Gates ``g ∈ [0, 1]`` maximising ``Σ g² γ a`` subject to ``Σ g² a ≤ budget_abs``.

    Greedy by descending ``γ`` over the directions with ``γ > min_gamma`` and a cost ``a > 0``:
    gate 1 while the cumulative cost fits, then ``√(remaining / a)`` for the first that does not
    (the budget is then met exactly), then 0. This is optimal (a fractional knapsack in
    ``t = g² a``). Directions with zero cost carry no change and get gate 0.

    Examples:
        >>> gates = select_directions(torch.tensor([4.0, 3.0, 2.0, 0.5]), torch.tensor([1.0, 1.0, 4.0, 1.0]), 3.0)
        >>> gates.tolist()
        [1.0, 1.0, 0.5, 0.0]
    """
    if (
        isinstance(budget_abs, bool)
        or not isinstance(budget_abs, int | float)
        or not budget_abs >= 0
    ):
        raise InputError(f"budget_abs must be a number >= 0, got {budget_abs!r}")
    if gammas.ndim != 1 or costs.shape != gammas.shape:
        raise InputError(
            f"gammas and costs must be 1-D of one length, got {tuple(gammas.shape)} and "
            f"{tuple(costs.shape)}"
        )
    gamma_list = gammas.to(torch.float64).tolist()
    cost_list = costs.to(torch.float64).tolist()
    gates = [0.0] * len(gamma_list)
    remaining = float(budget_abs)
    for j in sorted(range(len(gamma_list)), key=lambda i: -gamma_list[i]):
        if gamma_list[j] <= min_gamma or remaining <= 0:
            break
        cost = cost_list[j]
        if cost <= 0:
            continue
        if cost <= remaining:
            gates[j], remaining = 1.0, remaining - cost
        else:
            gates[j], remaining = math.sqrt(remaining / cost), 0.0
    return torch.tensor(gates, dtype=torch.float64, device=gammas.device)


def _ridged(sigma: torch.Tensor, ridge: float) -> torch.Tensor:
    if ridge == 0:
        return sigma
    scale = ridge * torch.trace(sigma) / sigma.shape[0]
    return sigma + scale * torch.eye(sigma.shape[0], dtype=sigma.dtype, device=sigma.device)


def _energy(weight: torch.Tensor, sigma: torch.Tensor) -> float:
    """``tr(W Σ Wᵀ)``."""
    return float(((weight @ sigma) * weight).sum())


def amaris_layer(
    delta: torch.Tensor,
    sigma_s: torch.Tensor,
    sigma_b: torch.Tensor,
    budget: float,
    base_weight: torch.Tensor,
    *,
    min_gamma: float = 1.0,
    ridge: float = 0.0,
) -> tuple[torch.Tensor, LayerReport]:
    """Gate one specialist's change ``delta`` (``(out, d)``, augmented) of one layer.

    Returns ``ΔW~ P`` (float64) and its :class:`LayerReport`; the predicted base-output deviation
    is at most ``budget · tr(W~₀ Σ_b W~₀ᵀ)``. ``ridge`` regularises ``Σ_b`` (see the module).
    """
    delta = delta.to(torch.float64)
    base_weight = base_weight.to(device=delta.device, dtype=torch.float64)
    sigma_b = _square("sigma_b", sigma_b).to(delta.device)
    if delta.ndim != 2 or delta.shape != base_weight.shape or delta.shape[1] != sigma_b.shape[0]:
        raise InputError(
            f"delta {tuple(delta.shape)} and base_weight {tuple(base_weight.shape)} must be "
            f"(out, d) with d = {sigma_b.shape[0]}, the covariances' size"
        )
    regularised = _ridged(sigma_b, ridge)
    gammas, directions = generalized_eigh(sigma_s, regularised)
    columns = delta @ (regularised @ directions)  # v_j = ΔW~ Σ_b u_j
    costs = (columns**2).sum(0)  # a_j
    base_energy = _energy(base_weight, sigma_b)
    budget_abs = budget * base_energy
    gates = select_directions(gammas, costs, budget_abs, min_gamma)
    projected = (columns * gates) @ directions.T
    full_capture = float((gammas * costs).sum())
    kept = gates > 0
    report = LayerReport(
        rank=int(kept.sum()),
        gammas=gammas[kept].tolist(),
        gates=gates[kept].tolist(),
        predicted_deviation=float((gates**2 * costs).sum()),
        deviation_budget=budget_abs,
        base_energy=base_energy,
        capture_fraction=(
            float((gates**2 * gammas * costs).sum()) / full_capture if full_capture > 0 else 1.0
        ),
    )
    return projected, report


def _check_number(name: str, value: object, low: float, high: float | None = None) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if not ok or not (low < value and (high is None or value <= high)):
        allowed = f"in ({low:g}, {high:g}]" if high is not None else f"> {low:g}"
        raise InputError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _layers_with_stats(
    base: StateDict,
    specialist_stats: Sequence[Mapping[str, ActivationStats]],
    base_stats: Mapping[str, ActivationStats],
) -> list[str]:
    """Linear layers with statistics, checking every specialist has the same layers as the base."""
    for index, stats in enumerate(specialist_stats):
        for layer in base_stats:
            if layer not in stats:
                raise InputError(
                    f"layer {layer!r} has base statistics but none for specialist {index}"
                )
        for layer in stats:
            if layer not in base_stats:
                raise InputError(
                    f"layer {layer!r} has statistics for specialist {index} but not the base"
                )
    return [layer for layer in linear_layers(base) if layer in base_stats]


def amaris(
    base: StateDict,
    specialists: Sequence[StateDict],
    specialist_stats: Sequence[Mapping[str, ActivationStats]],
    base_stats: Mapping[str, ActivationStats],
    budget: float = 0.05,
    ridge: float = 0.0,
    min_gamma: float = 1.0,
    weights: Sequence[float] | None = None,
    other: Literal["base", "task_arithmetic"] = "task_arithmetic",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Merge specialists into the base with AMARIS (see the module); returns the merged state
    dict (the base's dtypes) and a JSON-serialisable report.

    Args:
        base: The base state dict.
        specialists: State dicts fine-tuned from it.
        specialist_stats: Per specialist, input statistics on its domain (of the specialist's or
            the base's activations); only positive semi-definiteness is required.
        base_stats: Input statistics of the base on core data; the layers they name are the ones
            gated, and every specialist must have statistics for the same layers.
        budget: Allowed relative base-output deviation per layer, in ``(0, 1]``, shared equally
            among the specialists.
        ridge: ``Σ_b + ridge · (tr(Σ_b) / d) · I``.
        min_gamma: Directions with ``γ ≤ min_gamma`` are never kept.
        weights: Scale of each specialist's change (default 1), applied before gating.
        other: Tensors not gated (norms, embeddings, layers without statistics): ``"base"``
            keeps the base's, ``"task_arithmetic"`` takes ``θ_0 + Σ w_i τ_i``.

    Tied weights (one tensor under several keys of ``base``, e.g. a language model's embedding
    and output head) are merged once, under their first key, as :func:`~.recipe.merge` does:
    the statistics of a layer whose weight is a later key are ignored, and every key of the tie
    gets the one merged tensor.

    Returns:
        ``(merged, report)`` with report ``{"method": "amaris", "budget", "ridge", "min_gamma",
        "other", "layers": {name: {"specialists": [LayerReport as dict, ...],
        "predicted_deviation_total", "deviation_budget", "base_energy", "scale"}}}``, plus
        ``"tied": {later key: first key}`` when ``base`` has tied weights.
    """
    budget = _check_number("budget", budget, 0.0, 1.0)
    if isinstance(ridge, bool) or not isinstance(ridge, int | float) or not ridge >= 0:
        raise InputError(f"ridge must be a number >= 0, got {ridge!r}")
    if not is_finite_real(min_gamma):
        raise InputError(f"min_gamma must be a finite number, got {min_gamma!r}")
    if other not in ("base", "task_arithmetic"):
        raise InputError(f"other must be 'base' or 'task_arithmetic', got {other!r}")
    check_compatible(base, specialists)
    if not specialists:
        raise InputError("amaris needs at least one specialist")
    weights = check_weights(weights, len(specialists))
    if isinstance(specialist_stats, Mapping) or len(specialist_stats) != len(specialists):
        raise InputError(
            f"specialist_stats must be a list with one statistics mapping per specialist "
            f"({len(specialists)})"
        )
    if not isinstance(base_stats, Mapping):
        raise InputError(
            f"base_stats must be a mapping of layer name to ActivationStats, got {base_stats!r}"
        )
    check_stats(base_stats, ridge)
    check_stats_fit(base, base_stats, "the base's")
    for index, stats in enumerate(specialist_stats):
        check_stats(stats, count=False)
        check_stats_fit(base, stats, f"specialist {index}'s")
    # Tied weights are one tensor under several keys: merge it once, under its first key (a layer
    # whose weight is a later key is not gated), then share the result.
    tied, base, specialists = untie_members(base, specialists)
    layers = _layers_with_stats(base, specialist_stats, base_stats)
    require_layers_with_stats(layers, "amaris")

    if other == "task_arithmetic":
        merged = task_arithmetic(base, specialists, weights)
    else:
        merged = {name: tensor.clone() for name, tensor in base.items()}
    share = budget / len(specialists)
    report: dict[str, Any] = {
        "method": "amaris",
        "budget": budget,
        "ridge": float(ridge),
        "min_gamma": float(min_gamma),
        "other": other,
        "layers": {},
    }
    for layer in layers:
        start = augmented_weight(base, layer)
        sigma_b = base_stats[layer].covariance.to(start.device)
        total = torch.zeros_like(start)
        entries = []
        for weight, tuned, stats in zip(weights, specialists, specialist_stats, strict=True):
            delta = weight * (augmented_weight(tuned, layer) - start)
            sigma_s = stats[layer].covariance.to(start.device)
            try:
                projected, entry = amaris_layer(
                    delta, sigma_s, sigma_b, share, start, min_gamma=min_gamma, ridge=ridge
                )
            except InputError as error:  # e.g. a singular Σ_b: say which layer
                raise InputError(f"layer {layer!r}: {error}") from error
            total += projected
            entries.append(asdict(entry))
        base_energy = _energy(start, sigma_b)
        predicted = _energy(total, _ridged(sigma_b, ridge))
        scale = 1.0
        if predicted > budget * base_energy:  # cross terms between specialists
            scale = math.sqrt(budget * base_energy / predicted)
            total, predicted = scale * total, budget * base_energy
        set_augmented_weight(merged, base, layer, start + total)
        report["layers"][layer] = {
            "specialists": entries,
            "predicted_deviation_total": predicted,
            "deviation_budget": budget * base_energy,
            "base_energy": base_energy,
            "scale": scale,
        }
    if tied:
        report["tied"] = tied
    return retie(merged, tied), report


def output_deviation(
    base: StateDict, merged: StateDict, stats: Mapping[str, ActivationStats]
) -> dict[str, float]:
    """Per layer in ``stats``, the relative output deviation of ``merged`` from ``base``:
    ``tr(ΔW~ Σ ΔW~ᵀ) / tr(W~₀ Σ W~₀ᵀ) = E‖ΔW~ x~‖² / E‖W~₀ x~‖²`` under ``Σ = stats.covariance``
    (e.g. held-out core data, to check AMARIS's budget). A base with zero output energy gives 0
    when nothing changed and ``inf`` otherwise.
    """
    check_compatible(base, [merged], names=["merged"], role="model")
    check_stats(stats, count=False)
    check_stats_fit(base, stats, "the")
    deviations = {}
    for layer, layer_stats in stats.items():
        start = augmented_weight(base, layer)
        sigma = layer_stats.covariance.to(start.device)
        change = _energy(augmented_weight(merged, layer) - start, sigma)
        energy = _energy(start, sigma)
        deviations[layer] = change / energy if energy > 0 else (0.0 if change == 0 else math.inf)
    return deviations
