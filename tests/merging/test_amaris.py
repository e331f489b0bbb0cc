"""AMARIS against scipy's generalized eigensolver and LP solver, and against deviations and
captures measured on the very input rows the statistics were built from."""

import json

import numpy as np
import pytest
import scipy.linalg
import scipy.optimize
import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.merging import (
    ActivationStats,
    amaris,
    amaris_layer,
    collect_activation_stats,
    generalized_eigh,
    output_deviation,
    select_directions,
    task_arithmetic,
)


def _random_spd(rng: np.random.Generator, d: int, rank: int | None = None) -> np.ndarray:
    a = rng.normal(size=(d, rank or d + 3)) * rng.uniform(0.3, 3.0, size=(d, 1))
    return a @ a.T / a.shape[1]


def _augment(x: np.ndarray) -> np.ndarray:
    return np.hstack([x, np.ones((x.shape[0], 1))])


def _energy(weight: np.ndarray, rows: np.ndarray) -> float:
    """``E‖W x‖²`` over the rows: the mean squared output norm."""
    return float(((rows @ weight.T) ** 2).sum(1).mean())


# --- generalized_eigh -------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [None, 3])  # Σ_s full rank, or only PSD
def test_generalized_eigh_matches_scipy(rank):
    rng = np.random.default_rng(0)
    for _ in range(3):
        sigma_s, sigma_b = _random_spd(rng, 6, rank), _random_spd(rng, 6)
        gammas, u = generalized_eigh(torch.tensor(sigma_s), torch.tensor(sigma_b))
        assert gammas.dtype == u.dtype == torch.float64
        reference = scipy.linalg.eigh(sigma_s, sigma_b, eigvals_only=True)[::-1]
        np.testing.assert_allclose(gammas.numpy(), reference, rtol=1e-9, atol=1e-12)
        u = u.numpy()
        np.testing.assert_allclose(u.T @ sigma_b @ u, np.eye(6), atol=1e-10)
        np.testing.assert_allclose(u.T @ sigma_s @ u, np.diag(gammas.numpy()), atol=1e-10)
        assert (np.diff(gammas.numpy()) <= 0).all()


def test_generalized_eigh_bad_input():
    eye = torch.eye(3)
    with pytest.raises(InputError, match=r"sigma_s has shape \(3, 3\), sigma_b has \(2, 2\)"):
        generalized_eigh(eye, torch.eye(2))
    with pytest.raises(InputError, match=r"sigma_b must be a square matrix, got \(3, 2\)"):
        generalized_eigh(eye, torch.zeros(3, 2))
    with pytest.raises(InputError, match="sigma_s has non-finite entries"):
        generalized_eigh(torch.full((3, 3), float("nan")), eye)
    with pytest.raises(InputError, match="sigma_b must be positive definite.* column 1"):
        generalized_eigh(eye, torch.diag(torch.tensor([1.0, 0.0, 1.0])))


# --- select_directions ------------------------------------------------------------------------


def _lp_optimum(gammas, costs, budget, min_gamma):
    """max Σ γ_j t_j s.t. Σ t_j ≤ budget, 0 ≤ t_j ≤ a_j, over the directions with γ_j > min_gamma."""
    usable = gammas > min_gamma
    if not usable.any():
        return np.zeros_like(costs)
    result = scipy.optimize.linprog(
        -gammas[usable],
        A_ub=np.ones((1, usable.sum())),
        b_ub=[budget],
        bounds=[(0.0, a) for a in costs[usable]],
        method="highs",
    )
    assert result.success
    t = np.zeros_like(costs)
    t[usable] = result.x
    return t


@pytest.mark.parametrize("min_gamma", [1.0, 2.0])
def test_select_directions_is_the_lp_optimum(min_gamma):
    rng = np.random.default_rng(1)
    binding = 0
    for _ in range(25):
        n = int(rng.integers(1, 8))
        gammas = rng.uniform(0.0, 4.0, size=n)
        costs = rng.uniform(0.05, 2.0, size=n)
        costs[rng.random(n) < 0.15] = 0.0  # directions the change does not touch
        available = costs[gammas > min_gamma].sum()
        budget = float(rng.uniform(0.0, 1.3) * available)
        gates = select_directions(torch.tensor(gammas), torch.tensor(costs), budget, min_gamma)
        gates = gates.numpy()
        assert ((gates >= 0) & (gates <= 1)).all()
        assert (gates[gammas <= min_gamma] == 0).all() and (gates[costs == 0] == 0).all()
        assert ((gates > 0) & (gates < 1)).sum() <= 1  # at most one fractional gate
        spent = gates**2 * costs
        optimum = _lp_optimum(gammas, costs, budget, min_gamma)
        np.testing.assert_allclose(spent, optimum, atol=1e-9)
        assert gammas @ spent == pytest.approx(gammas @ optimum, rel=1e-9, abs=1e-12)
        if budget < available:
            binding += 1
            assert spent.sum() == pytest.approx(budget, rel=1e-12)  # the budget is spent exactly
        else:
            assert (gates[(gammas > min_gamma) & (costs > 0)] == 1).all()
    assert binding >= 10  # the random cases exercise the binding budget


