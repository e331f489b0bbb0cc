"""GPU micro-benchmarks of AcceleGrad#: Newton–Schulz cost, one optimizer step, optimizer memory.

What it measures (brief ``adera_accelegrad.md`` D.3 item 4, issue 5 item 5), all in one run:

0. **Checks first** (no timing): the batched Newton–Schulz call equals the per-matrix loop, the
   bf16 result is close to the fp32 one, and the singular values of the result lie in the band
   the quintic targets (``newton_schulz``'s docstring: about ``[0.6, 1.3]`` after 5 steps for a
   condition number below ~100), on the ``3072×768`` Gaussian matrix (condition number ≈ 3; a
   square Gaussian one is too ill-conditioned for 5 steps).
1. **Newton–Schulz** (:func:`ada_modules.optim.newton_schulz.newton_schulz`, 5 steps) in bf16 and
   fp32 for transformer shapes ``768×768``, ``3072×768`` and ``4096×14336``, and for a stack of
   mixture-of-experts weights ``8×(1024×4096)``: one batched call against a Python loop over the 8
   matrices. Columns: median ms, TFLOP/s (``steps · batch · (4m²n + 2m³)`` with ``m ≤ n``), bf16
   speed-up over fp32, loop/batched ratio. fp32 matmuls run at the default
   ``torch.get_float32_matmul_precision()`` (printed; ``"highest"`` means no TF32).
2. **One ``step()``** on a GPT-2-small-shaped parameter set held by an ``nn.Module`` (fp32
   parameters, random fixed gradients, no forward pass): token embedding ``50257×768``, position
   embedding ``1024×768``, 12 blocks × (LayerNorm, qkv ``2304×768`` + bias, attention projection
   ``768×768`` + bias, LayerNorm, MLP ``3072×768`` and ``768×3072`` + biases), final LayerNorm and an
   **untied** head ``50257×768`` (≈163M parameters; GPT-2's 124M ties the head to the embedding).
   Optimizers: ``torch.optim.AdamW`` (default foreach; the baseline of every ratio), AdamW
   ``fused=True``, ``torch.optim.Muon`` **on the 48 hidden 2-D block matrices only, with AdamW for
   the embeddings, the head and every 1-D tensor** (Muon accepts only 2-D parameters and is not
   meant for embeddings/heads), :class:`~ada_modules.optim.scion.Scion` and
   :class:`~ada_modules.optim.accelegrad_sharp.AcceleGradSharp` (defaults: diagonal anchor,
   clipped LMO), both with :func:`~ada_modules.optim.param_groups.geometry_param_groups` of the same
   module (colnorm embeddings, spectral hidden matrices, sign head, RMS vectors): Muon, Scion and
   AcceleGrad# all make one Newton–Schulz call per hidden matrix per step.
3. **Memory** per optimizer: bytes of the tensors in ``optimizer.state`` after the first step, and
   the peak CUDA memory above parameters + gradients over the first two steps (state plus
   transients; measured before the timing, whose L2-flush buffer would inflate it).

Every ratio is against AdamW measured in the same run, on the same tensors (fixed seed). Timing:
``triton.testing.do_bench(..., return_mode="median")`` after a warm-up when Triton is installed,
else the median of ``torch.cuda.Event`` pairs; on the CPU (smoke test) the median of
``time.perf_counter`` around synchronised calls. There are no Triton kernels here, so the
correctness step is the check of section 0.

Run it (one H200, expected ≈1–2 minutes, guarded to at most ``--budget-s`` = 420 s; remaining
sections are skipped, and what was measured is still printed, once the budget is spent)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/accelegrad_sharp.py

Smoke test without a GPU (tiny shapes, a few seconds)::

    .venv/bin/python bench/gpu/accelegrad_sharp.py --device cpu --quick

Prints markdown tables and the elapsed time; writes ``$OUT/accelegrad_sharp.json``
(``{"device", "torch", "triton", "results": [...]}``, one record per row) when ``OUT`` is set.
Exits 1 when CUDA is requested but missing, or when a row failed (after printing the rest).
No downloads, no files read.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from _common import (  # bench/gpu/_common.py
    Guard,
    add_only_argument,
    bench_device,
    run_sections,
    sync,
    write_json,
)
from torch import Tensor, nn
from torch.optim import Optimizer

from ada_modules.optim.accelegrad_sharp import AcceleGradSharp
from ada_modules.optim.newton_schulz import newton_schulz
from ada_modules.optim.param_groups import geometry_param_groups
from ada_modules.optim.scion import Scion

try:
    import triton
    from triton.testing import do_bench
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    do_bench = None

SLUG = "accelegrad_sharp"
NS_STEPS = 5
MIB = 2**20


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run (full: GPT-2 small; quick: tiny, for a CPU smoke test)."""

    ns_shapes: tuple[tuple[int, int], ...]
    expert_stack: tuple[int, int, int]
    vocab: int
    context: int
    dim: int
    layers: int


