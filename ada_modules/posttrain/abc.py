"""Semi-supervised estimators and losses for preference data: human-only, pseudo-only, PPI++ and ABC.

The setting: a *labelled* set ``L`` of ``n`` examples with a human label and an AI-judge (pseudo)
label, and an *unlabelled* set ``U`` of ``N`` examples with the pseudo label only. For a
per-example statistic ``z`` (a label, a loss or a per-example gradient: one row per example, ``d``
columns) write ``z_h`` for its value under the human label and ``z_p`` under the pseudo label. Every
estimator of ``E[z_h]`` here is a linear combination of three group means,
``θ = a_h·mean_L(z_h) + a_p·mean_L(z_p) + a_u·mean_U(z_p)``:

========  ==================================  =================================================
method    coefficients ``(a_h, a_p, a_u)``    note
========  ==================================  =================================================
human     ``(1, 0, 0)``                       unbiased, high variance when ``n`` is small
pseudo    ``(0, n/(n+N), N/(n+N))``           low variance, biased by the judge
concat    ``(n/(n+N), 0, N/(n+N))``           human labels where known, pseudo elsewhere
ppi       ``(1, -1, 1)``                      prediction-powered inference (λ = 1)
ppi++     ``(1, -λ, λ)``                      power-tuned λ (Angelopoulos et al., PPI++)
abc       ``P + w·(PP - P)``                  ABC: pseudo-only blended towards PPI++
========  ==================================  =================================================

PPI++'s λ minimises the trace of the estimator's exact finite-sample variance,
``λ̂ = tr Cov_L(z_h, z_p) / (tr Var_L(z_p) + (n/N)·tr Var_U(z_p))``, clipped to ``[0, 1]``.
ABC (adaptive bias correction, reconstructed) starts from the low-variance pseudo-only estimate
``P`` and moves towards the unbiased PPI++ estimate ``PP`` by the weight that minimises the
plug-in mean squared error of ``P + w·D``, ``D = PP - P``:
``ŵ = (b̂² - tr Cov(P, D)) / (b̂² + tr Var(D))`` with the de-biased squared bias
``b̂² = max(‖D‖² - tr Var(D), 0)``, clipped to ``[0, 1]``. A small judge bias gives ``ŵ`` near 0
(the pseudo labels' low variance is kept), a large one ``ŵ`` near 1 (PPI++). λ̂ and ŵ are plug-in
values treated as fixed; every clip is reported in :attr:`SemiSupervisedWeights.notes`.

For training, the same coefficients weight the three mean *losses* (:func:`combine_losses`); the
statistics that choose λ̂ and ŵ are then per-example gradients (:func:`margin_gradients`).

Examples:
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> truth = (torch.rand(5100, generator=g) < 0.6).float()       # human labels, rate 0.6
    >>> judge = torch.where(torch.rand(5100, generator=g) < 0.8, truth, 1 - truth)
    >>> human_l, judge_l, judge_u = truth[:100], judge[:100], judge[100:]
    >>> estimate = estimate_mean(human_l, judge_l, judge_u, "ppi++")
    >>> 0.0 <= estimate.weights.lam <= 1.0, round(estimate.value.item(), 1)
    (True, 0.6)
    >>> estimate_mean(human_l, judge_l, judge_u, "pseudo").value.item() < 0.59  # biased to 0.5
    True
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import functional as F

from ada_modules.errors import InputError

__all__ = [
    "ESTIMATORS",
    "SemiSupervisedEstimate",
    "SemiSupervisedWeights",
    "combine_losses",
    "dpo_margin",
    "estimate_mean",
    "margin_gradients",
    "preference_loss",
    "semi_supervised_weights",
]

ESTIMATORS = ("human", "pseudo", "concat", "ppi", "ppi++", "abc")


@dataclass(frozen=True)
class SemiSupervisedWeights:
    """The coefficients of one estimator and the plug-in quantities that chose them.

    Attributes:
        method: One of :data:`ESTIMATORS`.
        a_h, a_p, a_u: Weights of ``mean_L(z_h)``, ``mean_L(z_p)`` and ``mean_U(z_p)``.
        lam: PPI++'s λ (1 for ``ppi``; the λ̂ that ``abc`` blends towards; 0 otherwise).
        weight: ABC's ŵ (1 for the PPI estimators, 0 otherwise).
        bias2: ABC's de-biased squared bias of pseudo-only against PPI++ (``nan`` otherwise).
        variance: Trace of the estimator's plug-in variance.
        notes: Why λ̂ or ŵ were clipped or set by a rule, one line each.
    """

    method: str
    a_h: float
    a_p: float
    a_u: float
    lam: float = 0.0
    weight: float = 0.0
    bias2: float = math.nan
    variance: float = math.nan
    notes: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class SemiSupervisedEstimate:
    """An estimate of ``E[z_h]`` with its normal-approximation standard error."""

    value: Tensor
    se: float
    weights: SemiSupervisedWeights

    def interval(self, z: float = 1.959964) -> tuple[Tensor, Tensor]:
        """The ``value ± z·se`` confidence interval (95 % by default)."""
        return self.value - z * self.se, self.value + z * self.se


def _as_rows(name: str, values: Tensor) -> Tensor:
    values = torch.as_tensor(values)
    if values.dim() == 1:
        values = values[:, None]
    if values.dim() != 2:
        raise InputError(f"{name} must have one row per example (1-D or 2-D), got {values.dim()}-D")
    if not torch.isfinite(values).all():
        raise InputError(f"{name} contains NaN or infinite values")
    return values.double()


def _check_groups(human_l: Tensor, pseudo_l: Tensor, pseudo_u: Tensor) -> tuple[Tensor, ...]:
    human_l = _as_rows("human_labelled", human_l)
    pseudo_l = _as_rows("pseudo_labelled", pseudo_l)
    pseudo_u = _as_rows("pseudo_unlabelled", pseudo_u)
    n, big_n = len(human_l), len(pseudo_u)
    if n < 2:
        raise InputError(
            f"the human-labelled set has {n} example(s); every estimator needs at least 2 "
            "(the plug-in variances and PPI++'s lambda are estimated from them)"
        )
    if len(pseudo_l) != n:
        raise InputError(
            f"human_labelled has {n} rows but pseudo_labelled has {len(pseudo_l)}: each labelled "
            "example needs its human and its pseudo statistic"
        )
    if big_n < 2:
        raise InputError(
            f"the pseudo-labelled (unlabelled) set has {big_n} example(s); at least 2 are needed"
        )
    if not human_l.shape[1] == pseudo_l.shape[1] == pseudo_u.shape[1]:
        raise InputError(
            "the three statistics must have the same width, got "
            f"{human_l.shape[1]}, {pseudo_l.shape[1]} and {pseudo_u.shape[1]}"
        )
    return human_l, pseudo_l, pseudo_u


class _Moments:
    """Traces of the (co)variances the linear estimators' variances are made of.

    ``big_n`` is the unlabelled set's size when ``pseudo_u`` is a subsample of it: the variances
    of the estimators use it, while the de-biasing of ABC's plug-in bias, computed from the
    subsample's mean, uses the subsample's size.
    """

    def __init__(
        self, human_l: Tensor, pseudo_l: Tensor, pseudo_u: Tensor, big_n: int | None = None
    ) -> None:
        self.n, self.sample_n = len(human_l), len(pseudo_u)
        self.big_n = self.sample_n if big_n is None else big_n
        centred_h = human_l - human_l.mean(0)
        centred_p = pseudo_l - pseudo_l.mean(0)
        centred_u = pseudo_u - pseudo_u.mean(0)
        self.hh = float((centred_h * centred_h).sum()) / (self.n - 1)
        self.hp = float((centred_h * centred_p).sum()) / (self.n - 1)
        self.pp = float((centred_p * centred_p).sum()) / (self.n - 1)
        self.uu = float((centred_u * centred_u).sum()) / (self.sample_n - 1)
        self.means = (human_l.mean(0), pseudo_l.mean(0), pseudo_u.mean(0))

    def covariance(
        self, a: tuple[float, float, float], c: tuple[float, float, float], sample: bool = False
    ) -> float:
        """Trace of Cov(a·means, c·means); L and U are independent samples.

        ``sample``: of the means over the given subsample rather than the whole unlabelled set.
        """
        labelled = a[0] * c[0] * self.hh + (a[0] * c[1] + a[1] * c[0]) * self.hp
        labelled += a[1] * c[1] * self.pp
        return labelled / self.n + a[2] * c[2] * self.uu / (self.sample_n if sample else self.big_n)

    def value(self, a: tuple[float, float, float]) -> Tensor:
        return a[0] * self.means[0] + a[1] * self.means[1] + a[2] * self.means[2]


def _ppi_lambda(moments: _Moments, notes: list[str]) -> float:
    denominator = moments.pp + moments.n / moments.big_n * moments.uu
    if denominator <= 0.0:
        notes.append("lambda set to 0: the pseudo statistic does not vary")
        return 0.0
    lam = moments.hp / denominator
    if lam < 0.0:
        notes.append(
            f"lambda {lam:.3g} clipped to 0: the pseudo and human statistics are anti-correlated"
        )
        return 0.0
    if lam > 1.0:
        notes.append(f"lambda {lam:.3g} clipped to 1")
        return 1.0
    return lam


def _weights(moments: _Moments, method: str) -> SemiSupervisedWeights:
    n, big_n = moments.n, moments.big_n
    notes: list[str] = []
    pseudo = (0.0, n / (n + big_n), big_n / (n + big_n))
    lam, weight, bias2 = 0.0, 0.0, math.nan
    if method == "human":
        coefficients = (1.0, 0.0, 0.0)
    elif method == "pseudo":
        coefficients = pseudo
    elif method == "concat":
        coefficients = (n / (n + big_n), 0.0, big_n / (n + big_n))
    elif method in ("ppi", "ppi++", "abc"):
        lam = 1.0 if method == "ppi" else _ppi_lambda(moments, notes)
        coefficients = (1.0, -lam, lam)
        weight = 1.0
        if method == "abc":
            difference = tuple(pp - p for pp, p in zip(coefficients, pseudo, strict=True))
            var_d = moments.covariance(difference, difference)
            observed_var_d = moments.covariance(difference, difference, sample=True)
            bias2 = max(float((moments.value(difference) ** 2).sum()) - observed_var_d, 0.0)
            cov_pd = moments.covariance(pseudo, difference)
            if bias2 + var_d <= 0.0:
                weight = 1.0
                notes.append("weight set to 1: pseudo-only and PPI++ coincide")
            else:
                weight = (bias2 - cov_pd) / (bias2 + var_d)
                if not 0.0 <= weight <= 1.0:
                    notes.append(f"weight {weight:.3g} clipped to [0, 1]")
                    weight = min(max(weight, 0.0), 1.0)
            coefficients = tuple(p + weight * d for p, d in zip(pseudo, difference, strict=True))
    else:
        raise InputError(f"method must be one of {', '.join(ESTIMATORS)}, got {method!r}")
    return SemiSupervisedWeights(
        method,
        *coefficients,
        lam=lam,
        weight=weight,
        bias2=bias2,
        variance=moments.covariance(coefficients, coefficients),
        notes=tuple(notes),
    )


def semi_supervised_weights(
    human_labelled: Tensor,
    pseudo_labelled: Tensor,
    pseudo_unlabelled: Tensor,
    method: str,
    num_unlabelled: int | None = None,
) -> SemiSupervisedWeights:
    """The coefficients of ``method`` chosen from per-example statistics.

    Args:
        human_labelled: ``z_h`` on the labelled set, shape ``(n,)`` or ``(n, d)``.
        pseudo_labelled: ``z_p`` on the same labelled examples, same shape.
        pseudo_unlabelled: ``z_p`` on the unlabelled set (or a random subsample of it), shape
            ``(m,)`` or ``(m, d)``.
        method: One of :data:`ESTIMATORS`.
        num_unlabelled: The unlabelled set's size ``N`` when ``pseudo_unlabelled`` is a
            subsample (``None``: ``m``).

    Examples:
        >>> import torch
        >>> z = torch.tensor([0.0, 1.0, 1.0, 0.0])
        >>> w = semi_supervised_weights(z, z, torch.tensor([0.0, 1.0] * 50), "ppi++")
        >>> round(w.lam, 3), (w.a_h, w.a_p, w.a_u) == (1.0, -w.lam, w.lam)
        (0.971, True)
    """
    if method not in ESTIMATORS:
        raise InputError(f"method must be one of {', '.join(ESTIMATORS)}, got {method!r}")
    groups = _check_groups(human_labelled, pseudo_labelled, pseudo_unlabelled)
    if num_unlabelled is not None and (
        isinstance(num_unlabelled, bool)
        or not isinstance(num_unlabelled, numbers.Real)
        or not len(groups[2]) <= num_unlabelled < math.inf
    ):
        raise InputError(
            f"num_unlabelled must be a finite number >= {len(groups[2])} (the unlabelled "
            f"statistics given) or None, got {num_unlabelled!r}"
        )
    return _weights(_Moments(*groups, big_n=num_unlabelled), method)


def estimate_mean(
    human_labelled: Tensor, pseudo_labelled: Tensor, pseudo_unlabelled: Tensor, method: str
) -> SemiSupervisedEstimate:
    """Estimate ``E[z_h]`` by ``method`` (see the module docstring), with a standard error.

    The standard error treats λ̂ and ŵ as fixed and ignores the pseudo estimates' bias, so the
    intervals of ``pseudo`` and ``concat`` (and of ``abc`` when its ŵ is small) are too narrow
    under a biased judge.
    """
    if method not in ESTIMATORS:
        raise InputError(f"method must be one of {', '.join(ESTIMATORS)}, got {method!r}")
    moments = _Moments(*_check_groups(human_labelled, pseudo_labelled, pseudo_unlabelled))
    weights = _weights(moments, method)
    value = moments.value((weights.a_h, weights.a_p, weights.a_u))
    return SemiSupervisedEstimate(
        value.squeeze(0) if value.numel() == 1 else value,
        math.sqrt(max(weights.variance, 0.0)),
        weights,
    )


def combine_losses(
    human_labelled: Tensor,
    pseudo_labelled: Tensor,
    pseudo_unlabelled: Tensor,
    weights: SemiSupervisedWeights,
) -> Tensor:
    """The training loss ``a_h·mean_L(ℓ_h) + a_p·mean_L(ℓ_p) + a_u·mean_U(ℓ_p)``.

    Args:
        human_labelled: Per-example losses under the human labels, shape ``(n,)``.
        pseudo_labelled: Per-example losses of the same examples under the pseudo labels.
        pseudo_unlabelled: Per-example losses of the unlabelled examples (pseudo labels).
        weights: From :func:`semi_supervised_weights`.

    Raises:
        ValueError: If a group with a nonzero coefficient is not 1-D or is empty, or the two
            labelled groups (both used) differ in length.

    Examples:
        >>> import torch
        >>> w = SemiSupervisedWeights("ppi", 1.0, -1.0, 1.0)
        >>> combine_losses(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0]), torch.tensor([4.0]), w)
        tensor(4.)
    """
    groups = {
        "human_labelled": (weights.a_h, human_labelled),
        "pseudo_labelled": (weights.a_p, pseudo_labelled),
        "pseudo_unlabelled": (weights.a_u, pseudo_unlabelled),
    }
    used = {name: losses for name, (c, losses) in groups.items() if c != 0.0}
    for name, losses in used.items():
        if losses.dim() != 1 or len(losses) == 0:
            raise InputError(
                f"{name} must hold one loss per example (1-D, not empty; its coefficient is "
                f"{groups[name][0]}), got shape {tuple(losses.shape)}"
            )
    if "human_labelled" in used and "pseudo_labelled" in used:
        if len(human_labelled) != len(pseudo_labelled):
            raise InputError(
                f"human_labelled has {len(human_labelled)} losses but pseudo_labelled has "
                f"{len(pseudo_labelled)}: both are the losses of the same labelled examples"
            )
    total = human_labelled.new_zeros(())
    for name, losses in used.items():
        total = total + groups[name][0] * losses.mean()
    return total


def _check_labels(labels: Tensor) -> None:
    if not torch.isfinite(labels).all() or ((labels < 0) | (labels > 1)).any():
        bad = labels[~(torch.isfinite(labels) & (labels >= 0) & (labels <= 1))][0].item()
        raise InputError(f"preference labels must lie in [0, 1] (1: first preferred), got {bad}")


def preference_loss(margin: Tensor, labels: Tensor) -> Tensor:
    """Per-example Bradley–Terry loss ``-[y·log σ(h) + (1-y)·log σ(-h)]`` (soft labels allowed).

    ``margin`` is ``h = r(first) - r(second)`` for a reward model, or :func:`dpo_margin` for DPO;
    ``labels`` is 1 where the first response is preferred.

    Examples:
        >>> import torch
        >>> preference_loss(torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])).round(decimals=4)
        tensor([0.6931, 2.1269])
    """
    _check_labels(labels)
    return F.binary_cross_entropy_with_logits(margin, labels.to(margin.dtype), reduction="none")


def dpo_margin(
    policy_first: Tensor,
    policy_second: Tensor,
    reference_first: Tensor,
    reference_second: Tensor,
    beta: float = 0.1,
) -> Tensor:
    """DPO's margin ``β·[(log π - log π_ref)(first) - (log π - log π_ref)(second)]``.

    The arguments are summed response log-probabilities, one per pair.
    """
    return beta * ((policy_first - reference_first) - (policy_second - reference_second))


def margin_gradients(margin: Tensor, labels: Tensor, margin_grads: Tensor) -> Tensor:
    """Per-example gradients of :func:`preference_loss`: ``(σ(h) - y)·∇h``.

    Args:
        margin: Margins ``h``, shape ``(m,)``.
        labels: Labels in ``[0, 1]``, shape ``(m,)``.
        margin_grads: Per-example ``∇h`` (flattened over the chosen parameters), ``(m, d)``.

    The same ``∇h`` serves both the human and the pseudo label of an example, so one backward
    pass per example gives both statistics :func:`semi_supervised_weights` needs.

    Raises:
        ValueError: If the shapes are not ``(m,)``, ``(m,)`` and ``(m, d)``, or a label is
            outside ``[0, 1]``.
    """
    if margin.dim() != 1 or labels.shape != margin.shape or margin_grads.dim() != 2:
        raise InputError(
            "margin, labels and margin_grads must have shapes (m,), (m,) and (m, d), got "
            f"{tuple(margin.shape)}, {tuple(labels.shape)} and {tuple(margin_grads.shape)}"
        )
    if len(margin_grads) != len(margin):
        raise InputError(f"margin_grads has {len(margin_grads)} rows for {len(margin)} margins")
    _check_labels(labels)
    return (torch.sigmoid(margin) - labels.to(margin.dtype))[:, None] * margin_grads
