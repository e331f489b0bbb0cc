"""``ada sweep``: spec validation, grid naming, override serialisation, aggregation, and real sweeps.

The end-to-end tests run the real ``python -m ada_modules fit/test`` subprocesses on a tiny
fixture model (``tests/sweep_fixtures/sweep_fixture_model.py``) whose ``test/score`` is
``10 * score + seed`` and whose ``test/steps`` counts the training steps in the weights it was
tested with, so every number in the tables is known exactly.
"""

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from jsonargparse import ArgumentParser

from ada_modules import sweep
from ada_modules.errors import InputError
from ada_modules.sweep import (
    Metric,
    RunRecord,
    SweepSpec,
    SweepSpecError,
    Variant,
    expand_grid,
    override_args,
    run_sweep,
    sweep_main,
)
from ada_modules.sweep_report import format_table, plot_metrics, summarize

FIXTURES = Path(__file__).parent / "sweep_fixtures"
BASE = FIXTURES / "base.yaml"
ROOT = Path(__file__).resolve().parents[1]
ALLOWED = "base, fit, fits, grid, metrics, name, overrides, quick, quick_seeds, quick_variants, seeds, stages, variants"


@pytest.fixture(scope="module", autouse=True)
def subprocess_env():
    """The CLI subprocesses import ``sweep_fixture_model`` by class path, with one thread each."""
    with pytest.MonkeyPatch.context() as patch:
        path = os.pathsep.join(filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")]))
        patch.setenv("PYTHONPATH", path)
        patch.syspath_prepend(str(FIXTURES))  # the in-process check of each variant's call
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


def write_spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"base: {BASE}\nmetrics: [test/score]\n{text}", encoding="utf-8")
    return path


def count_launches(monkeypatch) -> list[list[str]]:
    """Record every CLI subprocess the sweep starts (they still run)."""
    launched = []
    original = sweep._run_command

    def counting(command, log, env):
        launched.append(command)
        return original(command, log, env)

    monkeypatch.setattr(sweep, "_run_command", counting)
    return launched


