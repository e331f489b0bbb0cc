"""Plain-torch losses for offline RL with implicit Q-learning (IQL / AIQL).

* :func:`expectile_loss` fits the value function: the asymmetric L2 loss whose minimiser over a
  constant is the ``expectile`` of the targets, so for ``expectile > 0.5`` the value approaches an
  upper expectile of the Q-values of the dataset's actions without querying unseen actions.
* :func:`advantage_weights` turns advantages into the policy-extraction weights of advantage
  weighted regression, ``min(exp(temperature · A), max_weight)``.
* :func:`plackett_luce_log_likelihood` is the log-probability of an ordered selection of ``K``
  candidates out of a masked set of ``N`` under the Plackett–Luce model: the policy
  log-likelihood of a slate (ranking) action.
* :func:`subsample_candidates` keeps the chosen candidates plus a random subset of the others, so
  that the Plackett–Luce normaliser stays tractable for huge candidate sets (sampled softmax).

Example:
    >>> import torch
    >>> diff = torch.tensor([1.0, -1.0])
    >>> expectile_loss(diff, 0.9)  # 0.9·1 + 0.1·1, averaged
    tensor(0.5000)
    >>> advantage_weights(torch.tensor([0.0, 1.0, 100.0]), temperature=1.0, max_weight=5.0)
    tensor([1.0000, 2.7183, 5.0000])
"""

from __future__ import annotations

import math
import operator

import torch
from torch import Tensor

from ada_modules.checks import check_finite_real
from ada_modules.errors import InputError

__all__ = [
    "advantage_weights",
    "expectile_loss",
    "plackett_luce_log_likelihood",
    "sample_plackett_luce",
    "subsample_candidates",
]


def _check_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _check_selection(mask: Tensor, chosen: Tensor, num_candidates: int | None = None) -> None:
    """Validate a ``[B, N]`` bool ``mask`` and ``[B, K]`` integer ``chosen`` index tensor."""
    _check_tensor("mask", mask)
    _check_tensor("chosen", chosen)
    if mask.dtype != torch.bool:
        raise InputError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if mask.ndim != 2:
        raise InputError(f"mask must have shape [B, N], got {tuple(mask.shape)}")
    if num_candidates is not None and mask.shape[1] != num_candidates:
        raise InputError(
            f"mask must have the shape of scores [B, N], got {tuple(mask.shape)} "
            f"with N = {num_candidates} expected"
        )
    if chosen.dtype == torch.bool or chosen.is_floating_point() or chosen.is_complex():
        raise InputError(f"chosen must be an integer (long) tensor, got dtype {chosen.dtype}")
    if chosen.ndim != 2 or chosen.shape[0] != mask.shape[0]:
        raise InputError(
            f"chosen must have shape [B, K] with B = {mask.shape[0]}, got {tuple(chosen.shape)}"
        )
    if chosen.numel() == 0:
        return
    num_valid = mask.sum(dim=1)
    short = num_valid < chosen.shape[1]
    if short.any():
        row = int(short.nonzero()[0, 0])
        raise InputError(
            f"chosen picks K = {chosen.shape[1]} candidates but mask row {row} has only "
            f"{int(num_valid[row])} valid candidates"
        )
    out_of_range = (chosen < 0) | (chosen >= mask.shape[1])
    if out_of_range.any():
        row = int(out_of_range.any(dim=1).nonzero()[0, 0])
        raise InputError(
            f"chosen indices must be in [0, {mask.shape[1]}), got {chosen[row].tolist()} "
            f"in row {row}"
        )
    invalid = ~mask.gather(1, chosen)
    if invalid.any():
        row = int(invalid.any(dim=1).nonzero()[0, 0])
        raise InputError(
            f"chosen must point at valid candidates (mask True), got {chosen[row].tolist()} in "
            f"row {row} where mask is {mask[row].tolist()}"
        )
    ordered = chosen.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
    if repeated.any():
        row = int(repeated.nonzero()[0, 0])
        raise InputError(
            f"chosen indices must be distinct in each row, got {chosen[row].tolist()} in row {row}"
        )


def expectile_loss(diff: Tensor, expectile: float) -> Tensor:
    """IQL's asymmetric L2 loss ``mean(|expectile - 1(diff < 0)| · diff²)``.

    Args:
        diff: ``target_q - value``, any shape, floating point, at least one element.
        expectile: The expectile ``τ`` in ``(0, 1)``; ``τ > 0.5`` weighs positive differences
            (value below the target) more, so the fitted value is an upper expectile. At
            ``τ = 0.5`` the loss is ``0.5 · mean(diff²)``.

    Returns:
        The scalar loss, differentiable with respect to ``diff``.

    Raises:
        InputError: If ``expectile`` is not in ``(0, 1)`` or ``diff`` is not a non-empty
            floating-point tensor.

    Example:
        >>> expectile_loss(torch.tensor([2.0, -2.0]), 0.5)  # 0.5 · mean(diff²)
        tensor(2.)
        >>> expectile_loss(torch.tensor([2.0, -1.0]), 0.75)  # (0.75·4 + 0.25·1) / 2
        tensor(1.6250)
    """
    _check_tensor("diff", diff)
    if not diff.is_floating_point():
        raise InputError(f"diff must be a floating-point tensor, got dtype {diff.dtype}")
    if diff.numel() == 0:
        raise InputError(f"diff must have at least one element, got shape {tuple(diff.shape)}")
    tau = check_finite_real("expectile", expectile)
    if not 0.0 < tau < 1.0:
        raise InputError(f"expectile must be in (0, 1), got {expectile!r}")
    weight = (tau - (diff < 0).to(diff.dtype)).abs()  # in diff's dtype, not the default one
    return (weight * diff.square()).mean()


