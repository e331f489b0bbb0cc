"""Sweep specs of ``ada sweep``: parse and validate the YAML (the format is documented in
:mod:`ada_modules.sweep`, which re-exports everything public here).

Example::

    >>> from ada_modules.sweep_spec import override_args
    >>> override_args({"trainer.max_steps": 5})
    ['--trainer.max_steps=5']
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ada_modules.errors import InputError
from ada_modules.sweep_report import file_name

__all__ = [
    "SPEC_KEYS",
    "STAGES",
    "Metric",
    "SharedFit",
    "SweepSpec",
    "SweepSpecError",
    "Variant",
    "expand_grid",
    "override_args",
]

STAGES = ("fit", "validate", "test", "predict")
SPEC_KEYS = (
    "base",
    "fit",
    "fits",
    "grid",
    "metrics",
    "name",
    "overrides",
    "quick",
    "quick_seeds",
    "quick_variants",
    "seeds",
    "stages",
    "variants",
)
_MIN_HINTS = ("loss", "err", "perplexity", "ppl", "time", "latency")
# `{fit_dir}` or `{fit_dir:NAME}` in a string value (group 1: the name, if any)
_FIT_DIR = re.compile(r"\{fit_dir(?::([^{}]*))?\}")


class SweepSpecError(ValueError):
    """A sweep spec is invalid; the message is one line naming the file and the bad key."""


_Fail = Callable[[str], SweepSpecError]  # builds the error for a message about the spec file


@dataclass(frozen=True)
class Metric:
    """A logged metric to collect, and which direction is better.

    Args:
        name: The name the LightningModule logs, e.g. ``test/exact_match``.
        mode: ``max`` if higher is better, ``min`` if lower is better.
        required: A run that did not log it failed (default); ``False``: the table shows ``–``
            for such runs (e.g. all-gather statistics, which a one-process run has none of).

    Example::

        >>> Metric.parse("val/loss")
        Metric(name='val/loss', mode='min', required=True)
    """

    name: str
    mode: Literal["max", "min"] = "max"
    required: bool = True

    @classmethod
    def parse(cls, entry: str | dict[str, Any]) -> Metric:
        """A metric from a spec entry: a name (mode guessed from it) or ``{name, mode}``."""
        if isinstance(entry, str):
            lowered = entry.lower()
            return cls(entry, "min" if any(h in lowered for h in _MIN_HINTS) else "max")
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InputError(f"expected a name or {{name, mode}}, got {entry!r}")
        unknown = sorted(set(entry) - {"name", "mode", "required"})
        if unknown:
            raise InputError(f"unknown key {unknown[0]!r} (allowed: name, mode, required)")
        required = entry.get("required", True)
        if not isinstance(required, bool):
            raise InputError(
                f"required of {entry['name']!r} must be true or false, got {required!r}"
            )
        mode = entry.get("mode", cls.parse(entry["name"]).mode)
        if mode not in ("max", "min"):
            raise InputError(f"mode of {entry['name']!r} must be 'max' or 'min', got {mode!r}")
        return cls(entry["name"], mode, required)


@dataclass(frozen=True)
class Variant:
    """A named set of dotted LightningCLI overrides, e.g. ``{"model.init_args.hidden_size": 64}``."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)
    stage_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Overrides added to one stage's call only, by stage (e.g. a KV cache for ``test``)."""
    base: list[Path] | None = None
    """Its own LightningCLI config files (absolute; ``None``: the spec's ``base``)."""


@dataclass(frozen=True)
class SharedFit:
    """One named shared fit of a spec's ``fits`` list, run once per seed before the variants.

    Attributes:
        name: Its name: ``{fit_dir:NAME}`` and the folder ``shared_fit/<name>/seed_<seed>``.
        base: Its LightningCLI config files (absolute; default: the spec's ``base``).
        overrides: Added after the spec's ``overrides``.
        quick: Added after the spec's ``quick`` profile by ``--quick`` (``None``: nothing).
    """

    name: str
    base: list[Path]
    overrides: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] | None = None


