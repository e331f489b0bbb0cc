"""GPU benchmark of AOT-POT: 2-D multi-PDE pre-training, residual vs multi-stream (mHC) residual.

What it measures (issue 17, item 5), in one run on one GPU:

0. **Check first** (no timing): at initialisation the mHC network computes the residual network's
   output (same sub-layer weights; the streams start equal), to 1e-4.
1. **Data**: 2-D advection and 2-D diffusion trajectories on a 64x64 grid (the library's
   pseudo-spectral generators, on CPU, ``--trajectories`` per PDE), next-frame windows of 4
   input frames; test: 64 trajectories per PDE rolled out for 5 frames.
2. **Training**: the operator transformer (patch 4, i.e. 16x16 tokens, ``--width`` channels,
   ``--depth`` blocks, 8 Fourier modes) with ``residual`` and with ``mhc`` (4 streams, per-token
   dynamic weights, Sinkhorn mixing), from the same seed, AdamW lr 1e-3, batch ``--batch``, bf16 autocast, for
   ``--steps`` steps or ``--train-seconds`` seconds each, whichever comes first.
3. **Columns**: extra parameters (%), median step time and samples/s (overhead % against
   residual), peak memory, steps done, and the test relative L2 per PDE (one step and rolled
   out) after the same number of steps (the smaller of the two runs' counts: the faster run is
   evaluated at that step too).

Run it (one H200)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/aot_pot.py

Smoke test on CPU (what ``tests/test_bench_scripts.py`` runs)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/aot_pot.py --device cpu --quick

Prints a markdown table; writes ``$OUT/aot_pot.json`` when ``OUT`` is set. Reports only; no
assertion on the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import sync, write_json  # bench/gpu/_common.py

from ada_modules.data.pde import PDE_FAMILIES, solve_pde
from ada_modules.models.operator_transformer import relative_l2
from ada_modules.nn.operator_transformer import OperatorTransformer

FAMILIES = ("advection_2d", "diffusion_2d")
HISTORY, ROLLOUT = 4, 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a CPU smoke test")
    parser.add_argument("--grid", type=int, default=64)
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--train-seconds", type=float, default=100.0)
    args = parser.parse_args(argv)
    if args.quick:
        args.grid, args.trajectories, args.width, args.depth = 16, 8, 16, 1
        args.batch, args.steps, args.train_seconds = 4, 3, 30.0
    return args


def make_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training windows (history + 1 frames), test windows (history + rollout), test labels."""
    train, test, labels = [], [], []
    frames = 20 if not args.quick else HISTORY + ROLLOUT
    num_test = 64 if not args.quick else 2
    for family in FAMILIES:
        traj = solve_pde(family, args.trajectories, args.grid, frames, seed=0)
        train.append(traj.unfold(1, HISTORY + 1, 1).permute(0, 1, 5, 2, 3, 4).flatten(0, 1))
        test.append(solve_pde(family, num_test, args.grid, HISTORY + ROLLOUT, seed=1))
        labels.append(torch.full((num_test,), PDE_FAMILIES.index(family)))
    return torch.cat(train), torch.cat(test), torch.cat(labels)


def build(kind: str, args: argparse.Namespace) -> OperatorTransformer:
    torch.manual_seed(0)
    streams = {"n_streams": 4, "dynamic": "token"} if kind == "mhc" else None
    return OperatorTransformer(
        spatial_dims=2, grid=args.grid, history=HISTORY, patch_size=4,
        width=args.width, depth=args.depth, modes=8 if not args.quick else 2, spectral_blocks=8
        if not args.quick else 2, groups=8, residual=kind, streams=streams,
    )  # fmt: skip


