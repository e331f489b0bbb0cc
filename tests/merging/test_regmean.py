"""RegMean against the least-squares merge and the closed form, computed with numpy."""

import numpy as np
import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.merging import ActivationStats, regmean


def _augment(x: np.ndarray) -> np.ndarray:
    return np.hstack([x, np.ones((x.shape[0], 1))])


def _setup(members: int = 2, rows: int = 12, inputs: int = 4, outputs: int = 3, seed: int = 0):
    """Members with a biased layer 'fc', a norm vector and an integer counter; inputs per member."""
    rng = np.random.default_rng(seed)
    base = {
        "fc.weight": torch.zeros(outputs, inputs),
        "fc.bias": torch.zeros(outputs),
        "norm.weight": torch.ones(inputs),
        "steps": torch.tensor(7),
    }
    models, inputs_per_member, stats = [], [], []
    for index in range(members):
        models.append(
            {
                "fc.weight": torch.tensor(rng.normal(size=(outputs, inputs)), dtype=torch.float32),
                "fc.bias": torch.tensor(rng.normal(size=outputs), dtype=torch.float32),
                "norm.weight": torch.full((inputs,), float(index + 2)),
                "steps": torch.tensor(100 + index),
            }
        )
        # each member's inputs have their own scale per feature, so the Gram matrices differ
        x = rng.normal(size=(rows, inputs)) * rng.uniform(0.2, 3.0, size=inputs) + index
        inputs_per_member.append(x)
        gram = _augment(x).T @ _augment(x)
        stats.append({"fc": ActivationStats(torch.tensor(gram), rows, has_bias=True)})
    return base, models, inputs_per_member, stats


def _augmented_weight(model) -> np.ndarray:
    return np.hstack(
        [model["fc.weight"].double().numpy(), model["fc.bias"].double().numpy()[:, None]]
    )


def test_alpha_one_is_the_least_squares_merge():
    base, models, xs, stats = _setup()
    merged = regmean(base, models, stats, alpha=1.0, ridge=0.0)
    # minimise Σ_i ‖X~_i W~ᵀ − X~_i W~_iᵀ‖²: one stacked least-squares problem
    design = np.vstack([_augment(x) for x in xs])
    targets = np.vstack(
        [_augment(x) @ _augmented_weight(m).T for x, m in zip(xs, models, strict=True)]
    )
    solution = np.linalg.lstsq(design, targets, rcond=None)[0].T
    np.testing.assert_allclose(_augmented_weight(merged), solution, rtol=1e-5, atol=1e-5)
    # the closed form W~ = (Σ W~_i G_i)(Σ G_i)⁻¹
    grams = [_augment(x).T @ _augment(x) for x in xs]
    closed = sum(
        _augmented_weight(m) @ g for m, g in zip(models, grams, strict=True)
    ) @ np.linalg.inv(sum(grams))
    np.testing.assert_allclose(_augmented_weight(merged), closed, rtol=1e-5, atol=1e-5)
    assert merged["fc.weight"].dtype == torch.float32 and merged["fc.bias"].dtype == torch.float32


def test_one_member_is_returned_unchanged():
    base, models, _, stats = _setup(members=1)
    for alpha in (1.0, 0.5, 0.0):
        merged = regmean(base, models, stats, alpha=alpha)
        assert torch.allclose(merged["fc.weight"], models[0]["fc.weight"], atol=1e-5)
        assert torch.allclose(merged["fc.bias"], models[0]["fc.bias"], atol=1e-5)


def test_alpha_scales_the_off_diagonal_entries():
    base, models, xs, stats = _setup(members=3)
    alpha = 0.3
    grams = []
    for x in xs:
        gram = _augment(x).T @ _augment(x)
        scaled = alpha * gram
        np.fill_diagonal(scaled, np.diag(gram))  # diagonal kept, off-diagonals times alpha
        grams.append(scaled)
    expected = sum(
        _augmented_weight(m) @ g for m, g in zip(models, grams, strict=True)
    ) @ np.linalg.inv(sum(grams))
    merged = regmean(base, models, stats, alpha=alpha)
    np.testing.assert_allclose(_augmented_weight(merged), expected, rtol=1e-5, atol=1e-5)


