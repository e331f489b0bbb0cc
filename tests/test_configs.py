"""Every YAML under cli_configs/ stays runnable.

- Each LightningCLI config parses and resolves with ``--print_config`` (catches bad class paths,
  untyped or renamed arguments); a partial config (``OVERLAYS``) after the config it extends.
- Each sweep spec (a YAML with a top-level ``base:`` key) validates and expands to runs.
- Every variant of each sweep spec parses in-process (``--dry-run``: the first CLI call of each
  variant with ``--print_config``, nothing runs).
- Each sweep spec other than a ``repro.yaml`` runs one (variant, seed) at a few-steps size, so
  that no sweep rots. The whole quick profile (~2-3 minutes) of each ``repro.yaml`` runs instead
  (running one of its variants too cost CI about 40 s per technique; the quickstart sweep's quick
  profile is tested in test_sweep.py). Both are ``slow``: a smoke run is 15-40 s, mostly process
  start-up, and the 16 of them took about 3 of the fast suite's 15 minutes on 2 cores; the
  in-process dry run above still parses every variant in the fast suite.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from ada_modules.cli import main
from ada_modules.sweep import SweepSpec, run_sweep

REPO = Path(__file__).resolve().parents[1]
ALL_YAML = sorted((REPO / "cli_configs").rglob("*.yaml"))


def _is_sweep_spec(path: Path) -> bool:
    data = yaml.safe_load(path.read_text())
    return isinstance(data, dict) and "base" in data


SPECS = [path for path in ALL_YAML if _is_sweep_spec(path)]
# Partial configs given after a base (`-c base.yaml -c overlay.yaml`): overlay -> base.
OVERLAYS = {
    REPO / "cli_configs" / "compose" / "cache.yaml": REPO / "cli_configs" / "compose" / "lm.yaml"
}
CONFIGS = [path for path in ALL_YAML if path not in SPECS]
REPROS = [path for path in SPECS if path.name == "repro.yaml"]

# Few-steps overrides for the smoke run of a sweep: enough to exercise fit -> checkpoint -> eval.
SMOKE = {
    "trainer.max_steps": 2,
    "trainer.limit_train_batches": 2,
    "trainer.limit_val_batches": 1,
    "trainer.limit_test_batches": 1,
    "trainer.limit_predict_batches": 1,
    "trainer.val_check_interval": None,
    "trainer.check_val_every_n_epoch": 1,
}


def _ids(paths: list[Path]) -> list[str]:
    return [str(path.relative_to(REPO / "cli_configs")) for path in paths]


def test_the_shipped_configs_are_found():
    assert REPO / "cli_configs" / "quickstart.yaml" in CONFIGS
    assert REPO / "cli_configs" / "quickstart_sweep.yaml" in SPECS


@pytest.mark.parametrize("config", CONFIGS, ids=_ids(CONFIGS))
def test_config_resolves_with_print_config(config, capsys):
    configs = [OVERLAYS[config], config] if config in OVERLAYS else [config]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *(arg for path in configs for arg in ("-c", str(path))), "--print_config"])
    assert exit_info.value.code == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert "class_path" in resolved["model"]


@pytest.mark.parametrize("spec", SPECS, ids=_ids(SPECS))
def test_sweep_spec_validates(spec):
    parsed = SweepSpec.from_yaml(spec)
    assert parsed.variants and parsed.seeds and parsed.metrics
    fits_quick = any(fit.quick for fit in parsed.fits or [])  # per-fit `quick` of `fits:`
    assert parsed.quick or fits_quick, "every sweep needs a quick profile for CI"


@pytest.mark.parametrize("spec", SPECS, ids=_ids(SPECS))
def test_every_variant_of_the_sweep_parses(spec, tmp_path, capsys):
    """Every variant of the quick profile (all of them, unless it names `quick_variants`)."""
    assert run_sweep(spec, out=tmp_path, quick=True, dry_run=True) == []
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ada ")]
    parsed = SweepSpec.from_yaml(spec)
    variants = parsed.quick_variants or parsed.variants
    assert len(lines) >= len(variants) * len(parsed.quick_seeds or parsed.seeds)


LARGE_SPECS = [path for path in SPECS if SweepSpec.from_yaml(path).quick_variants is not None]


@pytest.mark.slow
@pytest.mark.parametrize("spec", LARGE_SPECS, ids=_ids(LARGE_SPECS))
def test_every_variant_of_a_sweep_with_quick_variants_parses(spec, tmp_path, capsys):
    """The variants that such a quick profile skips, through the full profile's dry run."""
    assert run_sweep(spec, out=tmp_path, dry_run=True) == []
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ada ")]
    parsed = SweepSpec.from_yaml(spec)
    assert len(lines) >= len(parsed.variants) * len(parsed.seeds)


SMOKE_SPECS = [path for path in SPECS if path not in REPROS]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SMOKE_SPECS, ids=_ids(SMOKE_SPECS))
def test_sweep_smoke_run(spec, tmp_path):
    parsed = SweepSpec.from_yaml(spec)
    # A named fit's own `quick` comes after the spec's, so it would undo SMOKE's step limit.
    fits = [dataclasses.replace(fit, quick=None) for fit in parsed.fits or []] or parsed.fits
    smoke = dataclasses.replace(
        parsed,
        variants=parsed.variants[:1],
        seeds=parsed.seeds[:1],
        quick_seeds=None,
        # The first variant runs even where the quick profile skips it, and only the fits it uses.
        quick_variants=[parsed.variants[0].name],
        quick={**parsed.quick, **SMOKE},
        fits=fits,
    )
    records = run_sweep(smoke, out=tmp_path, quick=True)
    assert [record.status for record in records] == ["ok"], records[0].error


@pytest.mark.slow
@pytest.mark.parametrize("spec", REPROS, ids=_ids(REPROS))
def test_quick_profile_completes(spec, tmp_path):
    records = run_sweep(spec, out=tmp_path, quick=True, jobs=2)
    assert records and all(record.status == "ok" for record in records)
    results = json.loads((tmp_path / "results.json").read_text())
    expected = {m.name for m in SweepSpec.from_yaml(spec).metrics if m.required}
    for run in results["runs"]:
        assert expected <= set(run["metrics"]), run
    assert (tmp_path / "results.md").exists()
    assert list(tmp_path.glob("*.png"))
