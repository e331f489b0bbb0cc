"""Sparse prefill attention: Triton == torch reference, the reference against SDPA and a naive
masked softmax, block lists, dtypes, bad input.

On a machine without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` so that
``impl="triton"`` runs the kernel on CPU tensors (small shapes only: the interpreter is slow).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from ada_modules.attention.plan import causal_block_mask, num_blocks
from ada_modules.errors import InputError
from ada_modules.kernels import (
    block_mask_to_indices,
    interpreter_enabled,
    sparse_prefill_attention,
    sparse_prefill_attention_reference,
)
from ada_modules.kernels import sparse_prefill as sp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch, q_heads, kv_heads, q_len, k_len, dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, dim, generator=g)
    k = torch.randn(batch, kv_heads, k_len, dim, generator=g)
    v = torch.randn(batch, kv_heads, k_len, dim, generator=g)
    return (t.to(DEVICE, dtype) for t in (q, k, v))


def _random_plan(batch, heads, q_len, k_len, block_size, density, seed=0):
    """Random blocks plus the diagonal ones (so that most rows have keys)."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, num_blocks(q_len, block_size), num_blocks(k_len, block_size))
    mask = torch.rand(shape, generator=g) < density
    offset_blocks = (k_len - q_len) // block_size
    rows = torch.arange(shape[2])
    mask[:, :, rows, (rows + offset_blocks).clamp_max(shape[3] - 1)] = True
    return mask.to(DEVICE)