FULL = Sizes(
    ns_shapes=((768, 768), (3072, 768), (4096, 14336)),
    expert_stack=(8, 1024, 4096),
    vocab=50257,
    context=1024,
    dim=768,
    layers=12,
)
QUICK = Sizes(
    ns_shapes=((64, 64), (256, 64), (128, 448)),
    expert_stack=(4, 64, 256),
    vocab=512,
    context=64,
    dim=64,
    layers=2,
)


# ----------------------------------------------------------------------------------------------
# Timing and memory
# ----------------------------------------------------------------------------------------------


def median_ms(
    fn: Callable[[], Any], device: torch.device, quick: bool, rep_ms: float = 100
) -> float:
    """Median milliseconds of ``fn`` after a warm-up (do_bench / CUDA events / perf_counter)."""
    if device.type == "cuda" and do_bench is not None:
        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    for _ in range(2):
        fn()
    sync(device)
    times: list[float] = []
    budget = (0.05 if quick else 1.0) * rep_ms / 100
    t_end = time.perf_counter() + budget
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 100):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def state_bytes(optimizers: Iterable[Optimizer]) -> int:
    """Bytes of every tensor held in the optimizers' ``state``."""
    total = 0
    for opt in optimizers:
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, Tensor):
                    total += v.numel() * v.element_size()
    return total


def ns_flops(shape: tuple[int, ...], steps: int = NS_STEPS) -> float:
    """FLOPs of ``newton_schulz`` on a (batched) matrix: per step ``4m²n + 2m³``, ``m ≤ n``."""
    *batch, rows, cols = shape
    m, n = min(rows, cols), max(rows, cols)
    count = 1
    for b in batch:
        count *= b
    return float(steps * count * (4 * m * m * n + 2 * m**3))


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for a table, ``n/a`` for ``None``."""
    return "n/a" if x is None else f"{x:.{digits}f}"


# ----------------------------------------------------------------------------------------------
# Section 0: checks
# ----------------------------------------------------------------------------------------------


def run_checks(sizes: Sizes, device: torch.device, results: list[dict[str, Any]]) -> None:
    """Batched == loop, bf16 ≈ fp32, singular values in the quintic's band."""
    gen = torch.Generator(device=device).manual_seed(0)
    e, r, c = sizes.expert_stack
    stack = torch.randn(e, r, c, device=device, generator=gen)
    batched = newton_schulz(stack, steps=NS_STEPS)
    looped = torch.stack([newton_schulz(stack[i], steps=NS_STEPS) for i in range(e)])
    err_loop = (batched - looped).abs().max().item()
    g = torch.randn(*sizes.ns_shapes[1], device=device, generator=gen)
    o32 = newton_schulz(g, steps=NS_STEPS, dtype=torch.float32)
    o16 = newton_schulz(g.bfloat16(), steps=NS_STEPS, dtype=torch.bfloat16)
    err_bf16 = (o16.float() - o32).abs().max().item()
    sv = torch.linalg.svdvals(o32.double())
    sv16 = torch.linalg.svdvals(o16.double())
    rows = [
        ("batched vs loop, fp32 (max abs diff)", err_loop, err_loop <= 1e-4),
        ("bf16 vs fp32 (max abs diff)", err_bf16, err_bf16 <= 0.1),
        ("fp32 singular values min", sv.min().item(), sv.min().item() >= 0.5),
        ("fp32 singular values max", sv.max().item(), sv.max().item() <= 1.3),
        ("bf16 singular values min", sv16.min().item(), sv16.min().item() >= 0.5),
        ("bf16 singular values max", sv16.max().item(), sv16.max().item() <= 1.35),
    ]
    print("\n## Checks (Newton–Schulz, 5 steps)\n")
    print(f"stack {e}×({r}×{c}), matrix {sizes.ns_shapes[1][0]}×{sizes.ns_shapes[1][1]}\n")
    print("| check | value | ok |")
    print("| --- | ---: | :---: |")
    for name, value, ok in rows:
        print(f"| {name} | {value:.3g} | {'yes' if ok else 'NO'} |")
        results.append({"section": "check", "check": name, "value": value, "ok": bool(ok)})


