"""GPU benchmark of the packed KV cache: fused decode attention and end-to-end ``generate``.

What it measures (issue 3, part 7), with random weights and Llama-3.1-8B shapes (32 query heads,
8 key/value heads, head dim 128; the model of section 2 has all 32 layers, hidden 4096, MLP 14336,
vocabulary 128256, bf16), all in one run:

0. **Checks first**: :func:`~ada_modules.kernels.kv_quant.quantize_keys`/``quantize_values``
   (Triton) equal their torch references bit for bit on a 4K-token fp16 cache, and
   :func:`~ada_modules.kernels.kv_quant.decode_attention` (Triton) matches
   ``decode_attention_reference`` at 8K tokens (batch 1 and 16) and 32K (batch 1): max abs error
   printed. (The reference is not run at 128K: it materialises fp32 copies of the whole cache.)
1. **Decode attention** for one new token, at 8K / 32K / 128K cached tokens and batch 1 / 16
   (plus a residual window of 17 fp16 tokens for the quantized arms). Rows:
   ``sdpa-fp16`` (``F.scaled_dot_product_attention`` with ``enable_gqa=True`` over an fp16 cache:
   the baseline of every ratio), ``triton-fp16`` (our split-K kernel reading the fp16 cache),
   ``kivi2-fused``/``kivi4-fused`` (our kernel reading 2-/4-bit packed keys and values, group 32,
   and the fp16 window) and ``kivi2-dequant+sdpa`` (what the Hugging Face attention path of
   :class:`~ada_modules.kv.KIVICache` does each step: dequantize the history, concatenate the
   window, run SDPA). Columns: median ms (``triton.testing.do_bench``), the bytes the kernel must
   read (cache incl. scales/zeros/window, query), achieved GB/s (bytes / time; H200 HBM peak is
   ~4.8 TB/s) and the speed-up over ``sdpa-fp16``.
2. **End-to-end ``generate``** on a random-weight Llama-3.1-8B (bf16, batch 1, a 32K-token random
   prompt, 64 new tokens, greedy) with ``DynamicCache`` (bf16), ``KIVICache`` 4-bit and 2-bit
   (group 32, window 32), and 2-bit with the fused decode attention. Decode tokens/s = 64 / (time(prefill + 65 tokens) − time(prefill + 1
   token)); peak memory = ``max_memory_allocated`` during ``generate`` minus the weights; cache
   bytes from ``nbytes()`` after generation. The plain KIVI rows run the model's SDPA attention
   on the dequantized history that ``update`` returns, so their decode speed includes a
   dequantization of the whole cache per layer and step, and their peak includes one layer's
   dequantized copy; the row "fused decode" sets ``attn_implementation="quantized_kv"``
   (:func:`~ada_modules.kv.quantized_kv_attention`), whose decode steps read the packed cache with
   the kernel of section 1. Each arm first runs a short warm-up generation (96-token prompt) so
   that Triton compilation is not timed.

Run it (one H200, expected ≈3–5 minutes, guarded to ``--budget-s`` = 450 s; sections that would not
fit are skipped and what was measured is still printed)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/adakvq.py

Smoke test without a GPU (tiny shapes, torch references, a few seconds)::

    .venv/bin/python bench/gpu/adakvq.py --device cpu --quick

Prints markdown tables and the elapsed time; writes ``$OUT/adakvq.json`` (``{"device", "torch",
"triton", "results": [...]}``) when ``OUT`` is set. Exits 1 when CUDA is requested but missing, or
when a section failed or a check was out of tolerance. No downloads, no files read.
"""

import argparse
import sys
import time
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
    sync,
    write_json,
)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from ada_modules.kernels.kv_quant import (
    QuantizedKV,
    decode_attention,
    decode_attention_reference,
    dequantize,
    quantize_keys,
    quantize_keys_reference,
    quantize_values,
    quantize_values_reference,
)
from ada_modules.kv import QUANTIZED_KV_ATTENTION, KIVICache

try:
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