def test_select_directions_bad_input():
    gammas, costs = torch.tensor([2.0, 3.0]), torch.tensor([1.0, 1.0])
    assert select_directions(gammas, costs, 0.0).tolist() == [0.0, 0.0]
    for budget in (-1.0, True, float("nan")):
        with pytest.raises(InputError, match="budget_abs must be a number >= 0"):
            select_directions(gammas, costs, budget)
    with pytest.raises(InputError, match=r"1-D of one length, got \(2,\) and \(3,\)"):
        select_directions(gammas, torch.ones(3), 1.0)


# --- amaris_layer -----------------------------------------------------------------------------


def _layer_case(seed: int = 0, rows: int = 300, inputs: int = 5, outputs: int = 3):
    """Base and specialist input rows (augmented), a base weight and a change."""
    rng = np.random.default_rng(seed)
    x_base = _augment(rng.normal(size=(rows, inputs)))
    scales = rng.uniform(0.3, 3.0, size=inputs)
    x_spec = _augment(rng.normal(size=(rows, inputs)) * scales + rng.normal(size=inputs) * 0.5)
    base_weight = rng.normal(size=(outputs, inputs + 1))
    delta = rng.normal(size=(outputs, inputs + 1))
    return x_base, x_spec, base_weight, delta


def _run_layer(x_base, x_spec, base_weight, delta, budget, **kwargs):
    sigma_b = x_base.T @ x_base / len(x_base)
    sigma_s = x_spec.T @ x_spec / len(x_spec)
    projected, report = amaris_layer(
        torch.tensor(delta),
        torch.tensor(sigma_s),
        torch.tensor(sigma_b),
        budget,
        torch.tensor(base_weight),
        **kwargs,
    )
    assert projected.dtype == torch.float64
    return projected.numpy(), report


def test_amaris_layer_deviation_and_capture_are_measured_ones():
    x_base, x_spec, base_weight, delta = _layer_case()
    budget = 0.05
    projected, report = _run_layer(x_base, x_spec, base_weight, delta, budget, ridge=0.0)
    base_energy = _energy(base_weight, x_base)
    deviation = _energy(projected, x_base)  # E_b‖ΔW P x~‖², measured on the rows
    assert report.base_energy == pytest.approx(base_energy, rel=1e-10)
    assert report.deviation_budget == pytest.approx(budget * base_energy, rel=1e-10)
    assert report.predicted_deviation == pytest.approx(deviation, rel=1e-8)
    assert deviation <= budget * base_energy * (1 + 1e-9)
    assert deviation == pytest.approx(budget * base_energy, rel=1e-8)  # the budget binds here
    capture = _energy(projected, x_spec) / _energy(delta, x_spec)  # E_s‖ΔW P x~‖² / E_s‖ΔW x~‖²
    assert report.capture_fraction == pytest.approx(capture, rel=1e-8)
    assert 0 < report.capture_fraction < 1
    assert report.rank == len(report.gates) == len(report.gammas) > 0
    assert all(g > 1 for g in report.gammas) and report.gammas == sorted(report.gammas)[::-1]
    assert all(g == 1.0 for g in report.gates[:-1]) and 0 < report.gates[-1] <= 1


def test_amaris_layer_with_a_ridge_over_estimates_the_deviation():
    x_base, x_spec, base_weight, delta = _layer_case(seed=1)
    ridge = 0.05
    projected, report = _run_layer(x_base, x_spec, base_weight, delta, 0.05, ridge=ridge)
    sigma_b = x_base.T @ x_base / len(x_base)
    regularised = sigma_b + ridge * np.trace(sigma_b) / len(sigma_b) * np.eye(len(sigma_b))
    predicted = float(np.trace(projected @ regularised @ projected.T))
    assert report.predicted_deviation == pytest.approx(predicted, rel=1e-8)
    assert (
        _energy(projected, x_base)
        < report.predicted_deviation
        <= report.deviation_budget * (1 + 1e-9)
    )
    # the capture is exact whatever the ridge: the directions diagonalise Σ_s either way
    capture = _energy(projected, x_spec) / _energy(delta, x_spec)
    assert report.capture_fraction == pytest.approx(capture, rel=1e-8)