# ----------------------------------------------------------------------------------------------
# Section 1: Newton–Schulz
# ----------------------------------------------------------------------------------------------

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_newton_schulz(
    sizes: Sizes, device: torch.device, quick: bool, guard: Guard, results: list[dict[str, Any]]
) -> None:
    """Time single matrices (bf16, fp32) and a batched expert stack against a per-matrix loop."""
    gen = torch.Generator(device=device).manual_seed(1)
    single: list[tuple[tuple[int, int], dict[str, float]]] = []
    for shape in sizes.ns_shapes:
        base = torch.randn(*shape, device=device, generator=gen)
        times: dict[str, float] = {}
        for name, dt in DTYPES.items():
            if not guard.ok(f"newton_schulz {shape} {name}", 10):
                continue
            g = base.to(dt)
            times[name] = median_ms(lambda g=g, dt=dt: newton_schulz(g, dtype=dt), device, quick)
        single.append((shape, times))
        del base

    print("\n## Newton–Schulz, one matrix (5 steps)\n")
    print("| shape | dtype | median ms | TFLOP/s | bf16 speed-up vs fp32 |")
    print("| --- | --- | ---: | ---: | ---: |")
    for shape, times in single:
        for name in DTYPES:
            if name not in times:
                continue
            ms = times[name]
            tflops = ns_flops(shape) / ms / 1e9
            speed = times["fp32"] / ms if name == "bf16" and "fp32" in times else None
            print(
                f"| {shape[0]}×{shape[1]} | {name} | {ms:.3f} | {tflops:.3g} | "
                f"{fmt(speed, 2) + '×' if speed else '–'} |"
            )
            results.append(
                {
                    "section": "newton_schulz",
                    "shape": list(shape),
                    "batch": 1,
                    "dtype": name,
                    "impl": "single",
                    "median_ms": ms,
                    "tflops": tflops,
                    "ratio_bf16_speedup_vs_fp32": speed,
                }
            )

    e, r, c = sizes.expert_stack
    stack = torch.randn(e, r, c, device=device, generator=gen)
    print(f"\n## Newton–Schulz, expert stack {e}×({r}×{c}): one batched call vs a loop\n")
    print("| dtype | batched ms | loop ms | loop / batched | batched TFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, dt in DTYPES.items():
        if not guard.ok(f"newton_schulz stack {name}", 15):
            continue
        s = stack.to(dt)
        t_batched = median_ms(lambda s=s, dt=dt: newton_schulz(s, dtype=dt), device, quick)
        t_loop = median_ms(
            lambda s=s, dt=dt: [newton_schulz(s[i], dtype=dt) for i in range(e)], device, quick
        )
        tflops = ns_flops((e, r, c)) / t_batched / 1e9
        print(
            f"| {name} | {t_batched:.3f} | {t_loop:.3f} | {t_loop / t_batched:.2f}× | {tflops:.3g} |"
        )
        for impl, ms in (("batched", t_batched), ("loop", t_loop)):
            results.append(
                {
                    "section": "newton_schulz",
                    "shape": [r, c],
                    "batch": e,
                    "dtype": name,
                    "impl": impl,
                    "median_ms": ms,
                    "tflops": ns_flops((e, r, c)) / ms / 1e9,
                    "ratio_loop_over_batched": t_loop / t_batched,
                }
            )


# ----------------------------------------------------------------------------------------------
# Section 2/3: optimizer step and memory
# ----------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Parameters of a GPT-2 block (no forward: only the shapes matter)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.attn_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)


class GPTParams(nn.Module):
    """GPT-2-small parameter set with an untied ``lm_head`` (no forward)."""

    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.wte = nn.Embedding(sizes.vocab, sizes.dim)
        self.wpe = nn.Embedding(sizes.context, sizes.dim)
        self.h = nn.ModuleList(Block(sizes.dim) for _ in range(sizes.layers))
        self.ln_f = nn.LayerNorm(sizes.dim)
        self.lm_head = nn.Linear(sizes.dim, sizes.vocab, bias=False)


def build_model(sizes: Sizes, device: torch.device) -> GPTParams:
    """The parameter set on ``device`` with fixed random gradients (same seed every call)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPTParams(sizes)
    gen = torch.Generator(device=device).manual_seed(2)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, generator=gen).mul_(1e-3)
    return model


def hidden_matrices(model: GPTParams) -> list[nn.Parameter]:
    """The 2-D weights of the blocks (what Muon, Scion and AcceleGrad# orthogonalise)."""
    return [p for p in model.h.parameters() if p.ndim == 2]


def make_adamw(model: GPTParams) -> list[Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)]


def make_adamw_fused(model: GPTParams) -> list[Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)]


