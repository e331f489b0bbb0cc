"""Multi-stream residuals: doubly stochastic mixing, exact plain residual, identity at init."""

import itertools

import pytest
import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.nn.multistream import (
    MultiStreamResidual,
    MultiStreamStack,
    permutation_matrices,
    sinkhorn,
)

VARIANTS = [
    dict(kind="hyper"),
    dict(kind="mhc", mixing="sinkhorn"),
    dict(kind="mhc", mixing="sinkhorn_log"),
    dict(kind="mhc", mixing="permutation"),
    dict(kind="mhc", dynamic="pooled"),
    dict(kind="mhc", dynamic="none"),
    dict(kind="mhc", dynamic_input="flat"),
    dict(kind="mhc", mixing="permutation", dynamic_input="flat", dynamic="pooled"),
    dict(kind="hyper", dynamic_input="flat"),
]


def _blocks(dim: int, count: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(count)]


def _plain(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = x + block(x)
    return x


@pytest.mark.parametrize("log_domain", [False, True])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_sinkhorn_is_doubly_stochastic(log_domain: bool, scale: float) -> None:
    torch.manual_seed(0)
    m = sinkhorn(scale * torch.randn(200, 4, 4), iters=20, log_domain=log_domain)
    assert (m >= 0).all()
    # the last-normalised axis (rows) to rounding, the other to the iteration's residual
    assert (m.sum(-1) - 1).abs().max() < 1e-5
    assert (m.sum(-2) - 1).abs().max() < (1e-2 if scale == 1.0 else 6e-2)


def test_sinkhorn_column_error_shrinks_with_iterations() -> None:
    torch.manual_seed(0)
    logits = 3 * torch.randn(100, 4, 4)
    errors = [(sinkhorn(logits, iters=k).sum(-2) - 1).abs().max() for k in (1, 5, 20, 200)]
    assert errors[0] > errors[1] > errors[2] > errors[3] and errors[3] < 1e-2


def test_sinkhorn_log_domain_survives_huge_logits() -> None:
    logits = torch.tensor([[200.0, -200.0], [-200.0, 200.0]])
    assert torch.isfinite(sinkhorn(logits, log_domain=True)).all()
    assert torch.allclose(sinkhorn(logits, log_domain=True), torch.eye(2), atol=1e-6)


def test_sinkhorn_stays_finite_when_a_whole_row_is_far_below_the_maximum() -> None:
    for logits in ([[0.0, 0.0], [-120.0, -120.0]], [[0.0, -120.0], [0.0, -120.0]]):
        m = sinkhorn(torch.tensor(logits))
        torch.testing.assert_close(m, torch.full((2, 2), 0.5))


def test_sinkhorn_runs_in_fp32_for_half_inputs() -> None:
    m = sinkhorn(torch.randn(4, 4).to(torch.bfloat16))
    assert m.dtype == torch.float32


def test_permutation_matrices() -> None:
    perms = permutation_matrices(4)
    assert perms.shape == (24, 4, 4)
    assert torch.equal(perms[0], torch.eye(4))
    assert torch.equal(perms.sum(-1), torch.ones(24, 4)) and torch.equal(
        perms.sum(-2), torch.ones(24, 4)
    )
    assert len({tuple(p.flatten().tolist()) for p in perms}) == 24


@pytest.mark.parametrize(
    "variant",
    [v for v in VARIANTS if v["kind"] == "mhc"],
    ids=lambda v: "-".join(map(str, v.values())),
)
def test_mixing_is_doubly_stochastic_after_training_steps(variant: dict) -> None:
    torch.manual_seed(0)
    layer = MultiStreamResidual(nn.Linear(8, 8), dim=8, n_streams=4, **variant)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))  # away from init, dynamic part included
    _, _, mix = layer.weights(torch.randn(3, 5, 4, 8))
    exact = variant.get("mixing") == "permutation"
    assert (mix >= 0).all()
    assert (mix.sum(-1) - 1).abs().max() < 1e-5
    assert (mix.sum(-2) - 1).abs().max() < (1e-5 if exact else 5e-2)


def test_disable_is_bitwise_the_plain_residual() -> None:
    blocks = _blocks(16, 5)
    x = torch.randn(3, 7, 16)
    stack = MultiStreamStack(blocks, dim=16, n_streams=4, disable=True)
    assert stack.n_streams == 1 and not list(
        p for n, p in stack.named_parameters() if "static" in n
    )
    assert torch.equal(stack(x), _plain(blocks, x))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_stack_equals_the_plain_residual_at_init(variant: dict) -> None:
    blocks = _blocks(16, 6)
    x = torch.randn(3, 7, 16)
    stack = MultiStreamStack(blocks, dim=16, n_streams=4, **variant)
    torch.testing.assert_close(stack(x), _plain(blocks, x), rtol=1e-5, atol=1e-5)