SLUG = "adakvq"
GIB = 2**30


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run (full: Llama-3.1-8B; quick: tiny, for a CPU smoke test)."""

    heads: int
    kv_heads: int
    head_dim: int
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    check_cases: tuple[tuple[int, int], ...]  # (context, batch) compared with the reference
    model: dict[str, Any]
    prompt: int
    new_tokens: int


FULL = Sizes(
    heads=32,
    kv_heads=8,
    head_dim=128,
    contexts=(8192, 32768, 131072),
    batches=(1, 16),
    check_cases=((8192, 1), (8192, 16), (32768, 1)),
    model={
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
    },
    prompt=32768,
    new_tokens=64,
)
QUICK = Sizes(
    heads=4,
    kv_heads=2,
    head_dim=32,
    contexts=(256, 512),
    batches=(1, 2),
    check_cases=((256, 2),),
    model={
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    },
    prompt=128,
    new_tokens=8,
)
GROUP, RESIDUAL_TOKENS = 32, 17


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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


def quantize_segment(keys: torch.Tensor, values: torch.Tensor, bits: int) -> QuantizedKV:
    return QuantizedKV(quantize_keys(keys, bits, GROUP), quantize_values(values, bits, GROUP))


# ----------------------------------------------------------------------------------------------
# Section 0: checks
# ----------------------------------------------------------------------------------------------


def run_checks(sizes: Sizes, device: torch.device, results: list[dict[str, Any]]) -> None:
    rows = []
    keys, values, _ = make_cache(sizes, 4 * max(sizes.contexts[0] // 8, 32), 1, device, 0)
    for bits in (2, 3, 4, 8):
        pk, rk = quantize_keys(keys, bits, GROUP), quantize_keys_reference(keys, bits, GROUP)
        pv, rv = (
            quantize_values(values, bits, GROUP),
            quantize_values_reference(values, bits, GROUP),
        )
        same = all(
            torch.equal(a, b)
            for a, b in (
                (pk.codes, rk.codes),
                (pk.scale, rk.scale),
                (pk.zero, rk.zero),
                (pv.codes, rv.codes),
                (pv.scale, rv.scale),
                (pv.zero, rv.zero),
            )
        )
        deq = torch.equal(dequantize(pk), dequantize(rk)) and torch.equal(
            dequantize(pv), dequantize(rv)
        )
        rows.append((f"quantize/dequantize {bits}-bit == reference (bitwise)", 0.0, same and deq))
    del keys, values
    for context, batch in sizes.check_cases:
        keys, values, query = make_cache(sizes, context, batch, device, 1)
        res_k, res_v, _ = make_cache(sizes, RESIDUAL_TOKENS, batch, device, 2)
        for bits in (2, 4):
            seg = quantize_segment(keys, values, bits)
            out = decode_attention(query, [seg], res_k, res_v)
            ref = decode_attention_reference(query, [seg], res_k, res_v)
            err = (out.float() - ref.float()).abs().max().item()
            rows.append((f"decode {bits}-bit T={context} B={batch}: max abs err", err, err < 5e-3))
        del keys, values
    print("\n## Checks\n")
    print("| check | value | ok |")
    print("| --- | ---: | :---: |")
    for name, value, ok in rows:
        print(f"| {name} | {value:.2e} | {'yes' if ok else 'NO'} |")
        results.append({"section": "check", "check": name, "value": value, "ok": bool(ok)})


# ----------------------------------------------------------------------------------------------
# Section 1: decode attention
# ----------------------------------------------------------------------------------------------


def decode_arms(
    keys: torch.Tensor,
    values: torch.Tensor,
    query: torch.Tensor,
    res_k: torch.Tensor,
    res_v: torch.Tensor,
) -> list[tuple[str, Callable[[], Any], int]]:
    """The decode-attention arms ``(name, call, bytes it must read)`` for one cache."""
    q4 = query.unsqueeze(2)
    fp_bytes = nbytes(keys, values, query)
    segs = {bits: quantize_segment(keys, values, bits) for bits in (2, 4)}
    window_bytes = nbytes(res_k, res_v, query)

    def sdpa_fp16() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, keys, values, enable_gqa=True)

    def triton_fp16() -> torch.Tensor:
        return decode_attention(query, [], keys, values)

    def fused(bits: int) -> Callable[[], torch.Tensor]:
        return lambda: decode_attention(query, [segs[bits]], res_k, res_v)

    def dequant_sdpa() -> torch.Tensor:
        k = torch.cat([dequantize(segs[2].keys), res_k], dim=-2)
        v = torch.cat([dequantize(segs[2].values), res_v], dim=-2)
        return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    return [
        ("sdpa-fp16", sdpa_fp16, fp_bytes),
        ("triton-fp16", triton_fp16, fp_bytes),
        ("kivi2-fused", fused(2), segs[2].nbytes() + window_bytes),
        ("kivi4-fused", fused(4), segs[4].nbytes() + window_bytes),
        ("kivi2-dequant+sdpa", dequant_sdpa, segs[2].nbytes() + window_bytes),
    ]


def run_decode(
    sizes: Sizes, device: torch.device, guard: Guard, results: list[dict[str, Any]]
) -> None:
    """Time every arm at every (context, batch); ratios against ``sdpa-fp16``."""
    print(
        f"\n## Decode attention, one new token (Hq={sizes.heads}, Hkv={sizes.kv_heads}, "
        f"d={sizes.head_dim})\n"
    )
    print("| tokens | batch | impl | median ms | bytes read (MiB) | GB/s | speed-up vs sdpa-fp16 |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for context in sizes.contexts:
        for batch in sizes.batches:
            if not guard.ok(f"decode T={context} B={batch}", 25):
                continue
            keys, values, query = make_cache(sizes, context, batch, device, 3)
            res_k, res_v, _ = make_cache(sizes, RESIDUAL_TOKENS, batch, device, 4)
            arms = decode_arms(keys, values, query, res_k, res_v)
            base_ms = None
            for name, fn, read in arms:
                ms = median_ms(fn, device)
                base_ms = base_ms or ms
                gbps = read / ms / 1e6
                print(
                    f"| {context} | {batch} | {name} | {ms:.4f} | {read / 2**20:,.1f} | "
                    f"{gbps:,.0f} | {base_ms / ms:.2f}× |"
                )
                results.append(
                    {
                        "section": "decode",
                        "tokens": context,
                        "batch": batch,
                        "impl": name,
                        "median_ms": ms,
                        "bytes_read": read,
                        "gb_per_s": gbps,
                        "ratio_speedup_vs_sdpa_fp16": base_ms / ms,
                    }
                )
            del keys, values, arms
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Section 2: end-to-end generate
# ----------------------------------------------------------------------------------------------


def run_generate(
    sizes: Sizes, device: torch.device, guard: Guard, results: list[dict[str, Any]]
) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(**sizes.model, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    weights = nbytes(*model.parameters())
    gen = torch.Generator(device=device).manual_seed(5)
    prompt = torch.randint(2, config.vocab_size, (1, sizes.prompt), device=device, generator=gen)
    factories: list[tuple[str, Callable[[], Any], str]] = [
        (
            "DynamicCache (bf16)" if dtype == torch.bfloat16 else "DynamicCache (fp32)",
            lambda: DynamicCache(config=config),
            "sdpa",
        ),
        ("KIVICache 4-bit", lambda: KIVICache(config, 4, 4, GROUP, GROUP, 32), "sdpa"),
        ("KIVICache 2-bit", lambda: KIVICache(config, 2, 2, GROUP, GROUP, 32), "sdpa"),
        (
            "KIVICache 2-bit, fused decode (quantized_kv)",
            lambda: KIVICache(config, 2, 2, GROUP, GROUP, 32),
            QUANTIZED_KV_ATTENTION,
        ),
    ]

    def timed_generate(cache: Any, new: int, length: int | None = None) -> tuple[float, Any]:
        ids = prompt[:, :length]
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
        sync(device)
        return time.perf_counter() - t0, out

    print(
        f"\n## End-to-end generate: random-weight Llama ({config.num_hidden_layers} layers, "
        f"{weights / GIB:.1f} GiB of weights, {dtype}), prompt {sizes.prompt}, "
        f"{sizes.new_tokens} new tokens, batch 1\n"
    )
    print(
        "| cache | prefill s | decode tokens/s | peak GiB above weights | cache MiB | "
        "same tokens as DynamicCache |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    ref_tokens = None
    with torch.no_grad():
        timed_generate(factories[0][1](), 2)  # warm-up (allocator, cuBLAS at the full prompt)
        for name, factory, attn in factories:
            if not guard.ok(f"generate {name}", 45):
                continue
            model.set_attn_implementation(attn)
            timed_generate(factory(), 40, length=96)  # compiles this arm's Triton kernels
            prefill_s, _ = timed_generate(factory(), 1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            cache = factory()
            total_s, out = timed_generate(cache, sizes.new_tokens + 1)
            peak = torch.cuda.max_memory_allocated(device) - weights if device.type == "cuda" else 0
            cache_bytes = (
                cache.nbytes()
                if hasattr(cache, "nbytes")
                else sum(nbytes(layer.keys, layer.values) for layer in cache.layers)
            )
            tokens = out[0, sizes.prompt :]
            ref_tokens = tokens if ref_tokens is None else ref_tokens
            same = (tokens == ref_tokens).float().mean().item()
            tps = sizes.new_tokens / max(total_s - prefill_s, 1e-9)
            print(
                f"| {name} | {prefill_s:.2f} | {tps:.1f} | {peak / GIB:.2f} | "
                f"{cache_bytes / 2**20:,.0f} | {same:.2f} |"
            )
            results.append(
                {
                    "section": "generate",
                    "cache": name,
                    "prompt": sizes.prompt,
                    "new_tokens": sizes.new_tokens,
                    "prefill_s": prefill_s,
                    "decode_tokens_per_s": tps,
                    "peak_bytes_above_weights": peak,
                    "cache_bytes": cache_bytes,
                    "fraction_same_tokens_as_dynamic": same,
                }
            )
            del cache, out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes for a smoke test")
    parser.add_argument("--budget-s", type=float, default=450.0, help="overall time budget")
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
    print(f"# AdaKVQ / KIVI GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(
        f"device: {device_name}; torch {torch.__version__}; "
        f"triton {triton.__version__ if triton else 'absent'}"
    )
    results: list[dict[str, Any]] = []
    sections: list[tuple[str, Callable[[], None], float]] = [
        ("checks", lambda: run_checks(sizes, device, results), 30),
        ("decode", lambda: run_decode(sizes, device, guard, results), 30),
        ("generate", lambda: run_generate(sizes, device, guard, results), 90),
    ]
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
            "elapsed_s": elapsed,
            "skipped": guard.skipped,
            "errors": errors,
            "results": results,
        },
    )
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