def quietly(function, *args, **kwargs):
    """Call ``function`` and return (its result, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = function(*args, **kwargs)
    return result, out.getvalue(), err.getvalue()


# --- spec validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "hint"),
    [("variant", " (did you mean 'variants'?)"), ("seed", " (did you mean 'seeds'?)")],
)
def test_unknown_key_names_it_and_lists_the_allowed_keys(tmp_path, key, hint):
    spec = write_spec(tmp_path, f"{key}: [1]\n")
    with pytest.raises(SweepSpecError) as error:
        SweepSpec.from_yaml(spec)
    assert (
        str(error.value) == f"{spec.resolve()}: unknown key {key!r}{hint}; allowed keys: {ALLOWED}"
    )


def test_missing_base_file(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: nope.yaml\nmetrics: [a]\n")
    with pytest.raises(SweepSpecError) as error:
        SweepSpec.from_yaml(spec)
    assert str(error.value) == f"{spec.resolve()}: base config not found: {tmp_path / 'nope.yaml'}"


def test_empty_variants(tmp_path):
    spec = write_spec(tmp_path, "variants: []\n")
    with pytest.raises(SweepSpecError) as error:
        SweepSpec.from_yaml(spec)
    assert str(error.value) == (
        f"{spec.resolve()}: 'variants' must be a non-empty list of {{name, overrides}}"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stages: [fit, tset]\n", "unknown stage 'tset' in 'stages'; allowed: fit, validate"),
        ("stages: [test, fit]\n", "'fit' must be the first of 'stages'"),
        ("fit: {}\nstages: [fit, test]\n", "must not include 'fit' when a shared 'fit'"),
        ("seeds: [0, x]\n", "'seeds' must be a non-empty list of distinct integers"),
        ("seeds: 3\n", "'seeds' must be a non-empty list of distinct integers, got 3"),
        ("variants: [{name: a}, {name: a}]\n", "variants 'a' and 'a' have the same name"),
        ("variants: [{name: a, overide: {}}]\n", "unknown key 'overide' in variant 'a'"),
        ("variants: [{name: a, overrides: {--x: 1}}]\n", "bad override key '--x'"),
        ("grid: {trainer.max_steps: 3}\n", "grid key 'trainer.max_steps' must have a non-empty"),
        ("quick: [1]\n", "'quick' must be a mapping of dotted keys"),
        ("quick_variants: []\n", "'quick_variants' must be a non-empty list of variant names"),
        ("variants: [{name: a}]\nquick_variants: [b]\n", "names unknown variants ['b']"),
    ],
)
def test_bad_specs_fail_with_one_line_naming_the_key(tmp_path, text, message):
    with pytest.raises(SweepSpecError) as error:
        SweepSpec.from_yaml(write_spec(tmp_path, text))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_metrics_and_yaml(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"base: {BASE}\nmetrics: [{{name: a, mode: up}}]\n")
    with pytest.raises(SweepSpecError, match="mode of 'a' must be 'max' or 'min', got 'up'"):
        SweepSpec.from_yaml(spec)
    spec.write_text(f"base: {BASE}\n")
    with pytest.raises(SweepSpecError, match="'metrics' must be a non-empty list"):
        SweepSpec.from_yaml(spec)
    spec.write_text("base: [a\n")
    with pytest.raises(SweepSpecError, match="invalid YAML at line 2"):
        SweepSpec.from_yaml(spec)
    with pytest.raises(SweepSpecError, match="sweep spec not found"):
        SweepSpec.from_yaml(tmp_path / "missing.yaml")


def test_quick_needs_a_quick_profile(tmp_path):
    with pytest.raises(SweepSpecError, match="--quick needs a 'quick' profile"):
        run_sweep(write_spec(tmp_path, ""), out=tmp_path / "out", quick=True, dry_run=True)


def test_defaults_and_names(tmp_path):
    spec = SweepSpec.from_yaml(write_spec(tmp_path, "", name="my_sweep.yaml"))
    assert spec.name == "my_sweep"
    assert spec.base == [BASE.resolve()]
    assert spec.stages == ["fit", "test"]
    assert spec.variants == [Variant("base", {})]
    assert spec.seeds == [0]
    assert spec.shared_fit is None and spec.quick is None
    (tmp_path / "adakvq").mkdir()
    repro = write_spec(tmp_path / "adakvq", "fit: {}\n", name="repro.yaml")
    spec = SweepSpec.from_yaml(repro)
    assert (spec.name, spec.stages, spec.shared_fit) == ("adakvq", ["test"], {})


def test_sweep_main_and_cli_exit_2_with_one_line(tmp_path, capsys):
    spec = write_spec(tmp_path, "variant: []\n")
    assert sweep_main([str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ada sweep: error: ") and "unknown key 'variant'" in err
    assert err.count("\n") == 1
    assert sweep_main([str(spec), "--jobs", "zero"]) == 2
    assert "jobs" in capsys.readouterr().err

    from ada_modules.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", str(spec), "--dry-run"])
    assert exit_info.value.code == 2
    assert "unknown key 'variant'" in capsys.readouterr().err


# --- grid, overrides, metrics -----------------------------------------------------------------


def test_grid_is_a_cartesian_product_with_short_unique_names():
    variants = expand_grid(
        {"model.init_args.hidden_size": [64, 128], "trainer.max_steps": [10, 20], "x.flag": [True]}
    )
    assert [v.name for v in variants] == [
        "hidden_size=64,max_steps=10,flag=true",
        "hidden_size=64,max_steps=20,flag=true",
        "hidden_size=128,max_steps=10,flag=true",
        "hidden_size=128,max_steps=20,flag=true",
    ]
    assert variants[1].overrides == {
        "model.init_args.hidden_size": 64,
        "trainer.max_steps": 20,
        "x.flag": True,
    }
    # Keys that end alike keep their full name.
    names = [v.name for v in expand_grid({"model.init_args.lr": [1], "data.init_args.lr": [2]})]
    assert names == ["model.init_args.lr=1,data.init_args.lr=2"]


def test_variants_times_grid(tmp_path):
    spec = SweepSpec.from_yaml(
        write_spec(
            tmp_path,
            "variants:\n  - {name: kivi, overrides: {model.init_args.cache: kivi}}\n"
            "  - {name: ada}\ngrid: {model.init_args.bits: [2, 4]}\n",
        )
    )
    assert [v.name for v in spec.variants] == [
        "kivi,bits=2",
        "kivi,bits=4",
        "ada,bits=2",
        "ada,bits=4",
    ]
    assert spec.variants[1].overrides == {
        "model.init_args.cache": "kivi",
        "model.init_args.bits": 4,
    }


def test_override_values_keep_their_types_through_jsonargparse():
    values = {
        "a_int": 3,
        "a_float": 1e-3,
        "a_bool": False,
        "a_none": None,
        "a_str": "two words",
        "a_list": [1, 2],
        "a_dict": {"k": [0.5, "v"]},
    }
    args = override_args(values)
    assert args[:4] == ["--a_int=3", "--a_float=0.001", "--a_bool=false", "--a_none=null"]
    assert args[4:] == ["--a_str=two words", "--a_list=[1, 2]", '--a_dict={"k": [0.5, "v"]}']
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--a_int", type=int)
    parser.add_argument("--a_float", type=float)
    parser.add_argument("--a_bool", type=bool)
    parser.add_argument("--a_none", type=int | None, default=7)
    parser.add_argument("--a_str", type=str)
    parser.add_argument("--a_list", type=list[int])
    parser.add_argument("--a_dict", type=dict[str, list[float | str]])
    assert vars(parser.parse_args(args)) == values


def test_misspelled_override_key_fails_before_any_run(tmp_path, monkeypatch):
    launched = count_launches(monkeypatch)
    spec = write_spec(
        tmp_path, "variants:\n  - {name: typo, overrides: {model.init_args.scroe: 1.0}}\n"
    )
    with pytest.raises(SweepSpecError, match=r"'typo': model: .*'scroe' is not accepted"):
        run_sweep(spec, out=tmp_path / "out")
    assert launched == [] and not (tmp_path / "out").exists()


def test_editing_the_base_config_invalidates_resume(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(BASE.read_text(), encoding="utf-8")
    spec = SweepSpec.from_dict(
        {"base": str(base), "metrics": ["test/score"], "seeds": [0]}, tmp_path / "spec.yaml"
    )
    _, (run,) = sweep._plan(spec, tmp_path, quick=False)
    before = run.record(status="ok", metrics={})
    base.write_text(BASE.read_text() + "\n# edited\n", encoding="utf-8")
    after = run.record(status="ok", metrics={})
    assert before.base == after.base and not before.same_run(after)


def test_quick_variants_limit_the_quick_profile_only(tmp_path):
    spec = write_spec(
        tmp_path,
        "variants: [{name: a}, {name: b}]\ngrid: {trainer.max_steps: [1, 2]}\n"
        "quick: {}\nquick_variants: ['b,max_steps=2']\n",
    )
    _, quick, _ = quietly(run_sweep, spec, out=tmp_path / "q", quick=True, dry_run=True)
    _, full, _ = quietly(run_sweep, spec, out=tmp_path / "f", dry_run=True)
    assert len(quick.strip().splitlines()) == 1 and "runs/b,max_steps=2/" in quick
    assert len(full.strip().splitlines()) == 4


def test_common_variant_and_quick_overrides_in_that_order(tmp_path):
    spec = write_spec(
        tmp_path,
        "overrides: {trainer.max_steps: 1, trainer.logger: true}\n"
        "variants: [{name: v, overrides: {trainer.max_steps: 2, model.init_args.score: 3}}]\n"
        "quick: {model.init_args.score: 4}\n",
    )
    _, stdout, _ = quietly(run_sweep, spec, out=tmp_path / "out", quick=True, dry_run=True)
    fit = shlex.split(stdout.split(" && ")[0])
    assert fit[4:7] == [
        "--trainer.max_steps=2",
        "--trainer.logger=true",
        "--model.init_args.score=4",
    ]


def test_metric_modes():
    assert Metric.parse("test/exact_match") == Metric("test/exact_match", "max")
    assert Metric.parse("val/loss") == Metric("val/loss", "min")
    assert Metric.parse("test/latency_ms").mode == "min"
    assert Metric.parse({"name": "test/gen_length", "mode": "min"}).mode == "min"
    assert Metric.parse({"name": "train/loss", "mode": "max"}).mode == "max"


# --- aggregation and reports (pure) -----------------------------------------------------------


def record(variant, seed, metrics, status="ok"):
    return RunRecord(variant, seed, status, metrics, {}, [], [], None, "", "")


def test_mean_std_table_with_bold_best():
    records = [
        record("small", 0, {"test/acc": 0.5, "test/loss": 2.0}),
        record("small", 1, {"test/acc": 0.7, "test/loss": 1.0}),
        record("large", 0, {"test/acc": 0.9, "test/loss": 3.0}),
        record("large", 1, {"test/acc": 0.9, "test/loss": 5.0}),
        record("large", 2, {}, status="failed"),
        record("broken", 0, {}, status="failed"),
        record("nan", 0, {"test/acc": None, "test/loss": 1.0}),
    ]
    metrics = [Metric("test/acc"), Metric("test/loss", "min")]
    summary = summarize(records, metrics, order=["large", "small"])
    assert list(summary) == ["large", "small", "broken", "nan"]
    assert summary["small"]["test/acc"].mean == pytest.approx(0.6)
    assert summary["small"]["test/acc"].std == pytest.approx(0.1414213562)
    assert summary["large"]["test/acc"].n == 2
    assert format_table(records, metrics, order=["large", "small"]) == "\n".join(
        [
            "| variant | runs ok | test/acc ↑ | test/loss ↓ |",
            "|---|---|---|---|",
            "| large | 2/3 | **0.9 ± 0** | 4 ± 1.414 |",
            "| small | 2/2 | 0.6 ± 0.1414 | 1.5 ± 0.7071 |",
            "| broken | 0/1 | – | – |",
            "| nan | 1/1 | – (1 not finite) | **1** |",
        ]
    )


def test_a_diverged_run_is_counted_not_averaged():
    records = [
        record("deep", 0, {"val/loss": 1.3}),
        record("deep", 1, {"val/loss": 1.5}),
        record("deep", 2, {"val/loss": float("nan")}),
        record("deep", 3, {"val/loss": None}),  # how a metrics file holds NaN and infinity
        record("shallow", 0, {"val/loss": 1.45}),
    ]
    metrics = [Metric("val/loss", "min")]
    deep = summarize(records, metrics)["deep"]["val/loss"]
    assert (deep.mean, deep.n, deep.not_finite) == (pytest.approx(1.4), 2, 2)
    assert format_table(records, metrics).splitlines()[2:] == [
        "| deep | 4/4 | 1.4 ± 0.1414 (2 not finite) |",
        "| shallow | 1/1 | **1.45** |",  # the best of the runs that did not diverge
    ]


def test_plots_one_png_per_metric_with_safe_names(tmp_path):
    records = [record("a", 0, {"test/acc": 1.0}), record("b", 0, {"test/acc": 2.0})]
    metrics = [Metric("test/acc"), Metric("test/never_logged")]
    (tmp_path / "test_never_logged.png").write_bytes(b"a chart of an earlier sweep")
    paths = plot_metrics(records, metrics, tmp_path)
    assert paths == [tmp_path / "test_acc.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(tmp_path.iterdir()) == paths  # the stale chart is gone: exactly what was written


@pytest.mark.parametrize(
    "values",
    [
        {"fp": [0.95, 0.96], "kivi2": [0.93, 0.925], "adakvq": [0.94]},
        {"a": [1200.0, 1300.0], "b": [1250.0, 1250.0]},
        {"a": [-3.0], "b": [-2.0]},
        {"a": [0.0], "b": [0.02]},  # non-negative data: the margin stops at 0
    ],
)
def test_chart_y_axis_fits_the_data_and_its_error_bars(values):
    from ada_modules.sweep_report import metric_figure

    records = [record(v, s, {"m": x}) for v, xs in values.items() for s, x in enumerate(xs)]
    summaries = summarize(records, [Metric("m")])
    ends = [
        (row["m"].mean - (row["m"].std or 0.0), row["m"].mean + (row["m"].std or 0.0))
        for row in summaries.values()
    ]
    low, high = min(e[0] for e in ends), max(e[1] for e in ends)
    axes = metric_figure(summaries, Metric("m")).axes[0]
    bottom, top = axes.get_ylim()
    # Every mean ± std is inside the axis, with a margin of at most 10 % of the data's span on
    # each side: the axis no longer starts at 0, which made 0.93 and 0.95 look the same.
    margin = 0.1 * (high - low) + 1e-9
    assert low - margin <= bottom <= low and high <= top <= high + margin
    assert not axes.patches, "no bars: their length would be read from a baseline that is not 0"
    assert metric_figure(summarize([record("a", 0, {})], [Metric("m")]), Metric("m")) is None


def test_y_range_of_equal_values_and_zero():
    from ada_modules.sweep_report import y_range

    assert y_range([0.93, 0.95], [0.0, 0.0]) == (0.928, 0.952)
    assert y_range([5.0, 5.0], [0.0, 0.0]) == (4.75, 5.25)
    assert y_range([0.0], [0.0]) == (0.0, 0.5)
    assert y_range([-1.0], [0.0]) == (-1.05, -0.95)


def test_report_lists_exactly_the_files_written(tmp_path, capsys):
    spec = SweepSpec.from_dict(
        {"base": str(BASE), "metrics": ["test/acc", "test/never_logged"], "name": "r"},
        tmp_path / "spec.yaml",
    )
    runs = []
    for seed in (0, 1):
        run_dir = tmp_path / "runs" / "base" / f"seed_{seed}"
        run_dir.mkdir(parents=True)
        runs.append(
            RunRecord("base", seed, "ok", {"test/acc": 0.9}, {}, [], [], None, str(run_dir), "")
        )
    (tmp_path / "runs" / "base" / "seed_0" / "conn").mkdir()
    (tmp_path / "runs" / "base" / "seed_0" / "conn" / "m_step50.png").write_bytes(b"png")
    (tmp_path / "runs" / "base" / "seed_0" / "fit.log").write_text("not an image")
    fit_dir = tmp_path / "shared_fit" / "seed_0"
    fit_dir.mkdir(parents=True)
    fit = RunRecord("(shared fit)", 0, "ok", {}, {}, [], [], None, str(fit_dir), "")
    sweep._report(spec, tmp_path, runs, [fit])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-5:] == [
        f"Wrote to {tmp_path}: results.json, results.md, test_acc.png",
        "No chart for test/never_logged: no successful run logged a finite value.",
        f"Images written by the runs (in {tmp_path}/runs/<variant>/seed_<seed>/):",
        "  conn/m_step50.png: 1 of 2 runs",
        "The shared fits wrote no images.",
    ]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["test_acc.png"]


# --- dry run (no subprocess) ------------------------------------------------------------------


def test_dry_run_prints_one_self_contained_line_per_run(tmp_path):
    out = tmp_path / "out"
    _, stdout, _ = quietly(run_sweep, FIXTURES / "main.yaml", out=out, quick=True, dry_run=True)
    lines = stdout.splitlines()
    assert len(lines) == 4 and not out.exists()
    fit, test = lines[0].split(" && ")
    fit, test = shlex.split(fit), shlex.split(test)
    run_dir = out.resolve() / "runs" / "a" / "seed_0"
    assert fit[:4] == ["ada", "fit", "-c", str(BASE.resolve())]
    assert "--model.init_args.score=1.0" in fit and "--trainer.max_steps=2" in fit
    assert f"--trainer.default_root_dir={run_dir}" in fit
    assert fit[-1] == f"--metrics_file={run_dir / 'fit.metrics.json'}"
    assert test[:2] == ["ada", "test"] and f"--ckpt_path={run_dir}/checkpoints/last.ckpt" in test
    assert "--seed_everything=1" in shlex.split(lines[1].split(" && ")[0])


def test_dry_run_lists_shared_fits_first(tmp_path):
    out = tmp_path / "out"
    _, stdout, _ = quietly(run_sweep, FIXTURES / "shared_fit.yaml", out=out, dry_run=True)
    lines = stdout.splitlines()
    assert lines[0].startswith("# 1 shared fit") and lines[2].startswith("# 2 run")
    assert shlex.split(lines[1])[:2] == ["ada", "fit"] and "--trainer.max_steps=3" in lines[1]
    ckpt = out.resolve() / "shared_fit" / "seed_5" / "checkpoints" / "last.ckpt"
    for line in lines[3:]:
        assert shlex.split(line)[:2] == ["ada", "test"] and f"--ckpt_path={ckpt}" in line


def test_run_dir_and_fit_dir_in_override_values_name_the_runs_folders(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"base: {FIXTURES / 'base.yaml'}\nseeds: [3, 4]\nmetrics: [test/score]\n"
        "fit: {trainer.callbacks: [{init_args: {dirpath: '{fit_dir}/a'}, class_path: C}]}\n"
        "variants:\n  - name: v\n    overrides:\n"
        "      trainer.callbacks: [{init_args: {dirpath: '{fit_dir}/a', x: '{run_dir}'}}]\n"
    )
    fits, runs = sweep._plan(SweepSpec.from_yaml(spec), tmp_path / "out", quick=False)
    for fit, run in zip(fits, runs, strict=True):
        assert fit.overrides["trainer.callbacks"][0]["init_args"]["dirpath"] == f"{fit.run_dir}/a"
        assert run.overrides["trainer.callbacks"][0]["init_args"] == {
            "dirpath": f"{fit.run_dir}/a",
            "x": str(run.run_dir),
        }
        assert f"seed_{run.seed}" in str(fit.run_dir) and fit.run_dir != run.run_dir


# --- real sweeps (subprocesses of `python -m ada_modules`) ------------------------------------


@pytest.fixture(scope="module")
def main_sweep(tmp_path_factory):
    """The quick profile of main.yaml (2 variants x 2 seeds, fit then test), two jobs at a time."""
    out = tmp_path_factory.mktemp("main_sweep")
    records, stdout, stderr = quietly(
        run_sweep, FIXTURES / "main.yaml", out=out, quick=True, jobs=2
    )
    return out, records, stdout, stderr


EXPECTED_TABLE = "\n".join(
    [
        "| variant | runs ok | test/score ↑ | test/steps ↓ |",
        "|---|---|---|---|",
        "| a | 2/2 | 10.5 ± 0.7071 | **2 ± 0** |",
        "| b | 2/2 | **25.5 ± 0.7071** | **2 ± 0** |",
    ]
)

EXPECTED_RUNS = "\n".join(
    ["| variant | seed | status | test/score | test/steps |", "|---|---|---|---|---|"]
    + [f"| {v} | {s} | ok | {base + s} | 2 |" for v, base in (("a", 10), ("b", 25)) for s in (0, 1)]
)  # fmt: skip
EXPECTED_MD = f"# main\n\n{EXPECTED_TABLE}\n\n## Every run\n\n{EXPECTED_RUNS}\n"


def test_sweep_writes_results_json_md_and_plots(main_sweep):
    out, records, stdout, stderr = main_sweep
    assert [(r.variant, r.seed, r.status) for r in records] == [
        ("a", 0, "ok"),
        ("a", 1, "ok"),
        ("b", 0, "ok"),
        ("b", 1, "ok"),
    ], [r.error for r in records]
    for r in records:
        score = {"a": 1.0, "b": 2.5}[r.variant]
        assert r.metrics["test/score"] == 10 * score + r.seed
        assert r.metrics["test/steps"] == 2  # the quick profile, through fit's checkpoint
        image = {"model.init_args.image": True} if r.variant == "b" else {}
        assert r.overrides == {"model.init_args.score": score, **image, "trainer.max_steps": 2}
        assert r.wall_s > 0
        run_dir = Path(r.run_dir)
        assert (run_dir / "checkpoints" / "last.ckpt").is_file()
        assert (run_dir / "fit.log").is_file() and (run_dir / "test.log").is_file()
    data = json.loads((out / "results.json").read_text())
    assert data["quick"] is True and data["shared_fits"] == []
    assert [RunRecord(**r) for r in data["runs"]] == records
    assert (out / "results.md").read_text() == EXPECTED_MD
    assert EXPECTED_TABLE in stdout
    for name in ("test_score.png", "test_steps.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    # The report names exactly the files written: its own, and the images the runs wrote.
    assert sorted(p.name for p in out.glob("*.png")) == ["test_score.png", "test_steps.png"]
    images = sorted(p.relative_to(out).as_posix() for p in (out / "runs").rglob("*.png"))
    assert images == [f"runs/b/seed_{s}/images/steps_2.png" for s in (0, 1)]
    assert stdout.splitlines()[-3:] == [
        f"Wrote to {out.resolve()}: results.json, results.md, test_score.png, test_steps.png",
        f"Images written by the runs (in {out.resolve()}/runs/<variant>/seed_<seed>/):",
        "  images/steps_2.png: 2 of 4 runs",
    ]
    started = [line for line in stderr.splitlines() if line.startswith("[start] ")]
    assert sorted(started) == [f"[start] variant={v} seed={s}" for v in "ab" for s in (0, 1)]
    progress = [line for line in stderr.splitlines() if line.startswith("[") and line[1].isdigit()]
    assert len(progress) == 4 and all(line.endswith(" s)") for line in progress)
    assert sorted(line[:6] for line in progress) == ["[1/4] ", "[2/4] ", "[3/4] ", "[4/4] "]


def test_rerun_skips_finished_runs(main_sweep, monkeypatch):
    out, records, _, _ = main_sweep
    launched = count_launches(monkeypatch)
    again, stdout, stderr = quietly(run_sweep, FIXTURES / "main.yaml", out=out, quick=True)
    assert launched == []
    assert stderr.count("ok earlier, skipped") == 4
    assert again == records and EXPECTED_TABLE in stdout
    assert stdout.splitlines()[-1] == "  images/steps_2.png: 2 of 4 runs"  # kept with their runs
    # Without --quick the overrides differ, so nothing is reused (checked without running it).
    spec = SweepSpec.from_yaml(FIXTURES / "main.yaml")
    _, full = sweep._plan(spec, out, quick=False)
    for old, run in zip(records, full, strict=True):
        assert not old.same_run(run.record(status="ok", metrics={}))


def test_a_rerun_reads_the_metrics_the_spec_now_wants(main_sweep, tmp_path, monkeypatch):
    """(Before the next test edits main_sweep's runs.) Runs recorded ok were skipped whatever the spec now wanted: a metric no run logged was
    reported as a successful sweep (a fresh sweep fails every run on it)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(main_sweep[0], out)
    text = (FIXTURES / "main.yaml").read_text().replace("base: base.yaml", f"base: {BASE}")
    spec = tmp_path / "main.yaml"
    spec.write_text(text.replace("  - test/score\n", "  - test/score\n  - test/missing\n"))
    launched = count_launches(monkeypatch)
    records, _, stderr = quietly(run_sweep, spec, out=out, quick=True)
    assert launched == []  # nothing is rerun: the metrics files are read again
    assert [r.status for r in records] == ["failed"] * 4
    assert all("metric 'test/missing' was not logged" in r.error for r in records)
    assert stderr.count("ran earlier, failed: metric 'test/missing'") == 4


def test_dry_run_lines_run_and_collect_gives_the_same_table(main_sweep, monkeypatch):
    out, records, _, _ = main_sweep
    _, stdout, _ = quietly(run_sweep, FIXTURES / "main.yaml", out=out, quick=True, dry_run=True)
    lines = stdout.splitlines()
    assert lines == [r.command for r in records]
    # Run one printed line for real, as a cluster job would, after removing that run's results.
    run_dir = Path(records[3].run_dir)
    for file in run_dir.glob("*.metrics.json"):
        file.unlink()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(lines[3], shell=True, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run_dir / "test.metrics.json").read_text())["test/score"] == 26.0

    launched = count_launches(monkeypatch)
    collected, stdout, _ = quietly(
        run_sweep, FIXTURES / "main.yaml", out=out, quick=True, collect=True
    )
    assert launched == []
    assert [(r.variant, r.seed, r.status, r.metrics) for r in collected] == [
        (r.variant, r.seed, r.status, r.metrics) for r in records
    ]
    assert all(r.wall_s is None for r in collected)
    assert (out / "results.md").read_text() == EXPECTED_MD

    # A run whose command never ran is collected as failed, naming the missing file.
    (run_dir / "test.metrics.json").unlink()
    collected, _, _ = quietly(run_sweep, FIXTURES / "main.yaml", out=out, quick=True, collect=True)
    assert collected[3].status == "failed" and "test.metrics.json" in collected[3].error