@dataclass
class SweepSpec:
    """A validated sweep spec; build it with :meth:`from_yaml` (format: :mod:`ada_modules.sweep`).

    Attributes:
        path: The spec file (absolute).
        name: Name of the sweep; the default output folder is ``sweeps/<name>``.
        base: LightningCLI config files (absolute), passed as ``-c`` in order.
        stages: Subcommands each variant runs, in order.
        variants: The expanded variants (listed variants times grid points).
        seeds: Seeds of a full sweep.
        metrics: Metrics to collect and compare.
        overrides: Overrides of every run (shared fits included), before the variant's.
        quick: Overrides added to every run with ``quick=True``, last.
        quick_seeds: Seeds used with ``quick=True`` (``None``: the same as ``seeds``).
        quick_variants: Names of the variants run with ``quick=True`` (``None``: all).
        shared_fit: Overrides of the shared fit stage (``fit``), or ``None``.
        fits: The named shared fits (``fits``), in the order they run for each seed, or ``None``.
            ``fit`` and ``fits`` exclude each other; with neither, each variant fits itself.
    """

    path: Path
    name: str
    base: list[Path]
    stages: list[str]
    variants: list[Variant]
    seeds: list[int]
    metrics: list[Metric]
    overrides: dict[str, Any] = field(default_factory=dict)
    quick: dict[str, Any] | None = None
    quick_seeds: list[int] | None = None
    quick_variants: list[str] | None = None
    shared_fit: dict[str, Any] | None = None
    fits: list[SharedFit] | None = None

    @classmethod
    def from_yaml(cls, path: str | Path) -> SweepSpec:
        """Read and validate a sweep spec; every problem raises one-line :class:`SweepSpecError`.

        Example::

            spec = SweepSpec.from_yaml("cli_configs/quickstart_sweep.yaml")
            print([v.name for v in spec.variants], spec.seeds)
        """
        path = Path(path)
        if not path.is_file():
            raise SweepSpecError(f"sweep spec not found: {path}")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            where = getattr(error, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            problem = getattr(error, "problem", None) or type(error).__name__
            raise SweepSpecError(f"{path}: invalid YAML{line}: {problem}") from error
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: object, path: str | Path) -> SweepSpec:
        """Validate a parsed spec; ``path`` locates the spec (``base`` is relative to its folder)."""
        path = Path(path).resolve()

        def fail(message: str) -> SweepSpecError:
            return SweepSpecError(f"{path}: {message}")

        if not isinstance(data, dict):
            raise fail(f"expected a mapping of sweep keys, got {type(data).__name__}")
        for key in data:
            if key not in SPEC_KEYS:
                close = difflib.get_close_matches(str(key), SPEC_KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise fail(f"unknown key {key!r}{hint}; allowed keys: {', '.join(SPEC_KEYS)}")
        if "base" not in data:
            raise fail("missing key 'base' (the LightningCLI config file to sweep over)")
        base = _config_files(data["base"], "'base'", "base config", path.parent, fail)

        shared_fit = fits = None
        if "fit" in data and "fits" in data:
            raise fail(
                "'fit' and 'fits' exclude each other: give one shared fit ('fit') or a list of "
                "named shared fits ('fits')"
            )
        if "fit" in data:
            shared_fit = _overrides(data["fit"] or {}, "fit", fail)
        if "fits" in data:
            fits = _fits(data["fits"], base, path.parent, fail)
        shared = shared_fit is not None or fits is not None
        stages = data.get("stages", ["test"] if shared else ["fit", "test"])
        if not isinstance(stages, list) or not stages:
            raise fail(f"'stages' must be a non-empty list of {', '.join(STAGES)}")
        for stage in stages:
            if stage not in STAGES:
                raise fail(f"unknown stage {stage!r} in 'stages'; allowed: {', '.join(STAGES)}")
        if len(set(stages)) != len(stages):
            raise fail(f"'stages' lists a stage twice: {stages}")
        if "fit" in stages and stages[0] != "fit":
            raise fail("'fit' must be the first of 'stages' (later stages use its checkpoint)")
        if shared_fit is not None and "fit" in stages:
            raise fail("'stages' must not include 'fit' when a shared 'fit' stage is given")

        variants = _variants(data, stages, path.parent, fail)
        if shared_fit is not None:
            for variant in variants:
                if variant.base is not None:
                    raise fail(
                        f"variant {variant.name!r} has its own 'base', but a shared 'fit' trains "
                        "every variant's checkpoint on the spec's base; use named 'fits' instead"
                    )
        seeds = _seeds(data.get("seeds", [0]), "seeds", fail)
        quick_seeds = None
        if "quick_seeds" in data:
            quick_seeds = _seeds(data["quick_seeds"], "quick_seeds", fail)
        quick = _overrides(data["quick"] or {}, "quick", fail) if "quick" in data else None
        quick_variants = None
        if "quick_variants" in data:
            quick_variants = data["quick_variants"]
            names = [v.name for v in variants]
            if not isinstance(quick_variants, list) or not quick_variants:
                raise fail("'quick_variants' must be a non-empty list of variant names")
            unknown = [name for name in quick_variants if name not in names]
            if unknown:
                raise fail(f"'quick_variants' names unknown variants {unknown}; known: {names}")
        common = _overrides(data.get("overrides") or {}, "overrides", fail)

        entries = data.get("metrics")
        if not isinstance(entries, list) or not entries:
            raise fail("'metrics' must be a non-empty list of logged metric names")
        metrics = []
        for entry in entries:
            try:
                metrics.append(Metric.parse(entry))
            except ValueError as error:
                raise fail(f"bad entry in 'metrics': {error}") from error
        if len({m.name for m in metrics}) != len(metrics):
            raise fail("'metrics' lists a metric twice")
        charts: dict[str, str] = {}
        for metric in metrics:  # one chart file per metric
            other = charts.setdefault(file_name(metric.name), metric.name)
            if other != metric.name:
                raise fail(
                    f"metrics {other!r} and {metric.name!r} would both be charted in "
                    f"{file_name(metric.name)}.png; rename one"
                )
        _check_fit_dirs(fits, common, quick, variants, fail)

        name = data.get("name") or (path.parent.name if path.stem == "repro" else path.stem)
        if not isinstance(name, str) or file_name(name) != name:
            raise fail(f"'name' must be a plain file name, got {name!r}")
        return cls(
            path=path,
            name=name,
            base=base,
            stages=list(stages),
            variants=variants,
            seeds=seeds,
            metrics=metrics,
            overrides=common,
            quick=quick,
            quick_seeds=quick_seeds,
            quick_variants=quick_variants,
            shared_fit=shared_fit,
            fits=fits,
        )


def expand_grid(grid: dict[str, list[Any] | dict[str, dict[str, Any]]]) -> list[Variant]:
    """The cartesian product of a grid of overrides, one auto-named variant per point.

    A key with a list of values is a dotted override key; its part of a variant's name is
    ``key=value`` with the key's last part (the full key where two keys share their last part).
    A key with a mapping is a *named axis*: each of its points is a name with a mapping of
    overrides, applied together, and named ``key=name``.

    Example::

        >>> [v.name for v in expand_grid({"model.init_args.lr": [0.1, 0.01], "trainer.a.b": [1]})]
        ['lr=0.1,b=1', 'lr=0.01,b=1']
        >>> judges = {"judge": {"good": {"data.acc": 0.9}, "bad": {"data.acc": 0.2, "data.b": 1}}}
        >>> [(v.name, v.overrides) for v in expand_grid(judges)][1]
        ('judge=bad', {'data.acc': 0.2, 'data.b': 1})
    """
    keys = list(grid)
    last = [key.rsplit(".", 1)[-1] for key in keys]
    labels = [
        short if last.count(short) == 1 else key for key, short in zip(keys, last, strict=True)
    ]
    axes = [
        list(values.items())
        if isinstance(values, dict)
        else [(_value_text(v), {key: v}) for v in values]
        for key, values in grid.items()
    ]
    variants = []
    for points in itertools.product(*axes):
        name = ",".join(f"{label}={text}" for label, (text, _) in zip(labels, points, strict=True))
        overrides = {k: v for _, point in points for k, v in point.items()}
        variants.append(Variant(name, overrides))
    return variants


def override_args(overrides: dict[str, Any]) -> list[str]:
    """Command-line arguments for dotted overrides: ``--key=value``, non-strings as JSON.

    Example::

        >>> override_args({"trainer.max_steps": 5, "model.init_args.dims": [1, 2], "x.name": "a b"})
        ['--trainer.max_steps=5', '--model.init_args.dims=[1, 2]', '--x.name=a b']
    """
    return [f"--{key}={_value_text(value)}" for key, value in overrides.items()]


def _value_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan")
    return json.dumps(value)


def _overrides(value: object, where: str, fail: _Fail) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(f"'{where}' must be a mapping of dotted keys to values, got {value!r}")
    for key in value:
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][\w.]*\+?", key):
            raise fail(f"bad override key {key!r} in '{where}' (expected e.g. trainer.max_steps)")
    return dict(value)