def test_channel_first_matches_channel_last() -> None:
    torch.manual_seed(0)
    first = MultiStreamResidual(nn.Tanh(), dim=8, n_streams=3, channel_first=True)
    last = MultiStreamResidual(nn.Tanh(), dim=8, n_streams=3)
    with torch.no_grad():
        first.dynamic_weight.normal_()
    last.load_state_dict(first.state_dict())
    streams = torch.randn(2, 3, 8, 4, 5)  # (batch, n, C, H, W)
    out_first = first(streams)
    out_last = last(streams.movedim(2, -1)).movedim(-1, 2)
    torch.testing.assert_close(out_first, out_last, rtol=1e-5, atol=1e-5)


def test_dynamic_weights_depend_on_the_input_and_static_do_not() -> None:
    torch.manual_seed(0)
    z = torch.randn(2, 5, 4, 8)
    token = MultiStreamResidual(nn.Linear(8, 8), dim=8, dynamic="token")
    pooled = MultiStreamResidual(nn.Linear(8, 8), dim=8, dynamic="pooled")
    static = MultiStreamResidual(nn.Linear(8, 8), dim=8, dynamic="none")
    for layer in (token, pooled):
        nn.init.normal_(layer.dynamic_weight)
    pre_token = token.weights(z)[0]
    pre_pooled = pooled.weights(z)[0]
    assert pre_token.shape == (2, 5, 4) and not torch.allclose(pre_token[:, 0], pre_token[:, 1])
    assert pre_pooled.shape == (2, 1, 4) and not torch.allclose(pre_pooled[0], pre_pooled[1])
    assert static.weights(z)[0].shape == (4,)


def _stream_spread_after_training(symmetric_reads: bool, steps: int) -> float:
    """Largest deviation of a stream from the stream mean at the stack's output after training."""
    torch.manual_seed(0)
    stack = MultiStreamStack(_blocks(8, 4), dim=8, n_streams=4, kind="mhc")
    if symmetric_reads:  # every sub-layer reads all streams alike: nothing breaks the symmetry
        with torch.no_grad():
            for layer in stack.layers:
                layer.pre_static.fill_(float(torch.logit(torch.tensor(0.25))))
    x, target = torch.randn(64, 8), torch.randn(64, 8)
    outputs = []
    stack.layers[-1].register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    opt = torch.optim.Adam(stack.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(stack(x), target).backward()
        opt.step()
    stack(x)
    streams = outputs[-1]
    return float((streams - streams.mean(1, keepdim=True)).abs().max())


def test_streams_diverge_with_training() -> None:
    """Streams start equal; the asymmetric reads at init (stream l mod n) make the gradients that
    reach earlier sub-layers differ per stream, so training separates them. With symmetric reads
    (the control) they stay equal up to rounding."""
    assert _stream_spread_after_training(symmetric_reads=False, steps=0) < 1e-6
    separated = _stream_spread_after_training(symmetric_reads=False, steps=100)
    control = _stream_spread_after_training(symmetric_reads=True, steps=100)
    assert separated > 1e-2 and separated > 1000 * control


@pytest.mark.parametrize("kind", ["mhc", "hyper"])
def test_composite_gain_is_one_only_for_doubly_stochastic_mixing(kind: str) -> None:
    torch.manual_seed(0)
    stack = MultiStreamStack(_blocks(8, 12), dim=8, n_streams=4, kind=kind)
    with torch.no_grad():
        for layer in stack.layers:
            layer.res_static.add_(0.5 * torch.randn(4, 4))
    if kind == "mhc":
        assert stack.composite_gain() == pytest.approx(1.0, abs=1e-4)
    else:  # unconstrained mixing compounds over depth
        assert stack.composite_gain() > 2.0


def test_parameter_overhead_of_stream_inputs() -> None:
    dim, n = 64, 4
    blocks = [nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))]
    stack = MultiStreamStack(blocks, dim=dim, n_streams=n, kind="mhc")
    base = sum(p.numel() for p in blocks[0].parameters())
    extra = sum(p.numel() for p in stack.parameters()) - base
    assert extra == dim * (n + 2) + (n + n + n * n) + 3
    flat = MultiStreamStack(blocks, dim=dim, n_streams=n, kind="mhc", dynamic_input="flat")
    extra_flat = sum(p.numel() for p in flat.parameters()) - base
    assert extra_flat == n * dim * (n * n + 2 * n) + (n + n + n * n) + 3


