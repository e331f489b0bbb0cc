import logging
import math

import pytest
import torch

import ada_modules.data.pde as pde
from ada_modules.data import PDEDataModule, PDEDivergenceError, PDETrajectories
from ada_modules.data.pde import (
    PDE_FAMILIES,
    PDE_FRAME_DT,
    PDE_PARAMETER_RANGES,
    PDE_SPATIAL_DIMS,
    evolve_pde,
    solve_pde,
)

TWO_PI = 2 * math.pi
F64 = torch.float64


def _axis(grid):
    return torch.arange(grid, dtype=torch.float64) / grid


def _small_module(**kwargs):
    args = {
        "grid": 16,
        "frames": 8,
        "history": 3,
        "rollout": 4,
        "train_trajectories": 5,
        "val_trajectories": 3,
        "test_trajectories": 4,
        "seed": 0,
        "batch_size": 4,
    }
    return PDEDataModule(**(args | kwargs))


def test_families_table_is_consistent():
    assert len(set(PDE_FAMILIES)) == len(PDE_FAMILIES)
    for table in (PDE_SPATIAL_DIMS, PDE_FRAME_DT, PDE_PARAMETER_RANGES):
        assert tuple(table) == PDE_FAMILIES
    assert {PDE_SPATIAL_DIMS[f] for f in ("advection_2d", "diffusion_2d")} == {2}
    assert PDEDataModule.num_families == len(PDE_FAMILIES)


@pytest.mark.parametrize("c", [0.7, -1.3])
def test_advection_1d_is_an_exact_shift(c):
    x, t = _axis(32), torch.tensor([0.0, 0.1, 0.37, 1.0], dtype=F64)
    u = evolve_pde("advection", torch.sin(TWO_PI * 3 * x)[None], {"c": c}, t)
    exact = torch.sin(TWO_PI * 3 * (x[None] - c * t[:, None]))
    torch.testing.assert_close(u[0], exact, atol=1e-12, rtol=0)


def test_advection_2d_is_an_exact_shift():
    x = _axis(16)
    gx, gy = torch.meshgrid(x, x, indexing="ij")
    cx, cy, t = 0.8, -1.1, torch.tensor([0.0, 0.05, 0.3], dtype=F64)
    u = evolve_pde("advection_2d", torch.sin(TWO_PI * (gx + 2 * gy))[None], {"cx": cx, "cy": cy}, t)
    for i, s in enumerate(t.tolist()):
        exact = torch.sin(TWO_PI * ((gx - cx * s) + 2 * (gy - cy * s)))
        torch.testing.assert_close(u[0, i], exact, atol=1e-12, rtol=0)


def test_diffusion_1d_and_2d_decay_exactly():
    t = torch.tensor([0.0, 0.05, 0.5], dtype=F64)
    nu = torch.tensor([0.01, 0.03], dtype=F64)
    x = _axis(32)
    u = evolve_pde("diffusion", torch.sin(TWO_PI * 2 * x).expand(2, -1), {"nu": nu}, t)
    decay = torch.exp(-nu[:, None] * (TWO_PI * 2) ** 2 * t[None])  # (2, times)
    torch.testing.assert_close(u, decay[..., None] * torch.sin(TWO_PI * 2 * x), atol=1e-12, rtol=0)
    g = _axis(16)
    gx, gy = torch.meshgrid(g, g, indexing="ij")
    u0 = torch.sin(TWO_PI * gx) * torch.cos(TWO_PI * 2 * gy)
    u = evolve_pde("diffusion_2d", u0[None], {"nu": 0.02}, t)
    decay = torch.exp(-0.02 * TWO_PI**2 * (1 + 4) * t)
    torch.testing.assert_close(u[0], decay[:, None, None] * u0, atol=1e-12, rtol=0)