def _seeds(value: object, where: str, fail: _Fail) -> list[int]:
    ok = isinstance(value, list) and value and all(type(s) is int for s in value)
    if not ok or len(set(value)) != len(value):
        raise fail(f"'{where}' must be a non-empty list of distinct integers, got {value!r}")
    return list(value)


def _stage_overrides(
    value: object, i: int, stages: list[str], fail: _Fail
) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict):
        raise fail(f"variants[{i}].stage_overrides must map stage names to overrides")
    for stage in value:
        if stage not in stages:
            raise fail(
                f"variants[{i}].stage_overrides: {stage!r} is not one of the spec's stages "
                f"{list(stages)}"
            )
    return {
        stage: _overrides(overrides, f"variants[{i}].stage_overrides.{stage}", fail)
        for stage, overrides in value.items()
    }


def _variants(data: dict[str, Any], stages: list[str], folder: Path, fail: _Fail) -> list[Variant]:
    listed = [Variant("base")]
    if "variants" in data:
        entries = data["variants"]
        if not isinstance(entries, list) or not entries:
            raise fail("'variants' must be a non-empty list of {name, overrides}")
        listed = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise fail(f"variants[{i}] must be a mapping with a 'name' string")
            unknown = sorted(set(entry) - {"name", "base", "overrides", "stage_overrides"})
            if unknown:
                raise fail(
                    f"unknown key {unknown[0]!r} in variant {entry['name']!r}; "
                    "allowed keys: name, base, overrides, stage_overrides"
                )
            where = f"variants[{i}].overrides"
            base = None
            if "base" in entry:
                what = f"base config of variant {entry['name']!r}"
                base = _config_files(entry["base"], f"'variants[{i}].base'", what, folder, fail)
            listed.append(
                Variant(
                    entry["name"],
                    _overrides(entry.get("overrides") or {}, where, fail),
                    _stage_overrides(entry.get("stage_overrides") or {}, i, stages, fail),
                    base,
                )
            )
    variants = listed
    if "grid" in data:
        grid = data["grid"]
        if not isinstance(grid, dict) or not grid:
            raise fail("'grid' must be a non-empty mapping of dotted keys to lists of values")
        _overrides(grid, "grid", fail)
        for key, values in grid.items():
            if isinstance(values, dict) and values:
                for point, overrides in values.items():
                    if not isinstance(overrides, dict) or not overrides:
                        raise fail(
                            f"grid axis {key!r}: point {point!r} must be a non-empty mapping of "
                            "dotted keys to values"
                        )
                    _overrides(overrides, f"grid.{key}.{point}", fail)
            elif not isinstance(values, list) or not values:
                raise fail(
                    f"grid key {key!r} must have a non-empty list of values (or, as a named "
                    "axis, a mapping of point names to overrides)"
                )
        points = expand_grid(grid)
        if "variants" not in data:
            variants = points
        else:
            variants = [
                Variant(
                    f"{v.name},{p.name}",
                    {**v.overrides, **p.overrides},
                    v.stage_overrides,
                    v.base,
                )
                for v in listed
                for p in points
            ]
    folders: dict[str, str] = {}
    for variant in variants:
        folder = file_name(variant.name)
        if folder in folders:
            raise fail(f"variants {folders[folder]!r} and {variant.name!r} have the same name")
        folders[folder] = variant.name
    return variants


