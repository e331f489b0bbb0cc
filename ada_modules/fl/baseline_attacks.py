"""Baseline model-poisoning attacks of the FL simulator, written from the papers' formulas.

Each attack sees the ``(n - f, d)`` benign updates of a round (the omniscient threat model) and
returns the ``(f, d)`` malicious ones, ``f = context.num_malicious``, on the benign tensor's device
and dtype. ``ATTACKS`` maps the names used by configs to the classes.

Examples:
    >>> import torch
    >>> from ada_modules.fl.attack import AttackContext
    >>> benign = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    >>> context = AttackContext(num_clients=10, num_malicious=2, round=0)
    >>> ATTACKS["lie"]().craft(benign, context).shape
    torch.Size([2, 5])
    >>> torch.allclose(IPM(epsilon=0.5).craft(benign, context)[1], -0.5 * benign.mean(0))
    True
"""

import math
from numbers import Real
from statistics import NormalDist

import torch
from torch import Tensor

from ada_modules.errors import InputError
from ada_modules.fl.attack import Attack, AttackContext

__all__ = ["ATTACKS", "IPM", "LIE", "FangKrum", "FangTrimmedMean", "MinMax", "MinSum", "NoAttack"]


def _number(name: str, value: object, low: float, *, strict: bool) -> float:
    """``value`` as a float, checked to be a finite real number ``> low`` (or ``>= low``)."""
    bad = not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value)
    if bad or (value <= low if strict else value < low):
        raise InputError(
            f"{name} must be a finite number {'>' if strict else '>='} {low}, got {value!r}"
        )
    return float(value)


def _check(benign: Tensor, context: AttackContext, *, attack: bool = True) -> int:
    """Validate the craft inputs; return ``f``."""
    if not isinstance(benign, Tensor) or benign.ndim != 2 or benign.shape[0] < 2:
        shape = tuple(benign.shape) if isinstance(benign, Tensor) else type(benign).__name__
        raise InputError(f"benign must be a 2-D tensor (n - f, d) with >= 2 rows, got {shape}")
    if not benign.is_floating_point():
        raise InputError(f"benign must be a floating-point tensor, got dtype {benign.dtype}")
    f = context.num_malicious
    if not isinstance(f, int) or isinstance(f, bool) or f < (1 if attack else 0):
        need = ">= 1 for a real attack" if attack else ">= 0"
        raise InputError(f"context.num_malicious must be an int {need}, got {f!r}")
    return f


def _repeat(row: Tensor, f: int, like: Tensor) -> Tensor:
    """``f`` copies of ``row`` as an ``(f, d)`` tensor on ``like``'s device and dtype."""
    return row.to(like.device, like.dtype).unsqueeze(0).repeat(f, 1)


def _work(benign: Tensor) -> Tensor:
    """``benign`` in at least float32 (the distance computations of the searches)."""
    return benign if benign.dtype in (torch.float32, torch.float64) else benign.float()


class NoAttack(Attack):
    """The "none" arm: the malicious clients send their honest updates.

    ``context.own_updates`` when given (it must be ``(f, d)``), else the benign mean repeated.
    """

    def craft(self, benign: Tensor, context: AttackContext) -> Tensor:
        f = _check(benign, context, attack=False)
        own = context.own_updates
        if own is None:
            return _repeat(benign.mean(0), f, benign)
        if not isinstance(own, Tensor) or tuple(own.shape) != (f, benign.shape[1]):
            shape = tuple(own.shape) if isinstance(own, Tensor) else type(own).__name__
            raise InputError(f"context.own_updates must be ({f}, {benign.shape[1]}), got {shape}")
        return own.to(benign.device, benign.dtype)


class LIE(Attack):
    """ "A little is enough" (Baruch et al., NeurIPS 2019): ``m = mu - z * sigma`` per coordinate.

    ``mu``/``sigma`` are the coordinate-wise mean and standard deviation of the benign updates
    (``correction=1``, the unbiased estimate, by default; 0 for the population one). ``z=None``
    uses the paper's ``z_max = Phi^-1((n - f - s) / (n - f))`` with ``s = floor(n / 2) + 1 - f``
    from ``context.num_clients`` and ``context.num_malicious``; the probability is clamped into
    ``[1e-6, 1 - 1e-6]`` (|z| <= 4.75): it reaches 0 for ``n <= 2`` and 1 or more with a malicious
    majority (``s <= 0``), where the exact quantile is infinite. The paper's sign is kept: for an
    even ``n`` with ``f = 1`` the probability is below 1/2 and ``z_max`` is slightly negative. A
    fixed ``z >= 0`` overrides it. All ``f`` rows are identical.
    """

    def __init__(self, z: float | None = None, correction: int = 1) -> None:
        self.z = None if z is None else _number("z", z, 0.0, strict=False)
        if (
            not isinstance(correction, int)
            or isinstance(correction, bool)
            or correction not in (0, 1)
        ):
            raise InputError(f"correction must be 0 or 1, got {correction!r}")
        self.correction = correction

    @staticmethod
    def z_max(num_clients: int, num_malicious: int) -> float:
        """The paper's ``z_max`` for ``n`` clients of which ``f`` are malicious (clamped)."""
        n, f = num_clients, num_malicious
        if n - f < 1:
            raise InputError(f"LIE needs num_clients > num_malicious, got n={n}, f={f}")
        s = n // 2 + 1 - f
        p = min(max((n - f - s) / (n - f), 1e-6), 1.0 - 1e-6)
        return NormalDist().inv_cdf(p)

    def craft(self, benign: Tensor, context: AttackContext) -> Tensor:
        f = _check(benign, context)
        z = self.z if self.z is not None else self.z_max(context.num_clients, f)
        sigma = benign.std(0, correction=self.correction)
        return _repeat(benign.mean(0) - z * sigma, f, benign)


