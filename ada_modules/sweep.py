"""``ada sweep``: run a YAML sweep of LightningCLI configs and tabulate and plot its metrics.

A sweep runs every variant of a base config for every seed, through the same code path as
``ada fit`` / ``ada test`` (one subprocess per stage, so a crash is one failed row and the rest go
on), then writes ``results.json``, ``results.md`` (mean ± std over seeds) and one chart per metric.

Spec format
-----------
A sweep spec is a YAML mapping; ``base`` and ``metrics`` are required::

    # cli_configs/quickstart_sweep.yaml
    base: quickstart.yaml            # LightningCLI config(s), relative to this file; a list of
                                     # files is composed like repeated `-c` (last one wins)
    stages: [fit, test]              # default; `test`/`validate`/`predict` after `fit` load the
                                     # checkpoint that fit wrote (<run dir>/checkpoints/last.ckpt)
    overrides:                       # added to every run (any LightningCLI key), e.g. to keep
      trainer.logger: true           # logs in the run folder instead of a path in the base
    variants:                        # a list of named overrides (any LightningCLI key) ...
      - name: small
        overrides: {model.init_args.hidden_size: 64}
      - name: large
        overrides: {model.init_args.hidden_size: 128, model.init_args.num_layers: 4}
      - name: small_bf16_test        # stage_overrides: added last to one stage's call only,
        overrides: {model.init_args.hidden_size: 64}  # e.g. test with a KV cache built from a
        stage_overrides:             # profile that this run's fit writes
          test: {trainer.precision: bf16-true}
    grid:                            # ... and/or a grid: the cartesian product of the values,
      model.init_args.num_heads: [2, 4]  # named `num_heads=2`, ... (combined with every variant)
    seeds: [0, 1]                    # set as `seed_everything`; default [0]
    metrics:                         # logged metric names to collect and compare
      - test/exact_match             # mode `max`, except names containing loss, err,
      - {name: test/gen_length, mode: min}  # perplexity, ppl, time or latency: those are `min`
      - {name: train/adera_bytes_ratio, mode: min, required: false}  # may be missing: –
    quick:                           # overrides added to every run by `ada sweep --quick`
                                     # (after `overrides` and the variant's, so they win)
      trainer.max_steps: 20
    quick_seeds: [0]                 # seeds used by `--quick` (default: `seeds`)
    name: quickstart                 # default output folder is sweeps/<name>; default name: the
                                     # file stem (the folder name for a file called repro.yaml)

Override values are passed to the CLI as ``--key=value``: strings as they are, everything else
as JSON, so numbers, booleans, ``null``, lists and mappings keep their types. Before anything
runs, the first CLI call of each variant is parsed in-process with ``--print_config``: an unknown
key or a value of the wrong type fails the spec with the CLI's one-line error; a value that a
component rejects when it is built fails that variant's runs, with the error in the record.
Besides the overrides, every call gets ``--seed_everything``,
``--trainer.default_root_dir=<run dir>`` and ``--metrics_file``; ``fit`` also gets a
``ModelCheckpoint(dirpath=<run dir>/checkpoints, save_last=True, save_top_k=0)`` appended to
``trainer.callbacks`` (so the base config must not set ``trainer.enable_checkpointing: false``),
and later stages get ``--ckpt_path=<run dir>/checkpoints/last.ckpt``.

Shared fit: with a top-level ``fit:`` mapping of overrides (``fit: {}`` for none), each seed is
trained once with the base config, those overrides and the quick profile; as soon as a seed's fit
is done, every variant runs only its evaluation ``stages`` (default ``[test]``; ``fit`` is not
allowed there) from that checkpoint, with its own overrides. Use it to compare inference-time choices (a KV cache, an
attention implementation) on one trained model.

Folders in values: inside any string override value, ``{run_dir}`` stands for the run's own folder
and ``{fit_dir}`` for the folder of the same seed's shared fit, e.g. to write a file from a callback
during the shared fit and read it in every variant (``{fit_dir}/aad/aad_profile.json``).

Outputs (``--out DIR``, default ``sweeps/<name>``): ``DIR/results.json`` (``runs``: one record
per variant and seed, see :class:`RunRecord`; ``shared_fits``: one per seed), ``DIR/results.md``
(per variant: successful/all runs and ``mean ± std`` over the successful seeds, the mean alone
for one seed, the best mean in bold; see :func:`ada_modules.sweep_report.format_table`),
``DIR/<metric>.png`` (``/`` in metric names becomes ``_``; a chart of the mean ± std per variant, for
every metric that some run logged; see :func:`ada_modules.sweep_report.plot_metrics`) and, per run,
``DIR/runs/<variant>/seed_<seed>/`` with ``<stage>.log`` (the CLI's output),
``<stage>.metrics.json``, ``checkpoints/last.ckpt`` and whatever the run's callbacks write
under its ``default_root_dir`` (e.g. images). Shared fits live in ``DIR/shared_fit/seed_<seed>/``.
At the end the sweep prints what it wrote: the report files by name, the metrics left without a
chart, and every image found in the run and shared-fit folders (path inside the folder, and in
how many of them), or that the runs wrote none. A spec that promises images from its runs is held
to it by that list, for the profile that was run.

Resume: a run already recorded as ``ok`` in ``DIR/results.json`` with the same base, stages and
overrides (and shared fit) is skipped; ``results.json`` is rewritten atomically after every run,
so an interrupted sweep loses at most the runs in progress. ``--jobs N`` runs N at a time, each
with ``OMP_NUM_THREADS`` = CPUs / N unless that variable is set.

Cluster: ``ada sweep SPEC --dry-run`` prints one self-contained shell line per run (shared fits
first, after a ``#`` comment line); run them anywhere that shares ``DIR``, then
``ada sweep SPEC --collect`` (same ``--out`` and ``--quick``) builds the results from the metrics
files they wrote.

Example:
    From a shell::

        ada sweep cli_configs/quickstart_sweep.yaml --quick --out /tmp/qs --jobs 2

    From Python::

        from ada_modules.sweep import run_sweep
        records = run_sweep("cli_configs/quickstart_sweep.yaml", out="/tmp/qs", quick=True)
        print([(r.variant, r.seed, r.metrics["test/exact_match"]) for r in records])
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import io
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ArgumentError, ArgumentParser

from ada_modules.errors import InputError
from ada_modules.sweep_report import file_name, format_table, plot_metrics

__all__ = [
    "Metric",
    "RunRecord",
    "SweepSpec",
    "SweepSpecError",
    "Variant",
    "build_parser",
    "expand_grid",
    "override_args",
    "run_sweep",
    "sweep_main",
]

STAGES = ("fit", "validate", "test", "predict")
SPEC_KEYS = (
    "base",
    "fit",
    "grid",
    "metrics",
    "name",
    "overrides",
    "quick",
    "quick_seeds",
    "seeds",
    "stages",
    "variants",
)
_MIN_HINTS = ("loss", "err", "perplexity", "ppl", "time", "latency")
_SHARED_FIT = "(shared fit)"


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


@dataclass
class SweepSpec:
    """A validated sweep spec; build it with :meth:`from_yaml` (see the module docstring).

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
        shared_fit: Overrides of the shared fit stage, or ``None`` when each variant fits itself.
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
    shared_fit: dict[str, Any] | None = None

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
        base_entries = data["base"] if isinstance(data["base"], list) else [data["base"]]
        if not base_entries or not all(isinstance(b, str) and b for b in base_entries):
            raise fail("'base' must be a config file path or a non-empty list of them")
        base = [(path.parent / b).resolve() for b in base_entries]
        for file in base:
            if not file.is_file():
                raise fail(f"base config not found: {file}")

        shared_fit = None
        if "fit" in data:
            shared_fit = _overrides(data["fit"] or {}, "fit", fail)
        stages = data.get("stages", ["test"] if shared_fit is not None else ["fit", "test"])
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

        variants = _variants(data, stages, fail)
        seeds = _seeds(data.get("seeds", [0]), "seeds", fail)
        quick_seeds = None
        if "quick_seeds" in data:
            quick_seeds = _seeds(data["quick_seeds"], "quick_seeds", fail)
        quick = _overrides(data["quick"] or {}, "quick", fail) if "quick" in data else None
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
            shared_fit=shared_fit,
        )


