"""Reliability layer on one GPU: a larger random-init LM as the channel, sampling throughput.

What it measures (issue 25):

a. **Batched sampling**: one :class:`~ada_modules.reliability.lm_channel.CausalLMChannel` call
   of ``n`` samples (one ``generate`` of ``n`` rows) for n = 1 .. 64: wall time per call, samples/s
   and generated tokens/s. Diversity combining draws its ``K`` samples in one such call.
b. **Per operator**: every operator of :mod:`ada_modules.reliability.operators` on the same
   items: mean wall time per item, samples per item, tokens per item, tokens/s. Sequential
   operators (rateless sampling one sample per call, HARQ one per round) cannot batch their
   samples: this shows what adaptive stopping costs in latency for the samples it saves.

The model is a randomly initialised Llama (``--layers`` x ``--width``, bf16) over the character
vocabulary of :class:`~ada_modules.data.CharTokenizer`: its answers are noise, so the verifier
accepts with a fixed probability (0.3) to make the sequential operators stop at a realistic rate,
and every sample runs to ``--max-new-tokens`` unless it draws the end token. Timings are
CUDA-synchronised wall times: the median over ``--items`` items, after one warm-up call
(which compiles nothing: the first operator's first item still includes the allocator's warm-up).

Run it (one H200, about 2 minutes; guarded to ``--budget-s``)::

    OUT=/tmp/bench python bench/gpu/reliability.py

Smoke test on CPU (what ``tests/test_bench_scripts.py`` runs)::

    python bench/gpu/reliability.py --device cpu --quick

Prints markdown tables; writes ``$OUT/reliability.json`` when ``OUT`` is set.
"""

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from _common import Guard, add_only_argument, bench_device, run_sections, sync, write_json

from ada_modules.data import CharTokenizer
from ada_modules.models.causal_lm import build_causal_lm
from ada_modules.reliability import (
    DiversityCombining,
    HybridRetransmission,
    RatelessSampling,
    RedundantVerification,
    SimulatedVerifier,
)
from ada_modules.reliability.lm_channel import CausalLMChannel

SLUG = "reliability"


def build_channel(args: argparse.Namespace, device: torch.device) -> CausalLMChannel:
    """A random-init Llama on ``device`` as a channel over ``args.items`` addition prompts."""
    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    model = build_causal_lm(
        tokenizer,
        hidden_size=args.width,
        num_layers=args.layers,
        num_heads=max(1, args.width // 64),
        num_kv_heads=max(1, args.width // 256),
        intermediate_size=4 * args.width,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype)
    prompts = [f"{17 * i % 1000}+{31 * i % 1000}=" for i in range(args.items + 1)]
    return CausalLMChannel(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens)


def timed(fn: Any, device: torch.device) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def run_batched(channel: CausalLMChannel, args, device, guard: Guard, results: list) -> None:
    print("\n## a. One channel call of n samples (one generate of n rows)\n")
    print("| n | ms per call | samples/s | tokens/s | tokens per sample |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(0)
    channel.sample(0, 1, generator=g)  # warm-up
    for n in args.batch_sizes:
        if not guard.ok(f"n={n}", 5):
            break
        times, tokens = [], []
        for item in range(1, min(args.items, 8) + 1):
            seconds, samples = timed(lambda i=item, n=n: channel.sample(i, n, generator=g), device)
            times.append(seconds)
            tokens.append(samples.cost)
        t = statistics.median(times)
        row = {
            "n": n,
            "ms": 1e3 * t,
            "samples_per_s": n / t,
            "tokens_per_s": sum(tokens) / sum(times),
        }
        results.append({"section": "batched", **row})
        print(
            f"| {n} | {row['ms']:.1f} | {row['samples_per_s']:.1f} | {row['tokens_per_s']:.0f} | "
            f"{statistics.mean(tokens) / n:.1f} |"
        )


def run_operators(channel: CausalLMChannel, args, device, guard: Guard, results: list) -> None:
    print(f"\n## b. Operators on {args.items} items (verifier accepts with 0.3, costs nothing)\n")
    print("| operator | ms per item | samples per item | tokens per item | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    verifier = SimulatedVerifier(tpr=0.3, fpr=0.3)
    operators = {
        "single": DiversityCombining(1),
        "vote5 (one call)": DiversityCombining(5),
        "vote9 (one call)": DiversityCombining(9),
        "best_of_5 (one call)": DiversityCombining(5, rule="best_of_n", verifier=verifier),
        "rateless9 (one per call)": RatelessSampling(max_samples=9),
        "rateless9 (batches of 3)": RatelessSampling(max_samples=9, batch=3),
        "harq4 (one per round)": HybridRetransmission(max_rounds=4, verifier=verifier),
        "verify4 (2 of 3 checks)": RedundantVerification(4, [verifier] * 3, min_pass=2),
    }
    g = torch.Generator().manual_seed(1)
    for name, operator in operators.items():
        if not guard.ok(name, 10):
            break
        times, samples, tokens = [], [], []
        for item in range(1, args.items + 1):
            seconds, outcome = timed(
                lambda i=item, op=operator: op(channel, i, truth="", generator=g), device
            )
            times.append(seconds)
            samples.append(outcome.samples)
            tokens.append(outcome.cost)
        row = {
            "operator": name,
            "ms_per_item": 1e3 * statistics.median(times),
            "samples_per_item": statistics.mean(samples),
            "tokens_per_item": statistics.mean(tokens),
            "tokens_per_s": sum(tokens) / sum(times),
        }
        results.append({"section": "operators", **row})
        print(
            f"| {name} | {row['ms_per_item']:.1f} | {row['samples_per_item']:.2f} | "
            f"{row['tokens_per_item']:.1f} | {row['tokens_per_s']:.0f} |"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny model and few items")
    parser.add_argument("--budget-s", type=float, default=300.0, help="overall time budget")
    add_only_argument(parser)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    args.batch_sizes = [1, 2, 4, 8, 16, 32, 64]
    if args.quick:
        args.layers, args.width, args.items, args.max_new_tokens = 1, 64, 3, 8
        args.batch_sizes = [1, 4]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guard = Guard(budget_s=args.budget_s)
    resolved = bench_device(args.device)
    if resolved is None:
        return 1
    device, device_name = resolved
    print(f"# Reliability layer GPU benchmark ({'quick' if args.quick else 'full'})\n")
    print(
        f"device: {device_name}; torch {torch.__version__}; random-init Llama {args.layers} x "
        f"{args.width}; max_new_tokens {args.max_new_tokens}"
    )
    channel = build_channel(args, device)
    results: list[dict[str, Any]] = []
    sections = [
        ("batched", lambda: run_batched(channel, args, device, guard, results), 10),
        ("operators", lambda: run_operators(channel, args, device, guard, results), 10),
    ]
    errors = run_sections(sections, guard, args.only)
    print(f"\nelapsed: {guard.elapsed():.1f} s")
    write_json(
        SLUG,
        {
            "device": device_name,
            "torch": torch.__version__,
            "model": {"layers": args.layers, "width": args.width},
            "max_new_tokens": args.max_new_tokens,
            "skipped": guard.skipped,
            "errors": errors,
            "results": results,
        },
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
