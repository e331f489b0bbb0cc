"""AcceleGrad#: AcceleGrad's linear coupling with adaptive anchors and per-group geometry.

The coupling, the weights ``alpha_k`` and the output follow AcceleGrad (Levy et al., 2018). The
diagonal anchor, the sharp / mirror / clipped-LMO short steps and the use of one Newton–Schulz polar
factor of the raw stochastic gradient for both the dual norm and the direction are a
**reconstruction** from the AcceleGrad# abstract (see the design brief, section A.2.6), not a
published algorithm.
"""

import math
import warnings
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from ada_modules.errors import InputError
from ada_modules.optim import lmo as _lmo
from ada_modules.optim._dtensor import plain
from ada_modules.optim.accelegrad import _sum_sq, _Swap, accelegrad_alpha, check_positive

__all__ = ["ANCHORS", "GEOMETRIES", "AcceleGradSharp"]

ANCHORS: tuple[str, ...] = ("scalar", "diagonal")
"""Adaptive anchors accepted by :class:`AcceleGradSharp`."""
GEOMETRIES: tuple[str, ...] = ("sharp", "mirror", "lmo")
"""Short-step geometries accepted by :class:`AcceleGradSharp`."""
_OUTPUTS = ("last", "average")
_NONFINITE = ("raise", "skip")


