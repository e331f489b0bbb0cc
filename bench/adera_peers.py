"""AdERA's lossless all-gather codecs against the lossless compressors a user would otherwise use.

Which is cheaper to send at step ``s`` when the receiver still holds step ``s - 1``: the weights
compressed on their own, their XOR with the previous copy compressed, or AdERA's payloads? All on
real weight snapshots, CPU. Everything runs on one torch thread, training included (a second thread
on a shared 2-core box can make training many times slower).

**Snapshots.** Two models, trained with a plain loop (``loss = module.training_step(batch, i)``,
``torch.optim.AdamW(lr=1e-3, weight_decay=0.01)``, fp32 master weights, batch 32 of the 1–3 digit
addition task, seed 0):

* the library's tiny LM, ``CausalLMModule(architecture="llama", hidden_size=256, num_layers=10,
  num_heads=4, num_kv_heads=4, intermediate_size=1024)`` (~10.5 M parameters; ``--quick``: hidden
  64, 2 layers, intermediate 256), one group per decoder block (all parameters of
  ``module.model.model.layers[i]`` flattened and concatenated, as FSDP2's ``fully_shard`` groups
  them; embeddings, final norm and head are left out);
* the tiny MoE of ``bench/adera.py`` (``MoELMModule``, 2 blocks, width 64, 8 experts of hidden
  128, top-2), two groups per block as its ``configure_model`` shards it: the stacked experts and
  the rest of the block.

At steps ``s`` in {10, 50, 100, 200} (``--quick``: {5, 10}) the groups of steps ``s - 1`` and ``s``
are kept, as fp32 and as their bf16 cast (what FSDP2 gathers under
``MixedPrecisionPolicy(param_dtype=bf16)``).

**Bytes table.** Per model, dtype and step: the bytes that travel for step ``s`` given step
``s - 1``, summed over the groups, ÷ the raw bytes, for

* ``ZipNN``: ``zipnn.ZipNN(input_format="byte", bytearray_dtype=...)`` on the weights alone;
* ``ZipNN xor``: the same with ``delta_compressed_type="byte"`` and the previous copy as
  ``delta_second_data`` (ZipNN's XOR-delta mode);
* ``zstd-1``, ``zstd-3``: zstandard at level 1 and 3 on the raw bytes;
* ``zstd-1 xor``, ``zstd-3 xor``: the same on the XOR of the bits with the previous copy;
* ``AdERA exponent``: :func:`ada_modules.kernels.exponent_codec.encode` against the exponents of
  the previous copy (the receiver's exponent cache), whole payload with its header;
* ``AdERA value``: :func:`ada_modules.kernels.delta_codec.encode` against the previous copy itself
  (the receiver caches the whole previous value).

The best method of a row is in bold. Two data columns say why: the fraction of elements that are
bitwise unchanged and the fraction of exponents that are unchanged. Every method is handed copies
of its inputs (zipnn 0.5.4's ``compress`` rewrites its input in place), each payload is decoded and
compared bitwise with the step's weights, and the snapshots are checked to be unaltered afterwards:
"all exact" says that all of it held for the row; the script exits non-zero (after writing its
files) when it did not.

**Throughput table.** Encode and decode MB/s of raw bytes (median of repeats, methods alternated,
one thread; ZipNN with ``threads=1``, AdERA's torch reference codec ``impl="torch"``) on one
group: the LM's middle decoder block at step 100 (``--quick``: step 10), bf16 and fp32, with a plain
``clone`` of the group as the baseline. Encode goes from the weight tensor to the payload (for the
byte compressors: the copy to ``bytes`` and the XOR included), decode from the payload back to a
tensor. Absolute MB/s on a shared 2-core box mean little; the bytes ratios are exact.

``zipnn`` and ``zstandard`` are optional (the ``bench`` extra: ``pip install -e '.[bench]'``);
without one of them the script says so and shows its columns as "n/a".

Run it::

    .venv/bin/python bench/adera_peers.py            # ~10 min
    .venv/bin/python bench/adera_peers.py --quick    # < 60 s

Prints markdown tables and writes ``adera_peers.json`` and ``adera_peers.png`` (bytes ÷ raw per
step and method, one panel per model and dtype) to ``--out``.
"""

import argparse
import importlib
import importlib.metadata
import json
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import matplotlib
import torch
from adera import flat, fsdp_groups, median_times  # bench/adera.py, beside this script
from lightning.pytorch import LightningModule
from torch import nn

