"""GPU benchmark of AMARIS: activation-statistics collection and merge time for 1B-shaped layers.

What it measures (issue 22), with the linear layers of one Llama-3.2-1B-shaped decoder block
(hidden 2048, intermediate 8192, 32 query / 8 key-value heads of dim 64: q, o ``2048 -> 2048``,
k, v ``2048 -> 512``, gate, up ``2048 -> 8192``, down ``8192 -> 2048``), random weights and
random inputs, in one run:

a. **Checks first.** On the device, :func:`~ada_modules.merging.generalized_eigh` against the
   CPU float64 result on a 512-dim pair (eigenvalues, relative error), and the AMARIS layer's
   predicted deviation against the deviation measured on the statistics (relative error).
b. **Statistics collection**: :func:`~ada_modules.merging.collect_activation_stats` on one
   bf16 block (an ``nn.Module`` calling the seven layers as a decoder block's MLP and attention
   projections do) over batches of 8 x 512 tokens; tokens per second, and the time of a plain
   forward of the block on the same batches for scale (the float64 accumulation ``x~ᵀ x~`` is
   the overhead).
c. **Merge time per layer**: :func:`~ada_modules.merging.amaris_layer` (float64 generalized
   eigensolver, gate, projection) for each distinct shape, median of a few calls, and the
   extrapolation to the whole 16-block model with one specialist (7 layers per block; our
   implementation solves one eigenproblem per layer, also where layers share an input).

Timing: ``median_ms`` of ``_common`` (``do_bench`` on CUDA, median of 3 on the CPU). The run is
guarded to ``--budget-s`` (420 s by default); what was measured is still printed and written.

Run it::

    python bench/gpu/amaris.py                    # on a GPU machine, ~3 minutes
    python bench/gpu/amaris.py --device cpu --quick   # smoke test at tiny sizes
"""

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _common import (
    Guard,
    add_only_argument,
    bench_device,
    median_ms,
    run_sections,
    sync,
    write_json,
)
from torch import nn

from ada_modules.merging import (
    ActivationStats,
    amaris_layer,
    collect_activation_stats,
    generalized_eigh,
)

SLUG = "amaris"


@dataclass(frozen=True)
class Sizes:
    hidden: int
    intermediate: int
    kv: int
    batch: int
    seq: int
    batches: int
    blocks: int
    check_dim: int


FULL = Sizes(
    hidden=2048, intermediate=8192, kv=512, batch=8, seq=512, batches=8, blocks=16, check_dim=512
)
QUICK = Sizes(
    hidden=64, intermediate=256, kv=16, batch=2, seq=16, batches=2, blocks=2, check_dim=32
)


