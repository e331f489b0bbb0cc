"""Row-wise absmax int8: the Triton kernel against its torch reference, invariants and bad input.

On a machine without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` so that
``impl="triton"`` runs the kernel on CPU tensors.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ada_modules.kernels import int8_absmax
from ada_modules.kernels.int8_absmax import (
    dequantize_int8_absmax,
    dequantize_int8_absmax_reference,
    quantize_int8_absmax,
    quantize_int8_absmax_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1), (3, 17), (5, 130), (2, 3, 40), (7,), (2, 4100)]  # 4100: more than one chunk
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]


def _roundtrip_bound(scale: torch.Tensor) -> torch.Tensor:
    """``scale / 2`` plus a few fp32 ulps of the largest value in the row (|x| <= 127 * scale)."""
    return (scale / 2 * (1 + 1e-5)).unsqueeze(-1)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference(seed, shape, dtype):
    x = (3 * torch.randn(shape, device=DEVICE)).to(dtype)
    q, scale = quantize_int8_absmax(x, impl="triton")
    q_ref, scale_ref = quantize_int8_absmax_reference(x)

    assert q.dtype == torch.int8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert torch.equal(q, q_ref)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)

    x_hat = dequantize_int8_absmax(q, scale, impl="triton")
    assert torch.equal(x_hat, dequantize_int8_absmax_reference(q, scale))


@pytest.mark.triton
def test_codes_agree_next_to_half_steps(seed):
    # Values at (k + 1/2) steps land within an ulp of a rounding boundary, so any difference in how
    # the kernel and the reference divide, multiply or round changes some codes.
    absmax = torch.logspace(-3, 3, 64, device=DEVICE) * (1 + torch.rand(64, device=DEVICE))
    k = torch.randint(-127, 127, (64, 48), device=DEVICE)
    x = (k + 0.5) * (absmax / 127)[:, None]
    x[:, 0] = absmax
    q, scale = quantize_int8_absmax(x, impl="triton")
    q_ref, scale_ref = quantize_int8_absmax_reference(x)
    assert torch.equal(q, q_ref)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_error_is_at_most_half_a_step(seed, impl, dtype):
    x = (10 * torch.randn(6, 37, device=DEVICE)).to(dtype)
    q, scale = quantize_int8_absmax(x, impl=impl)
    x_hat = dequantize_int8_absmax(q, scale, impl=impl)

    assert (q.abs().amax(dim=-1) == 127).all()
    assert ((x.float() - x_hat).abs() <= _roundtrip_bound(scale)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_rows_give_zero_scale_and_codes(impl):
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5], [0.0, -0.0, 0.0]], device=DEVICE)
    q, scale = quantize_int8_absmax(x, impl=impl)
    x_hat = dequantize_int8_absmax(q, scale, impl=impl)

    assert scale[0] == 0 and scale[2] == 0
    assert not q[[0, 2]].any()
    assert torch.isfinite(x_hat).all() and not x_hat[[0, 2]].any()


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_round_half_to_even(impl):
    # absmax 127 makes the step exactly 1, so each value is its own scaled code.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]], device=DEVICE)
    q, _ = quantize_int8_absmax(x, impl=impl)
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]]


@pytest.mark.triton
@pytest.mark.parametrize(
    "make",
    [
        lambda base: base[:, 3:60],  # row stride larger than the row
        lambda base: base[:, 1:80:3],  # column stride 3
        lambda base: base[:, :24].t(),  # transposed
    ],
    ids=["row_slice", "column_step", "transposed"],
)
def test_non_contiguous_inputs(seed, make):
    x = make(torch.randn(9, 100, device=DEVICE))
    q, scale = quantize_int8_absmax(x, impl="triton")
    q_ref, scale_ref = quantize_int8_absmax_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)

    q_strided = q_ref.t().contiguous().t()
    x_hat = dequantize_int8_absmax(q_strided, scale_ref, impl="triton")
    assert torch.equal(x_hat, dequantize_int8_absmax_reference(q_strided, scale_ref))


@pytest.mark.parametrize("impl", IMPLS)
def test_no_rows(impl):
    q, scale = quantize_int8_absmax(torch.empty(0, 5, device=DEVICE), impl=impl)
    assert q.shape == (0, 5) and scale.shape == (0,)
    assert dequantize_int8_absmax(q, scale, impl=impl).shape == (0, 5)


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    def fail(*args):
        raise AssertionError("the Triton path ran for a CPU tensor")

    monkeypatch.setattr(int8_absmax, "_quantize_int8_absmax_triton", fail)
    monkeypatch.setattr(int8_absmax, "_dequantize_int8_absmax_triton", fail)
    x = torch.randn(3, 5)
    dequantize_int8_absmax(*quantize_int8_absmax(x))


@pytest.mark.triton
def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"cpu.*TRITON_INTERPRET=1"):
        quantize_int8_absmax(torch.randn(3, 5), impl="triton")


@pytest.mark.parametrize(
    ("x", "error", "match"),
    [
        (torch.ones(3, 4, dtype=torch.int32), TypeError, "torch.int32"),
        (torch.ones(3, 4, dtype=torch.float64), TypeError, "torch.float64"),
        ([1.0, 2.0], TypeError, "list"),
        (torch.tensor(1.0), ValueError, r"shape \(\)"),
        (torch.ones(3, 0), ValueError, r"shape \(3, 0\)"),
    ],
    ids=["int32", "float64", "list", "0-d", "empty_row"],
)
def test_quantize_rejects_bad_input(x, error, match):
    with pytest.raises(error, match=match):
        quantize_int8_absmax(x)


@pytest.mark.parametrize(
    ("q", "scale", "error", "match"),
    [
        (torch.ones(3, 4), torch.ones(3), TypeError, "q must have dtype torch.int8"),
        (torch.ones(3, 4, dtype=torch.int8), torch.ones(3).half(), TypeError, "torch.float16"),
        (torch.tensor(1, dtype=torch.int8), torch.tensor(1.0), ValueError, "0-d"),
        (torch.ones(3, 4, dtype=torch.int8), torch.ones(4), ValueError, r"\(3,\), got \(4,\)"),
    ],
    ids=["float_codes", "half_scale", "0-d", "scale_shape"],
)
def test_dequantize_rejects_bad_input(q, scale, error, match):
    with pytest.raises(error, match=match):
        dequantize_int8_absmax(q, scale)


def test_unknown_impl_is_named():
    with pytest.raises(ValueError, match="'cuda'"):
        quantize_int8_absmax(torch.randn(2, 3), impl="cuda")


@settings(max_examples=25, deadline=None)
@given(
    leading=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    cols=st.integers(1, 64),
    magnitude=st.sampled_from([1e-3, 1.0, 1e4]),
    data_seed=st.integers(0, 2**16),
)
def test_reference_properties(leading, cols, magnitude, data_seed):
    generator = torch.Generator().manual_seed(data_seed)
    x = magnitude * torch.randn(*leading, cols, generator=generator)
    q, scale = quantize_int8_absmax_reference(x)
    x_hat = dequantize_int8_absmax_reference(q, scale)

    assert q.shape == x.shape and scale.shape == x.shape[:-1]
    assert torch.equal(scale, x.abs().amax(dim=-1) / 127)
    assert (q.abs().amax(dim=-1) == 127).all()  # the absmax element maps to +-127
    assert ((x - x_hat).abs() <= _roundtrip_bound(scale)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 17), (64, 4096), (33, 5000), (4, 8, 1000)], ids=str)
def test_kernel_matches_reference_on_cuda(shape, dtype):
    x = torch.randn(shape, device="cuda").to(dtype)
    q, scale = quantize_int8_absmax(x)  # "auto" picks Triton for CUDA tensors
    q_ref, scale_ref = quantize_int8_absmax_reference(x)
    assert torch.equal(q, q_ref)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    assert torch.equal(dequantize_int8_absmax(q, scale), dequantize_int8_absmax_reference(q, scale))
