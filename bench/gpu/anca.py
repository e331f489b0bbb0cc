"""GPU benchmark of aNCA: deformable-perception kernels, then plain NCA vs aNCA on mazes and Sudoku.

What it measures (aNCA, issue 26), in one run on one GPU, float32 (TF32 off; the kernel check
in float64):

1. ``deform_speed``. **Check first**: ``torchvision.ops.deform_conv2d`` against the pure-torch
   ``deform_conv2d_reference`` (bilinear ``grid_sample``) on random non-zero offsets (uniform in
   ``[-2, 2]`` cells, so taps land between cells and off the grid) and random modulation: max
   abs difference of the outputs (the section fails above 1e-3) and relative max difference of
   the gradients with respect to the input, offsets, mask, weight and bias (fails above 1e-3).
   **Then timing** of one :class:`~ada_modules.nn.anca.DeformablePerception` of the NCA's size
   (``state + 3`` channels -> ``hidden``; 64 + 3 -> 128), batch 64, grids 32x32 and 64x64:
   forward and forward+backward median ms (``median_ms`` of ``_common``: ``do_bench`` on CUDA)
   and peak memory, for the plain 3x3 convolution (``deformable=False``), the torchvision backend
   and the grid_sample backend (offset and modulation layers given small random weights, so the
   taps move).
2. ``maze``: the plain NCA and aNCA (:class:`~ada_modules.nn.anca.NeuralCellularAutomaton`,
   state 64, hidden 128, max offset 2, modulation; aNCA starts from the plain NCA's weights, so
   both compute the same function at initialisation: checked) trained on the same 8192 mazes of
   side 15 in the same batch order (batch 64, steps drawn from ``[2 side, 2.7 side]`` = [30, 40]
   per batch, cross-entropy on every cell), AdamW lr 2e-3 (weight decay 1e-4) with OneCycle,
   gradient clipping 1.0, for ``--maze-seconds`` (70) seconds each: a few calibration steps on a
   throw-away copy size the OneCycle schedule to the time budget (capped at ``--max-steps``).
   Then exact match (:func:`~ada_modules.data.mazes.maze_solved`) and cell accuracy on 256 test
   mazes of sides 15, 33 and 59 with ``2.7 side`` steps (40, 89, 159), and on side 59 with 4x
   that (636 steps) if the time guard allows.
3. ``sudoku``: the same two arms on 9x9 Sudoku with 28-35 givens (8192 unique training puzzles,
   about 2 ms each to generate; 256 unique test puzzles), steps drawn from [15, 20],
   cross-entropy on the blanks, ``--sudoku-seconds`` (60) seconds each. The answer keeps the
   givens (:func:`~ada_modules.data.sudoku.sudoku_answer`); reported: solved fraction
   (:func:`~ada_modules.data.sudoku.sudoku_solved`) and blank-cell accuracy at 20 steps (and 40).

Training columns: steps done, training seconds, ms per step, final loss (mean of the last 50
steps), peak memory. The arms get the same time, not the same number of steps.

Run it (one H200, about 5-6 minutes, guarded to ``--budget-s`` = 420 s; the per-arm training
time shrinks, or a section is skipped, when the guard says so, and what was measured is still
printed and written)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/anca.py

Smoke test on CPU (what ``tests/test_bench_scripts.py`` runs; mazes of side 7, 4x4 Sudoku, 8
training steps per arm, 16 test puzzles; the aNCA backend is grid_sample on CPU)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/anca.py --device cpu --quick

Prints markdown tables and the elapsed time; writes ``$OUT/anca.json`` (``{"device", "torch",
"torchvision", "quick", "elapsed_s", "skipped", "errors", "results": [...]}``) when ``OUT`` is set.
Exits 1 when CUDA is requested but missing, or when a section failed (a kernel check included).
No assertion on the training numbers.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from _common import (  # bench/gpu/_common.py
    Guard,
    add_only_argument,
    bench_device,
    median_ms,
    run_sections,
    sync,
    write_json,
)
from torch import nn

from ada_modules.data.mazes import generate_maze, maze_solved, maze_tensors
from ada_modules.data.sudoku import generate_sudoku, sudoku_answer, sudoku_solved, sudoku_tensors
from ada_modules.nn.anca import (
    DeformablePerception,
    NeuralCellularAutomaton,
    deform_conv2d_reference,
)

SLUG = "anca"
ARMS = ("nca", "anca")  # plain 3x3 perception, deformable perception
LR, WEIGHT_DECAY, CLIP = 2e-3, 1e-4, 1.0
CHECK_TOL = 1e-3


@dataclass(frozen=True)
class Sizes:
    speed_batch: int
    speed_grids: tuple[int, ...]
    check_batch: int
    state: int
    hidden: int
    batch: int
    eval_batch: int
    maze_side: int
    maze_train: int
    maze_test: int
    maze_sides: tuple[int, ...]
    box: int
    givens: tuple[int, int]
    sudoku_train: int
    sudoku_test: int
    sudoku_steps: tuple[int, int]
    calibration: int  # steps timed (after as many warm-up steps) to size the OneCycle schedule


FULL = Sizes(
    speed_batch=64, speed_grids=(32, 64), check_batch=8, state=64, hidden=128, batch=64,
    eval_batch=128, maze_side=15, maze_train=8192, maze_test=256, maze_sides=(15, 33, 59), box=3,
    givens=(28, 35), sudoku_train=8192, sudoku_test=256, sudoku_steps=(15, 20), calibration=10,
)  # fmt: skip
QUICK = Sizes(
    speed_batch=2, speed_grids=(8, 12), check_batch=2, state=8, hidden=16, batch=8,
    eval_batch=16, maze_side=7, maze_train=64, maze_test=16, maze_sides=(7, 9, 11), box=2,
    givens=(8, 10), sudoku_train=64, sudoku_test=16, sudoku_steps=(6, 8), calibration=1,
)  # fmt: skip


def maze_steps(side: int) -> tuple[int, int]:
    """Training step range for mazes of ``side``: about 2 to 2.7 steps per cell of the side."""
    return 2 * side, int(2.7 * side)


def _table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------------------------------
# 1. Deformable perception: check, then speed
# ---------------------------------------------------------------------------------------------


def deform_check(
    channels: int, out_channels: int, batch: int, grid: int, device: torch.device, seed: int
) -> dict[str, Any]:
    """torchvision's deform_conv2d vs deform_conv2d_reference on random offsets and modulation."""
    from torchvision.ops import deform_conv2d

    gen = torch.Generator().manual_seed(seed)
    shape = (batch, channels, grid, grid)
    tensors = {
        "input": torch.randn(shape, generator=gen),
        "offset": 4 * torch.rand(batch, 18, grid, grid, generator=gen) - 2,
        "mask": 2 * torch.sigmoid(torch.randn(batch, 9, grid, grid, generator=gen)),
        "weight": torch.randn(out_channels, channels, 3, 3, generator=gen) / (9 * channels) ** 0.5,
        "bias": 0.1 * torch.randn(out_channels, generator=gen),
    }
    # float64: bilinear sampling's derivative jumps at integer positions, where float32
    # rounding could pick the other side and fail the check for no fault of either kernel
    leaves = [t.to(device, torch.float64).requires_grad_() for t in tensors.values()]
    x, offset, mask, weight, bias = leaves
    ours = deform_conv2d(x, offset, weight, bias, padding=(1, 1), mask=mask)
    reference = deform_conv2d_reference(x, offset, weight, bias, mask=mask, padding=1)
    grad_out = torch.randn(ours.shape, generator=gen).to(device, torch.float64)
    grads_ours = torch.autograd.grad(ours, leaves, grad_out)
    grads_reference = torch.autograd.grad(reference, leaves, grad_out)
    record: dict[str, Any] = {
        "section": "deform_check",
        "check": "torchvision_vs_grid_sample",
        "shape": list(shape),
        "out_channels": out_channels,
        "output_max_abs_diff": float((ours - reference).detach().abs().max()),
        "output_max_abs": float(reference.detach().abs().max()),
        "grad_rel_diff": {
            name: float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
            for name, a, b in zip(tensors, grads_ours, grads_reference, strict=True)
        },
    }
    record["ok"] = record["output_max_abs_diff"] <= CHECK_TOL and all(
        v <= CHECK_TOL for v in record["grad_rel_diff"].values()
    )
    return record