class AcceleGradSharp(Optimizer):
    r"""AcceleGrad# — linear coupling, an adaptive anchor and a per-group short-step geometry.

    Per parameter group, with step counter ``k = 0, 1, ...``, ``alpha_k = 1`` (``k <= 2``),
    ``(k + 1) / 4`` (``k >= 3``), ``tau_k = 1 / alpha_k``, each tensor's norm ``||.||`` (the
    group's ``norm``, or :func:`~ada_modules.optim.lmo.auto_norm` of the tensor), its dual
    ``||.||_*`` and LMO ``lmo(.)``, one call of :meth:`step` performs::

        x_{k+1} = tau_k z_k + (1 - tau_k) y_k                  # held by the parameters
        g_k     = grad f(x_{k+1}; xi_k)                       # raw stochastic gradient
        S_k     = sum_{j<=k} alpha_j^2 sum_tensors ||g_j||_*^2 # scalar, over the group
        eta_k   = 2 D / sqrt(G0^2 + S_k)
        # anchor (long step)
        scalar:   z_{k+1} = Proj(z_k - alpha_k eta_k g_k)
        diagonal: z_{k+1} = Proj(z_k - alpha_k 2 D g_k / (sqrt(s_k) + eps)),
                  s_k = sum_{j<=k} alpha_j^2 g_j * g_j        # per coordinate
        # geometry (short step)
        sharp:  y_{k+1} = x_{k+1} - eta_k g_k^#,   g^# = ||g||_* (-lmo(g))
        mirror: y_{k+1} = x_{k+1} - 2 D g_k / (sqrt(s_k) + eps)
        lmo:    y_{k+1} = x_{k+1} + eta_k min(rho, ||g_k||_*) lmo(g_k)
        ybar    = sum_j alpha_j y_{j+1} / sum_j alpha_j

    after which the next coupling point ``x_{k+2}`` is written into the parameters. ``Proj`` is
    the Euclidean projection of the group's ``z`` (one vector) onto the ball of radius
    ``proj_radius`` around the origin (none when ``None``). For a matrix norm, ``lmo(g_k)`` and
    ``||g_k||_*`` come from **one** Newton–Schulz call on ``g_k`` itself (no momentum buffer), reused
    by the sharp and clipped-LMO steps and by ``S_k``.

    AcceleGrad is the setting ``anchor="scalar", geometry="sharp", norm="euclidean"`` (then
    ``g^# = g``, ``||g||_* = ||g||_2`` and the update is :class:`~ada_modules.optim.AcceleGrad`'s
    with the same ``lr = D`` and ``g0``). What is reconstruction: the diagonal anchor, the dual norms
    in ``S_k``, the mirror and clipped-LMO branches and the projection for the diagonal anchor (the
    paper's ``K`` is Euclidean).

    The defaults (diagonal anchor, clipped LMO, automatic norms: spectral for matrices,
    spectral-conv for convolutions, RMS for vectors) are meant for ordinary networks; see
    :func:`~ada_modules.optim.param_groups.geometry_param_groups` for per-layer norms (colnorm
    embeddings, sign heads). Parameters whose ``grad`` is ``None`` are skipped for the step. State:
    ``y``, ``z`` per tensor, ``s`` (diagonal anchor or mirror step) and ``ybar`` (``output="average"``)
    — three extra parameter-sized buffers by default.

    Parameters sharded with FSDP2 (``DTensor``s) are supported, with states sharded like them: the
    element-wise parts run on the local shards, each LMO and dual norm as described in
    :mod:`ada_modules.optim.lmo` (on the gathered full tensor when it needs one), and the scalar
    accumulators from norms reduced over the ranks, so every rank takes the unsharded step.

    Args:
        params: Parameters, ``(name, parameter)`` pairs, or groups. Group keys override any of the
            options below.
        lr: ``D``, the step scale (diameter); must be positive.
        anchor: ``"scalar"`` (AdaGrad-norm) or ``"diagonal"`` (per-coordinate AdaGrad).
        geometry: ``"sharp"``, ``"mirror"`` or ``"lmo"`` (clipped LMO).
        norm: A name in :data:`~ada_modules.optim.lmo.NORM_NAMES`, a
            :class:`~ada_modules.optim.lmo.Norm`, or ``None`` for the automatic norm per tensor.
        norm_kwargs: Options of the named norm (e.g. ``{"transpose": True}`` for ``"colnorm"``);
            a name and a dict keep the optimizer's state dict plain data, which checkpoints
            loaded with ``weights_only=True`` need.
        radius: ``rho``, the clip of the dual norm in the ``"lmo"`` geometry (``None``: no clip).
        g0: ``G0 > 0``, initial value of the scalar accumulator.
        eps: Denominator guard of the per-coordinate accumulator (> 0: a coordinate whose
            gradients have all been zero takes no step).
        proj_radius: Radius of the projection ball for ``z`` (``None``: unconstrained). A step at
            ``lr = 0`` (as ``torch.distributed.checkpoint`` takes to create the states before
            loading them) skips the projection, so that it leaves the parameters unchanged.
        output: What :meth:`swap_output` shows: ``"last"`` (``y``) or ``"average"`` (``ybar``).
        nonfinite: On a NaN/Inf gradient, ``"raise"`` (naming the parameter) or ``"skip"`` the
            whole step with a warning, leaving parameters and state untouched.
        foreach: Use ``torch._foreach_*`` kernels for the elementwise parts (``None``: when every
            parameter of the group is on a CUDA device).

    Raises:
        ValueError: For an ``lr``/``g0``/``eps``/``radius``/``proj_radius`` that is not a finite
            number > 0, an unknown anchor, geometry, norm, output or nonfinite mode, a norm that
            does not fit a tensor's shape (spectral on a 1-D tensor), or sparse gradients (at the
            step).
        TypeError: For complex, non-floating or float16 parameters (float16's range does not
            hold the sums of squared gradients; bfloat16 and float32 do).

    Examples:
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        >>> x, t = torch.randn(64, 4), torch.randn(64, 1)
        >>> opt = AcceleGradSharp(net.parameters(), lr=0.05)
        >>> first = torch.nn.functional.mse_loss(net(x), t).item()
        >>> for _ in range(100):
        ...     opt.zero_grad()
        ...     torch.nn.functional.mse_loss(net(x), t).backward()
        ...     opt.step()
        >>> with opt.swap_output():
        ...     last = torch.nn.functional.mse_loss(net(x), t).item()
        >>> last < 0.7 * first
        True
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
        lr: float = 0.01,
        anchor: Literal["scalar", "diagonal"] = "diagonal",
        geometry: Literal["sharp", "mirror", "lmo"] = "lmo",
        norm: str | _lmo.Norm | None = None,
        norm_kwargs: dict[str, Any] | None = None,
        radius: float | None = 1.0,
        g0: float = 1e-8,
        eps: float = 1e-8,
        proj_radius: float | None = None,
        output: Literal["last", "average"] = "last",
        nonfinite: Literal["raise", "skip"] = "raise",
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "anchor": anchor,
            "geometry": geometry,
            "norm": norm,
            "norm_kwargs": norm_kwargs,
            "radius": radius,
            "g0": g0,
            "eps": eps,
            "proj_radius": proj_radius,
            "output": output,
            "nonfinite": nonfinite,
            "foreach": foreach,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after validating its options and its tensors against its norm."""
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except InputError:
            self.param_groups.pop()  # a refused group is not kept
            raise

    def _init_group(self, group: dict[str, Any]) -> list[Tensor]:
        if not group["params"]:
            return []
        need_s = group["anchor"] == "diagonal" or group["geometry"] == "mirror"
        params = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "y" not in state:
                state["y"] = p.detach().clone()
                state["z"] = p.detach().clone()
            if need_s and "s" not in state:
                state["s"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["output"] == "average" and "ybar" not in state:
                state["ybar"] = state["y"].clone()
            params.append(p)
        head = self.state[group["params"][0]]
        if "group_step" not in head:
            head["group_step"] = 0
            head["group_sumsq"] = 0.0
            head["group_alpha_sum"] = 0.0
        return params

    def _grads_finite(self) -> bool:
        """Check every gradient once (one synchronisation); raise or report per ``nonfinite``."""
        bad: list[str] = []
        for group in self.param_groups:
            indexed = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            for i, p in indexed:
                if p.grad.is_sparse:
                    raise InputError(
                        f"AcceleGradSharp does not support sparse gradients ({_name(group, i)})"
                    )
            if not indexed:
                continue
            # Norms of sharded gradients are reduced over the ranks, so all ranks agree.
            norms = [plain(n) for n in torch._foreach_norm([p.grad for _, p in indexed])]
            finite = torch.stack([n.isfinite().to(norms[0].device) for n in norms]).tolist()
            names = []
            for (i, p), ok in zip(indexed, finite, strict=True):
                if ok:
                    continue
                # a finite gradient whose norm overflows its dtype (|g| above ~1.8e19 in float32)
                # would make the step size 0 for good: skipped or raised too, under its own name
                big = bool(torch.linalg.vector_norm(p.grad, dtype=torch.float64).isfinite())
                what = f"gradient norm overflows {p.grad.dtype}" if big else "non-finite gradient"
                names.append(f"{what} in {_name(group, i)}")
            if names and group["nonfinite"] == "raise":
                raise FloatingPointError(", ".join(names))
            bad += names
        if bad:
            warnings.warn(
                f"AcceleGradSharp: skipped a step, {', '.join(bad)}",
                RuntimeWarning,
                stacklevel=3,
            )
        return not bad

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Take one step with the gradients in ``.grad`` (evaluated at the current parameters).

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The loss returned by ``closure``, or ``None``.

        Raises:
            FloatingPointError: On a NaN/Inf gradient in a group with ``nonfinite="raise"``.
            ValueError: On a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._grads_finite():
            return loss
        for group in self.param_groups:
            params = self._init_group(group)
            if params:
                self._group_step(group, params)
        return loss

    def _group_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        head = self.state[group["params"][0]]
        k = head["group_step"]
        alpha = accelegrad_alpha(k)
        two_d = 2.0 * group["lr"]
        geometry, anchor = group["geometry"], group["anchor"]
        foreach = group["foreach"]
        if foreach is None:
            foreach = all(p.is_cuda for p in params)
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        ys, zs = [st["y"] for st in states], [st["z"] for st in states]

        # One LMO / dual-norm evaluation per tensor (one Newton–Schulz call for matrices).
        dirs: list[Tensor] = []
        if anchor == "scalar" or geometry != "mirror":
            duals: list[Tensor] = []
            for p, g in zip(params, grads, strict=True):
                norm = _resolve_norm(group, p)
                if isinstance(norm, _lmo.Euclidean) and geometry == "sharp":
                    duals.append(plain(torch.linalg.vector_norm(g)))
                    dirs.append(g)
                    continue
                lmo, dual = norm.lmo_and_dual(g)
                duals.append(dual)
                if geometry == "sharp":
                    dirs.append(lmo.mul_(-dual.to(lmo.dtype)))
                elif geometry == "lmo":
                    clip = dual if group["radius"] is None else dual.clamp(max=group["radius"])
                    dirs.append(lmo.mul_(clip.to(lmo.dtype)))
            head["group_sumsq"] += alpha * alpha * _sum_sq(duals)
        eta = two_d / math.sqrt(group["g0"] ** 2 + head["group_sumsq"])

        denoms: list[Tensor] = []
        if "s" in states[0]:
            ss = [st["s"] for st in states]
            _addcmul_(foreach, ss, grads, alpha * alpha)
            denoms = _sqrt_add(foreach, ss, group["eps"])

        # Anchor (long step) z.
        if anchor == "scalar":
            _add_(foreach, zs, grads, -alpha * eta)
        else:
            _addcdiv_(foreach, zs, grads, denoms, -alpha * two_d)
        # With lr = 0 nothing moves, not even z onto the ball (checkpoint loaders step at lr 0).
        if group["proj_radius"] is not None and group["lr"] > 0:
            znorm = math.sqrt(_sum_sq(torch._foreach_norm(zs)))
            if znorm > group["proj_radius"]:
                _mul_(foreach, zs, group["proj_radius"] / znorm)

        # Geometry (short step) y from x.
        _copy_(foreach, ys, params)
        if geometry == "mirror":
            _addcdiv_(foreach, ys, grads, denoms, -two_d)
        elif geometry == "sharp":
            _add_(foreach, ys, dirs, -eta)
        else:
            _add_(foreach, ys, dirs, eta)

        # Weighted average, then the next coupling point x_{k+2} = lerp(y, z, tau_{k+1}).
        head["group_alpha_sum"] += alpha
        if group["output"] == "average":
            _lerp_(foreach, [st["ybar"] for st in states], ys, alpha / head["group_alpha_sum"])
        _copy_(foreach, params, ys)
        _lerp_(foreach, params, zs, 1.0 / accelegrad_alpha(k + 1))
        head["group_step"] = k + 1

    def swap_output(self) -> AbstractContextManager[Optimizer]:
        """Context manager putting each group's output (``y`` or ``ybar``) into the parameters.

        The coupling point ``x`` is restored bitwise on exit; parameters that never took a step
        are left alone.

        Examples:
            >>> import torch
            >>> w = torch.nn.Parameter(torch.ones(3))
            >>> opt = AcceleGradSharp([w], lr=0.1, output="average")
            >>> w.grad = torch.ones(3)
            >>> opt.step()
            >>> x = w.detach().clone()
            >>> with opt.swap_output():
            ...     pass
            >>> torch.equal(w, x)
            True
        """
        key = {}
        for group in self.param_groups:
            for p in group["params"]:
                key[p] = "ybar" if group["output"] == "average" else "y"
        return _Swap(self, lambda p, st: st.get(key[p]))


def _name(group: dict[str, Any], i: int) -> str:
    """Human name of the ``i``-th tensor of ``group`` (its name when given, else its index)."""
    names = group.get("param_names")
    shape = tuple(group["params"][i].shape)
    return f"parameter {names[i]!r} {shape}" if names else f"parameter #{i} {shape}"


def _resolve_norm(group: dict[str, Any], p: Tensor) -> _lmo.Norm:
    norm = group["norm"]
    if isinstance(norm, _lmo.Norm):
        return norm
    if norm is None:
        return _lmo.get_norm(_lmo.auto_norm(p))
    return _lmo.get_norm(norm, **(group["norm_kwargs"] or {}))


def _check_group(group: dict[str, Any]) -> None:
    """Raise ``InputError`` naming the first bad option or tensor of ``group``."""
    _validate(group)
    for i, p in enumerate(group["params"]):
        if p.is_complex() or not p.is_floating_point() or p.dtype == torch.float16:
            raise InputError(
                f"AcceleGradSharp needs real floating parameters other than float16 (whose "
                f"range does not hold sums of squared gradients), got {p.dtype} for "
                f"{_name(group, i)}; bfloat16 works, and so does Lightning's "
                "precision='16-mixed', which keeps float32 parameters"
            )
        try:
            _resolve_norm(group, p).check(p)
        except ValueError as err:
            raise InputError(f"{_name(group, i)}: {err}") from None


def _validate(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first bad option of ``group``."""
    check_positive("lr (the step scale D)", group["lr"])
    for key in ("radius", "proj_radius"):
        if group[key] is not None:
            check_positive(key, group[key], "or None")
    check_positive("g0", group["g0"])
    check_positive("eps", group["eps"])
    for key, allowed in (
        ("anchor", ANCHORS),
        ("geometry", GEOMETRIES),
        ("output", _OUTPUTS),
        ("nonfinite", _NONFINITE),
    ):
        if group[key] not in allowed:
            raise InputError(f"unknown {key} {group[key]!r}; allowed: {', '.join(allowed)}")
    norm = group["norm"]
    if not (norm is None or isinstance(norm, _lmo.Norm) or norm in _lmo.NORM_NAMES):
        raise InputError(f"unknown norm {norm!r}; allowed: None, {', '.join(_lmo.NORM_NAMES)}")
    norm_kwargs = group["norm_kwargs"]
    if norm_kwargs is not None and not isinstance(norm_kwargs, dict):
        raise InputError(f"norm_kwargs must be a dict or None, got {norm_kwargs!r}")
    if norm_kwargs and not isinstance(norm, str):
        raise InputError(f"norm_kwargs {norm_kwargs!r} needs a norm name, got norm={norm!r}")
    if group["foreach"] is not None and not isinstance(group["foreach"], bool):
        raise InputError(f"foreach must be None, true or false, got {group['foreach']!r}")


# Elementwise kernels: one torch._foreach_* call per list, or a loop of the same per-tensor ops.


def _add_(foreach: bool, xs: list[Tensor], ys: list[Tensor], alpha: float) -> None:
    if foreach:
        torch._foreach_add_(xs, ys, alpha=alpha)
    else:
        for x, y in zip(xs, ys, strict=True):
            x.add_(y, alpha=alpha)


def _addcmul_(foreach: bool, xs: list[Tensor], gs: list[Tensor], value: float) -> None:
    if foreach:
        torch._foreach_addcmul_(xs, gs, gs, value=value)
    else:
        for x, g in zip(xs, gs, strict=True):
            x.addcmul_(g, g, value=value)


def _addcdiv_(
    foreach: bool, xs: list[Tensor], gs: list[Tensor], ds: list[Tensor], value: float
) -> None:
    if foreach:
        torch._foreach_addcdiv_(xs, gs, ds, value=value)
    else:
        for x, g, d in zip(xs, gs, ds, strict=True):
            x.addcdiv_(g, d, value=value)


def _sqrt_add(foreach: bool, xs: list[Tensor], eps: float) -> list[Tensor]:
    if foreach:
        out = torch._foreach_sqrt(xs)
        torch._foreach_add_(out, eps)
        return list(out)
    return [x.sqrt().add_(eps) for x in xs]


def _mul_(foreach: bool, xs: list[Tensor], c: float) -> None:
    if foreach:
        torch._foreach_mul_(xs, c)
    else:
        for x in xs:
            x.mul_(c)


def _copy_(foreach: bool, dst: list[Tensor], src: list[Tensor]) -> None:
    if foreach:
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


def _lerp_(foreach: bool, xs: list[Tensor], ends: list[Tensor], weight: float) -> None:
    if foreach:
        torch._foreach_lerp_(xs, ends, weight)
    else:
        for x, e in zip(xs, ends, strict=True):
            x.lerp_(e, weight)
