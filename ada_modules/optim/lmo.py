"""Norms on parameter tensors with their dual norms, linear minimisation oracles and sharp operators.

Optimizers with per-layer geometry (Scion/uSCG, AcceleGrad#) need, for a norm ``‖·‖`` on one
parameter tensor,

- the **LMO** over the unit ball, ``lmo(g) = argmin_{‖v‖ ≤ 1} ⟨g, v⟩``, so that
  ``⟨g, lmo(g)⟩ = −‖g‖_*`` and ``‖lmo(g)‖ = 1`` (the sign convention of the Scion paper's tables:
  the LMO already points downhill);
- the **dual norm** ``‖g‖_* = sup_{‖v‖ ≤ 1} ⟨g, v⟩``;
- the **sharp operator** ``g^# = argmax_v ⟨g, v⟩ − ½‖v‖² = ‖g‖_* · (−lmo(g))``, the steepest-descent
  direction of the norm (``g^# = g`` for the Euclidean norm).

Every norm also has its primal :meth:`Norm.norm`, so the identities can be checked. The norms and
their scalings follow Scion (Pethick et al., 2025, "Training Deep Learning Models with
Norm-Constrained LMOs"); the unit balls are chosen so that ``lmo`` equals the direction Scion's code
uses, and dual norms are whatever makes ``⟨g, lmo(g)⟩ = −‖g‖_*`` hold exactly. Matrices ``[d_out,
d_in]`` are stored as in ``nn.Linear``.

| name | primal ``‖v‖`` | ``lmo(g)`` | dual ``‖g‖_*`` |
|---|---|---|---|
| ``euclidean`` | ``‖v‖_F`` | ``−g/‖g‖_F`` | ``‖g‖_F`` (``g^# = g``) |
| ``rms`` | ``‖v‖_F/√n`` (``n`` entries) | ``−√n g/‖g‖_F`` | ``√n ‖g‖_F`` |
| ``spectral`` | ``σ_max(v)/s``, ``s = √(d_out/d_in)`` | ``−s UVᵀ`` (Newton–Schulz) | ``s ‖g‖_nuclear`` |
| ``spectral_conv`` | spectral of ``[out, in·k]`` | ``s = √(out/in)/k``, ``k`` taps | as spectral |
| ``colnorm`` | ``max_j ‖v[:, j]‖₂/s`` | ``−s g[:, j]/‖g[:, j]‖₂`` | ``s Σ_j ‖g[:, j]‖₂`` |
| ``rownorm`` | ``max_i ‖v[i, :]‖₂/s`` | ``−s g[i, :]/‖g[i, :]‖₂`` | ``s Σ_i ‖g[i, :]‖₂`` |
| ``sign`` | ``max_ij abs(v_ij)/s`` | ``−s sign(g)`` | ``s ‖g‖₁`` |

The spectral norms use :func:`~ada_modules.optim.newton_schulz.newton_schulz` instead of an SVD:
``lmo(g) = −s·NS(g)`` and ``‖g‖_* ≈ s⟨g, NS(g)⟩`` from the *same* NS output, so
``⟨g, lmo(g)⟩ = −‖g‖_*`` holds to rounding, while ``‖lmo(g)‖`` and the nuclear-norm estimate are
within the NS band (singular values of ``NS(g)`` in roughly ``[0.68, 1.2]``). Tensors with more
than two dimensions are stacks of matrices for ``spectral`` (e.g. mixture-of-experts weights
``[E, out, in]``, one batched NS call): the primal norm is the largest block norm and the dual the
sum of the blocks' dual norms, the pair for which the LMO acts block by block.

Zero gradients give a zero LMO, a zero dual norm and a zero sharp direction, never NaN.
Half-precision inputs are computed in float32; ``lmo`` and ``sharp`` come back in the input dtype,
dual and primal norms as 0-d float tensors of at least float32 precision.

**Sharded tensors.** Every operation accepts a ``torch.distributed.tensor.DTensor`` (the parameters,
gradients and optimizer states of a model sharded with FSDP2's ``fully_shard`` or with tensor
parallelism) and returns what it returns for the full tensor: ``lmo`` and ``sharp`` as a
``DTensor`` placed like the input, dual and primal norms as ordinary 0-d tensors (the same value on
every rank). An operation that needs the whole tensor (the Newton–Schulz polar factor, column or
row norms, the RMS scaling) runs on ``full_tensor()`` (one all-gather) and each rank keeps its part
of the result, so it equals the unsharded result bit for bit. Operations listed in a norm's
:attr:`Norm.local_ops` (``sign``'s element-wise LMO, ``euclidean``'s copy as sharp direction and
the ``ℓ1``/``ℓ2``/max reductions of both) run on the local shards with one scalar all-reduce for a
norm; such a reduction sums in another order than on one device, so those norms agree with the
unsharded ones to rounding (relative ``~1e-7`` in float32), not bit for bit. Implicit
redistributions inside a Newton–Schulz iteration never happen. Custom subclasses get the same
treatment: their ``lmo_and_dual``, ``norm`` (and overridden ``lmo``, ``dual_norm``, ``sharp``) see
full tensors only, unless named in ``local_ops``.

Example:
    >>> import torch
    >>> g = torch.tensor([[3.0, -4.0], [0.0, 0.0]])
    >>> sign = get_norm("sign", normalized=False)
    >>> sign.lmo(g)
    tensor([[-1.,  1.],
            [-0., -0.]])
    >>> float(sign.dual_norm(g)), float(sign.norm(sign.lmo(g)))
    (7.0, 1.0)
    >>> auto_norm(torch.zeros(4, 3)), auto_norm(torch.zeros(3))
    ('spectral', 'rms')
"""

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from ada_modules.errors import InputError
from ada_modules.optim._dtensor import is_dtensor, plain, shard_like
from ada_modules.optim.newton_schulz import newton_schulz

