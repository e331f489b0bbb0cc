"""Compile every Triton kernel of ``ada_modules.kernels`` for a real GPU target, on a CPU machine.

The interpreter (``TRITON_INTERPRET=1``, what the kernel tests use) runs a kernel's Python body and
never lowers it, so code that the interpreter accepts but Triton's compiler rejects (for instance
two ``return`` statements of different dtypes in one ``@triton.jit`` helper) only failed on a
GPU. This script runs each public kernel function once, through its real launch path, with a
stand-in driver that reports a GPU target and a ``JITFunction.run`` that compiles without
launching (Triton's ``warmup``): the kernels go through the whole pipeline to a cubin (``ptxas``
ships with triton), with the dtypes and constexprs our functions pass. What the kernels would have
written is never read.

Run it as its own process, with ``TRITON_INTERPRET`` unset (``tests/kernels/test_compile_for_gpu.py``
does)::

    python tests/kernels/compile_for_gpu.py [--arch 90]

Prints one line per compiled kernel; exits non-zero if any kernel fails to compile or a kernel of
the package was never launched.
"""

import argparse
import ast
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

import ada_modules.kernels as kernels_pkg
from ada_modules.kernels import (
    adkv_decode_attention,
    adkv_dequantize,
    decode_attention,
    delta_codec,
    dequantize,
    dequantize_int8_absmax,
    interpreter_enabled,
    quantize_int8_absmax,
    quantize_keys,
    quantize_values,
    routed_sum,
    sparse_prefill_attention,
)
from ada_modules.kernels.exponent_codec import decode_from, encode_into, encode_into_reference
from ada_modules.kernels.sparse_prefill import causal_block_mask
from ada_modules.kv.adkv import ADKVParams, adkv_encode


