"""AVSD targets: pool several privileged teacher views into one token-level distillation target.

Pure functions on log-probabilities, without a model (see
:class:`~ada_modules.models.SelfDistillationModule` for the training loop). With ``M`` teacher
views giving next-token distributions ``p_1 .. p_M`` at a position:

* the **consensus** is their normalised geometric mean ``G ∝ exp(mean_m log p_m)`` (the
  logarithmic opinion pool: mass only where every view puts some);
* the **permissive** target is their arithmetic mean ``A = mean_m p_m`` (the linear pool: mass
  wherever any view puts some);
* the **residual** is what the views do not share, measured by their generalised Jensen-Shannon
  spread ``D = mean_m KL(p_m || A)`` (0 when all views agree, at most ``log M``), reported
  normalised as ``D / log M`` in ``[0, 1]``;
* the **gated target** ``q ∝ A^g G^(1-g)`` moves from the consensus (``g = 0``) to the permissive
  target (``g = 1``); the gate is a constant or, per token, ``g = sigmoid(sharpness *
  (threshold - D / log M))``: permissive where the views agree, conservative where they disagree;
* the **token weight** ``w = max(0, 1 + residual_scale * D / log M)`` scales the update by the
  residual (``residual_scale < 0``: smaller steps where the views disagree).

One view, or identical views, give ``G = A = q = p_1``, ``D = 0`` and ``w = 1``: single-view
self-distillation (OPSD). The choices above are this library's reconstruction from the abstract;
``docs/techniques/avsd.md`` lists them.

Examples:
    >>> import torch
    >>> views = torch.log_softmax(torch.randn(3, 2, 5, 11), dim=-1)  # 3 views, (2, 5) tokens
    >>> target = avsd_target(views, gate="adaptive")
    >>> target.logp.shape, target.weight.shape
    (torch.Size([2, 5, 11]), torch.Size([2, 5]))
    >>> bool(torch.allclose(target.logp.exp().sum(-1), torch.ones(2, 5)))
    True
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ada_modules.checks import is_finite_real
from ada_modules.errors import InputError

__all__ = [
    "AVSDTarget",
    "ViewPool",
    "avsd_target",
    "check_gate",
    "generalized_jsd",
    "pool_views",
    "sampled_token_advantages",
]


@dataclass(frozen=True)
class ViewPool:
    """The pooled views at every position.

    Attributes:
        consensus: ``log G``, the normalised geometric mean, shape ``(..., V)``.
        permissive: ``log A``, the arithmetic mean, shape ``(..., V)``.
        disagreement: ``D / log M`` in ``[0, 1]`` (0 for one view), shape ``(...)``.
    """

    consensus: Tensor
    permissive: Tensor
    disagreement: Tensor


@dataclass(frozen=True)
class AVSDTarget:
    """The gated target of :func:`avsd_target`.

    Attributes:
        logp: Log-probabilities of the gated target ``q``, shape ``(..., V)``.
        weight: Token weight from the residual, shape ``(...)``.
        gate: The gate ``g`` per position, shape ``(...)``.
        pool: The consensus, permissive target and disagreement it was built from.
    """

    logp: Tensor
    weight: Tensor
    gate: Tensor
    pool: ViewPool


def _check_views(view_logps: Tensor) -> None:
    if view_logps.dim() < 2 or view_logps.shape[0] < 1:
        raise InputError(
            f"view_logps must have shape (views, ..., vocab) with at least one view, got "
            f"{tuple(view_logps.shape)}"
        )


def _kl(p: Tensor, q: Tensor) -> Tensor:
    """``KL(p || q)`` over the last axis, from log-probabilities (broadcast).

    A token without mass under ``p`` (``-inf``) adds 0, also where ``q`` is ``-inf`` too; such
    entries are replaced before the arithmetic, so neither the value nor the gradients of this
    sum see NaN.
    """
    has_mass = p > -math.inf
    p = torch.where(has_mass, p, 0.0)
    q = torch.where(has_mass, q, 0.0)
    return torch.where(has_mass, p.exp() * (p - q), 0.0).sum(-1)


def pool_views(view_logps: Tensor) -> ViewPool:
    """Consensus, permissive target and normalised disagreement of ``M`` views.

    Where no token has every view's support (say, top-k views that share no token), the
    geometric consensus is empty; there the consensus is the arithmetic pool.

    Args:
        view_logps: Log-probabilities of each view, shape ``(M, ..., V)`` (each row normalised;
            ``-inf`` for a token a view rules out). A target: with ``-inf`` entries, gradients
            through the views are not defined (detach them, as teacher views are).

    Raises:
        ValueError: If ``view_logps`` has no view axis or no view.
    """
    _check_views(view_logps)
    num_views = view_logps.shape[0]
    mean = view_logps.mean(0)
    permissive = torch.logsumexp(view_logps, dim=0) - math.log(num_views)
    no_common_token = (mean == -math.inf).all(-1, keepdim=True)
    consensus = torch.where(no_common_token, permissive, torch.log_softmax(mean, dim=-1))
    if num_views == 1:
        return ViewPool(consensus, view_logps[0], torch.zeros_like(view_logps[0, ..., 0]))
    spread = _kl(view_logps, permissive).mean(0)
    disagreement = (spread / math.log(num_views)).clamp(0.0, 1.0)
    return ViewPool(consensus, permissive, disagreement)


def check_gate(
    gate: float | str, gate_threshold: float, gate_sharpness: float, residual_scale: float
) -> None:
    """Raise an ``InputError`` naming the first of :func:`avsd_target`'s gate arguments that is bad."""
    if gate != "adaptive" and not (is_finite_real(gate) and 0.0 <= gate <= 1.0):
        raise InputError(f"gate must be 'adaptive' or a number in [0, 1], got {gate!r}")
    if not (is_finite_real(gate_sharpness) and gate_sharpness >= 0):
        raise InputError(f"gate_sharpness must be a finite number >= 0, got {gate_sharpness!r}")
    for name, value in (("gate_threshold", gate_threshold), ("residual_scale", residual_scale)):
        if not is_finite_real(value):
            raise InputError(f"{name} must be a finite number, got {value!r}")