def run_deform_speed(
    sizes: Sizes, device: torch.device, seed: int, results: list[dict[str, Any]]
) -> None:
    channels, out_channels = sizes.state + 3, sizes.hidden
    print(f"\n## 1. Deformable perception ({channels} -> {out_channels} channels, 3x3)\n")
    check = deform_check(
        channels, out_channels, sizes.check_batch, sizes.speed_grids[0], device, seed
    )
    results.append(check)
    grads = ", ".join(f"{k} {v:.1e}" for k, v in check["grad_rel_diff"].items())
    print(
        f"check torchvision vs grid_sample, input {tuple(check['shape'])}, offsets in [-2, 2]: "
        f"output max |diff| {check['output_max_abs_diff']:.2e} (max |out| "
        f"{check['output_max_abs']:.1f}); gradients, relative max |diff|: {grads} -> "
        f"{'ok' if check['ok'] else 'MISMATCH'}\n"
    )

    variants = (
        ("conv3x3", {"deformable": False}),
        ("torchvision", {"backend": "torchvision"}),
        ("grid_sample", {"backend": "grid_sample"}),
    )
    rows = []
    for grid in sizes.speed_grids:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(sizes.speed_batch, channels, grid, grid, generator=gen).to(device)
        x.requires_grad_()
        base_ms = None
        for name, kwargs in variants:
            torch.manual_seed(seed)
            perception = DeformablePerception(channels, out_channels, **kwargs).to(device)
            for layer in (perception.offsets, perception.modulation):
                if layer is not None:  # zero at init: give the taps somewhere to move
                    nn.init.normal_(layer.weight, std=0.02)

            def forward(perception=perception, x=x) -> None:
                with torch.no_grad():
                    perception(x)

            def forward_backward(perception=perception, x=x) -> None:
                x.grad = None
                perception(x).sum().backward()

            fwd_ms = median_ms(forward, device)
            fwd_bwd_ms = median_ms(forward_backward, device)
            _reset_peak(device)
            forward_backward()
            sync(device)
            base_ms = fwd_bwd_ms if base_ms is None else base_ms
            record = {
                "section": "deform_speed",
                "variant": name,
                "batch": sizes.speed_batch,
                "grid": grid,
                "channels": channels,
                "out_channels": out_channels,
                "forward_ms": fwd_ms,
                "forward_backward_ms": fwd_bwd_ms,
                "vs_conv3x3": fwd_bwd_ms / base_ms,
                "peak_mem_gb": _peak_gb(device),
            }
            results.append(record)
            mem = "-" if record["peak_mem_gb"] is None else f"{record['peak_mem_gb']:.2f}"
            rows.append(
                [f"{grid}x{grid}", name, f"{fwd_ms:.3f}", f"{fwd_bwd_ms:.3f}",
                 f"{record['vs_conv3x3']:.1f}x", mem]
            )  # fmt: skip
    print(f"batch {sizes.speed_batch}, median ms\n")
    _table(["grid", "perception", "forward", "forward+backward", "vs conv3x3", "peak GB"], rows)
    if not check["ok"]:
        raise RuntimeError(
            f"torchvision and grid_sample deformable convolutions disagree beyond {CHECK_TOL}"
        )


