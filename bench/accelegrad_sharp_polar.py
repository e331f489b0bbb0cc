"""AcceleGrad#'s spectral oracle on the raw stochastic gradient: what it saves in polar computations.

The abstract claims that using stochastic gradients directly in spectral oracles reduces
polar-computation time and optimizer overhead. AcceleGrad# needs two things from each matrix's
gradient ``g`` per step: the LMO direction ``-s U Vᵀ`` and the dual norm ``s ‖g‖_nuclear`` (for its
step-size accumulator). This script times three ways of getting them, per layer shape:

- **exact**: a thin SVD of ``g`` (polar factor and nuclear norm exactly);
- **two calls**: a Muon-style oracle, which orthogonalises a momentum buffer ``m`` (one
  Newton–Schulz call), plus a second call on ``g`` for the dual norm, which the buffer's polar
  factor does not give;
- **one call on g** (AcceleGrad#, :meth:`~ada_modules.optim.lmo.Spectral.lmo_and_dual`): one
  Newton–Schulz call on ``g`` itself, its polar factor the direction and ``⟨g, NS(g)⟩`` the dual
  norm.

Reported: the median time of each (5 Newton–Schulz steps, float32, one thread), the ratios, and the
relative error of the one-call dual norm against the exact nuclear norm (Newton–Schulz's singular
values end in about [0.68, 1.2], so it is an estimate). Random Gaussian gradients; the time does
not depend on their values.

Run it::

    .venv/bin/python bench/accelegrad_sharp_polar.py --quick --out /tmp/polar   # ~5 s
    .venv/bin/python bench/accelegrad_sharp_polar.py --out bench_out/accelegrad_sharp

Reports only; no assertion.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ada_modules.optim.lmo import Spectral
from ada_modules.optim.newton_schulz import newton_schulz

# (label, out, in): the digits MLP's hidden matrix, the tiny LM's attention and MLP matrices, and
# GPT-2-small's attention and MLP shapes.
SHAPES = (
    ("digits MLP hidden", 128, 128),
    ("tiny LM attention", 64, 64),
    ("tiny LM MLP", 256, 64),
    ("GPT-2 attention", 768, 768),
    ("GPT-2 MLP", 3072, 768),
)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def exact(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Polar factor and nuclear norm from a thin SVD."""
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    return u @ vh, s.sum()


def two_calls(g: torch.Tensor, momentum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Muon-style direction from the momentum buffer, and a second call for ``g``'s dual norm."""
    direction = newton_schulz(momentum)
    return direction, (g * newton_schulz(g)).sum()


def measure(shapes: tuple[tuple[str, int, int], ...], repeats: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    norm = Spectral()
    rows = []
    for label, rows_out, cols_in in shapes:
        g = torch.randn(rows_out, cols_in, generator=generator)
        momentum = torch.randn(rows_out, cols_in, generator=generator)
        exact_ms = median_ms(lambda g=g: exact(g), repeats)
        two_ms = median_ms(lambda g=g, m=momentum: two_calls(g, m), repeats)
        one_ms = median_ms(lambda g=g: norm.lmo_and_dual(g), repeats)
        _, dual = norm.lmo_and_dual(g)
        nuclear = exact(g)[1] * norm._scale(g.shape)
        rows.append(
            {
                "layer": label,
                "shape": f"{rows_out} x {cols_in}",
                "exact_svd_ms": exact_ms,
                "two_calls_ms": two_ms,
                "one_call_ms": one_ms,
                "svd_over_one": exact_ms / one_ms,
                "two_over_one": two_ms / one_ms,
                "dual_norm_rel_error": float((dual - nuclear).abs() / nuclear),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the three small shapes, 5 repeats")
    parser.add_argument("--out", type=Path, default=Path("bench_out/accelegrad_sharp"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = SHAPES[:3] if args.quick else SHAPES
    rows = measure(shapes, repeats=5 if args.quick else 20)
    print("\n## Polar computations per matrix and step (median, one thread, float32)\n")
    print(
        "| layer | shape | exact SVD (ms) | two NS calls (ms) | one NS call on g (ms) | "
        "SVD ÷ one | two ÷ one | dual-norm rel. error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layer']} | {r['shape']} | {r['exact_svd_ms']:.3f} | {r['two_calls_ms']:.3f} | "
            f"{r['one_call_ms']:.3f} | {r['svd_over_one']:.2f} | {r['two_over_one']:.2f} | "
            f"{r['dual_norm_rel_error']:.3f} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "polar.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nwrote {args.out / 'polar.json'}")


if __name__ == "__main__":
    main()