def avsd_target(
    view_logps: Tensor,
    gate: float | Literal["adaptive"] = "adaptive",
    gate_threshold: float = 0.1,
    gate_sharpness: float = 20.0,
    residual_scale: float = 0.0,
) -> AVSDTarget:
    """The gated AVSD target ``q ∝ A^g G^(1-g)`` and the residual token weight.

    Args:
        view_logps: Log-probabilities of each view, shape ``(M, ..., V)``.
        gate: A constant ``g`` in ``[0, 1]`` (0: consensus only, 1: arithmetic mean only), or
            ``"adaptive"``: ``g = sigmoid(gate_sharpness * (gate_threshold - D / log M))``.
        gate_threshold: Normalised disagreement at which the adaptive gate is one half.
        gate_sharpness: Slope of the adaptive gate.
        residual_scale: ``w = max(0, 1 + residual_scale * D / log M)``; 0 gives ``w = 1``.

    Raises:
        ValueError: If ``gate`` is neither ``"adaptive"`` nor in ``[0, 1]``, ``gate_sharpness``
            is not a finite number >= 0, or ``gate_threshold``/``residual_scale`` not finite.
    """
    check_gate(gate, gate_threshold, gate_sharpness, residual_scale)
    pool = pool_views(view_logps)
    if gate == "adaptive":
        g = torch.sigmoid(gate_sharpness * (gate_threshold - pool.disagreement))
    else:
        g = torch.full_like(pool.disagreement, float(gate))
    if gate == 0:
        logp = pool.consensus
    elif gate == 1:
        logp = pool.permissive
    else:
        w = g[..., None]
        # a zero weight drops its term, so that 0 * -inf (a token one target rules out) is not NaN
        mixed = torch.where(w > 0, w * pool.permissive, 0.0) + torch.where(
            w < 1, (1.0 - w) * pool.consensus, 0.0
        )
        logp = torch.log_softmax(mixed, dim=-1)
    weight = (1.0 + residual_scale * pool.disagreement).clamp(min=0.0)
    return AVSDTarget(logp, weight, g, pool)