def test_shared_fit_failed_variant_and_resume(tmp_path, monkeypatch):
    out = tmp_path / "out"
    records, _, stderr = quietly(run_sweep, FIXTURES / "shared_fit.yaml", out=out)
    ok, broken = records
    assert ok.status == "ok", ok.error
    assert ok.metrics == {"test/score": 15.0, "test/steps": 3.0}  # weights of the shared fit
    assert ok.stages == ["test"] and ok.shared_fit == {"trainer.max_steps": 3}
    assert not (Path(ok.run_dir) / "checkpoints").exists()
    assert broken.status == "failed"
    assert "ScoreModel was asked to fail in test" in broken.error
    assert "asked to fail in test" in (Path(broken.run_dir) / "test.log").read_text()
    data = json.loads((out / "results.json").read_text())
    assert [(f["variant"], f["seed"], f["status"]) for f in data["shared_fits"]] == [
        ("(shared fit)", 5, "ok")
    ]
    assert "| broken | 0/1 | – | – |" in (out / "results.md").read_text()
    assert "[3/3]" in stderr and "failed" in stderr

    # Resume: only the failed run is launched again; `ada sweep` returns 1 while a run fails.
    launched = count_launches(monkeypatch)
    code, _, stderr = quietly(sweep_main, [str(FIXTURES / "shared_fit.yaml"), "--out", str(out)])
    assert code == 1
    assert (
        len(launched) == 1
        and launched[0][3] == "test"
        and "--model.init_args.fail_in=test" in launched[0]
    )
    assert stderr.count("ok earlier, skipped") == 2


