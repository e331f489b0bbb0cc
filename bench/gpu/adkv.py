"""GPU benchmark of ADKV decode attention: the fused ADKV-GEMV against FP16 SDPA and KIVI.

What it measures (issue 15), with Llama-3.1-8B attention shapes (32 query heads, 8 key/value
heads, head dim 128) and random caches, all in one run:

0. **Checks first.** :func:`~ada_modules.kernels.adkv_decode.adkv_dequantize` (Triton) equals
   ``adkv_dequantize_reference`` bit for bit for 2, 3, 4 and 8 bits, on a generated cache (batch 2,
   8 heads, 4096 + 37 tokens: a partial last keyframe segment) and on one made by the python
   encoder (300 tokens). :func:`~ada_modules.kernels.adkv_decode.adkv_decode_attention` (Triton)
   matches ``adkv_decode_attention_reference`` at 8K tokens (batch 1 and 16, the latter with a
   17-token fp16 residual window and left padding) and 32K (batch 1): max abs error printed
   (tolerance 1e-3).
1. **Decode attention** for one new token at 8K / 32K / 128K cached tokens and batch 1 / 16 / 64.
   Rows: ``sdpa-fp16`` (``F.scaled_dot_product_attention`` with ``enable_gqa=True`` over an fp16
   cache: the baseline of every ratio), ``kivi4-fused`` / ``kivi2-fused``
   (:func:`~ada_modules.kernels.kv_quant.decode_attention` over 4-/2-bit KIVI segments, group 32)
   and ``adkv4-fused`` / ``adkv2-fused`` (:func:`~ada_modules.kernels.adkv_decode.adkv_decode_attention`,
   keyframe period 256). Columns: median ms (``triton.testing.do_bench``: CUDA events, L2
   flushed, median after warm-up), the KV bytes the kernel reads including metadata (KIVI: codes,
   scales and zero points; ADKV: codes, keyframes and per-channel parameters), the effective
   GB/s (KV bytes / time) and its fraction of the H200's HBM peak (4.8 TB/s), the speed-up over
   ``sdpa-fp16`` and the max abs error against the torch reference of the same arm (fp32 math
   over the same cache; only where the reference fits, batch × tokens ≤ 128K).

ADKV inputs are generated in the stored format rather than encoded (the encoder is sequential in
python): per bit width, 8 template keyframe segments of codes whose step exponent stays within
±2 octaves of the keyframe (random magnitudes and signs; a magnitude that would leave the band is
replaced by the one that moves the step back, as the encoder does), tiled at random over the
segments of the cache, with keyframe centres ``N(0, 0.5)`` in fp16, keyframe exponents at the
MSE-optimal step of a unit Gaussian ± half an octave, and the default parameters
(``ADKVParams.default(bits)``). They decode to values of order 1, so every arm sees similar data.

Run it (one H200, expected ≈3–5 minutes, guarded to ``--budget-s`` = 420 s; rows that would not
fit the time or the memory are skipped and what was measured is still printed)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/adkv.py

Smoke test without a GPU (tiny shapes, torch references, a few seconds)::

    .venv/bin/python bench/gpu/adkv.py --device cpu --quick

Prints markdown tables and the elapsed time; writes ``$OUT/adkv.json`` (``{"device", "torch",
"triton", "results": [...]}``) when ``OUT`` is set. Exits 1 when CUDA is requested but missing, or
when a section failed or a check was out of tolerance. No downloads, no files read.
"""

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import (  # bench/gpu/_common.py
    Guard,
    add_only_argument,
    bench_device,
    median_ms,
    run_sections,
    write_json,
)

from ada_modules.kernels.adkv_decode import (
    ADKVTensor,
    adkv_decode_attention,
    adkv_decode_attention_reference,
    adkv_dequantize,
    adkv_dequantize_reference,
)
from ada_modules.kernels.kv_quant import (
    QuantizedKV,
    decode_attention,
    decode_attention_reference,
    pack_codes,
    quantize_keys,
    quantize_values,
)
from ada_modules.kv.adkv import OPTIMAL_GAUSSIAN_STEP, ADKVParams, adkv_encode

try:
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