__all__ = [
    "NORM_NAMES",
    "ColNorm",
    "Euclidean",
    "Norm",
    "RMS",
    "RowNorm",
    "Sign",
    "Spectral",
    "SpectralConv",
    "auto_norm",
    "get_norm",
]


def _work(t: Tensor) -> Tensor:
    """``t`` in a dtype fit for reductions: half precisions become float32."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _safe_divide(x: Tensor, norms: Tensor) -> Tensor:
    """``x / norms`` where the blocks with zero norm (hence zero ``x``) stay zero."""
    return x / norms.clamp_min(torch.finfo(norms.dtype).tiny)


# What each operation returns, per output: True for a tensor like its input, False for a 0-d norm.
_RESULTS: dict[str, tuple[bool, ...]] = {
    "lmo_and_dual": (True, False),
    "lmo": (True,),
    "sharp": (True,),
    "dual_norm": (False,),
    "norm": (False,),
}


def _dtensor_aware(method: Callable[[Any, Tensor], Any]) -> Callable[[Any, Tensor], Any]:
    """Run a norm operation on a ``DTensor`` as on its full tensor (see the module docstring).

    Operations in the norm's ``local_ops`` see the ``DTensor`` itself; the others its
    ``full_tensor()``. Results like the input come back placed like it, 0-d norms as ordinary
    tensors. Nested calls (``sharp`` calling ``lmo_and_dual``) see ordinary tensors, so a tensor is
    gathered once per outer call.
    """
    op = method.__name__

    @functools.wraps(method)
    def wrapper(self: "Norm", *args: Tensor, **kwargs: Tensor) -> Any:
        t = args[0] if args else next(iter(kwargs.values()), None)
        if not is_dtensor(t):
            return method(self, *args, **kwargs)
        out = method(self, t if op in self.local_ops else t.full_tensor())
        outs = out if isinstance(out, tuple) else (out,)
        mapped = tuple(
            (o if is_dtensor(o) else shard_like(o, t)) if like else plain(o)
            for o, like in zip(outs, _RESULTS[op], strict=True)
        )
        return mapped if isinstance(out, tuple) else mapped[0]

    wrapper._dtensor_aware = True  # type: ignore[attr-defined]
    return wrapper


class Norm(ABC):
    """A norm on one parameter tensor with its dual norm, LMO and sharp operator.

    Subclasses implement :meth:`lmo_and_dual` and :meth:`norm`; the other operations derive from
    them. Norm objects hold only options, never shapes, so one instance serves every parameter.
    Every operation takes ``DTensor``s too (sharded parameters, see the module docstring): the
    methods a subclass defines are wrapped so that they see full tensors, except those named in
    :attr:`local_ops`.

    Examples:
        >>> import torch
        >>> norm = get_norm("euclidean")
        >>> g = torch.tensor([3.0, 4.0])
        >>> norm.lmo(g), float(norm.dual_norm(g))
        (tensor([-0.6000, -0.8000]), 5.0)
        >>> torch.equal(norm.sharp(g), g)
        True
    """

    name: ClassVar[str]
    """Registry name, as accepted by :func:`get_norm`."""
    min_ndim: ClassVar[int] = 0
    """Fewest dimensions a supported tensor has."""
    max_ndim: ClassVar[int | None] = None
    """Most dimensions a supported tensor has (``None``: no limit)."""
    hint: ClassVar[str] = ""
    """Advice appended to the shape error."""
    local_ops: ClassVar[frozenset[str]] = frozenset()
    """Operations that run on a ``DTensor`` itself, with ``DTensor``'s own kernels: element-wise
    ones (bitwise equal to the unsharded result) and reductions to a scalar (one all-reduce; equal
    to rounding). The others run on ``full_tensor()``. Subclasses inherit it: a subclass that
    overrides one of these operations with a non-local computation must leave it out."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for op in _RESULTS:
            method = cls.__dict__.get(op)
            if callable(method) and not getattr(method, "_dtensor_aware", False):
                setattr(cls, op, _dtensor_aware(method))

    def check(self, param: Tensor) -> None:
        """Raise if this norm does not apply to ``param``'s shape or dtype.

        Raises:
            ValueError: If the number of dimensions is unsupported (the message names the norm
                and the shape).
            TypeError: If ``param`` is not a real floating tensor (complex, integer).
        """
        if param.is_complex() or not param.is_floating_point():
            raise InputError(
                f"norm {self.name!r} needs a real floating tensor, got dtype {param.dtype}"
            )
        too_big = self.max_ndim is not None and param.ndim > self.max_ndim
        if param.ndim < self.min_ndim or too_big:
            wanted = (
                f"exactly {self.min_ndim}"
                if self.min_ndim == self.max_ndim
                else f">= {self.min_ndim}"
            )
            raise InputError(
                f"norm {self.name!r} needs a tensor with {wanted} dimensions, got shape "
                f"{tuple(param.shape)}{self.hint}"
            )

    @abstractmethod
    def lmo_and_dual(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """``(lmo(g), dual_norm(g))`` computed together (one Newton–Schulz call for matrices)."""

    @abstractmethod
    def norm(self, v: Tensor) -> Tensor:
        """Primal norm ``‖v‖`` as a 0-d tensor."""

    @_dtensor_aware
    def lmo(self, g: Tensor) -> Tensor:
        """``argmin_{‖v‖ ≤ 1} ⟨g, v⟩``, so that ``⟨g, lmo(g)⟩ = −‖g‖_*``; shape and dtype of ``g``."""
        return self.lmo_and_dual(g)[0]

    @_dtensor_aware
    def dual_norm(self, g: Tensor) -> Tensor:
        """Dual norm ``‖g‖_* = sup_{‖v‖ ≤ 1} ⟨g, v⟩`` as a 0-d tensor."""
        return self.lmo_and_dual(g)[1]

    @_dtensor_aware
    def sharp(self, g: Tensor) -> Tensor:
        """Sharp operator ``g^# = ‖g‖_* · (−lmo(g))``; shape and dtype of ``g``."""
        lmo, dual = self.lmo_and_dual(g)
        return (lmo.to(dual.dtype) * -dual).to(g.dtype)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({options})"


class _BlockL2(Norm):
    """Scaled ℓ2 norms of blocks: ``‖v‖ = max_b ‖v_b‖₂ / s`` with dual ``s Σ_b ‖g_b‖₂``."""

    def _oriented(self, t: Tensor) -> Tensor:
        """``t`` as the layout whose blocks :meth:`_dims` reduces over."""
        return t

    def _dims(self, t: Tensor) -> tuple[int, ...] | None:
        """Dimensions of one block (``None``: the whole tensor is one block)."""
        return None

    @abstractmethod
    def _scale(self, t: Tensor) -> float:
        """Radius ``s`` of the unit ball in the blocks' ℓ2 norm."""

    def _block_norms(self, t: Tensor) -> Tensor:
        return torch.linalg.vector_norm(t, dim=self._dims(t), keepdim=True)

    def lmo_and_dual(self, g: Tensor) -> tuple[Tensor, Tensor]:
        self.check(g)
        x = self._oriented(_work(g))
        norms = self._block_norms(x)
        scale = self._scale(x)
        lmo = _safe_divide(x, norms) * -scale
        return self._oriented(lmo).to(g.dtype), norms.sum() * scale

    def dual_norm(self, g: Tensor) -> Tensor:
        self.check(g)
        x = self._oriented(_work(g))
        return self._block_norms(x).sum() * self._scale(x)

    def norm(self, v: Tensor) -> Tensor:
        self.check(v)
        x = self._oriented(_work(v))
        return self._block_norms(x).amax() / self._scale(x)


class Euclidean(_BlockL2):
    """Frobenius (ℓ2) norm, self-dual: ``lmo(g) = −g/‖g‖``, ``‖g‖_* = ‖g‖``, ``g^# = g``.

    The plain-gradient geometry: AcceleGrad's and SGD's. :meth:`sharp` returns a copy of ``g``
    bit for bit (no divide-and-multiply rounding).
    """

    name = "euclidean"
    local_ops = frozenset({"sharp", "dual_norm", "norm"})

    def _scale(self, t: Tensor) -> float:
        return 1.0

    def sharp(self, g: Tensor) -> Tensor:
        self.check(g)
        return g.clone()


class RMS(_BlockL2):
    """Root-mean-square norm ``‖v‖_F/√n``, for biases and gains (Scion's ``BiasRMS``).

    ``lmo(g) = −√n g/‖g‖_F`` has entries of RMS one; ``‖g‖_* = √n ‖g‖_F``.

    Examples:
        >>> import torch
        >>> RMS().lmo(torch.tensor([1.0, 0.0, 0.0, 0.0]))
        tensor([-2., -0., -0., -0.])
    """

    name = "rms"

    def _scale(self, t: Tensor) -> float:
        return math.sqrt(t.numel())


class ColNorm(_BlockL2):
    """Largest column ℓ2 norm, for input layers and embeddings (Scion's ``ColNorm``).

    Each column ``g[:, j]`` (the weights of input feature ``j`` in a ``[d_out, d_in]`` matrix) is
    normalised to ℓ2 length ``s``: ``lmo(g)[:, j] = −s g[:, j]/‖g[:, j]‖₂`` and
    ``‖g‖_* = s Σ_j ‖g[:, j]‖₂``.

    Args:
        normalized: ``False`` (default, as in Scion's code): ``s = 1``. ``True``: ``s = √d_out``,
            so that each column has RMS one (the ``ℓ1 → RMS`` operator norm of the Scion paper).
        transpose: Normalise rows instead, for ``nn.Embedding`` weights ``[vocab, dim]`` whose
            rows are the token vectors (then ``d_out = dim``).

    Examples:
        >>> import torch
        >>> ColNorm().lmo(torch.tensor([[3.0, 0.0], [4.0, 0.0]]))
        tensor([[-0.6000, -0.0000],
                [-0.8000, -0.0000]])
    """

    name = "colnorm"
    min_ndim = 2
    max_ndim = 2
    hint = "; use 'rms' or 'sign' for 1-D parameters"

    def __init__(self, normalized: bool = False, transpose: bool = False) -> None:
        self.normalized = normalized
        self.transpose = transpose

    def _oriented(self, t: Tensor) -> Tensor:
        return t.mT if self.transpose else t

    def _dims(self, t: Tensor) -> tuple[int, ...]:
        return (0,)

    def _scale(self, t: Tensor) -> float:
        return math.sqrt(t.shape[0]) if self.normalized else 1.0


class RowNorm(_BlockL2):
    """Largest row ℓ2 norm (Scion's ``RowNorm``), the ``RMS → ℓ∞`` operator norm by default.

    Each row is normalised to ℓ2 length ``s``: ``lmo(g)[i, :] = −s g[i, :]/‖g[i, :]‖₂`` and
    ``‖g‖_* = s Σ_i ‖g[i, :]‖₂``.

    Args:
        normalized: ``True`` (default, as in Scion): ``s = 1/√d_in``, so that ``‖v‖`` is the
            ``RMS → ℓ∞`` operator norm. ``False``: ``s = 1``.
        transpose: Normalise columns instead (then ``d_in`` is the number of rows).
    """

    name = "rownorm"
    min_ndim = 2
    max_ndim = 2
    hint = "; use 'rms' or 'sign' for 1-D parameters"

    def __init__(self, normalized: bool = True, transpose: bool = False) -> None:
        self.normalized = normalized
        self.transpose = transpose

    def _oriented(self, t: Tensor) -> Tensor:
        return t.mT if self.transpose else t

    def _dims(self, t: Tensor) -> tuple[int, ...]:
        return (1,)

    def _scale(self, t: Tensor) -> float:
        return 1.0 / math.sqrt(t.shape[1]) if self.normalized else 1.0


class Sign(Norm):
    """Scaled max-entry (ℓ∞) norm ``max |v_ij| / s``, for output heads (Scion's ``Sign``).

    ``lmo(g) = −s sign(g)`` (signSGD's direction) and ``‖g‖_* = s ‖g‖₁``.

    Args:
        normalized: ``True`` (default, as in Scion): ``s = 1/fan_in`` with ``fan_in`` the product
            of all dimensions but the first (``1`` for 0-D and 1-D tensors). ``False``: ``s = 1``.
    """

    name = "sign"
    local_ops = frozenset({"lmo", "dual_norm", "norm", "lmo_and_dual", "sharp"})

    def __init__(self, normalized: bool = True) -> None:
        self.normalized = normalized

    def _scale(self, t: Tensor) -> float:
        if not self.normalized or t.ndim < 2:
            return 1.0
        return 1.0 / math.prod(t.shape[1:])

    def lmo(self, g: Tensor) -> Tensor:
        self.check(g)
        x = _work(g)
        return (torch.sign(x) * -self._scale(x)).to(g.dtype)

    def lmo_and_dual(self, g: Tensor) -> tuple[Tensor, Tensor]:
        return self.lmo(g), self.dual_norm(g)

    def dual_norm(self, g: Tensor) -> Tensor:
        self.check(g)
        x = _work(g)
        return x.abs().sum() * self._scale(x)

    def norm(self, v: Tensor) -> Tensor:
        self.check(v)
        x = _work(v)
        return x.abs().amax() / self._scale(x)


class Spectral(Norm):
    """Scaled spectral (operator) norm ``σ_max(v) / s`` with ``s = √(d_out/d_in)``, for hidden weights.

    ``s`` is Scion's width scaling: it makes the norm the ``RMS → RMS`` operator norm, so that the
    LMO's update size transfers across widths. ``lmo(g) = −s U Vᵀ`` (``g = U Σ Vᵀ``) and
    ``‖g‖_* = s ‖g‖_nuclear``, both from one Newton–Schulz call: ``lmo(g) = −s NS(g)``,
    ``‖g‖_* = s ⟨g, NS(g)⟩``. Tensors with more than two dimensions are stacks of matrices over the
    last two dimensions (mixture-of-experts weights ``[E, out, in]``), orthogonalised in one batched
    call; then ``‖v‖`` is the largest block norm and ``‖g‖_*`` the sum over blocks.

    Args:
        steps: Newton–Schulz iterations.
        eps: Newton–Schulz's Frobenius-norm guard.
        dtype: Newton–Schulz's computation dtype (``None``: float32, float64 for float64
            tensors; ``torch.bfloat16`` is faster on CUDA).

    Examples:
        >>> import torch
        >>> g = torch.diag(torch.tensor([2.0, 1.0]))
        >>> norm = Spectral(steps=10)
        >>> lmo, dual = norm.lmo_and_dual(g)
        >>> bool(torch.allclose(-(g * lmo).sum(), dual))
        True
    """

    name = "spectral"
    min_ndim = 2
    hint = (
        "; the spectral norm applies to matrices (or stacks of them): use 'rms' or 'sign' for "
        "biases and gains"
    )

    def __init__(self, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype | None = None) -> None:
        if not isinstance(steps, int) or steps < 1:
            raise InputError(f"steps must be an integer >= 1, got {steps!r}")
        self.steps = steps
        self.eps = eps
        self.dtype = dtype

    def _matrices(self, t: Tensor) -> Tensor:
        """``t`` as a matrix or a stack of matrices."""
        return t

    def _scale(self, shape: torch.Size) -> float:
        return math.sqrt(shape[-2] / shape[-1])

    def lmo_and_dual(self, g: Tensor) -> tuple[Tensor, Tensor]:
        self.check(g)
        m = self._matrices(_work(g))
        scale = self._scale(g.shape)
        polar = newton_schulz(m, steps=self.steps, eps=self.eps, dtype=self.dtype)
        dual = (m * polar).sum() * scale
        return (polar * -scale).reshape(g.shape).to(g.dtype), dual

    def norm(self, v: Tensor) -> Tensor:
        self.check(v)
        m = self._matrices(_work(v))
        return torch.linalg.matrix_norm(m, ord=2).amax() / self._scale(v.shape)


class SpectralConv(Spectral):
    """Spectral norm of a convolution weight ``[out, in, *kernel]`` seen as ``[out, in·k]``.

    Scion's ``SpectralConv`` scaling: ``s = √(out/in) / k`` with ``in`` the input channels (per
    group) and ``k`` the number of kernel taps (``k_h·k_w`` for 2-D kernels), so that the update
    of the summed-over-taps operator keeps the ``RMS → RMS`` size of :class:`Spectral`. Otherwise
    as :class:`Spectral` with one matrix per tensor.
    """

    name = "spectral_conv"
    min_ndim = 3
    hint = "; use 'spectral' for 2-D weights and 'rms' or 'sign' for 1-D parameters"

    def _matrices(self, t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], -1)

    def _scale(self, shape: torch.Size) -> float:
        return math.sqrt(shape[0] / shape[1]) / math.prod(shape[2:])