def test_quickstart_sweep_spec_is_valid():
    spec = SweepSpec.from_yaml(ROOT / "cli_configs" / "quickstart_sweep.yaml")
    assert len(spec.variants) == 2 and len(spec.seeds) == 2
    assert spec.stages == ["fit", "test"] and spec.quick
    assert {m.name for m in spec.metrics} == {
        "test/exact_match",
        "test/gen_length",
        "test/tokens_per_s",
    }


@pytest.mark.slow
def test_quickstart_sweep_quick_profile(tmp_path):
    out = tmp_path / "qs"
    spec = ROOT / "cli_configs" / "quickstart_sweep.yaml"
    code = sweep_main([str(spec), "--quick", "--jobs", "2", "--out", str(out)])
    data = json.loads((out / "results.json").read_text())
    assert code == 0, [r["error"] for r in data["runs"]]
    assert len(data["runs"]) == 4
    assert (out / "test_exact_match.png").is_file()
    assert "test/exact_match" in (out / "results.md").read_text()


@pytest.mark.parametrize(
    ("spec_path", "callback"),
    [
        ("ancre/repro.yaml", "ConnectivityMonitor"),
        ("ancre/repro_lm.yaml", "ConnectivityMonitor"),
        ("adakvq/repro.yaml", "AADProfiler"),
        ("adakvq/repro_arith.yaml", "AADProfiler"),
    ],
)
def test_quick_profiles_write_the_images_their_specs_promise(spec_path, callback):
    """The image-writing callback of each spec fires within the quick profile's steps."""
    spec = SweepSpec.from_yaml(ROOT / "cli_configs" / spec_path)
    trainer = {}
    for base in spec.base:
        trainer.update(yaml.safe_load(base.read_text())["trainer"])
    overrides = {**spec.overrides, **(spec.shared_fit or {}), **spec.quick}
    trainer.update({k.removeprefix("trainer."): v for k, v in overrides.items()})
    (found,) = [c for c in trainer["callbacks"] if c["class_path"].endswith(f".{callback}")]
    if callback == "ConnectivityMonitor":  # writes every `every_n_steps` optimizer steps
        assert found["init_args"]["every_n_steps"] <= trainer["max_steps"]
    else:  # writes at each validation
        assert "validation" in found["init_args"]["loops"]
        assert trainer["val_check_interval"] <= trainer["max_steps"]