class IPM(Attack):
    """Inner-product manipulation (Xie et al., UAI 2020): ``m = -epsilon * mean(benign)``.

    Small ``epsilon`` (0.1-0.5) slips past robust rules; a large one (e.g. 100) breaks the mean.
    """

    def __init__(self, epsilon: float = 0.5) -> None:
        self.epsilon = _number("epsilon", epsilon, 0.0, strict=True)

    def craft(self, benign: Tensor, context: AttackContext) -> Tensor:
        return _repeat(-self.epsilon * benign.mean(0), _check(benign, context), benign)


PERTURBATIONS = ("unit_vec", "sign", "std")  # the allowed MinMax / MinSum perturbations


class _MinDistance(Attack):
    """Shared part of Min-Max / Min-Sum: ``m = mu + gamma * p`` with the largest admissible gamma.

    ``p`` points against the benign direction: ``-mu / ||mu||`` ("unit_vec"), ``-sign(mu)``
    ("sign") or ``-std`` ("std", coordinate-wise, correction 1). The paper's search: start at
    ``gamma_init``, step ``gamma_init / 2``; grow by the step while the condition holds (keeping
    the last gamma that held), shrink otherwise, halve the step, stop once it is below ``tol``. It
    explores ``(0, 2 * gamma_init)``; gamma = 0 (``m = mu``) always satisfies both conditions and is
    returned if nothing larger does. ``last_gamma`` holds the value of the latest call.
    """

    def __init__(
        self, perturbation: str = "std", gamma_init: float = 10.0, tol: float = 1e-5
    ) -> None:
        if perturbation not in PERTURBATIONS:
            allowed = ", ".join(PERTURBATIONS)
            raise InputError(f"unknown perturbation {perturbation!r}; allowed: {allowed}")
        self.perturbation = perturbation
        self.gamma_init = _number("gamma_init", gamma_init, 0.0, strict=True)
        self.tol = _number("tol", tol, 0.0, strict=True)
        self.last_gamma: float | None = None

    def direction(self, benign: Tensor) -> Tensor:
        """The perturbation ``p`` (against the benign direction) for these benign updates."""
        mu = benign.mean(0)
        if self.perturbation == "unit_vec":
            return -mu / mu.norm().clamp_min(torch.finfo(mu.dtype).tiny)
        if self.perturbation == "sign":
            return -torch.sign(mu)
        return -benign.std(0)

    def score(self, benign: Tensor, m: Tensor) -> float:
        """The left side of the condition for the crafted update ``m``."""
        raise NotImplementedError

    def threshold(self, benign: Tensor) -> float:
        """The right side of the condition (from the benign updates alone)."""
        raise NotImplementedError

    def craft(self, benign: Tensor, context: AttackContext) -> Tensor:
        f = _check(benign, context)
        work = _work(benign)
        mu, p = work.mean(0), self.direction(work)
        threshold = self.threshold(work)
        gamma, step, best = self.gamma_init, self.gamma_init / 2, 0.0
        while step >= self.tol:
            if self.score(work, mu + gamma * p) <= threshold:
                best, gamma = gamma, gamma + step
            else:
                gamma -= step
            step /= 2
        self.last_gamma = best
        return _repeat(mu + best * p, f, benign)


def _pairwise(x: Tensor) -> Tensor:
    """Exact Euclidean distances between the rows of ``x``, ``(n, n)``."""
    return torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")


class MinMax(_MinDistance):
    """Min-Max (Shejwalkar & Houmansadr, NDSS 2021).

    Condition: ``max_i ||m - b_i|| <= max_{i,j} ||b_i - b_j||``. All ``f`` rows are identical.
    """

    def score(self, benign: Tensor, m: Tensor) -> float:
        return (benign - m).norm(dim=1).max().item()

    def threshold(self, benign: Tensor) -> float:
        return _pairwise(benign).max().item()


class MinSum(_MinDistance):
    """Min-Sum (Shejwalkar & Houmansadr, NDSS 2021).

    Condition: ``sum_i ||m - b_i||^2 <= max_i sum_j ||b_i - b_j||^2``. All ``f`` rows identical.
    """

    def score(self, benign: Tensor, m: Tensor) -> float:
        return ((benign - m) ** 2).sum().item()

    def threshold(self, benign: Tensor) -> float:
        return (_pairwise(benign) ** 2).sum(1).max().item()


