"""aNCA: the deformable perception against torchvision, the plain NCA at init, bad input."""

import numpy as np
import pytest
import torch
from torchvision.ops import deform_conv2d

from ada_modules.errors import InputError
from ada_modules.nn.anca import (
    DeformablePerception,
    NeuralCellularAutomaton,
    deform_conv2d_reference,
)


@pytest.mark.parametrize("with_mask", [True, False])
@pytest.mark.parametrize(("height", "width", "padding"), [(7, 9, 1), (5, 5, 0), (1, 6, 1)])
def test_reference_matches_torchvision(with_mask, height, width, padding):
    generator = torch.Generator().manual_seed(height * width + padding)
    x = torch.randn(2, 5, height, width, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 5, 3, 3, generator=generator, dtype=torch.float64)
    bias = torch.randn(4, generator=generator, dtype=torch.float64)
    out_h, out_w = height + 2 * padding - 2, width + 2 * padding - 2
    # offsets of up to +-3 cells: many taps land between cells and some outside the grid
    offset = 3 * torch.randn(2, 18, out_h, out_w, generator=generator, dtype=torch.float64)
    mask = torch.rand(2, 9, out_h, out_w, generator=generator, dtype=torch.float64)
    mask = mask if with_mask else None
    expected = deform_conv2d(x, offset, weight, bias, padding=(padding, padding), mask=mask)
    actual = deform_conv2d_reference(x, offset, weight, bias, mask=mask, padding=padding)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10)


def test_reference_gradients_match_torchvision():
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(1, 3, 6, 6, generator=generator, dtype=torch.float64),
        0.7 * torch.randn(1, 18, 6, 6, generator=generator, dtype=torch.float64),
        torch.randn(2, 3, 3, 3, generator=generator, dtype=torch.float64),
        torch.rand(1, 9, 6, 6, generator=generator, dtype=torch.float64),
    ]
    grads = []
    for function in (deform_conv2d, deform_conv2d_reference):
        leaves = [t.clone().requires_grad_() for t in tensors]
        x, offset, weight, mask = leaves
        if function is deform_conv2d:
            out = function(x, offset, weight, padding=(1, 1), mask=mask)
        else:
            out = function(x, offset, weight, mask=mask, padding=1)
        out.pow(2).sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-8, atol=1e-8)


def _pair(**kwargs):
    torch.manual_seed(0)
    anca = NeuralCellularAutomaton(3, 2, state_channels=8, hidden_channels=16, **kwargs)
    plain = NeuralCellularAutomaton(
        3, 2, state_channels=8, hidden_channels=16, deformable=False, **kwargs
    )
    missing, unexpected = plain.load_state_dict(anca.state_dict(), strict=False)
    assert not missing and unexpected  # the offset and modulation layers only
    assert all(key.startswith("perception.") for key in unexpected)
    return anca, plain


@pytest.mark.parametrize("backend", ["torchvision", "grid_sample"])
@pytest.mark.parametrize("fire_rate", [1.0, 0.5])
def test_zero_offset_anca_equals_the_plain_nca(backend, fire_rate):
    anca, plain = _pair(backend=backend, fire_rate=fire_rate)
    inputs = torch.randn(2, 3, 9, 9)
    torch.manual_seed(1)
    ours = anca(inputs, steps=6, all_steps=True)
    torch.manual_seed(1)
    theirs = plain(inputs, steps=6, all_steps=True)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert ours.abs().max() > 0.01  # not trivially zero


def test_backends_agree_on_outputs_and_gradients_once_the_taps_move():
    torch.manual_seed(0)
    nca = NeuralCellularAutomaton(3, 2, state_channels=8, hidden_channels=16)
    for layer in (nca.perception.offsets, nca.perception.modulation):
        torch.nn.init.normal_(layer.weight, std=0.3)
    inputs = torch.randn(2, 3, 7, 7)
    results = []
    for backend in ("torchvision", "grid_sample"):
        nca.perception.backend = backend
        nca.zero_grad()
        out = nca(inputs, steps=4)
        out.square().sum().backward()
        results.append((out, nca.perception.offsets.weight.grad.clone()))
    (out_tv, grad_tv), (out_gs, grad_gs) = results
    torch.testing.assert_close(out_gs, out_tv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_gs, grad_tv, rtol=1e-3, atol=1e-3)
    assert grad_gs.abs().max() > 0  # the offsets learn


def test_offsets_are_bounded_and_modulation_starts_at_one():
    perception = DeformablePerception(4, 8, max_offset=1.5)
    x = torch.randn(1, 4, 5, 5)
    offset, mask = perception.sampling(x)
    assert offset.abs().max() == 0 and torch.equal(mask, torch.ones_like(mask))
    torch.nn.init.normal_(perception.offsets.weight, std=100.0)
    offset, _ = perception.sampling(x)
    assert offset.abs().max() <= 1.5 and offset.abs().max() > 1.0


def test_one_rule_runs_any_grid_and_the_last_step_is_the_output():
    torch.manual_seed(0)
    nca = NeuralCellularAutomaton(3, 2, state_channels=8, hidden_channels=16)
    for side in (5, 11, 17):
        inputs = torch.randn(1, 3, side, side)
        every = nca(inputs, steps=3, all_steps=True)
        assert every.shape == (3, 1, 2, side, side)
        torch.testing.assert_close(every[-1], nca(inputs, steps=3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"in_channels": 0}, "in_channels must be an integer >= 1, got 0"),
        ({"fire_rate": 0.0}, "fire_rate must be a number in (0, 1], got 0.0"),
        ({"max_offset": 0}, "max_offset must be a finite number > 0, got 0"),
        ({"max_offset": float("inf")}, "max_offset must be a finite number > 0, got inf"),
        ({"deformable": "no"}, "deformable must be True or False, got 'no'"),
        ({"modulation": 1}, "modulation must be True or False, got 1"),
        ({"backend": "cuda"}, "backend must be 'auto', 'torchvision' or 'grid_sample'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("]", r"\]")):
        NeuralCellularAutomaton(**{"in_channels": 3, "out_channels": 2, **kwargs})


def test_numpy_integers_are_integers():
    torch.manual_seed(0)
    nca = NeuralCellularAutomaton(np.int64(3), np.int64(2), state_channels=np.int32(4))
    torch.manual_seed(0)
    same = NeuralCellularAutomaton(3, 2, state_channels=4)
    inputs = torch.randn(1, 3, 5, 5)
    assert torch.equal(nca(inputs, steps=np.int64(2)), same(inputs, steps=2))


def test_bad_forward_input():
    nca = NeuralCellularAutomaton(3, 2, state_channels=4, hidden_channels=8)
    with pytest.raises(InputError, match=r"inputs must have shape \(batch, 3, height, width\)"):
        nca(torch.zeros(1, 4, 5, 5), steps=2)
    with pytest.raises(InputError, match="steps must be an integer >= 1, got 0"):
        nca(torch.zeros(1, 3, 5, 5), steps=0)


def test_reference_names_a_mask_or_bias_of_the_wrong_shape():
    x, weight, offset = torch.zeros(1, 2, 4, 4), torch.zeros(3, 2, 3, 3), torch.zeros(1, 18, 4, 4)
    with pytest.raises(InputError, match=r"mask must have shape \(1, 9, 4, 4\), got \(1, 9, 4\)"):
        deform_conv2d_reference(x, offset, weight, mask=torch.zeros(1, 9, 4), padding=1)
    with pytest.raises(InputError, match=r"bias must have shape \(3,\), got \(2,\)"):
        deform_conv2d_reference(x, offset, weight, bias=torch.zeros(2), padding=1)