def test_stage_overrides_apply_to_their_stage_only_and_are_recorded(tmp_path):
    spec = write_spec(
        tmp_path,
        "variants:\n  - name: cache\n    overrides: {trainer.max_steps: 3}\n"
        "    stage_overrides:\n      test: {model.init_args.scale: 2.0, x: '{run_dir}'}\n",
    )
    [run] = sweep._plan(SweepSpec.from_yaml(spec), tmp_path / "out", quick=False)[1]
    (_, fit_args), (_, test_args) = run.calls
    assert not any("scale" in a for a in fit_args)
    assert "--model.init_args.scale=2.0" in test_args and f"--x={run.run_dir}" in test_args
    assert "--trainer.max_steps=3" in fit_args and "--trainer.max_steps=3" in test_args
    assert run.overrides["test:model.init_args.scale"] == 2.0


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("stage_overrides: {predict: {trainer.max_steps: 1}}", "'predict' is not one of"),
        ("stage_overrides: [1]", "must map stage names"),
    ],
)
def test_bad_stage_overrides(tmp_path, entry, message):
    spec = write_spec(tmp_path, f"variants:\n  - name: a\n    {entry}\n")
    with pytest.raises(SweepSpecError, match=message):
        SweepSpec.from_yaml(spec)


def test_a_metric_that_is_not_required_may_be_missing():
    metric = Metric.parse({"name": "train/adera_bytes_ratio", "required": False})
    assert (metric.mode, metric.required) == ("max", False)
    assert Metric.parse({"name": "val/loss", "required": True}) == Metric("val/loss", "min", True)
    with pytest.raises(InputError, match="required of 'x' must be true or false"):
        Metric.parse({"name": "x", "required": "no"})


# --- named shared fits (`fits`) ---------------------------------------------------------------

FITS = FIXTURES / "fits.yaml"
WEIGHTS = FIXTURES / "weights.yaml"


def fits_spec(**changes) -> SweepSpec:
    """The fits.yaml fixture spec, with top-level keys replaced (``None`` removes one)."""
    data = yaml.safe_load(FITS.read_text())
    data.update(changes)
    return SweepSpec.from_dict({k: v for k, v in data.items() if v is not None}, FITS)


