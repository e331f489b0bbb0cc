"""GPU benchmark of AdaCal sparse prefill: the block-sparse kernel, prefill time with the plan, recall.

What it measures (issue 16), with Llama-3.1-8B attention shapes (32 query heads, 8 key/value
heads, head dim 128, bf16, batch 1, blocks of 128), in one run:

a. **Checks first.** :func:`~ada_modules.kernels.sparse_prefill.sparse_prefill_attention` (Triton)
   against ``sparse_prefill_attention_reference`` (torch, fp32 math) on random plans: fp32 and
   bf16, blocks of 64 and 128, a ragged last block, grouped-query heads, left padding (batch 2)
   and a chunked-prefill offset (fewer queries than keys); and the dense causal plan against
   SDPA. Max abs error printed (tolerance 1e-3 in fp32, 3e-2 in bf16).
b. **Prefill time** of one attention layer at 8K / 32K / 64K / 128K tokens, plan included:
   ``sdpa`` (``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, a fused
   backend: the baseline), and our kernel with the plan of ``dense`` (every causal block),
   ``adacal``, ``flexprefill`` and ``a_shape`` (:mod:`ada_modules.attention`). Columns: median ms
   of plan + attention, of the plan alone, the density (computed / causal blocks), the probe
   overhead (plan / total), the speed-up over ``sdpa``; then per policy the crossover, the first
   measured length from which on it beats ``sdpa``. Inputs: planted heads
   (:func:`~ada_modules.data.planted_attention.planted_attention`, ``retrieval`` regime, one
   planted layer of 8 heads as the key/value heads, each query head its kv head's queries plus a
   little noise), so that the plans see structured attention as in a trained model.
c. **Recall at 32K** on planted layers of both regimes (``structure`` and ``retrieval``): per
   policy (and ``vertical_slash``) the density, the attention recall (the dense attention mass
   the plan keeps, mean over query rows and heads, and of the worst head), the relative L2 error
   of its output against dense attention, and in the retrieval regime the needle hit rate (the
   retrieving rows whose plan holds the block of their needle).

Timing: ``median_ms`` of ``_common`` (Triton's ``do_bench`` on CUDA over about 0.4 s after a
warm-up that compiles, the median of 3 calls on the CPU). Each section and each length asks a time guard first (the whole
run is guarded to ``--budget-s`` = 420 s); what was measured is still printed.

Run it (one H200, expected ≈4–6 minutes)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/adacal.py

Smoke test without a GPU (tiny shapes, the torch reference, a few seconds)::

    .venv/bin/python bench/gpu/adacal.py --device cpu --quick

Prints markdown tables and the elapsed time; writes ``<out>/adacal.json`` (``{"device", "torch",
"triton", "results": [...]}``) with ``--out DIR`` or when ``OUT`` is set. Exits 1 when CUDA is
requested but missing, or when a section failed or a check was out of tolerance. No downloads,
no files read.
"""

import argparse
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import (
    Guard,
    add_only_argument,  # bench/gpu/_common.py
    bench_device,
    median_ms,
    run_sections,
    write_json,
)

from ada_modules.attention import (
    AdaCalPolicy,
    AShapePolicy,
    DensePolicy,
    FlexPrefillPolicy,
    VerticalSlashPolicy,
)
from ada_modules.attention.plan import causal_block_mask, num_blocks, plan_density
from ada_modules.data.planted_attention import planted_attention
from ada_modules.kernels.sparse_prefill import (
    sparse_prefill_attention,
    sparse_prefill_attention_reference,
)

try:
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

SLUG = "adacal"
TIMED_POLICIES = ("dense", "adacal", "flexprefill", "a_shape")
RECALL_POLICIES = (*TIMED_POLICIES, "vertical_slash")
CHECK_TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2}
QUERY_NOISE = 0.2  # std of the noise added to a kv head's planted queries for each query head


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run (full: Llama-3.1-8B attention; quick: tiny, for a CPU smoke test)."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    lengths: tuple[int, ...]
    recall_length: int
    check_length: int
    check_block_sizes: tuple[int, ...]


