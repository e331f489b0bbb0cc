"""ANCReStack / ConnectivityRouter: identity at init, routing, hard export, memory, bad input."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ada_modules.errors import InputError
from ada_modules.nn import ANCReStack, ConnectivityRouter, MLPResNet, export_hard, find_routers

ROUTED = ("source", "input", "denseformer")


def _branches(depth: int = 6, width: int = 8) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]


class _Residual(nn.Module):
    """A block that adds its own input, like an HF decoder layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * torch.tanh(self.linear(x))


def _plain(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = x + block(x)
    return x


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        (mode, options)
        for mode in ROUTED
        for options in (
            {},
            {"per_channel": True, "num_channels": 8},
            {"dilation": 2},
            {"top_k": 2},
            {"lr_scale": 8.0},
        )
        if not (mode == "denseformer" and "top_k" in options)  # top_k: softmax modes only
    ],
)
def test_bitwise_identity_to_the_plain_residual_stack_at_init(seed, mode, options):
    blocks = _branches()
    x = torch.randn(3, 5, 8)
    stack = ANCReStack(blocks, mode=mode, residual_in_block=False, **options)
    assert torch.equal(stack(x), _plain(blocks, x))


@pytest.mark.parametrize("mode", ROUTED)
def test_identity_with_blocks_that_add_their_input_and_take_extra_arguments(seed, mode):
    blocks = [_Residual(8) for _ in range(5)]
    x = torch.randn(4, 8)
    expected = x
    for block in blocks:
        expected = block(expected, scale=0.5)
    assert torch.equal(ANCReStack(blocks, mode=mode)(x, scale=0.5), expected)


def test_coefficients_get_gradients_once_the_gate_moves(seed):
    stack = ANCReStack(_branches(), mode="source", residual_in_block=False)
    x = torch.randn(4, 8)
    stack(x).square().sum().backward()
    assert stack.router.gate.grad.abs().sum() > 0
    assert stack.router.logits.grad.abs().sum() == 0  # gate = 0: no logit gradient yet
    with torch.no_grad():
        stack.router.gate.fill_(0.5)
    stack.zero_grad()
    stack(x).square().sum().backward()
    assert stack.router.logits.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["source", "denseformer", "rezero"])
def test_lr_scale_multiplies_the_coefficients_adam_step(seed, mode):
    # Same function of the used coefficients; one Adam step moves them lr_scale times as far.
    x = torch.randn(4, 8)
    moved = []
    for lr_scale in (1.0, 8.0):
        torch.manual_seed(0)
        stack = ANCReStack(_branches(), mode=mode, residual_in_block=False, lr_scale=lr_scale)
        if mode == "source":
            with torch.no_grad():
                stack.router.gate.fill_(0.5 / lr_scale)  # used gate 0.5: logits get gradients
        before = stack.connectivity()
        optimizer = torch.optim.Adam(stack.router.parameters(), lr=1e-3)
        stack(x).square().sum().backward()
        optimizer.step()
        moved.append((stack.connectivity() - before).abs().sum().item())
        if mode == "rezero":  # its connectivity is fixed; alpha is the coefficient
            moved[-1] = (stack.router.alpha * lr_scale).abs().sum().item()
    assert moved[0] > 0
    assert moved[1] == pytest.approx(8 * moved[0], rel=0.05)


def test_source_routing_matches_the_formula(seed):
    blocks = _branches(depth=3)
    stack = ANCReStack(blocks, mode="source", residual_in_block=False, temperature=0.5)
    with torch.no_grad():
        stack.router.logits.copy_(torch.randn_like(stack.router.logits))
        stack.router.gate.copy_(torch.tensor([0.7, 1.3]))
    x = torch.randn(2, 8)
    states = [x]
    logits = stack.router.logits.detach()
    rows = {1: logits[0:2], 2: logits[2:5]}
    gates = {1: 0.7, 2: 1.3}
    for i, block in enumerate(blocks):
        out = states[-1] + block(states[-1])
        if i in rows:
            a = torch.softmax(rows[i] / 0.5, dim=0)
            mix = sum(a[j] * states[j] for j in range(i + 1))
            out = out + gates[i] * (mix - states[-1])
        states.append(out)
    torch.testing.assert_close(stack(x), states[-1])
    matrix = stack.connectivity()
    assert matrix.shape == (3, 4)
    torch.testing.assert_close(matrix.sum(dim=1), torch.ones(3))


