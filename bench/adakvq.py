"""KV-cache bytes per token and flush cost of the KIVI cache against FP16 and re-quantize-everything.

What is compared (issue 3, part 7), all on CPU in one run, for the KV geometry of Llama-3.1-8B
(32 layers, 8 key/value heads, head dim 128, fp16 states, batch 1):

1. **Bytes per token** of the cache after ``T`` tokens, measured from the tensors a
   :class:`~ada_modules.kv.quantized_layer.QuantizedKVLayer` really holds (packed int32 codes +
   fp16 scales + fp16 zero points + the fp16 residual window), times 32 layers, against an FP16
   cache (``2 · 8 · 128 · 2`` bytes per token per layer). Arms: FP16, KIVI-2, KIVI-3, KIVI-4 and
   KIVI-8 (keys and values at the same bits; group 32, residual window 32 unless ``--group`` /
   ``--residual`` say otherwise). The ratio column is arm / FP16. With ``T = 2000`` and
   ``R = 32``, the last ``T mod R = 16`` tokens sit in the fp16 window and are counted.
2. **Flush cost**: the time spent quantizing while ``T`` tokens stream into one layer, ``R`` at a
   time (each append triggers exactly one flush, as token-by-token decoding does once every ``R``
   steps). Ours quantizes only the block that leaves the window. The baseline, **"re-quantize
   everything (ours, HF-style)"**, is our own re-implementation of the algorithm of transformers'
   ``QuantizedLayer`` (used by ``QuantizedCache``): at every flush it dequantizes the whole
   history, appends the window and quantizes all of it again — with *our* quantizer, grouping and
   packing, so that only the algorithm differs. transformers' own ``QuantizedCache`` is not timed:
   its backends need ``optimum-quanto`` or ``hqq``, which are not installed here. Columns: total
   flush milliseconds, the ratio baseline / ours, and the relative error ``‖K − K̂‖ / ‖K‖`` of the
   keys held at the end. With KIVI's grouping aligned to the flushed blocks, re-quantizing a
   dequantized group reproduces its codes, so the two errors come out equal: the price of
   re-quantizing everything here is time (O(T) per flush), not accuracy (HF's default grouping
   along the head dim is another matter, not measured here).

Timing: ``time.perf_counter`` around each flush, torch reference kernels (``impl="torch"``) on one
thread; absolute times on a shared CPU mean little, the ratios in one run do. Keys are drawn with
per-channel offsets and a slow drift (``N(0,1) + 4·sin(channel) + 0.002·t``) so that per-channel
ranges differ between blocks, as post-RoPE keys do.

3. **Memory table** (computed, not measured; instant): bytes per token and the ratio to FP16 of
   the packed layout at ``--memory-tokens`` tokens (2048) for average code bits 2 / 2.5 / 3 / 4 ×
   group sizes 32 / 64 / 128, without a residual window and with a full window of ``R = G`` and of
   ``R = 128`` tokens, from :func:`ada_modules.kv.kv_memory` (which equals the bytes a
   :class:`~ada_modules.kv.KIVICache` / :class:`~ada_modules.kv.AdaKVQCache` holds, tested in
   ``tests/kv/test_memory.py``). ``--memory`` prints only this table; ``--scale-dtype float32``
   costs 32-bit scales and zero points. This is the table of the "Memory" section of
   ``docs/techniques/adakvq.md``.
4. With ``--profiles SWEEP [SWEEP ...]`` instead: the AAD profiles and bit allocations of AdaKVQ
   sweeps (``cli_configs/adakvq/repro.yaml``, ``repro_arith.yaml``, ``repro_walk.yaml``), which
   write each seed's profile to ``<sweep>/shared_fit/[<fit>/]seed_<s>/aad/aad_profile.json``:
   per layer the normalised AAD and its fluctuation over positions (mean ± std over seeds) and
   the per-head range; per seed the widths ``allocate_bits`` gives under ``--budget`` for the
   AdaKVQ (``dp``), ``reverse`` and ``random`` arms; and ``aad_layers.png`` (per-layer AAD of
   each sweep) in ``--out``.

Run it::

    .venv/bin/python bench/adakvq.py            # T = 2000, ~40 s on 2 cores
    .venv/bin/python bench/adakvq.py --quick    # T = 500, ~10 s
    .venv/bin/python bench/adakvq.py --memory   # only the memory table (docs), ~10 s of imports
    .venv/bin/python bench/adakvq.py --profiles sweeps/adakvq sweeps/adakvq_arith \\
        --out docs/techniques/img/adakvq

Prints markdown tables and writes ``adakvq.json`` to ``--out``. Reports only; no assertion.
"""

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from ada_modules.kernels.kv_quant import QuantizedKV, quantize_keys, quantize_values
from ada_modules.kv import AADProfile, allocate_bits, kv_memory
from ada_modules.kv.quantized_layer import QuantizedKVLayer

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
HEAD_DIM_TINY = 16  # the head dim of the repro sweeps' tiny models (value groups of 16)
ARMS: list[tuple[str, int | None]] = [
    ("FP16", None),
    ("KIVI-2", 2),
    ("KIVI-3", 3),
    ("KIVI-4", 4),
    ("KIVI-8", 8),
]