def test_amaris_layer_with_room_keeps_every_direction_above_min_gamma():
    x_base, x_spec, base_weight, delta = _layer_case(seed=2)
    sigma_b = x_base.T @ x_base / len(x_base)
    sigma_s = x_spec.T @ x_spec / len(x_spec)
    huge = base_weight * 1e4  # budget · base energy far above any cost
    projected, report = _run_layer(x_base, x_spec, huge, delta, 1.0, ridge=0.0)
    gammas, vectors = scipy.linalg.eigh(sigma_s, sigma_b)  # Vᵀ Σ_b V = I
    keep = gammas > 1.0
    assert 0 < keep.sum() < len(gammas)
    assert report.rank == keep.sum() and report.gates == [1.0] * report.rank
    expected = delta @ sigma_b @ vectors[:, keep] @ vectors[:, keep].T  # the oblique projector
    np.testing.assert_allclose(projected, expected, atol=1e-9)
    # below every γ: all directions, and P = Σ_b U Uᵀ = I gives the full change back
    everything, report = _run_layer(x_base, x_spec, huge, delta, 1.0, ridge=0.0, min_gamma=-1.0)
    assert report.rank == len(gammas) and report.capture_fraction == pytest.approx(1.0)
    np.testing.assert_allclose(everything, delta, atol=1e-9)


def test_amaris_layer_capture_grows_with_the_budget():
    x_base, x_spec, base_weight, delta = _layer_case(seed=3)
    captures, deviations = [], []
    for budget in (1e-4, 1e-3, 0.01, 0.05, 0.2, 0.5, 1.0):
        projected, report = _run_layer(x_base, x_spec, base_weight, delta, budget, ridge=0.0)
        captures.append(report.capture_fraction)
        deviations.append(_energy(projected, x_base))
        assert deviations[-1] <= budget * report.base_energy * (1 + 1e-9)
    assert all(b >= a - 1e-12 for a, b in zip(captures, captures[1:], strict=False))
    assert all(b >= a - 1e-12 for a, b in zip(deviations, deviations[1:], strict=False))
    assert captures[0] < captures[-1]


def test_amaris_layer_shape_mismatch():
    x_base, x_spec, base_weight, delta = _layer_case()
    with pytest.raises(InputError, match=r"delta \(3, 5\) and base_weight \(3, 6\) must be"):
        _run_layer(x_base, x_spec, base_weight, delta[:, :5], 0.05)


# --- amaris on a state dict -------------------------------------------------------------------


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _problem(specialists: int = 2, scale: float = 0.5):
    """A 2-layer MLP base, specialists fine-tuned from it, and statistics of both layers."""
    g = torch.Generator().manual_seed(10)
    base_model = _mlp(0)
    core = torch.randn(128, 4, generator=g, dtype=torch.float64)
    base_stats = collect_activation_stats(base_model, [core])
    base = {
        **base_model.state_dict(),
        "norm.weight": torch.ones(6, dtype=torch.float64),
        "steps": torch.tensor(5),
    }
    tuned, tuned_stats = [], []
    for index in range(specialists):
        model = _mlp(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float64))
        shift = torch.randn(4, generator=g, dtype=torch.float64)
        domain = torch.randn(96, 4, generator=g, dtype=torch.float64) * (2.0 + index) + shift
        tuned_stats.append(collect_activation_stats(model, [domain]))
        tuned.append(
            {
                **model.state_dict(),
                "norm.weight": torch.full((6,), 2.0 + index, dtype=torch.float64),
                "steps": torch.tensor(50 + index),
            }
        )
    return base, tuned, tuned_stats, base_stats, (base_model, core)


def test_output_deviation_is_the_measured_relative_output_change():
    base, tuned, _, base_stats, (base_model, core) = _problem(specialists=1)
    deviation = output_deviation(base, tuned[0], base_stats)
    inputs = {"0": core.numpy(), "2": torch.tanh(base_model[0](core)).detach().numpy()}
    for layer, rows in inputs.items():
        rows = _augment(rows)
        w0 = np.hstack([base[f"{layer}.weight"].numpy(), base[f"{layer}.bias"].numpy()[:, None]])
        w1 = np.hstack(
            [tuned[0][f"{layer}.weight"].numpy(), tuned[0][f"{layer}.bias"].numpy()[:, None]]
        )
        expected = _energy(w1 - w0, rows) / _energy(w0, rows)
        assert deviation[layer] == pytest.approx(expected, rel=1e-9)
    assert output_deviation(base, base, base_stats) == {"0": 0.0, "2": 0.0}