@dataclass
class RunRecord:
    """The outcome of one run (a variant and a seed), as stored in ``results.json``.

    Attributes:
        variant: Variant name (``"(shared fit)"`` for a shared fit).
        seed: The ``seed_everything`` value.
        status: ``"ok"`` or ``"failed"``.
        metrics: Every metric the run's stages logged (later stages win on equal names);
            ``None`` for a non-finite value.
        overrides: The overrides the run used (the spec's ``overrides``, the variant's, then the
            quick profile).
        stages: The subcommands it ran.
        base: The base config files.
        shared_fit: The shared fit's overrides if the run used a shared checkpoint.
        run_dir: Folder with its logs, metrics files and checkpoint.
        command: The shell line that reproduces the run.
        wall_s: Wall time in seconds (``None`` for collected runs).
        error: The failure (the last lines of the failing stage's log), or ``None``.
        base_sha256: Hash of the base config files' contents: editing them invalidates resume.
    """

    variant: str
    seed: int
    status: Literal["ok", "failed"]
    metrics: dict[str, float | None]
    overrides: dict[str, Any]
    stages: list[str]
    base: list[str]
    shared_fit: dict[str, Any] | None
    run_dir: str
    command: str
    wall_s: float | None = None
    error: str | None = None
    base_sha256: str = ""

    def same_run(self, other: RunRecord) -> bool:
        """Whether ``other`` describes the same run configuration (used to resume)."""
        return all(
            getattr(self, name) == getattr(other, name)
            for name in (
                "variant",
                "seed",
                "overrides",
                "stages",
                "base",
                "base_sha256",
                "shared_fit",
            )
        )