class FangKrum(Attack):
    """Fang et al. (USENIX Security 2020), the Krum variant with full knowledge.

    ``c = -lambda * sign(mean(benign))``. ``lambda`` starts at the paper's upper bound, in update
    terms (the global model is the zero update), with ``k = n - f - 2`` nearest benign neighbours:
    ``min_i sum_{l in N_k(i)} ||b_l - b_i|| / ((n - 2f - 1) sqrt(d)) + max_i ||b_i|| / sqrt(d)``;
    when ``n - 2f - 1 <= 0`` (outside Krum's assumption) it starts at ``2 * max_i ||b_i||_inf``.
    It halves until ``context.aggregator``, run on ``[benign; f copies of c]``, keeps a crafted row
    (``kept > 0``) or ``lambda < 1e-5``; in that case the rows are ``-lambda * sign(mu)`` with the
    final, sub-threshold lambda (nearly zero updates, as in the paper). The other ``f - 1``
    attackers send copies of ``c`` (the paper perturbs them slightly). ``last_lambda`` and
    ``last_selected`` report the latest call.
    """

    def __init__(self, threshold: float = 1e-5) -> None:
        self.threshold = _number("threshold", threshold, 0.0, strict=True)
        self.last_lambda: float | None = None
        self.last_selected: bool | None = None

    @staticmethod
    def lambda_init(benign: Tensor, num_clients: int, num_malicious: int) -> float:
        """The starting ``lambda`` (see the class docstring)."""
        n, f, (k, d) = num_clients, num_malicious, benign.shape
        if n - 2 * f - 1 <= 0:
            return 2.0 * benign.abs().max().item()
        dist = _pairwise(_work(benign))
        neighbours = max(min(n - f - 2, k - 1), 0)
        near = dist.sort(1).values[:, 1 : 1 + neighbours].sum(1).min()
        bound = near / ((n - 2 * f - 1) * math.sqrt(d)) + benign.norm(dim=1).max() / math.sqrt(d)
        return float(bound)

    def craft(self, benign: Tensor, context: AttackContext) -> Tensor:
        f = _check(benign, context)
        if context.aggregator is None:
            raise InputError(
                "FangKrum needs the server's rule: context.aggregator must be a callable "
                "updates[n, d] -> Aggregation, got None"
            )
        direction, k = torch.sign(benign.mean(0)), benign.shape[0]
        lam, selected = self.lambda_init(benign, context.num_clients, f), False
        if not math.isfinite(lam):  # benign updates so large that the bound overflows
            lam = torch.finfo(benign.dtype).max
        while lam >= self.threshold:
            rows = _repeat(-lam * direction, f, benign)
            kept = context.aggregator(torch.cat([benign, rows])).kept
            if bool((kept[k:] > 0).any()):
                selected = True
                break
            lam /= 2
        self.last_lambda, self.last_selected = lam, selected
        return _repeat(-lam * direction, f, benign)


class FangTrimmedMean(Attack):
    """Fang et al. (USENIX Security 2020), the trimmed-mean / median variant, full knowledge.

    Per coordinate ``j`` with ``s_j = sign(mean_j)`` and the benign ``max_j``/``min_j``: if
    ``s_j > 0`` each malicious value is uniform in ``[min_j / b, min_j]`` (``min_j > 0``) or
    ``[b * min_j, min_j]``; if ``s_j <= 0`` uniform in ``[max_j, b * max_j]`` (``max_j > 0``) or
    ``[max_j, max_j / b]``. Rows are sampled independently (in float64 on the CPU, so the result
    does not depend on the device) from a generator seeded with ``seed * 1_000_003 + round``:
    deterministic per seed and round, and different seeds do not share a round's draws.
    """

    def __init__(self, b: float = 2.0, seed: int = 0) -> None:
        self.b = _number("b", b, 1.0, strict=False)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**40:
            raise InputError(f"seed must be an int in [0, 2**40), got {seed!r}")
        self.seed = seed

    def interval(self, benign: Tensor) -> tuple[Tensor, Tensor]:
        """The per-coordinate ``(low, high)`` bounds the malicious values are drawn from."""
        x, b = benign.double(), self.b
        top, bottom = x.max(0).values, x.min(0).values
        below = torch.where(bottom > 0, bottom / b, b * bottom)  # just under the minimum
        above = torch.where(top > 0, b * top, top / b)  # just over the maximum
        positive = x.mean(0) > 0
        return torch.where(positive, below, top), torch.where(positive, bottom, above)

    def craft(self, benign: Tensor, context: AttackContext) -> Tensor:
        f = _check(benign, context)
        low, high = (t.cpu() for t in self.interval(benign))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + context.round)
        u = torch.rand(f, benign.shape[1], generator=generator, dtype=torch.float64)
        return (low + u * (high - low)).to(benign.device, benign.dtype)


ATTACKS: dict[str, type[Attack]] = {
    "none": NoAttack,
    "lie": LIE,
    "ipm": IPM,
    "min_max": MinMax,
    "min_sum": MinSum,
    "fang_krum": FangKrum,
    "fang_trimmed_mean": FangTrimmedMean,
}
