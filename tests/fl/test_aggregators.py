"""Robust aggregation rules: hand-made cases, invariants on random inputs, robustness to huge
outliers, and bad input (including non-finite client updates)."""

import math

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.fl.aggregators import (
    AGGREGATORS,
    aggregate,
    bulyan,
    centered_clipping,
    coordinate_median,
    fltrust,
    krum,
    max_tolerated,
    mean,
    multi_krum,
    trimmed_mean,
)

ROBUST = ["median", "trimmed_mean", "krum", "multi_krum", "bulyan", "fltrust", "centered_clipping"]
SELECTING = ["median", "trimmed_mean", "krum", "multi_krum", "bulyan"]


def _col(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)[:, None]


def _kwargs(name: str, updates: torch.Tensor, root: torch.Tensor | None = None) -> dict:
    if name == "fltrust":
        return {"root_update": updates.mean(0) if root is None else root}
    return {}


def _random(seed: int, n: int = 11, d: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen, dtype=torch.float64)


# ------------------------------------------------------------------ hand-made cases


def test_median_odd_and_even():
    result = coordinate_median(_col(3, -1, 7, 100, 2))
    assert result.update.tolist() == [3.0]
    assert result.kept.tolist() == [1, 0, 0, 0, 0]
    result = coordinate_median(_col(1, 5, 2, 9))  # the true median, not torch.median's lower one
    assert result.update.tolist() == [3.5]
    assert result.kept.tolist() == [0, 1, 1, 0]


def test_median_matches_quantile_definition():
    for n in (4, 5, 10, 11):
        updates = _random(n, n=n)
        expected = torch.quantile(updates, 0.5, dim=0)  # linear interpolation = true median
        torch.testing.assert_close(coordinate_median(updates).update, expected)
        # each coordinate uses 1 (odd n) or 2 (even n) clients
        assert coordinate_median(updates).kept.sum().item() == pytest.approx(2 - n % 2)


def test_trimmed_mean_drops_known_outliers():
    updates = torch.tensor([[-100.0, 1.0], [1.0, 2.0], [2.0, 3.0], [3.0, 50.0], [100.0, 4.0]])
    result = trimmed_mean(updates, f=1)
    assert result.update.tolist() == [2.0, 3.0]  # mean(1, 2, 3), mean(2, 3, 4)
    assert result.kept.tolist() == [0.0, 1.0, 1.0, 0.5, 0.5]


def test_krum_picks_the_cluster_center():
    # f=1, n=5: scores on n - f - 2 = 2 neighbours. Center (index 2): 1 + 1 = 2; the three
    # cluster points: 1 + 2 = 3; the outlier: far more.
    updates = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [10.0, 10.0]])
    result = krum(updates, f=1)
    assert result.update.tolist() == [0.0, 0.0]
    assert result.kept.tolist() == [0, 0, 1, 0, 0]


def test_krum_ignores_colluding_attackers():
    gen = torch.Generator().manual_seed(0)
    benign = 0.1 * torch.randn(5, 3, generator=gen)
    updates = torch.cat([torch.full((2, 3), 5.0), benign])  # two identical attackers first
    result = krum(updates, f=2)
    assert result.kept[:2].tolist() == [0, 0] and result.kept.sum() == 1
    assert any(torch.equal(result.update, row) for row in benign)


def test_multi_krum_selection_and_special_cases():
    updates = _col(0.0, 0.1, 0.2, 0.3, 50.0)
    result = multi_krum(updates, f=1)  # m = n - f = 4: the four close ones
    assert result.kept.tolist() == [1, 1, 1, 1, 0]
    torch.testing.assert_close(result.update, torch.tensor([0.15], dtype=torch.float64))
    updates = _random(1)
    torch.testing.assert_close(multi_krum(updates, f=2, m=11).update, updates.mean(0))
    assert multi_krum(updates, f=2, m=11).kept.tolist() == [1.0] * 11
    for iterated in (False, True):
        one = multi_krum(updates, f=2, m=1, iterated=iterated)
        assert torch.equal(one.update, krum(updates, f=2).update)