def sampled_token_advantages(
    target_logp: Tensor, student_logp: Tensor, tokens: Tensor, weight: Tensor | None = None
) -> Tensor:
    """Per-token advantage ``w * (log q(y) - log s(y))`` of the sampled tokens ``y`` (OPSD form).

    Used as the advantage of a policy-gradient step on the student's own samples, this is a
    one-sample estimate of the reverse KL ``KL(s || q)`` gradient.

    Args:
        target_logp: Target log-probabilities, ``(..., V)``.
        student_logp: Either the student's full log-probabilities ``(..., V)`` or those of the
            sampled tokens ``(...)``.
        tokens: The sampled tokens, ``(...)``, each in ``[0, V)`` (padding marked ``-100`` is
            refused: mask the advantages instead).
        weight: Token weights ``(...)`` (``None``: 1).

    Raises:
        ValueError: If the shapes do not match or a token is outside the vocabulary.
    """
    if target_logp.shape[:-1] != tokens.shape:
        raise InputError(
            f"target_logp {tuple(target_logp.shape)} and tokens {tuple(tokens.shape)} must "
            "share their leading dimensions"
        )
    if tokens.is_floating_point() or tokens.is_complex():
        raise InputError(f"tokens must be integer token ids, got {tokens.dtype}")
    vocab = target_logp.shape[-1]
    outside = (tokens < 0) | (tokens >= vocab)
    if outside.any():
        raise InputError(
            f"tokens must lie in [0, {vocab}) (the vocabulary of target_logp), got "
            f"{tokens[outside][0].item()}; mask padding out afterwards instead of marking it"
        )
    target = target_logp.gather(-1, tokens[..., None]).squeeze(-1)
    if student_logp.shape == target_logp.shape:
        student_logp = student_logp.gather(-1, tokens[..., None]).squeeze(-1)
    if student_logp.shape != tokens.shape:
        raise InputError(
            f"student_logp must have shape {tuple(tokens.shape)} or {tuple(target_logp.shape)}, "
            f"got {tuple(student_logp.shape)}"
        )
    advantages = target - student_logp
    return advantages if weight is None else advantages * weight


def generalized_jsd(target_logp: Tensor, student_logp: Tensor, beta: float = 0.5) -> Tensor:
    """Generalised Jensen-Shannon divergence per position (GKD's full-distribution loss).

    ``beta * KL(q || m) + (1 - beta) * KL(s || m)`` with ``m = beta * q + (1 - beta) * s``,
    divided by ``beta * (1 - beta)`` so that its limits are the plain KLs: ``beta = 0`` is the
    forward ``KL(q || s)`` and ``beta = 1`` the reverse ``KL(s || q)`` (TRL's GKD convention up to
    that scale, which keeps the loss size comparable across ``beta``).

    Args:
        target_logp: Target log-probabilities ``q``, ``(..., V)`` (``-inf`` where ``q`` has no
            mass: such tokens add nothing).
        student_logp: Student log-probabilities ``s``, ``(..., V)``.
        beta: Interpolation in ``[0, 1]``.

    Raises:
        ValueError: If ``beta`` is outside ``[0, 1]`` or the shapes differ.
    """
    if not 0.0 <= beta <= 1.0:
        raise InputError(f"beta must be in [0, 1], got {beta!r}")
    if target_logp.shape != student_logp.shape:
        raise InputError(
            f"target_logp and student_logp must have the same shape, got "
            f"{tuple(target_logp.shape)} and {tuple(student_logp.shape)}"
        )
    if beta == 0.0:
        return _kl(target_logp, student_logp)
    if beta == 1.0:
        return _kl(student_logp, target_logp)
    mixture = torch.logsumexp(
        torch.stack([target_logp + math.log(beta), student_logp + math.log(1.0 - beta)]), dim=0
    )
    jsd = beta * _kl(target_logp, mixture) + (1.0 - beta) * _kl(student_logp, mixture)
    return jsd / (beta * (1.0 - beta))