def _left_padding(batch, k_len, amounts):
    mask = torch.ones(batch, k_len, dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(amounts):
        mask[b, :n] = False
    return mask


def _naive(q, k, v, block_mask, block_size, key_padding_mask=None, scaling=None):
    """Per (batch, head) loops, the element mask from ``repeat_interleave``d blocks, fp64."""
    batch, q_heads, q_len, dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    scaling = dim**-0.5 if scaling is None else scaling
    out = torch.zeros(q.shape, dtype=torch.float64)
    pos = torch.arange(q_len)[:, None] + (k_len - q_len)
    causal = torch.arange(k_len)[None, :] <= pos
    for b in range(batch):
        for h in range(q_heads):
            kh = h // (q_heads // kv_heads)
            blocks = block_mask[b, h].cpu()
            elem = blocks.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
            elem = elem[:q_len, :k_len] & causal
            if key_padding_mask is not None:
                elem &= key_padding_mask[b].cpu()[None, :]
            s = (q[b, h].cpu().double() @ k[b, kh].cpu().double().T) * scaling
            for i in range(q_len):
                keys = elem[i].nonzero().flatten()
                if len(keys):
                    w = torch.softmax(s[i, keys], dim=0)
                    out[b, h, i] = w @ v[b, kh, keys].cpu().double()
    return out


# ----------------------------------------------------------------------------------------------
# Kernel == reference
# ----------------------------------------------------------------------------------------------

KERNEL_CASES = [
    # (batch, q_heads, kv_heads, q_len, k_len, dim, block, density, padding)
    pytest.param(1, 2, 2, 77, 77, 16, 16, 0.5, None, id="ragged-last-block"),
    pytest.param(1, 4, 2, 100, 100, 32, 32, 0.6, None, id="gqa"),
    pytest.param(2, 2, 1, 90, 90, 16, 16, 0.7, (0, 37), id="batch2-left-padding"),
    pytest.param(1, 2, 2, 50, 130, 16, 16, 0.5, None, id="chunked-prefill-offset"),
    pytest.param(2, 2, 2, 40, 72, 24, 16, 0.5, (20, 3), id="dim24-offset-padding"),
    pytest.param(1, 2, 1, 64, 64, 32, 64, 1.0, None, id="one-block-bigger-than-dim"),
]


@pytest.mark.triton
@pytest.mark.parametrize(
    ("batch", "q_heads", "kv_heads", "q_len", "k_len", "dim", "block", "density", "padding"),
    KERNEL_CASES,
)
def test_kernel_matches_reference(
    batch, q_heads, kv_heads, q_len, k_len, dim, block, density, padding
):
    q, k, v = _inputs(batch, q_heads, kv_heads, q_len, k_len, dim)
    mask = _random_plan(batch, q_heads, q_len, k_len, block, density)
    pad = _left_padding(batch, k_len, padding) if padding else None
    out = sparse_prefill_attention(
        q, k, v, mask, block_size=block, key_padding_mask=pad, impl="triton"
    )
    ref = sparse_prefill_attention_reference(q, k, v, mask, block_size=block, key_padding_mask=pad)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
def test_kernel_tiles_smaller_than_the_block(monkeypatch):
    # Wide heads take BLOCK_N < block_size (and blocks of 256, BLOCK_M < block_size); force both.
    monkeypatch.setattr(sp, "_tile_configs", lambda *args: [(16, 16, 4, 1)])
    monkeypatch.setattr(sp, "_chosen_tiles", {})
    q, k, v = _inputs(2, 2, 1, 70, 90, 16)
    mask = _random_plan(2, 2, 70, 90, 32, 0.5)
    pad = _left_padding(2, 90, (0, 9))
    out = sparse_prefill_attention(
        q, k, v, mask, block_size=32, key_padding_mask=pad, impl="triton"
    )
    ref = sparse_prefill_attention_reference(q, k, v, mask, block_size=32, key_padding_mask=pad)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_tile_configs_divide_the_block_and_fit_the_shared_memory():
    h200 = 232448  # bytes of shared memory a block may opt in to
    assert sp._tile_configs(128, 128, 2, h200)[0] == (128, 64, 8, 3)
    assert sp._tile_configs(128, 128, 4, h200)[0] == (64, 32, 4, 2)
    assert sp._tile_configs(16, 32, 2, math.inf) == [(16, 16, 4, 3), (16, 16, 4, 2), (16, 16, 4, 1)]
    for block_m, block_n, _, stages in sp._tile_configs(64, 256, 2, 101376):  # sm_86
        assert 64 % block_m == 0 and 64 % block_n == 0
        assert (block_m * 256 + 2 * stages * block_n * 256 + block_m * block_n) * 2 <= 101376


@pytest.mark.triton
def test_kernel_falls_back_to_smaller_tiles_when_out_of_shared_memory(monkeypatch):
    from triton.runtime.errors import OutOfResources

    kernel, tried = sp._sparse_prefill_kernel, []

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tried.append(kwargs["BLOCK_M"])
                if kwargs["BLOCK_M"] > 16:
                    raise OutOfResources(300000, 232448, "shared memory")
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(sp, "_sparse_prefill_kernel", Launcher())
    monkeypatch.setattr(sp, "_tile_configs", lambda *args: [(32, 32, 4, 2), (16, 16, 4, 1)])
    monkeypatch.setattr(sp, "_chosen_tiles", {})
    q, k, v = _inputs(1, 2, 2, 40, 40, 16)
    mask = _random_plan(1, 2, 40, 40, 32, 0.5)
    out = sparse_prefill_attention(q, k, v, mask, block_size=32, impl="triton")
    ref = sparse_prefill_attention_reference(q, k, v, mask, block_size=32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    sparse_prefill_attention(q, k, v, mask, block_size=32, impl="triton")
    assert tried == [32, 16, 16]  # the tiles that fit are remembered


@pytest.mark.triton
def test_kernel_rows_without_keys_are_zero():
    q, k, v = _inputs(1, 2, 2, 64, 64, 16)
    mask = causal_block_mask(1, 2, 64, 64, block_size=16)
    mask[0, 0, 1] = False  # query block 1 of head 0: no key block
    mask[0, 1, 2, :2] = False  # head 1: only its diagonal block, fully padded below
    pad = torch.ones(1, 64, dtype=torch.bool, device=DEVICE)
    pad[0, 32:40] = False  # the first queries of block 2 see no real key in block 2
    out = sparse_prefill_attention(
        q, k, v, mask, block_size=16, key_padding_mask=pad, impl="triton"
    )
    ref = sparse_prefill_attention_reference(q, k, v, mask, block_size=16, key_padding_mask=pad)
    assert torch.isfinite(out).all()
    assert out[0, 0, 16:32].eq(0).all()
    assert out[0, 1, 32:40].eq(0).all()
    assert out[0, 1, 40:48].ne(0).any(dim=-1).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
def test_kernel_reads_non_contiguous_inputs():
    q, k, v = _inputs(1, 2, 2, 48, 48, 16)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, L, H, D) memory, as in a model
    kt = torch.cat([k, k], dim=-1)[..., ::2]  # a strided last dim
    mask = _random_plan(1, 2, 48, 48, 16, 0.5)
    out = sparse_prefill_attention(qt, kt, v, mask, block_size=16, impl="triton")
    ref = sparse_prefill_attention_reference(q, kt.contiguous(), v, mask, block_size=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# The Triton interpreter holds bf16 tensors as uint16 and its tl.dot multiplies those bits.
BF16_KERNEL = pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton interpreter cannot tl.dot bf16; checked on CUDA"
)
HALF_CASES = [
    pytest.param(torch.float16, "torch", id="fp16-torch"),
    pytest.param(torch.float16, "triton", marks=pytest.mark.triton, id="fp16-triton"),
    pytest.param(torch.bfloat16, "torch", id="bf16-torch"),
    pytest.param(
        torch.bfloat16, "triton", marks=[pytest.mark.triton, BF16_KERNEL], id="bf16-triton"
    ),
]


@pytest.mark.parametrize(("dtype", "impl"), HALF_CASES)
def test_half_precision_output_dtype(dtype, impl):
    q, k, v = _inputs(1, 2, 1, 40, 40, 16, dtype=dtype)
    mask = _random_plan(1, 2, 40, 40, 16, 0.6)
    out = sparse_prefill_attention(q, k, v, mask, block_size=16, impl=impl)
    assert out.dtype == dtype
    exact = sparse_prefill_attention_reference(q.float(), k.float(), v.float(), mask, block_size=16)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), exact, atol=tol, rtol=0)


