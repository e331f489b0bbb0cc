"""AdERA's exponent codec on CPU: throughput and bytes, on synthetic and on real weight updates.

What is measured (issue 4, part 7), torch reference codec (``impl="torch"``) on one thread:

1. **Synthetic change rates.** A shard of ``N`` weights ``~ N(0, 0.02)`` (``N`` = 1M, 64K with
   ``--quick``) in bf16 and fp32, and a cache in which a fraction ``p`` in {0, 1%, 10%, 50%, 100%}
   of the exponents differ (positions drawn uniformly; the cached exponent has its lowest bit
   flipped, as a ±1 exponent step does). Columns: ``encode_into`` and ``decode_from`` MB/s of raw
   shard bytes (median of repeats, the three operations alternated), a plain ``clone`` of the raw
   shard as the baseline (encode time ÷ copy time), the exact encoded bytes ÷ raw bytes (header,
   per-chunk counts, sign+mantissa planes and the exception stream, capacity = stream) with the
   estimate of the chunk forms beside it (SAME at ``p = 0``: 0.5 / 0.75; BITMAP: ``0.5625 + p/2``
   for bf16, ``0.78125 + p/4`` for fp32, capped at 1 where RAW takes over), and whether the decode
   is bitwise exact.
2. **Chunk size.** Encoded bytes ÷ raw for bf16 at ``p`` in {0.1%, 1%, 10%} and chunks of 64 to
   4096 elements (bytes only: a bigger chunk has a cheaper count but a bitmap row of
   ``chunk / 8`` bytes as soon as one element changes).
3. **Real weight updates.** The tiny MoE of ``cli_configs/adera/moe.yaml`` (2 blocks, width 64,
   8 experts of hidden 128, top-2; 262 144 expert weights in two FSDP groups of 131 072, and 49 K
   other weights in three groups that AdERA never compresses at its default ``min_numel`` of
   65 536) is trained with AdamW (lr 1e-3, constant, weight decay 0.01, batch 32) on the 1–3 digit
   addition task for ``--steps`` steps (300; 25 with ``--quick``). After every optimizer step the expert
   weights are encoded against their exponents of the previous step, as fp32 (the master weights)
   and as their bf16 cast (what FSDP2 gathers under ``MixedPrecisionPolicy(param_dtype=bf16)``),
   one encode per FSDP group: the change rate ``p`` (changed exponents ÷ elements), the exact
   bytes ratio (capacity = stream: AdERA's all-gather adds its 1.25× capacity headroom on top,
   see the docs) and the codec MB/s on these data. Table: selected steps, then the mean ± std over
   the steps after ``--warmup`` (50).

Absolute MB/s on a shared 2-core box mean little (the torch reference is many small ops; the GPU
path is Triton, see ``bench/gpu/adera.py``); the bytes ratios are exact and load-independent.

Run it::

    .venv/bin/python bench/adera.py              # ~30-60 s
    .venv/bin/python bench/adera.py --quick      # < 30 s

Prints markdown tables and writes ``adera.json`` and ``adera_change_rate.png`` (per-step change
rate and bytes ratio of the expert weights) to ``--out``. Reports only; no assertion.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import torch
from torch import nn

from ada_modules.data import ArithmeticDataModule
from ada_modules.kernels.exponent_codec import (
    DEFAULT_CHUNK_SIZE,
    chunk_counts,
    decode_from,
    encode,
    encode_into,
    encoded_nbytes,
    extract_exponents,
    raw_nbytes,
    stream_nbytes,
)
from ada_modules.models import MoELMModule

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RATES = (0.0, 0.01, 0.1, 0.5, 1.0)
CHUNK_RATES = (0.001, 0.01, 0.1)
CHUNKS = (64, 256, 1024, 4096)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
IMPL = "torch"


def form_estimate(p: float, dtype: torch.dtype) -> float:
    """Bytes ratio of the planes plus the SAME (``p = 0``) or BITMAP form, without header/counts."""
    planes = 0.5 if dtype == torch.bfloat16 else 0.75
    if p == 0:
        return planes
    return min(planes + (1 / 16 + p / 2 if dtype == torch.bfloat16 else 1 / 32 + p / 4), 1.0)


def shard_and_cache(
    numel: int, dtype: torch.dtype, p: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``~ N(0, 0.02)`` and a cache whose exponents differ at ``round(p * numel)`` places."""
    x = (0.02 * torch.randn(numel, generator=gen)).to(dtype)
    cache = extract_exponents(x)
    changed = torch.randperm(numel, generator=gen)[: round(p * numel)]
    cache[changed] ^= 1
    return x, cache


