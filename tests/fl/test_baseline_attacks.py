"""Tests of the baseline model-poisoning attacks against the papers' formulas."""

import math

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.fl.attack import Aggregation, AttackContext
from ada_modules.fl.baseline_attacks import (
    ATTACKS,
    IPM,
    LIE,
    FangKrum,
    FangTrimmedMean,
    MinMax,
    MinSum,
    NoAttack,
)

N, F, D = 10, 3, 12


def make_benign(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (0.2 + 0.5 * torch.randn(N - F, D, generator=generator)).to(dtype)


def make_context(**kwargs) -> AttackContext:
    return AttackContext(num_clients=kwargs.pop("n", N), num_malicious=F, round=0, **kwargs)


def krum(updates: torch.Tensor, f: int) -> Aggregation:
    n = updates.shape[0]
    x = updates.double()
    scores = (torch.cdist(x, x) ** 2).sort(1).values[:, 1 : n - f - 1].sum(1)
    kept = torch.zeros(n, dtype=updates.dtype)
    kept[scores.argmin()] = 1.0
    return Aggregation(updates[scores.argmin()], kept)


def never_malicious(updates: torch.Tensor) -> Aggregation:
    kept = torch.zeros(updates.shape[0], dtype=updates.dtype)
    kept[0] = 1.0
    return Aggregation(updates[0], kept)


def test_registry_names() -> None:
    assert set(ATTACKS) == {
        "none",
        "lie",
        "ipm",
        "min_max",
        "min_sum",
        "fang_krum",
        "fang_trimmed_mean",
    }


@pytest.mark.parametrize("name", sorted(ATTACKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_shape_and_dtype(name: str, dtype: torch.dtype) -> None:
    benign = make_benign(dtype=dtype)
    context = make_context(aggregator=lambda u: krum(u, F))
    out = ATTACKS[name]().craft(benign, context)
    assert out.shape == (F, D)
    assert out.dtype == dtype and out.device == benign.device
    assert torch.isfinite(out.float()).all()


def test_no_attack_returns_own_updates() -> None:
    benign, own = make_benign(), torch.randn(F, D, dtype=torch.float64)
    assert torch.equal(NoAttack().craft(benign, make_context(own_updates=own)), own)
    mean = NoAttack().craft(benign, make_context())
    assert torch.allclose(mean, benign.mean(0).expand(F, -1))
    with pytest.raises(InputError, match="own_updates"):
        NoAttack().craft(benign, make_context(own_updates=torch.zeros(F + 1, D)))


def test_lie_fixed_z() -> None:
    benign = make_benign()
    out = LIE(z=1.5).craft(benign, make_context())
    expected = benign.mean(0) - 1.5 * benign.std(0, correction=1)
    assert torch.allclose(out, expected.expand(F, -1))
    out0 = LIE(z=1.0, correction=0).craft(benign, make_context())
    assert torch.allclose(out0[0], benign.mean(0) - benign.std(0, correction=0))


def test_lie_z_max() -> None:
    # n = 20, f = 4: s = 10 + 1 - 4 = 7, p = (16 - 7) / 16 = 0.5625, Phi^-1(0.5625) ~ 0.1573.
    z = LIE.z_max(20, 4)
    assert z == pytest.approx(0.15731068, abs=1e-6)
    assert z == pytest.approx(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.5625)))
    benign = torch.randn(16, 5, dtype=torch.float64)
    context = AttackContext(num_clients=20, num_malicious=4, round=0)
    expected = benign.mean(0) - z * benign.std(0)
    assert torch.allclose(LIE().craft(benign, context)[3], expected)
    # Edge cases stay finite: n = 2 (p = 0) and a malicious majority (p >= 1).
    assert math.isfinite(LIE.z_max(2, 1)) and LIE.z_max(2, 1) < 0
    assert math.isfinite(LIE.z_max(10, 6)) and LIE.z_max(10, 6) > 4


def test_ipm() -> None:
    benign = make_benign()
    assert torch.allclose(
        IPM(0.3).craft(benign, make_context()), -0.3 * benign.mean(0).expand(F, -1)
    )


def test_min_max_min_sum_constraints_and_maximal_gamma() -> None:
    benign = make_benign(seed=1)
    mu, dist = benign.mean(0), torch.cdist(benign, benign)

    def max_dist(m: torch.Tensor) -> float:
        return (benign - m).norm(dim=1).max().item()

    def sum_sq(m: torch.Tensor) -> float:
        return ((benign - m) ** 2).sum().item()

    cases = [
        (MinMax, max_dist, dist.max().item()),
        (MinSum, sum_sq, (dist**2).sum(1).max().item()),
    ]
    for cls, score, threshold in cases:
        for perturbation in ("unit_vec", "sign", "std"):
            attack = cls(perturbation=perturbation)
            out = attack.craft(benign, make_context())
            p = attack.direction(benign)
            gamma = attack.last_gamma
            assert 0 < gamma < 2 * attack.gamma_init, (cls, perturbation, gamma)
            assert torch.allclose(out, (mu + gamma * p).expand(F, -1))
            assert score(out[0]) <= threshold
            assert score(mu + gamma * (1 + 1e-3) * p) > threshold, (cls, perturbation)
    # The perturbation points against the benign direction.
    assert (MinMax("unit_vec").direction(benign) @ mu) < 0


def test_fang_krum_selected_by_krum() -> None:
    benign = make_benign(seed=2)
    attack = FangKrum()
    out = attack.craft(benign, make_context(aggregator=lambda u: krum(u, F)))
    assert attack.last_selected and attack.last_lambda >= 1e-5
    assert attack.last_lambda < FangKrum.lambda_init(benign, N, F)  # it had to halve
    expected = -attack.last_lambda * torch.sign(benign.mean(0))
    assert torch.allclose(out, expected.expand(F, -1))
    kept = krum(torch.cat([benign, out]), F).kept
    assert kept[N - F :].sum() == 1


def test_fang_krum_never_selected() -> None:
    benign = make_benign(seed=2)
    attack = FangKrum()
    out = attack.craft(benign, make_context(aggregator=never_malicious))
    assert not attack.last_selected and attack.last_lambda < 1e-5
    # The rows are -lambda * sign(mu) with the final, sub-threshold lambda.
    assert torch.allclose(out, (-attack.last_lambda * torch.sign(benign.mean(0))).expand(F, -1))
    assert out.abs().max() < 1e-5


def test_fang_krum_lambda_bound() -> None:
    benign = make_benign(seed=3)
    n, f, d = N, F, D
    dist = torch.cdist(benign, benign)
    near = dist.sort(1).values[:, 1 : n - f - 1].sum(1).min()
    expected = near / ((n - 2 * f - 1) * d**0.5) + benign.norm(dim=1).max() / d**0.5
    assert FangKrum.lambda_init(benign, n, f) == pytest.approx(expected.item())
    assert FangKrum.lambda_init(benign, 6, 3) == pytest.approx(2 * benign.abs().max().item())


def test_fang_trimmed_mean_intervals_and_determinism() -> None:
    benign = torch.randn(N - F, 400, dtype=torch.float64)
    benign[:, :100] += 1.0  # coordinates with a positive minimum
    benign[:, 100:200] -= 1.0  # and with a negative maximum
    b = 2.0
    attack = FangTrimmedMean(b=b, seed=7)
    out = attack.craft(benign, make_context())
    top, bottom, positive = benign.max(0).values, benign.min(0).values, benign.mean(0) > 0
    low = torch.where(positive, torch.where(bottom > 0, bottom / b, b * bottom), top)
    high = torch.where(positive, bottom, torch.where(top > 0, b * top, top / b))
    assert (low <= high).all()
    assert ((out >= low) & (out <= high)).all()
    assert (out[:, positive] <= bottom[positive]).all() and (
        out[:, ~positive] >= top[~positive]
    ).all()
    assert not torch.equal(out[0], out[1])  # rows sampled independently
    again = FangTrimmedMean(b=b, seed=7).craft(benign, make_context())
    assert torch.equal(out, again)
    later = AttackContext(num_clients=N, num_malicious=F, round=1)
    assert not torch.equal(out, attack.craft(benign, later))
    assert not torch.equal(out, FangTrimmedMean(b=b, seed=8).craft(benign, make_context()))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: IPM(epsilon=0.0), "epsilon"),
        (lambda: IPM(epsilon=-1.0), "epsilon"),
        (lambda: IPM(epsilon="0.5"), "epsilon"),
        (lambda: IPM(epsilon=math.nan), "epsilon"),
        (lambda: MinMax(perturbation="bogus"), "allowed: unit_vec, sign, std"),
        (lambda: MinSum(perturbation="sgn"), "'sgn'"),
        (lambda: LIE(z=-0.5), "z must be"),
        (lambda: LIE(correction=2), "correction"),
        (lambda: FangTrimmedMean(b=0.5), "b must be"),
        (lambda: FangTrimmedMean(seed=-1), "seed"),
    ],
)
def test_bad_arguments(build, match: str) -> None:
    with pytest.raises(InputError, match=match):
        build()


def test_bad_craft_inputs() -> None:
    with pytest.raises(InputError, match="aggregator"):
        FangKrum().craft(make_benign(), make_context())
    for name in sorted(ATTACKS):
        with pytest.raises(InputError, match="benign"):
            ATTACKS[name]().craft(torch.zeros(1, D), make_context(aggregator=never_malicious))
    with pytest.raises(InputError, match="benign"):
        LIE().craft(torch.zeros(D), make_context())
    zero = AttackContext(num_clients=N, num_malicious=0, round=0)
    with pytest.raises(InputError, match="num_malicious"):
        IPM().craft(make_benign(), zero)
    assert NoAttack().craft(make_benign(), zero).shape == (0, D)


def test_fang_krum_ends_when_the_benign_updates_overflow_its_bound():
    """A diverged model's huge updates make the paper's bound infinite; the search still ends."""
    benign = torch.full((6, 3), 3e38)
    benign[0] = -3e38
    context = AttackContext(
        num_clients=8, num_malicious=2, round=0, aggregator=lambda u: Aggregation(u[0], u[:, 0] * 0)
    )
    rows = FangKrum().craft(benign, context)
    assert rows.shape == (2, 3) and torch.isfinite(rows).all()
