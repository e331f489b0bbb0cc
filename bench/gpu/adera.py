"""GPU benchmark of AdERA's exponent and delta codecs and compressed all-gather on one device.

What it measures (issue 4, part 7), all in one run:

0. **Checks first.** At ``N`` = 1M elements, bf16 and fp32, change rates {0, 1%, 10%, 50%, 100%}
   plus a shard full of edge values (±0, subnormals, ±Inf, NaN payloads, exponents 0x00/0xFF) and
   a capacity too small (a spill): the Triton ``encode_into`` buffer and spill equal the torch
   reference's byte for byte, and the Triton ``decode_from`` rebuilds the shard and its exponents
   bit for bit. Then the same for the **delta codec** (:mod:`ada_modules.kernels.delta_codec`,
   never run on a GPU before this script), bf16 and fp32, with a cache that is (a) identical (SAME
   chunks), (b) the shard with each element's bits moved by a random integer in [-3, 3] (an
   optimizer step; EG chunks), (c) unrelated random values (RAW chunks), (d) edge values (±0,
   subnormals, ±Inf, NaN payloads) mixed in, against a moved cache and against a zero cache, and
   (e) case (b) with a capacity of a third of the stream (a spill): at ``N`` = 1M + 300 elements
   (a partial last chunk) the Triton buffer's chunk words and stream size equal the torch
   ``chunk_forms``, the spill has the right size and ``decode_from`` rebuilds the shard bit for
   bit, into a new tensor and in place into the cache (as a receiver does); on the first 256K + 77
   elements the Triton ``encode_into`` buffer and spill equal the torch reference's byte for byte
   (the reference loops over up to ~50 bit planes; on a 2-core CPU it takes 0.5–4 s per
   256K-element encode, so the byte comparison is kept at that size).
1. **Codec throughput** (Triton) at ``N`` in {64K, 1M, 16M, 256M} elements, bf16 and fp32,
   ``p`` in {0, 1%, 10%, 50%} (changed positions uniform; capacity = the exact stream, so no
   spill): ``encode_into`` and ``decode_from`` median ms (``triton.testing.do_bench``: CUDA events,
   L2 flushed) and GB/s of raw shard bytes, against a plain ``copy_`` of the raw shard (the
   ratio columns: codec time ÷ copy time). ``encode_into`` includes its one host read (the stream
   size, which sizes the spill) and ``decode_from`` its header read, as in the all-gather. A
   torch-reference row (p = 1%, 1M and 16M) shows what the Triton kernels buy.
2. **Delta codec throughput** (Triton) at ``N`` in {1M, 16M, 64M} elements, bf16 and fp32, cache
   (b) (bits moved by [-3, 3]) and (a) (identical), capacity = the exact stream: ``encode_into``
   (with its one host read, the stream size) and ``decode_from`` (with its header read) median ms
   (``do_bench``, 30 ms of repeats; a call over 250 ms is timed once instead), GB/s of raw shard
   bytes, the payload ÷ raw bytes ratio, the ratio to a plain ``copy_`` (codec time ÷ copy time),
   whether the decode was exact, and whether the issue's target (>= 100 GB/s encode and decode on
   one H200) is met: reported, not asserted. The section stops starting rows after 120 s.
3. **Interference.** bf16 GEMMs on the default stream (8192×8192×8192, and 8192 tokens ×
   4096 → 14336 like one Mixtral expert) for about half a second, alone and while the codec work of one
   P=8 all-gather of a 64M-element bf16 group (encode one 8M shard, decode 8 shards, p = 1%) runs
   in a loop on a side stream: GEMM time with and without the codec (slowdown %), and the codec's
   time per all-gather alone and under contention.
4. **One-rank all-gather.** FSDP2 skips the all-gather at world size 1, so
   :class:`~ada_modules.strategies.AdERAAllGather` (``mode="always"``, ``min_numel=0``) is called
   directly on a 1-rank NCCL group (gloo on CPU), alternating two versions of a shard (a
   multiplicative update ``x·(1 + 0.01·ε)``, so every gather sees the same change rate): output
   bitwise equal to the input, a ``shadow=True`` gather, bytes ratio and reuse rate from its
   ``GatherStats``, and the median ms per gather against the raw ``all_gather_single`` (the
   codec's whole overhead, with no bandwidth to save at one rank). Then a small MLP is sharded
   with ``fully_shard`` on the 1-rank mesh, the AdERA all-gathers are installed
   (``install_adera_all_gather``) and it trains 3 AdamW steps: it runs, and the table shows the
   number of gathers FSDP2 routed to AdERA (0 at world size 1).

Run it (one H200, expected ≈2–5 minutes with compilation: the last run of sections 0, 1, 3 and 4
took 17 s; the delta codec adds 12 checks of about 1M elements and a throughput section that
starts no row after 120 s. Guarded to ``--budget-s`` = 420 s, checked before every section, check
and row, so it ends well within 8 minutes; what would not fit is skipped and what was measured is
still printed. ``--only`` takes ``checks``, ``throughput``, ``delta-throughput``,
``interference``, ``one-rank``)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/adera.py

Smoke test without a GPU (tiny shapes, torch reference codecs, gloo, a few seconds)::

    .venv/bin/python bench/gpu/adera.py --device cpu --quick

Prints markdown tables and the elapsed time; writes ``$OUT/adera.json`` (``{"device", "torch",
"triton", "results": [...]}``) when ``OUT`` is set. Exits 1 when CUDA is requested but missing, or
when a section failed or a check was not exact. No downloads, no files read.
"""