from ada_modules.data import ArithmeticDataModule
from ada_modules.kernels import delta_codec, exponent_codec
from ada_modules.models import CausalLMModule, MoELMModule

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
INT_VIEWS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
ZIPNN_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
METHODS = (
    "ZipNN",
    "ZipNN xor",
    "zstd-1",
    "zstd-3",
    "zstd-1 xor",
    "zstd-3 xor",
    "AdERA exponent",
    "AdERA value",
)
IMPL = "torch"
BATCH_SIZE = 32
INSTALL = "pip install -e '.[bench]'"


@dataclass(frozen=True)
class Method:
    """A lossless codec; ``state(prev)`` is what sender and receiver hold from the last gather."""

    name: str
    state: Callable[[torch.Tensor], Any]
    encode: Callable[[torch.Tensor, Any], bytes | torch.Tensor]
    decode: Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class Codecs:
    """The optional modules; ``None`` where missing."""

    zipnn: ModuleType | None
    zstd: ModuleType | None


# ----------------------------------------------------------------------------------------------
# Codecs
# ----------------------------------------------------------------------------------------------


def optional(name: str) -> ModuleType | None:
    """``import name``, or ``None`` with a line that says how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        print(f"{name} is missing ({error}): its columns show n/a; install with {INSTALL}")
        return None


def load_codecs() -> Codecs:
    """zipnn and zstandard if installed."""
    return Codecs(optional("zipnn"), optional("zstandard"))


def to_bytes(x: torch.Tensor) -> bytes:
    """A copy of the raw bytes of ``x``."""
    return x.reshape(-1).view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes | bytearray, dtype: torch.dtype) -> torch.Tensor:
    """The flat tensor of ``dtype`` whose raw bytes are ``data``."""
    return torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=dtype)


def xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bitwise XOR of two flat tensors of one float dtype, as that dtype."""
    view = INT_VIEWS[a.dtype]
    return (a.reshape(-1).view(view) ^ b.reshape(-1).view(view)).view(a.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (dtype and elements)."""
    return (
        a.dtype == b.dtype
        and a.numel() == b.numel()
        and torch.equal(
            a.reshape(-1).view(INT_VIEWS[a.dtype]), b.reshape(-1).view(INT_VIEWS[b.dtype])
        )
    )


def nothing(prev: torch.Tensor) -> None:
    """The state of a method that ignores the previous copy."""


def keep(prev: torch.Tensor) -> torch.Tensor:
    """The state of a method that caches the whole previous copy."""
    return prev


def zipnn_methods(zipnn: ModuleType, dtype: torch.dtype) -> list[Method]:
    """ZipNN on the weights alone and in its XOR-delta mode, one thread."""
    plain = zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPES[dtype], threads=1)
    delta = zipnn.ZipNN(
        input_format="byte",
        bytearray_dtype=ZIPNN_DTYPES[dtype],
        threads=1,
        delta_compressed_type="byte",
    )
    return [
        Method(
            "ZipNN",
            nothing,
            lambda x, _: plain.compress(to_bytes(x)),
            lambda payload, _: from_bytes(plain.decompress(payload), dtype),
        ),
        Method(
            "ZipNN xor",
            to_bytes,
            lambda x, prev: delta.compress(to_bytes(x), delta_second_data=prev),
            lambda payload, prev: from_bytes(
                delta.decompress(payload, delta_second_data=prev), dtype
            ),
        ),
    ]


def zstd_methods(zstd: ModuleType, dtype: torch.dtype) -> list[Method]:
    """zstd at levels 1 and 3, on the raw bytes and on their XOR with the previous copy."""
    decompressor = zstd.ZstdDecompressor()
    methods = []
    for level in (1, 3):
        compressor = zstd.ZstdCompressor(level=level)
        methods.append(
            Method(
                f"zstd-{level}",
                nothing,
                lambda x, _, c=compressor: c.compress(to_bytes(x)),
                lambda payload, _: from_bytes(decompressor.decompress(payload), dtype),
            )
        )
        methods.append(
            Method(
                f"zstd-{level} xor",
                keep,
                lambda x, prev, c=compressor: c.compress(to_bytes(xor(x, prev))),
                lambda payload, prev: xor(
                    from_bytes(decompressor.decompress(payload), dtype), prev
                ),
            )
        )
    return methods


def adera_methods() -> list[Method]:
    """AdERA's exponent and value reuse (torch reference codecs)."""
    return [
        Method(
            "AdERA exponent",
            exponent_codec.extract_exponents,
            lambda x, cache: exponent_codec.encode(x, cache, impl=IMPL),
            lambda payload, cache: exponent_codec.decode(payload, cache, impl=IMPL)[0],
        ),
        Method(
            "AdERA value",
            keep,
            lambda x, prev: delta_codec.encode(x, prev, impl=IMPL),
            lambda payload, prev: delta_codec.decode(payload, prev, impl=IMPL),
        ),
    ]


def build_methods(codecs: Codecs, dtype: torch.dtype) -> list[Method]:
    """The available methods for ``dtype``, in the order of ``METHODS``."""
    methods = adera_methods()
    if codecs.zstd is not None:
        methods = zstd_methods(codecs.zstd, dtype) + methods
    if codecs.zipnn is not None:
        methods = zipnn_methods(codecs.zipnn, dtype) + methods
    return methods


def payload_nbytes(payload: bytes | torch.Tensor) -> int:
    """Bytes of a payload (``bytes`` or a tensor)."""
    return (
        payload.numel() * payload.element_size()
        if isinstance(payload, torch.Tensor)
        else len(payload)
    )


def round_trip(method: Method, cur: torch.Tensor, prev: torch.Tensor) -> tuple[int, bool]:
    """Payload bytes of ``cur`` given ``prev``, and whether it decodes to ``cur`` bit for bit.

    Encoder and decoder each get their own copies of the inputs.
    """
    payload = method.encode(cur.clone(), method.state(prev.clone()))
    decoded = method.decode(payload, method.state(prev.clone()))
    return payload_nbytes(payload), same_bits(decoded, cur)


# ----------------------------------------------------------------------------------------------
# Snapshots
# ----------------------------------------------------------------------------------------------


def lm_groups(module: CausalLMModule) -> list[list[nn.Parameter]]:
    """One group per decoder block."""
    return [list(layer.parameters()) for layer in module.model.model.layers]


def moe_groups(module: MoELMModule) -> list[list[nn.Parameter]]:
    """Per block, the stacked experts and the rest of the block (as ``configure_model`` shards);
    the root group is left out, as for the LM."""
    experts, others = fsdp_groups(module.model)
    return [group for pair in zip(experts, others[: len(experts)], strict=True) for group in pair]


def train(
    module: LightningModule, groups: list[list[nn.Parameter]], kept: set[int]
) -> tuple[dict[int, list[torch.Tensor]], dict[int, float]]:
    """Train up to ``max(kept)`` steps; fp32 group snapshots and losses at the steps ``kept``."""
    steps = max(kept)
    torch.manual_seed(0)
    data = ArithmeticDataModule(
        seed=0, num_train=steps * BATCH_SIZE, num_val=8, num_test=8, batch_size=BATCH_SIZE
    )
    data.setup("fit")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    loader = iter(data.train_dataloader())
    snapshots, losses = {}, {}
    for step in range(1, steps + 1):
        loss = module.training_step(next(loader), step - 1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step in kept:
            snapshots[step] = [flat(g) for g in groups]
            losses[step] = loss.item()
    return snapshots, losses


# ----------------------------------------------------------------------------------------------
# Bytes and throughput
# ----------------------------------------------------------------------------------------------


def bytes_row(
    methods: list[Method], prev: list[torch.Tensor], cur: list[torch.Tensor]
) -> dict[str, Any]:
    """Bytes of every method for one (model, dtype, step), summed over the groups."""
    raw = sum(x.numel() * x.element_size() for x in cur)
    numel = sum(x.numel() for x in cur)
    sent = dict.fromkeys(METHODS)
    exact = dict.fromkeys(METHODS)
    intact = True
    same_elements = same_exponents = 0
    for p, c in zip(prev, cur, strict=True):
        before = (p.clone(), c.clone())
        view = INT_VIEWS[c.dtype]
        same_elements += int((p.view(view) == c.view(view)).sum())
        same_exponents += int(
            (exponent_codec.extract_exponents(p) == exponent_codec.extract_exponents(c)).sum()
        )
        for method in methods:
            nbytes, ok = round_trip(method, c, p)
            sent[method.name] = (sent[method.name] or 0) + nbytes
            exact[method.name] = (exact[method.name] is not False) and ok
        intact = intact and same_bits(p, before[0]) and same_bits(c, before[1])
    return {
        "raw_bytes": raw,
        "elements_unchanged": same_elements / numel,
        "exponents_unchanged": same_exponents / numel,
        "bytes": sent,
        "ratio": {m: None if n is None else n / raw for m, n in sent.items()},
        "exact": exact,
        "inputs_intact": intact,
        "all_exact": intact and all(ok is not False for ok in exact.values()),
    }


def time_methods(
    methods: list[Method], prev: torch.Tensor, cur: torch.Tensor, repeats: int
) -> dict[str, dict[str, float]]:
    """Encode and decode MB/s (raw bytes) and bytes ratio of each method on one group."""
    fns: dict[str, Callable[[], Any]] = {"copy/encode": cur.clone}
    ratios = {}
    for m in methods:
        x, enc_state, dec_state = cur.clone(), m.state(prev.clone()), m.state(prev.clone())
        payload = m.encode(x, enc_state)
        ratios[m.name] = payload_nbytes(payload) / (cur.numel() * cur.element_size())
        fns[f"{m.name}/encode"] = lambda m=m, x=x, s=enc_state: m.encode(x, s)
        fns[f"{m.name}/decode"] = lambda m=m, p=payload, s=dec_state: m.decode(p, s)
    raw = cur.numel() * cur.element_size()
    out: dict[str, dict[str, float]] = {}
    for key, seconds in median_times(fns, repeats).items():
        name, op = key.split("/")
        out.setdefault(name, {"ratio": ratios.get(name, 1.0)})[f"{op}_MBps"] = raw / seconds / 1e6
    return out


# ----------------------------------------------------------------------------------------------
# Tables and plot
# ----------------------------------------------------------------------------------------------


def print_bytes_table(rows: list[dict[str, Any]]) -> None:
    """The main table; the smallest ratio of a row in bold."""
    print("\n## Bytes sent for step s given step s − 1, ÷ raw bytes (summed over the groups)\n")
    print(
        "| model | dtype | step | elements unchanged | exponents unchanged | "
        + " | ".join(METHODS)
        + " | all exact |"
    )
    print(
        "| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in METHODS) + " | :---: |"
    )
    for r in rows:
        ratios = r["ratio"]
        best = min(v for v in ratios.values() if v is not None)
        cells = [
            "n/a" if v is None else f"**{v:.4f}**" if v == best else f"{v:.4f}"
            for v in ratios.values()
        ]
        print(
            f"| {r['model']} | {r['dtype']} | {r['step']} | {r['elements_unchanged']:.2%} | "
            f"{r['exponents_unchanged']:.2%} | " + " | ".join(cells) + f" | "
            f"{'yes' if r['all_exact'] else 'NO'} |"
        )


def print_throughput_table(timings: dict[str, dict[str, dict[str, float]]], title: str) -> None:
    """Encode/decode MB/s and bytes ratio per method on the timed group."""
    print(f"\n## Throughput on one group: {title}\n")
    print(
        "| method | bf16 encode MB/s | bf16 decode MB/s | bf16 ÷ raw | "
        "fp32 encode MB/s | fp32 decode MB/s | fp32 ÷ raw |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ("copy", *METHODS):
        cells = []
        for dtype in DTYPES:
            t = timings[dtype].get(name)
            if t is None:
                cells += ["n/a"] * 3
            else:
                decode = f"{t['decode_MBps']:,.0f}" if "decode_MBps" in t else "—"
                cells += [f"{t['encode_MBps']:,.0f}", decode, f"{t['ratio']:.4f}"]
        print(f"| {'copy (clone)' if name == 'copy' else name} | " + " | ".join(cells) + " |")


def plot(rows: list[dict[str, Any]], models: list[str], path: Path) -> None:
    """Bytes ÷ raw per step and method; one panel per model and dtype."""
    fig, axes = plt.subplots(
        len(models), len(DTYPES), figsize=(12, 3.6 * len(models)), squeeze=False
    )
    for row_axes, model in zip(axes, models, strict=True):
        for ax, dtype in zip(row_axes, DTYPES, strict=True):
            sub = [r for r in rows if r["model"] == model and r["dtype"] == dtype]
            steps = [r["step"] for r in sub]
            for i, method in enumerate(METHODS):
                ratios = [r["ratio"][method] for r in sub]
                if None not in ratios:
                    style = "-" if method.startswith("AdERA") else "--" if "xor" in method else ":"
                    ax.plot(steps, ratios, style, marker="os^vDPX*"[i], color=f"C{i}", label=method)
            ax.set(xscale="log", xlabel="step", ylabel="bytes / raw", ylim=(0, None))
            ax.minorticks_off()
            ax.set_xticks(steps, [str(s) for s in steps])
            ax.set_title(f"{model}, {dtype}", fontsize=10)
            ax.grid(alpha=0.3)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="center right", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def build_models(quick: bool) -> dict[str, tuple[str, LightningModule, list[list[nn.Parameter]]]]:
    """Name -> (description, module, FSDP groups), seeded."""
    width, layers = (64, 2) if quick else (256, 10)
    torch.manual_seed(0)
    lm = CausalLMModule(
        architecture="llama",
        hidden_size=width,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=4 * width,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    moe = MoELMModule(
        d_model=64, num_layers=2, num_heads=4, d_ff=128, num_experts=8, top_k=2, max_seq_len=64
    )
    lm_name = f"CausalLMModule(llama, hidden {width}, {layers} layers, intermediate {4 * width})"
    return {
        "LM": (lm_name, lm, lm_groups(lm)),
        "MoE": (
            "MoELMModule(d_model 64, 2 blocks, 8 experts of d_ff 128, top-2)",
            moe,
            moe_groups(moe),
        ),
    }


def snapshot_models(
    quick: bool, steps: tuple[int, ...]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[int, list[torch.Tensor]]]]:
    """Train both models; their descriptions and their fp32 group snapshots at steps s - 1, s."""
    kept = {s - d for s in steps for d in (1, 0)}
    info, snapshots = {}, {}
    for model, (description, module, groups) in build_models(quick).items():
        numels = [sum(q.numel() for q in g) for g in groups]
        params = sum(q.numel() for q in module.parameters())
        start = time.perf_counter()
        snapshots[model], losses = train(module, groups, kept)
        print(
            f"- {model}: {description}: {params:,} parameters, {sum(numels):,} in {len(groups)} "
            f"groups; {max(steps)} steps in {time.perf_counter() - start:.0f} s, loss "
            + ", ".join(f"{losses[s]:.3f} (step {s})" for s in steps)
        )
        info[model] = {
            "description": description,
            "params": params,
            "group_numels": numels,
            "losses": losses,
        }
    return info, snapshots


def main() -> None:
    """Train, measure, print the tables, write JSON and plot; exit 1 if a method was not exact."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="LM of width 64, steps {5, 10}")
    parser.add_argument("--out", type=Path, default=Path("bench_out/adera_peers"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=r"You are trying to `self\.log\(\)`")
    torch.set_num_threads(1)
    start = time.perf_counter()
    steps = (5, 10) if args.quick else (10, 50, 100, 200)
    timed_step = steps[-1] if args.quick else 100
    codecs = load_codecs()
    versions = {
        "torch": torch.__version__,
        "zipnn": None if codecs.zipnn is None else importlib.metadata.version("zipnn"),
        "zstandard": None if codecs.zstd is None else importlib.metadata.version("zstandard"),
    }
    print(
        f"# AdERA codecs vs lossless compressors, CPU ({torch.get_num_threads()} thread; "
        + ", ".join(f"{k} {v or 'missing'}" for k, v in versions.items())
        + ")\n"
    )
    info, snapshots = snapshot_models(args.quick, steps)
    methods = {dtype: build_methods(codecs, dt) for dtype, dt in DTYPES.items()}
    block = len(info["LM"]["group_numels"]) // 2
    title = (
        f"LM decoder block {block} ({info['LM']['group_numels'][block]:,} elements), "
        f"step {timed_step}"
    )
    rows, timings = [], {}
    for model, snaps in snapshots.items():
        for dtype, dt in DTYPES.items():
            for s in steps:
                prev = [x.to(dt) for x in snaps[s - 1]]
                cur = [x.to(dt) for x in snaps[s]]
                rows.append(
                    {"model": model, "dtype": dtype, "step": s}
                    | bytes_row(methods[dtype], prev, cur)
                )
                if model == "LM" and s == timed_step:
                    timings[dtype] = time_methods(
                        methods[dtype], prev[block], cur[block], 3 if args.quick else 5
                    )
    print_bytes_table(rows)
    print_throughput_table(timings, title)
    elapsed = time.perf_counter() - start
    results = {
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "versions": versions,
        "models": info,
        "bytes": rows,
        "throughput": {"group": title, "by_dtype": timings},
        "elapsed_s": elapsed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "adera_peers.json"
    path.write_text(json.dumps(results, indent=1))
    plot(rows, list(info), args.out / "adera_peers.png")
    print(f"\nwall time {elapsed:.1f} s; wrote {path} and adera_peers.png")
    failed = [
        f"{r['model']} {r['dtype']} step {r['step']}: "
        + ", ".join(
            [m for m, ok in r["exact"].items() if ok is False]
            + ([] if r["inputs_intact"] else ["snapshots altered"])
        )
        for r in rows
        if not r["all_exact"]
    ]
    if failed:
        print("NOT EXACT: " + "; ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