def test_alpha_zero_is_a_per_input_weighted_average():
    base, models, xs, stats = _setup(members=2)
    merged = regmean(base, models, stats, alpha=0.0)
    # G_i diagonal: column k of W~ is Σ_i n_ik W~_i[:, k] / Σ_i n_ik with n_ik = Σ_rows x_k²
    norms = [(_augment(x) ** 2).sum(0) for x in xs]
    weights = [_augmented_weight(m) for m in models]
    expected = sum(w * n for w, n in zip(weights, norms, strict=True)) / sum(norms)
    np.testing.assert_allclose(_augmented_weight(merged), expected, rtol=1e-5, atol=1e-6)


def test_ridge_adds_a_multiple_of_the_mean_diagonal():
    base, models, xs, stats = _setup(members=2, rows=2)  # 4 rows, 5 dims: singular without it
    ridge = 0.1
    grams = [_augment(x).T @ _augment(x) for x in xs]
    total = sum(grams)
    total = total + ridge * np.trace(total) / total.shape[0] * np.eye(total.shape[0])
    expected = sum(
        _augmented_weight(m) @ g for m, g in zip(models, grams, strict=True)
    ) @ np.linalg.inv(total)
    merged = regmean(base, models, stats, alpha=1.0, ridge=ridge)
    np.testing.assert_allclose(_augmented_weight(merged), expected, rtol=1e-5, atol=1e-6)


def test_other_tensors_are_averaged_and_integers_come_from_the_base():
    base, models, _, stats = _setup(members=2)
    base["head.weight"] = torch.zeros(2, 3)  # a linear layer without statistics
    models[0]["head.weight"] = torch.full((2, 3), 1.0)
    models[1]["head.weight"] = torch.full((2, 3), 4.0)
    merged = regmean(base, models, stats)
    assert torch.equal(merged["norm.weight"], torch.full((4,), 2.5))  # mean of 2 and 3
    assert torch.equal(merged["head.weight"], torch.full((2, 3), 2.5))
    assert merged["steps"].item() == 7
    # a layer with statistics in only one member is averaged too; with no other layer, nothing
    # would be merged by statistics, and that is refused rather than silently an average
    partial = [stats[0], {}]
    with pytest.raises(InputError, match="^regmean: no linear layer of the base has statistics"):
        regmean(base, models, partial)
    base["head.bias"], models[0]["head.bias"], models[1]["head.bias"] = (torch.zeros(2),) * 3
    head = ActivationStats(torch.eye(4, dtype=torch.float64), 8, has_bias=True)
    averaged = regmean(base, models, [{**stats[0], "head": head}, {"head": head}])
    expected = (models[0]["fc.weight"] + models[1]["fc.weight"]) / 2
    assert torch.allclose(averaged["fc.weight"], expected)


def test_inputs_are_not_modified():
    base, models, _, stats = _setup()
    copies = [{k: v.clone() for k, v in m.items()} for m in [base, *models]]
    sums = [s["fc"].second_moment_sum.clone() for s in stats]
    regmean(base, models, stats, alpha=0.5)
    for original, copy in zip([base, *models], copies, strict=True):
        assert all(torch.equal(original[k], copy[k]) for k in copy)
    assert all(torch.equal(s["fc"].second_moment_sum, c) for s, c in zip(stats, sums, strict=True))


def test_bad_input():
    base, models, _, stats = _setup(members=2, rows=2)  # 4 rows for a 5-dim layer: singular
    with pytest.raises(
        InputError, match="^layer 'fc': the members' summed Gram matrix is singular"
    ):
        regmean(base, models, stats, alpha=1.0)
    regmean(base, models, stats, alpha=1.0, ridge=1e-3)  # a ridge makes it solvable
    with pytest.raises(InputError, match=r"alpha must be in \[0, 1\], got 1.5"):
        regmean(base, models, stats, alpha=1.5)
    with pytest.raises(InputError, match="ridge must be a number >= 0, got True"):
        regmean(base, models, stats, ridge=True)
    with pytest.raises(InputError, match=r"one statistics mapping per member \(2\)"):
        regmean(base, models, stats[:1])
    with pytest.raises(InputError, match="^regmean: no linear layer of the base has statistics"):
        regmean(base, models, [{}, {}])
    wrong = {"fc": ActivationStats(torch.eye(4, dtype=torch.float64), 9, has_bias=False)}
    with pytest.raises(InputError, match="^layer 'fc': member 1's statistics have dim 4"):
        regmean(base, models, [stats[0], wrong])
    with pytest.raises(InputError, match="needs at least one member"):
        regmean(base, [], [])