SLUG = "adkv"
HBM_PEAK_GBPS = 4800.0  # H200
GROUP, RESIDUAL_TOKENS, TEMPLATES = 32, 17, 8
BAND = 16  # generated step exponents stay within ±BAND eighth-octaves of the keyframe
REFERENCE_LIMIT = 131072  # batch × tokens up to which the torch references run (fp32/int64 copies)
CHECK_TOL = 1e-3


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run (full: Llama-3.1-8B attention; quick: tiny, for a CPU smoke test)."""

    heads: int
    kv_heads: int
    head_dim: int
    period: int
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    check_tokens: int
    check_cases: tuple[tuple[int, int], ...]  # (context, batch) of the decode-attention checks


FULL = Sizes(
    heads=32,
    kv_heads=8,
    head_dim=128,
    period=256,
    contexts=(8192, 32768, 131072),
    batches=(1, 16, 64),
    check_tokens=4096 + 37,
    check_cases=((8192, 1), (8192, 16), (32768, 1)),
)
QUICK = Sizes(
    heads=4,
    kv_heads=2,
    head_dim=32,
    period=64,
    contexts=(256, 512),
    batches=(1, 2),
    check_tokens=128 + 37,
    check_cases=((256, 2),),
)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def free_bytes(device: torch.device) -> float:
    """Free device memory (unbounded on the CPU)."""
    if device.type != "cuda":
        return math.inf
    torch.cuda.empty_cache()
    return float(torch.cuda.mem_get_info(device)[0])


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def make_cache(
    sizes: Sizes, context: int, batch: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp16 keys/values ``(batch, kv_heads, context, head_dim)`` and a query ``(batch, heads, d)``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, sizes.kv_heads, context, sizes.head_dim)
    keys = torch.randn(shape, device=device, generator=gen, dtype=torch.float16)
    keys += torch.linspace(-3, 3, sizes.head_dim, device=device, dtype=torch.float16)  # channels
    values = torch.randn(shape, device=device, generator=gen, dtype=torch.float16)
    query = torch.randn(
        batch, sizes.heads, sizes.head_dim, device=device, generator=gen, dtype=torch.float16
    )
    return keys, values, query


_TEMPLATES: dict[tuple[int, int, int, int, str], torch.Tensor] = {}


def segment_templates(sizes: Sizes, bits: int, device: torch.device) -> torch.Tensor:
    """``TEMPLATES`` packed keyframe segments ``(TEMPLATES, kv_heads, period, words)`` of valid
    codes: the step exponent stays within ``±BAND`` of the keyframe's (built once per bit width)."""
    key = (bits, sizes.kv_heads, sizes.period, sizes.head_dim, str(device))
    if key not in _TEMPLATES:
        gen = torch.Generator(device=device).manual_seed(100 + bits)
        table = ADKVParams.default(bits).multipliers.to(device, torch.int64)
        half = 2 ** (bits - 1)
        shape = (TEMPLATES, sizes.kv_heads, sizes.head_dim)
        relative = torch.zeros(shape, dtype=torch.int64, device=device)
        codes = torch.empty(
            (TEMPLATES, sizes.kv_heads, sizes.period, sizes.head_dim),
            dtype=torch.int64,
            device=device,
        )
        for t in range(sizes.period):
            magnitude = torch.randint(0, half, shape, device=device, generator=gen)
            moved = relative + table[magnitude]
            magnitude = torch.where(moved > BAND, table.argmin(), magnitude)
            magnitude = torch.where(moved < -BAND, table.argmax(), magnitude)
            relative += table[magnitude]
            upper = torch.randint(0, 2, shape, device=device, generator=gen).bool()
            codes[:, :, t] = torch.where(upper, half + magnitude, half - 1 - magnitude)
        _TEMPLATES[key] = pack_codes(codes, bits)
    return _TEMPLATES[key]