import argparse
import math
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    Guard,
    add_only_argument,  # bench/gpu/_common.py
    bench_device,
    median_ms,
    run_sections,
    sync,
    write_json,
)
from torch import nn

from ada_modules.kernels import delta_codec
from ada_modules.kernels.exponent_codec import (
    chunk_counts,
    decode_from,
    encode_into,
    encode_into_reference,
    extract_exponents,
    raw_nbytes,
    stream_nbytes,
)
from ada_modules.strategies import AdERAAllGather, install_adera_all_gather

try:
    import triton
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

SLUG = "adera"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
DELTA_TARGET_GB_PER_S = 100.0
"""The issue's target for the delta codec: encode and decode at >= 100 GB/s on one H200."""
SLOW_CALL_MS = 250.0
"""A delta-codec call slower than this is timed once, not repeated by ``do_bench``."""
STEP_LABEL = "bits + [-3, 3] (step)"
"""The realistic delta case: the cache is the shard with its bits moved by [-3, 3] units."""


@dataclass(frozen=True)
class Sizes:
    """Sizes of one run (full: H200; quick: tiny, for a CPU smoke test)."""

    check_numel: int
    check_rates: tuple[float, ...]
    numels: tuple[int, ...]
    rates: tuple[float, ...]
    reference_numels: tuple[int, ...]
    gemms: tuple[tuple[int, int, int], ...]  # (m, k, n)
    gemm_seconds: float
    side_shard: int
    side_world: int
    gather_numels: tuple[int, ...]
    mlp_width: int
    delta_check_numel: int  # Triton round trip and chunk forms (a partial last chunk)
    delta_ref_numel: int  # prefix compared byte for byte with the (slow) torch reference
    delta_numels: tuple[int, ...]
    delta_rep_ms: int  # do_bench repetition time per timing
    delta_seconds: float  # cap on the delta throughput section (time guard)


FULL = Sizes(
    check_numel=1 << 20,
    check_rates=(0.0, 0.01, 0.1, 0.5, 1.0),
    numels=(1 << 16, 1 << 20, 1 << 24, 1 << 28),
    rates=(0.0, 0.01, 0.1, 0.5),
    reference_numels=(1 << 20, 1 << 24),
    gemms=((8192, 8192, 8192), (8192, 4096, 14336)),
    gemm_seconds=0.5,
    side_shard=1 << 23,
    side_world=8,
    gather_numels=(1 << 20, 1 << 24, 1 << 26),
    mlp_width=2048,
    delta_check_numel=(1 << 20) + 300,
    delta_ref_numel=(1 << 18) + 77,
    delta_numels=(1 << 20, 1 << 24, 1 << 26),
    delta_rep_ms=30,
    delta_seconds=120.0,
)
QUICK = Sizes(
    check_numel=4096,
    check_rates=(0.0, 0.1, 1.0),
    numels=(4096, 1 << 16),
    rates=(0.0, 0.1),
    reference_numels=(4096,),
    gemms=((128, 128, 128),),
    gemm_seconds=0.05,
    side_shard=1 << 12,
    side_world=2,
    gather_numels=(1 << 14,),
    mlp_width=64,
    delta_check_numel=5000,
    delta_ref_numel=3000,
    delta_numels=(4096,),
    delta_rep_ms=5,
    delta_seconds=30.0,
)