@pytest.mark.triton
@pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
def test_bf16_under_the_interpreter_is_refused():
    q, k, v = _inputs(1, 2, 1, 20, 20, 16, dtype=torch.bfloat16)
    mask = _random_plan(1, 2, 20, 20, 16, 1.0)
    with pytest.raises(InputError, match="bfloat16.*interpreter.*impl='torch'"):
        sparse_prefill_attention(q, k, v, mask, block_size=16, impl="triton")


# ----------------------------------------------------------------------------------------------
# Reference == SDPA / naive masked softmax
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("q_len", "k_len"), [(77, 77), (30, 100)])
def test_reference_with_the_causal_plan_is_causal_sdpa(q_len, k_len):
    q, k, v = _inputs(2, 4, 2, q_len, k_len, 16)
    mask = causal_block_mask(2, 4, q_len, k_len, block_size=16, device=DEVICE)
    out = sparse_prefill_attention_reference(q, k, v, mask, block_size=16)
    # SDPA's is_causal aligns to the top left; the queries are the last positions here.
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=DEVICE).tril(k_len - q_len)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if q_len == k_len:
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)


def test_reference_with_padding_is_masked_sdpa():
    q, k, v = _inputs(2, 2, 2, 50, 50, 16)
    pad = _left_padding(2, 50, (0, 21))
    mask = causal_block_mask(2, 2, 50, 50, block_size=16, device=DEVICE)
    out = sparse_prefill_attention_reference(q, k, v, mask, block_size=16, key_padding_mask=pad)
    allowed = torch.ones(50, 50, dtype=torch.bool, device=DEVICE).tril() & pad[:, None, None, :]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    has_keys = allowed.any(-1, keepdim=True).expand_as(out[..., :1]).squeeze(-1)
    torch.testing.assert_close(out[has_keys], expected[has_keys], atol=1e-5, rtol=1e-5)
    assert out[~has_keys].eq(0).all()  # the padded queries of sequence 1 see no key


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "q_len", "k_len", "dim", "block", "padding", "scaling"),
    [
        (2, 1, 45, 45, 16, 16, None, None),
        (4, 2, 33, 70, 8, 16, (5, 40), 0.3),
    ],
)
def test_reference_with_a_sparse_plan_is_a_naive_masked_softmax(
    q_heads, kv_heads, q_len, k_len, dim, block, padding, scaling
):
    q, k, v = _inputs(2, q_heads, kv_heads, q_len, k_len, dim, seed=3)
    mask = _random_plan(2, q_heads, q_len, k_len, block, 0.4, seed=4)
    mask[0, 0, 0] = False  # a query block with no key
    pad = _left_padding(2, k_len, padding) if padding else None
    out = sparse_prefill_attention_reference(
        q, k, v, mask, block_size=block, key_padding_mask=pad, scaling=scaling
    )
    expected = _naive(q, k, v, mask, block, pad, scaling)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_chunks_agree_with_one_chunk(monkeypatch):
    q, k, v = _inputs(1, 2, 1, 100, 100, 16)
    mask = _random_plan(1, 2, 100, 100, 16, 0.5)
    whole = sparse_prefill_attention_reference(q, k, v, mask, block_size=16)
    monkeypatch.setattr(sp, "_REFERENCE_CHUNK_ELEMENTS", 1)  # one query block per chunk
    chunked = sparse_prefill_attention_reference(q, k, v, mask, block_size=16)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(DEVICE != "cpu", reason="auto picks Triton on CUDA tensors")
