"""Deferred state gradients (``state_grads="deferred"``): equal to autograd's, in every layout."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ada_modules.errors import InputError
from ada_modules.kernels import routed_sum_reference
from ada_modules.nn import ConnectivityRouter, ConnectivityWrapper, MLPResNet
from ada_modules.nn._ancre_deferred import GradientLedger, deferred_routed_sum, tap_state


def _graph_nodes(t: torch.Tensor) -> set[str]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo += [nxt for nxt, _ in fn.next_functions]
    return names


def _pair(**options: object) -> tuple[MLPResNet, MLPResNet]:
    """The same trunk with autograd's and with deferred state gradients, random coefficients."""
    plain = MLPResNet(8, depth=6, norm=False, **options)
    with torch.no_grad():
        for p in plain.router.parameters():
            p.normal_()
    deferred = MLPResNet(8, depth=6, norm=False, state_grads="deferred", **options)
    deferred.load_state_dict(plain.state_dict())
    return plain, deferred


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    model(x).square().mean().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return grads


def _assert_close(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "source"},
        {"mode": "input"},
        {"mode": "denseformer"},
        {"mode": "source", "dilation": 2},
        {"mode": "source", "top_k": 2},
        {"mode": "input", "top_k": 2, "dilation": 3},
        {"mode": "source", "gate": False, "lr_scale": 4.0},
    ],
    ids=str,
)
def test_gradients_equal_autograds(seed, options):
    plain, deferred = _pair(**options)
    x = torch.randn(5, 8)
    assert torch.equal(plain(x), deferred(x))  # the forward pass is the same arithmetic
    out = deferred(x.detach().requires_grad_())
    assert {"_DeferredRowBackward", "_StateTapBackward"} <= _graph_nodes(out)
    _assert_close(_grads(plain, x), _grads(deferred, x))


def test_hf_decoder_gradients_equal_autograds(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    base = LlamaForCausalLM(config)
    models = []
    for state_grads in ("autograd", "deferred"):
        model = LlamaForCausalLM(config)
        model.load_state_dict(base.state_dict())
        ConnectivityWrapper(mode="source", state_grads=state_grads)(model)
        models.append(model)
    with torch.no_grad():
        for p in models[0].model.connectivity.parameters():
            p.normal_()
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(0, 16, (2, 7))
    grads = []
    for model in models:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
        assert all(g is not None for g in grads[-1])
    assert "_DeferredRowBackward" in _graph_nodes(loss)
    _assert_close(*grads)


@pytest.mark.parametrize("mode", ["source", "input"])
def test_partial_backward_then_full_backward_counts_each_term_once(seed, mode):
    plain, deferred = _pair(mode=mode)
    x = torch.randn(5, 8)
    expected = _grads(plain, x)[1:]
    kept = []
    hook = deferred.layers[2].register_forward_hook(lambda module, args, out: kept.append(out))
    loss = deferred(x).square().mean()
    hook.remove()
    torch.autograd.grad(loss, kept[0], retain_graph=True)  # runs the later rows only
    loss.backward()
    _assert_close(expected, [p.grad for p in deferred.parameters()])


def test_retained_graph_accumulates_two_backward_passes(seed):
    plain, deferred = _pair(mode="input")
    x = torch.randn(5, 8)
    expected = [2 * g for g in _grads(plain, x)[1:]]
    loss = deferred(x).square().mean()
    loss.backward(retain_graph=True)
    loss.backward()
    _assert_close(expected, [p.grad for p in deferred.parameters()])


def test_checkpointed_blocks_fall_back_to_autograd(seed):
    plain, deferred = _pair(mode="source")
    x = torch.randn(5, 8)
    expected = _grads(plain, x)[1:]
    h = x
    for layer in deferred.layers:
        h = checkpoint(layer, h, use_reentrant=False)
    h.square().mean().backward()
    _assert_close(expected, [p.grad for p in deferred.parameters()])


def test_bfloat16_gradients_are_close_to_autograds(seed):
    plain, deferred = _pair(mode="source")
    plain, deferred = plain.bfloat16(), deferred.bfloat16()
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    for e, g in zip(_grads(plain, x), _grads(deferred, x), strict=True):
        torch.testing.assert_close(g, e, rtol=0.05, atol=0.05)


def test_the_ledger_is_released_after_the_backward_pass():
    ledger = GradientLedger()
    x0 = torch.randn(4, requires_grad=True)
    x1 = tap_state(x0.tanh(), ledger, 1)
    c = torch.tensor([0.3, -0.7], requires_grad=True)
    out = deferred_routed_sum([x0, x1], c, [0, 1], 1, 2, ledger, routed_sum_reference)
    x2 = tap_state(out * 2, ledger, 2)
    x2.sum().backward()
    expected = 2 * (0.3 + (-0.7) * (1 - x0.detach().tanh() ** 2))
    torch.testing.assert_close(x0.grad, expected)
    assert ledger._buffer is None and not ledger._pending


def test_the_ledger_takes_rows_of_one_dtype_and_size_only():
    ledger = GradientLedger()
    assert ledger.accepts(torch.zeros(2, 3))
    assert ledger.accepts(torch.ones(3, 2))  # same size: its gradients fit the buffer's rows
    assert not ledger.accepts(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert not ledger.accepts(torch.zeros(2, 4))


def test_double_backward_raises_instead_of_missing_terms(seed):
    _, deferred = _pair(mode="source")
    x = torch.randn(5, 8, requires_grad=True)
    (grad,) = torch.autograd.grad(deferred(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"state_grads": "fast"}, "state_grads must be 'autograd' or 'deferred', got 'fast'"),
        (
            {"state_grads": "deferred", "per_channel": True, "num_channels": 4},
            "per_channel=True",
        ),
    ],
)
def test_bad_state_grads_is_named(kwargs, match):
    with pytest.raises(InputError, match=match):
        ConnectivityRouter(3, **kwargs)