# ---------------------------------------------------------------------------------------------
# Training and evaluation shared by the maze and Sudoku sections
# ---------------------------------------------------------------------------------------------


@dataclass
class Task:
    """Training data on the device and how to score it."""

    name: str
    inputs: torch.Tensor
    target: torch.Tensor
    steps: tuple[int, int]  # training steps drawn uniformly from [low, high]
    blanks_only: bool  # loss on the blank cells (Sudoku: input channel 0)


def build_arms(
    in_channels: int, out_channels: int, sizes: Sizes, backend: str, device: torch.device, seed: int
) -> dict[str, NeuralCellularAutomaton]:
    """The plain NCA and aNCA; aNCA takes the plain NCA's weights (its offsets start at zero)."""
    models = {}
    for arm in ARMS:
        torch.manual_seed(seed)
        models[arm] = NeuralCellularAutomaton(
            in_channels, out_channels, state_channels=sizes.state, hidden_channels=sizes.hidden,
            deformable=arm == "anca", backend=backend,
        ).to(device)  # fmt: skip
    missing, unexpected = models["anca"].load_state_dict(models["nca"].state_dict(), strict=False)
    assert not unexpected and all(
        k.startswith(("perception.offsets", "perception.modulation")) for k in missing
    ), (missing, unexpected)
    return models


