"""Tests of ada_modules.fl.clients: flat parameters, client batches and vmapped client updates."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ada_modules.errors import InputError
from ada_modules.fl.clients import ClientData, client_updates, flatten_params, unflatten_params
from ada_modules.fl.partition import partition
from ada_modules.models.classifier import ImageClassifierModule

NUM_CLIENTS, BATCH = 5, 6


def _tiny_mlp(seed: int = 0) -> nn.Module:
    """The library's MLP (``architecture="mlp"``) on 8x8 inputs, one hidden layer of 7."""
    torch.manual_seed(seed)
    return ImageClassifierModule(architecture="mlp", hidden_sizes=[7], image_size=8)


def _client_data(seed: int = 0) -> ClientData:
    generator = torch.Generator().manual_seed(seed)
    sizes = [3, 10, 17, 4, 25]
    xs = [torch.rand(size, 64, generator=generator) for size in sizes]
    ys = [torch.randint(10, (size,), generator=generator) for size in sizes]
    return ClientData(xs, ys)


def client_updates_reference(model, flat, x, y, *, algorithm, lr, local_steps=1):
    """Per-client loop on a copy of the model with torch.autograd.grad."""
    updates = []
    for i in range(x.shape[0]):
        local = copy.deepcopy(model)
        vector_to_parameters(flat.clone(), local.parameters())
        steps = [(x[i], y[i])] if algorithm == "fedsgd" else list(zip(x[i], y[i], strict=True))
        for inputs, targets in steps:
            loss = nn.functional.cross_entropy(local(inputs), targets)
            grads = torch.autograd.grad(loss, list(local.parameters()))
            with torch.no_grad():
                for param, gradient in zip(local.parameters(), grads, strict=True):
                    param -= lr * gradient
        updates.append(parameters_to_vector(local.parameters()).detach() - flat)
    return torch.stack(updates)


def test_flatten_unflatten_round_trip():
    model = _tiny_mlp()
    flat = flatten_params(model)
    assert torch.equal(flat, parameters_to_vector(model.parameters()))
    assert not flat.requires_grad
    params = unflatten_params(model, flat)
    assert list(params) == [name for name, _ in model.named_parameters()]
    for (name, param), value in zip(model.named_parameters(), params.values(), strict=True):
        assert torch.equal(value, param.detach()), name
    assert torch.equal(torch.cat([p.reshape(-1) for p in params.values()]), flat)
    # functional_call with the unflattened parameters is the model itself.
    inputs = torch.rand(4, 64)
    out = torch.func.functional_call(model, unflatten_params(model, flat + 1.0), (inputs,))
    shifted = copy.deepcopy(model)
    vector_to_parameters(flat + 1.0, shifted.parameters())
    torch.testing.assert_close(out, shifted(inputs))


