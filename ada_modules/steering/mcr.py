"""The Modality Contribution Ratio (MCR): how much each modality moves a model's answer."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ada_modules.errors import InputError
from ada_modules.steering._checks import check_real

__all__ = ["answer_divergence", "attention_share", "modality_contribution_ratio"]

Divergence = Literal["kl", "js"]


def answer_divergence(p_logits: Tensor, q_logits: Tensor, divergence: Divergence = "js") -> Tensor:
    """Per-row divergence ``D(p || q)`` of two answer distributions given as logits ``(..., k)``.

    ``kl`` is the Kullback-Leibler divergence, ``js`` the Jensen-Shannon divergence (symmetric,
    at most ``log 2``). Computed in float32 whatever the logits' and torch's default dtype. A
    ``-inf`` logit marks an impossible option; NaN and ``+inf`` are refused.

    Example:
        >>> same = torch.tensor([[2.0, 0.0]])
        >>> answer_divergence(same, same).item()
        0.0
        >>> round(answer_divergence(torch.tensor([[50.0, 0.0]]), torch.tensor([[0.0, 50.0]])).item(), 4)
        0.6931
    """
    _check_divergence(divergence)
    _check_logits(p_logits=p_logits, q_logits=q_logits)
    return _divergence(p_logits, q_logits, divergence)


def _check_divergence(divergence: object) -> None:
    if divergence not in ("kl", "js"):
        raise InputError(f"divergence must be 'kl' or 'js', got {divergence!r}")


def _check_logits(**logits: Tensor) -> None:
    """Each a tensor without NaN or ``+inf``, all of one shape; the errors name the argument."""
    for name, value in logits.items():
        if not isinstance(value, Tensor):
            raise InputError(f"{name} must be a tensor, got {type(value).__name__}")
        if (value.isnan() | value.isposinf()).any():
            raise InputError(f"{name} holds NaN or +inf (-inf marks an impossible option)")
    (first, reference), *others = logits.items()
    for name, value in others:
        if value.shape != reference.shape:
            raise InputError(
                f"the two answer distributions differ in shape: {first} {tuple(reference.shape)} "
                f"vs {name} {tuple(value.shape)}"
            )


def _divergence(p_logits: Tensor, q_logits: Tensor, divergence: Divergence) -> Tensor:
    log_p = torch.log_softmax(p_logits.float(), dim=-1)
    log_q = torch.log_softmax(q_logits.float(), dim=-1)
    if divergence == "kl":
        return _kl(log_p, log_q)
    log_m = torch.logsumexp(torch.stack([log_p, log_q]), dim=0) - math.log(2.0)
    return 0.5 * (_kl(log_p, log_m) + _kl(log_q, log_m))


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """``KL(p || q)`` over the last dim; options with ``p = 0`` (e.g. ``-inf`` logits) add 0."""
    terms = torch.where(log_p.isneginf(), torch.zeros_like(log_p), log_p.exp() * (log_p - log_q))
    return terms.sum(-1).clamp_min(0.0)


def modality_contribution_ratio(
    full_logits: Tensor,
    without_image_logits: Tensor,
    without_text_logits: Tensor,
    divergence: Divergence = "js",
    eps: float = 1e-6,
) -> Tensor:
    """The image's share of the answer, by ablation: ``MCR_v`` per row, in ``[0, 1]``.

    ``MCR_v = D_v / (D_v + D_t)`` with ``D_v = D(p(.|I,T) || p(.|-,T))`` (what removing the image
    changes) and ``D_t = D(p(.|I,T) || p(.|I,-))`` (what removing the text changes); the text's
    share is ``1 - MCR_v``. ``eps`` is added to both, so a row that neither removal moves (the
    modalities agree) gets 0.5.

    Args:
        full_logits: Answer logits with both modalities, ``(batch, k)``.
        without_image_logits: With the image removed.
        without_text_logits: With the text removed.
        divergence: ``js`` (default, bounded) or ``kl``.
        eps: Added to each divergence, > 0.

    Example:
        >>> full = torch.tensor([[4.0, 0.0], [0.0, 4.0]])  # answer: option 0, then option 1
        >>> no_image = torch.tensor([[4.0, 0.0], [4.0, 0.0]])  # the text says option 0
        >>> no_text = torch.tensor([[0.0, 4.0], [0.0, 4.0]])  # the image says option 1
        >>> modality_contribution_ratio(full, no_image, no_text).round(decimals=3).tolist()
        [0.0, 1.0]
    """
    eps = check_real("eps", eps, "a finite number > 0", lambda x: 0 < x < math.inf)
    _check_divergence(divergence)
    _check_logits(
        full_logits=full_logits,
        without_image_logits=without_image_logits,
        without_text_logits=without_text_logits,
    )
    d_image = _divergence(full_logits, without_image_logits, divergence)
    d_text = _divergence(full_logits, without_text_logits, divergence)
    return (d_image + eps) / (d_image + d_text + 2 * eps)


def attention_share(attentions: tuple[Tensor, ...] | list[Tensor], image_mask: Tensor) -> Tensor:
    """The cheap MCR variant: the image tokens' share of the last position's attention.

    Averages over layers and heads the attention that the last query position pays to image
    positions, divided by what it pays to all image and text positions (``image_mask`` marks the
    image tokens, ``(batch, seq)``; every other position counts as text). Attention shares are
    confounded by token counts (many image tokens draw attention by number): prefer the ablation
    :func:`modality_contribution_ratio`.

    Args:
        attentions: One ``(batch, heads, seq, seq)`` tensor per layer, e.g. the
            ``attentions`` of a transformers model called with ``output_attentions=True`` and
            loaded with ``attn_implementation="eager"`` (sdpa and flash attention return none).
        image_mask: ``(batch, seq)`` booleans.

    Example:
        >>> attn = torch.zeros(1, 1, 3, 3)
        >>> attn[0, 0, 2] = torch.tensor([0.6, 0.2, 0.2])
        >>> attention_share([attn], torch.tensor([[True, False, False]])).tolist()
        [0.6000000238418579]
    """
    if len(attentions) == 0 or any(a is None for a in attentions):
        raise InputError(
            "attentions must hold one attention tensor per layer, got "
            f"{'none' if len(attentions) == 0 else 'None'}: transformers returns no attention "
            'weights with sdpa or flash attention; load the model with attn_implementation="eager"'
        )
    for i, a in enumerate(attentions):
        if not isinstance(a, Tensor) or a.dim() != 4:
            raise InputError(
                f"attentions[{i}] must be (batch, heads, seq, seq), got "
                f"{tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__}"
            )
    stacked = torch.stack([a[:, :, -1, :].float() for a in attentions])  # (layers, b, heads, seq)
    if image_mask.shape != stacked.shape[1:2] + stacked.shape[3:]:
        raise InputError(
            f"image_mask must be (batch, seq) = {tuple(stacked.shape[1:2] + stacked.shape[3:])}, "
            f"got {tuple(image_mask.shape)}"
        )
    last = stacked.mean(dim=(0, 2))  # (batch, seq)
    image = (last * image_mask).sum(-1)
    return image / last.sum(-1).clamp_min(1e-12)