def expand_grid(grid: dict[str, list[Any]]) -> list[Variant]:
    """The cartesian product of a grid of overrides, one auto-named variant per point.

    A variant is named ``key=value,...`` with the last part of each dotted key (the full key
    where two keys share their last part).

    Example::

        >>> [v.name for v in expand_grid({"model.init_args.lr": [0.1, 0.01], "trainer.a.b": [1]})]
        ['lr=0.1,b=1', 'lr=0.01,b=1']
    """
    keys = list(grid)
    last = [key.rsplit(".", 1)[-1] for key in keys]
    labels = [
        short if last.count(short) == 1 else key for key, short in zip(keys, last, strict=True)
    ]
    variants = []
    for values in itertools.product(*(grid[key] for key in keys)):
        name = ",".join(
            f"{label}={_value_text(v)}" for label, v in zip(labels, values, strict=True)
        )
        variants.append(Variant(name, dict(zip(keys, values, strict=True))))
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


def _variants(data: dict[str, Any], stages: list[str], fail: _Fail) -> list[Variant]:
    listed = [Variant("base")]
    if "variants" in data:
        entries = data["variants"]
        if not isinstance(entries, list) or not entries:
            raise fail("'variants' must be a non-empty list of {name, overrides}")
        listed = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise fail(f"variants[{i}] must be a mapping with a 'name' string")
            unknown = sorted(set(entry) - {"name", "overrides", "stage_overrides"})
            if unknown:
                raise fail(
                    f"unknown key {unknown[0]!r} in variant {entry['name']!r}; "
                    "allowed keys: name, overrides, stage_overrides"
                )
            where = f"variants[{i}].overrides"
            listed.append(
                Variant(
                    entry["name"],
                    _overrides(entry.get("overrides") or {}, where, fail),
                    _stage_overrides(entry.get("stage_overrides") or {}, i, stages, fail),
                )
            )
    variants = listed
    if "grid" in data:
        grid = data["grid"]
        if not isinstance(grid, dict) or not grid:
            raise fail("'grid' must be a non-empty mapping of dotted keys to lists of values")
        _overrides(grid, "grid", fail)
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise fail(f"grid key {key!r} must have a non-empty list of values")
        points = expand_grid(grid)
        if "variants" not in data:
            variants = points
        else:
            variants = [
                Variant(f"{v.name},{p.name}", {**v.overrides, **p.overrides}, v.stage_overrides)
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


@dataclass(frozen=True)
class _Run:
    """One planned run: its record fields and the CLI calls (stage, argument list) that make it."""

    variant: str
    seed: int
    overrides: dict[str, Any]
    stages: tuple[str, ...]
    run_dir: Path
    calls: tuple[tuple[str, tuple[str, ...]], ...]
    shared_fit: dict[str, Any] | None
    depends_on: _Run | None = None

    def shell(self) -> str:
        return " && ".join(shlex.join(["ada", stage, *args]) for stage, args in self.calls)

    def record(self, base: list[Path], **outcome: Any) -> RunRecord:
        return RunRecord(
            variant=self.variant,
            seed=self.seed,
            overrides=self.overrides,
            stages=list(self.stages),
            base=[str(b) for b in base],
            shared_fit=self.shared_fit,
            run_dir=str(self.run_dir),
            command=self.shell(),
            base_sha256=_files_sha256(base),
            **outcome,
        )


def _files_sha256(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _plan(spec: SweepSpec, out: Path, quick: bool) -> tuple[list[_Run], list[_Run]]:
    """The shared fits (one per seed, or none) and the variant runs of a sweep."""
    if quick and spec.quick is None:
        raise SweepSpecError(f"{spec.path}: --quick needs a 'quick' profile in the spec")
    extra = spec.quick if quick else {}
    seeds = spec.quick_seeds if quick and spec.quick_seeds else spec.seeds
    config = tuple(arg for file in spec.base for arg in ("-c", str(file)))

    def make(
        variant: str,
        seed: int,
        overrides: dict[str, Any],
        stages: list[str],
        run_dir: Path,
        ckpt: Path | None,
        depends_on: _Run | None = None,
        stage_overrides: dict[str, dict[str, Any]] | None = None,
    ) -> _Run:
        calls = []
        stage_overrides = stage_overrides or {}
        for stage in stages:
            args = [
                *config,
                *override_args({**overrides, **stage_overrides.get(stage, {})}),
                f"--seed_everything={seed}",
                f"--trainer.default_root_dir={run_dir}",
            ]
            if stage == "fit":
                args.append("--trainer.callbacks+=" + json.dumps(_last_checkpoint(run_dir)))
                ckpt = run_dir / "checkpoints" / "last.ckpt"
            elif ckpt is not None:
                args.append(f"--ckpt_path={ckpt}")
            args.append(f"--metrics_file={run_dir / f'{stage}.metrics.json'}")
            calls.append((stage, tuple(args)))
        shared = spec.shared_fit if depends_on is not None else None
        # recorded (and compared when resuming) as "<stage>:<key>"
        recorded = {
            **overrides,
            **{f"{st}:{k}": v for st, extra in stage_overrides.items() for k, v in extra.items()},
        }
        return _Run(
            variant, seed, recorded, tuple(stages), run_dir, tuple(calls), shared, depends_on
        )

    fits = {}
    if spec.shared_fit is not None:
        for seed in seeds:
            fit_dir = out / "shared_fit" / f"seed_{seed}"
            overrides = {**spec.overrides, **spec.shared_fit, **extra}
            overrides = _with_folders(overrides, run_dir=fit_dir, fit_dir=fit_dir)
            fits[seed] = make(_SHARED_FIT, seed, overrides, ["fit"], fit_dir, None)
    runs = []
    for variant in spec.variants:
        for seed in seeds:
            run_dir = out / "runs" / file_name(variant.name) / f"seed_{seed}"
            fit = fits.get(seed)
            ckpt = fit.run_dir / "checkpoints" / "last.ckpt" if fit else None
            overrides = {**spec.overrides, **variant.overrides, **extra}
            overrides = _with_folders(overrides, run_dir=run_dir, fit_dir=fit and fit.run_dir)
            per_stage = _with_folders(
                variant.stage_overrides, run_dir=run_dir, fit_dir=fit and fit.run_dir
            )
            runs.append(
                make(variant.name, seed, overrides, spec.stages, run_dir, ckpt, fit, per_stage)
            )
    return list(fits.values()), runs


def _with_folders(value: Any, run_dir: Path, fit_dir: Path | None) -> Any:
    """``value`` with ``{run_dir}`` and ``{fit_dir}`` (if any) filled in every string it holds."""
    if isinstance(value, str):
        value = value.replace("{run_dir}", str(run_dir))
        return value if fit_dir is None else value.replace("{fit_dir}", str(fit_dir))
    if isinstance(value, dict):
        return {key: _with_folders(item, run_dir, fit_dir) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_folders(item, run_dir, fit_dir) for item in value]
    return value


def _last_checkpoint(run_dir: Path) -> dict[str, Any]:
    """A ModelCheckpoint that writes exactly ``<run_dir>/checkpoints/last.ckpt`` when fit ends."""
    return {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "dirpath": str(run_dir / "checkpoints"),
            "save_top_k": 0,
            "save_last": True,
            "enable_version_counter": False,
        },
    }


def _tail(log: Path, lines: int = 15) -> str:
    """The last non-empty lines of a log (progress-bar carriage returns split lines too)."""
    if not log.is_file():
        return f"no log at {log}"
    text = log.read_text(encoding="utf-8", errors="replace")
    kept = [line.rstrip()[:300] for line in re.split(r"[\r\n]+", text) if line.strip()]
    return "\n".join(kept[-lines:]) or f"{log} is empty"


def _read_metrics(
    run: _Run, metrics: list[Metric], check: bool
) -> tuple[dict[str, Any], str | None]:
    """Merged metrics of a run's stages, and an error if a file or a wanted metric is missing."""
    merged: dict[str, Any] = {}
    for stage, _ in run.calls:
        file = run.run_dir / f"{stage}.metrics.json"
        if not file.is_file():
            return merged, f"no metrics file {file} (did `ada {stage}` run?)"
        merged.update(json.loads(file.read_text(encoding="utf-8")))
    missing = [m.name for m in metrics if m.required and m.name not in merged] if check else []
    if missing:
        logged = ", ".join(sorted(merged)) or "nothing"
        return merged, f"metric {missing[0]!r} was not logged (logged: {logged})"
    return merged, None


def _execute(run: _Run, metrics: list[Metric], env: dict[str, str]) -> dict[str, Any]:
    """Run the stages of one run as ``python -m ada_modules`` subprocesses; return the outcome."""
    # Start clean, so that the checkpoint and metrics read afterwards are this attempt's.
    shutil.rmtree(run.run_dir, ignore_errors=True)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for stage, args in run.calls:
        log = run.run_dir / f"{stage}.log"
        code = _run_command([sys.executable, "-m", "ada_modules", stage, *args], log, env)
        if code != 0:
            wall = time.perf_counter() - start
            error = f"`ada {stage}` exited with code {code}; see {log}\n{_tail(log)}"
            return {"status": "failed", "metrics": {}, "wall_s": wall, "error": error}
    merged, error = _read_metrics(run, metrics, check=run.variant != _SHARED_FIT)
    wall = time.perf_counter() - start
    return {
        "status": "failed" if error else "ok",
        "metrics": merged,
        "wall_s": wall,
        "error": error,
    }


def _run_command(command: list[str], log: Path, env: dict[str, str]) -> int:
    """Run one CLI call with its output in ``log``; return its exit code."""
    with log.open("w", encoding="utf-8") as handle:
        handle.write(shlex.join(command) + "\n")
        handle.flush()
        return subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env).returncode


