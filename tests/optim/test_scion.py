"""Scion / uSCG: hand-computed steps, descent on least squares, resume and bad input."""

import copy
import math

import pytest
import torch

from ada_modules.optim.lmo import get_norm
from ada_modules.optim.newton_schulz import newton_schulz
from ada_modules.optim.scion import Scion


def _param(*values: float) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values))


@pytest.mark.parametrize("unconstrained", [False, True])
def test_one_step_by_hand_sign_and_rms(unconstrained: bool) -> None:
    w = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [0.5, 0.0]]))
    b = _param(3.0, 4.0)
    opt = Scion(
        [{"params": [w], "norm": "sign", "norm_kwargs": {"normalized": False}}, {"params": [b]}],
        lr=0.1,
        momentum=0.5,
        radius=2.0,
        unconstrained=unconstrained,
    )
    w.grad = torch.tensor([[0.3, -0.1], [0.0, 2.0]])
    b.grad = torch.tensor([3.0, -4.0])
    opt.step()
    shrink = 1.0 if unconstrained else 0.9
    # d = 0.5 g; sign lmo = -sign(d); step 0.1 * 2.0.
    expected_w = shrink * torch.tensor([[1.0, -2.0], [0.5, 0.0]]) + 0.2 * torch.tensor(
        [[-1.0, 1.0], [0.0, -1.0]]
    )
    # rms lmo = -sqrt(2) d/||d|| = -sqrt(2) (0.6, -0.8).
    expected_b = shrink * torch.tensor([3.0, 4.0]) - 0.2 * math.sqrt(2) * torch.tensor([0.6, -0.8])
    assert torch.allclose(w, expected_w, atol=1e-7) and torch.allclose(b, expected_b, atol=1e-7)
    assert torch.equal(opt.state[b]["momentum_buffer"], torch.tensor([1.5, -2.0]))


def test_momentum_is_the_weight_of_the_new_gradient() -> None:
    p = _param(0.0, 0.0)
    opt = Scion([p], lr=0.1, momentum=0.25, norm="euclidean", unconstrained=True)
    grads = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])]
    d = torch.zeros(2)
    expected = torch.zeros(2)
    for g in grads:
        p.grad = g
        opt.step()
        d = 0.75 * d + 0.25 * g
        expected = expected - 0.1 * d / d.norm()
    assert torch.allclose(opt.state[p]["momentum_buffer"], d)
    assert torch.allclose(p, expected)


def test_auto_spectral_step_uses_one_newton_schulz_polar() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 3))
    w0 = w.detach().clone()
    g = torch.randn(6, 3)
    opt = Scion([w], lr=0.2, momentum=1.0, radius=3.0)
    w.grad = g
    opt.step()
    expected = 0.8 * w0 - 0.2 * 3.0 * math.sqrt(6 / 3) * newton_schulz(g)
    assert torch.allclose(w, expected, atol=1e-6)


def test_constrained_iterates_converge_into_the_ball() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(10 * torch.randn(8, 4))
    opt = Scion([w], lr=0.2, momentum=1.0, radius=0.5)
    for _ in range(60):
        w.grad = torch.randn(8, 4)
        opt.step()
    # ||x_k|| <= (1-γ)^k ||x_0|| + ρ max ||lmo|| (NS band up to ~1.2).
    assert get_norm("spectral").norm(w.detach()) <= 0.5 * 1.25


def _least_squares(unconstrained: bool, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=gen)
    w_true = torch.randn(16, 4, generator=gen) / 4
    y = x @ w_true
    model = torch.nn.Linear(16, 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    opt = Scion(
        [{"params": [model.weight]}, {"params": [model.bias], "radius": 0.1}],
        lr=0.05,
        momentum=0.5,
        radius=2.0,
        unconstrained=unconstrained,
    )
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("unconstrained", [False, True])
def test_decreases_least_squares_loss(unconstrained: bool) -> None:
    losses = _least_squares(unconstrained, 80)
    # Constant steps of fixed size: the loss falls, then hovers at a floor set by lr * radius.
    assert max(losses[-10:]) < 0.05 * losses[0]
    assert max(losses[-10:]) < losses[20]


def test_state_dict_resume_is_bitwise() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    x, y = torch.randn(32, 5), torch.randn(32, 2)

    def make(m: torch.nn.Module) -> Scion:
        return Scion(
            [
                {"params": m[0].parameters()},
                {"params": [m[2].weight], "norm": "sign", "radius": 4.0},
                {"params": [m[2].bias], "norm": "rms", "momentum": 0.9, "unconstrained": True},
            ],
            lr=0.05,
        )

    def train(m: torch.nn.Module, opt: Scion, steps: int) -> None:
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()

    opt = make(model)
    train(model, opt, 3)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, 4)

    resumed = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    resumed.load_state_dict(saved_model)
    opt2 = make(resumed)
    opt2.load_state_dict(saved_opt)
    train(resumed, opt2, 4)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_norm_instance_and_stack_of_experts() -> None:
    experts = torch.nn.Parameter(torch.randn(3, 4, 5))
    opt = Scion(
        [{"params": [experts], "norm": get_norm("spectral", steps=6)}], lr=0.1, momentum=1.0
    )
    g = torch.randn(3, 4, 5)
    experts.grad = g
    before = experts.detach().clone()
    opt.step()
    expected = 0.9 * before - 0.1 * math.sqrt(4 / 5) * newton_schulz(g, steps=6)
    assert torch.allclose(experts, expected, atol=1e-6)


