import pytest
import torch

from ada_modules.nn.moe import MoELayer, StackedExperts, load_balancing_loss


def test_output_shapes_and_routing_picks_the_top_two(seed):
    layer = MoELayer(d_model=16, d_ff=32, num_experts=8, top_k=2)
    x = torch.randn(3, 7, 16)
    y, aux = layer(x)
    assert y.shape == x.shape and aux.ndim == 0
    routing = layer.route(x.reshape(-1, 16))
    probs = torch.softmax(layer.router(x.reshape(-1, 16)), dim=-1)
    expected = probs.argsort(dim=-1, descending=True)[:, :2]
    assert torch.equal(routing.indices, expected)
    assert torch.allclose(routing.probs, probs)
    assert torch.allclose(routing.weights.sum(-1), torch.ones(21))
    top = probs.gather(1, expected)
    assert torch.allclose(routing.weights, top / top.sum(-1, keepdim=True))


def test_unnormalized_weights_are_the_router_probabilities(seed):
    layer = MoELayer(d_model=8, d_ff=8, num_experts=4, top_k=2, normalize_weights=False)
    x = torch.randn(5, 8)
    routing = layer.route(x)
    assert torch.allclose(routing.weights, routing.probs.gather(1, routing.indices))


def test_output_is_the_weighted_sum_of_the_chosen_experts(seed):
    layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2)
    x = torch.randn(6, 8)
    y, _ = layer(x)
    routing = layer.route(x)
    for t in range(6):
        manual = sum(
            routing.weights[t, j]
            * layer.experts.expert(int(routing.indices[t, j]), x[t : t + 1])[0]
            for j in range(2)
        )
        assert torch.allclose(y[t], manual, atol=1e-6)


def test_aux_loss_on_a_hand_built_routing():
    # 4 tokens, 4 experts, top-2: assignments e0 x3, e1 x2, e2 x2, e3 x1 of 8.
    probs = torch.tensor(
        [
            [0.4, 0.3, 0.2, 0.1],
            [0.4, 0.1, 0.4, 0.1],
            [0.25, 0.25, 0.25, 0.25],
            [0.1, 0.2, 0.3, 0.4],
        ]
    )
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 2]])
    # mean probabilities 0.2875, 0.2125, 0.2875, 0.2125
    expected = 4 * (3 / 8 * 0.2875 + 2 / 8 * 0.2125 + 2 / 8 * 0.2875 + 1 / 8 * 0.2125)
    assert load_balancing_loss(probs, indices, 4).item() == pytest.approx(expected)
    uniform = torch.full((4, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert load_balancing_loss(uniform, balanced, 4).item() == pytest.approx(1.0)
    collapsed = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 4)
    assert load_balancing_loss(collapsed, torch.zeros(4, 1, dtype=torch.long), 4).item() == 4.0


def test_gradient_reaches_every_used_expert_and_the_router(seed):
    layer = MoELayer(d_model=8, d_ff=16, num_experts=8, top_k=2)
    x = torch.randn(64, 8)
    y, aux = layer(x)
    (y.square().mean() + aux).backward()
    used = layer.route(x).indices.unique()
    grad_norm = layer.experts.w_in.grad.flatten(1).norm(dim=1)
    assert (grad_norm[used] > 0).all()
    unused = torch.ones(8, dtype=torch.bool)
    unused[used] = False
    assert (grad_norm[unused] == 0).all()
    assert layer.experts.w_out.grad.flatten(1).norm(dim=1)[used].gt(0).all()
    assert layer.router.weight.grad.abs().sum() > 0


def test_aux_loss_gradient_flows_only_through_the_probabilities(seed):
    layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2)
    _, aux = layer(torch.randn(16, 8))
    aux.backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.experts.w_in.grad is None


def test_bfloat16_layer_runs(seed):
    layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2).to(torch.bfloat16)
    y, aux = layer(torch.randn(4, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and aux.dtype == torch.float32


def test_experts_are_stacked_parameters():
    layer = MoELayer(d_model=8, d_ff=16, num_experts=8, top_k=2)
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {
        "router.weight": (8, 8),
        "experts.w_in": (8, 8, 16),
        "experts.w_out": (8, 16, 8),
    }


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 9}, "top_k=9 must not exceed num_experts=8"),
        ({"top_k": 0}, "top_k must be a positive integer"),
        ({"num_experts": 0}, "num_experts must be a positive integer"),
        ({"d_model": 2.5}, "d_model must be a positive integer"),
        ({"d_ff": True}, "d_ff must be a positive integer"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoELayer(**{"d_model": 8, "d_ff": 16, **kwargs})


def test_bad_inputs():
    layer = MoELayer(d_model=8, d_ff=16, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="last dimension d_model=8"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match="probs must have shape"):
        load_balancing_loss(torch.rand(3, 5), torch.zeros(3, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="indices must have shape"):
        load_balancing_loss(torch.rand(3, 4), torch.zeros(2, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="num_experts"):
        StackedExperts(0, 8, 8)