class _Results:
    """The records of a sweep in plan order, written atomically to results.json on every change."""

    def __init__(self, spec: SweepSpec, out: Path, quick: bool, fits: list[_Run], runs: list[_Run]):
        self.spec, self.out, self.quick = spec, out, quick
        self.slots: dict[tuple[str, int], RunRecord | None] = {
            (r.variant, r.seed): None for r in [*fits, *runs]
        }
        self.lock = threading.Lock()

    def set(self, record: RunRecord) -> None:
        with self.lock:
            self.slots[(record.variant, record.seed)] = record
            self.write()

    def records(self, shared: bool = False) -> list[RunRecord]:
        chosen = [r for r in self.slots.values() if r is not None]
        return [r for r in chosen if (r.variant == _SHARED_FIT) == shared]

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = {
            "spec": str(self.spec.path),
            "quick": self.quick,
            "metrics": [asdict(m) for m in self.spec.metrics],
            "runs": [asdict(r) for r in self.records()],
            "shared_fits": [asdict(r) for r in self.records(shared=True)],
        }
        path = self.out / "results.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)


def _previous(out: Path) -> list[RunRecord]:
    """Records of an earlier sweep in ``out`` (empty if there is none or it cannot be read)."""
    path = out / "results.json"
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [RunRecord(**r) for r in [*data["shared_fits"], *data["runs"]]]
    except (ValueError, KeyError, TypeError):
        print(f"ada sweep: ignoring unreadable {path}; running everything", file=sys.stderr)
        return []


