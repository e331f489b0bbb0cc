"""A merge described the way mergekit users write one: a base model, models with per-model
parameters, a method and its parameters; checked when built and carried out by :func:`merge`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ada_modules.checks import is_finite_real
from ada_modules.errors import InputError
from ada_modules.merging.amaris import amaris
from ada_modules.merging.fisher import fisher_merge
from ada_modules.merging.parameter_space import dare, task_arithmetic, ties
from ada_modules.merging.regmean import regmean
from ada_modules.merging.state_dicts import retie, untie, untie_members
from ada_modules.merging.stats import ActivationStats

__all__ = ["METHODS", "MergeRecipe", "ModelEntry", "merge"]

# method -> (its parameters and their defaults, the statistics it needs)
METHODS: dict[str, tuple[dict[str, Any], str | None]] = {
    "base": ({}, None),
    "task_arithmetic": ({"normalize": False}, None),
    "ties": ({"density": 0.5, "normalize": True}, None),
    "dare_linear": ({"density": 0.5, "rescale": True, "normalize": False}, None),
    "dare_ties": ({"density": 0.5, "rescale": True, "normalize": True}, None),
    "regmean": ({"alpha": 0.5, "ridge": 0.0, "include_base": True}, "activations"),
    "fisher": ({"eps": 1e-8, "include_base": True}, "fisher"),
    "amaris": (
        {"budget": 0.05, "ridge": 0.0, "min_gamma": 1.0, "other": "task_arithmetic"},
        "activations",
    ),
}
_MODEL_PARAMETERS = ("weight", "density")
# the per-model parameters each method reads (the others are rejected, not ignored)
_USES = {
    "base": (),
    "task_arithmetic": ("weight",),
    "ties": ("weight", "density"),
    "dare_linear": ("weight", "density"),
    "dare_ties": ("weight", "density"),
    "regmean": (),
    "fisher": ("weight",),
    "amaris": ("weight",),
}


@dataclass(frozen=True)
class ModelEntry:
    """One model to merge into the base: its checkpoint, its data domain and its parameters."""

    model: str
    domain: str
    parameters: dict[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, entry: object, index: int) -> ModelEntry:
        """An entry of ``models``: ``{model: PATH, domain: NAME, parameters: {weight, density}}``."""
        where = f"models[{index}]"
        if not isinstance(entry, Mapping):
            raise InputError(f"{where} must be a mapping with 'model' and 'domain', got {entry!r}")
        unknown = sorted(set(entry) - {"model", "domain", "parameters"})
        if unknown:
            raise InputError(
                f"{where} has unknown key {unknown[0]!r} (allowed: model, domain, parameters)"
            )
        for key in ("model", "domain"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise InputError(
                    f"{where}.{key} must be a non-empty string, got {entry.get(key)!r}"
                )
        parameters = _mapping(f"{where}.parameters", entry.get("parameters"))
        _check_parameters(f"{where}.parameters", parameters, _MODEL_PARAMETERS)
        return cls(entry["model"], entry["domain"], parameters)


def _mapping(where: str, value: object) -> dict[str, Any]:
    """``value`` (a mapping, or ``None`` for an empty one) as a dict."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InputError(f"{where} must be a mapping of parameter names to values, got {value!r}")
    return dict(value)


def _check_parameters(where: str, parameters: Mapping[str, Any], allowed: Sequence[str]) -> None:
    for key, value in parameters.items():
        if key not in allowed:
            allowed_text = ", ".join(allowed) or "none"
            raise InputError(f"{where} has unknown key {key!r} (allowed: {allowed_text})")
        if key in ("weight", "density", "budget", "alpha", "ridge", "eps", "min_gamma"):
            if not is_finite_real(value):
                raise InputError(f"{where}.{key} must be a finite number, got {value!r}")
        if key in ("normalize", "rescale", "include_base") and not isinstance(value, bool):
            raise InputError(f"{where}.{key} must be true or false, got {value!r}")
    density = parameters.get("density")
    if density is not None and not 0 < density <= 1:
        raise InputError(f"{where}.density must be in (0, 1], got {density}")
    budget = parameters.get("budget")
    if budget is not None and not 0 < budget <= 1:
        raise InputError(f"{where}.budget must be in (0, 1], got {budget}")