def task_loss(task: Task, logits: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor):
    loss = F.cross_entropy(logits, target, reduction="none")
    if not task.blanks_only:
        return loss.mean()
    mask = inputs[:, 0]
    return (loss * mask).sum() / mask.sum().clamp_min(1)


def train_step(model, optimizer, task: Task, inputs, target, steps: int) -> torch.Tensor:
    loss = task_loss(task, model(inputs, steps), inputs, target)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    return loss.detach()


class Batches:
    """Seeded batches and step counts: every arm sees the same sequence."""

    def __init__(self, task: Task, batch: int, seed: int) -> None:
        self.task, self.batch = task, batch
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        idx = torch.randint(len(self.task.inputs), (self.batch,), generator=self.gen)
        idx = idx.to(self.task.inputs.device)
        low, high = self.task.steps
        steps = int(torch.randint(low, high + 1, (), generator=self.gen))
        return self.task.inputs[idx], self.task.target[idx], steps


def calibrate(model, task: Task, sizes: Sizes, device: torch.device, seed: int) -> float:
    """Seconds per training step, measured on a throw-away copy (warms up cuDNN too)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    batches = Batches(task, sizes.batch, seed + 1000)
    for _ in range(sizes.calibration):  # warm-up
        train_step(model, optimizer, task, *batches())
    sync(device)
    start = time.perf_counter()
    for _ in range(sizes.calibration):
        train_step(model, optimizer, task, *batches())
    sync(device)
    return (time.perf_counter() - start) / sizes.calibration


def train_arm(
    arm: str,
    model: NeuralCellularAutomaton,
    task: Task,
    sizes: Sizes,
    seconds: float,
    max_steps: int,
    device: torch.device,
    seed: int,
) -> dict[str, Any]:
    """Train for about ``seconds`` (a OneCycle schedule sized by calibration), at most
    ``max_steps`` steps; stops early past 1.25 x ``seconds``."""
    step_s = calibrate(model, task, sizes, device, seed)
    total = max(1, min(max_steps, int(seconds / step_s)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=LR, total_steps=total, pct_start=0.1
    )
    batches = Batches(task, sizes.batch, seed)
    log_every = max(1, total // 20)
    curve: list[tuple[int, float]] = []
    tail = torch.zeros((), device=device)  # summed on the device: no sync per step
    tail_len = min(50, total)
    loss = torch.zeros((), device=device)
    _reset_peak(device)
    model.train()
    sync(device)
    start = time.perf_counter()
    done = 0
    for step in range(total):
        loss = train_step(model, optimizer, task, *batches())
        schedule.step()
        done = step + 1
        if done > total - tail_len:
            tail += loss
        if done % log_every == 0 or done == total:
            curve.append((done, float(loss)))
        if time.perf_counter() - start > 1.25 * seconds:
            break
    sync(device)
    train_s = time.perf_counter() - start
    stopped_early = done < total
    final = float(loss) if stopped_early else float(tail) / tail_len
    return {
        "section": task.name,
        "arm": arm,
        "params": sum(p.numel() for p in model.parameters()),
        "budget_s": seconds,
        "calibrated_step_ms": 1e3 * step_s,
        "planned_steps": total,
        "steps": done,
        "stopped_early": stopped_early,
        "train_s": train_s,
        "step_ms": 1e3 * train_s / done,
        "final_loss": final,
        "peak_mem_gb": _peak_gb(device),
        "curve": curve,
    }


@torch.no_grad()
def logits_in_chunks(model, inputs: torch.Tensor, steps: int, chunk: int) -> torch.Tensor:
    model.eval()
    return torch.cat([model(part, steps) for part in inputs.split(chunk)])


def identity_gap(models: dict[str, NeuralCellularAutomaton], inputs: torch.Tensor, steps: int):
    """Max |aNCA - NCA| of the logits at initialisation (zero offsets, unit modulation)."""
    with torch.no_grad():
        return float((models["anca"](inputs, steps) - models["nca"](inputs, steps)).abs().max())


def arm_seconds(guard: Guard, want: float, reserve_s: float, arms: int = len(ARMS)) -> float:
    """Training seconds per arm: ``want``, or less when the guard must keep ``reserve_s``."""
    left = guard.budget_s - guard.elapsed() - reserve_s
    return max(0.0, min(want, left / arms))


def train_arms(
    task: Task,
    models: dict[str, NeuralCellularAutomaton],
    sizes: Sizes,
    args: argparse.Namespace,
    want_s: float,
    reserve_s: float,
    device: torch.device,
    guard: Guard,
    results: list[dict[str, Any]],
) -> list[dict[str, Any]] | None:
    """Check that both arms start equal, then train each for the same time (``None``: no time)."""
    high = task.steps[1]
    gap = identity_gap(models, task.inputs[:8], high)
    print(f"identity at init (aNCA vs NCA, {high} steps): max |diff| = {gap:.2e}")
    results.append({"section": task.name, "check": "identity_at_init", "max_abs_diff": gap,
                    "ok": gap <= CHECK_TOL})  # fmt: skip
    seconds = arm_seconds(guard, want_s, reserve_s)
    if seconds < min(5.0, want_s):  # the guard left too little
        guard.skipped.append(f"{task.name} training (no time left)")
        print(f"[time guard] no time left to train on {task.name}")
        return None
    records = [
        train_arm(arm, models[arm], task, sizes, seconds, args.max_steps, device, args.seed)
        for arm in ARMS
    ]
    print(f"\ntraining, {seconds:.1f} s per arm (at most {args.max_steps} steps)\n")
    print_training(records)
    return records


def print_training(records: list[dict[str, Any]]) -> None:
    rows = []
    for r in records:
        mem = "-" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.2f}"
        early = " (stopped early)" if r["stopped_early"] else ""
        rows.append(
            [r["arm"], str(r["params"]), f"{r['steps']}{early}", f"{r['train_s']:.1f}",
             f"{r['step_ms']:.2f}", f"{r['final_loss']:.4f}", mem]
        )  # fmt: skip
    _table(["arm", "params", "steps", "train s", "ms/step", "final loss", "peak GB"], rows)


# ---------------------------------------------------------------------------------------------
# 2. Mazes
# ---------------------------------------------------------------------------------------------


def maze_set(side: int, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return maze_tensors([generate_maze(side, rng) for _ in range(count)])


def run_maze(
    sizes: Sizes,
    args: argparse.Namespace,
    device: torch.device,
    guard: Guard,
    reserve_s: float,
    results: list[dict[str, Any]],
) -> None:
    side = sizes.maze_side
    low, high = maze_steps(side)
    print(f"\n## 2. Mazes: train side {side}, steps [{low}, {high}], batch {sizes.batch}\n")
    start = time.perf_counter()
    train_x, train_y = maze_set(side, sizes.maze_train, args.seed)
    tests = {
        s: maze_set(s, sizes.maze_test, args.seed + 1 + i) for i, s in enumerate(sizes.maze_sides)
    }
    print(
        f"data: {sizes.maze_train} training mazes, {sizes.maze_test} test mazes per side "
        f"{list(sizes.maze_sides)} ({time.perf_counter() - start:.1f} s)"
    )
    task = Task("maze", train_x.to(device), train_y.to(device), (low, high), blanks_only=False)
    models = build_arms(3, 2, sizes, args.backend, device, args.seed)
    eval_reserve = 30.0 if device.type == "cuda" else 5.0
    records = train_arms(
        task, models, sizes, args, args.maze_seconds, reserve_s + eval_reserve, device,
        guard, results,
    )  # fmt: skip
    if records is None:
        return

    evals: list[tuple[int, int]] = [(s, int(2.7 * s)) for s in sizes.maze_sides]
    columns = []
    last_s = None
    for i, (s, steps) in enumerate(evals + [(sizes.maze_sides[-1], 4 * evals[-1][1])]):
        if i == len(evals):  # the long run on the largest side, if time permits
            need = 4 * last_s + 5 + reserve_s
            if not guard.ok(f"maze eval side {s} x4 steps", need):
                break
        inputs, target = tests[s][0].to(device), tests[s][1].to(device)
        sync(device)
        t0 = time.perf_counter()
        for record, arm in zip(records, ARMS, strict=True):
            logits = logits_in_chunks(models[arm], inputs, steps, sizes.eval_batch)
            prediction = logits.argmax(dim=1)
            record.setdefault("eval", []).append({
                "side": s,
                "steps": steps,
                "exact": float(maze_solved(prediction, target).float().mean()),
                "cell_acc": float((prediction == target).float().mean()),
            })  # fmt: skip
        sync(device)
        last_s = time.perf_counter() - t0
        columns.append(f"side {s} ({steps} steps)")
    print(f"\nexact match (cell accuracy) on {sizes.maze_test} test mazes per side\n")
    rows = [
        [r["arm"]] + [f"{e['exact']:.3f} ({e['cell_acc']:.4f})" for e in r.get("eval", [])]
        for r in records
    ]
    _table(["arm", *columns], rows)
    results.extend(records)


# ---------------------------------------------------------------------------------------------
# 3. Sudoku
# ---------------------------------------------------------------------------------------------


def sudoku_set(
    box: int, givens: tuple[int, int], count: int, unique: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    pairs = [
        generate_sudoku(box, int(rng.integers(givens[0], givens[1] + 1)), rng, unique=unique)
        for _ in range(count)
    ]
    return sudoku_tensors([p for p, _ in pairs], [s for _, s in pairs])


def run_sudoku(
    sizes: Sizes,
    args: argparse.Namespace,
    device: torch.device,
    guard: Guard,
    reserve_s: float,
    results: list[dict[str, Any]],
) -> None:
    n = sizes.box**2
    low, high = sizes.sudoku_steps
    print(
        f"\n## 3. Sudoku {n}x{n}, {sizes.givens[0]}-{sizes.givens[1]} givens, steps [{low}, "
        f"{high}], batch {sizes.batch}\n"
    )
    start = time.perf_counter()
    # unique puzzles: with several solutions the cross-entropy would mark valid answers wrong
    train_x, train_y = sudoku_set(sizes.box, sizes.givens, sizes.sudoku_train, True, args.seed)
    test_x, test_y = sudoku_set(sizes.box, sizes.givens, sizes.sudoku_test, True, args.seed + 1)
    print(
        f"data: {sizes.sudoku_train} unique training puzzles, {sizes.sudoku_test} unique "
        f"test puzzles ({time.perf_counter() - start:.1f} s)"
    )
    task = Task("sudoku", train_x.to(device), train_y.to(device), (low, high), blanks_only=True)
    models = build_arms(n + 1, n, sizes, args.backend, device, args.seed)
    records = train_arms(
        task, models, sizes, args, args.sudoku_seconds, reserve_s + 10, device, guard,
        results,
    )  # fmt: skip
    if records is None:
        return

    inputs, target = test_x.to(device), test_y.to(device)
    blanks = inputs[:, 0]
    columns = []
    for steps in (high, 2 * high):
        for record, arm in zip(records, ARMS, strict=True):
            logits = logits_in_chunks(models[arm], inputs, steps, sizes.eval_batch)
            prediction = sudoku_answer(inputs, logits)
            solved = sudoku_solved(prediction + 1, inputs.argmax(dim=1))
            correct = ((prediction == target).float() * blanks).sum() / blanks.sum()
            record.setdefault("eval", []).append({
                "steps": steps,
                "solved": float(solved.float().mean()),
                "blank_acc": float(correct),
            })  # fmt: skip
        columns.append(f"{steps} steps")
    print(f"\nsolved fraction (blank-cell accuracy) on {sizes.sudoku_test} unique test puzzles\n")
    rows = [
        [r["arm"]] + [f"{e['solved']:.3f} ({e['blank_acc']:.4f})" for e in r["eval"]]
        for r in records
    ]
    _table(["arm", *columns], rows)
    results.extend(records)


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a CPU smoke test")
    parser.add_argument("--budget-s", type=float, default=420.0, help="overall time budget")
    parser.add_argument("--maze-seconds", type=float, default=70.0, help="training s per arm")
    parser.add_argument("--sudoku-seconds", type=float, default=60.0, help="training s per arm")
    parser.add_argument("--max-steps", type=int, default=20000, help="training steps per arm")
    parser.add_argument(
        "--backend", default="auto", choices=("auto", "torchvision", "grid_sample"),
        help="aNCA's deformable convolution (auto: torchvision on CUDA, grid_sample on CPU)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    add_only_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.max_steps = min(args.max_steps, 8)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guard = Guard(budget_s=args.budget_s)
    resolved = bench_device(args.device)
    if resolved is None:
        return 1
    device, device_name = resolved
    sizes = QUICK if args.quick else FULL
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 throughout, for every arm
    torch.backends.cudnn.allow_tf32 = False
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    print(f"# aNCA GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(
        f"device: {device_name}; torch {torch.__version__}; torchvision "
        f"{torchvision.__version__}; float32 (TF32 off); budget {args.budget_s:.0f} s"
    )
    results: list[dict[str, Any]] = []
    # planned seconds of each section, so that an earlier one leaves time for the later ones
    plan = {
        "deform_speed": 30.0,
        "maze": 2 * args.maze_seconds + 45,
        "sudoku": 2 * args.sudoku_seconds + 20,
    }
    wanted = set(plan) if args.only is None else {s.strip() for s in args.only.split(",")}

    def reserve(after: str) -> float:
        later = list(plan)[list(plan).index(after) + 1 :]
        return sum(plan[name] for name in later if name in wanted)

    sections: list[tuple[str, Callable[[], None], float]] = [
        ("deform_speed", lambda: run_deform_speed(sizes, device, args.seed, results), 15),
        ("maze", lambda: run_maze(sizes, args, device, guard, reserve("maze"), results), 60),
        ("sudoku", lambda: run_sudoku(sizes, args, device, guard, reserve("sudoku"), results), 40),
    ]
    errors = run_sections(sections, guard, args.only)
    failed = [f"{r['section']} {r['check']}" for r in results if r.get("ok") is False]
    failed = [name for name in failed if not name.startswith("deform_check")]  # raised already
    if failed:
        print(f"\nchecks out of tolerance: {', '.join(failed)}")
    elapsed = guard.elapsed()
    print(f"\nelapsed: {elapsed:.1f} s")
    write_json(
        SLUG,
        {
            "device": device_name,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "quick": args.quick,
            "args": vars(args),
            "elapsed_s": elapsed,
            "skipped": guard.skipped,
            "errors": errors,
            "results": results,
        },
    )
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