def test_amaris_keeps_the_base_output_deviation_within_the_budget():
    """Each specialist gets budget / 2, so their predicted deviations add up to at most the
    budget; the summed change also has cross terms between the specialists, and where they push
    it over the budget it is scaled down to meet the budget exactly."""
    base, tuned, tuned_stats, base_stats, _ = _problem()
    budget = 0.1
    merged, report = amaris(base, tuned, tuned_stats, base_stats, budget=budget, ridge=0.0)
    json.dumps(report)
    assert report["method"] == "amaris" and report["budget"] == budget
    deviation = output_deviation(base, merged, base_stats)
    scaled = 0
    for layer in ("0", "2"):
        entry = report["layers"][layer]
        energy = entry["base_energy"]
        assert entry["deviation_budget"] == pytest.approx(budget * energy)
        per = [s["predicted_deviation"] for s in entry["specialists"]]
        assert all(
            s["deviation_budget"] == pytest.approx(budget / 2 * energy)
            for s in entry["specialists"]
        )
        assert all(p == pytest.approx(budget / 2 * energy, rel=1e-9) for p in per)  # binds
        assert entry["predicted_deviation_total"] == pytest.approx(
            deviation[layer] * energy, rel=1e-8
        )
        assert 0 < deviation[layer] <= budget * (1 + 1e-9)
        if entry["scale"] < 1:
            scaled += 1
            assert deviation[layer] == pytest.approx(budget, rel=1e-8)
    assert scaled == 0  # these two specialists' changes do not add up past the budget
    # The same specialist twice: its gated change twice, 4 x (budget / 2) before the scaling.
    merged, report = amaris(base, tuned[:1] * 2, tuned_stats[:1] * 2, base_stats, budget, 0.0)
    for layer, value in output_deviation(base, merged, base_stats).items():
        assert report["layers"][layer]["scale"] == pytest.approx(0.5**0.5, rel=1e-9)
        assert value == pytest.approx(budget, rel=1e-8)


def test_amaris_with_one_specialist_stays_within_the_budget():
    base, tuned, tuned_stats, base_stats, _ = _problem(specialists=1)
    for ridge in (0.0, 1e-6, 1e-2):  # a ridge only over-estimates the deviation
        merged, report = amaris(base, tuned, tuned_stats, base_stats, budget=0.05, ridge=ridge)
        deviation = output_deviation(base, merged, base_stats)
        assert set(deviation) == set(report["layers"]) == {"0", "2"}
        for value in deviation.values():
            assert value <= 0.05 * (1 + 1e-9)
            if ridge == 0.0:
                assert value == pytest.approx(0.05, rel=1e-8)


def test_amaris_adds_the_gated_changes_of_the_weighted_specialists():
    """The merge is the base plus the sum of the gated weighted changes, scaled by
    √(budget / its deviation) when that deviation exceeds the budget."""
    base, tuned, tuned_stats, base_stats, _ = _problem()
    weights = [0.5, 2.0]
    merged, report = amaris(
        base, tuned, tuned_stats, base_stats, budget=0.2, ridge=0.0, weights=weights
    )
    for layer in ("0", "2"):

        def augmented(sd, layer=layer):
            return torch.cat([sd[f"{layer}.weight"], sd[f"{layer}.bias"][:, None]], dim=1)

        start = augmented(base)
        total = torch.zeros_like(start)
        for w, model, stats in zip(weights, tuned, tuned_stats, strict=True):
            projected, _ = amaris_layer(
                w * (augmented(model) - start),
                stats[layer].covariance,
                base_stats[layer].covariance,
                0.1,  # budget / 2
                start,
                ridge=0.0,
            )
            total += projected
        sigma_b = base_stats[layer].covariance
        allowed = 0.2 * float(((start @ sigma_b) * start).sum())
        predicted = float(((total @ sigma_b) * total).sum())
        scale = min(1.0, (allowed / predicted) ** 0.5)
        assert report["layers"][layer]["scale"] == pytest.approx(scale, rel=1e-12)
        assert torch.allclose(augmented(merged), start + scale * total, atol=1e-12)