def random_adkv(
    sizes: Sizes, batch: int, tokens: int, bits: int, device: torch.device, seed: int
) -> ADKVTensor:
    """A valid ADKV cache ``(batch, kv_heads, tokens, head_dim)``: template segments tiled at
    random, random keyframes around the optimal Gaussian step, default parameters."""
    gen = torch.Generator(device=device).manual_seed(seed)
    templates = segment_templates(sizes, bits, device)
    segments = -(-tokens // sizes.period)
    pick = torch.randint(0, TEMPLATES, (batch, segments), device=device, generator=gen)
    codes = templates[pick].transpose(1, 2)  # (batch, kv_heads, segments, period, words)
    codes = codes.reshape(batch, sizes.kv_heads, segments * sizes.period, -1)[:, :, :tokens]
    keyframes = (batch, sizes.kv_heads, segments, sizes.head_dim)
    centre = (0.5 * torch.randn(keyframes, device=device, generator=gen)).half()
    optimal = round(8 * math.log2(OPTIMAL_GAUSSIAN_STEP[bits]))
    exponent = optimal + torch.randint(-4, 5, keyframes, device=device, generator=gen)
    params = ADKVParams.default(bits).to(device)
    return ADKVTensor(
        codes=codes.contiguous(),
        keyframe_centre=centre,
        keyframe_exponent=exponent.to(torch.int16),
        alpha_code=params.alpha_code,
        multipliers=params.multipliers,
        bits=bits,
        head_dim=sizes.head_dim,
        keyframe_period=sizes.period,
    )


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


# ----------------------------------------------------------------------------------------------
# Section 0: checks
# ----------------------------------------------------------------------------------------------


def run_checks(sizes: Sizes, device: torch.device, results: list[dict[str, Any]]) -> None:
    rows: list[tuple[str, float, bool]] = []
    gen = torch.Generator(device=device).manual_seed(7)
    encoded_input = torch.randn(
        1, sizes.kv_heads, 300, sizes.head_dim, device=device, generator=gen
    )
    for bits in (2, 3, 4, 8):
        generated = random_adkv(sizes, 2, sizes.check_tokens, bits, device, seed=bits)
        encoded = adkv_encode(encoded_input, ADKVParams.default(bits), keyframe_period=64)
        for name, packed in (("generated", generated), ("encoded", encoded)):
            out, ref = adkv_dequantize(packed), adkv_dequantize_reference(packed)
            rows.append(
                (
                    f"dequantize {bits}-bit, {name} T={packed.num_tokens} == reference (bitwise)",
                    max_abs_error(out, ref),
                    torch.equal(out, ref),
                )
            )
        del generated, encoded, out, ref
    for context, batch in sizes.check_cases:
        query = make_cache(sizes, 1, batch, device, 1)[2].float()  # fp32: no output rounding
        window, mask = (None, None), None
        if batch > 1:  # a residual window and left padding (a different amount per sequence)
            res_k, res_v, _ = make_cache(sizes, RESIDUAL_TOKENS, batch, device, 2)
            window = (res_k, res_v)
            mask = torch.ones(batch, context + RESIDUAL_TOKENS, dtype=torch.bool, device=device)
            for b in range(batch):
                mask[b, : b * 37] = False
        for bits in (2, 4):
            keys = random_adkv(sizes, batch, context, bits, device, seed=10 + bits)
            values = random_adkv(sizes, batch, context, bits, device, seed=20 + bits)
            out = adkv_decode_attention(query, keys, values, *window, mask)
            ref = adkv_decode_attention_reference(query, keys, values, *window, mask)
            err = max_abs_error(out, ref)
            extra = f" + {RESIDUAL_TOKENS} fp16, left padding" if batch > 1 else ""
            rows.append(
                (
                    f"decode {bits}-bit T={context}{extra} B={batch}: max abs err",
                    err,
                    err < CHECK_TOL,
                )
            )
            del keys, values, out, ref
    print("\n## Checks\n")
    print("| check | max abs err | ok |")
    print("| --- | ---: | :---: |")
    for name, value, ok in rows:
        print(f"| {name} | {value:.2e} | {'yes' if ok else 'NO'} |")
        results.append({"section": "check", "check": name, "value": value, "ok": bool(ok)})


# ----------------------------------------------------------------------------------------------
# Section 1: decode attention
# ----------------------------------------------------------------------------------------------


@dataclass
class Arm:
    """One decode-attention implementation over one cache."""

    name: str
    call: Callable[[], torch.Tensor]
    kv_bytes: int
    reference: Callable[[], torch.Tensor] | None  # None: too large for the torch reference


def time_arm(
    arm: Arm,
    context: int,
    batch: int,
    base_ms: float | None,
    device: torch.device,
    results: list[dict[str, Any]],
) -> float | None:
    """Time one arm, print its row and record it; return its median ms (None when out of memory)."""
    try:
        out = arm.call()  # compiles, and the output for the error column
        err = max_abs_error(out, arm.reference()) if arm.reference is not None else None
        del out
        ms = median_ms(arm.call, device)
    except torch.OutOfMemoryError:
        print(f"| {context} | {batch} | {arm.name} | out of memory | | | | | |")
        results.append(
            {"section": "decode", "tokens": context, "batch": batch, "impl": arm.name, "oom": True}
        )
        torch.cuda.empty_cache()
        return None
    gbps = arm.kv_bytes / ms / 1e6
    speedup = base_ms / ms if base_ms else 1.0
    err_text = f"{err:.1e}" if err is not None else "—"
    print(
        f"| {context} | {batch} | {arm.name} | {ms:.4f} | {arm.kv_bytes / 2**20:,.1f} | "
        f"{gbps:,.0f} | {gbps / HBM_PEAK_GBPS:.1%} | {speedup:.2f}× | {err_text} |"
    )
    results.append(
        {
            "section": "decode",
            "tokens": context,
            "batch": batch,
            "impl": arm.name,
            "median_ms": ms,
            "kv_bytes": arm.kv_bytes,
            "gb_per_s": gbps,
            "fraction_of_hbm_peak": gbps / HBM_PEAK_GBPS,
            "ratio_speedup_vs_sdpa_fp16": speedup,
            "max_abs_err_vs_reference": err,
        }
    )
    return ms


def run_decode(
    sizes: Sizes, device: torch.device, guard: Guard, results: list[dict[str, Any]]
) -> None:
    """Time every arm at every (context, batch); ratios against ``sdpa-fp16``."""
    print(
        f"\n## Decode attention, one new token (Hq={sizes.heads}, Hkv={sizes.kv_heads}, "
        f"d={sizes.head_dim}, ADKV keyframe period {sizes.period}, KIVI group {GROUP})\n"
    )
    print(
        "| tokens | batch | impl | median ms | KV MiB | GB/s | of HBM peak | speed-up vs "
        "sdpa-fp16 | max abs err |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for context in sizes.contexts:
        for batch in sizes.batches:
            what = f"decode T={context} B={batch}"
            fp16_bytes = 2 * batch * sizes.kv_heads * context * sizes.head_dim * 2
            if 1.8 * fp16_bytes > free_bytes(device):  # fp16 cache + KIVI 4-bit + transients
                guard.skipped.append(f"{what} (memory)")
                print(f"[memory guard] skipped {what}")
                continue
            need_s = 15 + 45 * batch * context / (64 * 131072)  # the largest row: about a minute
            if not guard.ok(what, need_s):
                continue
            run_row(sizes, context, batch, device, results)
            free_bytes(device)


def fp16_arm(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, checked: bool) -> Arm:
    q4 = query.unsqueeze(2)
    return Arm(
        "sdpa-fp16",
        lambda: F.scaled_dot_product_attention(q4, keys, values, enable_gqa=True)[:, :, 0],
        nbytes(keys, values),
        (lambda: decode_attention_reference(query, [], keys, values)) if checked else None,
    )


def kivi_arm(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bits: int, checked: bool
) -> Arm:
    seg = QuantizedKV(quantize_keys(keys, bits, GROUP), quantize_values(values, bits, GROUP))
    return Arm(
        f"kivi{bits}-fused",
        lambda: decode_attention(query, [seg]),
        seg.nbytes(),
        (lambda: decode_attention_reference(query, [seg])) if checked else None,
    )


def adkv_arm(
    sizes: Sizes, query: torch.Tensor, context: int, bits: int, device: torch.device, checked: bool
) -> Arm:
    batch = query.shape[0]
    keys = random_adkv(sizes, batch, context, bits, device, seed=30 + bits)
    values = random_adkv(sizes, batch, context, bits, device, seed=40 + bits)
    return Arm(
        f"adkv{bits}-fused",
        lambda: adkv_decode_attention(query, keys, values),
        keys.nbytes() + values.nbytes(),
        (lambda: adkv_decode_attention_reference(query, keys, values)) if checked else None,
    )


def run_row(
    sizes: Sizes, context: int, batch: int, device: torch.device, results: list[dict[str, Any]]
) -> None:
    """All arms at one (context, batch): the fp16 cache and its KIVI copies first, then ADKV."""
    checked = batch * context <= REFERENCE_LIMIT
    keys, values, query = make_cache(sizes, context, batch, device, 3)
    base_ms = time_arm(
        fp16_arm(query, keys, values, checked), context, batch, None, device, results
    )
    for bits in (4, 2):
        time_arm(
            kivi_arm(query, keys, values, bits, checked), context, batch, base_ms, device, results
        )
    del keys, values
    for bits in (4, 2):
        arm = adkv_arm(sizes, query, context, bits, device, checked)
        time_arm(arm, context, batch, base_ms, device, results)
        del arm


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes for a smoke test")
    parser.add_argument("--budget-s", type=float, default=420.0, help="overall time budget")
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
    print(f"# ADKV decode attention GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(
        f"device: {device_name}; torch {torch.__version__}; "
        f"triton {triton.__version__ if triton else 'absent'}"
    )
    results: list[dict[str, Any]] = []
    sections: list[tuple[str, Callable[[], None], float]] = [
        ("checks", lambda: run_checks(sizes, device, results), 60),
        ("decode", lambda: run_decode(sizes, device, guard, results), 30),
    ]
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
            "hbm_peak_gb_per_s": HBM_PEAK_GBPS,
            "elapsed_s": elapsed,
            "skipped": guard.skipped,
            "errors": errors,
            "results": results,
        },
    )
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