def run_sweep(
    spec: str | Path | SweepSpec,
    out: str | Path | None = None,
    quick: bool = False,
    jobs: int = 1,
    dry_run: bool = False,
    collect: bool = False,
) -> list[RunRecord]:
    """Run a sweep (or print its commands, or collect their results) and write its report.

    Args:
        spec: A spec file or a :class:`SweepSpec`.
        out: Output folder; default ``sweeps/<spec name>`` in the working directory.
        quick: Add the spec's ``quick`` overrides to every run and use ``quick_seeds``.
        jobs: Runs to execute in parallel (each gets ``OMP_NUM_THREADS=cpus // jobs`` unless the
            variable is set).
        dry_run: Only print one ``ada ...`` shell line per run; run nothing, write nothing.
        collect: Run nothing; build the results from the metrics files that the ``--dry-run``
            commands wrote in ``out``.

    Returns:
        One record per variant and seed, in spec order (empty for ``dry_run``). Shared fits are
        in ``results.json`` only.

    Raises:
        SweepSpecError: The spec is invalid, or ``quick`` is set and the spec has no profile.
        ValueError: ``jobs < 1``, or both ``dry_run`` and ``collect``.

    Example::

        records = run_sweep("cli_configs/quickstart_sweep.yaml", out="/tmp/qs", quick=True)
        failed = [r for r in records if r.status == "failed"]
    """
    if jobs < 1:
        raise InputError(f"jobs must be at least 1, got {jobs}")
    if dry_run and collect:
        raise InputError("dry_run and collect exclude each other")
    if not isinstance(spec, SweepSpec):
        spec = SweepSpec.from_yaml(spec)
    out = Path(out if out is not None else Path("sweeps") / spec.name).resolve()
    fits, runs = _plan(spec, out, quick)
    if not collect:
        _check_calls(spec, [*fits, *runs])

    if dry_run:
        if fits:
            print(f"# {len(fits)} shared fit(s): run these first")
            print("\n".join(fit.shell() for fit in fits))
            print(f"# {len(runs)} run(s) using the shared fits")
        print("\n".join(run.shell() for run in runs))
        return []

    results = _Results(spec, out, quick, fits, runs)
    if collect:
        for run in [*fits, *runs]:
            merged, error = _read_metrics(run, spec.metrics, check=run.variant != _SHARED_FIT)
            status = "failed" if error else "ok"
            results.slots[(run.variant, run.seed)] = run.record(
                spec.base, status=status, metrics=merged, error=error
            )
    else:
        _execute_all(spec, results, fits, runs, jobs)
    results.write()
    return _report(spec, out, results.records(), results.records(shared=True))