def test_input_routing_mixes_block_inputs_and_the_output(seed):
    blocks = _branches(depth=2)
    stack = ANCReStack(blocks, mode="input", residual_in_block=False, gate=False)
    with torch.no_grad():
        stack.router.logits.copy_(torch.tensor([0.3, -0.2, 1.0, 0.0, 0.5]))
    x = torch.randn(2, 8)
    y1 = x + blocks[0](x)
    a1 = torch.softmax(torch.tensor([0.3, -0.2]), dim=0)
    h1 = a1[0] * x + a1[1] * y1
    y2 = h1 + blocks[1](h1)
    a2 = torch.softmax(torch.tensor([1.0, 0.0, 0.5]), dim=0)
    expected = a2[0] * x + a2[1] * y1 + a2[2] * y2
    torch.testing.assert_close(stack(x), expected)
    assert stack.connectivity().shape == (3, 3)


def test_rezero_starts_as_the_identity_map(seed):
    stack = ANCReStack(_branches(), mode="rezero", residual_in_block=False)
    x = torch.randn(2, 8)
    assert torch.equal(stack(x), x)


def test_gate_off_is_close_to_residual_with_a_large_previous_logit(seed):
    blocks = _branches()
    x = torch.randn(2, 8)
    stack = ANCReStack(blocks, mode="source", residual_in_block=False, gate=False, prev_logit=20)
    torch.testing.assert_close(stack(x), _plain(blocks, x))
    far = ANCReStack(blocks, mode="source", residual_in_block=False, gate=False)
    assert not torch.allclose(far(x), _plain(blocks, x))


def test_dilation_and_top_k_restrict_the_sources(seed):
    dilated = ConnectivityRouter(8, mode="source", dilation=3)
    assert dilated._rows[7] == [1, 4, 7]
    full = ConnectivityRouter(8, mode="source")
    assert dilated.logits.numel() < full.logits.numel() == 8 * 9 // 2 - 1
    stack = ANCReStack(_branches(), mode="source", residual_in_block=False, top_k=2)
    with torch.no_grad():
        stack.router.logits.copy_(torch.randn_like(stack.router.logits))
        stack.router.gate.fill_(1.0)
    matrix = stack.connectivity()
    assert ((matrix.abs() > 0).sum(dim=1) <= 2).all()


def test_temperature_annealing_is_geometric_and_counts_training_steps(seed):
    stack = ANCReStack(
        _branches(2),
        residual_in_block=False,
        temperature=1.0,
        final_temperature=0.1,
        anneal_steps=10,
    )
    x = torch.randn(2, 8)
    for _ in range(5):
        stack(x)
    assert stack.router.current_temperature() == pytest.approx(0.1**0.5)
    stack.eval()
    stack(x)
    assert int(stack.router.step) == 5
    stack.train()
    for _ in range(10):
        stack(x)
    assert stack.router.current_temperature() == pytest.approx(0.1)


@pytest.mark.parametrize("mode", ["source", "input"])
def test_export_hard_keeps_the_strongest_source(seed, mode):
    blocks = _branches(depth=4)
    stack = ANCReStack(blocks, mode=mode, residual_in_block=False, gate=False, temperature=0.01)
    with torch.no_grad():  # near one-hot rows whose strongest source is the stack input
        stack.router.logits.fill_(0.0)
        for r in stack.router._rows:
            stack.router.logits[stack.router._offsets[r]] = 1.0
    x = torch.randn(3, 8)
    soft = stack(x)
    export_hard(stack)
    assert stack.router.hard and not list(stack.router.parameters())
    torch.testing.assert_close(stack(x), soft)
    # and the hard stack is exactly the hand-written network with those shortcuts
    states = [x]
    for i, block in enumerate(blocks):
        if mode == "source":
            y = states[-1] + block(states[-1])  # B(x_i) + x_s - x_i, as the export computes it
            states.append(y + (states[0] - states[-1]) if i else y)
        else:
            h = states[0]
            states.append(h + block(h))
    expected = states[-1] if mode == "source" else states[0]
    assert torch.equal(stack(x), expected)