def fake_runs(monkeypatch, out: Path, fail=(), delay: float = 0.0) -> list[tuple[str, ...]]:
    """Replace the CLI subprocesses: a call writes its metrics file and returns 0, or 1 for a run
    folder (relative to ``out``) in ``fail``; a fit also writes ``images/fit.png``. Returns the
    events ("start"/"end", stage, run folder relative to ``out``) in the order they happened."""
    events = []

    def fake(command, log, env):
        stage, args = command[3], dict(a.split("=", 1) for a in command[4:] if "=" in a)
        run_dir = Path(args["--trainer.default_root_dir"])
        where = run_dir.relative_to(out.resolve()).as_posix()
        events.append(("start", stage, where))
        time.sleep(delay)
        log.write_text("fake run\n")
        if where in fail:
            events.append(("end", stage, where))
            return 1
        metrics = {"test/score": 1.0, "test/steps": 0.0} if stage == "test" else {}
        Path(args["--metrics_file"]).write_text(json.dumps(metrics))
        if stage == "fit":
            (run_dir / "images").mkdir()
            (run_dir / "images" / "fit.png").write_bytes(b"png")
        events.append(("end", stage, where))
        return 0

    monkeypatch.setattr(sweep, "_run_command", fake)
    return events


def started(events) -> list[str]:
    return [where for kind, _, where in events if kind == "start"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fit: {}\nfits: [{name: a}]\n", "'fit' and 'fits' exclude each other"),
        ("fits: []\n", "'fits' must be a non-empty list of {name, base, overrides, quick}"),
        ("fits: [{name: a}, {name: a}]\n", "two of 'fits' are named 'a'"),
        ("fits: [{name: a/b}]\n", "fits[0]: 'name' must be a plain file name, got 'a/b'"),
        ("fits: [{name: a, overide: {}}]\n", "unknown key 'overide' in fit 'a'"),
        ("fits: [{name: a, quick: [1]}]\n", "'fits[0].quick' must be a mapping"),
        (
            "fits: [{name: a}, {name: b}]\nvariants: [{name: v, overrides: {x: '{fit_dir:c}/m'}}]\n",
            "variant 'v': unknown fit 'c' in '{fit_dir:c}'; fits: a, b",
        ),
        (
            "variants: [{name: v, stage_overrides: {test: {x: '{fit_dir:a}'}}}]\n",
            "variant 'v': unknown fit 'a' in '{fit_dir:a}'; the spec has no 'fits'",
        ),
        (
            "fits: [{name: a, overrides: {x: '{fit_dir:b}'}}, {name: b}]\n",
            "fits[0].overrides: fit 'a' cannot use '{fit_dir:b}': fit 'b' does not run before it",
        ),
        (
            "fits: [{name: a, quick: {x: '{fit_dir:a}'}}]\n",
            "fits[0].quick: fit 'a' cannot use '{fit_dir:a}': fit 'a' does not run before it",
        ),
        (
            "fits: [{name: a}, {name: b, overrides: {x: '{fit_dir}'}}]\n",
            "fits[1].overrides: fit 'b' cannot use '{fit_dir}': fit 'b' does not run before it "
            "(a fit may use only the folders of earlier fits); '{fit_dir}' is the last fit, "
            "{run_dir} a run's own folder",
        ),
        (
            "fits: [{name: a}, {name: b}]\noverrides: {x: '{fit_dir:a}'}\n",
            "'overrides' (added to every fit too): fit 'a' cannot use '{fit_dir:a}'",
        ),
    ],
)
def test_bad_fits_fail_with_one_line(tmp_path, text, message):
    with pytest.raises(SweepSpecError) as error:
        SweepSpec.from_yaml(write_spec(tmp_path, text))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_fit_base_that_does_not_exist(tmp_path):
    spec = write_spec(tmp_path, "fits: [{name: a}, {name: b, base: [nope.yaml]}]\n")
    with pytest.raises(SweepSpecError) as error:
        SweepSpec.from_yaml(spec)
    missing = tmp_path / "nope.yaml"
    assert str(error.value) == f"{spec.resolve()}: base config of fit 'b' not found: {missing}"


def test_fits_variants_may_fine_tune_from_a_fit(tmp_path):
    text = "fits: [{name: a}]\nstages: [fit, test]\n"
    text += "variants: [{name: v, overrides: {w: '{fit_dir:a}/checkpoints/last.ckpt'}}]\n"
    out = tmp_path / "out"
    fits, runs = sweep._plan(SweepSpec.from_yaml(write_spec(tmp_path, text)), out, quick=False)
    (run,) = runs
    (fit_stage, fit_args), (test_stage, test_args) = run.calls
    assert (fit_stage, test_stage) == ("fit", "test")
    assert f"--w={fits[0].run_dir}/checkpoints/last.ckpt" in fit_args
    assert not any(a.startswith("--ckpt_path") for a in fit_args)
    assert f"--ckpt_path={run.run_dir}/checkpoints/last.ckpt" in test_args


@pytest.mark.parametrize(
    ("quick_variants", "expected"),
    [("[va]", ["a", "c"]), ("[vb]", ["b"]), ("[vlast]", ["a", "c"]), ("[va, vb]", ["a", "b", "c"])],
)
def test_a_quick_profile_runs_only_the_fits_its_variants_need(tmp_path, quick_variants, expected):
    text = (
        "fits: [{name: a}, {name: b}, {name: c, overrides: {w: '{fit_dir:a}/x'}}]\n"
        "variants: [{name: va, overrides: {w: '{fit_dir:c}/y'}},"
        " {name: vb, overrides: {w: '{fit_dir:b}/y'}}, {name: vlast, overrides: {w: '{fit_dir}'}}]\n"
        f"quick: {{}}\nquick_variants: {quick_variants}\n"
    )
    spec = SweepSpec.from_yaml(write_spec(tmp_path, text))
    fits, runs = sweep._plan(spec, tmp_path / "out", quick=True)
    assert [fit.fit_name for fit in fits] == expected
    assert all(run.depends_on == tuple(fits) for run in runs)
    full, _ = sweep._plan(spec, tmp_path / "out", quick=False)
    assert [fit.fit_name for fit in full] == ["a", "b", "c"]


def test_fits_spec_defaults():
    spec = SweepSpec.from_yaml(FITS)
    assert spec.shared_fit is None and spec.stages == ["test"]
    assert [(f.name, f.base, f.quick) for f in spec.fits] == [
        ("base", [BASE], None),
        ("more", [BASE, WEIGHTS], {"trainer.max_steps": 2}),
    ]