def test_auto_runs_the_reference_on_cpu():
    q, k, v = _inputs(1, 2, 2, 20, 20, 16)
    mask = _random_plan(1, 2, 20, 20, 16, 0.5)
    out = sparse_prefill_attention(q, k, v, mask, block_size=16)
    ref = sparse_prefill_attention_reference(q, k, v, mask, block_size=16)
    assert torch.equal(out, ref)


def test_empty_queries():
    q, k, v = _inputs(1, 2, 2, 0, 20, 16)
    mask = torch.zeros(1, 2, 0, 2, dtype=torch.bool, device=DEVICE)
    assert sparse_prefill_attention(q, k, v, mask, block_size=16).shape == (1, 2, 0, 16)


# ----------------------------------------------------------------------------------------------
# Block lists
# ----------------------------------------------------------------------------------------------


def test_block_mask_to_indices_lists_selected_blocks_in_order():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(2, 3, 5, 7, generator=g) < 0.4
    mask[0, 0, 0] = False
    indices, counts = block_mask_to_indices(mask)
    assert indices.dtype == counts.dtype == torch.int32
    assert indices.shape == (2, 3, 5, counts.max().item())
    rows = indices.view(-1, indices.shape[-1])
    for row, n, m in zip(rows, counts.flatten(), mask.view(-1, 7), strict=True):
        assert row[:n].tolist() == m.nonzero().flatten().tolist()
    empty, none = block_mask_to_indices(torch.zeros(1, 4, 0, dtype=torch.bool))
    assert empty.shape == (1, 4, 1) and none.eq(0).all()


def test_kernel_mask_drops_blocks_above_the_diagonal_and_of_padding_only():
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool)  # q_len 40 of k_len 64, block 16
    pad = torch.ones(1, 64, dtype=torch.bool)
    pad[0, :16] = False
    kept = sp._kernel_block_mask(mask, 40, 64, 16, pad)[0, 0]
    assert kept.tolist() == [
        [False, True, True, False],  # queries 0..15 at positions 24..39
        [False, True, True, True],  # positions 40..55
        [False, True, True, True],  # positions 56..63
    ]


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