def test_bulyan_hand_case():
    # n=7, f=1: theta = 5, beta = 3. Repeated Krum (max(r - 3, 1) neighbours among the r left;
    # ties to the lower index) picks 4 (score 50 on 4 neighbours), 7 (53 on 3), 1 (50 on 2),
    # 8 (tie with 11 at 9 on 1), 0 (tie with 11 at 121). Median of {0, 1, 4, 7, 8} is 4; the
    # 3 values closest to it are {1, 4, 7}: mean 4.
    result = bulyan(_col(0, 1, 4, 7, 8, 11, 900), f=1)
    assert result.update.tolist() == [4.0]
    assert result.kept.tolist() == [0, 1, 1, 1, 0, 0, 0]


def test_bulyan_second_stage_per_coordinate():
    # Whichever five benign rows the first stage picks, coordinate 0 averages three zeros; each
    # coordinate keeps beta = 3 values, so the kept shares add up to 3.
    updates = torch.tensor([[0.0, v] for v in (-3.0, -1.0, 0.0, 1.0, 3.0, 0.5)] + [[1e3, 1e3]])
    result = bulyan(updates, f=1)
    assert result.kept[-1] == 0
    assert result.update[0] == 0.0
    assert result.kept.max() <= 1 and result.kept.sum().item() == pytest.approx(3.0)


def test_fltrust_trust_and_norm():
    root = torch.tensor([2.0, 0.0])
    updates = torch.tensor([[5.0, 0.0], [-1.0, 0.0], [0.5, 0.0]])
    result = fltrust(updates, root_update=root)
    assert result.kept.tolist() == [1.0, 0.0, 1.0]  # the opposite update has trust 0
    torch.testing.assert_close(result.update, root)  # rescaled to the root's norm
    updates = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-3.0, 4.0]])
    result = fltrust(updates, root_update=torch.tensor([3.0, 0.0]))
    # trusts 1, cos 45 deg = 2**-0.5, ReLU(-0.6) = 0; rescaled to norm 3: (3, 0), 3 * 2**-0.5 * (1, 1)
    expected = (torch.tensor([3.0, 0.0]) + torch.tensor([1.5, 1.5])) / (1 + 2**-0.5)
    torch.testing.assert_close(result.update, expected)
    assert result.kept[2] == 0


def test_fltrust_all_distrusted_gives_zeros():
    result = fltrust(torch.tensor([[-1.0, 0.0], [0.0, 2.0]]), root_update=torch.tensor([1.0, 0.0]))
    assert result.update.tolist() == [0.0, 0.0] and result.kept.tolist() == [0.0, 0.0]


def test_centered_clipping():
    updates = _col(0, 0, 0, 0, 100)
    result = centered_clipping(updates, tau=1.0)
    torch.testing.assert_close(result.update, _col(0.2)[0])  # (0 + 0 + 0 + 0 + 1) / 5
    torch.testing.assert_close(result.kept, torch.tensor([1, 1, 1, 1, 0.01], dtype=torch.float64))
    # Iterated to the fixed point v: 4 * (-v) + 1 = 0 for 0 < v < 1.
    result = centered_clipping(updates, tau=1.0, iterations=200)
    assert result.update.item() == pytest.approx(0.25)
    updates = _random(3)
    for iterations in (1, 5):
        big = centered_clipping(updates, tau=1e9, iterations=iterations)
        torch.testing.assert_close(big.update, updates.mean(0))
    center = updates[0]
    step = centered_clipping(updates, center=center, tau=0.01)
    assert (step.update - center).norm() <= 0.01 + 1e-12  # a step of at most tau from the center


# ------------------------------------------------------------------ invariants


def test_registry_and_bounds():
    assert set(AGGREGATORS) == {
        "mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan", "fltrust",
        "centered_clipping",
    }  # fmt: skip
    assert [max_tolerated("mean", n) for n in (1, 2, 5, 6)] == [0, 0, 2, 2]
    assert [max_tolerated("krum", n) for n in (2, 3, 7, 8)] == [-1, 0, 2, 2]
    assert [max_tolerated("bulyan", n) for n in (2, 3, 7, 11, 14)] == [-1, 0, 1, 2, 2]
    for name in AGGREGATORS:
        assert max_tolerated(name, 0) == -1  # cannot run, never below the sentinel
        for n in range(1, 20):
            assert 2 * max_tolerated(name, n) < n


