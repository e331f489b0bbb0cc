"""Group-relative advantage estimators for on-policy RL: GRPO, Dr. GRPO, AEM, and Clip-Cov.

Every function here is pure: tensors in, tensors out, no model. Rewards and per-response
statistics are laid out as ``(num_prompts, group_size)``: row ``p`` holds the ``G`` responses
(or multi-turn episodes) sampled for prompt (task) ``p``.

The AEM transform is a **reconstruction** from the abstract of "AEM: Adaptive Entropy Modulation
for agentic RL credit assignment" (the paper's code and exact formulas are not public); see
:func:`aem_advantages` and ``docs/techniques/aem.md``.

:data:`ADVANTAGE_ESTIMATORS` maps a name to an estimator with the common signature
``fn(rewards, stats, **kwargs)`` (see :class:`RolloutStats`); ``register_advantage`` adds one, like
verl's ``register_adv_est``.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ada_modules.errors import InputError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "RolloutStats",
    "aem_advantages",
    "aem_strength",
    "clip_cov_mask",
    "dr_grpo_advantages",
    "grpo_advantages",
    "predicted_entropy_drift",
    "register_advantage",
    "relative_surprisal",
]

_SCHEDULES = ("balance", "linear", "entropy", "constant")


def _check_rewards(rewards: Tensor) -> None:
    if not isinstance(rewards, Tensor):
        raise InputError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.ndim != 2:
        raise InputError(
            f"rewards must have shape (num_prompts, group_size), got {tuple(rewards.shape)}"
        )
    if rewards.shape[1] < 2:
        raise InputError(
            f"group_size must be >= 2 (a group-relative advantage of one response is "
            f"undefined), got rewards of shape {tuple(rewards.shape)}"
        )
    if not rewards.is_floating_point():
        raise InputError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    bad = ~torch.isfinite(rewards)
    if bad.any():
        prompt = int(bad.any(dim=1).nonzero()[0, 0])
        raise InputError(
            f"rewards of prompt index {prompt} are not finite: {rewards[prompt].tolist()}"
        )


def _check_eps(eps: float) -> None:
    if not 0 < eps < math.inf:
        raise InputError(
            f"eps must be a finite number > 0 (it keeps equal groups at 0), got {eps!r}"
        )


def _check_like(name: str, value: Tensor, rewards: Tensor) -> None:
    if not isinstance(value, Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise InputError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if value.shape != rewards.shape:
        raise InputError(
            f"{name} must have the shape of rewards {tuple(rewards.shape)}, got {tuple(value.shape)}"
        )
    if not torch.isfinite(value).all():
        raise InputError(f"{name} contains non-finite values")


def grpo_advantages(
    rewards: Tensor, scale: Literal["group", "batch", "none"] = "group", eps: float = 1e-4
) -> Tensor:
    """GRPO's group-normalised advantage ``(r - mean_group r) / (std_group r + eps)``.

    Args:
        rewards: Outcome rewards, shape ``(num_prompts, group_size)``.
        scale: ``"group"`` divides by each group's standard deviation (GRPO, TRL's default
            ``scale_rewards="group"``), ``"batch"`` by the standard deviation of all rewards,
            ``"none"`` does not divide (Dr. GRPO, see :func:`dr_grpo_advantages`).
        eps: Added to the standard deviation; a group whose rewards are all equal gets zero.

    Returns:
        Advantages of the shape of ``rewards``; each row sums to zero.

    Raises:
        ValueError: If ``group_size < 2``, a reward is NaN/inf (naming the prompt index), or
            ``scale`` is unknown.

    Examples:
        >>> grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
        tensor([[ 0.8659, -0.8659, -0.8659,  0.8659],
                [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    _check_rewards(rewards)
    if scale not in ("group", "batch", "none"):
        raise InputError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    _check_eps(eps)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    std = rewards.std(dim=1, keepdim=True) if scale == "group" else rewards.std()
    return centred / (std + eps)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO's advantage: the group-centred reward without std scaling.

    Dividing by the group std up-weights prompts that are nearly always or nearly never solved
    (a question-level difficulty bias); Dr. GRPO drops it.

    Examples:
        >>> dr_grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        tensor([[ 0.7500, -0.2500, -0.2500, -0.2500]])
    """
    return grpo_advantages(rewards, scale="none")


def relative_surprisal(surprisal: Tensor, eps: float = 1e-6) -> Tensor:
    """Each response's surprisal standardised within its group: ``(s - mean_g s) / std_g s``.

    Args:
        surprisal: Response-level surprisal, shape ``(num_prompts, group_size)``, e.g. the
            length-normalised ``-log pi(y) / |y|`` of each sampled response under the policy
            that sampled it.
        eps: Added to the standard deviation (a group of equally surprising responses gives 0).

    Examples:
        >>> relative_surprisal(torch.tensor([[1.0, 2.0, 3.0]]))
        tensor([[-1.0000,  0.0000,  1.0000]])
    """
    if surprisal.ndim != 2 or surprisal.shape[1] < 2:
        raise InputError(
            f"surprisal must have shape (num_prompts, group_size >= 2), got {tuple(surprisal.shape)}"
        )
    _check_eps(eps)
    centred = surprisal - surprisal.mean(dim=1, keepdim=True)
    return centred / (surprisal.std(dim=1, keepdim=True) + eps)


def predicted_entropy_drift(advantages: Tensor, surprisal: Tensor, entropy: Tensor) -> Tensor:
    """First-order response-level entropy change of a natural-gradient step, per prompt.

    For a softmax policy over whole responses and the natural-gradient step built from ``G``
    sampled responses with advantages ``A_i``, the entropy changes by approximately
    ``(lr / G) * sum_i A_i * (S_i - H)`` with ``S_i = -log pi(y_i)`` and ``H`` the response
    entropy: positively rewarded surprising responses and penalised typical ones raise the
    entropy. This returns ``mean_i A_i * (S_i - H)`` (the factor ``lr`` left out).

    Args:
        advantages: Shape ``(num_prompts, group_size)``.
        surprisal: ``-log pi(y_i)`` of each response, same shape.
        entropy: Response entropy per prompt, shape ``(num_prompts,)`` (or a scalar); the group
            mean of ``surprisal`` is the usual estimate.

    Raises:
        ValueError: If ``surprisal`` differs in shape from ``advantages`` or ``entropy`` has
            neither one value per prompt nor a single one.

    Examples:
        >>> a = torch.tensor([[1.0, -1.0]])
        >>> predicted_entropy_drift(a, torch.tensor([[3.0, 1.0]]), torch.tensor([2.0]))
        tensor([1.])
    """
    if advantages.ndim != 2 or surprisal.shape != advantages.shape:
        raise InputError(
            "advantages and surprisal must both have shape (num_prompts, group_size), got "
            f"{tuple(advantages.shape)} and {tuple(surprisal.shape)}"
        )
    entropy = torch.as_tensor(entropy, dtype=surprisal.dtype, device=surprisal.device)
    if entropy.numel() == 1:
        entropy = entropy.reshape(())
    elif entropy.shape in ((len(advantages),), (len(advantages), 1)):
        entropy = entropy.reshape(-1, 1)
    else:
        raise InputError(
            f"entropy must have one value per prompt ({len(advantages)},) or be a scalar, got "
            f"shape {tuple(entropy.shape)}"
        )
    return (advantages * (surprisal - entropy)).mean(dim=1)


def aem_strength(
    rewards: Tensor,
    strength: float,
    schedule: Literal["balance", "linear", "entropy", "constant"] = "balance",
    progress: float = 0.0,
    entropy: float | None = None,
    target_entropy: float | None = None,
) -> Tensor:
    """The signed modulation strength ``beta`` of each group (positive: explore).

    Schedules (all reconstructions, see :func:`aem_advantages`):

    - ``"balance"``: ``beta_p = strength * (n_neg - n_pos) / (n_neg + n_pos)`` from the group's
      numbers of responses above and below its mean reward: groups that mostly fail explore,
      groups that mostly succeed exploit, so training moves from exploration to exploitation as
      the success rate grows, without a clock.
    - ``"linear"``: ``beta = strength * (1 - 2 * progress)``, from ``+strength`` at the start of
      training (``progress=0``) to ``-strength`` at the end (``progress=1``).
    - ``"entropy"``: ``beta = strength * clip((target_entropy - entropy) / target_entropy, -1, 1)``:
      explore while the response entropy is below target, exploit above it.
    - ``"constant"``: ``beta = strength``.

    Returns:
        Shape ``(num_prompts,)``.

    Examples:
        >>> aem_strength(torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]), 0.5)
        tensor([ 0.2500, -0.2500])
    """
    if schedule not in _SCHEDULES:
        raise InputError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
    if not math.isfinite(strength):
        raise InputError(f"strength must be finite, got {strength!r}")
    num_prompts = rewards.shape[0]
    full = torch.full((num_prompts,), float(strength), dtype=rewards.dtype, device=rewards.device)
    if schedule == "constant":
        return full
    if schedule == "linear":
        if not 0.0 <= progress <= 1.0:
            raise InputError(f"progress must be in [0, 1], got {progress!r}")
        return full * (1.0 - 2.0 * progress)
    if schedule == "entropy":
        if (
            entropy is None
            or target_entropy is None
            or not math.isfinite(entropy)
            or not 0 < target_entropy < math.inf
        ):
            raise InputError(
                "schedule='entropy' needs a finite entropy and a finite positive target_entropy, "
                f"got entropy={entropy!r}, target_entropy={target_entropy!r}"
            )
        gap = (target_entropy - entropy) / target_entropy
        return full * max(-1.0, min(1.0, gap))
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    positive = (centred > 0).sum(dim=1).to(rewards.dtype)
    negative = (centred < 0).sum(dim=1).to(rewards.dtype)
    return full * (negative - positive) / (negative + positive).clamp(min=1.0)


def aem_advantages(
    rewards: Tensor,
    surprisal: Tensor,
    strength: float = 0.5,
    schedule: Literal["balance", "linear", "entropy", "constant"] = "balance",
    progress: float = 0.0,
    entropy: float | None = None,
    target_entropy: float | None = None,
    scale: Literal["group", "batch", "none"] = "group",
) -> Tensor:
    """AEM (reconstruction): GRPO advantages rescaled by a response-level uncertainty proxy.

    With ``A_i`` the GRPO advantage of response ``i`` in its group,
    ``rho_i`` = :func:`relative_surprisal` of its length-normalised surprisal and ``beta`` from
    :func:`aem_strength`::

        u_i      = tanh(rho_i)                       # uncertainty proxy in (-1, 1)
        A~_i     = A_i * (1 + beta * sign(A_i) * u_i)

    ``sign(A_i) * u_i`` has the sign of response ``i``'s contribution ``A_i * (S_i - H)`` to the
    first-order entropy change (see :func:`predicted_entropy_drift`), so ``beta > 0`` amplifies
    the samples that raise the response-level entropy (rare successes, confident failures) and
    damps those that lower it (exploration); ``beta < 0`` does the opposite (exploitation). With
    ``|beta| <= 1`` no advantage changes sign, and ``strength=0`` gives GRPO exactly.

    Args:
        rewards: Outcome rewards, shape ``(num_prompts, group_size)``.
        surprisal: Length-normalised surprisal of each response under the sampling policy, same
            shape.
        strength: ``|beta|`` at its largest, in ``[0, 1]``.
        schedule: How ``beta`` evolves; see :func:`aem_strength`.
        progress: Fraction of the training budget spent, for ``schedule="linear"``.
        entropy: Current response-level entropy, for ``schedule="entropy"``.
        target_entropy: Entropy target, for ``schedule="entropy"``.
        scale: Normalisation of the underlying GRPO advantage (see :func:`grpo_advantages`).

    Raises:
        ValueError: On bad shapes, ``group_size < 2``, NaN rewards (naming the prompt index),
            or ``strength`` outside ``[0, 1]``.

    Examples:
        >>> r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
        >>> s = torch.tensor([[2.0, 1.0, 1.5, 0.5]])
        >>> torch.equal(aem_advantages(r, s, strength=0.0), grpo_advantages(r))
        True
        >>> aem_advantages(r, s, strength=0.5)  # mostly failures: explore (beta = 0.25)
        tensor([[ 1.8078, -0.5460, -0.4538, -0.6026]])
    """
    _check_rewards(rewards)
    _check_like("surprisal", surprisal, rewards)
    if not 0.0 <= strength <= 1.0:
        raise InputError(f"strength must be in [0, 1], got {strength!r}")
    advantages = grpo_advantages(rewards, scale=scale)
    # checked at every strength, so that a sweep that starts at 0 meets a bad schedule at once
    beta = aem_strength(rewards, strength, schedule, progress, entropy, target_entropy)
    if strength == 0.0:
        return advantages
    uncertainty = torch.tanh(relative_surprisal(surprisal))
    return advantages * (1.0 + beta[:, None] * torch.sign(advantages) * uncertainty)


def clip_cov_mask(
    advantages: Tensor,
    logprobs: Tensor,
    mask: Tensor,
    ratio: float = 2e-4,
    bounds: tuple[float, float] = (1.0, 5.0),
    generator: torch.Generator | None = None,
) -> Tensor:
    """Clip-Cov (Cui et al. 2025): tokens whose gradient is detached to slow entropy collapse.

    Per response token ``t`` the centred covariance term
    ``c_t = (A_t - mean A) * (log pi_t - mean log pi)`` is computed (means over all valid tokens
    of the batch). Among the tokens with ``bounds[0] <= c_t <= bounds[1]``, a random
    ``ratio`` fraction of all valid tokens (at least one if any qualifies and ``ratio > 0``) is
    selected; the policy loss ignores them.

    Args:
        advantages: Per-token advantages, shape ``(batch, seq)``.
        logprobs: Per-token log-probabilities of the sampled tokens, same shape.
        mask: 1 (or True) on response tokens, same shape.
        ratio: Fraction of valid tokens to clip (the paper uses ``2e-4`` at LLM scale, i.e. a few
            hundred tokens per batch; small runs need a larger value).
        bounds: Covariance window ``(low, high)``.
        generator: Random generator for the selection.

    Returns:
        Boolean tensor of the input shape, True where the token keeps its gradient.

    Raises:
        ValueError: If the shapes differ or an argument is out of range.

    Examples:
        >>> a = torch.tensor([[2.0, 2.0, -2.0]])
        >>> lp = torch.tensor([[-0.1, -3.0, -3.0]])
        >>> keep = clip_cov_mask(a, lp, torch.ones(1, 3), ratio=0.34)
        >>> keep[0, 1].item(), int((~keep).sum())  # tokens 0 and 2 qualify (cov 2.6); one drops
        (True, 1)
    """
    if advantages.shape != logprobs.shape or advantages.shape != mask.shape:
        raise InputError(
            "advantages, logprobs and mask must have the same shape, got "
            f"{tuple(advantages.shape)}, {tuple(logprobs.shape)}, {tuple(mask.shape)}"
        )
    if not 0.0 <= ratio <= 1.0:
        raise InputError(f"ratio must be in [0, 1], got {ratio!r}")
    low, high = bounds
    if not low <= high:
        raise InputError(f"bounds must be (low, high) with low <= high, got {bounds!r}")
    valid = mask.bool()
    keep = valid.clone()
    count = int(valid.sum())
    if count == 0 or ratio == 0.0:
        return keep
    a_mean = advantages[valid].mean()
    lp_mean = logprobs[valid].mean()
    cov = (advantages - a_mean) * (logprobs - lp_mean)
    candidates = (valid & (cov >= low) & (cov <= high)).flatten().nonzero().squeeze(1)
    if candidates.numel() == 0:
        return keep
    num_clip = min(candidates.numel(), max(1, int(ratio * count)))
    order = torch.randperm(candidates.numel(), generator=generator, device=torch.device("cpu"))
    chosen = candidates[order[:num_clip].to(candidates.device)]
    keep.view(-1)[chosen] = False
    return keep


@dataclass(frozen=True)
class RolloutStats:
    """What a rollout tells an advantage estimator besides the rewards.

    Attributes:
        surprisal: Length-normalised surprisal of each response, ``(num_prompts, group_size)``.
        progress: Fraction of the training budget spent, in ``[0, 1]``.
        entropy: Mean response-level entropy estimate of the batch (nats per token).
    """

    surprisal: Tensor
    progress: float = 0.0
    entropy: float | None = None


AdvantageEstimator = Callable[..., Tensor]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding an estimator ``fn(rewards, stats, **kwargs)`` under ``name``.

    Raises:
        ValueError: If ``name`` is already registered.

    Examples:
        >>> @register_advantage("sign")
        ... def sign_advantages(rewards, stats):
        ...     return torch.sign(grpo_advantages(rewards))
        >>> ADVANTAGE_ESTIMATORS["sign"](torch.tensor([[1.0, 0.0]]), None)
        tensor([[ 1., -1.]])
        >>> del ADVANTAGE_ESTIMATORS["sign"]
    """

    def decorate(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise InputError(f"an advantage estimator named {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorate


@register_advantage("grpo")
def _grpo(rewards: Tensor, stats: RolloutStats, scale: str = "group") -> Tensor:
    return grpo_advantages(rewards, scale=scale)  # type: ignore[arg-type]


@register_advantage("dr_grpo")
def _dr_grpo(rewards: Tensor, stats: RolloutStats) -> Tensor:
    return dr_grpo_advantages(rewards)


@register_advantage("aem")
def _aem(rewards: Tensor, stats: RolloutStats, **kwargs: object) -> Tensor:
    return aem_advantages(
        rewards,
        stats.surprisal,
        progress=stats.progress,
        entropy=stats.entropy,
        **kwargs,  # type: ignore[arg-type]
    )
