"""ADKV metadata and stored bits against context length, and CPU encode/decode throughput.

What is compared (issue 15, part 7), on CPU in one run, for one layer of the KV geometry of
Llama-3.1-8B (8 key/value heads, head dim 128, batch 1; keys and values at the same bits):

1. **Metadata bits per element vs context length** ``T`` (1K to 128K tokens), for every arm of
   the study: group-wise KIVI (G = 32 and G = 128: an fp16 scale and zero per group of keys per
   channel and of values per token), static per-channel (one fp16 scale and zero per channel for
   the whole sequence), and ADKV with keyframes every P = 512 and P = 256 tokens (an fp16 centre
   and an int16 step exponent per channel per keyframe, plus the per-channel parameters: a uint8
   centre rate and an int8 multiplier per code magnitude). Bytes are **measured** from the
   tensors the quantizers hold at ``T = 1024`` and ``T = 4096`` (real encodes) and computed by the
   layout formula for longer contexts; the ``check`` column shows the measured and computed
   bytes agree where both exist. The group-wise metadata is flat in bits per element (it grows
   with ``T``); ADKV's is flat too but ~P/G times smaller, and its per-channel parameters are
   amortised. Also total bits per element (codes + metadata) and the ratio KIVI-32 / arm.
2. **Throughput on CPU** (tokens per second for the whole layer, torch, one thread): ADKV encode
   (a Python loop over tokens: the recursion is sequential), ADKV decode by prefix sums
   (:func:`~ada_modules.kernels.adkv_decode.adkv_dequantize_reference`) and by the sequential
   replay, against KIVI quantize and dequantize at the same bits.

With ``--out``, writes ``adkv.json``, ``adkv_metadata.png`` (metadata bits per element vs ``T``,
log-log) and ``adkv_drift.png`` (one drifting post-RoPE outlier channel of the synthetic data, its
2-bit ADKV reconstruction and the centre the codec tracks, against the one range a static
per-channel quantizer must cover) there: the plots of ``docs/techniques/adkv.md``.

Run it::

    .venv/bin/python bench/adkv.py            # ~1 minute on 2 cores
    .venv/bin/python bench/adkv.py --quick    # ~15 s
    .venv/bin/python bench/adkv.py --out docs/techniques/img/adkv

Reports only; no assertion.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from ada_modules.kernels.adkv_decode import adkv_dequantize_reference
from ada_modules.kernels.kv_quant import dequantize, packed_words, quantize_keys, quantize_values
from ada_modules.kv.adkv import ADKVParams, adkv_dequantize_sequential, adkv_encode

KV_HEADS, HEAD_DIM = 8, 128
CONTEXTS = [1024, 4096, 16384, 65536, 131072]
MEASURED = [1024, 4096]


def make_states(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 keys with drifting channel pairs (post-RoPE-like) and values, one layer."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(tokens, dtype=torch.float32)[:, None]
    keys = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen)
    freq = 10000 ** (-torch.arange(HEAD_DIM // 2, dtype=torch.float32) * 2 / HEAD_DIM)
    amp = torch.zeros(HEAD_DIM // 2)
    amp[-8:] = 10.0  # eight low-frequency outlier pairs
    keys[..., : HEAD_DIM // 2] += amp * torch.cos(t * freq)
    keys[..., HEAD_DIM // 2 :] += amp * torch.sin(t * freq)
    values = torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen)
    return keys.half(), values.half()


def groupwise_metadata_bytes(tokens: int, group: int) -> int:
    """fp16 scale + zero per group: keys per channel over ``group`` tokens, values per token over
    ``group`` channels (one layer, keys and values)."""
    keys = -(-tokens // group) * HEAD_DIM
    values = tokens * (HEAD_DIM // group)
    return KV_HEADS * (keys + values) * 2 * 2


def static_metadata_bytes() -> int:
    """fp16 scale + zero per channel for the whole sequence, keys and values."""
    return KV_HEADS * HEAD_DIM * 2 * 2 * 2


def adkv_metadata_bytes(tokens: int, period: int, bits: int) -> int:
    """Keyframes (fp16 centre + int16 exponent per channel) + shared per-channel parameters
    (uint8 rate + int8 multiplier per code magnitude), keys and values."""
    keyframes = -(-tokens // period) * KV_HEADS * HEAD_DIM * 4
    parameters = KV_HEADS * HEAD_DIM * (1 + 2 ** (bits - 1))
    return 2 * (keyframes + parameters)


def measured_groupwise(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int) -> int:
    k = quantize_keys(keys, bits, group)
    v = quantize_values(values, bits, group)
    return sum(t.numel() * t.element_size() for t in (k.scale, k.zero, v.scale, v.zero))


def measured_adkv(keys: torch.Tensor, values: torch.Tensor, bits: int, period: int) -> int:
    params = ADKVParams.default(bits).for_shape(KV_HEADS, HEAD_DIM)
    total = 0
    for x in (keys, values):
        packed = adkv_encode(x, params, period)
        total += packed.keyframe_nbytes() + packed.parameter_nbytes()
    return total


def metadata_table(bits: int, measure_up_to: int) -> list[dict]:
    rows = []
    elements = lambda t: 2 * KV_HEADS * t * HEAD_DIM  # noqa: E731 - keys and values
    code_bits = packed_words(HEAD_DIM, bits) * 32 / HEAD_DIM
    for tokens in CONTEXTS:
        measured = tokens in MEASURED and tokens <= measure_up_to
        states = make_states(tokens) if measured else None
        arms = {
            "KIVI G=32": (groupwise_metadata_bytes(tokens, 32), 32),
            "KIVI G=128": (groupwise_metadata_bytes(tokens, 128), 128),
            "static per-channel": (static_metadata_bytes(), None),
            "ADKV P=512": (adkv_metadata_bytes(tokens, 512, bits), 512),
            "ADKV P=256": (adkv_metadata_bytes(tokens, 256, bits), 256),
        }
        for arm, (computed, size) in arms.items():
            check = ""
            if measured and arm.startswith("KIVI"):
                check = measured_groupwise(*states, bits, size) == computed
            elif measured and arm.startswith("ADKV"):
                check = measured_adkv(*states, bits, size) == computed
            meta = 8 * computed / elements(tokens)
            rows.append(
                {
                    "tokens": tokens,
                    "bits": bits,
                    "arm": arm,
                    "metadata_bytes": computed,
                    "metadata_bits_per_element": meta,
                    "total_bits_per_element": code_bits + meta,
                    "measured_equals_formula": check,
                }
            )
    kivi = {r["tokens"]: r["metadata_bits_per_element"] for r in rows if r["arm"] == "KIVI G=32"}
    for r in rows:
        r["kivi32_over_arm"] = kivi[r["tokens"]] / r["metadata_bits_per_element"]
    return rows


def throughput(tokens: int, bits: int) -> list[dict]:
    keys, _ = make_states(tokens)
    keys = keys.float()
    params = ADKVParams.default(bits).for_shape(KV_HEADS, HEAD_DIM)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return tokens / (time.perf_counter() - start)

    packed = adkv_encode(keys, params, 512)
    kivi = quantize_keys(keys, bits, 32, impl="torch")
    rows = {
        "ADKV encode": timed(lambda: adkv_encode(keys, params, 512)),
        "ADKV decode (prefix sums)": timed(lambda: adkv_dequantize_reference(packed)),
        "ADKV decode (sequential)": timed(lambda: adkv_dequantize_sequential(packed)),
        "KIVI quantize": timed(lambda: quantize_keys(keys, bits, 32, impl="torch")),
        "KIVI dequantize": timed(lambda: dequantize(kivi, impl="torch")),
    }
    return [{"tokens": tokens, "bits": bits, "op": k, "tokens_per_s": v} for k, v in rows.items()]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        pts = [(r["tokens"], 8 * r["metadata_bytes"] / 2**20) for r in rows if r["arm"] == arm]
        ax.plot(*zip(*pts, strict=True), marker="o", label=arm)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("metadata per layer (Mbit, keys + values)")
    ax.set_title(f"KV metadata vs context, 8 KV heads x 128, {rows[0]['bits']}-bit codes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_drift(path: Path) -> None:
    """A drifting outlier channel, its 2-bit ADKV reconstruction and the tracked centre."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ada_modules.data import rope_drift_kv
    from ada_modules.kernels.adkv_decode import CENTRE_FRACTION_BITS, step_from_exponent
    from ada_modules.kv.adkv import ADKVEncoder

    gen = torch.Generator().manual_seed(0)
    sample = rope_drift_kv(2048, low_frequency_outliers=False, generator=gen)
    channel = int(sample.outlier_channels[0, 0])
    x = sample.keys[None, :1]  # (1, 1, T, D): head 0
    encoder = ADKVEncoder(ADKVParams.default(2), keyframe_period=512)
    centres = []
    for t in range(x.shape[-2]):  # token by token, to read the centre the decoder replays
        encoder.append(x[:, :, t : t + 1])
        state = encoder._state
        shift = torch.tensor(-float(CENTRE_FRACTION_BITS))
        unit = torch.ldexp(step_from_exponent(state["key_exponent"]), shift)
        centres.append(
            float((state["key_centre"] + state["accumulator"].float() * unit)[0, 0, channel])
        )
    decoded = adkv_dequantize_reference(encoder.packed)[0, 0, :, channel]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    t = range(x.shape[-2])
    ax.plot(t, x[0, 0, :, channel], lw=0.6, color="0.6", label="post-RoPE key channel")
    ax.plot(t, decoded, lw=0.6, color="tab:blue", alpha=0.7, label="ADKV 2-bit reconstruction")
    ax.plot(t, centres, lw=1.5, color="tab:red", label="tracked centre (EMA)")
    lo, hi = float(x[0, 0, :, channel].min()), float(x[0, 0, :, channel].max())
    ax.axhspan(lo, hi, color="tab:orange", alpha=0.08, label="static per-channel range")
    ax.set_xlabel("token")
    ax.set_title(f"Outlier channel {channel} of head 0 (synthetic RoPE drift)")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="measure at T = 1024 only")
    parser.add_argument("--out", type=Path, default=None, help="folder for adkv.json and the plot")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    measure_up_to = 1024 if args.quick else 4096
    results: dict[str, list[dict]] = {"metadata": [], "throughput": []}
    for bits in (2, 4):
        rows = metadata_table(bits, measure_up_to)
        results["metadata"] += rows
        print(f"\n### Metadata, {bits}-bit codes (one layer: 8 KV heads x 128, keys + values)\n")
        print(
            "| T | arm | metadata bits/elem | total bits/elem | KIVI-32 / arm | measured = formula |"
        )
        print("|---:|---|---:|---:|---:|:-:|")
        for r in rows:
            print(
                f"| {r['tokens']} | {r['arm']} | {r['metadata_bits_per_element']:.4f} | "
                f"{r['total_bits_per_element']:.3f} | {r['kivi32_over_arm']:.1f}x | "
                f"{r['measured_equals_formula']} |"
            )
    tokens = 256 if args.quick else 1024
    print(f"\n### CPU throughput (one layer, T = {tokens}, torch, 1 thread)\n")
    print("| bits | operation | tokens/s |")
    print("|---:|---|---:|")
    for bits in (2, 4):
        for r in throughput(tokens, bits):
            results["throughput"].append(r)
            print(f"| {bits} | {r['op']} | {r['tokens_per_s']:.0f} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "adkv.json").write_text(json.dumps(results, indent=1, default=str))
        plot([r for r in results["metadata"] if r["bits"] == 2], args.out / "adkv_metadata.png")
        plot_drift(args.out / "adkv_drift.png")
        print(f"\nwrote adkv.json, adkv_metadata.png and adkv_drift.png to {args.out}")
    print(f"\nelapsed {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
