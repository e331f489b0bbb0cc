"""Robust aggregation rules of a federated-learning round, as pure torch functions.

Every rule is ``rule(updates[n, d], f, **rule_kwargs) -> Aggregation(update[d], kept[n])`` with
``f`` the number of Byzantine clients it must tolerate; ``kept[i]`` is the share of client ``i``'s
update that entered the result (see :class:`~ada_modules.fl.attack.Aggregation`). A simulator calls
:func:`aggregate`, which validates the input and drops non-finite rows before the rule runs; the
rules can also be called directly (they validate their own requirements).

Examples:
    >>> import torch
    >>> updates = torch.tensor([[1.0, 2.0], [1.2, 1.8], [0.8, 2.2], [0.9, 2.1], [1e6, -1e6]])
    >>> result = aggregate("median", updates, f=1)
    >>> result.update
    tensor([1., 2.])
    >>> result.kept
    tensor([1., 0., 0., 0., 0.])
    >>> max_tolerated("bulyan", 11)
    2
"""

import inspect
import math
import warnings
from collections.abc import Callable
from numbers import Real

import torch
from torch import Tensor

from ada_modules.checks import is_int
from ada_modules.errors import InputError
from ada_modules.fl.attack import Aggregation

__all__ = [
    "AGGREGATORS", "aggregate", "bulyan", "centered_clipping", "coordinate_median", "fltrust",
    "krum", "max_tolerated", "mean", "multi_krum", "trimmed_mean",
]  # fmt: skip

