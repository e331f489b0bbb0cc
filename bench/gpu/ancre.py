"""GPU benchmark of ANCRe: a 24-layer GPT-like model, residual vs DenseFormer-like vs ANCRe.

What it measures (issues 6 and 27), in one run on one GPU:

0. **Check first** (no timing): the routed-sum kernels (forward and backward,
   :func:`~ada_modules.kernels.routed_sum`) against the float64 reference, in fp32 and bf16, with
   one coefficient per state and per channel; then the layouts give bitwise-equal logits at
   initialisation (same weights; ANCRe and DenseFormer start as the plain residual network).
0b. **Routed sums alone**: forward + backward of every routed sum of a 24-layer ``"source"`` stack
   (rows of 2..24 states of ``batch x tokens x hidden``), fused kernel vs term by term in torch.
1. **Training**: a 24-layer Llama-style decoder (hidden 512, 8 heads, MLP 1376, vocab 256,
   ~76 M parameters; built from a ``LlamaConfig``, the layers wrapped by
   :class:`~ada_modules.nn.ConnectivityWrapper`) trained from the same initial weights with AdamW
   (lr 1e-3, 100 warm-up steps, then constant; bf16 autocast) on a synthetic corpus: each
   sequence is 128 tokens of a random sparse first-order Markov chain (8 successors per token)
   followed by a verbatim copy of those 128 tokens (an induction task). Batch 32 × 256 tokens.
   Validation loss on 128 held-out sequences every ``--eval-every`` steps.
   ``source_torch_sums`` is ANCRe with its routed sums term by term in torch (``impl="torch"``):
   the step-time overhead without the fused kernel. ``source_deferred`` is ANCRe with the fused
   kernel and ``state_grads="deferred"`` (each state's gradient as one sum over the rows that read
   it).
2. **Columns**: parameters added by the layout (% of the model), median training-step time and
   tokens/s (overhead % against residual), peak memory, final validation loss, and the **time to
   target**: training seconds (evaluation excluded) and steps until the validation loss first
   reaches the residual run's final validation loss (the target is set by the baseline, after
   its run; ``>`` means not reached within the budget).

Each layout trains for ``--steps`` steps or ``--train-seconds`` seconds, whichever comes first (the
default budget, 60 s for each of the five layouts, is meant to keep the whole script under about 7
minutes on an H200; it has not run on one yet). Timing: CUDA-synchronised
``time.perf_counter`` per step; the median over the steps after a 20-step warm-up.

Run it (one H200)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/ancre.py

Smoke test on CPU (what ``tests/test_bench_scripts.py`` runs; a 4-layer, 32-wide model for a few
steps)::

    OUT=/tmp/bench .venv/bin/python bench/gpu/ancre.py --device cpu --quick

Prints markdown tables and the elapsed time; writes ``$OUT/ancre.json`` (``{"device", "torch",
"triton", "results": [...]}``, one record per layout) when ``OUT`` is set. Reports only; no
assertion on the numbers.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from _common import median_ms, write_json  # bench/gpu/_common.py
from transformers import LlamaConfig, LlamaForCausalLM

from ada_modules.kernels import interpreter_enabled, routed_sum
from ada_modules.nn import ConnectivityWrapper

SLUG = "ancre"
# layout name -> (ConnectivityWrapper mode, routed-sum impl, state_grads)
LAYOUTS = {
    "residual": ("residual", "auto", "autograd"),
    "denseformer": ("denseformer", "auto", "autograd"),
    "source": ("source", "auto", "autograd"),
    "source_torch_sums": ("source", "torch", "autograd"),
    "source_deferred": ("source", "auto", "deferred"),
}


def markov_corpus(
    num: int, half: int, vocab: int, generator: torch.Generator, device: str
) -> torch.Tensor:
    """``num`` sequences: ``half`` Markov-chain tokens, then the same tokens again."""
    successors = torch.randint(0, vocab, (vocab, 8), generator=generator)
    weights = torch.rand(vocab, 8, generator=generator) ** 2 + 0.05
    probs = torch.zeros(vocab, vocab).scatter_add_(1, successors, weights)
    probs = probs / probs.sum(dim=1, keepdim=True)
    tokens = torch.empty(num, half, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (num,), generator=generator)
    for t in range(1, half):
        tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=generator)[:, 0]
    return torch.cat([tokens, tokens], dim=1).to(device)


def build_model(args: argparse.Namespace, device: str) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=2 * args.half,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, val: torch.Tensor, device: str) -> float:
    model.eval()
    losses = []
    for batch in val.split(32):
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            losses.append(model(input_ids=batch, labels=batch).loss.float().item())
    model.train()
    return statistics.mean(losses)


def train(
    layout: str,
    base: LlamaForCausalLM,
    train_data: torch.Tensor,
    val: torch.Tensor,
    args: argparse.Namespace,
    device: str,
) -> dict:
    model = copy.deepcopy(base)
    mode, impl, state_grads = LAYOUTS[layout]
    ConnectivityWrapper(mode=mode, impl=impl, state_grads=state_grads)(model)
    extra = sum(p.numel() for n, p in model.named_parameters() if "connectivity" in n)
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    generator = torch.Generator().manual_seed(1)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    step_times: list[float] = []
    curve: list[tuple[int, float, float]] = []  # (step, train seconds, val loss)
    trained = 0.0
    step = 0
    while step < args.steps and trained < args.train_seconds:
        idx = torch.randint(0, train_data.shape[0], (args.batch,), generator=generator)
        batch = train_data[idx.to(train_data.device)]
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        warmup.step()
        _sync(device)
        elapsed = time.perf_counter() - start
        trained += elapsed
        step_times.append(elapsed)
        step += 1
        if step % args.eval_every == 0:
            curve.append((step, trained, evaluate(model, val, device)))
    if not curve or curve[-1][0] != step:
        curve.append((step, trained, evaluate(model, val, device)))
    timed = step_times[20:] or step_times
    step_s = statistics.median(timed)
    return {
        "layout": layout,
        "params_total": total,
        "params_extra": extra,
        "params_extra_pct": 100.0 * extra / (total - extra),
        "steps": step,
        "train_seconds": trained,
        "median_step_ms": 1000 * step_s,
        "tokens_per_s": args.batch * 2 * args.half / step_s,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None,
        "final_val_loss": curve[-1][2],
        "curve": curve,
    }


def check_routed_sum(device: str, tokens: int, hidden: int) -> list[str]:
    """The kernels and the term-by-term torch path against the float64 reference.

    Checks the output, the first state's gradient and the coefficient gradients, in fp32 and
    bf16, one coefficient per state and per channel. An error is the largest absolute difference
    over the largest magnitude of the quantity. A case fails when the kernel's error exceeds
    ``2 x`` the torch path's error ``+ 4 eps`` of the dtype. Returns the failures.
    """
    failures = []
    generator = torch.Generator().manual_seed(2)
    print("\n### routed_sum against float64: relative error, kernel (torch path)\n")
    print("| dtype | states | coefficients | output | states grad | coeffs grad |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for n, per_channel in ((3, False), (25, False), (9, True)):
            shape = (tokens, hidden)
            exact = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(n)]
            exact = [x.to(dtype).double() for x in exact]  # representable in dtype
            coeffs = torch.randn(n, hidden if per_channel else 1, generator=generator).double()
            grad = torch.randn(shape, generator=generator).to(dtype)
            runs = {}
            for impl, run_dtype, run_device in (
                ("reference", torch.float64, "cpu"),
                ("triton", dtype, device),
                ("torch", dtype, device),
            ):
                leaves = [
                    coeffs.to(run_device, torch.float64 if impl == "reference" else torch.float32)
                ]
                leaves += [x.to(run_device, run_dtype) for x in exact]
                leaves = [t.requires_grad_() for t in leaves]
                out = routed_sum(
                    leaves[1:], leaves[0], impl="triton" if impl == "triton" else "torch"
                )
                grads = torch.autograd.grad(out, leaves[:2], grad.to(run_device, run_dtype))
                runs[impl] = [t.detach().double().cpu() for t in (out, grads[1], grads[0])]
            cells = []
            eps = torch.finfo(dtype).eps
            for k, name in enumerate(("output", "states grad", "coeffs grad")):
                want = runs["reference"][k]
                scale = want.abs().max()
                err = {
                    i: float((runs[i][k] - want).abs().max() / scale) for i in ("triton", "torch")
                }
                cells.append(f"{err['triton']:.1e} ({err['torch']:.1e})")
                if err["triton"] > 2 * err["torch"] + 4 * eps:
                    failures.append(f"{dtype} n={n} per_channel={per_channel} {name}: {err}")
            kind = "per channel" if per_channel else "per state"
            print(f"| {dtype} | {n} | {kind} | " + " | ".join(cells) + " |")
    return failures


def time_routed_sums(device: str, layers: int, tokens: int, hidden: int) -> dict:
    """Forward + backward of all routed sums of a ``layers``-block source stack, both impls."""
    states = [torch.randn(tokens, hidden, device=device, requires_grad=True) for _ in range(layers)]
    coeffs = [torch.randn(r + 1, 1, device=device, requires_grad=True) for r in range(1, layers)]
    grad = torch.randn(tokens, hidden, device=device)
    timings = {}
    impls = (
        ("triton", "torch") if device.startswith("cuda") or interpreter_enabled() else ("torch",)
    )
    for impl in impls:

        def step(impl: str = impl) -> None:
            outs = [routed_sum(states[: r + 1], coeffs[r - 1], impl=impl) for r in range(1, layers)]
            torch.autograd.backward(outs, [grad] * len(outs))

        timings[impl] = median_ms(step, torch.device(device))
    terms = sum(r + 1 for r in range(1, layers))
    print(
        f"\n### Routed sums of a {layers}-block source stack ({layers - 1} sums, {terms} terms of "
        f"{tokens} x {hidden} fp32), forward + backward\n"
    )
    print("| impl | median ms |")
    print("|---|---|")
    for impl, ms in timings.items():
        print(f"| {impl} | {ms:.3f} |")
    if "triton" in timings:
        print(f"\nfused / term by term: {timings['triton'] / timings['torch']:.3f}")
    return {"layers": layers, "tokens": tokens, "hidden": hidden, "median_ms": timings}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--quick", action="store_true", help="tiny model, a few steps")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--train-seconds", type=float, default=60.0, help="budget per layout")
    parser.add_argument("--eval-every", type=int, default=100)
    args = parser.parse_args(argv)
    args.layers, args.hidden, args.heads, args.mlp, args.vocab = 24, 512, 8, 1376, 256
    args.half, args.batch, args.num_train = 128, 32, 20000
    if args.quick:
        args.layers, args.hidden, args.heads, args.mlp, args.vocab = 4, 32, 2, 64, 64
        args.half, args.batch, args.num_train = 16, 8, 256
        args.steps, args.eval_every = min(args.steps, 6), 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu for the smoke test", file=sys.stderr)
        return 1
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    data = markov_corpus(args.num_train + 128, args.half, args.vocab, generator, device)
    train_data, val = data[: args.num_train], data[args.num_train :]
    base = build_model(args, device)

    # 0. The kernels against the reference, then identity at init (same logits, same weights).
    tokens = args.batch * 2 * args.half
    if device.startswith("cuda") or interpreter_enabled():
        failures = check_routed_sum(device, tokens, args.hidden)
        if failures:
            print("routed_sum kernel check failed: " + "; ".join(failures), file=sys.stderr)
            return 1
    else:
        print("routed_sum kernel check skipped: no CUDA and TRITON_INTERPRET is not set")
    sums = time_routed_sums(device, args.layers, tokens, args.hidden)
    probe = val[:4]
    with torch.no_grad():
        reference = base(input_ids=probe).logits
        for layout in list(LAYOUTS)[1:]:
            mode, impl, state_grads = LAYOUTS[layout]
            wrapper = ConnectivityWrapper(mode=mode, impl=impl, state_grads=state_grads)
            wrapped = wrapper(copy.deepcopy(base))
            same = torch.equal(wrapped(input_ids=probe).logits, reference)
            print(f"identity at init ({layout} vs residual): {same}")
            if not same:
                print("identity check failed", file=sys.stderr)
                return 1

    results = [train(layout, base, train_data, val, args, device) for layout in LAYOUTS]
    baseline = results[0]
    target = baseline["final_val_loss"]
    print(
        f"\n### {args.layers}-layer GPT-like (hidden {args.hidden}), batch {args.batch}x"
        f"{2 * args.half} tokens, {device}; target val loss = residual final {target:.4f}\n"
    )
    print(
        "| layout | extra params % | median step ms | tokens/s | step-time overhead % | "
        "peak mem GB | final val loss | steps to target | seconds to target | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for record in results:
        hit = next(((s, t) for s, t, v in record["curve"] if v <= target), None)
        record["target_val_loss"] = target
        record["steps_to_target"] = hit[0] if hit else None
        record["seconds_to_target"] = hit[1] if hit else None
        record["overhead_pct"] = 100 * (record["median_step_ms"] / baseline["median_step_ms"] - 1)
        base_hit = baseline["seconds_to_target"]
        speedup = base_hit / hit[1] if hit and base_hit else None
        record["time_to_target_speedup"] = speedup
        mem = "-" if record["peak_mem_gb"] is None else f"{record['peak_mem_gb']:.2f}"
        print(
            f"| {record['layout']} | {record['params_extra_pct']:.4f} | "
            f"{record['median_step_ms']:.1f} | {record['tokens_per_s']:.0f} | "
            f"{record['overhead_pct']:+.1f} | {mem} | {record['final_val_loss']:.4f} | "
            f"{hit[0] if hit else '>' + str(record['steps'])} | "
            f"{f'{hit[1]:.1f}' if hit else '>' + format(record['train_seconds'], '.1f')} | "
            f"{f'{speedup:.2f}x' if speedup else '-'} |"
        )
    print("\nvalidation curves (step: loss)")
    for record in results:
        points = ", ".join(f"{s}: {v:.3f}" for s, _, v in record["curve"])
        print(f"- {record['layout']}: {points}")
    elapsed = time.perf_counter() - start
    print(f"\nelapsed {elapsed:.1f} s")
    write_json(
        SLUG,
        {
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "triton": _triton_version(),
            "elapsed_s": elapsed,
            "routed_sums": sums,
            "results": results,
        },
    )
    return 0


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