def median_times(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, calls alternated (A, B, C, A, B, C, ...) after a warm-up."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def exact(y: torch.Tensor, x: torch.Tensor) -> bool:
    view = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
    return torch.equal(y.view(view), x.view(view))


# ----------------------------------------------------------------------------------------------
# Section 1: synthetic change rates
# ----------------------------------------------------------------------------------------------


def run_synthetic(numel: int, repeats: int, results: dict[str, Any]) -> None:
    print(f"\n## Codec on synthetic change rates (N = {numel:,} elements, torch reference)\n")
    print(
        "| dtype | p | encode MB/s | decode MB/s | copy MB/s | encode ÷ copy time | "
        "encoded ÷ raw | form estimate | exact |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        for p in RATES:
            x, cache = shard_and_cache(numel, dtype, p, gen)
            stream = stream_nbytes(chunk_counts(x, cache), numel)
            buffer, spill = encode_into(x, cache, stream, impl=IMPL)
            y, new_cache = decode_from(buffer, cache, numel, dtype, spill=spill, impl=IMPL)
            ok = exact(y, x) and torch.equal(new_cache, extract_exponents(x))
            times = median_times(
                {
                    "copy": lambda x=x: x.clone(),
                    "encode": lambda x=x, c=cache, s=stream: encode_into(x, c, s, impl=IMPL),
                    "decode": lambda b=buffer, c=cache, d=dtype, s=spill: decode_from(
                        b, c, numel, d, spill=s, impl=IMPL
                    ),
                },
                repeats,
            )
            raw = raw_nbytes(numel, dtype)
            ratio = buffer.numel() / raw
            mbps = {k: raw / t / 1e6 for k, t in times.items()}
            print(
                f"| {name} | {p:.0%} | {mbps['encode']:,.0f} | {mbps['decode']:,.0f} | "
                f"{mbps['copy']:,.0f} | {times['encode'] / times['copy']:,.0f}× | {ratio:.4f} | "
                f"{form_estimate(p, dtype):.4f} | {'yes' if ok else 'NO'} |"
            )
            rows.append(
                {
                    "dtype": name,
                    "numel": numel,
                    "change_rate": p,
                    "encode_MBps": mbps["encode"],
                    "decode_MBps": mbps["decode"],
                    "copy_MBps": mbps["copy"],
                    "encode_s": times["encode"],
                    "decode_s": times["decode"],
                    "copy_s": times["copy"],
                    "encoded_bytes": buffer.numel(),
                    "raw_bytes": raw,
                    "bytes_ratio": ratio,
                    "form_estimate": form_estimate(p, dtype),
                    "exact": ok,
                }
            )
    results["synthetic"] = rows


def run_chunks(numel: int, results: dict[str, Any]) -> None:
    print(f"\n## Encoded ÷ raw bytes by chunk size (bf16, N = {numel:,})\n")
    print("| p | " + " | ".join(f"chunk {c}" for c in CHUNKS) + " |")
    print("| ---: | " + " | ".join("---:" for _ in CHUNKS) + " |")
    rows = []
    gen = torch.Generator().manual_seed(1)
    raw = raw_nbytes(numel, torch.bfloat16)
    for p in CHUNK_RATES:
        x, cache = shard_and_cache(numel, torch.bfloat16, p, gen)
        ratios = []
        for chunk in CHUNKS:
            stream = stream_nbytes(chunk_counts(x, cache, chunk), numel, chunk)
            ratio = encoded_nbytes(numel, torch.bfloat16, stream, chunk) / raw
            ratios.append(ratio)
            rows.append({"change_rate": p, "chunk_size": chunk, "bytes_ratio": ratio})
        print(f"| {p:.1%} | " + " | ".join(f"{r:.4f}" for r in ratios) + " |")
    results["chunk_size"] = rows


# ----------------------------------------------------------------------------------------------
# Section 3: real weight updates (the tiny MoE)
# ----------------------------------------------------------------------------------------------


def fsdp_groups(model: nn.Module) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]]]:
    """The parameters of the FSDP groups ``MoELMModule.configure_model`` makes: experts, others."""
    experts, others = [], []
    seen: set[int] = set()
    for block in model.blocks:
        group = list(block.moe.experts.parameters())
        experts.append(group)
        seen.update(id(q) for q in group)
        others.append([q for q in block.parameters() if id(q) not in seen])
        seen.update(id(q) for q in others[-1])
    others.append([q for q in model.parameters() if id(q) not in seen])
    return experts, others