@pytest.mark.parametrize(
    ("quick", "steps"), [(False, {"base": 2, "more": 3}), (True, {"base": 1, "more": 2})]
)
def test_fits_plan_order_folders_configs_and_placeholders(tmp_path, quick, steps):
    out = tmp_path / "out"
    fits, runs = sweep._plan(SweepSpec.from_yaml(FITS), out, quick=quick)
    seeds = [0] if quick else [0, 1]
    assert [(f.variant, f.seed) for f in fits] == [
        (f"(shared fit: {name})", seed) for seed in seeds for name in ("base", "more")
    ]
    for seed in seeds:
        base, more = [f for f in fits if f.seed == seed]
        assert base.run_dir == out / "shared_fit" / "base" / f"seed_{seed}"
        assert more.run_dir == out / "shared_fit" / "more" / f"seed_{seed}"
        base_ckpt = f"{base.run_dir}/checkpoints/last.ckpt"
        (_, base_args), (_, more_args) = base.calls[0], more.calls[0]
        assert base_args[:2] == ("-c", str(BASE))  # the fit's own base
        assert more_args[:4] == ("-c", str(BASE), "-c", str(WEIGHTS))  # the spec's base
        assert f"--trainer.max_steps={steps['base']}" in base_args
        # the spec's quick, then the fit's quick
        assert f"--trainer.max_steps={steps['more']}" in more_args
        assert f"--model.init_args.weights={base_ckpt}" in more_args
        assert any(a.startswith("--trainer.callbacks+=") for a in more_args)
        assert (base.depends_on, more.depends_on) == ((), (base,))
        assert (base.shared_fit, more.shared_fit) == (None, {"base": base.overrides})
        assert base.base == (BASE,) and more.base == (BASE, WEIGHTS)
        from_base, from_more = [r for r in runs if r.seed == seed]
        assert from_base.run_dir == out / "runs" / "from_base" / f"seed_{seed}"
        assert from_base.overrides["model.init_args.weights"] == base_ckpt
        # plain {fit_dir}: the last fit
        assert (
            from_more.overrides["model.init_args.weights"]
            == f"{more.run_dir}/checkpoints/last.ckpt"
        )
        for run in (from_base, from_more):
            assert run.depends_on == (base, more) and run.stages == ("test",)
            assert run.shared_fit == {"base": base.overrides, "more": more.overrides}
    assert not any(
        "--ckpt_path" in a for run in [*fits, *runs] for _, args in run.calls for a in args
    )


def test_fits_dry_run_lists_each_seeds_fits_in_order_first(tmp_path):
    out = tmp_path / "out"
    _, stdout, _ = quietly(run_sweep, FITS, out=out, dry_run=True)
    lines = stdout.splitlines()
    assert lines[0] == "# 4 shared fit(s): run these first, in order"
    assert lines[5] == "# 4 run(s) using the shared fits" and len(lines) == 10
    fits = [dict(a.split("=", 1) for a in shlex.split(line) if "=" in a) for line in lines[1:5]]
    assert all(shlex.split(line)[:2] == ["ada", "fit"] for line in lines[1:5])
    assert [
        (
            Path(f["--trainer.default_root_dir"]).relative_to(out.resolve()).as_posix(),
            f["--seed_everything"],
        )
        for f in fits
    ] == [
        ("shared_fit/base/seed_0", "0"),
        ("shared_fit/more/seed_0", "0"),
        ("shared_fit/base/seed_1", "1"),
        ("shared_fit/more/seed_1", "1"),
    ]
    assert all(shlex.split(line)[:2] == ["ada", "test"] for line in lines[6:])
    assert "--ckpt_path" not in stdout and not out.exists()


def test_a_bad_override_of_a_fit_names_the_fit(tmp_path, monkeypatch):
    events = fake_runs(monkeypatch, tmp_path / "out")
    fits = yaml.safe_load(FITS.read_text())["fits"]
    fits[1]["overrides"]["model.init_args.wieghts"] = "x"
    with pytest.raises(SweepSpecError, match=r"'\(shared fit: more\)': .*'wieghts'"):
        run_sweep(fits_spec(fits=fits), out=tmp_path / "out")
    assert events == [] and not (tmp_path / "out").exists()


def test_a_failed_fit_fails_the_rest_of_its_seed_without_running_it(tmp_path, monkeypatch):
    out = tmp_path / "out"
    events = fake_runs(monkeypatch, out, fail={"shared_fit/base/seed_0"})
    records, stdout, stderr = quietly(run_sweep, FITS, out=out)
    # seed 0 stops after its failed first fit; seed 1 runs everything, each fit after the one before
    assert started(events) == [
        "shared_fit/base/seed_0",
        "shared_fit/base/seed_1",
        "shared_fit/more/seed_1",
        "runs/from_base/seed_1",
        "runs/from_more/seed_1",
    ]
    error = f"shared fit 'base' for seed 0 failed; see {out.resolve()}/shared_fit/base/seed_0"
    assert [(r.variant, r.seed, r.status, r.error) for r in records] == [
        ("from_base", 0, "failed", error),
        ("from_base", 1, "ok", None),
        ("from_more", 0, "failed", error),
        ("from_more", 1, "ok", None),
    ]
    data = json.loads((out / "results.json").read_text())
    fits = [(f["variant"], f["seed"], f["status"], f["base"]) for f in data["shared_fits"]]
    assert fits == [
        ("(shared fit: base)", 0, "failed", [str(BASE)]),
        ("(shared fit: more)", 0, "failed", [str(BASE), str(WEIGHTS)]),
        ("(shared fit: base)", 1, "ok", [str(BASE)]),
        ("(shared fit: more)", 1, "ok", [str(BASE), str(WEIGHTS)]),
    ]
    assert data["shared_fits"][1]["error"] == error
    assert "[3/8] shared fit 'more' seed=0 ... failed (no shared checkpoint)" in stderr
    assert stdout.splitlines()[-2:] == [
        f"Images written by the shared fits (in {out.resolve()}/shared_fit/<fit>/seed_<seed>/):",
        "  images/fit.png: 2 of 4 shared fits",
    ]


def test_fits_with_jobs_wait_for_the_fits_before_them(tmp_path, monkeypatch):
    out = tmp_path / "out"
    events = fake_runs(monkeypatch, out, delay=0.02)
    records, _, _ = quietly(run_sweep, FITS, out=out, jobs=3)
    assert all(r.status == "ok" for r in records)
    order = {(kind, where): i for i, (kind, _, where) in enumerate(events)}
    assert len(order) == 16  # 8 runs started and ended once each
    for seed in (0, 1):
        base, more = (f"shared_fit/{name}/seed_{seed}" for name in ("base", "more"))
        assert order[("start", more)] > order[("end", base)]
        for variant in ("from_base", "from_more"):
            assert order[("start", f"runs/{variant}/seed_{seed}")] > order[("end", more)]


def test_changing_a_later_fit_reruns_it_and_its_seeds_variants_only(tmp_path, monkeypatch):
    out = tmp_path / "out"
    spec = fits_spec(seeds=[0])
    events = fake_runs(monkeypatch, out)
    quietly(run_sweep, spec, out=out)
    assert len(started(events)) == 4
    events.clear()
    _, _, stderr = quietly(run_sweep, spec, out=out)
    assert events == [] and stderr.count("ok earlier, skipped") == 4
    fits = yaml.safe_load(FITS.read_text())["fits"]
    fits[1]["overrides"]["trainer.max_steps"] = 4
    records, _, stderr = quietly(run_sweep, fits_spec(seeds=[0], fits=fits), out=out)
    assert started(events) == [
        "shared_fit/more/seed_0",
        "runs/from_base/seed_0",
        "runs/from_more/seed_0",
    ]
    assert "shared fit 'base' seed=0 ... ok earlier, skipped" in stderr
    assert records[0].shared_fit["more"]["trainer.max_steps"] == 4

    # A fit that runs again with the same configuration (here: recorded as failed) reruns the
    # later fits and the variants of its seed too: they were trained from its earlier weights.
    results = json.loads((out / "results.json").read_text())
    results["shared_fits"][0]["status"] = "failed"
    (out / "results.json").write_text(json.dumps(results))
    events.clear()
    quietly(run_sweep, fits_spec(seeds=[0], fits=fits), out=out)
    assert started(events) == [
        "shared_fit/base/seed_0",
        "shared_fit/more/seed_0",
        "runs/from_base/seed_0",
        "runs/from_more/seed_0",
    ]