def advantage_weights(advantage: Tensor, temperature: float, max_weight: float = 100.0) -> Tensor:
    """Advantage-weighted-regression weights ``min(exp(temperature · advantage), max_weight)``.

    The exponent is clamped at ``log(max_weight)`` before exponentiating, so huge advantages give
    ``max_weight`` rather than ``inf``. The result is detached: the weights multiply a policy
    log-likelihood and must not pass gradients into the critic.

    Args:
        advantage: Advantages ``Q(s, a) - V(s)``, any shape, floating point.
        temperature: Inverse temperature ``β ≥ 0``; ``0`` gives all ones (behaviour cloning),
            larger values imitate the high-advantage actions more greedily.
        max_weight: Upper bound of each weight, ``> 0``.

    Returns:
        Detached weights of the shape and dtype of ``advantage``.

    Raises:
        InputError: If ``temperature < 0``, ``max_weight <= 0``, either is not finite, or
            ``advantage`` is not a floating-point tensor.

    Example:
        >>> advantage_weights(torch.tensor([-1.0, 0.0, 1e9]), temperature=2.0, max_weight=10.0)
        tensor([ 0.1353,  1.0000, 10.0000])
        >>> advantage_weights(torch.tensor([-3.0, 3.0]), temperature=0.0)
        tensor([1., 1.])
    """
    _check_tensor("advantage", advantage)
    if not advantage.is_floating_point():
        raise InputError(f"advantage must be a floating-point tensor, got dtype {advantage.dtype}")
    beta = check_finite_real("temperature", temperature)
    if beta < 0:
        raise InputError(f"temperature must be >= 0, got {temperature!r}")
    cap = check_finite_real("max_weight", max_weight)
    if cap <= 0:
        raise InputError(f"max_weight must be > 0, got {max_weight!r}")
    advantage = advantage.detach()
    if beta == 0.0:
        return torch.ones_like(advantage).clamp(max=cap)
    exponent = (beta * advantage).clamp(max=math.log(cap))
    return exponent.exp().clamp(max=cap)


def plackett_luce_log_likelihood(scores: Tensor, mask: Tensor, chosen: Tensor) -> Tensor:
    """Plackett–Luce log-probability of picking ``chosen`` (in order) from the valid candidates.

    For row ``b``: ``Σ_k scores[b, c_k] - logsumexp{scores[b, j] : mask[b, j], j ∉ {c_1..c_k-1}}``.
    Scores of masked-out candidates are ignored entirely (they may be anything, even ``inf``).
    With ``K = 1`` this is the log-softmax over the valid candidates; with ``K`` equal to the
    number of valid candidates it is the log-probability of a full ranking.

    Args:
        scores: Candidate scores (logits), shape ``[B, N]``, floating point.
        mask: ``True`` for valid candidates, bool, shape ``[B, N]``.
        chosen: Indices of the picked candidates in pick order, integer, shape ``[B, K]``;
            in each row valid, distinct and at most the number of valid candidates.

    Returns:
        Log-likelihoods, shape ``[B]``, differentiable with respect to ``scores``.

    Raises:
        InputError: If a shape or dtype is wrong, an index is out of range, repeated or points
            at a masked-out candidate, or a row of ``mask`` has fewer than ``K`` valid entries.

    Example:
        >>> scores = torch.tensor([[1.0, 2.0, 50.0]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> plackett_luce_log_likelihood(scores, mask, torch.tensor([[1]]))  # log σ(2 - 1)
        tensor([-0.3133])
        >>> plackett_luce_log_likelihood(scores, mask, torch.tensor([[1, 0]]))  # last pick is sure
        tensor([-0.3133])
    """
    _check_tensor("scores", scores)
    if not scores.is_floating_point():
        raise InputError(f"scores must be a floating-point tensor, got dtype {scores.dtype}")
    if scores.ndim != 2:
        raise InputError(f"scores must have shape [B, N], got {tuple(scores.shape)}")
    _check_tensor("mask", mask)
    if tuple(mask.shape) != tuple(scores.shape):
        raise InputError(
            f"mask must have the shape of scores {tuple(scores.shape)}, got {tuple(mask.shape)}"
        )
    _check_selection(mask, chosen, scores.shape[1])
    chosen = chosen.long()
    picked = scores.gather(1, chosen)  # [B, K]
    remaining = mask.clone()
    total = scores.new_zeros(scores.shape[0])
    for k in range(chosen.shape[1]):
        index = chosen[:, k : k + 1]
        normaliser = torch.logsumexp(scores.masked_fill(~remaining, -math.inf), dim=1)
        total = total + picked[:, k] - normaliser
        remaining = remaining.scatter(1, index, False)
    return total


