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
      size:                          # a named axis: each point sets several keys together,
        narrow: {model.init_args.intermediate_size: 128}  # named `size=narrow`, ...
        wide: {model.init_args.intermediate_size: 512, model.init_args.hidden_size: 96}
    seeds: [0, 1]                    # set as `seed_everything`; default [0]
    metrics:                         # logged metric names to collect and compare
      - test/exact_match             # mode `max`, except names containing loss, err,
      - {name: test/gen_length, mode: min}  # perplexity, ppl, time or latency: those are `min`
      - {name: train/adera_bytes_ratio, mode: min, required: false}  # may be missing: –
    quick:                           # overrides added to every run by `ada sweep --quick`
                                     # (after `overrides` and the variant's, so they win)
      trainer.max_steps: 20
    quick_seeds: [0]                 # seeds used by `--quick` (default: `seeds`)
    quick_variants: ["small,num_heads=2,size=narrow"]  # variants run by `--quick` (default: all)
    name: quickstart                 # default output folder is sweeps/<name>; default name: the
                                     # file stem (the folder name for a file called repro.yaml)

Override values are passed to the CLI as ``--key=value``: strings as they are, everything else
as JSON, so numbers, booleans, ``null``, lists and mappings keep their types. Before anything
runs, the first CLI call of each variant (and each shared fit) is parsed in-process with
``--print_config``: an unknown key or a value of the wrong type fails the spec with the CLI's
one-line error; a value that a component rejects when it is built fails that variant's runs,
with the error in the record. Besides the overrides, every call gets ``--seed_everything``,
``--trainer.default_root_dir=<run dir>`` and ``--metrics_file``; ``fit`` also gets a
``ModelCheckpoint(dirpath=<run dir>/checkpoints, save_last=True, save_top_k=0)`` appended to
``trainer.callbacks`` (so the base config must not set ``trainer.enable_checkpointing: false``),
and later stages get ``--ckpt_path=<run dir>/checkpoints/last.ckpt``.

Shared fit: with a top-level ``fit:`` mapping of overrides (``fit: {}`` for none), each seed is
trained once with the base config, those overrides and the quick profile; as soon as a seed's fit is
done, every variant runs only its evaluation ``stages`` (default ``[test]``; ``fit`` is not allowed
there) from that checkpoint, with its own overrides. Use it to compare inference-time choices (a KV
cache, an attention implementation) on one trained model.

Named shared fits: ``fits:`` (instead of ``fit:``) lists fits that run once per seed, in order,
before that seed's variants, e.g. a base model and then specialists fine-tuned from it::

    fits:
      - name: base                   # required, unique; folder DIR/shared_fit/base/seed_<seed>/
        base: train_base.yaml        # optional: its own config file(s) (default: the spec's base)
        overrides: {data.init_args.train_domains: [identity]}
      - name: rot90
        base: train_base.yaml
        overrides:                   # after the spec's `overrides`; may use earlier fits' folders
          data.init_args.train_domains: [rot90]
          trainer.callbacks:         # start from the base's weights (LoadWeights callback)
            - class_path: ada_modules.callbacks.LoadWeights
              init_args: {path: "{fit_dir:base}/checkpoints/last.ckpt"}
        quick: {trainer.max_epochs: 2}  # optional: after the spec's `quick`, with --quick
    stages: [test]                   # the variants' stages (default [test]; [fit, ...] fine-tunes)
    variants:
      - name: ta                     # names the checkpoints it loads: no --ckpt_path is added
        base: train_base.yaml        # optional, as for a fit: its own config file(s)
        overrides: {model.init_args.base_model: "{fit_dir:base}/checkpoints/last.ckpt"}