FULL = Sizes(
    heads=32,
    kv_heads=8,
    head_dim=128,
    block_size=128,
    lengths=(8192, 32768, 65536, 131072),
    recall_length=32768,
    check_length=4096 + 37,
    check_block_sizes=(64, 128),
)
QUICK = Sizes(
    heads=4,
    kv_heads=2,
    head_dim=32,
    block_size=32,
    lengths=(512, 1024),
    recall_length=1024,
    check_length=200 + 7,
    check_block_sizes=(16, 32),
)


def make_policy(name: str, block_size: int) -> Any:
    """The policy ``name`` with its defaults; ``min_sparse_length`` is not used (``plan`` is
    called directly)."""
    cls = {
        "dense": DensePolicy,
        "adacal": AdaCalPolicy,
        "flexprefill": FlexPrefillPolicy,
        "a_shape": AShapePolicy,
        "vertical_slash": VerticalSlashPolicy,
    }[name]
    return cls(block_size=block_size)


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Layer:
    """One attention layer's inputs ``(1, heads, L, D)`` / ``(1, kv_heads, L, D)`` and, for
    planted data, the needle targets per kv head ``(kv_heads, L)`` (``-1``: no needle)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    needle_target: torch.Tensor | None = None


def planted_layer(
    sizes: Sizes, length: int, regime: str, device: torch.device, dtype: torch.dtype, seed: int
) -> Layer:
    """A planted layer of ``kv_heads`` heads (generated on the CPU); query head ``h`` gets the
    queries of kv head ``h // group`` plus ``QUERY_NOISE`` Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    layer = planted_attention(
        length,
        num_heads=sizes.kv_heads,
        head_dim=sizes.head_dim,
        regime=regime,
        needle_heads=min(3, sizes.kv_heads),
        generator=gen,
    )
    group = sizes.heads // sizes.kv_heads
    q = layer.query.to(device).repeat_interleave(group, dim=0)
    noise_gen = torch.Generator(device=device).manual_seed(seed + 1)
    q += QUERY_NOISE * q.std() * torch.randn(q.shape, device=device, generator=noise_gen)
    return Layer(
        q[None].to(dtype),
        layer.key[None].to(device, dtype),
        layer.value[None].to(device, dtype),
        layer.needle_target.to(device),
    )


def random_inputs(
    batch: int,
    heads: int,
    kv_heads: int,
    q_len: int,
    k_len: int,
    dim: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, device=device, generator=gen)
    k = torch.randn(batch, kv_heads, k_len, dim, device=device, generator=gen)
    v = torch.randn(batch, kv_heads, k_len, dim, device=device, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_plan(
    batch: int, heads: int, q_len: int, k_len: int, block_size: int, device: torch.device
) -> torch.Tensor:
    """Random blocks (density about 0.4) plus the first block and the diagonal ones."""
    gen = torch.Generator(device=device).manual_seed(q_len + k_len)
    shape = (batch, heads, num_blocks(q_len, block_size), num_blocks(k_len, block_size))
    mask = torch.rand(shape, device=device, generator=gen) < 0.4
    mask[..., 0] = True
    rows = torch.arange(shape[2], device=device)
    diagonal = ((k_len - q_len) // block_size + rows).clamp_max(shape[3] - 1)
    mask[:, :, rows, diagonal] = True
    return mask


def causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal SDPA with grouped-query heads, any backend (the checks: moderate sizes)."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


def fused_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], str]:
    """The baseline: causal SDPA on a fused backend (never the math one, whose score matrix
    would not fit at 128K), ``enable_gqa=True``; where no fused backend takes grouped-query
    heads, the key/value heads are expanded once, outside the timed call. Returns the call and
    its label."""
    if query.device.type != "cuda":
        return (lambda: causal_sdpa(query, key, value)), "sdpa"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def gqa() -> torch.Tensor:
        with sdpa_kernel(fused):
            return causal_sdpa(query, key, value)

    try:
        gqa()
        return gqa, "sdpa"
    except RuntimeError as err:
        print(f"[sdpa] no fused backend with enable_gqa ({err}); expanding the kv heads")
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))

    def expanded() -> torch.Tensor:
        with sdpa_kernel(fused):
            return F.scaled_dot_product_attention(query, key, value, is_causal=True)

    return expanded, "sdpa (kv expanded)"