def _check_calls(spec: SweepSpec, runs: list[_Run]) -> None:
    """Parse the first call of each variant in-process (``--print_config``, nothing runs), so
    that a misspelled key or a bad value fails the spec before any run starts."""
    from ada_modules.cli import main

    checked = set()
    for run in runs:
        if run.variant in checked:
            continue
        checked.add(run.variant)
        stage, args = run.calls[0]
        errors = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            try:
                main([stage, *args, "--print_config"])
            except SystemExit as exit_info:
                if exit_info.code:
                    message = errors.getvalue().strip().splitlines()[-1]
                    message = message.removeprefix("ada: error: ")
                    what = "the shared fit" if run.variant == _SHARED_FIT else run.variant
                    raise SweepSpecError(f"{spec.path}: {what!r}: {message}") from None


def _execute_all(
    spec: SweepSpec, results: _Results, fits: list[_Run], runs: list[_Run], jobs: int
) -> None:
    """Run the shared fits and the variant runs, ``jobs`` at a time, skipping finished ones.

    A variant run starts once the shared fit of its seed is done (not all of them).
    """
    env = dict(os.environ)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    earlier_records = {(r.variant, r.seed): r for r in _previous(results.out)}
    done = {key: r for key, r in earlier_records.items() if r.status == "ok"}
    # Keep the earlier records in results.json until their runs are redone, so that a sweep
    # killed again still remembers them (resume compares configurations before reusing one).
    for key in results.slots:
        results.slots[key] = earlier_records.get(key)
    total, counter, rerun_fits = len(fits) + len(runs), itertools.count(1), set()

    def label(run: _Run) -> str:
        what = "shared fit" if run.variant == _SHARED_FIT else f"variant={run.variant}"
        return f"{what} seed={run.seed}"

    def step(run: _Run) -> None:
        fresh = run.record(spec.base, status="failed", metrics={})
        earlier = done.get((run.variant, run.seed))
        dep = run.depends_on
        if earlier and earlier.same_run(fresh) and (dep is None or dep.seed not in rerun_fits):
            results.set(earlier)
            _progress(next(counter), total, label(run), "ok earlier, skipped")
            return
        if dep is not None and results.slots[(dep.variant, dep.seed)].status != "ok":
            error = f"shared fit for seed {run.seed} failed; see {dep.run_dir}"
            results.set(run.record(spec.base, status="failed", metrics={}, error=error))
            _progress(next(counter), total, label(run), "failed (no shared checkpoint)")
            return
        if run.variant == _SHARED_FIT:
            rerun_fits.add(run.seed)
        print(f"[start] {label(run)}", file=sys.stderr, flush=True)
        record = run.record(spec.base, **_execute(run, spec.metrics, env))
        results.set(record)
        outcome = f"{record.status} ({record.wall_s:.1f} s)"
        if record.error:
            outcome += f": {record.error.splitlines()[-1]}"
        _progress(next(counter), total, label(run), outcome)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            # Every shared fit is queued before any variant run, so a run that waits for its
            # seed's fit never holds a worker that fit needs; runs of the seeds whose fits were
            # queued first come first, so they start as soon as their own fit is done.
            fitted = {fit.seed: pool.submit(step, fit) for fit in fits}
            if fits:
                order = [fit.seed for fit in fits]
                runs = sorted(runs, key=lambda run: order.index(run.seed))

            def after_fit(run: _Run) -> None:
                if run.depends_on is not None:
                    fitted[run.depends_on.seed].result()
                step(run)

            for future in [*fitted.values(), *(pool.submit(after_fit, run) for run in runs)]:
                future.result()
        except BaseException:  # Ctrl-C: start no further runs
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _progress(index: int, total: int, label: str, outcome: str) -> None:
    print(f"[{index}/{total}] {label} ... {outcome}", file=sys.stderr, flush=True)