def _config_files(value: object, where: str, what: str, folder: Path, fail: _Fail) -> list[Path]:
    """The config files of a ``base`` entry (a path or a list of them, relative to ``folder``)."""
    entries = value if isinstance(value, list) else [value]
    if not entries or not all(isinstance(b, str) and b for b in entries):
        raise fail(f"{where} must be a config file path or a non-empty list of them")
    files = [(folder / b).resolve() for b in entries]
    for file in files:
        if not file.is_file():
            raise fail(f"{what} not found: {file}")
    return files


def _fits(value: object, base: list[Path], folder: Path, fail: _Fail) -> list[SharedFit]:
    if not isinstance(value, list) or not value:
        raise fail("'fits' must be a non-empty list of {name, base, overrides, quick}")
    fits: list[SharedFit] = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise fail(f"fits[{i}] must be a mapping with a 'name' string")
        name = entry["name"]
        if file_name(name) != name:
            raise fail(f"fits[{i}]: 'name' must be a plain file name, got {name!r}")
        if name in (fit.name for fit in fits):
            raise fail(f"two of 'fits' are named {name!r}")
        unknown = sorted(set(entry) - {"name", "base", "overrides", "quick"})
        if unknown:
            raise fail(
                f"unknown key {unknown[0]!r} in fit {name!r}; "
                "allowed keys: name, base, overrides, quick"
            )
        fit_base = base
        if "base" in entry:
            what = f"base config of fit {name!r}"
            fit_base = _config_files(entry["base"], f"'fits[{i}].base'", what, folder, fail)
        quick = None
        if "quick" in entry:
            quick = _overrides(entry["quick"] or {}, f"fits[{i}].quick", fail)
        overrides = _overrides(entry.get("overrides") or {}, f"fits[{i}].overrides", fail)
        fits.append(SharedFit(name, fit_base, overrides, quick))
    return fits


