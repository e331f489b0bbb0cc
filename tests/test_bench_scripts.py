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


def _write_curve(run_dir: Path, values: list[float]) -> None:
    log = run_dir / "lightning_logs" / "version_0"
    log.mkdir(parents=True)
    rows = [f"{25 * (i + 1) - 1},{v}" for i, v in enumerate(values)]
    (log / "metrics.csv").write_text("step,val/loss\n" + "\n".join(rows) + "\n")


def test_ancre_curves_count_diverged_runs_and_leave_them_out(tmp_path):
    """`bench/ancre.py --curves` on a sweep folder where some runs ended in NaN."""
    nan = float("nan")
    curves = {
        "residual": [[2.1, nan], [2.1, 1.5], [2.1, nan]],
        "hyper": [[2.0, 1.1], [2.0, 1.0], [2.0, 1.3]],
    }
    for variant, runs in {"residual_l6": [[2.0, 1.3], [2.0, 1.2], [2.0, 1.4]], **curves}.items():
        for seed, values in enumerate(runs):
            _write_curve(tmp_path / "sweep" / "runs" / variant / f"seed_{seed}", values)
    result = _run(
        [
            "bench/ancre.py",
            *("--curves", str(tmp_path / "sweep"), "--baseline", "residual_l6", "--by-step"),
            *("--curve-threshold", "1.35", "--out", str(tmp_path / "out")),
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    residual, hyper = (next(x for x in lines if x.startswith(f"| {v} | 3 |")) for v in curves)
    # 2 of 3 residual runs diverged: counted, and the final value is the other run's alone; the
    # paired difference is on the one seed where both are finite. Fisher's test of 0/3 against
    # 2/3 diverged gives 0.4 (scipy.stats.fisher_exact).
    assert residual.startswith("| residual | 3 | 2 | >50, >50, >50 | 1.5 |")
    assert residual.endswith("| 0.3 | 0/1 |")
    assert hyper.startswith("| hyper | 3 | 0 (p=0.4 vs residual) | 50, 50, 50 |")
    assert hyper.endswith("| -0.1667 ± 0.05774 | 3/3 |")
    assert "| residual | NaN@50 | 1.500 | NaN@50 |" in lines  # each seed's final value


def test_attention_backward_errors_against_float64():
    """`bench/ancre_attention_backward.py`: at small logits every attention's value gradient
    matches float64; the error is measured, not assumed (a non-finite gradient reads inf)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import ancre_attention_backward as attention_backward
    finally:
        sys.path.remove(str(REPO / "bench"))
    (row,) = attention_backward.run([1.0], seed=0)
    assert 1.0 < row["largest_logit"] < 20.0
    for name in attention_backward.ATTENTIONS:
        assert row[name] < 1e-5, (name, row[name])
    reference = attention_backward.torch.ones(3, dtype=attention_backward.torch.float64)
    grad = attention_backward.torch.tensor([1.0, 1.5, float("nan")])
    assert attention_backward.relative_error(grad, reference) == float("inf")
    assert attention_backward.relative_error(grad[:2], reference[:2]) == 0.5