def test_other_tensors_follow_the_other_option():
    base, tuned, tuned_stats, base_stats, _ = _problem()
    only_first = [{"0": s["0"]} for s in tuned_stats]  # layer "2" has no statistics
    merged, report = amaris(base, tuned, only_first, {"0": base_stats["0"]}, other="base")
    assert list(report["layers"]) == ["0"]
    for name in ("norm.weight", "2.weight", "2.bias", "steps"):
        assert torch.equal(merged[name], base[name]), name
    assert not torch.equal(merged["0.weight"], base["0.weight"])
    merged, _ = amaris(base, tuned, only_first, {"0": base_stats["0"]}, weights=[1.0, 0.5])
    arithmetic = task_arithmetic(base, tuned, weights=[1.0, 0.5])
    assert torch.allclose(
        merged["norm.weight"], torch.full((6,), 1 + 1 + 0.5 * 2, dtype=torch.float64)
    )
    for name in ("norm.weight", "2.weight", "2.bias", "steps"):
        assert torch.equal(merged[name], arithmetic[name]), name
    assert merged["0.weight"].dtype == torch.float64 and merged["steps"].item() == 5


def test_amaris_bad_input():
    base, tuned, tuned_stats, base_stats, _ = _problem()

    def run(**kwargs):
        args = {
            "base": base,
            "specialists": tuned,
            "specialist_stats": tuned_stats,
            "base_stats": base_stats,
        }
        return amaris(**{**args, **kwargs})

    for budget in (0, 0.0, 1.5, True, -0.1, float("nan"), "0.1"):
        with pytest.raises(InputError, match=rf"^budget must be in \(0, 1\], got {budget!r}"):
            run(budget=budget)
    wrong = dict(tuned_stats[1])
    wrong["0"] = ActivationStats(torch.eye(6, dtype=torch.float64), 100, has_bias=True)
    with pytest.raises(
        InputError,
        match=r"^layer '0': specialist 1's statistics have dim 6 \(bias True\), the layer needs "
        r"5 \(4 inputs, a bias\)",
    ):
        run(specialist_stats=[tuned_stats[0], wrong])
    missing = {"0": tuned_stats[1]["0"]}
    with pytest.raises(
        InputError, match="^layer '2' has base statistics but none for specialist 1"
    ):
        run(specialist_stats=[tuned_stats[0], missing])
    with pytest.raises(InputError, match="^layer '2' has statistics for specialist 0 but not the"):
        run(base_stats={"0": base_stats["0"]})
    with pytest.raises(InputError, match=r"one statistics mapping per specialist \(2\)"):
        run(specialist_stats=tuned_stats[:1])
    with pytest.raises(InputError, match="weights has 1 entries for 2 specialists"):
        run(weights=[1.0])
    with pytest.raises(InputError, match="other must be 'base' or 'task_arithmetic', got 'mean'"):
        run(other="mean")
    with pytest.raises(InputError, match="ridge must be a number >= 0, got -1"):
        run(ridge=-1)
    for min_gamma in (None, float("nan"), float("inf")):  # NaN kept every direction
        with pytest.raises(InputError, match=f"min_gamma must be a finite number, got {min_gamma}"):
            run(min_gamma=min_gamma)
    with pytest.raises(InputError, match="^amaris: no linear layer of the base has statistics"):
        run(specialist_stats=[{}, {}], base_stats={})  # e.g. GPT-2: Conv1D layers, no nn.Linear
    with pytest.raises(InputError, match="at least one specialist"):
        run(specialists=[], specialist_stats=[])

    # Σ_b not positive definite: a base input feature that is always 0
    core = torch.randn(64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    core[:, 1] = 0.0
    flat = collect_activation_stats(_mlp(0), [core], layers=["0"])
    specialist = [{"0": s["0"]} for s in tuned_stats]
    with pytest.raises(InputError, match="^layer '0': sigma_b must be positive definite"):
        run(specialist_stats=specialist, base_stats=flat, ridge=0.0)
    run(specialist_stats=specialist, base_stats=flat, ridge=1e-6)  # a ridge fixes it
    not_psd = {"0": ActivationStats(-torch.eye(5, dtype=torch.float64), 100, has_bias=True)}
    with pytest.raises(InputError, match="^layer '0': the covariance is not positive semi-def"):
        run(specialist_stats=specialist, base_stats=not_psd)
    few = {"0": ActivationStats(torch.eye(5, dtype=torch.float64), 3, has_bias=True)}
    with pytest.raises(InputError, match="^layer '0': 3 samples for a 5-dim covariance"):
        run(specialist_stats=specialist, base_stats=few, ridge=0.0)