@torch.no_grad()
def evaluate(net: OperatorTransformer, test: torch.Tensor, labels: torch.Tensor) -> dict:
    net.eval()
    with torch.autocast(test.device.type, dtype=torch.bfloat16):
        predicted = net.rollout(test[:, :HISTORY], ROLLOUT).float()
    target = test[:, HISTORY:]
    one = relative_l2(predicted[:, 0], target[:, 0])
    rolled = relative_l2(predicted, target)
    net.train()
    return {
        PDE_FAMILIES[i]: {"rel_l2": float(one[labels == i].mean()), "rollout": float(rolled[labels == i].mean())}
        for i in labels.unique().tolist()
    }  # fmt: skip


def train(net, train_data, args, device, max_steps: int) -> tuple[list[float], int, float]:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(0)
    times, step, start = [], 0, time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    while step < max_steps and time.perf_counter() - start < args.train_seconds:
        idx = torch.randint(len(train_data), (args.batch,), generator=gen)
        batch = train_data[idx].to(device, non_blocking=True)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = net(batch[:, :HISTORY])[0]
        loss = relative_l2(pred.float(), batch[:, HISTORY]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        step += 1
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return times, step, peak


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu --quick for the smoke test", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    start = time.perf_counter()
    train_data, test, labels = make_data(args)
    print(f"data: {len(train_data)} training windows, {len(test)} test trajectories "
          f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    test, labels = test.to(device), labels.to(device)

    plain = build("residual", args).to(device)
    ours = build("mhc", args).to(device)
    ours.load_state_dict(plain.state_dict(), strict=False)
    with torch.no_grad():
        gap = (ours(test[:4, :HISTORY])[0] - plain(test[:4, :HISTORY])[0]).abs().max().item()
    print(f"identity at init (mhc vs residual, same sub-layer weights): max |diff| = {gap:.2e}")
    if gap > 1e-4:
        print("identity check failed", file=sys.stderr)
        return 1
    ours = build("mhc", args).to(device)  # its own init, as a user would train it

    records = []
    max_steps = args.steps
    for kind, net in (("residual", plain), ("mhc", ours)):
        times, steps, peak = train(net, train_data, args, device, max_steps)
        max_steps = steps  # mhc gets at most the residual run's steps
        warm = times[20:] if len(times) > 40 else times
        median = statistics.median(warm)
        records.append({
            "residual": kind,
            "params": sum(p.numel() for p in net.parameters()),
            "median_step_ms": 1000 * median,
            "samples_per_s": args.batch / median,
            "peak_mem_gb": peak,
            "steps": steps,
            "test": evaluate(net, test, labels),
        })  # fmt: skip
    if records[1]["steps"] < records[0]["steps"]:  # mhc ran out of time first: equal steps
        net = build("residual", args).to(device)
        _, steps, _ = train(net, train_data, args, device, records[1]["steps"])
        records[0]["steps"], records[0]["test"] = steps, evaluate(net, test, labels)

    base = records[0]
    print(f"\n### 2-D multi-PDE ({', '.join(FAMILIES)}), grid {args.grid}, width {args.width}, "
          f"depth {args.depth}, batch {args.batch}, {device}\n")  # fmt: skip
    header = " | ".join(f"{f} rel-L2 (1 step / {ROLLOUT} steps)" for f in FAMILIES)
    print(f"| residual | extra params % | median step ms | samples/s | overhead % | peak GB | "
          f"steps | {header} |")  # fmt: skip
    print("|---" * (7 + len(FAMILIES)) + "|")
    for r in records:
        extra = 100 * (r["params"] - base["params"]) / base["params"]
        overhead = 100 * (r["median_step_ms"] / base["median_step_ms"] - 1)
        cells = " | ".join(
            f"{r['test'][f]['rel_l2']:.4f} / {r['test'][f]['rollout']:.4f}" for f in FAMILIES
        )
        print(f"| {r['residual']} | {extra:.2f} | {r['median_step_ms']:.2f} | "
              f"{r['samples_per_s']:.0f} | {overhead:.1f} | {r['peak_mem_gb']:.2f} | "
              f"{r['steps']} | {cells} |")  # fmt: skip
    print(f"\nelapsed {time.perf_counter() - start:.0f} s")
    write_json("aot_pot", {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "identity_gap": gap,
        "results": records,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
