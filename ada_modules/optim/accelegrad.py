"""AcceleGrad (Levy, Yurtsever & Cevher, NeurIPS 2018): universal accelerated AdaGrad-norm.

This is the 2018 method as written in the paper, kept deliberately plain: it is the reference
baseline and the regression anchor of :class:`~ada_modules.optim.accelegrad_sharp.AcceleGradSharp`.
"""

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ada_modules.errors import InputError
from ada_modules.optim._dtensor import plain

__all__ = ["AcceleGrad", "accelegrad_alpha"]


def accelegrad_alpha(t: int) -> float:
    """The AcceleGrad weight ``alpha_t``: 1 for ``t <= 2`` and ``(t + 1) / 4`` for ``t >= 3``.

    Examples:
        >>> [accelegrad_alpha(t) for t in range(6)]
        [1.0, 1.0, 1.0, 1.0, 1.25, 1.5]
    """
    return 1.0 if t <= 2 else (t + 1) / 4


class AcceleGrad(Optimizer):
    r"""AcceleGrad: accelerated AdaGrad-norm by linear coupling, tuning-free in the smoothness.

    With step counter ``t = 0, 1, ...``, weights ``alpha_t = 1`` (``t <= 2``), ``(t + 1) / 4``
    (``t >= 3``) and ``tau_t = 1 / alpha_t``, one call of :meth:`step` performs::

        x_{t+1} = tau_t z_t + (1 - tau_t) y_t           # the point held by the parameters
        g_t     = grad f(x_{t+1})                       # computed by the caller before step()
        eta_t   = 2 D / sqrt(G0^2 + sum_{s<=t} alpha_s^2 ||g_s||^2)
        z_{t+1} = Proj_K(z_t - alpha_t eta_t g_t)       # long (anchor) step
        y_{t+1} = x_{t+1} - eta_t g_t                   # short (gradient) step
        ybar    = sum_s alpha_s y_{s+1} / sum_s alpha_s # the output of the method

    and then writes the next coupling point ``x_{t+2}`` into the parameters, so that the next
    forward/backward pass is evaluated where the method needs the gradient. ``x_1 = y_0 = z_0``
    is the initial value of the parameters. ``K`` is the Euclidean ball of radius ``proj_radius``
    around the origin (no projection when it is ``None``); the paper's diameter is ``D = 2R``.

    The vector of the paper is the whole parameter group: ``||g_t||`` is the Euclidean norm of the
    concatenation of the group's gradients and the projection acts on the group's ``z`` as one
    vector. Put tensors in separate groups to get one step size per tensor. Parameters whose
    ``grad`` is ``None`` are skipped for that step (their ``x``, ``y`` and ``z`` do not move).

    The iterates ``y`` (last iterate) and ``ybar`` (weighted average) live in the optimizer state;
    :meth:`swap_output` puts one of them into the parameters for evaluation.

    Args:
        params: Parameters or parameter groups.
        lr: ``D``, the diameter (scale) of the step; must be positive.
        g0: ``G0 > 0``, the initial value of the AdaGrad-norm accumulator.
        proj_radius: Radius ``R`` of the ball ``K`` (``None``: unconstrained). A step at
            ``lr = 0`` (as ``torch.distributed.checkpoint`` takes to create the states before
            loading them) skips the projection, so that it leaves the parameters unchanged.

    Raises:
        ValueError: If ``lr``, ``g0`` or ``proj_radius`` (of the defaults or of a group) is not a
            finite number > 0.

    Examples:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.tensor([3.0, -2.0]))
        >>> opt = AcceleGrad([w], lr=4.0)
        >>> for _ in range(300):
        ...     opt.zero_grad()
        ...     (w**2).sum().backward()
        ...     opt.step()
        >>> with opt.swap_output():
        ...     print(w.abs().max().item() < 1e-3)
        True
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1.0,
        g0: float = 1e-8,
        proj_radius: float | None = None,
    ) -> None:
        super().__init__(params, {"lr": lr, "g0": g0, "proj_radius": proj_radius})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its ``lr``, ``g0`` and ``proj_radius``."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_positive("lr (the diameter D)", group["lr"])
            check_positive("g0", group["g0"])
            if group["proj_radius"] is not None:
                check_positive("proj_radius", group["proj_radius"], "or None")
        except InputError:
            self.param_groups.pop()  # a refused group is not kept
            raise

    def _init_group(self, group: dict[str, Any]) -> list[Tensor]:
        if not group["params"]:
            return []
        params = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise InputError("AcceleGrad does not support sparse gradients")
            state = self.state[p]
            if "y" not in state:
                state["y"] = p.detach().clone()
                state["z"] = p.detach().clone()
                state["ybar"] = p.detach().clone()
            params.append(p)
        head = self.state[group["params"][0]]
        if "group_step" not in head:
            head["group_step"] = 0
            head["group_sumsq"] = 0.0
            head["group_alpha_sum"] = 0.0
        return params

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Take one step with the gradients in ``.grad`` (evaluated at the current parameters).

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The loss returned by ``closure``, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = self._init_group(group)
            if not params:
                continue
            head = self.state[group["params"][0]]
            t = head["group_step"]
            alpha = accelegrad_alpha(t)
            head["group_sumsq"] += alpha * alpha * _grad_sum_sq([p.grad for p in params])
            eta = 2.0 * group["lr"] / math.sqrt(group["g0"] ** 2 + head["group_sumsq"])
            for p in params:
                st = self.state[p]
                st["z"].add_(p.grad, alpha=-alpha * eta)
                torch.add(p, p.grad, alpha=-eta, out=st["y"])
            # With lr = 0 nothing moves, not even z onto the ball (checkpoint loaders step at lr 0).
            if group["proj_radius"] is not None and group["lr"] > 0:
                znorm = math.sqrt(_sum_sq(_norms([self.state[p]["z"] for p in params])))
                if znorm > group["proj_radius"]:
                    for p in params:
                        self.state[p]["z"].mul_(group["proj_radius"] / znorm)
            head["group_alpha_sum"] += alpha
            weight = alpha / head["group_alpha_sum"]
            tau = 1.0 / accelegrad_alpha(t + 1)
            for p in params:
                st = self.state[p]
                st["ybar"].lerp_(st["y"], weight)
                p.copy_(torch.lerp(st["y"], st["z"], tau))
            head["group_step"] = t + 1
        return loss

    def swap_output(self, which: str = "average") -> AbstractContextManager[Optimizer]:
        """Context manager that puts ``ybar`` (``"average"``) or ``y`` (``"last"``) into the params.

        The coupling point ``x`` is restored bitwise on exit. Parameters that never took a step are
        left alone.
        """
        if which not in ("average", "last"):
            raise InputError(f"which must be 'average' or 'last', got {which!r}")
        key = "ybar" if which == "average" else "y"
        return _Swap(self, lambda p, st: st.get(key))


def check_positive(name: str, value: object, alternative: str = "") -> None:
    """Raise :class:`InputError` unless ``value`` is a finite real number > 0.

    Examples:
        >>> check_positive("lr", float("inf"))
        Traceback (most recent call last):
        ...
        ada_modules.errors.InputError: lr must be a finite number > 0, got inf
    """
    try:
        ok = not isinstance(value, bool | str | bytes) and 0 < float(value) < math.inf
    except (TypeError, ValueError):
        ok = False
    if not ok:
        suffix = f" {alternative}" if alternative else ""
        raise InputError(f"{name} must be a finite number > 0{suffix}, got {value!r}")


def _norms(tensors: list[Tensor]) -> list[Tensor]:
    """Euclidean norms; a float16 tensor's in float32 (in float16 they overflow from 65504)."""
    if any(t.dtype == torch.float16 for t in tensors):
        return [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
    return torch._foreach_norm(tensors)


def _grad_sum_sq(grads: list[Tensor]) -> float:
    """Sum of the gradients' squared norms, in float64.

    A norm taken in float32 overflows from about 1.8e19 (its square does), which would make the
    accumulator inf and every later step 0; then the norms are taken again in float64.
    """
    total = _sum_sq(_norms(grads))
    if math.isinf(total):
        total = _sum_sq([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
    return total


def _sum_sq(values: list[Tensor]) -> float:
    """Sum of squares of 0-d tensors, in float64, with one device synchronisation.

    0-d ``DTensor``s (norms of sharded tensors, pending a reduction over the ranks) are reduced
    first, one all-reduce each, so every rank returns the same value.
    """
    values = [plain(v) for v in values]
    dev = values[0].device
    return float(torch.stack([v.to(dev, torch.float64) for v in values]).square().sum())


class _Swap:
    """Write a per-parameter tensor from the optimizer state into the params; restore on exit."""

    def __init__(self, opt: Optimizer, pick: Any) -> None:
        self._opt = opt
        self._pick = pick
        self._saved: list[tuple[Tensor, Tensor]] = []

    def __enter__(self) -> Optimizer:
        with torch.no_grad():
            for group in self._opt.param_groups:
                for p in group["params"]:
                    src = self._pick(p, self._opt.state.get(p, {}))
                    if src is None:
                        continue
                    self._saved.append((p, p.detach().clone()))
                    p.copy_(src)
        return self._opt

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for p, x in self._saved:
                p.copy_(x)
        self._saved = []