def test_burgers_conserves_mean_dissipates_energy_and_is_converged_in_time():
    u, params = solve_pde("burgers", 16, grid=64, frames=20, seed=3, return_parameters=True)
    assert torch.isfinite(u).all()
    mean = u.double().mean(dim=-1)
    torch.testing.assert_close(mean, mean[:, :1].expand_as(mean), atol=1e-6, rtol=0)
    energy = u.double().pow(2).mean(dim=(-1, -2))
    assert (energy.diff(dim=1) <= 1e-7).all()
    assert (energy[:, -1] < energy[:, 0]).all()
    lo, hi = PDE_PARAMETER_RANGES["burgers"]["nu"]
    assert ((params["nu"] >= lo) & (params["nu"] <= hi)).all()
    # the same run with 8x smaller substeps agrees
    times = PDE_FRAME_DT["burgers"] * torch.arange(20, dtype=torch.float64)
    u0 = u[:, 0, 0].double()
    fine = evolve_pde("burgers", u0, params, times, max_step=1e-3)
    torch.testing.assert_close(evolve_pde("burgers", u0, params, times), fine, atol=1e-5, rtol=0)


def test_allen_cahn_is_bounded_and_matches_the_reaction_ode():
    u = solve_pde("allen_cahn", 16, grid=64, frames=20, seed=1)
    assert torch.isfinite(u).all() and u.abs().max() <= 1.0 + 1e-2
    x = _axis(64)
    u0 = 1.5 * torch.sin(TWO_PI * x)[None]  # starts above 1: must not exceed max|u0|
    bounded = evolve_pde("allen_cahn", u0, {"eps": 0.005}, torch.linspace(0, 3, 7, dtype=F64))
    assert bounded.abs().max() <= 1.5 + 1e-2 and bounded[:, -1].abs().max() <= 1.0 + 1e-2
    # a constant state follows u' = u - u^3, solved in closed form
    t = torch.tensor([0.0, 1.0, 2.0, 5.0], dtype=F64)
    flat = evolve_pde("allen_cahn", torch.full((1, 16), 0.1, dtype=torch.float64), {"eps": 0.01}, t)
    exact = 0.1 * torch.exp(t) / torch.sqrt(1 - 0.01 + 0.01 * torch.exp(2 * t))
    torch.testing.assert_close(flat[0], exact[:, None].expand(-1, 16), atol=1e-4, rtol=0)


def test_kdv_moves_a_soliton_at_its_speed_and_conserves_mass_and_energy():
    delta, c, x = 1e-3, 1.0, _axis(128)

    def soliton(t):
        shifted = (x - 0.3 - c * t + 0.5) % 1.0 - 0.5  # periodic distance to the crest
        return 3 * c / torch.cosh(0.5 * math.sqrt(c / delta) * shifted) ** 2

    u = evolve_pde("kdv", soliton(0.0)[None], {"delta": delta}, [0.0, 0.2, 0.4])
    for i, t in enumerate((0.0, 0.2, 0.4)):
        torch.testing.assert_close(u[0, i], soliton(t), atol=1e-4, rtol=0)
    w = solve_pde("kdv", 8, grid=64, frames=20, seed=0).double()
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.mean(-1), w[:, :1].mean(-1).expand(-1, 20, -1), atol=1e-6, rtol=0)
    energy = w.pow(2).mean(-1)
    torch.testing.assert_close(energy, energy[:, :1].expand(-1, 20, -1), atol=0, rtol=1e-4)


@pytest.mark.parametrize("family", PDE_FAMILIES)
def test_shapes_dtypes_and_visible_change_per_frame(family):
    u = solve_pde(family, 6, grid=16, frames=4, seed=0)
    shape = (6, 4, 1, 16) if PDE_SPATIAL_DIMS[family] == 1 else (6, 4, 1, 16, 16)
    assert tuple(u.shape) == shape and u.dtype == torch.float32 and torch.isfinite(u).all()
    change = (u[:, 1:] - u[:, :-1]).flatten(2).norm(dim=-1) / u[:, :-1].flatten(2).norm(dim=-1)
    assert 0.01 < change.median() < 0.4