def _bad(name):
    q, k, v = _inputs(1, 4, 2, 32, 48, 16)
    mask = causal_block_mask(1, 4, 32, 48, block_size=16)
    args = {"query": q, "key": k, "value": v, "block_mask": mask, "block_size": 16}
    if name == "block_size":
        args["block_size"] = 24
    elif name == "block_size_small":
        args["block_size"] = 8
    elif name == "heads":
        args["key"], args["value"] = k[:, :1].expand(1, 3, 48, 16), v[:, :1].expand(1, 3, 48, 16)
    elif name == "mask_heads":
        args["block_mask"] = mask[:, :2]
    elif name == "mask_shape":
        args["block_mask"] = mask[:, :, :, :2]
    elif name == "mask_dtype":
        args["block_mask"] = mask.int()
    elif name == "batch":
        args["key"], args["value"] = torch.cat([k, k]), torch.cat([v, v])
    elif name == "q_len":
        args["query"] = torch.randn(1, 4, 64, 16)
    elif name == "value_shape":
        args["value"] = v[..., :8]
    elif name == "dim":
        args["query"] = torch.randn(1, 4, 32, 8)
    elif name == "dtype":
        args["query"] = q.half()
    elif name == "int_query":
        args["query"] = q.long()
    elif name == "padding_shape":
        args["key_padding_mask"] = torch.ones(1, 32, dtype=torch.bool)
    elif name == "padding_dtype":
        args["key_padding_mask"] = torch.ones(1, 48)
    elif name == "scaling":
        args["scaling"] = math.inf
    elif name == "query_dims":
        args["query"] = q[0]
    return args


BAD_CASES = [
    ("block_size", "block_size must be a power of two >= 16, got 24"),
    ("block_size_small", "block_size must be a power of two >= 16, got 8"),
    ("heads", r"query heads \(4\) must be a multiple of key/value heads \(3\)"),
    ("mask_heads", r"block_mask must be .* = \(1, 4, 2, 3\).*\(1, 2, 2, 3\)"),
    ("mask_shape", r"block_mask must be .*got torch.bool \(1, 4, 2, 2\)"),
    ("mask_dtype", r"block_mask must be a bool tensor.*got torch.int32"),
    ("batch", "key has batch 2, expected the query's batch 1"),
    ("q_len", r"query length \(64\) may not exceed key length \(48\)"),
    ("value_shape", r"value must have the shape of key \(1, 2, 48, 16\), got \(1, 2, 48, 8\)"),
    ("dim", "key has head_dim 16, expected the query's head_dim 8"),
    ("dtype", "query, key and value must share a dtype, got torch.float16"),
    ("int_query", "query must have dtype in"),
    ("padding_shape", r"key_padding_mask must be .*\(1, 48\), got torch.bool \(1, 32\)"),
    ("padding_dtype", r"key_padding_mask must be a bool tensor.*got torch.float32"),
    ("scaling", "scaling must be a finite number or None, got inf"),
    ("query_dims", r"query must be a 4-d tensor .*got torch.float32 \(4, 32, 16\)"),
]


@pytest.mark.parametrize("fn", [sparse_prefill_attention, sparse_prefill_attention_reference])
@pytest.mark.parametrize(("name", "match"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_raises_naming_the_value(fn, name, match):
    args = _bad(name)
    if DEVICE == "cuda":
        args = {n: a.to(DEVICE) if isinstance(a, torch.Tensor) else a for n, a in args.items()}
    with pytest.raises(InputError, match=match):
        fn(**args)


def test_block_mask_to_indices_rejects_a_non_bool_mask():
    with pytest.raises(InputError, match="block_mask must be a bool tensor.*torch.int64"):
        block_mask_to_indices(torch.ones(2, 2, dtype=torch.long))
