"""Pieces shared by the GPU benchmark scripts of this folder (imported by them, not run).

The scripts run as ``python bench/gpu/<slug>.py``, so this folder is on ``sys.path``.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    from triton.testing import do_bench
except ImportError:  # pragma: no cover - depends on the environment
    do_bench = None


@dataclass
class Guard:
    """Global time budget: sections and rows ask it before starting."""

    budget_s: float
    start: float = field(default_factory=time.perf_counter)
    skipped: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def ok(self, what: str, need_s: float) -> bool:
        """Whether ``need_s`` seconds are left for ``what``; records it as skipped otherwise."""
        if self.budget_s - self.elapsed() >= need_s:
            return True
        self.skipped.append(what)
        print(f"[time guard] skipped {what} ({self.elapsed():.0f} s of {self.budget_s:.0f} s used)")
        return False


def bench_device(name: str) -> tuple[torch.device, str] | None:
    """The device ``--device name`` asks for and a description of it, or ``None`` (after saying
    why on stderr) when it asks for CUDA on a machine without it."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu --quick for a smoke test.", file=sys.stderr)
        return None
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        return device, torch.cuda.get_device_name(device)
    return device, f"cpu ({torch.get_num_threads()} threads)"


def mean_std(values: list[float]) -> str:
    """``mean ± std`` of a table cell (the value alone when there is one)."""
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}"


def sync(device: torch.device) -> None:
    """Wait for queued work on ``device``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--device`` (cuda, or cpu for a smoke test), ``--quick`` and ``--budget-s``."""
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time guard in seconds")


def add_only_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--only a,b``: run just these sections (e.g. one skipped by the time guard before)."""
    parser.add_argument(
        "--only", default=None, help="comma-separated sections to run (default all)"
    )


def run_sections(
    sections: list[tuple[str, Callable[[], None], float]], guard: Guard, only: str | None = None
) -> list[str]:
    """Run each ``(name, section, need_s)`` that the guard leaves time for (of ``only``, if given).

    A section that raises is reported and the others still run; the errors are returned (the
    script exits non-zero on them). Prints what the guard skipped.
    """
    names = [name for name, _, _ in sections]
    wanted = set(names) if only is None else {name.strip() for name in only.split(",")}
    if wanted - set(names):
        raise SystemExit(f"--only: unknown sections {sorted(wanted - set(names))}; known: {names}")
    errors: list[str] = []
    for name, section, need_s in sections:
        if name not in wanted:
            continue
        if not guard.ok(f"section {name}", need_s):
            continue
        try:
            section()
        except Exception as err:  # report, keep going, exit non-zero at the end
            errors.append(f"{name}: {type(err).__name__}: {err}")
            print(f"\n**{name} failed**: {type(err).__name__}: {err}")
    if guard.skipped:
        print(f"\nskipped by the time guard: {', '.join(guard.skipped)}")
    return errors


def quiet_trainer(device: torch.device, **overrides: Any) -> Any:
    """A one-device Lightning ``Trainer`` that validates, logs, checkpoints and prints nothing;
    ``overrides`` replace or add ``Trainer`` arguments (``limit_val_batches=None`` validates)."""
    from lightning.pytorch import Trainer

    settings = {
        "accelerator": "gpu" if device.type == "cuda" else "cpu",
        "devices": 1,
        "max_epochs": -1,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return Trainer(**(settings | overrides))


def write_json(slug: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``$OUT/<slug>.json`` when ``OUT`` is set (the device tool's folder)."""
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / f"{slug}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))
        print(f"wrote {path}")


def finish_runs(
    slug: str, device: str, quick: bool, begin: float, skipped: list[str], runs: list[Any]
) -> None:
    """Say what the time guard skipped and the elapsed time; write ``$OUT/<slug>.json`` with
    every run (the end of a script that runs arms until its time guard stops it)."""
    elapsed = time.perf_counter() - begin
    if skipped:
        print(f"\nskipped by the time guard: {', '.join(skipped)}")
    print(f"\nelapsed: {elapsed:.1f} s")
    payload = {"device": device, "torch": torch.__version__, "quick": quick}
    write_json(slug, {**payload, "elapsed_s": elapsed, "skipped": skipped, "results": runs})


def median_ms(fn: Callable[[], Any], device: torch.device, rep_ms: int = 60) -> float:
    """Median milliseconds of ``fn`` (``do_bench`` on CUDA, ``perf_counter`` repeats on CPU)."""
    if device.type == "cuda" and do_bench is not None:
        return float(do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