def sample_plackett_luce(
    logits: Tensor, mask: Tensor, k: int, generator: torch.Generator | None = None
) -> Tensor:
    """Draw ordered picks of ``k`` valid candidates from the Plackett-Luce policy of ``logits``.

    The Gumbel-top-k trick: the ``k`` largest ``logits + Gumbel noise`` over the valid entries
    are a Plackett-Luce sample, best first. Works on any leading batch shape.

    Args:
        logits: Scores ``[..., N]``.
        mask: Valid candidates ``[..., N]`` (broadcastable to ``logits``).
        k: Picks per row.
        generator: Source of the noise (its device must be the tensors').

    Returns:
        Indices ``[..., k]``.

    Raises:
        ValueError: If ``k`` is not an integer >= 0, a row has fewer than ``k`` valid
            candidates, ``mask`` is not a bool tensor that broadcasts to ``logits``, or a logit
            is NaN. A valid candidate with logit ``-inf`` is picked only after every finite one.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> picks = sample_plackett_luce(torch.tensor([[9.0, 0.0, 8.0, 5.0]]),
        ...                              torch.tensor([[True, True, True, False]]), 2, g)
        >>> sorted(picks[0].tolist())
        [0, 2]
    """
    try:
        picks = -1 if isinstance(k, bool) else operator.index(k)  # numpy and 0-d tensors too
    except TypeError:
        picks = -1
    if picks < 0:
        raise InputError(f"k must be an integer >= 0, got {k!r}")
    k = picks
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise InputError(f"mask must be a bool tensor, got {what}")
    try:
        mask = torch.broadcast_to(mask, logits.shape)
    except RuntimeError:
        raise InputError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the logits' "
            f"{tuple(logits.shape)}"
        ) from None
    if bool(logits.isnan().any()):
        raise InputError("logits hold NaN (a NaN candidate would always be picked first)")
    valid = mask.sum(-1).reshape(-1)
    short = (valid < k).nonzero()
    if len(short):
        row = int(short[0, 0])
        raise InputError(
            f"k = {k} picks, but mask row {row} (flattened over the leading dims) has only "
            f"{int(valid[row])} valid candidates"
        )
    uniform = torch.rand(logits.shape, generator=generator, device=logits.device)
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-12)))
    keys = logits + gumbel
    # a valid candidate scored -inf still ranks above every masked one (picked last, not never)
    keys = keys.clamp_min(torch.finfo(keys.dtype).min).masked_fill(~mask, -math.inf)
    return keys.topk(k, dim=-1).indices


def subsample_candidates(
    mask: Tensor, chosen: Tensor, num_negatives: int, generator: torch.Generator | None = None
) -> Tensor:
    """A smaller candidate mask: every chosen candidate plus up to ``num_negatives`` random others.

    In each row the negatives are drawn uniformly without replacement among the valid candidates
    that were not chosen; when fewer than ``num_negatives`` exist, all of them are kept. Feeding the
    result to :func:`plackett_luce_log_likelihood` gives a sampled-softmax estimate of the
    likelihood whose cost does not grow with ``N``.

    Args:
        mask: ``True`` for valid candidates, bool, shape ``[B, N]``.
        chosen: Indices of the picked candidates, integer, shape ``[B, K]`` (valid and distinct).
        num_negatives: How many non-chosen valid candidates to keep per row, an int ``>= 0``.
        generator: Random generator for the draw; a seeded one makes the result reproducible.

    Returns:
        A new bool mask of shape ``[B, N]``, a subset of ``mask``.

    Raises:
        InputError: If ``num_negatives`` is not an int ``>= 0`` or ``mask``/``chosen`` are
            malformed (see :func:`plackett_luce_log_likelihood`).

    Example:
        >>> mask = torch.tensor([[True, True, True, True, False, True]])
        >>> gen = torch.Generator().manual_seed(0)
        >>> kept = subsample_candidates(mask, torch.tensor([[2]]), num_negatives=2, generator=gen)
        >>> kept[0, 2].item(), kept.sum().item(), kept[0, 4].item()
        (True, 3, False)
    """
    _check_selection(mask, chosen)
    if isinstance(num_negatives, bool) or not isinstance(num_negatives, int) or num_negatives < 0:
        raise InputError(f"num_negatives must be an int >= 0, got {num_negatives!r}")
    chosen = chosen.long()
    keep = torch.zeros_like(mask).scatter(1, chosen, True)
    negatives = mask & ~keep
    count = min(num_negatives, mask.shape[1])
    if count == 0 or mask.numel() == 0:
        return keep
    device = generator.device if generator is not None else mask.device
    keys = torch.rand(mask.shape, generator=generator, device=device).to(mask.device)
    keys = keys.masked_fill(~negatives, -1.0)  # non-negatives rank below every negative
    top_keys, top_index = keys.topk(count, dim=1)
    return keep.scatter(1, top_index, top_keys >= 0) | keep