def test_sample_batches_shapes_membership_and_determinism():
    xs = [torch.full((size, 2), float(i)) for i, size in enumerate([1, 4, 9])]
    ys = [torch.full((size,), i) for i, size in enumerate([1, 4, 9])]
    data = ClientData(xs, ys)
    assert len(data) == 3 and data.sizes.tolist() == [1, 4, 9]
    x, y = data.sample_batches(8, torch.Generator().manual_seed(1))
    assert x.shape == (3, 8, 2) and y.shape == (3, 8)
    for i in range(3):
        assert (y[i] == i).all() and (x[i] == i).all()
    x2, y2 = data.sample_batches(8, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = data.sample_batches(8, torch.Generator().manual_seed(2), num_steps=4)
    assert x3.shape == (3, 4, 8, 2)


def test_sample_batches_covers_client_rows_uniformly():
    data = ClientData([torch.arange(5.0).unsqueeze(1)], [torch.arange(5)])
    _, y = data.sample_batches(5000, torch.Generator().manual_seed(0))
    counts = torch.bincount(y.reshape(-1), minlength=5)
    assert counts.min() > 900 and counts.max() < 1100
    _, y_a = data.sample_batches(5000, torch.Generator().manual_seed(0))
    _, y_b = data.sample_batches(5000, torch.Generator().manual_seed(1))
    assert torch.equal(y, y_a) and not torch.equal(y, y_b)


@pytest.mark.parametrize("algorithm, local_steps", [("fedsgd", 1), ("fedavg", 1), ("fedavg", 3)])
def test_vmap_updates_equal_per_client_loop(algorithm, local_steps):
    model = _tiny_mlp()
    before = copy.deepcopy(model.state_dict())
    flat = flatten_params(model) + 0.01  # global params differ from the model's own weights
    num_steps = None if algorithm == "fedsgd" else local_steps
    x, y = _client_data().sample_batches(BATCH, torch.Generator().manual_seed(0), num_steps)
    kwargs = {"algorithm": algorithm, "lr": 0.5, "local_steps": local_steps}
    updates = client_updates(model, flat, x, y, **kwargs)
    expected = client_updates_reference(model, flat, x, y, **kwargs)
    assert updates.shape == (NUM_CLIENTS, flat.numel()) and not updates.requires_grad
    torch.testing.assert_close(updates, expected, atol=1e-6, rtol=1e-5)
    assert updates.abs().max() > 1e-3
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_fedavg_one_local_step_is_fedsgd():
    model = _tiny_mlp()
    flat = flatten_params(model)
    x, y = _client_data().sample_batches(BATCH, torch.Generator().manual_seed(3), num_steps=1)
    fedavg = client_updates(model, flat, x, y, algorithm="fedavg", lr=0.2)
    fedsgd = client_updates(model, flat, x[:, 0], y[:, 0], algorithm="fedsgd", lr=0.2)
    torch.testing.assert_close(fedavg, fedsgd, atol=1e-7, rtol=1e-6)


def test_fedsgd_mean_update_is_centralised_sgd_step():
    model, lr = _tiny_mlp(), 0.3
    flat = flatten_params(model)
    x, y = _client_data().sample_batches(BATCH, torch.Generator().manual_seed(5))
    new_global = flat + client_updates(model, flat, x, y, lr=lr).mean(0)  # server_lr = 1

    central = copy.deepcopy(model)
    optimizer = torch.optim.SGD(central.parameters(), lr=lr)
    loss = nn.functional.cross_entropy(central(x.reshape(-1, 64)), y.reshape(-1))
    loss.backward()
    optimizer.step()
    torch.testing.assert_close(new_global, flatten_params(central), atol=1e-6, rtol=1e-5)


def test_digits_partition_to_updates():
    from ada_modules.data.digits import DigitsDataModule

    dm = DigitsDataModule(seed=0)
    dm.setup("fit")
    x, y = dm.datasets["train"].tensors
    parts = partition(y, 8, scheme="dirichlet", alpha=0.3, seed=0, min_size=5)
    data = ClientData.from_partition(x, y, parts)
    assert data.sizes.tolist() == [len(p) for p in parts]
    xb, yb = data.sample_batches(16, torch.Generator().manual_seed(0), num_steps=2)
    model = _tiny_mlp()
    updates = client_updates(
        model, flatten_params(model), xb, yb, algorithm="fedavg", local_steps=2
    )
    assert updates.shape == (8, flatten_params(model).numel()) and updates.isfinite().all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"algorithm": "fedprox"},
            r"algorithm must be one of \('fedsgd', 'fedavg'\), got 'fedprox'",
        ),
        ({"lr": 0.0}, "lr must be a finite number > 0, got 0.0"),
        ({"lr": float("nan")}, "lr must be a finite number > 0"),
        ({"local_steps": 0}, "local_steps must be an integer >= 1, got 0"),
        ({"local_steps": 2}, "local_steps must be 1 with algorithm='fedsgd', got 2"),
        ({"flat": torch.zeros(3)}, r"flat_params must be a floating 1-D tensor of shape \(535,\)"),
        ({"x": torch.zeros(5)}, r"got shapes \(5,\) and \(5, 6\)"),
        ({"x": torch.zeros(5, 7, 64)}, r"got shapes \(5, 7, 64\) and \(5, 6\)"),
        ({"y": torch.zeros(4, 6, dtype=torch.long)}, r"got shapes \(5, 6, 64\) and \(4, 6\)"),
        ({"y": torch.zeros(5, 3, dtype=torch.long)}, r"leading dimensions \(n, B, \.\.\.\)"),
        (
            {"algorithm": "fedavg", "local_steps": 2},
            r"\(n, local_steps=2, B, \.\.\.\), got shapes \(5, 6, 64\) and \(5, 6\)",
        ),
    ],
)
def test_client_updates_bad_input(kwargs, match):
    model = _tiny_mlp()
    args = {
        "flat": flatten_params(model),
        "x": torch.zeros(NUM_CLIENTS, BATCH, 64),
        "y": torch.zeros(NUM_CLIENTS, BATCH, dtype=torch.long),
        **kwargs,
    }
    flat, x, y = args.pop("flat"), args.pop("x"), args.pop("y")
    with pytest.raises(InputError, match=match):
        client_updates(model, flat, x, y, **args)


def test_client_data_and_flat_bad_input():
    model = _tiny_mlp()
    with pytest.raises(InputError, match=r"flat must be a floating 1-D tensor of shape \(535,\)"):
        unflatten_params(model, torch.zeros(535, dtype=torch.long))
    with pytest.raises(InputError, match="model must have parameters"):
        flatten_params(nn.ReLU())
    with pytest.raises(InputError, match="equally long, non-empty lists, got 2 and 1"):
        ClientData([torch.zeros(2, 3)] * 2, [torch.zeros(2)])
    with pytest.raises(InputError, match="xs must share one per-sample shape"):
        ClientData([torch.zeros(2, 3), torch.zeros(2, 4)], [torch.zeros(2)] * 2)
    with pytest.raises(InputError, match=r"client 1: .* got shapes \(0, 3\) and \(0,\)"):
        ClientData([torch.zeros(2, 3), torch.zeros(0, 3)], [torch.zeros(2), torch.zeros(0)])
    data = ClientData([torch.zeros(2, 3)], [torch.zeros(2)])
    with pytest.raises(InputError, match="batch_size must be an integer >= 1, got 0"):
        data.sample_batches(0)
    with pytest.raises(InputError, match="num_steps must be an integer >= 1, got 0"):
        data.sample_batches(2, num_steps=0)
