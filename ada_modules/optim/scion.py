"""Scion and uSCG: stochastic conditional gradient with per-layer norm-ball LMOs.

Our implementation of the update of Pethick et al. (ICML 2025, "Training Deep Learning Models with
Norm-Constrained LMOs"), with the norms of :mod:`ada_modules.optim.lmo`.
"""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ada_modules.checks import is_finite_real
from ada_modules.errors import InputError
from ada_modules.optim._dtensor import shard_like
from ada_modules.optim.lmo import NORM_NAMES, Norm, auto_norm, get_norm

__all__ = ["Scion"]


class Scion(Optimizer):
    """Stochastic conditional gradient over per-layer norm balls (Scion), or its unconstrained form.

    With momentum ``d ← (1 − μ) d + μ g`` (``d`` starts at zero) and the LMO of each parameter's
    norm (``lmo(d) = argmin_{‖v‖ ≤ 1} ⟨d, v⟩``, which already points downhill), one step is

    - constrained (Scion/SCG, default): ``x ← (1 − γ) x + γ ρ lmo(d)``, a Frank–Wolfe step that
      keeps ``x`` inside the ball of radius ``ρ`` once it is there (and acts as weight decay);
    - unconstrained (uSCG): ``x ← x + γ ρ lmo(d)``;

    with ``γ = lr`` and ``ρ = radius``. Every LMO here is invariant to positive scaling of ``d``,
    so the update size is ``γ ρ`` in the layer's norm whatever the gradient's size.

    Momentum convention: ``momentum`` is the weight ``μ`` of the *new* gradient, i.e. one minus the
    usual coefficient (as in the Scion paper and code): ``momentum=1`` uses the current gradient
    only, ``momentum=0.1`` corresponds to ``β = 0.9``.

    Norms are chosen per param group by name (one of
    :data:`~ada_modules.optim.lmo.NORM_NAMES`, with options in ``norm_kwargs``), as a
    :class:`~ada_modules.optim.lmo.Norm` instance, or left ``None`` for
    :func:`~ada_modules.optim.lmo.auto_norm` per parameter (``"spectral"`` for matrices,
    ``"spectral_conv"`` for convolution weights, ``"rms"`` for biases and gains). Scion's recipes
    use ``"colnorm"``/``"spectral"`` for input layers, ``"spectral"`` for hidden weights and
    ``"sign"`` with a larger radius for the output head. Each spectral parameter costs one
    Newton–Schulz call per step.

    Parameters sharded with FSDP2 (``DTensor``s) are supported: momentum and the update stay on
    the local shards, and each LMO runs as described in :mod:`ada_modules.optim.lmo` (on the
    gathered full tensor when it needs one), so a step equals the unsharded one.

    Args:
        params: Parameters or param groups; groups may set every argument below.
        lr: Step size ``γ``; in ``(0, 1]`` for the constrained update (a convex combination).
        momentum: Weight ``μ`` of the new gradient in ``(0, 1]`` (one minus the usual β).
        radius: Norm-ball radius ``ρ > 0``.
        norm: Norm name, a ``Norm`` instance, or ``None`` for :func:`auto_norm` per parameter.
        norm_kwargs: Options for the named norm (e.g. ``{"transpose": True}`` for ``"colnorm"``).
        unconstrained: Use uSCG (no shrinkage of ``x``) instead of the constrained update.

    Raises:
        ValueError: If ``lr``, ``momentum`` or ``radius`` is out of range, the norm name is
            unknown, or a norm does not apply to a parameter's shape (spectral on 1-D).
        TypeError: If a parameter is complex or not floating, or an option has the wrong type.
        RuntimeError: At :meth:`step`, if a gradient is sparse.

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        ... )
        >>> opt = Scion(
        ...     [
        ...         {"params": model[0].parameters()},  # auto: spectral weight, rms bias
        ...         {"params": model[2].parameters(), "norm": "sign", "radius": 8.0},
        ...     ],
        ...     lr=0.05,
        ...     momentum=0.5,
        ... )
        >>> x, y = torch.randn(64, 4), torch.randn(64, 1)
        >>> first = torch.nn.functional.mse_loss(model(x), y).item()
        >>> for _ in range(30):
        ...     opt.zero_grad()
        ...     loss = torch.nn.functional.mse_loss(model(x), y)
        ...     loss.backward()
        ...     opt.step()
        >>> loss.item() < first
        True
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.1,
        radius: float = 1.0,
        norm: str | Norm | None = None,
        norm_kwargs: dict[str, Any] | None = None,
        unconstrained: bool = False,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "momentum": momentum,
            "radius": radius,
            "norm": norm,
            "norm_kwargs": norm_kwargs,
            "unconstrained": unconstrained,
        }
        self._validate_options(defaults)
        super().__init__(params, defaults)

    @staticmethod
    def _validate_options(group: dict[str, Any]) -> None:
        unconstrained = group["unconstrained"]
        if not isinstance(unconstrained, bool):
            raise InputError(f"unconstrained must be a bool, got {unconstrained!r}")
        lr = group["lr"]
        high = "" if unconstrained else " and <= 1 for the constrained update"
        if not is_finite_real(lr) or not (0 < lr and (unconstrained or lr <= 1)):
            raise InputError(f"lr must be a finite number > 0{high}, got {lr!r}")
        momentum = group["momentum"]
        if not is_finite_real(momentum) or not 0 < momentum <= 1:
            raise InputError(
                f"momentum must be in (0, 1] (the weight of the new gradient, one minus the usual "
                f"beta), got {momentum!r}"
            )
        radius = group["radius"]
        if not is_finite_real(radius) or not radius > 0:
            raise InputError(f"radius must be a finite number > 0, got {radius!r}")
        norm = group["norm"]
        if norm is not None and not isinstance(norm, str | Norm):
            raise InputError(f"norm must be a name, a Norm or None, got {norm!r}")
        if isinstance(norm, str) and norm not in NORM_NAMES:
            raise InputError(f"unknown norm {norm!r}; allowed: {', '.join(NORM_NAMES)}")
        norm_kwargs = group["norm_kwargs"]
        if norm_kwargs is not None and not isinstance(norm_kwargs, dict):
            raise InputError(f"norm_kwargs must be a dict or None, got {norm_kwargs!r}")
        if norm_kwargs and not isinstance(norm, str):
            raise InputError(f"norm_kwargs {norm_kwargs!r} needs a norm name, got norm={norm!r}")

    @staticmethod
    def _norm_for(group: dict[str, Any], param: Tensor) -> Norm:
        """The norm of ``param`` in ``group``."""
        norm = group["norm"]
        if isinstance(norm, Norm):
            return norm
        if norm is None:
            return get_norm(auto_norm(param))
        return get_norm(norm, **(group["norm_kwargs"] or {}))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after validating its options and its parameters' shapes for its norm."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._validate_options(group)
            for p in group["params"]:
                self._norm_for(group, p).check(p)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def init(self, generator: torch.Generator | None = None) -> None:
        """Re-initialise every parameter with two or more dimensions on its norm ball's sphere.

        Each such parameter becomes ``ρ · v / ‖v‖`` with ``v = lmo(G)`` for a Gaussian ``G``: a
        random point of norm exactly ``ρ`` in its layer's norm (a scaled, near semi-orthogonal
        matrix for ``"spectral"``; random signs for ``"sign"``; equal-norm columns for
        ``"colnorm"``),
        the initialisation Scion's authors pair with the constrained update, which otherwise
        spends its first steps shrinking weights that start outside the ball. Vectors (biases,
        norm gains) keep their module's initialisation. Call it once, before training. A sharded
        (``DTensor``) parameter gets rank 0's draw of the full tensor, so it equals the unsharded
        initialisation from the same generator state.

        Args:
            generator: Random generator for reproducible draws (``None``: the global one).

        Examples:
            >>> import torch
            >>> layer = torch.nn.Linear(8, 4)
            >>> opt = Scion(layer.parameters(), lr=0.1, radius=2.0)
            >>> opt.init(torch.Generator().manual_seed(0))
            >>> from ada_modules.optim.lmo import get_norm
            >>> round(float(get_norm("spectral").norm(layer.weight.detach())), 4)
            2.0
        """
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    continue
                norm = self._norm_for(group, p)
                device = generator.device if generator is not None else p.device
                gaussian = torch.randn(p.shape, generator=generator, device=device)
                direction = norm.lmo(gaussian.to(p.device, p.dtype))
                direction.mul_(group["radius"] / norm.norm(direction))
                p.copy_(shard_like(direction, p, src_rank=0))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, radius = group["lr"], group["momentum"], group["radius"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"Scion does not support sparse gradients (parameter of shape "
                        f"{tuple(p.shape)}); use a dense embedding (sparse=False)"
                    )
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, momentum)
                direction = self._norm_for(group, p).lmo(buf)
                if not group["unconstrained"]:
                    p.mul_(1.0 - lr)
                p.add_(direction, alpha=lr * radius)
        return loss