def test_no_weight_decay_names_exist() -> None:
    stack = MultiStreamStack(_blocks(8, 3), dim=8)
    names = dict(stack.named_parameters())
    assert stack.no_weight_decay() and stack.no_weight_decay() <= set(names)
    assert {name.split(".")[-1] for name in stack.no_weight_decay()} == {
        "pre_static",
        "post_static",
        "res_static",
        "dynamic_alpha",
    }


def test_high_learning_rate_stays_finite_for_mhc() -> None:
    torch.manual_seed(0)
    stack = MultiStreamStack(_blocks(16, 8), dim=16, n_streams=4, kind="mhc")
    opt = torch.optim.Adam(stack.parameters(), lr=5e-2)
    x, target = torch.randn(32, 16), torch.randn(32, 16)
    for _ in range(50):
        opt.zero_grad()
        loss = nn.functional.mse_loss(stack(x), target)
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(n_streams=0), "n_streams must be an integer >= 1, got 0"),
        (dict(sinkhorn_iters=0), "sinkhorn_iters must be an integer >= 1, got 0"),
        (dict(kind="hc"), "kind must be one of"),
        (dict(mixing="birkhoff"), "mixing must be one of"),
        (dict(dynamic="per_token"), "dynamic must be one of"),
        (dict(n_streams=6, mixing="permutation"), "n_streams <= 5"),
        (dict(n_streams=4, disable=True), "n_streams must be 1"),
        (dict(dim=0), "dim must be an integer >= 1"),
        (dict(dynamic_scale="1e-2"), "dynamic_scale must be a finite number, got '1e-2'"),
        (dict(dynamic_scale=None), "dynamic_scale must be a finite number, got None"),
        (dict(dynamic_scale=True), "dynamic_scale must be a finite number, got True"),
        (dict(dynamic_scale=float("inf")), "dynamic_scale must be a finite number, got inf"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    kwargs = {"dim": 4, **kwargs}
    with pytest.raises(InputError, match=match):
        MultiStreamResidual(nn.Identity(), **kwargs)


def test_bad_stream_shape_names_it() -> None:
    layer = MultiStreamResidual(nn.Identity(), dim=4, n_streams=2)
    with pytest.raises(
        ValueError, match=r"expected streams \(batch, 2, \.\.\.\), got shape \(3, 4\)"
    ):
        layer(torch.randn(3, 4))


def test_a_wrong_channel_width_names_dim() -> None:
    layer = MultiStreamResidual(nn.Linear(4, 4), dim=4, n_streams=2)
    with pytest.raises(InputError, match=r"expected dim=4 channels on the last axis"):
        layer(torch.randn(3, 2, 7, 5))
    first = MultiStreamResidual(nn.Conv2d(4, 4, 1), dim=4, n_streams=2, channel_first=True)
    assert first(torch.randn(3, 2, 4, 5, 5)).shape == (3, 2, 4, 5, 5)
    with pytest.raises(InputError, match=r"expected dim=4 channels on axis 2 \(channel_first\)"):
        first(torch.randn(3, 2, 5, 5, 4))  # channel-last streams given to a channel-first layer
    stack = MultiStreamStack([nn.Linear(4, 4)], dim=4, n_streams=2)
    with pytest.raises(InputError, match="expected dim=4"):
        stack(torch.randn(3, 7, 6))


def test_stack_rejects_empty_blocks_and_layer_index() -> None:
    with pytest.raises(ValueError, match="blocks must not be empty"):
        MultiStreamStack([], dim=4)
    with pytest.raises(ValueError, match="layer_index"):
        MultiStreamStack([nn.Identity()], dim=4, layer_index=1)


def test_gradients_reach_every_parameter() -> None:
    stack = MultiStreamStack(_blocks(8, 3), dim=8, n_streams=4, kind="mhc")
    stack(torch.randn(4, 8)).pow(2).sum().backward()
    missing = [n for n, p in stack.named_parameters() if p.grad is None]
    # the dynamic projections are zero at init but still get gradients through alpha * (x W)
    assert not missing
    for a, b in itertools.pairwise(stack.layers):
        assert a.layer_index + 1 == b.layer_index


def test_streams_are_mixed_in_fp32_under_autocast() -> None:
    """bf16 weights no longer sum to 1: under autocast the streams would drift ~1e-3 per layer."""
    stack = MultiStreamStack([_Zero() for _ in range(12)], dim=8, n_streams=4, kind="mhc")
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = stack(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


class _Zero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)