_NORMS: dict[str, type[Norm]] = {
    cls.name: cls for cls in (Euclidean, Spectral, SpectralConv, ColNorm, RowNorm, Sign, RMS)
}
NORM_NAMES: tuple[str, ...] = tuple(_NORMS)
"""Names accepted by :func:`get_norm`."""

# A Norm instance in a param group goes into the optimizer's state_dict: let torch.load's
# weights_only unpickler (Lightning's resume) rebuild it (its fields are numbers and a dtype).
torch.serialization.add_safe_globals(list(_NORMS.values()))


def get_norm(name: str, **kwargs: Any) -> Norm:
    """Build the norm registered under ``name`` with its options.

    Args:
        name: One of :data:`NORM_NAMES`.
        **kwargs: The norm class's options (e.g. ``transpose=True`` for ``"colnorm"``).

    Raises:
        ValueError: If ``name`` is unknown (the message lists the allowed names).
        TypeError: If an option is not one of the norm's.

    Examples:
        >>> get_norm("colnorm", transpose=True)
        ColNorm(normalized=False, transpose=True)
    """
    if name not in _NORMS:
        raise InputError(f"unknown norm {name!r}; allowed: {', '.join(NORM_NAMES)}")
    return _NORMS[name](**kwargs)


def auto_norm(param: Tensor) -> str:
    """Default norm name for a parameter, by its number of dimensions (Scion's ``Auto``).

    ``>= 3`` dimensions: ``"spectral_conv"`` (convolution weights; pass ``"spectral"`` explicitly
    for stacks of expert matrices ``[E, out, in]``); 2: ``"spectral"``; 0 or 1: ``"rms"``.
    Embeddings and output heads are 2-D too: give them ``"colnorm"``/``"sign"`` explicitly.

    Examples:
        >>> import torch
        >>> auto_norm(torch.zeros(8, 3, 3, 3))
        'spectral_conv'
    """
    if param.ndim >= 3:
        return "spectral_conv"
    if param.ndim == 2:
        return "spectral"
    return "rms"