@dataclass(frozen=True)
class MergeRecipe:
    """A validated merge: method, method parameters (defaults filled in) and the models.

    ``parameters`` may also hold ``weight`` and ``density``, the defaults of every model's own
    ``parameters`` (as in mergekit).

    Examples:
        >>> recipe = MergeRecipe.build(
        ...     "ties",
        ...     [{"model": "a.ckpt", "domain": "rot90", "parameters": {"weight": 0.5}}],
        ...     {"density": 0.2},
        ... )
        >>> recipe.parameters, recipe.weights(), recipe.models[0].domain
        ({'density': 0.2, 'normalize': True}, [0.5], 'rot90')
    """

    method: str
    parameters: dict[str, Any]
    models: tuple[ModelEntry, ...]
    model_defaults: dict[str, float] = field(default_factory=dict)

    @classmethod
    def build(
        cls, method: str, models: Sequence[object], parameters: Mapping[str, Any] | None = None
    ) -> MergeRecipe:
        """Check a method name, its parameters and the model entries; fill in defaults."""
        if method not in METHODS:
            raise InputError(f"merge_method must be one of {', '.join(METHODS)}, got {method!r}")
        if isinstance(models, str | bytes) or not isinstance(models, Sequence) or not models:
            raise InputError(f"models must be a non-empty list of model entries, got {models!r}")
        entries = tuple(ModelEntry.parse(entry, i) for i, entry in enumerate(models))
        for i, entry in enumerate(entries):
            for key in entry.parameters:
                if key not in _USES[method]:
                    raise InputError(
                        f"models[{i}].parameters.{key} is not used by merge_method {method!r} "
                        f"(it reads {', '.join(_USES[method]) or 'no per-model parameter'})"
                    )
        defaults, _ = METHODS[method]
        given = _mapping("parameters", parameters)
        _check_parameters("parameters", given, [*defaults, *_USES[method]])
        if "other" in given and given["other"] not in ("base", "task_arithmetic"):
            raise InputError(
                f"parameters.other must be 'base' or 'task_arithmetic', got {given['other']!r}"
            )
        model_defaults = {
            k: given.pop(k) for k in _MODEL_PARAMETERS if k in given and k not in defaults
        }
        return cls(method, {**defaults, **given}, entries, model_defaults)

    @property
    def statistics(self) -> str | None:
        """What the method reads besides weights: ``"activations"``, ``"fisher"`` or ``None``."""
        return METHODS[self.method][1]

    def weights(self) -> list[float]:
        """Each model's ``weight`` (default 1)."""
        return [
            float(e.parameters.get("weight", self.model_defaults.get("weight", 1.0)))
            for e in self.models
        ]

    def density(self) -> float:
        """The ``density`` of TIES/DARE: one value for all models (mergekit allows one per model;
        here a model's own value must agree with the others)."""
        values = {e.parameters.get("density", self.parameters.get("density")) for e in self.models}
        if len(values) != 1:
            raise InputError(f"the models' densities differ ({sorted(values)}); use one density")
        return float(values.pop())