def int_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def shard_and_cache(
    numel: int, dtype: torch.dtype, p: float, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``~ N(0, 0.02)`` and a cache whose exponents differ at a fraction ``p`` of places."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (0.02 * torch.randn(numel, device=device, generator=gen)).to(dtype)
    cache = extract_exponents(x)
    if p >= 1:
        cache ^= 1
    elif p > 0:
        flip = torch.rand(numel, device=device, generator=gen) < p
        cache = torch.where(flip, cache ^ 1, cache)
    return x, cache


def edge_shard(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random weights with ±0, subnormals, ±Inf, NaN payloads and exponents 0x00/0xFF mixed in."""
    x = torch.randn(numel, device=device).to(dtype)
    bits = int_view(x)
    if dtype == torch.bfloat16:
        specials = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x7F7F]
    else:
        specials = [0, 1 << 31, 1, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001, -1, 0x7F7FFFFF]
    width = 16 if dtype == torch.bfloat16 else 32
    values = torch.tensor(
        [v - (1 << width) if v >= 1 << (width - 1) else v for v in specials],
        dtype=bits.dtype,
        device=device,
    )
    idx = torch.arange(0, numel // 2, 3, device=device)
    bits[idx] = values.repeat(idx.numel() // len(values) + 1)[: idx.numel()]
    return x


def bits_moved(x: torch.Tensor, gen: torch.Generator, reach: int = 3) -> torch.Tensor:
    """``x`` with each element's bits, read as a ``B``-bit unsigned integer, moved by a random
    integer in ``[-reach, reach]`` (mod ``2**B``): the small moves of one optimizer step."""
    width = 16 if x.dtype == torch.bfloat16 else 32
    bits = int_view(x)
    u = bits.to(torch.int64) & ((1 << width) - 1)
    step = torch.randint(-reach, reach + 1, (x.numel(),), generator=gen, device=x.device)
    v = (u + step) & ((1 << width) - 1)
    v = torch.where(v >= 1 << (width - 1), v - (1 << width), v)
    return v.to(bits.dtype).view(x.dtype)


# ----------------------------------------------------------------------------------------------
# Section 0: checks
# ----------------------------------------------------------------------------------------------


def check_case(
    x: torch.Tensor, cache: torch.Tensor, capacity: int | None, impl: str
) -> tuple[bool, int]:
    """Encode with ``impl`` and the reference; compare buffers, spills and the decode."""
    numel, dtype = x.numel(), x.dtype
    stream = stream_nbytes(chunk_counts(x, cache), numel)
    capacity = stream if capacity is None else capacity
    buffer, spill = encode_into(x, cache, capacity, impl=impl)
    ref_buffer, ref_spill = encode_into_reference(x, cache, capacity)
    same = torch.equal(buffer, ref_buffer) and torch.equal(spill, ref_spill)
    y, new_cache = decode_from(buffer, cache, numel, dtype, spill=spill, impl=impl)
    same = same and torch.equal(int_view(y), int_view(x))
    same = same and torch.equal(new_cache, extract_exponents(x))
    return same, spill.numel()


def run_checks(
    sizes: Sizes, device: torch.device, impl: str, results: list[dict[str, Any]]
) -> None:
    print(
        f"\n## Checks: {impl} codec == torch reference, decode exact (N = {sizes.check_numel:,})\n"
    )
    print("| dtype | case | spill bytes | exact |")
    print("| --- | --- | ---: | :---: |")
    n = sizes.check_numel
    for name, dtype in DTYPES.items():
        cases: list[tuple[str, torch.Tensor, torch.Tensor, int | None]] = []
        for i, p in enumerate(sizes.check_rates):
            x, cache = shard_and_cache(n, dtype, p, device, seed=10 + i)
            cases.append((f"p = {p:.0%}", x, cache, None))
        x = edge_shard(n, dtype, device)
        cases.append(
            ("edge values vs stale cache", x, torch.zeros_like(extract_exponents(x)), None)
        )
        x, cache = shard_and_cache(n, dtype, 0.1, device, seed=20)
        cases.append(("p = 10%, capacity 64 B (spill)", x, cache, 64))
        for label, x, cache, capacity in cases:
            ok, spilled = check_case(x, cache, capacity, impl)
            print(f"| {name} | {label} | {spilled:,} | {'yes' if ok else 'NO'} |")
            results.append(
                {
                    "section": "check",
                    "check": f"{name} {label}",
                    "impl": impl,
                    "numel": n,
                    "spill_bytes": spilled,
                    "ok": bool(ok),
                }
            )


def error_line(err: Exception) -> str:
    """An exception as one line that fits a markdown table cell (compiler errors span lines)."""
    return " ".join(f"{type(err).__name__}: {err}".split()).replace("|", "/")


def delta_cases(
    numel: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[str, torch.Tensor, torch.Tensor, float | None]]:
    """``(label, shard, cache, capacity as a fraction of the stream or None for all of it)``."""
    gen = torch.Generator(device=device).manual_seed(30)
    x = (0.02 * torch.randn(numel, device=device, generator=gen)).to(dtype)
    unrelated = torch.randn(numel, device=device, generator=gen).to(dtype)
    moved = bits_moved(x, gen)
    edges = edge_shard(numel, dtype, device)
    return [
        ("identical cache (SAME)", x, x.clone(), None),
        ("cache = bits + [-3, 3] (step)", x, moved, None),
        ("unrelated cache (RAW)", x, unrelated, None),
        ("edge values, cache = bits + [-3, 3]", edges, bits_moved(edges, gen), None),
        ("edge values vs zero cache", edges, torch.zeros_like(edges), None),
        ("step, capacity E/3 (spill)", x, moved, 1 / 3),
    ]


def chunk_word_bytes(forms: delta_codec.ChunkForms) -> torch.Tensor:
    """The little-endian ``form << 24 | size`` chunk words of a payload, as bytes."""
    word = forms.form << 24 | forms.size
    return torch.stack([(word >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1).reshape(-1)


def delta_check_case(
    x: torch.Tensor, cache: torch.Tensor, fraction: float | None, ref_numel: int, impl: str
) -> dict[str, Any]:
    """Check the delta codec's ``impl`` on one case.

    On the whole shard: the chunk words and stream size of the ``impl`` buffer equal the torch
    ``chunk_forms``, the spill has the right size, and ``decode_from`` rebuilds the shard bit for
    bit (into a new tensor, and in place into a copy of the cache, as a receiver does). On the
    first ``ref_numel`` elements: the ``impl`` buffer and spill equal the torch reference's byte
    for byte.
    """
    numel, dtype = x.numel(), x.dtype
    forms = delta_codec.chunk_forms(x, cache)
    stream = int(forms.size.sum())
    capacity = stream if fraction is None else int(stream * fraction)
    buffer, spill = delta_codec.encode_into(x, cache, capacity, impl=impl)
    words = delta_codec.HEADER_NBYTES + 4 * forms.form.numel()
    forms_ok = (
        buffer.numel() == delta_codec.payload_nbytes(numel, dtype, capacity)
        and delta_codec.read_header(buffer).stream_nbytes == stream
        and spill.numel() == max(stream - capacity, 0)
        and torch.equal(
            buffer[delta_codec.HEADER_NBYTES : words], chunk_word_bytes(forms).to(torch.uint8)
        )
    )
    y = delta_codec.decode_from(buffer, cache, numel, dtype, spill=spill, impl=impl)
    decode_ok = torch.equal(int_view(y), int_view(x))
    in_place = cache.clone()
    delta_codec.decode_from(buffer, in_place, numel, dtype, spill=spill, out=in_place, impl=impl)
    in_place_ok = torch.equal(int_view(in_place), int_view(x))
    xr, cr = x[:ref_numel], cache[:ref_numel]
    ref_stream = int(delta_codec.chunk_forms(xr, cr).size.sum())
    ref_capacity = ref_stream if fraction is None else int(ref_stream * fraction)
    b_impl, s_impl = delta_codec.encode_into(xr, cr, ref_capacity, impl=impl)
    b_ref, s_ref = delta_codec.encode_into_reference(xr, cr, ref_capacity)
    bytes_ok = torch.equal(b_impl, b_ref) and torch.equal(s_impl, s_ref)
    return {
        "chunks_same": int((forms.form == 0).sum()),
        "chunks_raw": int((forms.form == 1).sum()),
        "chunks_eg": int((forms.form >= 2).sum()),
        "stream_bytes": stream,
        "capacity_bytes": capacity,
        "spill_bytes": spill.numel(),
        "bytes_ratio": delta_codec.encoded_nbytes(numel, dtype, stream) / raw_nbytes(numel, dtype),
        "forms_ok": bool(forms_ok),
        "bytes_equal_reference": bool(bytes_ok),
        "reference_spill_bytes": s_ref.numel(),
        "decode_ok": bool(decode_ok),
        "in_place_decode_ok": bool(in_place_ok),
        "ok": bool(forms_ok and bytes_ok and decode_ok and in_place_ok),
    }


def run_delta_checks(
    sizes: Sizes, device: torch.device, impl: str, guard: Guard, results: list[dict[str, Any]]
) -> None:
    n, n_ref = sizes.delta_check_numel, sizes.delta_ref_numel
    print(
        f"\n## Checks: delta codec, {impl} == torch (chunk forms and decode at N = {n:,}; "
        f"bytes == torch reference on the first {n_ref:,} elements)\n"
    )
    print(
        "| dtype | case | chunks SAME/RAW/EG | payload ÷ raw | spill bytes | forms | "
        "bytes == ref | decode | in-place decode | exact |"
    )
    print("| --- | --- | ---: | ---: | ---: | :---: | :---: | :---: | :---: | :---: |")
    yes = {True: "yes", False: "NO"}
    for name, dtype in DTYPES.items():
        for label, x, cache, fraction in delta_cases(n, dtype, device):
            if not guard.ok(f"delta check {name} {label}", 5):
                continue
            row: dict[str, Any] = {
                "section": "delta_check",
                "check": f"delta {name} {label}",
                "impl": impl,
                "numel": n,
                "reference_numel": n_ref,
            }
            try:
                row.update(delta_check_case(x, cache, fraction, n_ref, impl))
            except Exception as err:  # a kernel never run on this GPU: report, go on
                row.update(ok=False, error=error_line(err))
                print(f"| {name} | {label} | error: {row['error'][:200]} | | | | | | | NO |")
                results.append(row)
                continue
            print(
                f"| {name} | {label} | {row['chunks_same']}/{row['chunks_raw']}/"
                f"{row['chunks_eg']} | {row['bytes_ratio']:.4f} | {row['spill_bytes']:,} | "
                f"{yes[row['forms_ok']]} | {yes[row['bytes_equal_reference']]} | "
                f"{yes[row['decode_ok']]} | {yes[row['in_place_decode_ok']]} | {yes[row['ok']]} |"
            )
            results.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_all_checks(
    sizes: Sizes, device: torch.device, impl: str, guard: Guard, results: list[dict[str, Any]]
) -> None:
    """Section 0: the exponent codec's checks, then the delta codec's (each exact or reported)."""
    try:
        run_checks(sizes, device, impl, results)
    finally:  # the delta codec is checked even when the exponent codec's checks raise
        run_delta_checks(sizes, device, impl, guard, results)


# ----------------------------------------------------------------------------------------------
# Section 1: codec throughput
# ----------------------------------------------------------------------------------------------


def time_codec(
    x: torch.Tensor, cache: torch.Tensor, impl: str, device: torch.device
) -> tuple[float, float, float]:
    """``(encode ms, decode ms, bytes ratio)`` with capacity = the exact stream."""
    numel, dtype = x.numel(), x.dtype
    stream = stream_nbytes(chunk_counts(x, cache), numel)
    buffer, spill = encode_into(x, cache, stream, impl=impl)
    out = torch.empty_like(x)
    cache_out = torch.empty_like(cache)
    enc = median_ms(lambda: encode_into(x, cache, stream, impl=impl), device, rep_ms=50)
    dec = median_ms(
        lambda: decode_from(
            buffer, cache, numel, dtype, spill=spill, out=out, cache_out=cache_out, impl=impl
        ),
        device,
        rep_ms=50,
    )
    return enc, dec, buffer.numel() / raw_nbytes(numel, dtype)


def timing_fields(enc: float, dec: float, copy: float, raw: int, ratio: float) -> dict[str, float]:
    """Milliseconds, GB/s of ``raw`` shard bytes and ratios of one encode/decode/copy timing."""
    return {
        "encode_ms": enc,
        "decode_ms": dec,
        "copy_ms": copy,
        "encode_gb_per_s": raw / enc / 1e6,
        "decode_gb_per_s": raw / dec / 1e6,
        "copy_gb_per_s": raw / copy / 1e6,
        "ratio_encode_vs_copy": enc / copy,
        "ratio_decode_vs_copy": dec / copy,
        "bytes_ratio": ratio,
    }


def run_throughput(
    sizes: Sizes, device: torch.device, impl: str, guard: Guard, results: list[dict[str, Any]]
) -> None:
    print(f"\n## Codec throughput ({impl}), GB/s of raw shard bytes\n")
    print(
        "| dtype | N | p | impl | encode ms | decode ms | copy ms | encode GB/s | decode GB/s | "
        "copy GB/s | encode ÷ copy | decode ÷ copy | encoded ÷ raw |"
    )
    print(
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    arms = [(n, p, impl) for n in sizes.numels for p in sizes.rates]
    arms += [(n, 0.01, "torch") for n in sizes.reference_numels if impl != "torch"]
    for name, dtype in DTYPES.items():
        for numel, p, arm_impl in arms:
            if not guard.ok(f"throughput {name} N={numel} p={p} {arm_impl}", 8):
                continue
            x, cache = shard_and_cache(numel, dtype, p, device, seed=1)
            dst = torch.empty_like(x)
            copy = median_ms(lambda x=x, dst=dst: dst.copy_(x), device, rep_ms=50)
            enc, dec, ratio = time_codec(x, cache, arm_impl, device)
            f = timing_fields(enc, dec, copy, raw_nbytes(numel, dtype), ratio)
            print(
                f"| {name} | {numel:,} | {p:.0%} | {arm_impl} | {enc:.4f} | {dec:.4f} | "
                f"{copy:.4f} | {f['encode_gb_per_s']:,.2f} | {f['decode_gb_per_s']:,.2f} | "
                f"{f['copy_gb_per_s']:,.2f} | {enc / copy:.1f}× | {dec / copy:.1f}× | "
                f"{ratio:.4f} |"
            )
            results.append(
                {
                    "section": "throughput",
                    "dtype": name,
                    "numel": numel,
                    "change_rate": p,
                    "impl": arm_impl,
                    **f,
                }
            )
            del x, cache, dst
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Section 2: delta codec throughput
# ----------------------------------------------------------------------------------------------


def once_or_median_ms(fn: Callable[[], Any], device: torch.device, rep_ms: int) -> float:
    """``median_ms(fn)``, unless one call already takes over ``SLOW_CALL_MS``: then that one
    call's milliseconds (a slow kernel must not eat the run's time budget in repeats)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = (time.perf_counter() - t0) * 1e3
    if once > SLOW_CALL_MS:
        return once
    return median_ms(fn, device, rep_ms=rep_ms)


def time_delta(
    x: torch.Tensor, cache: torch.Tensor, impl: str, device: torch.device, rep_ms: int
) -> tuple[float, float, float, bool]:
    """``(encode ms, decode ms, payload ÷ raw, decode exact)`` of the delta codec, capacity = the
    exact stream (no spill). ``encode_into`` includes its host read of the stream size and
    ``decode_from`` its header read, as in the all-gather."""
    numel, dtype = x.numel(), x.dtype
    stream = delta_codec.read_header(delta_codec.encode(x, cache, impl=impl)).stream_nbytes
    buffer, spill = delta_codec.encode_into(x, cache, stream, impl=impl)
    out = torch.empty_like(x)
    enc = once_or_median_ms(
        lambda: delta_codec.encode_into(x, cache, stream, impl=impl), device, rep_ms
    )
    dec = once_or_median_ms(
        lambda: delta_codec.decode_from(
            buffer, cache, numel, dtype, spill=spill, out=out, impl=impl
        ),
        device,
        rep_ms,
    )
    exact = torch.equal(int_view(out), int_view(x))
    return enc, dec, (buffer.numel() + spill.numel()) / raw_nbytes(numel, dtype), exact


def target_met(encode_gbps: float, decode_gbps: float) -> str:
    """The target column: whether encode and decode reach ``DELTA_TARGET_GB_PER_S``."""
    met = (encode_gbps >= DELTA_TARGET_GB_PER_S, decode_gbps >= DELTA_TARGET_GB_PER_S)
    return {(True, True): "yes", (True, False): "encode only", (False, True): "decode only"}.get(
        met, "no"
    )


def delta_throughput_row(
    name: str,
    x: torch.Tensor,
    label: str,
    cache: torch.Tensor,
    copy: float,
    impl: str,
    device: torch.device,
    rep_ms: int,
) -> dict[str, Any]:
    """Time one shard against one cache; print its table row and return its result."""
    numel, dtype = x.numel(), x.dtype
    enc, dec, ratio, exact = time_delta(x, cache, impl, device, rep_ms)
    f = timing_fields(enc, dec, copy, raw_nbytes(numel, dtype), ratio)
    met = target_met(f["encode_gb_per_s"], f["decode_gb_per_s"])
    print(
        f"| {name} | {numel:,} | {label} | {enc:.4f} | {dec:.4f} | {copy:.4f} | "
        f"{f['encode_gb_per_s']:,.2f} | {f['decode_gb_per_s']:,.2f} | {f['copy_gb_per_s']:,.2f} | "
        f"{enc / copy:.1f}× | {dec / copy:.1f}× | {ratio:.4f} | {'yes' if exact else 'NO'} | {met} |"
    )
    return {
        **f,
        "target_gb_per_s": DELTA_TARGET_GB_PER_S,
        "target_met_encode": f["encode_gb_per_s"] >= DELTA_TARGET_GB_PER_S,
        "target_met_decode": f["decode_gb_per_s"] >= DELTA_TARGET_GB_PER_S,
        "target_met": met == "yes",
        "ok": bool(exact),
    }


def run_delta_throughput(
    sizes: Sizes, device: torch.device, impl: str, guard: Guard, results: list[dict[str, Any]]
) -> None:
    target = DELTA_TARGET_GB_PER_S
    print(
        f"\n## Delta codec throughput ({impl}), GB/s of raw shard bytes (target: >= {target:.0f} "
        "GB/s encode and decode on one H200)\n"
    )
    print(
        "| dtype | N | cache | encode ms | decode ms | copy ms | encode GB/s | decode GB/s | "
        f"copy GB/s | encode ÷ copy | decode ÷ copy | payload ÷ raw | exact | >= {target:.0f} GB/s |"
    )
    print(
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: "
        "| :---: |"
    )
    local = Guard(budget_s=sizes.delta_seconds)  # leave time for the sections after this one
    for name, dtype in DTYPES.items():
        for numel in sizes.delta_numels:
            what = f"delta throughput {name} N={numel}"
            if not (guard.ok(what, 10) and local.ok(what, 10)):
                continue
            gen = torch.Generator(device=device).manual_seed(5)
            x = (0.02 * torch.randn(numel, device=device, generator=gen)).to(dtype)
            dst = torch.empty_like(x)
            copy = median_ms(lambda x=x, dst=dst: dst.copy_(x), device, rep_ms=sizes.delta_rep_ms)
            del dst
            for label in (STEP_LABEL, "identical"):
                row: dict[str, Any] = {
                    "section": "delta_throughput",
                    "check": f"delta throughput {name} N={numel} {label}",
                    "dtype": name,
                    "numel": numel,
                    "cache": label,
                    "impl": impl,
                }
                try:
                    cache = bits_moved(x, gen) if label == STEP_LABEL else x.clone()
                    row.update(
                        delta_throughput_row(
                            name, x, label, cache, copy, impl, device, sizes.delta_rep_ms
                        )
                    )
                    del cache
                except Exception as err:  # a kernel never run on this GPU: report, go on
                    row.update(ok=False, error=error_line(err))
                    print(f"| {name} | {numel:,} | {label} | error: {row['error'][:200]} |")
                results.append(row)
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()
    guard.skipped.extend(local.skipped)


# ----------------------------------------------------------------------------------------------
# Section 3: GEMM interference
# ----------------------------------------------------------------------------------------------


def codec_allgather_work(sizes: Sizes, device: torch.device, impl: str) -> Callable[[], None]:
    """The codec work of one all-gather: encode one shard, decode ``side_world`` shards."""
    n, world = sizes.side_shard, sizes.side_world
    x, cache = shard_and_cache(n, torch.bfloat16, 0.01, device, seed=3)
    stream = stream_nbytes(chunk_counts(x, cache), n)
    buffer, spill = encode_into(x, cache, stream, impl=impl)
    out = torch.empty(world, n, dtype=torch.bfloat16, device=device)
    caches_out = torch.empty(world, n, dtype=torch.uint8, device=device)

    def work() -> None:
        encode_into(x, cache, stream, impl=impl)
        for r in range(world):
            decode_from(
                buffer,
                cache,
                n,
                torch.bfloat16,
                spill=spill,
                out=out[r],
                cache_out=caches_out[r],
                impl=impl,
            )

    return work


def elapsed_ms(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    """Milliseconds of ``iters`` calls (CUDA events on the current stream, else perf_counter)."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3


def contended(
    gemm: Callable[[], None], iters: int, work: Callable[[], None], device: torch.device
) -> tuple[float, float, int]:
    """GEMMs on the default stream while ``work`` loops on a side stream until they are done.

    Returns ``(GEMM ms, side-stream ms, side iterations)``.
    """
    side = torch.cuda.Stream(device)
    g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    g0.record()
    for _ in range(iters):
        gemm()
    g1.record()
    count = 0
    with torch.cuda.stream(side):
        s0.record(side)
        while not g1.query():
            work()
            count += 1
        s1.record(side)
    sync(device)
    return g0.elapsed_time(g1), s0.elapsed_time(s1), count


def run_interference(
    sizes: Sizes, device: torch.device, impl: str, guard: Guard, results: list[dict[str, Any]]
) -> None:
    group = sizes.side_shard * sizes.side_world
    print(
        f"\n## GEMM slowdown with the codec on a side stream (codec work of one P={sizes.side_world}"
        f" all-gather of a {group:,}-element bf16 group, p = 1%)\n"
    )
    print(
        "| GEMM (m×k×n, bf16) | GEMMs | GEMM ms alone | GEMM ms with codec | slowdown | "
        "codec ms/all-gather alone | codec ms/all-gather contended | codec runs |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    work = codec_allgather_work(sizes, device, impl)
    work()
    codec_alone = elapsed_ms(work, 5, device) / 5
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for m, k, n in sizes.gemms:
        if not guard.ok(f"interference {m}x{k}x{n}", 15):
            continue
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        c = torch.empty(m, n, device=device, dtype=dtype)

        def gemm(a: torch.Tensor = a, b: torch.Tensor = b, c: torch.Tensor = c) -> None:
            torch.mm(a, b, out=c)

        gemm()
        one = elapsed_ms(gemm, 3, device) / 3
        iters = max(int(sizes.gemm_seconds * 1e3 / max(one, 1e-3)), 3)
        alone = elapsed_ms(gemm, iters, device)
        row: dict[str, Any] = {
            "section": "interference",
            "gemm": [m, k, n],
            "gemm_dtype": str(dtype).removeprefix("torch."),
            "gemms": iters,
            "gemm_ms_alone": alone,
            "codec_ms_per_allgather_alone": codec_alone,
            "codec_shard_numel": sizes.side_shard,
            "codec_world": sizes.side_world,
        }
        if device.type == "cuda":
            with_codec, side_ms, runs = contended(gemm, iters, work, device)
            row.update(
                gemm_ms_with_codec=with_codec,
                slowdown=with_codec / alone - 1,
                codec_ms_per_allgather_contended=side_ms / max(runs, 1),
                codec_runs=runs,
            )
            print(
                f"| {m}×{k}×{n} | {iters} | {alone:,.1f} | {with_codec:,.1f} | "
                f"{with_codec / alone - 1:+.1%} | {codec_alone:.3f} | "
                f"{side_ms / max(runs, 1):.3f} | {runs} |"
            )
        else:
            print(
                f"| {m}×{k}×{n} | {iters} | {alone:,.1f} | n/a (no streams on CPU) | n/a | "
                f"{codec_alone:.3f} | n/a | 0 |"
            )
        results.append(row)
        del a, b, c


# ----------------------------------------------------------------------------------------------
# Section 4: one-rank all-gather and FSDP2 install
# ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_one_rank(device: torch.device) -> None:
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        **kwargs,
    )


def run_one_rank(
    sizes: Sizes, device: torch.device, impl: str, guard: Guard, results: list[dict[str, Any]]
) -> None:
    backend = dist.get_backend()
    group = dist.group.WORLD
    print(
        f"\n## One-rank all-gather ({backend}): AdERAAllGather(mode='always') called directly, "
        "alternating two versions of a shard\n"
    )
    print(
        "| dtype | N | change rate | raw ms | AdERA ms | AdERA ÷ raw | bytes ratio | reuse rate | "
        "spill gathers | exact | shadow ok |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | :---: |")
    for name, dtype in DTYPES.items():
        for numel in sizes.gather_numels:
            if not guard.ok(f"one-rank {name} N={numel}", 10):
                continue
            gen = torch.Generator(device=device).manual_seed(7)
            master = 0.02 * torch.randn(numel, device=device, generator=gen)
            noise = torch.randn(numel, device=device, generator=gen)
            versions = [master.to(dtype), (master * (1 + 0.01 * noise)).to(dtype)]
            del master, noise
            p = (extract_exponents(versions[0]) != extract_exponents(versions[1])).float().mean()
            comm = AdERAAllGather(mode="always", min_numel=0, impl=impl, name=f"{name}-{numel}")
            out = comm.allocate((numel,), dtype=dtype, device=device)
            comm(out, versions[1], group)  # first gather: raw, builds the cache
            ok = True
            for v in (versions[0], versions[1], versions[0]):
                comm(out, v, group)
                ok = ok and torch.equal(int_view(out), int_view(v))
            comm.stats.reset()
            turn = [0]

            def adera(
                comm: AdERAAllGather = comm,
                out: torch.Tensor = out,
                versions: list[torch.Tensor] = versions,
                turn: list[int] = turn,
            ) -> None:
                turn[0] ^= 1
                comm(out, versions[turn[0]], group)

            def raw(out: torch.Tensor = out, x: torch.Tensor = versions[0]) -> None:
                _all_gather(out, x, group=group)

            raw_ms = median_ms(raw, device, rep_ms=50)
            adera_ms = median_ms(adera, device, rep_ms=50)
            stats = comm.stats
            shadow = AdERAAllGather(mode="always", min_numel=0, impl=impl, shadow=True)
            shadow_ok = True
            try:
                for v in (versions[0], versions[1]):
                    shadow(out, v, group)
            except RuntimeError:
                shadow_ok = False
            print(
                f"| {name} | {numel:,} | {p.item():.2%} | {raw_ms:.4f} | {adera_ms:.4f} | "
                f"{adera_ms / raw_ms:.1f}× | {stats.compressed_bytes_ratio:.4f} | "
                f"{stats.reuse_rate:.4f} | {stats.spill_gathers} | {'yes' if ok else 'NO'} | "
                f"{'yes' if shadow_ok else 'NO'} |"
            )
            results.append(
                {
                    "section": "one_rank_allgather",
                    "backend": backend,
                    "dtype": name,
                    "numel": numel,
                    "impl": impl,
                    "change_rate": p.item(),
                    "raw_ms": raw_ms,
                    "adera_ms": adera_ms,
                    "ratio_adera_vs_raw": adera_ms / raw_ms,
                    "stats": stats.as_dict(),
                    "ok": bool(ok and shadow_ok),
                }
            )
            del versions, out, comm, shadow, adera, raw
            if device.type == "cuda":
                torch.cuda.empty_cache()


def run_fsdp_install(
    sizes: Sizes, device: torch.device, impl: str, results: list[dict[str, Any]]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    width = sizes.mlp_width
    model = nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
    ).to(device)
    mesh = init_device_mesh(device.type, (1,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comms = install_adera_all_gather(model, mode="always", min_numel=0, impl=impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, width, device=device)
    losses = []
    for _ in range(3):
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    gathers = sum(c.stats.gathers for c in comms.values())
    finite = all(math.isfinite(v) for v in losses)
    print(
        f"\nFSDP2 on the 1-rank mesh: AdERA installed on {len(comms)} FSDP modules, 3 AdamW steps "
        f"ran (losses {', '.join(f'{v:.4g}' for v in losses)}); gathers routed to AdERA: "
        f"{gathers} (FSDP2 does not all-gather at world size 1)."
    )
    results.append(
        {
            "section": "fsdp_one_rank",
            "fsdp_modules": len(comms),
            "steps": 3,
            "losses": losses,
            "adera_gathers": gathers,
            "ok": bool(finite),
        }
    )


def run_distributed(
    sizes: Sizes, device: torch.device, impl: str, guard: Guard, results: list[dict[str, Any]]
) -> None:
    init_one_rank(device)
    try:
        run_one_rank(sizes, device, impl, guard, results)
        if guard.ok("fsdp one-rank install", 10):
            run_fsdp_install(sizes, device, impl, results)
    finally:
        dist.destroy_process_group()


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
    impl = "triton" if device.type == "cuda" else "torch"
    sizes = QUICK if args.quick else FULL
    print(f"# AdERA GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(
        f"device: {device_name}; torch {torch.__version__}; "
        f"triton {triton.__version__ if triton else 'absent'}; codec impl {impl}"
    )
    results: list[dict[str, Any]] = []
    sections: list[tuple[str, Callable[[], None], float]] = [
        ("checks", lambda: run_all_checks(sizes, device, impl, guard, results), 30),
        ("throughput", lambda: run_throughput(sizes, device, impl, guard, results), 30),
        (
            "delta-throughput",
            lambda: run_delta_throughput(sizes, device, impl, guard, results),
            30,
        ),
        ("interference", lambda: run_interference(sizes, device, impl, guard, results), 30),
        ("one-rank", lambda: run_distributed(sizes, device, impl, guard, results), 20),
    ]
    errors = run_sections(sections, guard, args.only)
    elapsed = guard.elapsed()
    failed = [r.get("check", r["section"]) for r in results if r.get("ok") is False]
    if failed:
        print(f"\nchecks not exact: {', '.join(failed)}")
    print(f"\nelapsed: {elapsed:.1f} s")
    write_json(
        SLUG,
        {
            "device": device_name,
            "torch": torch.__version__,
            "triton": triton.__version__ if triton else None,
            "quick": args.quick,
            "impl": impl,
            "elapsed_s": elapsed,
            "skipped": guard.skipped,
            "errors": errors,
            "results": results,
        },
    )
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