# name -> (the rule's requirement, the largest f it tolerates with n clients; -1: it cannot run).
_HALF = ("n > 2f", lambda n: (n - 1) // 2)
_KRUM = ("n >= 2f + 3", lambda n: (n - 3) // 2)
_BOUNDS: dict[str, tuple[str, Callable[[int], int]]] = {
    "mean": _HALF,
    "median": _HALF,
    "trimmed_mean": _HALF,
    "krum": _KRUM,
    "multi_krum": _KRUM,
    "bulyan": ("n >= 4f + 3", lambda n: (n - 3) // 4),
    "fltrust": _HALF,
    "centered_clipping": _HALF,
}


def _check_name(name: object) -> str:
    if not isinstance(name, str) or name not in _BOUNDS:
        raise InputError(f"unknown aggregator {name!r}; known: {', '.join(_BOUNDS)}")
    return name


def _check_updates(updates: object) -> tuple[int, int]:
    if not isinstance(updates, Tensor) or updates.dim() != 2 or 0 in updates.shape:
        shape = tuple(updates.shape) if isinstance(updates, Tensor) else type(updates).__name__
        raise InputError(f"updates must be a non-empty (n, d) tensor, got {shape}")
    if not updates.is_floating_point():
        raise InputError(f"updates must be a floating-point tensor, got {updates.dtype}")
    return updates.shape[0], updates.shape[1]


def _check_f(f: object) -> int:
    if not is_int(f) or f < 0:  # type: ignore[operator]
        raise InputError(f"f (malicious clients) must be an int >= 0, got {f!r}")
    return int(f)  # type: ignore[arg-type]


def _require(name: str, n: int, f: int) -> None:
    condition, bound = _BOUNDS[name]
    if f > bound(n):
        allowed = f"at most f={bound(n)}" if bound(n) >= 0 else "it cannot run"
        raise InputError(f"{name} needs {condition}, got n={n}, f={f} ({allowed} with n={n})")


def _check(name: str, updates: Tensor, f: int) -> tuple[int, int]:
    n, d = _check_updates(updates)
    _require(name, n, _check_f(f))
    return n, d


def _window(updates: Tensor, lo: int, hi: int) -> Aggregation:
    """Per coordinate, the mean of the sorted values at ranks ``lo .. hi - 1``."""
    values, order = torch.sort(updates, dim=0, stable=True)
    used = torch.zeros_like(updates).scatter_(0, order[lo:hi], 1.0)
    return Aggregation(values[lo:hi].mean(0), used.mean(1))


def _sq_distances(updates: Tensor) -> Tensor:
    x = updates if updates.dtype in (torch.float32, torch.float64) else updates.float()
    # Exact differences (not the |a|^2 + |b|^2 - 2ab expansion, which cancels for huge outliers).
    return torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist").square()


def _krum_scores(dist: Tensor, k: int) -> Tensor:
    """Per row, the sum of the squared distances to its ``k`` nearest other rows."""
    k = max(0, min(k, dist.shape[0] - 1))
    others = dist + torch.diag(torch.full_like(dist.diagonal(), math.inf))
    return others.topk(k, dim=1, largest=False).values.sum(1)


def _iterated_krum(dist: Tensor, f: int, count: int) -> Tensor:
    """Indices of ``count`` rows chosen by repeated Krum on the rows not yet chosen.

    With ``r`` rows remaining, each is scored on its ``max(r - f - 2, f)`` nearest remaining rows
    (at most ``r - 1``): Krum's own count while ``r >= 2f + 2``, and ``f`` below it. At least
    ``f`` neighbours keep up to ``f`` colluding attackers from scoring 0 among themselves, and at
    most ``r - f - 1`` can all be honest; both hold down to ``r = 2f + 1``, Bulyan's last step.
    Ties go to the lower index.
    """
    remaining = torch.arange(dist.shape[0], device=dist.device)
    chosen = []
    for _ in range(count):
        r = remaining.numel()
        scores = _krum_scores(dist[remaining][:, remaining], max(r - f - 2, f))
        winner = int(scores.argmin())
        chosen.append(remaining[winner])
        remaining = torch.cat([remaining[:winner], remaining[winner + 1 :]])
    return torch.stack(chosen)


def _selection(updates: Tensor, chosen: Tensor) -> Aggregation:
    kept = torch.zeros(updates.shape[0], dtype=updates.dtype, device=updates.device)
    kept[chosen] = 1.0
    return Aggregation(updates[chosen].mean(0), kept)


def mean(updates: Tensor, f: int = 0) -> Aggregation:
    """The plain average (FedAvg/FedSGD); tolerates no attacker, accepts any ``f < n/2``.

    >>> mean(torch.tensor([[0.0, 2.0], [2.0, 4.0]])).update
    tensor([1., 3.])
    """
    n, _ = _check("mean", updates, f)
    return Aggregation(updates.mean(0), torch.ones(n, dtype=updates.dtype, device=updates.device))


def coordinate_median(updates: Tensor, f: int = 0) -> Aggregation:
    """The coordinate-wise median (for even ``n`` the mean of the two middle values).

    ``kept[i]``: the share of coordinates where client ``i``'s value is one of the middle values.

    >>> coordinate_median(torch.tensor([[1.0], [5.0], [2.0], [9.0]]))
    Aggregation(update=tensor([3.5000]), kept=tensor([0., 1., 1., 0.]))
    """
    n, _ = _check("median", updates, f)
    return _window(updates, (n - 1) // 2, n // 2 + 1)


def trimmed_mean(updates: Tensor, f: int) -> Aggregation:
    """Per coordinate, drop the ``f`` largest and ``f`` smallest values and average the rest.

    Needs ``n > 2f``; ``kept[i]``: the share of coordinates where client ``i`` was not trimmed.

    >>> trimmed_mean(torch.tensor([[-100.0], [1.0], [2.0], [3.0], [100.0]]), f=1).update
    tensor([2.])
    """
    n, _ = _check("trimmed_mean", updates, f)
    return _window(updates, f, n - f)


def krum(updates: Tensor, f: int) -> Aggregation:
    """Krum (Blanchard et al., 2017): the update with the least sum of squared distances to its
    ``n - f - 2`` nearest others. Needs ``n >= 2f + 3``; ties go to the lower index.

    >>> krum(torch.tensor([[0.0], [0.1], [0.2], [0.3], [50.0]]), f=1).kept
    tensor([0., 1., 0., 0., 0.])
    """
    n, _ = _check("krum", updates, f)
    scores = _krum_scores(_sq_distances(updates), n - f - 2)
    return _selection(updates, scores.argmin().reshape(1))


def multi_krum(
    updates: Tensor, f: int, m: int | None = None, *, iterated: bool = False
) -> Aggregation:
    """Multi-Krum: the average of ``m`` updates (default ``n - f``) chosen by their Krum score.

    By default the Krum scores are computed once on all ``n`` updates and the ``m`` best are taken
    (Blanchard et al.'s definition). ``iterated=True`` instead repeats Krum on the updates not yet
    chosen (Bulyan's selection, see :func:`bulyan`); past ``2f + 1`` remaining it is unprotected:
    with the default ``m = n - f`` its last pick is among ``f + 1`` updates, at most one honest,
    so colluding attackers get selected. ``m = n`` gives the mean. Needs ``n >= 2f + 3``.

    >>> multi_krum(torch.tensor([[0.0], [0.1], [0.2], [0.3], [50.0]]), f=1).kept
    tensor([1., 1., 1., 1., 0.])
    """
    n, _ = _check("multi_krum", updates, f)
    m = n - f if m is None else m
    if not is_int(m) or not 1 <= m <= n:
        raise InputError(
            f"multi_krum selects 1 <= m <= n={n} updates, got m={m!r} (an aggregator asked "
            "for more selections than clients)"
        )
    dist = _sq_distances(updates)
    if iterated:
        return _selection(updates, _iterated_krum(dist, f, int(m)))
    order = torch.sort(_krum_scores(dist, n - f - 2), stable=True).indices
    return _selection(updates, order[: int(m)])


def bulyan(updates: Tensor, f: int) -> Aggregation:
    """Bulyan (El Mhamdi et al., 2018): choose ``theta = n - 2f`` updates by repeated Krum, then
    per coordinate average the ``beta = theta - 2f`` chosen values closest to their median.

    Needs ``n >= 4f + 3``. ``kept[i]``: the share of coordinates where client ``i`` survives both
    stages. The repeated Krum scores on ``max(r - f - 2, f)`` neighbours among the ``r`` remaining.

    >>> bulyan(torch.tensor([[0.0], [1.0], [4.0], [7.0], [8.0], [11.0], [900.0]]), f=1)
    Aggregation(update=tensor([4.]), kept=tensor([0., 1., 1., 1., 0., 0., 0.]))
    """
    n, _ = _check("bulyan", updates, f)
    theta, beta = n - 2 * f, n - 4 * f
    chosen_idx = _iterated_krum(_sq_distances(updates), f, theta)
    chosen = updates[chosen_idx]
    median = _window(chosen, (theta - 1) // 2, theta // 2 + 1).update
    closest = (chosen - median).abs().topk(beta, dim=0, largest=False).indices
    used = torch.zeros_like(chosen).scatter_(0, closest, 1.0)
    kept = torch.zeros(n, dtype=updates.dtype, device=updates.device)
    kept[chosen_idx] = used.mean(1)
    return Aggregation(chosen.gather(0, closest).mean(0), kept)


def fltrust(updates: Tensor, f: int = 0, *, root_update: Tensor | None = None) -> Aggregation:
    """FLTrust (Cao et al., 2021): weight each update, rescaled to the norm of the server's
    ``root_update`` (shape ``(d,)``), by its trust ``ReLU(cos(update, root_update))``.

    A zero update (or root) has trust 0; when every trust is 0 the result is zeros (the server
    skips the round). ``kept[i] = trust_i / max(trust)``, all 0 when every trust is 0.

    >>> updates = torch.tensor([[2.0, 0.0], [1.0, 1.0], [-5.0, 0.0]])
    >>> fltrust(updates, root_update=torch.tensor([1.0, 0.0]))
    Aggregation(update=tensor([0.8787, 0.2929]), kept=tensor([1.0000, 0.7071, 0.0000]))
    """
    _, d = _check("fltrust", updates, f)
    if not isinstance(root_update, Tensor) or tuple(root_update.shape) != (d,):
        got = tuple(root_update.shape) if isinstance(root_update, Tensor) else root_update
        raise InputError(f"fltrust needs root_update, a ({d},) tensor, got {got!r}")
    if not torch.isfinite(root_update).all():
        raise InputError("fltrust needs a finite root_update, got NaN or inf values")
    root = root_update.to(updates)
    norms, root_norm = updates.norm(dim=1), root.norm()
    cos = (updates @ root) / (norms * root_norm).clamp_min(torch.finfo(updates.dtype).tiny)
    trust = cos.clamp_min(0.0)
    if not bool(trust.any()):
        return Aggregation(torch.zeros_like(root), torch.zeros_like(trust))
    rescaled = updates * (root_norm / norms.clamp_min(torch.finfo(updates.dtype).tiny))[:, None]
    update = (trust[:, None] * rescaled).sum(0) / trust.sum()
    return Aggregation(update, trust / trust.max())


def centered_clipping(
    updates: Tensor,
    f: int = 0,
    *,
    center: Tensor | None = None,
    tau: float = 10.0,
    iterations: int = 1,
) -> Aggregation:
    """Centered clipping (Karimireddy et al., 2021): ``v <- v + mean_i clip_tau(x_i - v)``, run
    ``iterations`` times from ``center``.

    ``center`` defaults to zeros; a simulator should pass the previous round's aggregate (the
    paper's momentum). ``kept[i] = min(1, tau / ||x_i - v||)`` at the last iteration.

    >>> centered_clipping(torch.tensor([[0.0], [0.0], [0.0], [100.0]]), tau=1.0)
    Aggregation(update=tensor([0.2500]), kept=tensor([1.0000, 1.0000, 1.0000, 0.0100]))
    """
    _, d = _check("centered_clipping", updates, f)
    if not isinstance(tau, Real) or isinstance(tau, bool) or not 0 < tau < math.inf:
        raise InputError(f"centered_clipping needs a finite tau > 0, got tau={tau!r}")
    if not is_int(iterations) or iterations < 1:
        raise InputError(f"centered_clipping needs an int iterations >= 1, got {iterations!r}")
    if center is None:
        v = updates.new_zeros(d)
    elif not isinstance(center, Tensor) or tuple(center.shape) != (d,):
        got = tuple(center.shape) if isinstance(center, Tensor) else center
        raise InputError(f"centered_clipping needs center None or a ({d},) tensor, got {got!r}")
    else:
        v = center.to(updates)
    for _ in range(iterations):
        diff = updates - v
        scale = (tau / diff.norm(dim=1).clamp_min(torch.finfo(updates.dtype).tiny)).clamp_max(1.0)
        v = v + (diff * scale[:, None]).mean(0)
    return Aggregation(v, scale)


AGGREGATORS: dict[str, Callable[..., Aggregation]] = {
    "mean": mean,
    "median": coordinate_median,
    "trimmed_mean": trimmed_mean,
    "krum": krum,
    "multi_krum": multi_krum,
    "bulyan": bulyan,
    "fltrust": fltrust,
    "centered_clipping": centered_clipping,
}


def max_tolerated(name: str, n: int) -> int:
    """The largest ``f`` rule ``name`` accepts with ``n`` clients (-1: it cannot run at all).

    Never ``n/2`` or more: ``mean`` (which in theory tolerates no attacker), ``median``,
    ``trimmed_mean``, ``fltrust`` and ``centered_clipping`` accept any ``f < n/2``; ``krum`` and
    ``multi_krum`` need ``n >= 2f + 3``, ``bulyan`` ``n >= 4f + 3``.

    Examples:
        >>> [max_tolerated(name, 7) for name in ("mean", "krum", "bulyan")]
        [3, 2, 1]
    """
    if not is_int(n) or n < 0:
        raise InputError(f"n (clients) must be an int >= 0, got {n!r}")
    return max(_BOUNDS[_check_name(name)][1](int(n)), -1)


def aggregate(name: str, updates: Tensor, f: int, **rule_kwargs: object) -> Aggregation:
    """Validate, drop the non-finite rows and run rule ``name``: the simulator's entry point.

    Rows with any NaN/inf are dropped with a ``RuntimeWarning`` naming them; their ``kept`` is 0.
    A dropped row is a detected faulty client, so it counts against the Byzantine budget: the rule
    runs on the ``n - d`` rows left with ``f - d`` (at least 0), for which its bound still holds.

    >>> updates = torch.tensor([[1.0], [2.0], [float("nan")], [2.5], [4.0], [5.0]])
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     result = aggregate("krum", updates, f=1)
    >>> result.kept  # Krum with f = 0 on the 5 finite rows
    tensor([0., 0., 0., 1., 0., 0.])
    >>> print(caught[0].message)
    aggregate('krum'): dropped 1 of 6 updates with NaN/inf values (clients [2]); their kept is 0
    """
    rule = AGGREGATORS[_check_name(name)]
    n, _ = _check_updates(updates)
    f = _check_f(f)
    if 2 * f >= n:
        raise InputError(f"f={f} malicious clients of n={n}: no rule tolerates f >= n/2")
    accepted = list(inspect.signature(rule).parameters)[2:]
    for key in rule_kwargs:
        if key not in accepted:
            raise InputError(f"{name} takes no argument {key!r}; it takes: {accepted or 'none'}")
    finite = torch.isfinite(updates).all(dim=1)
    if bool(finite.all()):
        return rule(updates, f, **rule_kwargs)
    dropped = (~finite).nonzero().flatten().tolist()
    if len(dropped) == n:
        raise InputError(f"all n={n} updates have NaN or inf values; nothing to aggregate")
    warnings.warn(
        f"aggregate({name!r}): dropped {len(dropped)} of {n} updates with NaN/inf values "
        f"(clients {dropped}); their kept is 0",
        RuntimeWarning,
        stacklevel=2,
    )
    result = rule(updates[finite], max(f - len(dropped), 0), **rule_kwargs)
    kept = torch.zeros(n, dtype=result.kept.dtype, device=result.kept.device)
    kept[finite] = result.kept
    return Aggregation(result.update, kept)