def section_guard(guard: Guard, cap_s: float) -> Guard:
    """A guard for one section: at most ``cap_s`` seconds from now and what the run has left;
    what it skips is recorded in ``guard``."""
    return Guard(budget_s=min(cap_s, guard.budget_s - guard.elapsed()), skipped=guard.skipped)


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


# ----------------------------------------------------------------------------------------------
# Section a: checks
# ----------------------------------------------------------------------------------------------


CHECK_HEADS, CHECK_KV_HEADS = 8, 2


def kernel_vs_reference(
    sizes: Sizes,
    device: torch.device,
    dtype: torch.dtype,
    block: int,
    batch: int,
    q_len: int,
    k_len: int,
    padding: tuple[int, ...] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's and the reference's outputs on random inputs and a random plan; ``padding``:
    left padding per sequence."""
    heads, kv_heads = CHECK_HEADS, CHECK_KV_HEADS
    q, k, v = random_inputs(batch, heads, kv_heads, q_len, k_len, sizes.head_dim, device, dtype, 1)
    mask = random_plan(batch, heads, q_len, k_len, block, device)
    pad = None
    if padding is not None:
        pad = torch.ones(batch, k_len, dtype=torch.bool, device=device)
        for b, n in enumerate(padding):
            pad[b, :n] = False
    args = {"block_size": block, "key_padding_mask": pad}
    return (
        sparse_prefill_attention(q, k, v, mask, **args),
        sparse_prefill_attention_reference(q, k, v, mask, **args),
    )


def dense_vs_sdpa(
    sizes: Sizes, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel with the dense causal plan, and causal SDPA."""
    heads, length, block = CHECK_HEADS, sizes.check_length, sizes.check_block_sizes[-1]
    q, k, v = random_inputs(
        1, heads, CHECK_KV_HEADS, length, length, sizes.head_dim, device, dtype, 2
    )
    dense = causal_block_mask(1, heads, length, length, block, device)
    return sparse_prefill_attention(q, k, v, dense, block_size=block), causal_sdpa(q, k, v)


def run_checks(
    sizes: Sizes, device: torch.device, guard: Guard, results: list[dict[str, Any]]
) -> None:
    """Kernel vs reference on random plans, and the dense plan vs SDPA. A case that raises is
    a failed check; the others still run."""
    print("\n## a. Checks\n")
    print("| check | max abs err | ok |")
    print("| --- | ---: | :---: |")

    def check(
        name: str, tol: float, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        if not guard.ok(name, 5):
            return
        try:
            out, ref = compute()
            err = max_abs_error(out, ref)
        except Exception as error:  # report it as a failed check, keep going
            print(f"| {name} | {type(error).__name__}: {error} | NO |")
            results.append({"section": "check", "check": name, "error": str(error), "ok": False})
            return
        ok = err < tol  # False for NaN
        print(f"| {name} | {err:.2e} | {'yes' if ok else 'NO'} |")
        results.append({"section": "check", "check": name, "value": err, "ok": ok})

    length = sizes.check_length
    shape = f"Hq={CHECK_HEADS}, Hkv={CHECK_KV_HEADS}, d={sizes.head_dim}"
    cases = [
        ("B=1", 1, length, length, None),
        ("B=2, left padding", 2, length, length, (0, 301)),
        ("chunk: the last third of the queries", 1, length // 3, length, None),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        tol, kind = CHECK_TOL[dtype], str(dtype).removeprefix("torch.")
        for block in sizes.check_block_sizes:
            for label, batch, q_len, k_len, padding in cases:
                check(
                    f"{kind} block {block} {label} (Lq={q_len}, Lk={k_len}, {shape}): "
                    "kernel vs reference",
                    tol,
                    functools.partial(
                        kernel_vs_reference,
                        sizes,
                        device,
                        dtype,
                        block,
                        batch,
                        q_len,
                        k_len,
                        padding,
                    ),
                )
        check(
            f"{kind} dense plan (L={length}, {shape}) vs SDPA causal",
            tol,
            functools.partial(dense_vs_sdpa, sizes, device, dtype),
        )


# ----------------------------------------------------------------------------------------------
# Section b: prefill time
# ----------------------------------------------------------------------------------------------


def time_length(
    sizes: Sizes, length: int, device: torch.device, results: list[dict[str, Any]]
) -> dict[str, float]:
    """SDPA and every policy at one length; returns the speed-ups over SDPA by policy."""
    block, scaling = sizes.block_size, sizes.head_dim**-0.5
    layer = planted_layer(sizes, length, "retrieval", device, torch.bfloat16, seed=length)
    q, k, v = layer.query, layer.key, layer.value
    baseline, label = fused_sdpa(q, k, v)
    base_ms = median_ms(baseline, device, rep_ms=400)
    del baseline  # and its expanded kv heads, if any
    print(f"| {length} | {label} | {base_ms:.3f} | | 1.000 | | 1.00× | |")
    results.append({"section": "timing", "tokens": length, "arm": label, "total_ms": base_ms})
    speedups = {}
    for name in TIMED_POLICIES:
        policy = make_policy(name, block)

        def plan(policy: Any = policy) -> Any:
            return policy.plan(q, k, key_padding_mask=None, scaling=scaling)

        def prefill(plan: Callable[[], Any] = plan) -> torch.Tensor:
            return sparse_prefill_attention(
                q, k, v, plan().block_mask, block_size=block, scaling=scaling
            )

        try:
            the_plan = plan()
            density = plan_density(the_plan.block_mask, length, length, block)
            plan_ms = median_ms(plan, device, rep_ms=400)
            total_ms = median_ms(prefill, device, rep_ms=400)
        except torch.OutOfMemoryError:
            print(f"| {length} | {name} | out of memory | | | | | |")
            results.append({"section": "timing", "tokens": length, "arm": name, "oom": True})
            free_memory(device)
            continue
        speedups[name] = base_ms / total_ms
        gflop = 2 * the_plan.probe_flops / 1e9
        print(
            f"| {length} | {name} | {total_ms:.3f} | {plan_ms:.3f} | {density:.3f} | "
            f"{plan_ms / total_ms:.1%} | {speedups[name]:.2f}× | {gflop:.2f} |"
        )
        results.append(
            {
                "section": "timing",
                "tokens": length,
                "arm": name,
                "total_ms": total_ms,
                "plan_ms": plan_ms,
                "attention_ms": total_ms - plan_ms,
                "density": density,
                "probe_overhead": plan_ms / total_ms,
                "probe_flops": the_plan.probe_flops,
                "ratio_speedup_vs_sdpa": speedups[name],
                "regime": the_plan.regime,
            }
        )
    return speedups


def run_timing(
    sizes: Sizes, device: torch.device, guard: Guard, results: list[dict[str, Any]]
) -> None:
    """Plan + attention per policy against SDPA at every length; then the crossovers."""
    print(
        f"\n## b. Prefill time of one layer, plan included (B=1, Hq={sizes.heads}, "
        f"Hkv={sizes.kv_heads}, d={sizes.head_dim}, bf16, block {sizes.block_size}, planted "
        "retrieval data)\n"
    )
    print(
        "| tokens | arm | total ms | plan ms | density | probe overhead | speed-up vs sdpa | "
        "probe GFLOP |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    speedups: dict[str, dict[int, float]] = {name: {} for name in TIMED_POLICIES}
    for length in sizes.lengths:
        need_s = 10 + 60 * (length / 131072) ** 1.5  # 128K: about a minute with the data
        if not guard.ok(f"timing L={length}", need_s):
            continue
        for name, speedup in time_length(sizes, length, device, results).items():
            speedups[name][length] = speedup
        free_memory(device)
    print("\n| policy | crossover (first length from which it beats sdpa) |")
    print("| --- | --- |")
    for name, by_length in speedups.items():
        crossover = crossover_length(by_length)
        text = "not reached" if crossover is None else str(crossover)
        if crossover is not None and crossover == min(by_length):
            text = f"≤ {crossover}"
        print(f"| {name} | {text} |")
        results.append({"section": "crossover", "arm": name, "tokens": crossover})


def crossover_length(speedups: dict[int, float]) -> int | None:
    """The smallest measured length from which on every measured speed-up is above 1."""
    found = None
    for length in sorted(speedups, reverse=True):
        if speedups[length] <= 1.0:
            break
        found = length
    return found


# ----------------------------------------------------------------------------------------------
# Section c: recall
# ----------------------------------------------------------------------------------------------


def kept_mass(
    query: torch.Tensor, key: torch.Tensor, block_masks: dict[str, torch.Tensor], block: int
) -> dict[str, torch.Tensor]:
    """Per policy, the dense causal attention mass each query row keeps under its plan:
    ``(heads, L)`` fp32, computed in chunks of query blocks (fp32 scores)."""
    _, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    k32 = key[0].float()
    kept = {name: torch.empty(heads, length, device=query.device) for name in block_masks}
    rows_per_chunk = max(block, (1 << 28) // (heads * length) // block * block)
    for lo in range(0, length, rows_per_chunk):
        hi = min(length, lo + rows_per_chunk)
        n = hi - lo
        q = query[0, :, lo:hi].float().mul(dim**-0.5).reshape(kv_heads, group * n, dim)
        scores = torch.matmul(q, k32[:, :hi].transpose(-1, -2)).view(heads, n, hi)
        later = (
            torch.arange(hi, device=query.device)
            > torch.arange(lo, hi, device=query.device)[:, None]
        )
        scores.masked_fill_(later, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        del scores
        key_blocks = num_blocks(hi, block)
        if key_blocks * block != hi:
            probs = F.pad(probs, (0, key_blocks * block - hi))
        mass = probs.view(heads, n, key_blocks, block).sum(-1)  # (heads, n, key blocks)
        del probs
        row_block = torch.arange(lo, hi, device=query.device) // block
        for name, mask in block_masks.items():
            selected = mask[0][:, row_block, :key_blocks]  # (heads, n, key blocks)
            kept[name][:, lo:hi] = (mass * selected).sum(-1)
        del mass
    return kept


def run_recall(
    sizes: Sizes, device: torch.device, guard: Guard, results: list[dict[str, Any]]
) -> None:
    """Density, attention recall, output error and needle hits per policy on planted layers."""
    length, block = sizes.recall_length, sizes.block_size
    print(
        f"\n## c. Recall at {length} tokens on planted layers (Hq={sizes.heads}, "
        f"Hkv={sizes.kv_heads}, d={sizes.head_dim}, bf16, block {block})\n"
    )
    print(
        "| regime | policy | density | attention recall (mean) | recall (worst head) | "
        "output rel. L2 err | needle hit rate |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for regime in ("structure", "retrieval"):
        if not guard.ok(f"recall {regime}", 25):
            continue
        layer = planted_layer(sizes, length, regime, device, torch.bfloat16, seed=7 + length)
        q, k, v = layer.query, layer.key, layer.value
        scaling = sizes.head_dim**-0.5
        dense_out = fused_sdpa(q, k, v)[0]().float()
        plans = {
            name: make_policy(name, block).plan(q, k, key_padding_mask=None, scaling=scaling)
            for name in RECALL_POLICIES
        }
        kept = kept_mass(q, k, {name: p.block_mask for name, p in plans.items()}, block)
        group = sizes.heads // sizes.kv_heads
        target = layer.needle_target.repeat_interleave(group, dim=0)  # (heads, L)
        heads_idx, rows_idx = (target >= 0).nonzero(as_tuple=True)
        for name, the_plan in plans.items():
            mask = the_plan.block_mask
            density = plan_density(mask, length, length, block)
            recall = kept[name].mean().item()
            worst = kept[name].mean(dim=-1).min().item()
            out = sparse_prefill_attention(q, k, v, mask, block_size=block, scaling=scaling)
            err = ((out.float() - dense_out).norm() / dense_out.norm()).item()
            hits = None
            if len(rows_idx):
                cols = target[heads_idx, rows_idx] // block
                hits = mask[0, heads_idx, rows_idx // block, cols].float().mean().item()
            hit_text = "—" if hits is None else f"{hits:.3f}"
            print(
                f"| {regime} | {name} | {density:.3f} | {recall:.4f} | {worst:.4f} | "
                f"{err:.2e} | {hit_text} |"
            )
            results.append(
                {
                    "section": "recall",
                    "regime": regime,
                    "tokens": length,
                    "policy": name,
                    "density": density,
                    "attention_recall": recall,
                    "attention_recall_worst_head": worst,
                    "output_rel_l2_err": err,
                    "needle_hit_rate": hits,
                    "policy_regime": the_plan.regime,
                }
            )
            del out
        del layer, q, k, v, plans, kept, dense_out
        free_memory(device)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes for a smoke test")
    parser.add_argument("--budget-s", type=float, default=420.0, help="overall time budget")
    add_only_argument(parser)
    parser.add_argument("--out", default=None, help="folder of adacal.json (default: $OUT)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guard = Guard(budget_s=args.budget_s)
    if args.out:
        os.environ["OUT"] = args.out
    resolved = bench_device(args.device)
    if resolved is None:
        return 1
    device, device_name = resolved
    sizes = QUICK if args.quick else FULL
    print(f"# AdaCal sparse prefill GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(
        f"device: {device_name}; torch {torch.__version__}; "
        f"triton {triton.__version__ if triton else 'absent'}"
    )
    results: list[dict[str, Any]] = []
    # (name, run, seconds it needs to start, its cap); the caps add up to 7 minutes.
    caps = {"checks": 60.0, "timing": 240.0, "recall": 120.0}
    sections: list[tuple[str, Callable[[], None], float]] = [
        (
            "checks",
            lambda: run_checks(sizes, device, section_guard(guard, caps["checks"]), results),
            30,
        ),
        (
            "timing",
            lambda: run_timing(sizes, device, section_guard(guard, caps["timing"]), results),
            60,
        ),
        (
            "recall",
            lambda: run_recall(sizes, device, section_guard(guard, caps["recall"]), results),
            30,
        ),
    ]
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references in fp32
    with torch.no_grad():
        errors = run_sections(sections, guard, args.only)
    elapsed = guard.elapsed()
    failed = [r["check"] for r in results if r["section"] == "check" and not r["ok"]]
    if failed:
        print(f"\nchecks outside their tolerance: {', '.join(failed)}")
    print(f"\nelapsed: {elapsed:.1f} s")
    write_json(
        SLUG,
        {
            "device": device_name,
            "torch": torch.__version__,
            "triton": triton.__version__ if triton else None,
            "quick": args.quick,
            "sizes": vars(sizes),
            "elapsed_s": elapsed,
            "skipped": guard.skipped,
            "errors": errors,
            "results": results,
        },
    )
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
