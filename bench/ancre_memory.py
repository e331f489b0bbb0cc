"""Peak memory of one training step of ANCRe's layouts, with and without deferred state gradients.

The wide trunk of ``bench/ancre.py --overhead`` (``MLPResNet``: 24 blocks of width 512, expansion
4, LayerNorm) on ``--rows`` input rows. Each layout runs in a fresh process, on one thread: two
warm-up steps (so the parameters' gradients exist), then one forward and one backward pass. The
process's resident memory is read when the forward pass starts and ends, and its peak over the
step (``VmHWM``, reset before the step through ``/proc/self/clear_refs``) gives the step's peak.
``MALLOC_MMAP_THRESHOLD_`` is fixed below a state's size, so each tensor gets its own mapping and
is given back to the system when freed: resident memory then follows the live tensors.

Two allocation regimes, each layout in both: as on CPU, where an allocation's pages count only
once written, and as on CUDA, where the whole allocation counts at once (``MALLOC_PERTURB_`` makes
the C library fill every allocation when it is made).

Columns, in units of ``S`` (the bytes of one state, ``rows x 512`` elements): the memory the
forward pass leaves for the backward (saved activations and the graph), and in each regime the
step's peak above the memory at its start and that peak minus residual's. ``source_deferred``
and ``input_deferred`` use ``state_grads="deferred"``, whose backward keeps every row's output
gradient until the pass ends, in pieces of 1, 2, 4, ... states allocated as rows arrive; term by
term, autograd holds the gradients of the states that later rows have read and not yet given to
their blocks. Linux only (``/proc``). Writes ``--out/ancre_memory.json``. Reports only; no
assertion on the numbers.

Example (about 5 minutes on one core; ``--dtypes float32 bfloat16`` adds bf16; ``--quick``, 256
rows and three layouts, takes about a minute)::

    python bench/ancre_memory.py --out /tmp/mem
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

LAYOUTS = ("residual", "denseformer", "source", "source_deferred", "input", "input_deferred")
WIDTH, DEPTH, EXPANSION = 512, 24, 4


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1))


def measure(layout: str, rows: int, dtype: torch.dtype) -> dict:
    """One layout's step in this process: resident memory in bytes at the step's points."""
    from ada_modules.nn import MLPResNet

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mode, _, grads = layout.partition("_")
    model = MLPResNet(
        WIDTH, depth=DEPTH, expansion=EXPANSION, mode=mode, state_grads=grads or "autograd"
    ).to(dtype)
    inputs = torch.randn(rows, WIDTH, dtype=dtype)
    for _ in range(2):
        model(inputs).float().square().mean().backward()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    start = 1024 * _status_kib("VmRSS")
    loss = model(inputs).float().square().mean()
    forward = 1024 * _status_kib("VmRSS")
    loss.backward()
    peak = 1024 * _status_kib("VmHWM")
    state = rows * WIDTH * inputs.element_size()
    return {
        "layout": layout,
        "rows": rows,
        "dtype": str(dtype).removeprefix("torch."),
        "state_bytes": state,
        "saved_by_forward": (forward - start) / state,
        "step_peak": (peak - start) / state,
    }


def _child(layout: str, rows: int, dtype: str, filled: bool) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    if filled:
        env["MALLOC_PERTURB_"] = "165"
    command = [sys.executable, __file__, "--one", layout, "--rows", str(rows), "--dtype", dtype]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{layout} ({dtype}, {rows} rows) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(layouts: tuple[str, ...], rows: int, dtype: str) -> list[dict]:
    """Each layout in a fresh process per regime; the peaks also relative to residual's."""
    records = []
    for layout in layouts:
        record = _child(layout, rows, dtype, filled=False)
        record["step_peak_filled"] = _child(layout, rows, dtype, filled=True)["step_peak"]
        records.append(record)
    base = next((r for r in records if r["layout"] == "residual"), None)
    state_mib = records[0]["state_bytes"] / 2**20
    print(f"\n### {rows} rows, {dtype}: S = {state_mib:.2f} MiB, K = {DEPTH} blocks (1 thread)\n")
    print(
        "| layout | saved by the forward pass (S) | step peak, as on CPU (S) | - residual's | "
        "step peak, as on CUDA (S) | - residual's |"
    )
    print("|---|---|---|---|---|---|")
    for record in records:
        cells = [f"{record['saved_by_forward']:.1f}"]
        for key in ("step_peak", "step_peak_filled"):
            extra = "" if base is None else f"{record[key] - base[key]:+.1f}"
            cells += [f"{record[key]:.1f}", extra]
        print(f"| {record['layout']} | " + " | ".join(cells) + " |")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[2048])
    parser.add_argument("--dtypes", nargs="*", default=["float32"], help="also: bfloat16")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument(
        "--quick", action="store_true", help="256 rows: residual, source, source_deferred"
    )
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--one", choices=LAYOUTS, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.rows[0], getattr(torch, args.dtype))))
        return
    if args.quick:
        args.rows, args.layouts = [256], ["residual", "source", "source_deferred"]
    start = time.perf_counter()
    results = [
        record
        for rows in args.rows
        for dtype in args.dtypes
        for record in run(tuple(args.layouts), rows, dtype)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ancre_memory.json").write_text(json.dumps({"results": results}, indent=1))
    print(f"\nelapsed {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