def test_export_hard_at_init_is_the_residual_network(seed):
    blocks = _branches()
    x = torch.randn(2, 8)
    stack = ANCReStack(blocks, mode="source", residual_in_block=False).export_hard()
    assert torch.equal(stack(x), _plain(blocks, x))
    assert torch.equal(stack.connectivity(), ConnectivityRouter(6, mode="residual").connectivity())
    assert stack.router._passes.current is None  # no state kept after the pass


def test_export_hard_rejects_modes_without_a_source_choice():
    with pytest.raises(ValueError, match="export_hard"):
        ANCReStack(_branches(2), mode="denseformer", residual_in_block=False).export_hard()


def test_states_are_released_after_the_forward_pass_and_never_stacked(seed):
    stack = ANCReStack(_branches(), mode="source", residual_in_block=False)
    stack(torch.randn(2, 8))
    assert stack.router._passes.current is None and not stack.router._passes.kept
    calls = []
    original = torch.stack

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    torch.stack = spy
    try:
        stack(torch.randn(2, 8)).sum().backward()
    finally:
        torch.stack = original
    assert not calls


def _moved(stack: ANCReStack) -> ANCReStack:
    """Non-zero coefficients everywhere, so that every routed term carries gradient."""
    with torch.no_grad():
        for param in stack.router.parameters():
            param.add_(0.5 * torch.randn_like(param))
    return stack


def _checkpointed(stack: ANCReStack, x: torch.Tensor, every: int | str) -> torch.Tensor:
    """Run ``stack`` with its blocks in non-reentrant checkpoints of ``every`` blocks, or in one
    checkpoint of the ``"whole"`` stack, or of an op before the stack and the stack (``"from
    before"``: the checkpoint does not save the stack's input)."""
    if every == "whole":
        return checkpoint(stack, x, use_reentrant=False)
    if every == "from before":
        return checkpoint(lambda t: stack(t * 1.0), x, use_reentrant=False)
    layers = list(stack.layers)

    def segment(t: torch.Tensor, start: int) -> torch.Tensor:
        for layer in layers[start : start + every]:
            t = layer(t)
        return t

    for start in range(0, len(layers), every):
        x = checkpoint(segment, x, start, use_reentrant=False)
    return x


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [param.grad.clone() for param in module.parameters()]


def _assert_same_training(
    reference: ANCReStack, every: int | str, forwards: int = 2, steps: int = 2
) -> ANCReStack:
    """Train a copy of ``reference`` under checkpointing next to it (``forwards`` forward passes
    per backward pass): the gradients (coefficients and inputs included) are the same."""
    checkpointed = copy.deepcopy(reference)
    for _ in range(steps):
        inputs = [torch.randn(3, 8, requires_grad=True) for _ in range(forwards)]
        ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
        losses = [_checkpointed(checkpointed, x, every).square().sum() for x in inputs]
        sum((k + 1) * loss for k, loss in enumerate(losses)).backward()
        losses = [reference(x).square().sum() for x in ref_inputs]
        sum((k + 1) * loss for k, loss in enumerate(losses)).backward()
        got = _grads(checkpointed) + [x.grad for x in inputs]
        want = _grads(reference) + [x.grad for x in ref_inputs]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        for module in (reference, checkpointed):
            with torch.no_grad():
                for param in module.parameters():
                    param.sub_(0.1 * param.grad)
                    param.grad = None
    return checkpointed