def make_muon(model: GPTParams) -> list[Optimizer]:
    hidden = hidden_matrices(model)
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [
        torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1),
        torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1),
    ]


def make_scion(model: GPTParams) -> list[Optimizer]:
    groups = geometry_param_groups(model, radii={"embedding": 1.0, "hidden": 3.0, "head": 10.0})
    return [Scion(groups, lr=0.01, momentum=0.1)]


def make_accelegrad_sharp(model: GPTParams) -> list[Optimizer]:
    return [AcceleGradSharp(geometry_param_groups(model, radii={"head": 10.0}), lr=0.01)]


OPTIMIZERS: dict[str, tuple[Callable[[GPTParams], list[Optimizer]], bool]] = {
    # name: (factory, needs CUDA)
    "AdamW": (make_adamw, False),
    "AdamW (fused)": (make_adamw_fused, True),
    "Muon (hidden 2-D) + AdamW (rest)": (make_muon, False),
    "Scion": (make_scion, False),
    "AcceleGrad#": (make_accelegrad_sharp, False),
}


def run_steps(
    sizes: Sizes, device: torch.device, quick: bool, guard: Guard, results: list[dict[str, Any]]
) -> None:
    """One ``step()`` per optimizer: median time, state bytes, peak memory over params + grads."""
    cuda = device.type == "cuda"
    rows: list[dict[str, Any]] = []
    n_params = n_hidden = 0
    for name, (factory, needs_cuda) in OPTIMIZERS.items():
        if needs_cuda and not cuda:
            continue
        if not guard.ok(f"step {name}", 30):
            continue
        model = build_model(sizes, device)
        n_params = sum(p.numel() for p in model.parameters())
        n_hidden = len(hidden_matrices(model))
        sync(device)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        optimizers = factory(model)

        def step(optimizers: list[Optimizer] = optimizers) -> None:
            for opt in optimizers:
                opt.step()

        step()  # first step: allocates the state
        sync(device)
        state = state_bytes(optimizers)
        step()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
        ms = median_ms(step, device, quick, rep_ms=300)
        rows.append({"optimizer": name, "median_ms": ms, "state_bytes": state, "peak_extra": peak})
        del optimizers, step, model
        if cuda:
            torch.cuda.empty_cache()

    ref = next((r for r in rows if r["optimizer"] == "AdamW"), None)

    def ratio(row: dict[str, Any], key: str) -> float | None:
        if ref is None or row[key] is None or not ref[key]:
            return None
        return row[key] / ref[key]

    print(
        f"\n## One optimizer step: {n_params / 1e6:.1f}M fp32 parameters "
        f"(GPT-2-small shapes, {sizes.layers} layers, d={sizes.dim}, vocab {sizes.vocab}, "
        f"untied head), {n_hidden} hidden matrices\n"
    )
    print(
        "Muon: torch.optim.Muon on the hidden 2-D block matrices, AdamW on embeddings, head and "
        "1-D tensors. Scion / AcceleGrad#: geometry_param_groups (colnorm embeddings, spectral "
        "hidden, sign head, RMS vectors). Peak = max CUDA memory above params + grads over the "
        "first two steps.\n"
    )
    print("| optimizer | step ms | × AdamW | state MiB | × AdamW | peak extra MiB | × AdamW |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        t_ratio, s_ratio = ratio(row, "median_ms"), ratio(row, "state_bytes")
        p_ratio = ratio(row, "peak_extra")
        peak_mib = None if row["peak_extra"] is None else row["peak_extra"] / MIB
        print(
            f"| {row['optimizer']} | {row['median_ms']:.3f} | {fmt(t_ratio, 2)} | "
            f"{row['state_bytes'] / MIB:.1f} | {fmt(s_ratio, 2)} | {fmt(peak_mib, 1)} | "
            f"{fmt(p_ratio, 2)} |"
        )
        results.append(
            {
                "section": "step",
                "optimizer": row["optimizer"],
                "params": n_params,
                "hidden_matrices": n_hidden,
                "dtype": "fp32",
                "median_ms": row["median_ms"],
                "params_per_s": n_params / row["median_ms"] * 1e3,
                "state_bytes": row["state_bytes"],
                "peak_extra_bytes": row["peak_extra"],
                "ratio_time_vs_adamw": t_ratio,
                "ratio_state_vs_adamw": s_ratio,
                "ratio_peak_vs_adamw": p_ratio,
            }
        )


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, short timing")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="global time guard in seconds (default 420)"
    )
    add_only_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guard = Guard(budget_s=args.budget_s)
    resolved = bench_device(args.device)
    if resolved is None:
        return 1
    device, device_name = resolved
    sizes = QUICK if args.quick else FULL
    print(f"# AcceleGrad# GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(
        f"device: {device_name}; torch {torch.__version__}; "
        f"triton {triton.__version__ if triton else 'absent'}; "
        f"timer: {'do_bench median' if device.type == 'cuda' and do_bench else 'median of repeats'}; "
        f"float32 matmul precision: {torch.get_float32_matmul_precision()}"
    )

    results: list[dict[str, Any]] = []
    sections: list[tuple[str, Callable[[], None], float]] = [
        ("checks", lambda: run_checks(sizes, device, results), 20),
        ("newton_schulz", lambda: run_newton_schulz(sizes, device, args.quick, guard, results), 20),
        ("step", lambda: run_steps(sizes, device, args.quick, guard, results), 40),
    ]
    errors = run_sections(sections, guard, args.only)
    elapsed = guard.elapsed()
    failed_checks = [r["check"] for r in results if r["section"] == "check" and not r["ok"]]
    if failed_checks:
        print(f"\nchecks outside their tolerance: {', '.join(failed_checks)}")
    print(f"\nelapsed: {elapsed:.1f} s")

    write_json(
        SLUG,
        {
            "device": device_name,
            "torch": torch.__version__,
            "triton": triton.__version__ if triton else None,
            "quick": args.quick,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "elapsed_s": elapsed,
            "skipped": guard.skipped,
            "errors": errors,
            "results": results,
        },
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