@pytest.mark.slow
def test_fits_sweep_end_to_end(tmp_path):
    """The quick profile for real: `more` trains from base's checkpoint (1 + 2 steps)."""
    records, _, _ = quietly(run_sweep, FITS, out=tmp_path, quick=True, jobs=2)
    assert [(r.variant, r.status, r.metrics) for r in records] == [
        ("from_base", "ok", {"test/score": 0.0, "test/steps": 1.0}),
        ("from_more", "ok", {"test/score": 10.0, "test/steps": 3.0}),
    ], [r.error for r in records]
    for name in ("base", "more"):
        assert (tmp_path / "shared_fit" / name / "seed_0" / "checkpoints" / "last.ckpt").is_file()


def test_a_variant_runs_with_its_own_base(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(BASE.read_text(encoding="utf-8"), encoding="utf-8")
    spec = write_spec(
        tmp_path,
        "variants: [{name: a}, {name: b, base: other.yaml}]\ngrid: {trainer.max_steps: [1, 2]}\n",
    )
    _, runs = sweep._plan(SweepSpec.from_yaml(spec), tmp_path / "out", quick=False)
    bases = {run.variant: run.base for run in runs}
    assert bases == {
        "a,max_steps=1": (BASE,),
        "a,max_steps=2": (BASE,),
        "b,max_steps=1": (other.resolve(),),
        "b,max_steps=2": (other.resolve(),),
    }
    assert all(args[:2] == ("-c", str(run.base[0])) for run in runs for _, args in run.calls)


def test_a_variant_base_that_does_not_exist(tmp_path):
    spec = write_spec(tmp_path, "variants: [{name: a, base: nope.yaml}]\n")
    with pytest.raises(SweepSpecError) as error:
        SweepSpec.from_yaml(spec)
    missing = tmp_path / "nope.yaml"
    assert str(error.value) == f"{spec.resolve()}: base config of variant 'a' not found: {missing}"


def test_a_variant_base_needs_named_fits_not_a_shared_fit(tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(BASE.read_text(encoding="utf-8"), encoding="utf-8")
    spec = write_spec(tmp_path, "fit: {}\nvariants: [{name: a, base: other.yaml}]\n")
    with pytest.raises(SweepSpecError, match="variant 'a' has its own 'base', but a shared 'fit'"):
        SweepSpec.from_yaml(spec)


# --- named grid axes ----------------------------------------------------------------------------


def test_named_grid_axis_sets_its_keys_together_times_the_listed_variants(tmp_path):
    spec = SweepSpec.from_yaml(
        write_spec(
            tmp_path,
            "variants:\n  - {name: kivi, overrides: {model.init_args.cache: kivi}}\n"
            "  - {name: ada}\n"
            "grid:\n"
            "  judge:\n"
            "    good: {data.init_args.judge_accuracy: 0.9}\n"
            "    biased: {data.init_args.judge_accuracy: 0.8, data.init_args.length_bias: 1.0}\n"
            "  model.init_args.bits: [2, 4]\n"
            "quick: {}\nquick_variants: ['ada,judge=biased,bits=4']\n",
        )
    )
    assert [v.name for v in spec.variants] == [
        "kivi,judge=good,bits=2",
        "kivi,judge=good,bits=4",
        "kivi,judge=biased,bits=2",
        "kivi,judge=biased,bits=4",
        "ada,judge=good,bits=2",
        "ada,judge=good,bits=4",
        "ada,judge=biased,bits=2",
        "ada,judge=biased,bits=4",
    ]
    assert spec.variants[2].overrides == {
        "model.init_args.cache": "kivi",
        "data.init_args.judge_accuracy": 0.8,
        "data.init_args.length_bias": 1.0,
        "model.init_args.bits": 2,
    }
    assert spec.variants[5].overrides == {
        "data.init_args.judge_accuracy": 0.9,
        "model.init_args.bits": 4,
    }
    # The axis's own name is never an override key.
    assert not any("judge" in v.overrides for v in spec.variants)
    assert spec.quick_variants == ["ada,judge=biased,bits=4"]
    # expand_grid alone: a named axis is the only axis.
    points = expand_grid({"size": {"narrow": {"m.w": 1}, "wide": {"m.w": 2, "m.h": 3}}})
    assert [(p.name, p.overrides) for p in points] == [
        ("size=narrow", {"m.w": 1}),
        ("size=wide", {"m.w": 2, "m.h": 3}),
    ]


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ("{judge: {good: 0.9}}", "grid axis 'judge': point 'good' must be a non-empty mapping"),
        ("{judge: {good: [0.9]}}", "grid axis 'judge': point 'good' must be a non-empty mapping"),
        ("{judge: {good: {}}}", "grid axis 'judge': point 'good' must be a non-empty mapping"),
        (
            "{judge: {good: {data.a: 1}, bad: null}}",
            "grid axis 'judge': point 'bad' must be a non-empty mapping",
        ),
        ("{judge: {good: {--x: 1}}}", "bad override key '--x' in 'grid.judge.good'"),
        ("{judge: {}}", "grid key 'judge' must have a non-empty list of values"),
    ],
)
def test_bad_named_grid_axis_fails_naming_the_axis_and_point(tmp_path, grid, message):
    with pytest.raises(SweepSpecError) as error:
        SweepSpec.from_yaml(write_spec(tmp_path, f"grid: {grid}\n"))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_typo_in_a_later_stages_overrides_fails_before_any_run(tmp_path, monkeypatch):
    launched = count_launches(monkeypatch)
    spec = write_spec(
        tmp_path,
        "variants:\n  - name: a\n    stage_overrides:\n      test: {model.init_args.scroe: 1.0}\n",
    )
    with pytest.raises(SweepSpecError, match=r"'a' \(test\): model: .*'scroe' is not accepted"):
        run_sweep(spec, out=tmp_path / "out")
    assert launched == [] and not (tmp_path / "out").exists()


def test_two_metrics_charted_in_one_file_are_refused(tmp_path):
    spec = write_spec(tmp_path, "variants: [{name: a}]\n").read_text()
    spec = spec.replace("metrics: [test/score]", "metrics: [test/acc, test_acc]")
    (tmp_path / "spec.yaml").write_text(spec)
    with pytest.raises(SweepSpecError, match=r"'test/acc' and 'test_acc' would both be charted"):
        SweepSpec.from_yaml(tmp_path / "spec.yaml")