_CHECKPOINTED = (
    [
        pytest.param(mode, {}, every, id=f"{mode}-{str(every).replace(' ', '_')}")
        for mode in ("source", "input")
        for every in (1, 2, "whole", "from before")
    ]
    + [
        pytest.param("denseformer", {"dilation": 2}, 2, id="denseformer_dilated-2"),
        pytest.param("rezero", {}, 2, id="rezero-2"),
        pytest.param(
            "source", {"top_k": 2, "per_channel": True, "num_channels": 8}, 1, id="top_k-1"
        ),
    ]
    + [  # the fused routed-sum kernel (the interpreter on CPU)
        pytest.param(
            mode, {"impl": "triton"}, every, id=f"{mode}_fused-{every}", marks=pytest.mark.triton
        )
        for mode, every in (("source", 2), ("input", "whole"))
    ]
)


@pytest.mark.parametrize(("mode", "options", "every"), _CHECKPOINTED)
def test_gradient_checkpointing_gives_the_same_gradients(seed, mode, options, every):
    stack = ANCReStack(_branches(), mode=mode, residual_in_block=False, **options)
    _assert_same_training(_moved(stack), every)


@pytest.mark.parametrize("every", [1, 2, "whole"], ids=["per_block", "pairs", "whole"])
def test_gradient_checkpointing_recomputes_with_the_temperature_of_the_pass(seed, every):
    stack = ANCReStack(
        _branches(), mode="input", residual_in_block=False, final_temperature=0.2, anneal_steps=4
    )
    checkpointed = _assert_same_training(_moved(stack), every)  # 2 passes, then the backward
    assert int(checkpointed.router.step) == int(stack.router.step) == 4  # the forwards only


