"""A token-choice top-k mixture-of-experts feed-forward layer with stacked expert weights.

Each token is routed to the ``top_k`` experts with the highest router probability and receives
the weighted sum of their outputs. The weights of all experts live in two large parameters,
``w_in`` of shape ``(E, d_model, d_ff)`` and ``w_out`` of shape ``(E, d_ff, d_model)``, rather than
in ``E`` separate ``nn.Linear`` modules. Under FSDP2 (``fully_shard``) each of them is one large
sharded parameter (sharded along the expert dimension), which is what a compressed all-gather
such as AdERA's works on; a per-expert module list would give many small parameters instead.

No token is ever dropped (there is no capacity factor): every token reaches its ``top_k``
experts. The switch-style load-balancing loss is returned with every forward pass (see
:func:`load_balancing_loss`); add it, scaled, to the task loss.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from ada_modules.errors import InputError

__all__ = ["MoELayer", "Routing", "StackedExperts", "load_balancing_loss"]


class Routing(NamedTuple):
    """The routing decision for a flat batch of ``T`` tokens.

    Attributes:
        indices: ``(T, top_k)`` expert ids, highest router probability first.
        weights: ``(T, top_k)`` combine weights of those experts (each row sums to 1 when the
            layer renormalises, else the raw router probabilities).
        probs: ``(T, E)`` router probabilities (softmax of the router logits).
    """

    indices: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


def load_balancing_loss(
    probs: torch.Tensor, indices: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Switch-Transformer-style auxiliary loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the ``T * top_k`` token-to-expert assignments that went to expert
    ``e`` (no gradient) and ``P_e`` the mean router probability of expert ``e`` over the ``T``
    tokens. The loss is 1 when both are uniform and grows up to ``E`` as routing collapses onto
    one expert; its gradient flows through ``P_e`` only.

    Args:
        probs: ``(T, E)`` router probabilities.
        indices: ``(T, top_k)`` chosen experts.
        num_experts: ``E``.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: If the shapes disagree with each other or with ``num_experts``.

    Examples:
        >>> probs = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
        >>> indices = torch.tensor([[0], [0]])  # top-1, both tokens on expert 0
        >>> load_balancing_loss(probs, indices, 2)  # 2 * (1.0 * 0.65 + 0.0 * 0.35)
        tensor(1.3000)
    """
    if probs.ndim != 2 or probs.shape[1] != num_experts:
        raise InputError(f"probs must have shape (T, {num_experts}), got {tuple(probs.shape)}")
    if indices.ndim != 2 or indices.shape[0] != probs.shape[0]:
        raise InputError(
            f"indices must have shape ({probs.shape[0]}, top_k), got {tuple(indices.shape)}"
        )
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts).to(probs.dtype)
    fraction = counts / indices.numel()
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


