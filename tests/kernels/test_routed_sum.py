"""Routed sum: the Triton kernels (forward and backward) against the torch reference.

On a machine without CUDA, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` so that
``impl="triton"`` runs the kernels on CPU tensors.
"""

import pytest
import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.kernels import routed_sum, routed_sum_reference
from ada_modules.nn import ANCReStack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (state shape, coefficient columns or None for a 1-D coeffs, channel_dim)
LAYOUTS = {
    "scalar_1d": ((3, 5, 40), None, -1),
    "scalar_2d": ((2, 7, 24), 1, -1),
    "channels_last": ((3, 5, 40), 40, -1),
    "channels_first": ((2, 6, 4, 5), 6, 1),
    "channels_middle_negative_dim": ((2, 6, 4, 5), 4, -2),
    "vector": ((300,), 300, 0),
}


def _inputs(shape, width, n):
    """``n`` float64 states and their coefficients (``width`` None: one per state, 1-D)."""
    states = [torch.randn(shape, dtype=torch.float64, device=DEVICE) for _ in range(n)]
    coeffs = torch.randn((n,) if width is None else (n, width), dtype=torch.float64, device=DEVICE)
    return states, coeffs


def _run(states, coeffs, channel_dim, grad, impl):
    """Output and gradients (coefficients first, then the states) of one routed sum."""
    leaves = [t.detach().requires_grad_() for t in (coeffs, *states)]
    out = routed_sum(leaves[1:], leaves[0], channel_dim, impl=impl)
    return out, torch.autograd.grad(out, leaves, grad)


@pytest.mark.triton
@pytest.mark.parametrize("n", [1, 3, 8, 11, 17])  # 8 states per launch: 11 and 17 need more
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_kernel_matches_reference_fp32(seed, layout, n):
    shape, width, channel_dim = LAYOUTS[layout]
    states, coeffs = _inputs(shape, width, n)
    grad = torch.randn(shape, dtype=torch.float64, device=DEVICE)
    expected, expected_grads = _run(states, coeffs, channel_dim, grad, "torch")  # fp64 reference

    out, grads = _run(
        [s.float() for s in states], coeffs.float(), channel_dim, grad.float(), "triton"
    )

    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("n", [5, 12])  # one launch stores the dtype; two add up in fp32
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_states_accumulate_in_fp32(seed, dtype, n):
    states, coeffs = _inputs((4, 64), 64, n)
    states = [s.to(dtype).double() for s in states]  # exactly representable inputs
    exact = routed_sum_reference(states, coeffs.float().double())

    out = routed_sum([s.to(dtype) for s in states], coeffs.float(), impl="triton")
    term_by_term = routed_sum([s.to(dtype) for s in states], coeffs.float(), impl="torch")

    assert out.dtype == dtype
    # One rounding of the fp32 sum: within half an ulp of the exact value on a GPU. The Triton
    # interpreter truncates fp32 -> bf16 in the kernel's store (its cast ignores the rounding
    # mode), which is up to a whole ulp.
    ulps = 1.0 if dtype == torch.bfloat16 and DEVICE == "cpu" and n <= 8 else 0.5
    eps = torch.finfo(dtype).eps
    assert ((out.double() - exact).abs() <= exact.abs() * eps * ulps + 1e-5).all()
    # the reference rounds after every term, so it is never closer to the exact value overall
    assert (out.double() - exact).abs().sum() <= (term_by_term.double() - exact).abs().sum()


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [4, 10])
def test_one_hot_and_zero_coefficients_are_exact(seed, dtype, n):
    # what keeps a routed stack bitwise equal to the residual stack at initialisation
    states = [torch.randn(3, 33, device=DEVICE).to(dtype) for _ in range(n)]
    one_hot = torch.zeros(n, device=DEVICE)
    one_hot[n - 2] = 1.0
    picked = routed_sum(states, one_hot, impl="triton")
    zeros = routed_sum(states, torch.zeros(n, device=DEVICE), impl="triton")
    assert torch.equal(picked, states[n - 2])
    assert torch.equal(zeros, torch.zeros_like(states[0]))


@pytest.mark.triton
def test_non_contiguous_states_and_partial_gradients(seed):
    base = [torch.randn(24, 16, device=DEVICE) for _ in range(3)]
    states = [b.t() for b in base]  # (16, 24), non-contiguous
    coeffs = torch.randn(3, 24, device=DEVICE)
    grad = torch.randn(16, 24, device=DEVICE)
    expected = routed_sum_reference(states, coeffs)
    torch.testing.assert_close(routed_sum(states, coeffs, impl="triton"), expected)

    # coefficients fixed, one state without gradient
    leaves = [states[0].detach().requires_grad_(), states[1], states[2].detach().requires_grad_()]
    out = routed_sum(leaves, coeffs, impl="triton")
    g0, g2 = torch.autograd.grad(out, [leaves[0], leaves[2]], grad)
    torch.testing.assert_close(g0, grad * coeffs[0])
    torch.testing.assert_close(g2, grad * coeffs[2])