def _report(
    spec: SweepSpec, out: Path, records: list[RunRecord], shared_fits: list[RunRecord]
) -> list[RunRecord]:
    """Write results.md and the plots, print the table and what was written; return the records."""
    order = [v.name for v in spec.variants]
    table = format_table(records, spec.metrics, order)
    (out / "results.md").write_text(f"# {spec.name}\n\n{table}\n", encoding="utf-8")
    plots = plot_metrics(records, spec.metrics, out, order)
    print(table)
    failed = sum(r.status != "ok" for r in records)
    note = f"; {failed} failed (see results.json)" if failed else ""
    print(f"\n{len(records)} runs{note}.")
    print("\n".join(_outputs(spec, out, plots, records, shared_fits)))
    return records


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg", ".pdf")


def _outputs(
    spec: SweepSpec,
    out: Path,
    plots: list[Path],
    records: list[RunRecord],
    shared_fits: list[RunRecord],
) -> list[str]:
    """Lines naming the files the report wrote and the images the runs wrote, exactly.

    The images are found in the run folders of ``records`` and ``shared_fits`` (a run's folder is
    emptied before it runs, so they are that run's), grouped by their path inside the run folder.
    """
    lines = [
        f"Wrote to {out}: " + ", ".join(["results.json", "results.md", *(p.name for p in plots)])
    ]
    charted = {p.name for p in plots}
    missing = [m.name for m in spec.metrics if f"{file_name(m.name)}.png" not in charted]
    if missing:
        lines.append(f"No chart for {', '.join(missing)}: no successful run logged a finite value.")
    for kind, folder, group in (
        ("runs", "runs/<variant>/seed_<seed>", records),
        ("shared fits", "shared_fit/seed_<seed>", shared_fits),
    ):
        if not group:
            continue
        images = _run_images(group)
        if not images:
            lines.append(f"The {kind} wrote no images.")
            continue
        lines.append(f"Images written by the {kind} (in {out}/{folder}/):")
        lines += [f"  {name}: {count} of {len(group)} {kind}" for name, count in images.items()]
    return lines