def test_gradient_checkpointing_of_a_hard_export_and_a_retained_graph(seed):
    reference = _moved(ANCReStack(_branches(), mode="source", residual_in_block=False))
    with torch.no_grad():  # re-route blocks 3 and 5 to earlier states
        reference.router.gate.fill_(1.0)
        reference.router.logits[reference.router._offsets[3]] = 5.0
        reference.router.logits[reference.router._offsets[5] + 2] = 5.0
    checkpointed = copy.deepcopy(reference)
    x = torch.randn(3, 8)
    for stack in (reference, checkpointed):
        loss = _checkpointed(stack, x, 1 if stack is checkpointed else "whole").sum()
        loss.backward(retain_graph=True)
        loss.backward()  # a second backward recomputes the blocks again
    for got, want in zip(_grads(checkpointed), _grads(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    hard_sources = export_hard(reference).router.hard_sources.tolist()
    assert hard_sources[3] == 0 and hard_sources[5] == 2
    reference.zero_grad()
    checkpointed = copy.deepcopy(reference)
    x = torch.randn(3, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    _checkpointed(checkpointed, x, 1).square().sum().backward()
    reference(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-7)
    for got, want in zip(_grads(checkpointed), _grads(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_checkpointed_states_are_kept_only_until_the_backward_or_the_graph_is_freed(seed):
    stack = _moved(ANCReStack(_branches(), mode="source", residual_in_block=False))
    passes = stack.router._passes
    stack(torch.randn(2, 8)).sum().backward()  # without checkpointing: nothing kept
    assert passes.current is None and not passes.kept
    out = _checkpointed(stack, torch.randn(2, 8), 1)
    assert len(passes.kept) == 1 and len(next(iter(passes.kept.values())).states) == 7
    out.sum().backward()
    assert not passes.kept and passes.recomputing is None
    out = _checkpointed(stack, torch.randn(2, 8), 1)  # a graph freed without a backward
    assert len(passes.kept) == 1
    del out
    assert not passes.kept
    with torch.no_grad():  # no graph, nothing to recompute
        _checkpointed(stack, torch.randn(2, 8), 1)
    assert not passes.kept


def test_reentrant_checkpointing_raises_instead_of_dropping_gradients(seed):
    stack = _moved(ANCReStack(_branches(3), mode="source", residual_in_block=False))
    x = torch.randn(2, 8, requires_grad=True)
    for layer in stack.layers:
        x = checkpoint(layer, x, use_reentrant=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        x.sum().backward()


def test_no_weight_decay_names_the_coefficients_and_they_are_one_dimensional():
    stack = ANCReStack(_branches(), mode="source", residual_in_block=False)
    names = stack.no_weight_decay()
    assert names == {"router.logits", "router.gate"}
    params = dict(stack.named_parameters())
    assert all(params[name].ndim == 1 for name in names)
    assert {name for name, _ in find_routers(stack)} == {"router"}


def test_parameter_overhead_is_quadratic_in_depth_only():
    trunk = MLPResNet(64, depth=16, mode="source")
    extra = sum(p.numel() for p in trunk.router.parameters())
    assert extra == 16 * 17 // 2 - 1 + 15
    blocks = sum(p.numel() for p in trunk.layers.parameters())
    assert extra / blocks < 0.01


def test_an_unnormalised_trunk_is_the_plain_residual_mlp_at_init(seed):
    trunk = MLPResNet(8, depth=3, norm=False, mode="source")
    assert not any(isinstance(m, nn.LayerNorm) for m in trunk.modules())
    x = torch.randn(4, 8)
    y = x
    for layer in trunk.layers:
        first, _, second = layer.block
        y = y + second(torch.relu(first(y)))
    torch.testing.assert_close(trunk(x), y)
    assert any(isinstance(m, nn.LayerNorm) for m in MLPResNet(8, depth=3).modules())
    with pytest.raises(ValueError, match="norm must be True or False, got 'no'"):
        MLPResNet(8, depth=3, norm="no")


def test_entropies_are_zero_for_one_hot_rows_and_positive_when_mixing(seed):
    stack = ANCReStack(_branches(3), mode="source", residual_in_block=False)
    assert torch.equal(stack.router.entropies(), torch.zeros(3))
    with torch.no_grad():
        stack.router.gate.fill_(0.5)
    assert (stack.router.entropies()[1:] > 0).all()


def test_a_block_that_changes_the_shape_is_named():
    stack = ANCReStack([nn.Linear(4, 4), nn.Linear(4, 3)], residual_in_block=False)
    with pytest.raises(ValueError, match="block 1 \\(Linear\\)"):
        stack(torch.randn(2, 4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"final_temperature": 0.0, "anneal_steps": 5}, "final_temperature"),
        ({"final_temperature": 0.1}, "anneal_steps"),
        ({"dilation": 0}, "dilation"),
        ({"top_k": 0}, "top_k"),
        ({"mode": "dense"}, "mode"),
        ({"per_channel": True}, "num_channels"),
        ({"anneal_steps": -1}, "anneal_steps"),
        ({"lr_scale": 0.0}, "lr_scale"),
        ({"lr_scale": math.inf}, "lr_scale must be a finite number > 0, got inf"),
        ({"lr_scale": math.nan}, "lr_scale must be a finite number > 0, got nan"),
        ({"prev_logit": math.nan}, "prev_logit must be a finite number, got nan"),
        ({"prev_logit": math.inf}, "prev_logit must be a finite number, got inf"),
        ({"temperature": math.inf}, "temperature must be a finite number > 0, got inf"),
        ({"channel_dim": 1.0}, "channel_dim must be an integer, got 1.0"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ANCReStack(_branches(2), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_channels": 8, "channel_dim": 2}, r"channel_dim=2 is out of range for states of"),
        ({"num_channels": 5}, r"num_channels=5, but the states have 8 channels on dim -1"),
    ],
)
def test_per_channel_sizes_that_do_not_fit_the_states_are_named(kwargs, match):
    stack = ANCReStack(
        _branches(2), mode="input", residual_in_block=False, per_channel=True, **kwargs
    )
    with pytest.raises(InputError, match=match):
        stack(torch.randn(2, 8))


def test_empty_stacks_and_non_modules_are_rejected():
    with pytest.raises(ValueError, match="blocks must not be empty"):
        ANCReStack([])
    with pytest.raises(TypeError, match="block 1"):
        ANCReStack([nn.Identity(), "relu"])
    with pytest.raises(ValueError, match="num_layers"):
        ConnectivityRouter(0)