Each fit is an ``ada fit`` call like the shared fit's, with the spec's ``overrides``, its own, then
(with ``--quick``) the spec's ``quick`` and its own. A fit starts after the fits before it of its
seed succeeded, the variant runs of a seed after all its fits; if a fit fails, the later fits and
the variant runs of that seed fail without running, naming it. Changing a fit reruns it, the later
fits of its seed and their variant runs. With ``fit`` among the ``stages``, every variant trains
too, starting where its overrides say (e.g. a ``LoadWeights`` callback on a fit's checkpoint: one
shared warm start, then each arm's own training), and its later stages use its own checkpoint.
With ``--quick`` and ``quick_variants``, only the fits those variants use run: the fits whose
folders they name, ``{fit_dir}`` standing for the last fit, and the fits those name in turn.

Folders in values: inside any string override value, ``{run_dir}`` stands for the run's own folder
and ``{fit_dir}`` for the folder of the same seed's shared fit, e.g. to write a file from a callback
during the shared fit and read it in every variant (``{fit_dir}/aad/aad_profile.json``). With
``fits``, ``{fit_dir:NAME}`` is the folder of the same seed's fit ``NAME`` and ``{fit_dir}`` that of
the last fit; a fit (with the spec's ``overrides`` and ``quick``, which reach it too) may use only
the folders of the fits before it, a variant those of any fit.

Outputs (``--out DIR``, default ``sweeps/<name>``): ``DIR/results.json`` (``runs``: one record per
variant and seed, see :class:`RunRecord`; ``shared_fits``: one per shared fit and seed),
``DIR/results.md`` (per variant: successful/all runs and ``mean ± std`` over the successful seeds,
the mean alone for one seed, the best mean in bold; see
:func:`ada_modules.sweep_report.format_table`), ``DIR/<metric>.png`` (``/`` in metric names becomes
``_``; a chart of the mean ± std per variant, for every metric that some run logged; see
:func:`ada_modules.sweep_report.plot_metrics`) and, per run, ``DIR/runs/<variant>/seed_<seed>/``
with ``<stage>.log`` (the CLI's output), ``<stage>.metrics.json``, ``checkpoints/last.ckpt`` and
whatever the run's callbacks write under its ``default_root_dir`` (e.g. images). Shared fits live in
``DIR/shared_fit/seed_<seed>/`` (with ``fits``: ``DIR/shared_fit/<name>/seed_<seed>/``). At the end
the sweep prints what it wrote: the report files by name, the metrics left without a chart, and
every image found in the run and shared-fit folders (path inside the folder, and in how many of
them), or that the runs wrote none. A spec that promises images from its runs is held to it by that
list, for the profile that was run.

Resume: a run already recorded as ``ok`` in ``DIR/results.json`` with the same base, stages and
overrides (and shared fits) is skipped, unless a shared fit it comes after was run again;
``results.json`` is rewritten atomically after every run, so an interrupted sweep loses at most the
runs in progress. ``--jobs N`` runs N at a time, each with ``OMP_NUM_THREADS`` = CPUs / N unless
that variable is set.

Cluster: ``ada sweep SPEC --dry-run`` prints one self-contained shell line per run (shared fits
first, in order, after a ``#`` comment line); run them anywhere that shares ``DIR``, then
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
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from jsonargparse import ArgumentError, ArgumentParser

from ada_modules.errors import InputError
from ada_modules.sweep_report import file_name, format_runs_table, format_table, plot_metrics
from ada_modules.sweep_spec import (
    _FIT_DIR,
    Metric,
    SharedFit,
    SweepSpec,
    SweepSpecError,
    Variant,
    expand_grid,
    override_args,
)

__all__ = [
    "Metric",
    "RunRecord",
    "SharedFit",
    "SweepSpec",
    "SweepSpecError",
    "Variant",
    "build_parser",
    "expand_grid",
    "override_args",
    "run_sweep",
    "sweep_main",
]

_SHARED_FIT = "(shared fit)"


@dataclass
class RunRecord:
    """The outcome of one run (a variant and a seed), as stored in ``results.json``.

    Attributes:
        variant: Variant name (``"(shared fit)"`` for the shared fit of ``fit``,
            ``"(shared fit: NAME)"`` for the shared fit ``NAME`` of ``fits``).
        seed: The ``seed_everything`` value.
        status: ``"ok"`` or ``"failed"``.
        metrics: Every metric the run's stages logged (later stages win on equal names);
            ``None`` for a non-finite value.
        overrides: The overrides the run used (the spec's ``overrides``, the variant's, then the
            quick profile).
        stages: The subcommands it ran.
        base: The base config files (a shared fit of ``fits``: its own).
        shared_fit: The overrides of the shared fits the run used: those of ``fit``, or, with
            ``fits``, a mapping of fit name to the overrides it ran with (the fits it comes
            after, for a fit); ``None`` for none.
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


@dataclass(frozen=True)
class _Run:
    """One planned run: its record fields and the CLI calls (stage, argument list) that make it.

    ``depends_on``: the shared fits of its seed that must have succeeded before it starts (for a
    fit of ``fits``, the fits before it), in order. ``fit_name``: a fit of ``fits``.
    """

    variant: str
    seed: int
    overrides: dict[str, Any]
    stages: tuple[str, ...]
    run_dir: Path
    calls: tuple[tuple[str, tuple[str, ...]], ...]
    shared_fit: dict[str, Any] | None
    base: tuple[Path, ...]
    depends_on: tuple[_Run, ...] = ()
    is_fit: bool = False
    fit_name: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.variant, self.seed

    def describe(self) -> str:
        """``shared fit``, ``shared fit 'NAME'`` or ``variant=NAME``."""
        if not self.is_fit:
            return f"variant={self.variant}"
        return "shared fit" + (f" {self.fit_name!r}" if self.fit_name else "")

    def shell(self) -> str:
        return " && ".join(shlex.join(["ada", stage, *args]) for stage, args in self.calls)

    def record(self, **outcome: Any) -> RunRecord:
        return RunRecord(
            variant=self.variant,
            seed=self.seed,
            overrides=self.overrides,
            stages=list(self.stages),
            base=[str(b) for b in self.base],
            shared_fit=self.shared_fit,
            run_dir=str(self.run_dir),
            command=self.shell(),
            base_sha256=_files_sha256(self.base),
            **outcome,
        )


def _files_sha256(files: tuple[Path, ...]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()


def _plan(spec: SweepSpec, out: Path, quick: bool) -> tuple[list[_Run], list[_Run]]:
    """The shared fits (in order for each seed, seed after seed; or none) and the variant runs."""
    if quick and spec.quick is None:
        raise SweepSpecError(f"{spec.path}: --quick needs a 'quick' profile in the spec")
    extra = spec.quick if quick else {}
    seeds = spec.quick_seeds if quick and spec.quick_seeds else spec.seeds

    def make(
        variant: str,
        seed: int,
        overrides: dict[str, Any],
        stages: list[str],
        run_dir: Path,
        base: list[Path],
        ckpt: Path | None,
        shared: dict[str, Any] | None = None,
        depends_on: tuple[_Run, ...] = (),
        stage_overrides: dict[str, dict[str, Any]] | None = None,
        fit_name: str | None = None,
    ) -> _Run:
        calls = []
        stage_overrides = stage_overrides or {}
        for stage in stages:
            args = [
                *(arg for file in base for arg in ("-c", str(file))),
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
        # recorded (and compared when resuming) as "<stage>:<key>"
        recorded = {
            **overrides,
            **{f"{st}:{k}": v for st, extra in stage_overrides.items() for k, v in extra.items()},
        }
        is_fit = fit_name is not None or variant == _SHARED_FIT
        return _Run(
            variant,
            seed,
            recorded,
            tuple(stages),
            run_dir,
            tuple(calls),
            shared,
            tuple(base),
            depends_on,
            is_fit,
            fit_name,
        )

    variants = spec.variants
    if quick and spec.quick_variants is not None:
        variants = [v for v in variants if v.name in spec.quick_variants]
    # a quick profile that runs some variants runs only the fits they need
    needed = _fits_needed(spec, variants) if quick and spec.quick_variants is not None else None
    fits: dict[int, list[_Run]] = {}  # by seed, in the order they run
    for seed in seeds:
        chain = fits[seed] = []
        if spec.shared_fit is not None:
            fit_dir = out / "shared_fit" / f"seed_{seed}"
            overrides = {**spec.overrides, **spec.shared_fit, **extra}
            overrides = _with_folders(overrides, run_dir=fit_dir, fit_dir=fit_dir)
            chain.append(make(_SHARED_FIT, seed, overrides, ["fit"], fit_dir, spec.base, None))
        dirs: dict[str, Path] = {}  # the folders of this seed's earlier fits
        for fit in spec.fits or []:
            if needed is not None and fit.name not in needed:
                continue
            fit_dir = out / "shared_fit" / fit.name / f"seed_{seed}"
            own_quick = (fit.quick or {}) if quick else {}
            overrides = {**spec.overrides, **fit.overrides, **extra, **own_quick}
            overrides = _with_folders(overrides, run_dir=fit_dir, fit_dir=None, fit_dirs=dirs)
            shared = {f.fit_name: f.overrides for f in chain} or None
            chain.append(
                make(
                    f"(shared fit: {fit.name})",
                    seed,
                    overrides,
                    ["fit"],
                    fit_dir,
                    fit.base,
                    None,
                    shared,
                    tuple(chain),
                    fit_name=fit.name,
                )
            )
            dirs[fit.name] = fit_dir
    runs = []
    for variant in variants:
        for seed in seeds:
            run_dir = out / "runs" / file_name(variant.name) / f"seed_{seed}"
            chain = fits[seed]
            fit_dir = chain[-1].run_dir if chain else None
            dirs = {fit.fit_name: fit.run_dir for fit in chain if fit.fit_name}
            if spec.shared_fit is not None:  # the variants load the shared fit's checkpoint
                ckpt, shared = fit_dir / "checkpoints" / "last.ckpt", spec.shared_fit
            else:  # with `fits`, they name the checkpoints they load in their overrides
                ckpt, shared = None, {fit.fit_name: fit.overrides for fit in chain} or None
            overrides = {**spec.overrides, **variant.overrides, **extra}
            overrides = _with_folders(overrides, run_dir, fit_dir, dirs)
            per_stage = _with_folders(variant.stage_overrides, run_dir, fit_dir, dirs)
            runs.append(
                make(
                    variant.name,
                    seed,
                    overrides,
                    spec.stages,
                    run_dir,
                    variant.base or spec.base,
                    ckpt,
                    shared,
                    tuple(chain),
                    per_stage,
                )
            )
    return [fit for seed in seeds for fit in fits[seed]], runs


def _folders_named(value: Any) -> set[str | None]:
    """The fit names of the ``{fit_dir:NAME}`` in ``value``'s strings (``None``: ``{fit_dir}``)."""
    if isinstance(value, str):
        return {match[1] for match in _FIT_DIR.finditer(value)}
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return set().union(*(_folders_named(item) for item in items))


def _fits_needed(spec: SweepSpec, variants: list[Variant]) -> set[str]:
    """The fits of ``spec.fits`` that ``variants`` use: the fits whose folders they (or the spec's
    ``overrides`` and ``quick``) name, ``{fit_dir}`` standing for the last fit, and in turn the
    fits those name (a fit names only earlier ones)."""
    fits = spec.fits or []
    wanted = _folders_named([spec.overrides, spec.quick or {}])
    for variant in variants:
        wanted |= _folders_named([variant.overrides, variant.stage_overrides])
    if None in wanted and fits:
        wanted.add(fits[-1].name)
    for fit in reversed(fits):
        if fit.name in wanted:
            wanted |= _folders_named([fit.overrides, fit.quick or {}])
    return {name for name in wanted if name is not None}


def _with_folders(
    value: Any, run_dir: Path, fit_dir: Path | None, fit_dirs: dict[str, Path] | None = None
) -> Any:
    """``value`` with ``{run_dir}``, ``{fit_dir}`` (if given) and ``{fit_dir:NAME}`` (for the
    names in ``fit_dirs``) filled in every string it holds."""
    if isinstance(value, str):
        value = value.replace("{run_dir}", str(run_dir))
        if fit_dirs:
            value = _FIT_DIR.sub(lambda m: str(fit_dirs.get(m[1], m[0])), value)
        return value if fit_dir is None else value.replace("{fit_dir}", str(fit_dir))
    if isinstance(value, dict):
        return {key: _with_folders(item, run_dir, fit_dir, fit_dirs) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_folders(item, run_dir, fit_dir, fit_dirs) for item in value]
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
    merged, error = _read_metrics(run, metrics, check=not run.is_fit)
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
        self.slots: dict[tuple[str, int], RunRecord | None] = {r.key: None for r in [*fits, *runs]}
        self.fit_keys = {fit.key for fit in fits}
        self.lock = threading.Lock()

    def set(self, record: RunRecord) -> None:
        with self.lock:
            self.slots[(record.variant, record.seed)] = record
            self.write()

    def records(self, shared: bool = False) -> list[RunRecord]:
        """The records of the variant runs, or of the shared fits."""
        return [
            r for key, r in self.slots.items() if r is not None and (key in self.fit_keys) == shared
        ]

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
            in_order = ", in order" if spec.fits else ""
            print(f"# {len(fits)} shared fit(s): run these first{in_order}")
            print("\n".join(fit.shell() for fit in fits))
            print(f"# {len(runs)} run(s) using the shared fits")
        print("\n".join(run.shell() for run in runs))
        return []

    results = _Results(spec, out, quick, fits, runs)
    if collect:
        for run in [*fits, *runs]:
            merged, error = _read_metrics(run, spec.metrics, check=not run.is_fit)
            status = "failed" if error else "ok"
            results.slots[run.key] = run.record(status=status, metrics=merged, error=error)
    else:
        _execute_all(spec, results, fits, runs, jobs)
    results.write()
    return _report(spec, out, results.records(), results.records(shared=True))


def _check_calls(spec: SweepSpec, runs: list[_Run]) -> None:
    """Parse every stage's call of each variant's first run in-process (``--print_config``,
    nothing runs), so that a misspelled key or a bad value, in a later stage's overrides too,
    fails the spec before any run starts."""
    from ada_modules.cli import main

    checked = set()
    for run in runs:
        if run.variant in checked:
            continue
        checked.add(run.variant)
        for index, (stage, args) in enumerate(run.calls):
            errors = io.StringIO()
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
                try:
                    main([stage, *args, "--print_config"])
                except SystemExit as exit_info:
                    if exit_info.code:
                        message = errors.getvalue().strip().splitlines()[-1]
                        message = message.removeprefix("ada: error: ")
                        what = "the shared fit" if run.variant == _SHARED_FIT else repr(run.variant)
                        if index:  # a later stage's overrides
                            what += f" ({stage})"
                        raise SweepSpecError(f"{spec.path}: {what}: {message}") from None


def _execute_all(
    spec: SweepSpec, results: _Results, fits: list[_Run], runs: list[_Run], jobs: int
) -> None:
    """Run the shared fits and the variant runs, ``jobs`` at a time, skipping finished ones.

    A run starts once the shared fits it depends on are done: a fit of ``fits`` after the fits
    before it, a variant run after the fits of its seed (not all of them). If one of those
    failed, the run fails without starting, naming it.
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
    total, counter = len(fits) + len(runs), itertools.count(1)
    rerun_fits: set[tuple[str, int]] = set()

    def label(run: _Run) -> str:
        return f"{run.describe()} seed={run.seed}"

    def step(run: _Run) -> None:
        earlier = done.get(run.key)
        fresh = run.record(status="failed", metrics={})
        deps_kept = not any(dep.key in rerun_fits for dep in run.depends_on)
        if earlier and earlier.same_run(fresh) and deps_kept:
            # read its metrics again: the spec may now want one it did not log
            merged, error = _read_metrics(run, spec.metrics, check=not run.is_fit)
            if error and "was not logged" in error:
                results.set(run.record(status="failed", metrics=merged, error=error))
                _progress(next(counter), total, label(run), f"ran earlier, failed: {error}")
                return
            if not error:
                results.set(replace(earlier, metrics=merged))
                _progress(next(counter), total, label(run), "ok earlier, skipped")
                return
        failed = [dep for dep in run.depends_on if results.slots[dep.key].status != "ok"]
        if failed:
            error = f"{failed[0].describe()} for seed {run.seed} failed; see {failed[0].run_dir}"
            results.set(run.record(status="failed", metrics={}, error=error))
            _progress(next(counter), total, label(run), "failed (no shared checkpoint)")
            return
        if run.is_fit:
            rerun_fits.add(run.key)
        print(f"[start] {label(run)}", file=sys.stderr, flush=True)
        record = run.record(**_execute(run, spec.metrics, env))
        results.set(record)
        outcome = f"{record.status} ({record.wall_s:.1f} s)"
        if record.error:
            outcome += f": {record.error.splitlines()[-1]}"
        _progress(next(counter), total, label(run), outcome)

    # A run waits only for runs queued before it, so it never holds a worker that one of them
    # needs: every shared fit is queued before any variant run, the fits of ``fits`` by their
    # place in the order (the first fit of every seed, then the second, ...), and the runs of
    # the seeds whose fits were queued first come first, so they start once their fits are done.
    fits = sorted(fits, key=lambda fit: len(fit.depends_on))
    seed_order = list(dict.fromkeys(fit.seed for fit in fits))
    if fits:
        runs = sorted(runs, key=lambda run: seed_order.index(run.seed))
    futures: dict[tuple[str, int], Future[None]] = {}

    def after_deps(run: _Run) -> None:
        for dep in run.depends_on:
            futures[dep.key].result()
        step(run)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            for run in [*fits, *runs]:
                futures[run.key] = pool.submit(after_deps, run)
            for future in list(futures.values()):
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
    ran = {r.variant for r in records}
    order = [v.name for v in spec.variants if v.name in ran]  # `quick_variants` may skip some
    table = format_table(records, spec.metrics, order)
    runs = format_runs_table(records, spec.metrics)
    (out / "results.md").write_text(
        f"# {spec.name}\n\n{table}\n\n## Every run\n\n{runs}\n", encoding="utf-8"
    )
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
    fit_folder = "shared_fit/<fit>/seed_<seed>" if spec.fits else "shared_fit/seed_<seed>"
    for kind, folder, group in (
        ("runs", "runs/<variant>/seed_<seed>", records),
        ("shared fits", fit_folder, shared_fits),
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