def _run_images(records: list[RunRecord]) -> dict[str, int]:
    """How many of the run folders hold each image file, by its path inside the folder."""
    found: dict[str, int] = {}
    for record in records:
        run_dir = Path(record.run_dir)
        if not run_dir.is_dir():
            continue
        for path in run_dir.rglob("*"):
            if path.suffix.lower() in _IMAGE_SUFFIXES and path.is_file():
                name = path.relative_to(run_dir).as_posix()
                found[name] = found.get(name, 0) + 1
    return dict(sorted(found.items()))


def build_parser() -> ArgumentParser:
    """The ``ada sweep`` argument parser (its description is the one-line help of ``sweep``).

    Example::

        >>> build_parser().parse_args(["spec.yaml", "--quick", "--jobs", "2"]).jobs
        2
    """
    parser = ArgumentParser(
        prog="ada sweep",
        description="Run a YAML sweep of configs (variants x seeds); tabulate and plot the metrics.",
        exit_on_error=False,
    )
    parser.add_argument("spec", type=str, help="Sweep spec YAML file.")
    parser.add_argument("--quick", action="store_true", help="Use the spec's quick profile.")
    parser.add_argument(
        "--out", type=str | None, default=None, help="Output folder (default: sweeps/<spec name>)."
    )
    parser.add_argument("--jobs", type=int, default=1, help="Runs to execute in parallel.")
    parser.add_argument(
        "--dry-run", action="store_true", help="Print one shell line per run; run nothing."
    )
    parser.add_argument(
        "--collect", action="store_true", help="Collect the results of --dry-run commands."
    )
    return parser


def sweep_main(argv: list[str]) -> int:
    """``ada sweep ARGS``: parse ``argv``, run the sweep, return the exit code.

    Returns:
        0 when every run succeeded, 1 when some run failed, 2 for a bad argument or spec (one
        line on stderr), 130 when interrupted.

    Example::

        code = sweep_main(["cli_configs/quickstart_sweep.yaml", "--quick", "--out", "/tmp/qs"])
    """
    try:
        args = build_parser().parse_args(argv)
        records = run_sweep(
            args.spec,
            out=args.out,
            quick=args.quick,
            jobs=args.jobs,
            dry_run=args.dry_run,
            collect=args.collect,
        )
    except (ArgumentError, ValueError, OSError) as error:
        message = " ".join(str(error).split())
        print(f"ada sweep: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ada sweep: interrupted; finished runs are kept for the next run", file=sys.stderr)
        return 130
    return 1 if any(r.status != "ok" for r in records) else 0