@pytest.mark.triton
def test_empty_states_give_an_empty_sum():
    states = [torch.zeros(0, 8, device=DEVICE) for _ in range(2)]
    assert routed_sum(states, torch.ones(2, device=DEVICE), impl="triton").shape == (0, 8)


@pytest.mark.parametrize(
    ("states", "coeffs", "channel_dim", "match"),
    [
        ([], torch.ones(1), -1, "non-empty sequence"),
        (torch.ones(2, 3), torch.ones(2), -1, "non-empty sequence"),
        ([torch.ones(2, 3), torch.ones(2, 4)], torch.ones(2), -1, r"states\[1\] is \(2, 4\)"),
        ([torch.ones(2, 3), torch.ones(2, 3).double()], torch.ones(2), -1, "must match"),
        (
            [torch.ones(2, 3, dtype=torch.long)],
            torch.ones(1),
            -1,
            "floating-point, got torch.int64",
        ),
        ([torch.ones(2, 3)] * 2, torch.ones(3), -1, r"shape \(2,\) or \(2, channels\)"),
        ([torch.ones(2, 3)] * 2, torch.ones(2, 4), -1, "4 channels but the states have 3"),
        ([torch.ones(2, 3)] * 2, torch.ones(2, 3), 2, "channel_dim must be in"),
        ([torch.ones(2, 3)] * 2, torch.ones(2, dtype=torch.long), -1, "floating-point"),
    ],
)
def test_bad_input_is_named(states, coeffs, channel_dim, match):
    with pytest.raises(InputError, match=match):
        routed_sum(states, coeffs, channel_dim)


@pytest.mark.triton
def test_float64_runs_the_reference_unless_the_kernel_is_asked_for():
    states = [torch.randn(2, 3, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    coeffs = torch.ones(2, dtype=torch.float64, device=DEVICE)
    assert torch.equal(routed_sum(states, coeffs), routed_sum_reference(states, coeffs))
    with pytest.raises(InputError, match="impl='triton' needs states in"):
        routed_sum(states, coeffs, impl="triton")


def _stack(impl, per_channel=False, **kwargs):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(10)]
    return ANCReStack(
        blocks,
        residual_in_block=False,
        per_channel=per_channel,
        num_channels=24,
        impl=impl,
        **kwargs,
    ).to(DEVICE)


@pytest.mark.triton
@pytest.mark.parametrize(
    ("mode", "per_channel"), [("source", False), ("input", True), ("denseformer", False)]
)
def test_routed_stack_with_the_kernel_matches_torch(seed, mode, per_channel):
    x = torch.randn(6, 24, device=DEVICE)
    fused, plain = _stack("triton", per_channel, mode=mode), _stack("torch", per_channel, mode=mode)
    assert torch.equal(fused(x), plain(x))  # identity at init, bitwise
    with torch.no_grad():  # move every coefficient off its initial value
        for a, b in zip(fused.router.parameters(), plain.router.parameters(), strict=True):
            a.add_(0.3 * torch.randn_like(a))
            b.copy_(a)
    out_fused, out_plain = fused(x), plain(x)
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-5, atol=1e-5)
    out_fused.square().sum().backward()
    out_plain.square().sum().backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters(), strict=True):
        # fp32 rounding in another order: relative to the largest gradient of the tensor
        error = (a.grad - b.grad).abs().max()
        assert error <= 1e-5 * b.grad.abs().max(), (name, error)


def test_router_names_a_bad_impl():
    with pytest.raises(InputError, match="impl must be 'auto', 'triton' or 'torch', got 'cuda'"):
        _stack("cuda")


class _TanhToDouble(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x).double()


@pytest.mark.triton
def test_routed_stack_with_mixed_dtypes_sums_term_by_term(seed):
    # x_0 is float32 and the later states float64: the reference promotes, the kernel could not
    x = torch.randn(4, 8, device=DEVICE)
    stacks = [
        ANCReStack(
            [_TanhToDouble() for _ in range(3)], mode="source", residual_in_block=False, impl=impl
        )
        for impl in ("triton", "torch")
    ]
    for stack in stacks:
        with torch.no_grad():
            stack.router.gate.fill_(0.5)
    assert torch.equal(stacks[0](x), stacks[1](x))


@pytest.mark.triton
def test_a_double_backward_through_the_kernel_raises():
    states = [torch.randn(3, 4, device=DEVICE, requires_grad=True) for _ in range(2)]
    out = routed_sum(states, torch.randn(2, device=DEVICE, requires_grad=True), impl="triton")
    (grad,) = torch.autograd.grad(out.square().sum(), states[0], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()