class StackedExperts(nn.Module):
    """``E`` two-layer GELU MLPs whose weights are stacked into two parameters.

    Expert ``e`` maps ``x`` to ``gelu(x @ w_in[e]) @ w_out[e]``. Kept as its own module so that
    FSDP2 can shard the experts as a unit separate from the router and the attention.

    Args:
        num_experts: Number of experts ``E``.
        d_model: Input and output width.
        d_ff: Hidden width of each expert.

    Raises:
        ValueError: If a size is not a positive integer.

    Examples:
        >>> experts = StackedExperts(num_experts=4, d_model=8, d_ff=16)
        >>> experts.w_in.shape, experts.w_out.shape
        (torch.Size([4, 8, 16]), torch.Size([4, 16, 8]))
        >>> experts.expert(2, torch.zeros(3, 8)).shape
        torch.Size([3, 8])
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("d_model", d_model), ("d_ff", d_ff)):
            _check_positive(name, value)
        self.num_experts = num_experts
        self.d_model = d_model
        self.d_ff = d_ff
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform init with ``nn.Linear``'s bound ``1/sqrt(fan_in)`` per expert matrix."""
        nn.init.uniform_(self.w_in, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model))
        nn.init.uniform_(self.w_out, -1 / math.sqrt(self.d_ff), 1 / math.sqrt(self.d_ff))

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Output of expert ``index`` for the rows of ``x`` (shape ``(n, d_model)``)."""
        return F.gelu(x @ self.w_in[index]) @ self.w_out[index]

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Combine the chosen experts' outputs: ``y_t = sum_j weights[t, j] * expert_{idx[t, j]}(x_t)``.

        Args:
            x: ``(T, d_model)`` tokens.
            routing: The routing of these tokens.

        Returns:
            ``(T, d_model)``.
        """
        out = torch.zeros_like(x)
        flat_experts = routing.indices.reshape(-1)
        flat_weights = routing.weights.reshape(-1, 1).to(x.dtype)
        flat_tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(
            routing.indices.shape[1]
        )
        # Group the assignments by expert once; one matmul pair per expert with tokens.
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            chosen = order[start : start + count]
            start += count
            tokens = flat_tokens[chosen]
            out.index_add_(0, tokens, self.expert(e, x[tokens]) * flat_weights[chosen])
        return out


class MoELayer(nn.Module):
    """Token-choice top-k mixture of ``E`` GELU MLP experts (drop-in for a transformer MLP).

    A bias-free linear router gives each token ``E`` logits; their softmax ``p`` picks the
    ``top_k`` experts with the highest probability, and (with ``normalize_weights``) the chosen
    probabilities are renormalised to sum to 1 (Mixtral-style top-2 gating). The output is the
    combine-weighted sum of the chosen experts' outputs. ``forward`` also returns the switch-style
    load-balancing loss (:func:`load_balancing_loss`) of the routing.

    Args:
        d_model: Input and output width.
        d_ff: Hidden width of each expert.
        num_experts: Number of experts ``E``.
        top_k: Experts per token (``1 <= top_k <= num_experts``).
        normalize_weights: Renormalise the chosen probabilities to sum to 1 per token.

    Raises:
        ValueError: If a size is not a positive integer or ``top_k > num_experts``.

    Examples:
        >>> layer = MoELayer(d_model=16, d_ff=32, num_experts=8, top_k=2)
        >>> y, aux = layer(torch.randn(2, 5, 16))
        >>> y.shape, aux.shape
        (torch.Size([2, 5, 16]), torch.Size([]))
        >>> routing = layer.route(torch.randn(10, 16))
        >>> routing.indices.shape, bool(torch.allclose(routing.weights.sum(-1), torch.ones(10)))
        (torch.Size([10, 2]), True)
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int = 8,
        top_k: int = 2,
        normalize_weights: bool = True,
    ) -> None:
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("d_ff", d_ff),
            ("num_experts", num_experts),
            ("top_k", top_k),
        ):
            _check_positive(name, value)
        if top_k > num_experts:
            raise InputError(f"top_k={top_k} must not exceed num_experts={num_experts}")
        self.d_model = d_model
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_weights = normalize_weights
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, d_model, d_ff)

    def route(self, x: torch.Tensor) -> Routing:
        """Routing of the flat tokens ``x`` (shape ``(T, d_model)``)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.normalize_weights:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(indices=indices, weights=weights, probs=probs)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix the experts for every token of ``x`` (shape ``(..., d_model)``).

        Returns:
            The output (same shape as ``x``) and the scalar load-balancing loss.

        Raises:
            ValueError: If the last dimension of ``x`` is not ``d_model``.
        """
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise InputError(
                f"x must have last dimension d_model={self.d_model}, got shape {tuple(x.shape)}"
            )
        flat = x.reshape(-1, self.d_model)
        routing = self.route(flat)
        out = self.experts(flat, routing)
        aux = load_balancing_loss(routing.probs, routing.indices, self.num_experts)
        return out.reshape(x.shape), aux


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