class TimedLayer(QuantizedKVLayer):
    """Our layer, with the time spent in each flush recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flush_s: list[float] = []

    def _flush(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        start = time.perf_counter()
        super()._flush(keys, values)
        self.flush_s.append(time.perf_counter() - start)


class RequantizeEverythingLayer(TimedLayer):
    """Baseline: at each flush, dequantize all history, append the window, quantize it all again.

    The algorithm of transformers' ``QuantizedLayer.update`` (which quantizes
    ``cat(dequantized history, residual, new)`` whenever the window fills), with our quantizer.
    """

    def _flush(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        start = time.perf_counter()
        if self.segments:
            hist_k, hist_v = self.dequantized_history()
            keys = torch.cat([hist_k, keys], dim=-2)
            values = torch.cat([hist_v, values], dim=-2)
        self.segments = [
            QuantizedKV(
                quantize_keys(keys, self.key_bits, self.key_group_size, impl=self.impl),
                quantize_values(values, self.value_bits, self.value_group_size, impl=self.impl),
            )
        ]
        self.block_bits = [(self.key_bits, self.value_bits)] * (
            keys.shape[-2] // self.residual_length
        )
        self.flush_s.append(time.perf_counter() - start)


def make_states(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 keys (channel offsets + drift) and values ``(1, KV_HEADS, tokens, HEAD_DIM)``."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(tokens, dtype=torch.float32)[:, None]
    channel = torch.arange(HEAD_DIM, dtype=torch.float32)[None, :]
    keys = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen)
    keys = keys + 4 * torch.sin(channel) + 0.002 * t
    values = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen)
    return keys.half(), values.half()


def stream(layer: QuantizedKVLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Append the states ``residual_length`` tokens at a time."""
    step = layer.residual_length
    for start in range(0, keys.shape[-2], step):
        layer.update(keys[..., start : start + step, :], values[..., start : start + step, :])