def test_equal_seeds_give_equal_data_and_others_differ():
    threads = torch.get_num_threads()
    first = solve_pde("burgers", 4, grid=16, frames=3, seed=5)
    assert torch.equal(first, solve_pde("burgers", 4, grid=16, frames=3, seed=5))
    assert not torch.equal(first, solve_pde("burgers", 4, grid=16, frames=3, seed=6))
    assert not torch.equal(first, solve_pde("burgers", 4, grid=16, frames=3, seed=-5))
    # families are mixed into the seed: the initial conditions differ too
    assert not torch.equal(first[:, 0], solve_pde("diffusion", 4, grid=16, frames=3, seed=5)[:, 0])
    assert torch.get_num_threads() == threads  # solved single-threaded, then restored
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(
        solve_pde("kdv", 2, 16, 3, seed=gen_a), solve_pde("kdv", 2, 16, 3, seed=gen_b)
    )


def test_a_diverging_solver_raises_naming_family_and_coefficients(monkeypatch):
    threads = torch.get_num_threads()
    u0 = torch.sin(TWO_PI * _axis(64))[None]
    with pytest.raises(PDEDivergenceError, match=r"the burgers solver diverged.*nu=0\b"):
        evolve_pde("burgers", u0, {"nu": 0.0}, [0.0, 1.0], max_step=1.0)
    # one substep per frame, far too long for stability: solve_pde raises, returns no NaN
    monkeypatch.setattr(pde, "_CFL", 1e3)
    monkeypatch.setattr(pde, "_MIN_SUBSTEPS", 1)
    monkeypatch.setitem(PDE_FRAME_DT, "kdv", 0.5)
    with pytest.raises(PDEDivergenceError, match=r"the kdv solver diverged.*delta="):
        solve_pde("kdv", 4, grid=64, frames=5, seed=0)
    assert issubclass(PDEDivergenceError, RuntimeError)
    assert torch.get_num_threads() == threads


def test_datamodule_splits_windows_and_labels():
    dm = _small_module(families=["advection", "burgers", "kdv"])
    dm.setup("fit")
    assert dm.families == ("advection", "burgers", "kdv") and dm.spatial_dims == 1
    assert isinstance(dm.generation_seconds, float) and dm.generation_seconds > 0
    # train: every start of a (history + 1)-window; val/test: one (history + rollout)-window
    sizes = {split: len(dm.datasets[split]) for split in ("train", "val", "test")}
    assert sizes == {"train": 3 * 5 * (8 - 4 + 1), "val": 3 * 3, "test": 3 * 4}
    frames, labels = next(iter(dm.train_dataloader()))
    assert tuple(frames.shape) == (4, 4, 1, 16) and frames.dtype == torch.float32
    assert labels.dtype == torch.int64
    frames, labels = next(iter(dm.test_dataloader()))
    assert tuple(frames.shape) == (4, 7, 1, 16)
    test = dm.datasets["test"]
    assert test.labels.tolist() == [0] * 4 + [2] * 4 + [4] * 4
    torch.testing.assert_close(test[0][0], test.trajectories[0, :7])
    train = dm.datasets["train"]
    torch.testing.assert_close(train[6][0], train.trajectories[1, 1:5])  # 5 starts per trajectory


def test_datamodule_splits_share_no_trajectory():
    dm = _small_module(families=["diffusion", "allen_cahn"])
    dm.setup()
    first = {s: dm.datasets[s].trajectories[:, 0].flatten(1) for s in ("train", "val", "test")}
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert torch.cdist(first[a], first[b]).min() > 1e-3


def test_single_family_2d_and_the_cache(caplog):
    dm = _small_module(families="diffusion_2d", grid=8)
    with caplog.at_level(logging.INFO, logger="ada_modules.data.pde"):
        dm.setup()
        again = _small_module(families="diffusion_2d", grid=8)
        again.setup()
    assert dm.families == ("diffusion_2d",) and dm.spatial_dims == 2
    frames, labels = next(iter(dm.val_dataloader()))
    assert tuple(frames.shape) == (3, 7, 1, 8, 8) and set(labels.tolist()) == {6}
    assert again.datasets["train"].trajectories is dm.datasets["train"].trajectories
    assert again.generation_seconds == dm.generation_seconds
    messages = [r.getMessage() for r in caplog.records if r.name == "ada_modules.data.pde"]
    assert "generated trajectories of diffusion_2d" in messages[0] and "reused" in messages[1]


