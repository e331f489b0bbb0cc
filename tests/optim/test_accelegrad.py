"""AcceleGrad: the paper's equations, acceleration on a smooth convex quadratic, bad input, resume."""

import io
import math

import pytest
import torch

from ada_modules.optim.accelegrad import AcceleGrad, accelegrad_alpha


def _quadratic(d: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """PSD matrix with eigenvalues i^-2 (L = 1) and a right-hand side."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    eig = torch.arange(1, d + 1, dtype=torch.float64) ** -2.0
    return (q * eig) @ q.T, torch.randn(d, generator=gen, dtype=torch.float64)


def _subopt(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> float:
    wstar = torch.linalg.solve(a, b)

    def f(v: torch.Tensor) -> torch.Tensor:
        return 0.5 * v @ a @ v - b @ v

    return float(f(w) - f(wstar))


def test_alpha_schedule() -> None:
    assert [accelegrad_alpha(t) for t in (0, 1, 2, 3, 7)] == [1.0, 1.0, 1.0, 1.0, 2.0]


def test_first_steps_follow_the_equations() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    opt = AcceleGrad([w], lr=0.5, g0=1.0)
    x0 = w.detach().clone()
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    w.grad = g.clone()
    opt.step()
    eta = 2 * 0.5 / math.sqrt(1.0 + 25.0)
    st = opt.state[w]
    torch.testing.assert_close(st["y"], x0 - eta * g)
    torch.testing.assert_close(st["z"], x0 - eta * g)  # alpha_0 = 1
    torch.testing.assert_close(w.detach(), x0 - eta * g)  # tau_1 = 1: x_2 = z_1


def test_beats_gradient_descent_on_smooth_quadratic() -> None:
    a, b = _quadratic()
    x0 = torch.zeros_like(b)
    dist = float(torch.linalg.solve(a, b).norm())
    w = torch.nn.Parameter(x0.clone())
    opt = AcceleGrad([w], lr=dist)  # D of the order of the distance to the solution, no L
    steps = 400
    for _ in range(steps):
        w.grad = a @ w.detach() - b
        opt.step()
    with opt.swap_output():
        acc = _subopt(a, b, w.detach())
    gd = x0.clone()
    for _ in range(steps):  # GD with 1/L, L = 1 known
        gd -= a @ gd - b
    assert acc < 0.01 * _subopt(a, b, gd)  # measured: ~300x lower at 400 steps


def test_projection_keeps_z_in_ball() -> None:
    w = torch.nn.Parameter(torch.zeros(3))
    opt = AcceleGrad([w], lr=10.0, proj_radius=1.0)
    for _ in range(10):
        w.grad = torch.full((3,), -1.0)
        opt.step()
    assert float(opt.state[w]["z"].norm()) <= 1.0 + 1e-6


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.0},
        {"lr": -1.0},
        {"lr": float("inf")},
        {"lr": "1.0"},
        {"g0": 0.0},
        {"g0": float("nan")},
        {"proj_radius": 0.0},
    ],
    ids=str,
)
def test_bad_arguments(kwargs: dict[str, float]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        AcceleGrad([torch.nn.Parameter(torch.zeros(2))], **{"lr": 1.0, **kwargs})
    with pytest.raises(ValueError, match=name):  # in a group of its own
        AcceleGrad([{"params": [torch.nn.Parameter(torch.zeros(2))], **kwargs}])
    opt = AcceleGrad([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(ValueError, match=name):  # added later: refused, and not kept
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], **kwargs})
    assert len(opt.param_groups) == 1


def test_an_empty_parameter_group_steps_like_torch_optimizers() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = AcceleGrad([{"params": [w]}, {"params": []}], lr=1.0)
    w.grad = torch.ones(2)
    opt.step()
    assert not torch.equal(w, torch.ones(2))


def test_float16_gradient_norms_do_not_overflow() -> None:
    w = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    opt = AcceleGrad([w], lr=1.0)
    w.grad = torch.full_like(w, 3000.0)  # norm 94,868: past float16's 65,504
    opt.step()
    assert opt.state[w]["group_sumsq"] == pytest.approx(1000 * 3000.0**2, rel=1e-3)
    assert bool((w < 0).all())  # a step was taken (in float16 the norm was inf: eta = 0)
    w2 = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    opt = AcceleGrad([w2], lr=5e4, proj_radius=1e6)
    w2.grad = torch.full_like(w2, 3000.0)
    opt.step()  # z's norm, 1e5, is past float16's range too: z must not be scaled to 0
    assert opt.state[w2]["z"].float().norm().item() == pytest.approx(1e5, rel=1e-2)


def test_float32_gradient_norms_past_float32_are_taken_in_float64() -> None:
    w = torch.nn.Parameter(torch.ones(4))
    opt = AcceleGrad([w], lr=0.1)
    w.grad = torch.full_like(w, 3e19)  # norm 6e19: its square is past float32's 3.4e38
    opt.step()
    assert opt.state[w]["group_sumsq"] == pytest.approx(4 * 3e19**2, rel=1e-6)  # was inf
    assert bool((w < 1).all())  # a step was taken (an inf accumulator made every step 0)


def test_state_dict_resume_bitwise() -> None:
    torch.manual_seed(0)
    a = torch.randn(6, 4)

    def run(opt: AcceleGrad, w: torch.nn.Parameter, n: int) -> None:
        for i in range(n):
            opt.zero_grad()
            ((a @ w - i % 3) ** 2).sum().backward()
            opt.step()

    w = torch.nn.Parameter(torch.ones(4))
    opt = AcceleGrad([w], lr=1.0, proj_radius=5.0)
    run(opt, w, 5)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    w_saved = w.detach().clone()
    run(opt, w, 5)
    w2 = torch.nn.Parameter(w_saved)
    opt2 = AcceleGrad([w2], lr=1.0, proj_radius=5.0)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf))
    run(opt2, w2, 5)
    assert torch.equal(w, w2)
