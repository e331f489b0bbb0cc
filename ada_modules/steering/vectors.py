"""Steering vectors from contrastive activations: one direction per decoder layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ada_modules.errors import InputError

__all__ = ["SteeringVector"]

Method = Literal["mean_diff", "pca_diff"]
_METHODS = ("mean_diff", "pca_diff")


@dataclass(frozen=True)
class SteeringVector:
    """A direction per decoder layer, added to that layer's output by :func:`~.steer`.

    ``directions[layer]`` is a ``(hidden,)`` tensor. Build one with :meth:`from_activations` from
    hidden states of inputs that show the wanted behaviour (``positive``) and inputs that show its
    opposite (``negative``); apply it with :func:`ada_modules.steering.steer`. The vector holds
    detached copies of the tensors it is given.

    To save one, save its ``directions`` (a plain ``{layer: tensor}`` dict that the default
    ``torch.load(..., weights_only=True)`` reads) and rebuild it with ``SteeringVector(loaded)``;
    ``torch.save(vector)`` pickles the class, which only ``weights_only=False`` loads.

    Example:
        >>> pos = {1: torch.tensor([[2.0, 0.0], [4.0, 0.0]])}
        >>> neg = {1: torch.tensor([[0.0, 1.0], [0.0, 1.0]])}
        >>> vector = SteeringVector.from_activations(pos, neg)
        >>> vector.directions[1].tolist(), vector.hidden_size
        ([3.0, -1.0], 2)
        >>> round(vector.normalized().directions[1].norm().item(), 6)
        1.0
        >>> import io
        >>> buffer = io.BytesIO()
        >>> torch.save(vector.directions, buffer)
        >>> _ = buffer.seek(0)
        >>> SteeringVector(torch.load(buffer)).directions[1].tolist()
        [3.0, -1.0]
    """

    directions: dict[int, Tensor]

    def __post_init__(self) -> None:
        if not self.directions:
            raise InputError("directions must hold at least one layer, got an empty mapping")
        widths = set()
        for layer, direction in self.directions.items():
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise InputError(f"directions keys must be layer indices >= 0, got {layer!r}")
            if not isinstance(direction, Tensor) or direction.dim() != 1:
                raise InputError(
                    f"directions[{layer}] must be a 1-D tensor, got "
                    f"{getattr(direction, 'shape', type(direction).__name__)}"
                )
            if not torch.isfinite(direction).all():
                raise InputError(f"directions[{layer}] holds NaN or infinite values")
            widths.add(direction.numel())
        if len(widths) > 1:
            raise InputError(f"directions must all have one width, got widths {sorted(widths)}")
        copies = {layer: direction.detach().clone() for layer, direction in self.directions.items()}
        object.__setattr__(self, "directions", copies)  # the dataclass is frozen

    @property
    def hidden_size(self) -> int:
        """The width of every direction."""
        return next(iter(self.directions.values())).numel()

    @property
    def layers(self) -> list[int]:
        """The decoder layers it steers, in order."""
        return sorted(self.directions)

    @classmethod
    def from_activations(
        cls,
        positive: dict[int, Tensor],
        negative: dict[int, Tensor],
        method: Method = "mean_diff",
    ) -> SteeringVector:
        """The direction from ``negative`` to ``positive`` hidden states, per layer.

        Args:
            positive: ``{layer: (n, hidden)}`` hidden states of inputs with the wanted behaviour.
            negative: ``{layer: (m, hidden)}`` hidden states of inputs without it (same layers).
            method: ``mean_diff``: difference of the class means (CAA). ``pca_diff``: the first
                principal direction of the paired differences ``positive[i] - negative[i]``
                (needs ``n == m``), signed so that positives project higher, scaled to the
                mean difference's length along it.

        Raises:
            ValueError: If the layers differ, a value is not a 2-D tensor, widths differ,
                ``pca_diff`` gets unpaired sets, or ``method`` is unknown.
        """
        if method not in _METHODS:
            raise InputError(f"method must be one of {', '.join(_METHODS)}, got {method!r}")
        if set(positive) != set(negative):
            raise InputError(
                f"positive and negative must hold the same layers, got {sorted(positive)} and "
                f"{sorted(negative)}"
            )
        directions = {}
        for layer in sorted(positive):
            pos, neg = positive[layer], negative[layer]
            for name, states in (("positive", pos), ("negative", neg)):
                if not isinstance(states, Tensor):
                    raise InputError(
                        f"{name}[{layer}] must be a tensor, got {type(states).__name__}"
                    )
                if states.dim() != 2 or states.shape[0] == 0:
                    raise InputError(
                        f"{name}[{layer}] must be (n, hidden) with n >= 1, got {tuple(states.shape)}"
                    )
            if pos.shape[1] != neg.shape[1]:
                raise InputError(
                    f"positive[{layer}] and negative[{layer}] widths differ: {pos.shape[1]} vs "
                    f"{neg.shape[1]}"
                )
            mean_diff = pos.float().mean(0) - neg.float().mean(0)
            if method == "mean_diff":
                directions[layer] = mean_diff
                continue
            if pos.shape[0] != neg.shape[0]:
                raise InputError(
                    f"pca_diff pairs positives with negatives, got {pos.shape[0]} and "
                    f"{neg.shape[0]} rows at layer {layer}"
                )
            diffs = pos.float() - neg.float()
            # the top right-singular vector of the (uncentred) differences, as repeng's pca_diff
            _, _, vh = torch.linalg.svd(diffs, full_matrices=False)
            axis = vh[0]
            projection = (mean_diff @ axis).item()
            directions[layer] = axis * projection
        return cls(directions)

    def normalized(self) -> SteeringVector:
        """The same directions at unit length (strength then counts in hidden-state units)."""
        return SteeringVector(
            {layer: d / d.norm().clamp_min(1e-12) for layer, d in self.directions.items()}
        )