def test_parameters_without_grad_are_skipped_and_closure_loss_returned() -> None:
    p, q = _param(1.0, 2.0), _param(3.0)
    opt = Scion([p, q], lr=0.1)

    def closure() -> float:
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss.item()

    assert opt.step(closure) == 5.0
    assert torch.equal(q, torch.tensor([3.0])) and q not in opt.state


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": 0.0}, ValueError, r"lr must be a finite number > 0.*got 0.0"),
        ({"lr": True}, ValueError, r"lr must be a finite number > 0.*got True"),
        ({"lr": math.inf, "unconstrained": True}, ValueError, r"lr must be a finite.*got inf"),
        ({"lr": -1e-3}, ValueError, "lr"),
        ({"lr": 1.5}, ValueError, r"<= 1 for the constrained update, got 1.5"),
        ({"momentum": 0.0}, ValueError, r"momentum must be in \(0, 1\].*got 0.0"),
        ({"momentum": 1.1}, ValueError, "momentum"),
        ({"radius": -2.0}, ValueError, r"radius must be a finite number > 0, got -2.0"),
        ({"radius": math.inf}, ValueError, r"radius must be a finite number > 0, got inf"),
        ({"norm": "nuclear"}, ValueError, r"unknown norm 'nuclear'; allowed: euclidean"),
        ({"norm": 3}, TypeError, "norm"),
        ({"unconstrained": "yes"}, TypeError, "unconstrained"),
        ({"norm_kwargs": {"transpose": True}}, ValueError, "norm_kwargs"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Scion([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)


def test_unconstrained_allows_lr_above_one() -> None:
    Scion([torch.nn.Parameter(torch.zeros(2, 2))], lr=2.0, unconstrained=True)


def test_spectral_on_a_bias_and_bad_groups_are_rejected() -> None:
    bias = torch.nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match=r"'spectral'.*\(5,\)"):
        Scion([bias], norm="spectral")
    opt = Scion([torch.nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(ValueError, match=r"'colnorm'.*\(5,\)"):
        opt.add_param_group({"params": [bias], "norm": "colnorm"})
    with pytest.raises(ValueError, match="radius"):
        opt.add_param_group({"params": [bias], "radius": 0})
    assert len(opt.param_groups) == 1


def test_complex_and_sparse_are_rejected() -> None:
    with pytest.raises(TypeError, match="complex"):
        Scion([torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))])
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = Scion(emb.parameters(), norm="colnorm", norm_kwargs={"transpose": True})
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"sparse gradients.*\(10, 4\)"):
        opt.step()


@pytest.mark.parametrize("norm", ["spectral", "sign", "colnorm", "rownorm"])
def test_init_puts_matrices_on_the_sphere_and_keeps_vectors(norm):
    layer = torch.nn.Linear(12, 6)
    bias = layer.bias.detach().clone()
    # The weight's norm by name ("spectral" also by shape); the bias's automatic ("rms").
    weight_norm = None if norm == "spectral" else norm
    groups = [{"params": [layer.weight], "norm": weight_norm}, {"params": [layer.bias]}]
    opt = Scion(groups, lr=0.1, radius=3.0)
    opt.init(torch.Generator().manual_seed(0))
    assert float(get_norm(norm).norm(layer.weight.detach())) == pytest.approx(3.0, rel=1e-5)
    assert torch.equal(layer.bias, bias)
    first = layer.weight.detach().clone()
    opt.init(torch.Generator().manual_seed(0))
    assert torch.equal(layer.weight, first)
    opt.init(torch.Generator().manual_seed(1))
    assert not torch.equal(layer.weight, first)


def test_a_norm_instance_in_the_state_dict_loads_with_weights_only(tmp_path) -> None:
    """Lightning resumes with torch.load(weights_only=True): a Norm object refused to unpickle."""
    from ada_modules.optim.lmo import Spectral

    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = Scion([w], lr=0.1, norm=Spectral(steps=7))
    w.grad = torch.randn(4, 4)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    norm = loaded["param_groups"][0]["norm"]
    assert isinstance(norm, Spectral) and norm.steps == 7
