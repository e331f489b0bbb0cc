"""Benchmark scripts keep running: each GPU script on CPU at its --quick size, each CPU script's
--quick profile as a slow test. Nothing here checks a timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU_SCRIPTS = sorted((REPO / "bench" / "gpu").glob("[!_]*.py"))  # _common.py is a module
CPU_SCRIPTS = sorted((REPO / "bench").glob("*.py"))


def _run(args: list[str], out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("script", GPU_SCRIPTS, ids=lambda p: p.name)
def test_gpu_benchmark_runs_on_cpu_at_quick_size(script, tmp_path):
    result = _run([str(script), "--device", "cpu", "--quick"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / f"{script.stem}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("script", CPU_SCRIPTS, ids=lambda p: p.name)
def test_cpu_benchmark_quick_profile(script, tmp_path):
    result = _run([str(script), "--quick", "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "|" in result.stdout  # it printed its tables