@pytest.mark.parametrize("name", list(AGGREGATORS))
def test_shapes_ranges_and_permutation_invariance(name):
    for seed in range(4):
        updates = _random(seed)
        kwargs = _kwargs(name, updates)
        result = aggregate(name, updates, 2, **kwargs)
        assert result.update.shape == (6,) and result.kept.shape == (11,)
        assert result.update.dtype == updates.dtype
        assert bool(((result.kept >= 0) & (result.kept <= 1)).all())
        perm = torch.randperm(11, generator=torch.Generator().manual_seed(seed))
        permuted = aggregate(name, updates[perm], 2, **kwargs)
        torch.testing.assert_close(permuted.update, result.update)
        torch.testing.assert_close(permuted.kept, result.kept[perm])


@pytest.mark.parametrize("name", list(AGGREGATORS))
def test_identical_updates_give_the_common_value(name):
    common = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    updates = common.expand(11, -1).clone()
    result = aggregate(name, updates, 2, **_kwargs(name, updates))
    torch.testing.assert_close(result.update, common)


def test_trimmed_mean_without_trimming_is_the_mean():
    updates = _random(5)
    torch.testing.assert_close(trimmed_mean(updates, f=0).update, updates.mean(0))
    assert trimmed_mean(updates, f=0).kept.tolist() == [1.0] * 11


@pytest.mark.parametrize("outliers", ["colluding", "random_sign"])
def test_robust_rules_resist_huge_outliers(outliers):
    n, f, d = 11, 2, 8
    gen = torch.Generator().manual_seed(7)
    benign = 1.0 + 0.3 * torch.randn(n - f, d, generator=gen, dtype=torch.float64)
    if outliers == "colluding":
        bad = torch.full((f, d), 1e6, dtype=torch.float64)
    else:
        bad = 1e6 * torch.randint(0, 2, (f, d), generator=gen).double().mul(2).sub(1)
    updates = torch.cat([benign[:4], bad, benign[4:]])  # attackers at indices 4, 5
    target = benign.mean(0)
    assert (mean(updates, f).update - target).norm() > 1e4
    for name in ROBUST:
        result = aggregate(name, updates, f, **_kwargs(name, updates, root=target))
        assert (result.update - target).norm() < 3.0, name
        if name in SELECTING:
            assert result.kept[4:6].tolist() == [0.0, 0.0], name


# ------------------------------------------------------------------ bad input


def test_unknown_rule_lists_the_known_ones():
    with pytest.raises(InputError, match="unknown aggregator 'avg'.*mean, median"):
        aggregate("avg", _random(0), 1)
    with pytest.raises(InputError, match="unknown aggregator"):
        max_tolerated("avg", 5)


@pytest.mark.parametrize("f", [True, -1, 1.0, "1"])
def test_bad_f(f):
    with pytest.raises(InputError, match="f \\(malicious clients\\) must be an int"):
        aggregate("median", _random(0), f)
    with pytest.raises(InputError, match="must be an int"):
        krum(_random(0), f)


@pytest.mark.parametrize(
    "updates",
    [torch.zeros(5), torch.zeros(0, 3), torch.zeros(3, 0), torch.zeros(2, 3, 1), [[1.0]]],
)
def test_bad_updates(updates):
    with pytest.raises(InputError, match="non-empty \\(n, d\\) tensor"):
        aggregate("mean", updates, 0)


def test_integer_updates_rejected():
    with pytest.raises(InputError, match="floating-point"):
        aggregate("mean", torch.ones(3, 2, dtype=torch.long), 0)


def test_f_at_half_of_n_is_always_an_error():
    for name in AGGREGATORS:
        with pytest.raises(InputError, match="f=5 malicious clients of n=10: no rule tolerates"):
            aggregate(name, _random(0, n=10), 5)


def test_rule_bounds_name_the_rule():
    with pytest.raises(InputError, match=r"bulyan needs n >= 4f \+ 3, got n=10, f=2 \(at most f=1"):
        aggregate("bulyan", _random(0, n=10), 2)
    with pytest.raises(InputError, match=r"krum needs n >= 2f \+ 3, got n=4, f=1"):
        krum(_random(0, n=4), 1)
    with pytest.raises(InputError, match="trimmed_mean needs n > 2f"):
        trimmed_mean(_random(0, n=4), 2)
    with pytest.raises(InputError, match="bulyan needs .*it cannot run with n=2"):
        bulyan(_random(0, n=2), 0)