def merge(
    recipe: MergeRecipe,
    base: Mapping[str, torch.Tensor],
    specialists: Sequence[Mapping[str, torch.Tensor]],
    base_stats: Mapping[str, Any] | None = None,
    specialist_stats: Sequence[Mapping[str, Any]] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Carry out ``recipe`` on state dicts; returns the merged state dict and a JSON-able report.

    ``base_stats`` / ``specialist_stats`` are what :attr:`MergeRecipe.statistics` names: per-layer
    :class:`~ada_modules.merging.ActivationStats` (of the base on core data and of each specialist
    on its domain) or diagonal Fisher dicts. RegMean and Fisher merge the base too (with its core
    statistics) unless ``include_base`` is false, so that they trade specialist gains against the
    base's behaviour like the other methods. Tied weights (one tensor under several keys of
    ``base``, e.g. a language model's embedding and output head) are merged once, under their
    first key, as that key's method treats it (AMARIS: as a tensor without statistics), and the
    report lists them under ``tied``.

    Examples:
        >>> base = {"w": torch.zeros(2)}
        >>> recipe = MergeRecipe.build("task_arithmetic", [{"model": "a", "domain": "d"}])
        >>> merged, report = merge(recipe, base, [{"w": torch.ones(2)}])
        >>> merged["w"].tolist(), report["method"]
        ([1.0, 1.0], 'task_arithmetic')
    """
    if len(specialists) != len(recipe.models):
        raise InputError(
            f"{len(recipe.models)} models in the recipe but {len(specialists)} state dicts given"
        )
    tied, untied_base, untied_specialists = untie_members(base, specialists)
    if not tied:
        return _merge(recipe, base, specialists, base_stats, specialist_stats, generator)

    # Tied weights are one tensor under several keys: merge it once, under its first key (the
    # statistics of a layer whose weight is a later key are dropped), then share the result.
    def layers(stats: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if stats is None:
            return None
        return untie(stats, tied, layers=recipe.statistics == "activations")

    merged, report = _merge(
        recipe,
        untied_base,
        untied_specialists,
        layers(base_stats),
        None if specialist_stats is None else [layers(s) for s in specialist_stats],
        generator,
    )
    return retie(merged, tied), {**report, "tied": tied}


def _merge(
    recipe: MergeRecipe,
    base: Mapping[str, torch.Tensor],
    specialists: Sequence[Mapping[str, torch.Tensor]],
    base_stats: Mapping[str, Any] | None,
    specialist_stats: Sequence[Mapping[str, Any]] | None,
    generator: torch.Generator | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    p, weights = recipe.parameters, recipe.weights()
    report: dict[str, Any] = {"method": recipe.method, "parameters": p, "weights": weights}
    if recipe.statistics is not None and (base_stats is None or specialist_stats is None):
        raise InputError(f"merge_method {recipe.method!r} needs base_stats and specialist_stats")
    if recipe.method == "base":
        return {k: v.clone() for k, v in base.items()}, report
    if recipe.method == "task_arithmetic":
        return task_arithmetic(base, specialists, weights, normalize=p["normalize"]), report
    if recipe.method == "ties":
        merged = ties(
            base, specialists, weights, density=recipe.density(), normalize=p["normalize"]
        )
        return merged, report
    if recipe.method in ("dare_linear", "dare_ties"):
        merged = dare(
            base,
            specialists,
            weights,
            density=recipe.density(),
            consensus="ties" if recipe.method == "dare_ties" else None,
            rescale=p["rescale"],
            generator=generator,
            normalize=p["normalize"],
        )
        return merged, report
    members, stats = list(specialists), list(specialist_stats or [])
    if recipe.method in ("regmean", "fisher") and p["include_base"]:
        members, stats = [base, *members], [base_stats, *stats]
    if recipe.method == "regmean":
        return regmean(base, members, stats, alpha=p["alpha"], ridge=p["ridge"]), report
    if recipe.method == "fisher":
        member_weights = ([1.0] if p["include_base"] else []) + weights
        return fisher_merge(members, stats, weights=member_weights, eps=p["eps"]), report
    merged, amaris_report = amaris(
        base,
        specialists,
        specialist_stats=list(specialist_stats or []),
        base_stats=base_stats or {},
        budget=p["budget"],
        ridge=p["ridge"],
        min_gamma=p["min_gamma"],
        weights=weights,
        other=p["other"],
    )
    return merged, {**report, **amaris_report}


def activation_stats_summary(stats: Mapping[str, ActivationStats]) -> dict[str, dict[str, int]]:
    """Per layer, the sample count and dimension (what the report keeps of the statistics)."""
    return {name: {"count": s.count, "dim": s.dim} for name, s in stats.items()}