class _CompileOnlyDriver:
    """The part of Triton's driver interface that compiling (not launching) a kernel uses."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def compile_only(arch: int, compiled: list[str]) -> Iterator[None]:
    """Make ``kernel[grid](...)`` compile for ``sm_<arch>`` and return without launching."""
    run = JITFunction.run

    def compile_without_launch(self, *args, grid, warmup, **kwargs):
        run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(self.fn.__name__)

    driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = compile_without_launch
    # resolve_impl lets impl="triton" take CPU tensors only when it believes the interpreter is
    # on; triton already decided (at import) that it is not, so the kernels really compile.
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        JITFunction.run = run
        del os.environ["TRITON_INTERPRET"]


def launched_kernel_names() -> set[str]:
    """Names of the ``@triton.jit`` functions of the package that are launched (``*_kernel``)."""
    names = set()
    for path in Path(kernels_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                jitted = any("jit" in ast.unparse(d) for d in node.decorator_list)
                if jitted:
                    names.add(node.name)
    return names


def _calls() -> list[tuple[str, Callable[[], object]]]:
    torch.manual_seed(0)
    tokens, head_dim, batch, kv_heads, heads = 64, 64, 2, 2, 4
    calls: list[tuple[str, Callable[[], object]]] = []
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(batch, kv_heads, tokens, head_dim, dtype=dtype)
        query = torch.randn(batch, heads, head_dim, dtype=dtype)
        window = torch.randn(batch, kv_heads, 5, head_dim, dtype=dtype)
        for bits in (2, 3, 4, 8):
            keys = quantize_keys(x, bits, 32, impl="torch")
            values = quantize_values(x, bits, 32, impl="torch")
            seg = kernels_pkg.QuantizedKV(keys, values)
            calls += [
                (
                    f"quantize_keys {dtype} {bits}b",
                    lambda x=x, b=bits: quantize_keys(x, b, 32, impl="triton"),
                ),
                (
                    f"quantize_values {dtype} {bits}b",
                    lambda x=x, b=bits: quantize_values(x, b, 32, impl="triton"),
                ),
                (f"dequantize {dtype} {bits}b", lambda k=keys: dequantize(k, impl="triton")),
                (
                    f"decode_attention {dtype} {bits}b",
                    lambda q=query, s=seg, w=window: decode_attention(q, [s], w, w, impl="triton"),
                ),
            ]
        for bits in (2, 4):
            packed = adkv_encode(x.float(), ADKVParams.default(bits), 16)
            calls += [
                (f"adkv_dequantize {bits}b", lambda p=packed: adkv_dequantize(p, impl="triton")),
                (
                    f"adkv_decode_attention {dtype} {bits}b",
                    lambda q=query, p=packed, w=window: adkv_decode_attention(
                        q, p, p, w, w, impl="triton"
                    ),
                ),
            ]
        q4 = torch.randn(batch, heads, tokens, head_dim, dtype=dtype)
        mask = causal_block_mask(batch, heads, tokens, tokens, 16)
        calls.append(
            (
                f"sparse_prefill_attention {dtype}",
                lambda q=q4, k=x, m=mask: sparse_prefill_attention(
                    q, k, k, m, block_size=16, impl="triton"
                ),
            )
        )
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, dtype=dtype)
        cache = torch.zeros(4096, dtype=torch.uint8)
        buffer, spill = encode_into_reference(x, cache, 64, chunk_size=256)
        calls += [
            (
                f"encode_into {dtype}",
                lambda x=x, c=cache: encode_into(x, c, 64, chunk_size=256, impl="triton"),
            ),
            (
                f"decode_from {dtype}",
                lambda b=buffer, c=cache, s=spill, d=dtype: decode_from(
                    b, c, 4096, d, spill=s, impl="triton"
                ),
            ),
        ]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, dtype=dtype)
        cache = torch.zeros(4096, dtype=dtype)
        buffer, spill = delta_codec.encode_into_reference(x, cache, 64, chunk_size=256)
        calls += [
            (
                f"delta encode_into {dtype}",
                lambda x=x, c=cache: delta_codec.encode_into(
                    x, c, 64, chunk_size=256, impl="triton"
                ),
            ),
            (
                f"delta decode_from {dtype}",
                lambda b=buffer, c=cache, s=spill, d=dtype: delta_codec.decode_from(
                    b, c, 4096, d, spill=s, impl="triton"
                ),
            ),
        ]
    for dtype in (torch.float32, torch.bfloat16):
        for shape, width, channel_dim in (
            ((4, 8, 64), 1, -1),
            ((4, 8, 64), 64, -1),
            ((2, 8, 4, 4), 8, 1),
        ):
            calls.append(
                (
                    f"routed_sum {dtype} {shape} {width} channels forward and backward",
                    lambda s=shape, w=width, d=channel_dim, t=dtype: _routed_sum_step(s, w, d, t),
                )
            )
    x = torch.randn(8, 96)
    q, scale = quantize_int8_absmax(x, impl="torch")
    calls += [
        ("quantize_int8_absmax", lambda: quantize_int8_absmax(x, impl="triton")),
        ("dequantize_int8_absmax", lambda: dequantize_int8_absmax(q, scale, impl="triton")),
    ]
    return calls


def _routed_sum_step(shape: tuple[int, ...], width: int, channel_dim: int, dtype) -> None:
    """One routed sum of 11 states (two launches each way) and its backward pass."""
    states = [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(11)]
    coeffs = torch.randn(11, width, requires_grad=True)
    out = routed_sum(states, coeffs, channel_dim, impl="triton")
    torch.autograd.grad(out, [coeffs, *states], torch.ones_like(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    args = parser.parse_args(argv)
    if interpreter_enabled():  # triton read it at import: its kernels would never be compiled
        print("compile_for_gpu.py needs TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    compiled: list[str] = []
    failures: list[str] = []
    with compile_only(args.arch, compiled):
        for name, call in _calls():
            before = len(compiled)
            try:
                call()
            except triton.CompilationError as err:
                failures.append(f"{name}: {err}\ncaused by: {err.__cause__!r}")
            except Exception:  # noqa: BLE001 - the launch wrote nothing, so later steps may fail
                if len(compiled) == before:
                    raise
            print(f"sm_{args.arch} {name}: {', '.join(sorted(set(compiled[before:])))}")
    missing = launched_kernel_names() - set(compiled)
    if missing:
        failures.append(f"kernels never compiled (add a call above): {sorted(missing)}")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