@pytest.mark.parametrize("m", [0, 12, True, 2.0])
def test_multi_krum_bad_m(m):
    with pytest.raises(InputError, match=f"m={m!r}.*more selections than clients"):
        aggregate("multi_krum", _random(0), 2, m=m)


def test_fltrust_needs_a_root_update():
    updates = _random(0)
    with pytest.raises(InputError, match="fltrust needs root_update, a \\(6,\\) tensor, got None"):
        aggregate("fltrust", updates, 1)
    with pytest.raises(InputError, match="got \\(5,\\)"):
        fltrust(updates, root_update=torch.zeros(5))
    with pytest.raises(InputError, match="finite root_update"):
        fltrust(updates, root_update=torch.full((6,), math.nan))


def test_centered_clipping_bad_arguments():
    updates = _random(0)
    for tau in (0.0, -1.0, math.inf, True):
        with pytest.raises(InputError, match=f"tau > 0, got tau={tau!r}"):
            centered_clipping(updates, tau=tau)
    with pytest.raises(InputError, match="iterations >= 1, got 0"):
        centered_clipping(updates, iterations=0)
    with pytest.raises(InputError, match="center None or a \\(6,\\) tensor, got \\(3,\\)"):
        centered_clipping(updates, center=torch.zeros(3))


def test_unknown_rule_argument():
    with pytest.raises(InputError, match="krum takes no argument 'm'; it takes: none"):
        aggregate("krum", _random(0), 1, m=3)
    with pytest.raises(InputError, match="median takes no argument 'tau'"):
        aggregate("median", _random(0), 1, tau=1.0)


# ------------------------------------------------------------------ non-finite updates


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rows_are_dropped_with_a_warning(bad):
    updates = _random(0, n=9)
    updates[3, 2] = bad
    with pytest.warns(RuntimeWarning, match=r"dropped 1 of 9 .*clients \[3\]"):
        result = aggregate("krum", updates, 2)
    assert bool(torch.isfinite(result.update).all())
    assert result.kept[3] == 0 and result.kept.sum() == 1
    expected = krum(torch.cat([updates[:3], updates[4:]]), 2)  # the rule on the finite rows
    torch.testing.assert_close(result.update, expected.update)


@pytest.mark.parametrize("name", list(AGGREGATORS))
def test_every_rule_survives_a_nan_row(name):
    updates = _random(1, n=12)  # 11 finite rows: enough for bulyan with f=2
    updates[0] = math.nan
    with pytest.warns(RuntimeWarning, match=r"clients \[0\]"):
        result = aggregate(name, updates, 2, **_kwargs(name, updates[1:]))
    assert bool(torch.isfinite(result.update).all()) and result.kept[0] == 0


def test_dropped_rows_count_against_f_or_all_non_finite():
    updates = _random(0, n=11)
    updates[[1, 5]] = math.nan  # 9 finite rows left: bulyan with f=2 would need 11
    with pytest.warns(RuntimeWarning, match=r"dropped 2 of 11 .*clients \[1, 5\]"):
        result = aggregate("bulyan", updates, 2)
    finite = torch.isfinite(updates).all(dim=1)
    torch.testing.assert_close(result.update, bulyan(updates[finite], 0).update)  # f - 2 = 0
    with pytest.raises(InputError, match="all n=3 updates have NaN or inf"):
        aggregate("mean", torch.full((3, 2), math.nan), 1)


def test_iterated_multi_krum_admits_colluders_at_default_m():
    # Why one-shot scoring is the default: iterated selection makes its last pick among f + 1
    # updates, f of them identical attackers, so one attacker gets in.
    benign = 1.0 + 0.3 * torch.randn(9, 4, generator=torch.Generator().manual_seed(2))
    updates = torch.cat([benign, torch.full((2, 4), 1e6)])
    assert multi_krum(updates, f=2).kept[9:].tolist() == [0.0, 0.0]
    assert multi_krum(updates, f=2, iterated=True).kept[9:].sum() == 1.0