class Block(nn.Module):
    """The seven linear layers of a Llama decoder block, called as the block calls them."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        h, i, kv = s.hidden, s.intermediate, s.kv
        self.q, self.k, self.v, self.o = (
            nn.Linear(h, h, bias=False),
            nn.Linear(h, kv, bias=False),
            nn.Linear(h, kv, bias=False),
            nn.Linear(h, h, bias=False),
        )
        self.gate, self.up = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        # attention itself does not matter for the statistics: a cheap stand-in mixes q, k, v
        mixed = q + (k.mean(-1, keepdim=True) + v.mean(-1, keepdim=True))
        x = x + self.o(mixed)
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _shapes(s: Sizes) -> dict[str, tuple[int, int]]:
    h, i, kv = s.hidden, s.intermediate, s.kv
    return {"q/o": (h, h), "k/v": (kv, h), "gate/up": (i, h), "down": (h, i)}


def _random_stats(d: int, samples: int, scale: torch.Tensor, device, generator) -> torch.Tensor:
    x = torch.randn(samples, d, device=device, dtype=torch.float64, generator=generator) * scale
    return x.T @ x


def run_checks(s: Sizes, device: torch.device, results: list[dict[str, Any]]) -> None:
    print("\n## a. Checks (device vs CPU float64)\n")
    g = torch.Generator(device=device).manual_seed(0)
    d = s.check_dim
    sigma_b = _random_stats(d, 4 * d, torch.ones(d, device=device, dtype=torch.float64), device, g)
    scale = torch.linspace(0.5, 2.0, d, device=device, dtype=torch.float64)
    sigma_s = _random_stats(d, 4 * d, scale, device, g)
    gammas, _ = generalized_eigh(sigma_s, sigma_b)
    reference, _ = generalized_eigh(sigma_s.cpu(), sigma_b.cpu())
    eig_error = float(((gammas.cpu() - reference).abs() / reference.abs()).max())
    weight = torch.randn(d, d, device=device, dtype=torch.float64, generator=g)
    delta = 0.1 * torch.randn(d, d, device=device, dtype=torch.float64, generator=g)
    projected, report = amaris_layer(delta, sigma_s, sigma_b, 0.05, weight)
    measured = float(((projected @ sigma_b) * projected).sum())
    deviation_error = abs(measured - report.predicted_deviation) / report.predicted_deviation
    for name, error, tolerance in (
        ("generalized eigenvalues", eig_error, 1e-8),
        ("predicted vs measured deviation", deviation_error, 1e-8),
    ):
        ok = error <= tolerance
        results.append({"section": "check", "check": name, "error": error, "ok": ok})
        print(f"| {name} | rel. error {error:.2e} | {'ok' if ok else 'OUT OF TOLERANCE'} |")


def run_collection(s: Sizes, device: torch.device, results: list[dict[str, Any]]) -> None:
    print("\n## b. Statistics collection on one bf16 block\n")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = Block(s).to(device=device, dtype=dtype).eval()
    g = torch.Generator(device=device).manual_seed(1)
    batches = [
        (torch.randn(s.batch, s.seq, s.hidden, device=device, dtype=dtype, generator=g),)
        for _ in range(s.batches)
    ]

    def collect() -> dict[str, ActivationStats]:
        return collect_activation_stats(block, batches, forward=lambda m, b: m(b[0]))

    @torch.no_grad()
    def forward_only() -> None:
        for (x,) in batches:
            block(x)

    collect_ms = median_ms(collect, device)
    forward_ms = median_ms(forward_only, device)
    tokens = s.batch * s.seq * s.batches
    stats = collect()
    sync(device)
    row = {
        "section": "collection",
        "tokens": tokens,
        "collect_ms": collect_ms,
        "forward_ms": forward_ms,
        "tokens_per_s": tokens / (collect_ms / 1e3),
        "layers": {name: st.dim for name, st in stats.items()},
    }
    results.append(row)
    print("| tokens | collect (ms) | forward only (ms) | overhead | tokens/s |")
    print("|---|---|---|---|---|")
    print(
        f"| {tokens} | {collect_ms:.1f} | {forward_ms:.1f} | {collect_ms / forward_ms:.1f}x | "
        f"{row['tokens_per_s']:.3g} |"
    )


def run_merge(s: Sizes, device: torch.device, guard: Guard, results: list) -> None:
    print("\n## c. AMARIS merge time per layer (one specialist, float64)\n")
    print("| layers | out x in | merge (ms) | rank kept |")
    print("|---|---|---|---|")
    g = torch.Generator(device=device).manual_seed(2)
    per_block_ms = 0.0
    complete = True
    for name, (out, d) in _shapes(s).items():
        if not guard.ok(f"merge {name}", 20 if device.type == "cuda" else 1):
            complete = False
            continue
        ones = torch.ones(d, device=device, dtype=torch.float64)
        sigma_b = _random_stats(d, 2 * d, ones, device, g)
        scale = torch.linspace(0.5, 2.0, d, device=device, dtype=torch.float64)
        sigma_s = _random_stats(d, 2 * d, scale, device, g)
        weight = torch.randn(out, d, device=device, dtype=torch.float64, generator=g)
        delta = 0.01 * torch.randn(out, d, device=device, dtype=torch.float64, generator=g)

        def merge(delta=delta, sigma_s=sigma_s, sigma_b=sigma_b, weight=weight):
            return amaris_layer(delta, sigma_s, sigma_b, 0.05, weight, ridge=1e-6)

        ms = median_ms(merge, device, rep_ms=200)
        _, report = merge()
        per_block_ms += 2 * ms if "/" in name else ms
        results.append(
            {"section": "merge", "layers": name, "shape": [out, d], "ms": ms, "rank": report.rank}
        )
        print(f"| {name} | {out} x {d} | {ms:.1f} | {report.rank} of {d} |")
    if complete:
        total_s = per_block_ms * s.blocks / 1e3
        results.append({"section": "merge_total", "blocks": s.blocks, "seconds": total_s})
        print(f"\nwhole model ({s.blocks} blocks x 7 layers, one specialist): {total_s:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time guard in seconds")
    add_only_argument(parser)
    parser.add_argument("--out", default=None, help="folder for amaris.json (default: $OUT)")
    args = parser.parse_args(argv)
    if args.out:
        os.environ["OUT"] = args.out
    resolved = bench_device(args.device)
    if resolved is None:
        return 1
    device, device_name = resolved
    sizes = QUICK if args.quick else FULL
    guard = Guard(budget_s=args.budget_s)
    print(f"# AMARIS GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(f"device: {device_name}; torch {torch.__version__}")
    results: list[dict[str, Any]] = []
    sections: list[tuple[str, Callable[[], None], float]] = [
        ("checks", lambda: run_checks(sizes, device, results), 10),
        ("collection", lambda: run_collection(sizes, device, results), 30),
        ("merge", lambda: run_merge(sizes, device, guard, results), 30),
    ]
    torch.backends.cuda.matmul.allow_tf32 = False
    errors = run_sections(sections, guard, args.only)
    failed = [r["check"] for r in results if r["section"] == "check" and not r["ok"]]
    if failed:
        print(f"\nchecks outside their tolerance: {', '.join(failed)}")
    print(f"\nelapsed: {guard.elapsed():.1f} s")
    write_json(
        SLUG,
        {
            "device": device_name,
            "quick": args.quick,
            "results": results,
            "errors": errors,
            "skipped": guard.skipped,
        },
    )
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