def _fit_dirs_in(value: object) -> Iterator[tuple[str, str | None]]:
    """Each ``{fit_dir}`` / ``{fit_dir:NAME}`` in the strings of ``value``: (text, NAME or None)."""
    if isinstance(value, str):
        for match in _FIT_DIR.finditer(value):
            yield match[0], match[1]
    elif isinstance(value, dict):
        for item in value.values():
            yield from _fit_dirs_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _fit_dirs_in(item)


def _check_fit_dirs(
    fits: list[SharedFit] | None,
    common: dict[str, Any],
    quick: dict[str, Any] | None,
    variants: list[Variant],
    fail: _Fail,
) -> None:
    """Every ``{fit_dir:NAME}`` names a fit, and a fit's calls use only earlier fits' folders.

    With ``fits``, a plain ``{fit_dir}`` is the last fit. The spec's ``overrides`` and ``quick``
    reach the fits too, so they are checked as part of each fit's overrides.
    """
    fits = fits or []
    names = [fit.name for fit in fits]
    spec_wide = [("'overrides'", common), ("'quick'", quick)]
    per_fit = [
        [(f"fits[{i}].overrides", fit.overrides), (f"fits[{i}].quick", fit.quick)]
        for i, fit in enumerate(fits)
    ]
    in_variants = [(f"variant {v.name!r}", [v.overrides, v.stage_overrides]) for v in variants]
    for where, value in [*spec_wide, *itertools.chain(*per_fit), *in_variants]:
        for text, name in _fit_dirs_in(value):
            if name is not None and name not in names:
                known = f"fits: {', '.join(names)}" if names else "the spec has no 'fits'"
                raise fail(f"{where}: unknown fit {name!r} in {text!r}; {known}")
    for i, fit in enumerate(fits):
        for k, (where, value) in enumerate([*spec_wide, *per_fit[i]]):
            for text, name in _fit_dirs_in(value):
                target = name if name is not None else names[-1]
                if target in names[:i]:
                    continue
                where += " (added to every fit too)" if k < len(spec_wide) else ""
                hint = "" if name else f"; {text!r} is the last fit, {{run_dir}} a run's own folder"
                raise fail(
                    f"{where}: fit {fit.name!r} cannot use {text!r}: fit {target!r} does not run "
                    f"before it (a fit may use only the folders of earlier fits){hint}"
                )