def held_keys(layer: QuantizedKVLayer) -> torch.Tensor:
    """All keys the layer holds, dequantized, in token order."""
    hist_k, _ = layer.dequantized_history()
    return torch.cat([hist_k, layer.keys], dim=-2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def profiles(sweep: Path) -> dict[int, AADProfile]:
    """The AAD profile of each seed's shared fit (or of the named fit that writes one), by seed."""
    found = {}
    paths = [*sweep.glob("shared_fit/seed_*/aad/aad_profile.json")]
    paths += sweep.glob("shared_fit/*/seed_*/aad/aad_profile.json")
    for path in sorted(paths):
        seed = int(re.search(r"seed_(\d+)", str(path)).group(1))
        found[seed] = AADProfile.from_json(path)
    if not found:
        raise SystemExit(f"no shared_fit/[<fit>/]seed_*/aad/aad_profile.json under {sweep}")
    return found


def mean_std(values: torch.Tensor) -> str:
    """``mean ± std`` over the first axis (population std over 1 value is 0)."""
    return f"{values.mean():.3f} ± {values.std(unbiased=False):.3f}"


def report(sweep: Path, budget: float, group_size: int) -> torch.Tensor:
    """Print the tables of one sweep; return its per-layer nAAD, ``(seeds, layers)``."""
    by_seed = profiles(sweep)
    means = torch.stack([p.layer_mean() for p in by_seed.values()])
    stds = torch.stack([p.layer_std() for p in by_seed.values()])
    heads = torch.stack([p.head_mean() for p in by_seed.values()])  # (seeds, layers, heads)
    print(f"\n## {sweep}: AAD per layer over seeds {sorted(by_seed)}\n")
    print("| layer | nAAD (mean over heads, positions) | std over positions | head range |")
    print("| ---: | --- | --- | --- |")
    for layer in range(means.shape[1]):
        low, high = heads[:, layer].min().item(), heads[:, layer].max().item()
        print(
            f"| {layer} | {mean_std(means[:, layer])} | {mean_std(stds[:, layer])} | "
            f"{low:.2f} … {high:.2f} |"
        )
    print(f"\n### Widths (keys / values per layer) at budget {budget} bits per element\n")
    print("| seed | nAAD per layer | AdaKVQ (dp) | reverse | random |")
    print("| ---: | --- | --- | --- | --- |")
    for seed, profile in by_seed.items():
        cells = []
        for method in ("dp", "reverse", "random"):
            allocation = allocate_bits(
                profile,
                budget,
                method=method,
                group_size=group_size,
                head_dim=HEAD_DIM_TINY,
                seed=seed,
            )
            cells.append(f"K {allocation.key_bits} / V {allocation.value_bits}")
        naad = ", ".join(f"{v:.3f}" for v in profile.layer_mean().tolist())
        print(f"| {seed} | {naad} | {' | '.join(cells)} |")
    return means


def plot_profiles(sweeps: list[Path], budget: float, group_size: int, out: Path) -> None:
    """Print the AAD/allocation tables of each sweep and plot their per-layer AAD."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for sweep in sweeps:
        means = report(sweep, budget, group_size)
        layers = list(range(means.shape[1]))
        ax.errorbar(
            layers,
            means.mean(0),
            yerr=means.std(0, unbiased=False),
            marker="o",
            capsize=3,
            label=f"{sweep.name} ({means.shape[0]} seeds)",
        )
        ax.set_xticks(layers)
    ax.axhline(0.5, color="grey", linestyle=":", label="uniform attention")
    ax.set(xlabel="layer", ylabel="normalised AAD", title="AAD per layer (mean ± std over seeds)")
    ax.legend(fontsize=8)
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / "aad_layers.png", dpi=120)
    print(f"\nwrote {out / 'aad_layers.png'}")


MEMORY_BITS = (2, 2.5, 3, 4)
MEMORY_GROUPS = (32, 64, 128)


def memory_table(tokens: int, scale_dtype: torch.dtype) -> list[dict[str, Any]]:
    """Print the memory table (code bits × G × window) at ``tokens`` tokens; return its rows."""
    fp16 = kv_memory(2, seq_len=tokens).fp16_bytes_per_token
    scale = str(scale_dtype).removeprefix("torch.")
    print(f"\n## Memory at T = {tokens:,} tokens: bytes / token (ratio to FP16)\n")
    print(
        f"Llama-3.1-8B KV shapes (32 layers, 8 KV heads, head dim 128: FP16 = {fp16:,} bytes / "
        f"token); keys and values at the same average code bits and group size G; {scale} scale "
        "and zero point per group; residual window in fp16, counted full (R tokens).\n"
    )
    print(
        "| code bits | G | stored bits / element (packed) | no window | window R = G | "
        "window R = 128 |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for bits in MEMORY_BITS:
        for group in MEMORY_GROUPS:
            cells = []
            row: dict[str, Any] = {"section": "memory", "bits": bits, "group": group}
            for name, residual in (("none", 0), ("r_eq_g", group), ("r_128", 128)):
                memory = kv_memory(
                    bits,
                    group_size=group,
                    residual_length=residual,
                    seq_len=tokens,
                    scale_dtype=scale_dtype,
                    residual_dtype=torch.float16,
                )
                cells.append(f"{memory.bytes_per_token:,.0f} ({memory.ratio:.4f})")
                row[f"bytes_per_token_{name}"] = memory.bytes_per_token
                row[f"ratio_{name}"] = memory.ratio
                row["packed_bits_per_element"] = memory.packed_bits_per_element
            print(
                f"| {bits:g} | {group} | {row['packed_bits_per_element']:.3f} | "
                f"{' | '.join(cells)} |"
            )
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = 500 tokens")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per cache (T)")
    parser.add_argument("--group", type=int, default=32, help="key/value group size (G)")
    parser.add_argument("--residual", type=int, default=32, help="residual window (R)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_out/adakvq"))
    parser.add_argument(
        "--profiles",
        type=Path,
        nargs="+",
        help="instead: AAD/allocation tables and figure of these AdaKVQ sweep folders",
    )
    parser.add_argument("--budget", type=float, default=4.5, help="with --profiles: stored bits")
    parser.add_argument("--memory", action="store_true", help="only the memory table (computed)")
    parser.add_argument("--memory-tokens", type=int, default=2048, help="T of the memory table")
    parser.add_argument(
        "--scale-dtype",
        choices=("float16", "bfloat16", "float32"),
        default="float16",
        help="dtype of scales and zero points in the memory table",
    )
    args = parser.parse_args()
    if args.profiles:
        plot_profiles(args.profiles, args.budget, 16, args.out)
        return
    memory_rows = memory_table(args.memory_tokens, getattr(torch, args.scale_dtype))
    if args.memory:
        return
    torch.set_num_threads(1)
    tokens = args.tokens or (500 if args.quick else 2000)
    wall = time.perf_counter()
    keys, values = make_states(tokens, args.seed)
    fp16_per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    results: list[dict[str, Any]] = list(memory_rows)

    print(f"\n## Bytes per token after T = {tokens} tokens (Llama-3.1-8B KV shapes, 32 layers)\n")
    print(f"G = {args.group}, R = {args.residual}; bytes = codes + fp16 scales/zeros + residual\n")
    print("| arm | bytes / token | ratio vs FP16 | bits / element (incl. metadata) |")
    print("| --- | ---: | ---: | ---: |")
    for name, bits in ARMS:
        if bits is None:
            per_token = float(fp16_per_token)
        else:
            layer = QuantizedKVLayer(bits, bits, args.group, args.group, args.residual, "torch")
            stream(layer, keys, values)
            per_token = LAYERS * layer.nbytes() / tokens
        ratio = per_token / fp16_per_token
        bits_el = 8 * per_token / (LAYERS * 2 * KV_HEADS * HEAD_DIM)
        print(f"| {name} | {per_token:,.0f} | {ratio:.4f} | {bits_el:.3f} |")
        results.append(
            {
                "section": "bytes",
                "arm": name,
                "bits": bits,
                "tokens": tokens,
                "bytes_per_token": per_token,
                "ratio_vs_fp16": ratio,
                "bits_per_element": bits_el,
            }
        )

    print(
        f"\n## Flush cost while {tokens} tokens stream into one layer ({args.residual} at a time)\n"
    )
    print(
        "| bits | ours: flush ms | re-quantize everything (ours, HF-style): flush ms | "
        "ratio baseline / ours | key rel. error ours | key rel. error baseline |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, bits in ARMS:
        if bits is None:
            continue
        ours = TimedLayer(bits, bits, args.group, args.group, args.residual, "torch")
        base = RequantizeEverythingLayer(bits, bits, args.group, args.group, args.residual, "torch")
        stream(ours, keys, values)
        stream(base, keys, values)
        ms_ours, ms_base = 1e3 * sum(ours.flush_s), 1e3 * sum(base.flush_s)
        err_ours, err_base = rel_err(held_keys(ours), keys), rel_err(held_keys(base), keys)
        assert ours.nbytes() == base.nbytes()  # same storage, only the algorithm differs
        print(
            f"| {bits} | {ms_ours:.1f} | {ms_base:.1f} | {ms_base / ms_ours:.1f}× | "
            f"{err_ours:.4f} | {err_base:.4f} |"
        )
        results.append(
            {
                "section": "flush",
                "arm": name,
                "bits": bits,
                "tokens": tokens,
                "flushes": len(ours.flush_s),
                "flush_ms_ours": ms_ours,
                "flush_ms_requantize_everything": ms_base,
                "ratio_baseline_over_ours": ms_base / ms_ours,
                "key_rel_err_ours": err_ours,
                "key_rel_err_requantize_everything": err_base,
            }
        )

    elapsed = time.perf_counter() - wall
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "tokens": tokens,
        "group": args.group,
        "residual": args.residual,
        "torch": torch.__version__,
        "results": results,
        "wall_s": elapsed,
    }
    (args.out / "adakvq.json").write_text(json.dumps(payload, indent=1))
    print(f"\nwall time {elapsed:.1f} s; wrote {args.out}/adakvq.json")


if __name__ == "__main__":
    main()