def test_seed_none_follows_seed_everything(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert PDEDataModule().seed == 7


def test_default_configuration():
    dm = PDEDataModule(seed=0)
    assert dm.families == ("advection", "diffusion", "burgers", "allen_cahn")
    assert (dm.grid, dm.frames, dm.history, dm.rollout, dm.counts) == (64, 20, 4, 5, (256, 32, 64))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"family": "navier_stokes"}, "family must be one of advection, diffusion"),
        ({"num_trajectories": 0}, "num_trajectories must be an integer >= 1, got 0"),
        ({"frames": 1}, "frames must be an integer >= 2, got 1"),
        ({"grid": 6}, "grid must be an even integer >= 8.*got 6"),
        ({"grid": 33}, "grid must be an even integer >= 8.*got 33"),
        ({"grid": 32.0}, "grid must be an even integer"),
        ({"seed": "a"}, "seed must be an integer or a torch.Generator, got 'a'"),
    ],
)
def test_solve_pde_rejects_bad_input(kwargs, match):
    args = {"family": "burgers", "num_trajectories": 2, "grid": 16, "frames": 3, "seed": 0}
    with pytest.raises(ValueError, match=match):
        solve_pde(**(args | kwargs))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("heat", torch.zeros(1, 16), {"nu": 0.1}, [0.0]), "family must be one of"),
        (("burgers", torch.zeros(1, 16), {"eps": 0.1}, [0.0]), r"keys \['nu'\]"),
        (("burgers", torch.zeros(1, 16), {"nu": -0.1}, [0.0]), r"params\['nu'\].*>= 0"),
        (("burgers", torch.zeros(2, 16), {"nu": [0.1] * 3}, [0.0]), r"params\['nu'\]"),
        (("burgers", torch.zeros(1, 4, 4), {"nu": 0.1}, [0.0]), "u0 of burgers must be"),
        (("diffusion_2d", torch.zeros(1, 8, 16), {"nu": 0.1}, [0.0]), "u0 of diffusion_2d"),
        (("burgers", torch.zeros(1, 15), {"nu": 0.1}, [0.0]), "grid must be an even"),
        (("burgers", torch.full((1, 16), math.nan), {"nu": 0.1}, [0.0]), "must be finite"),
        (("burgers", torch.zeros(1, 16), {"nu": 0.1}, [0.5, 0.1]), "non-decreasing"),
        (("burgers", torch.zeros(1, 16), {"nu": 0.1}, [0.0], 0.0), "max_step must be"),
    ],
)
def test_evolve_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        evolve_pde(*args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"families": ["burgers", "diffusion_2d"]}, "all 1D or all 2D"),
        ({"families": []}, "families must be a name or a list"),
        ({"families": ["kdv", "kdv"]}, "distinct names"),
        ({"families": ["kdv", "heat"]}, "family must be one of.*'heat'"),
        ({"history": 5}, r"history \+ rollout must be <= frames, got 5 \+ 4 > 8"),
        ({"history": 0}, "history must be an integer >= 1"),
        ({"rollout": 0}, "rollout must be an integer >= 1"),
        ({"grid": 10.5}, "grid must be an even integer"),
        ({"train_trajectories": 0}, "train_trajectories must be an integer >= 1"),
        ({"test_trajectories": -1}, "test_trajectories must be an integer >= 1"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_datamodule_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _small_module(**kwargs)


def test_trajectory_windows_reject_bad_input():
    trajectories, labels = torch.zeros(2, 5, 1, 8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"window must be an integer in \[1, 5\], got 6"):
        PDETrajectories(trajectories, labels, window=6)
    with pytest.raises(ValueError, match="starts must be 'all' or 'first'"):
        PDETrajectories(trajectories, labels, window=2, starts="last")
    with pytest.raises(ValueError, match="trajectories must be a tensor"):
        PDETrajectories(torch.zeros(2, 5, 8), labels, window=2)
    with pytest.raises(ValueError, match=r"labels must be a tensor \(2,\)"):
        PDETrajectories(trajectories, torch.tensor([0]), window=2)
    data = PDETrajectories(trajectories, labels, window=2, starts="first")
    assert len(data) == 2
    with pytest.raises(IndexError):
        data[2]