def flat(group: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1) for q in group])


def run_training(steps: int, warmup: int, results: dict[str, Any]) -> None:
    torch.manual_seed(0)
    module = MoELMModule(
        d_model=64, num_layers=2, num_heads=4, d_ff=128, num_experts=8, top_k=2, max_seq_len=64
    )
    model = module.model
    batch_size = 32
    data = ArithmeticDataModule(
        min_digits=1,
        max_digits=3,
        seed=0,
        num_train=steps * batch_size,
        num_val=8,
        num_test=8,
        batch_size=batch_size,
    )
    data.setup("fit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    experts, others = fsdp_groups(model)
    n_experts = sum(q.numel() for g in experts for q in g)
    n_others = sum(q.numel() for g in others for q in g)
    print(
        f"\n## Real weight updates: tiny MoE, AdamW lr 1e-3, {steps} steps "
        f"({n_experts:,} expert weights in {len(experts)} groups, {n_others:,} others)\n"
    )

    def caches(groups: list[list[nn.Parameter]], dtype: torch.dtype) -> list[torch.Tensor]:
        return [extract_exponents(flat(g).to(dtype)) for g in groups]

    prev = {name: caches(experts, dtype) for name, dtype in DTYPES.items()}
    prev_others = caches(others, torch.float32)
    rows = []
    loader = iter(data.train_dataloader())
    for step in range(1, steps + 1):
        batch = next(loader)
        logits, aux = model(batch["input_ids"])
        logits = logits[:, :-1]
        labels = batch["labels"][:, 1:]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        (loss + 0.01 * aux).backward()
        optimizer.step()
        row: dict[str, Any] = {"step": step, "loss": loss.item()}
        for name, dtype in DTYPES.items():
            changed = sent = raw = 0
            enc_s = dec_s = 0.0
            for i, group in enumerate(experts):
                x = flat(group).to(dtype)
                cache = prev[name][i]
                start = time.perf_counter()
                payload = encode(x, cache, impl=IMPL)
                enc_s += time.perf_counter() - start
                start = time.perf_counter()
                y, new_cache = decode_from(payload, cache, x.numel(), dtype, impl=IMPL)
                dec_s += time.perf_counter() - start
                if not exact(y, x):
                    raise RuntimeError(f"decode not exact at step {step} ({name})")
                changed += int((new_cache != cache).sum())
                sent += payload.numel()
                raw += raw_nbytes(x.numel(), dtype)
                prev[name][i] = new_cache
            row[f"{name}_change_rate"] = changed / n_experts
            row[f"{name}_bytes_ratio"] = sent / raw
            row[f"{name}_encode_MBps"] = raw / enc_s / 1e6
            row[f"{name}_decode_MBps"] = raw / dec_s / 1e6
        new_others = caches(others, torch.float32)
        row["others_fp32_change_rate"] = (
            sum(int((a != b).sum()) for a, b in zip(new_others, prev_others, strict=True))
            / n_others
        )
        prev_others = new_others
        rows.append(row)

    shown = [s for s in (1, 2, 3, 5, 10, 20, 50, 100, 200, 300, 500, 1000) if s <= steps]
    if steps not in shown:
        shown.append(steps)
    print(
        "| step | loss | p experts fp32 | bytes ratio fp32 | p experts bf16 | "
        "bytes ratio bf16 | p other groups fp32 |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in shown:
        r = rows[s - 1]
        print(
            f"| {s} | {r['loss']:.3f} | {r['fp32_change_rate']:.2%} | "
            f"{r['fp32_bytes_ratio']:.4f} | {r['bf16_change_rate']:.2%} | "
            f"{r['bf16_bytes_ratio']:.4f} | {r['others_fp32_change_rate']:.2%} |"
        )
    late = rows[warmup:] if steps > warmup else rows[steps // 2 :]
    first = late[0]["step"]

    def mean_std(key: str, scale: float = 1.0, fmt: str = ".4f") -> str:
        values = [r[key] * scale for r in late]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):{fmt}} ± {std:{fmt}}"

    print(f"\nSteps {first}–{steps} (mean ± std over {len(late)} steps):\n")
    print("| dtype | change rate (%) | bytes ratio | encode MB/s | decode MB/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    summary = {}
    for name in DTYPES:
        print(
            f"| {name} | {mean_std(f'{name}_change_rate', 100, '.2f')} | "
            f"{mean_std(f'{name}_bytes_ratio')} | {mean_std(f'{name}_encode_MBps', fmt=',.0f')} | "
            f"{mean_std(f'{name}_decode_MBps', fmt=',.0f')} |"
        )
        summary[name] = {
            key: statistics.mean(r[f"{name}_{key}"] for r in late)
            for key in ("change_rate", "bytes_ratio", "encode_MBps", "decode_MBps")
        }
    results["training"] = {
        "model": "MoELMModule(d_model=64, num_layers=2, num_heads=4, d_ff=128, num_experts=8, "
        "top_k=2)",
        "optimizer": "AdamW(lr=1e-3, weight_decay=0.01)",
        "batch_size": batch_size,
        "expert_elements": n_experts,
        "other_elements": n_others,
        "chunk_size": DEFAULT_CHUNK_SIZE,
        "summary_from_step": first,
        "summary": summary,
        "steps": rows,
    }


def plot_training(rows: list[dict[str, Any]], path: Path) -> None:
    """Per-step change rate and bytes ratio of the expert groups."""
    steps = [r["step"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, style in (("fp32", "-"), ("bf16", "--")):
        left.plot(steps, [100 * r[f"{name}_change_rate"] for r in rows], style, label=name)
        right.plot(steps, [r[f"{name}_bytes_ratio"] for r in rows], style, label=name)
    left.set(xlabel="step", ylabel="exponents changed (%)", ylim=(0, None))
    left.set_title("expert weights: change rate per step", fontsize=10)
    right.set(xlabel="step", ylabel="encoded / raw bytes")
    right.set_title("expert weights: bytes ratio (exact stream)", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 64K, 25 training steps")
    parser.add_argument("--out", type=Path, default=Path("bench_out/adera"))
    parser.add_argument("--steps", type=int, default=None, help="training steps (300; quick 25)")
    parser.add_argument("--warmup", type=int, default=50, help="steps left out of the summary")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    numel = 1 << 16 if args.quick else 1 << 20
    steps = args.steps or (25 if args.quick else 300)
    print(
        f"# AdERA exponent codec, CPU ({torch.get_num_threads()} thread, torch {torch.__version__})"
    )
    results: dict[str, Any] = {"quick": args.quick, "threads": torch.get_num_threads()}
    run_synthetic(numel, 3 if args.quick else 7, results)
    run_chunks(numel, results)
    run_training(steps, args.warmup, results)
    elapsed = time.perf_counter() - start
    results["elapsed_s"] = elapsed
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "adera.json"
    path.write_text(json.dumps(results, indent=1))
    plot_training(results["training"]["steps"], args.out / "adera_change_rate.png")
    print(f"\nwall time {elapsed:.1f} s; wrote {path} and adera_change_rate.png")


if __name__ == "__main__":
    main()
