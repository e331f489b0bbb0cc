"""Routed sum ``sum_j c_j * x_j`` over same-shaped states: ANCRe's shortcuts in one pass.

Each routed layer of :class:`~ada_modules.nn.ConnectivityRouter` mixes up to ``K + 1`` earlier
states with learned coefficients, one per state (``coeffs`` shaped ``(n,)`` or ``(n, 1)``) or one
per state and channel (``(n, C)``, the channels along ``channel_dim``). The reference does it term
by term, as autograd sees it: ``n - 1`` ``addcmul`` passes forward, and backward a product and a
reduction per term. The kernels read each state once:

* forward, ``_routed_sum_forward_kernel``: up to 8 states per launch, accumulated in fp32 and
  written once (more states: further launches add to an fp32 buffer);
* backward, ``_routed_sum_backward_kernel``: reads the output gradient ``g`` once per launch and
  each state once, writes ``dx_j = c_j * g`` and, per program, partial sums of ``g * x_j`` that
  torch reduces to the coefficient gradients.

The kernel accumulates in fp32 with fp32 coefficients, while the reference computes in the states'
dtype, so the two agree to rounding (exactly for one-hot or zero coefficients: a routed stack is
still bitwise the residual stack at init). ``routed_sum`` is differentiable with either ``impl``.
"""

# Triton reads argument annotations as types and specialisations, so kernel arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import Impl, resolve_impl, triton_available

__all__ = ["routed_sum", "routed_sum_reference"]

_STATES_PER_LAUNCH = 8  # the kernels take this many state pointers (unused ones are never read)
_TILE = 4096  # elements per program
_MAX_BLOCK_C = 256
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _tile(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # this program's (BLOCK_R, BLOCK_C) tile of the (n_rows, n_cols) view: indices, masks
        # and element offsets
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        rmask = rows < n_rows
        cmask = cols < n_cols
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        return rows, cols, rmask, cmask, mask, offs

    @triton.jit
    def _coefficient(c_ptr, j, n_coef, rows, cols, rmask, cmask, COEF_ON_ROWS: tl.constexpr):
        # (BLOCK_R, 1) coefficients of the rows (channels before the last dimension) or
        # (1, BLOCK_C) of the columns (channels last; n_coef = 1 for one coefficient per state)
        if COEF_ON_ROWS:
            c = tl.load(c_ptr + j * n_coef + rows % n_coef, mask=rmask, other=0.0)[:, None]
        else:
            c = tl.load(c_ptr + j * n_coef + cols % n_coef, mask=cmask, other=0.0)[None, :]
        return c

    @triton.jit
    def _add_term(acc, x_ptr, c_ptr, j, n_coef, rows, cols, rmask, cmask, offs, mask, COEF_ON_ROWS):
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return acc + _coefficient(c_ptr, j, n_coef, rows, cols, rmask, cmask, COEF_ON_ROWS) * x

    @triton.jit
    def _routed_sum_forward_kernel(
        out_ptr,
        c_ptr,
        x0,
        x1,
        x2,
        x3,
        x4,
        x5,
        x6,
        x7,
        n_rows,
        n_cols,
        n_coef,
        NUM: tl.constexpr,
        ACCUMULATE: tl.constexpr,
        COEF_ON_ROWS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        rows, cols, rmask, cmask, mask, offs = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
        if ACCUMULATE:
            acc = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        args = (n_coef, rows, cols, rmask, cmask, offs, mask)
        acc = _add_term(acc, x0, c_ptr, 0, *args, COEF_ON_ROWS)
        if NUM > 1:
            acc = _add_term(acc, x1, c_ptr, 1, *args, COEF_ON_ROWS)
        if NUM > 2:
            acc = _add_term(acc, x2, c_ptr, 2, *args, COEF_ON_ROWS)
        if NUM > 3:
            acc = _add_term(acc, x3, c_ptr, 3, *args, COEF_ON_ROWS)
        if NUM > 4:
            acc = _add_term(acc, x4, c_ptr, 4, *args, COEF_ON_ROWS)
        if NUM > 5:
            acc = _add_term(acc, x5, c_ptr, 5, *args, COEF_ON_ROWS)
        if NUM > 6:
            acc = _add_term(acc, x6, c_ptr, 6, *args, COEF_ON_ROWS)
        if NUM > 7:
            acc = _add_term(acc, x7, c_ptr, 7, *args, COEF_ON_ROWS)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_term(
        g,
        x_ptr,
        dx_ptr,
        c_ptr,
        part_ptr,
        j,
        part_stride,
        n_coef,
        n_cols,
        rows,
        cols,
        rmask,
        cmask,
        offs,
        mask,
        COEF_ON_ROWS: tl.constexpr,
        NEED_DC: tl.constexpr,
    ):
        c = _coefficient(c_ptr, j, n_coef, rows, cols, rmask, cmask, COEF_ON_ROWS)
        tl.store(dx_ptr + offs, (c * g).to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DC:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            part = part_ptr + j * part_stride
            if COEF_ON_ROWS:  # partial[j, row, program column]
                s = tl.sum(g * x, axis=1)
                tl.store(part + rows * tl.num_programs(1) + tl.program_id(1), s, mask=rmask)
            elif n_coef == 1:  # partial[j, program row, program column]
                program = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
                tl.store(part + program, tl.sum(tl.sum(g * x, axis=1), axis=0))
            else:  # partial[j, program row, column]
                s = tl.sum(g * x, axis=0)
                tl.store(part + tl.program_id(0).to(tl.int64) * n_cols + cols, s, mask=cmask)

    @triton.jit
    def _routed_sum_backward_kernel(
        g_ptr,
        c_ptr,
        part_ptr,
        x0,
        x1,
        x2,
        x3,
        x4,
        x5,
        x6,
        x7,
        dx0,
        dx1,
        dx2,
        dx3,
        dx4,
        dx5,
        dx6,
        dx7,
        part_stride,
        n_rows,
        n_cols,
        n_coef,
        NUM: tl.constexpr,
        COEF_ON_ROWS: tl.constexpr,
        NEED_DC: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        rows, cols, rmask, cmask, mask, offs = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        args = (part_stride, n_coef, n_cols, rows, cols, rmask, cmask, offs, mask)
        _backward_term(g, x0, dx0, c_ptr, part_ptr, 0, *args, COEF_ON_ROWS, NEED_DC)
        if NUM > 1:
            _backward_term(g, x1, dx1, c_ptr, part_ptr, 1, *args, COEF_ON_ROWS, NEED_DC)
        if NUM > 2:
            _backward_term(g, x2, dx2, c_ptr, part_ptr, 2, *args, COEF_ON_ROWS, NEED_DC)
        if NUM > 3:
            _backward_term(g, x3, dx3, c_ptr, part_ptr, 3, *args, COEF_ON_ROWS, NEED_DC)
        if NUM > 4:
            _backward_term(g, x4, dx4, c_ptr, part_ptr, 4, *args, COEF_ON_ROWS, NEED_DC)
        if NUM > 5:
            _backward_term(g, x5, dx5, c_ptr, part_ptr, 5, *args, COEF_ON_ROWS, NEED_DC)
        if NUM > 6:
            _backward_term(g, x6, dx6, c_ptr, part_ptr, 6, *args, COEF_ON_ROWS, NEED_DC)
        if NUM > 7:
            _backward_term(g, x7, dx7, c_ptr, part_ptr, 7, *args, COEF_ON_ROWS, NEED_DC)


def _coefficient_shape(coeffs: torch.Tensor, like: torch.Tensor, channel_dim: int) -> list[int]:
    """The shape that broadcasts one state's coefficients against a state."""
    shape = [1] * like.ndim
    if coeffs.ndim == 2 and coeffs.shape[1] > 1:
        shape[channel_dim] = coeffs.shape[1]
    return shape


def _check(states: Sequence[torch.Tensor], coeffs: torch.Tensor, channel_dim: int) -> None:
    if isinstance(states, torch.Tensor) or not isinstance(states, Sequence) or not states:
        raise InputError(
            f"states must be a non-empty sequence of tensors, got {type(states).__name__}"
        )
    first = states[0]
    for j, state in enumerate(states):
        if not isinstance(state, torch.Tensor):
            raise InputError(f"states[{j}] must be a torch.Tensor, got {type(state).__name__}")
        if not state.is_floating_point():
            raise InputError(f"states[{j}] must be floating-point, got {state.dtype}")
        if (state.shape, state.dtype, state.device) != (first.shape, first.dtype, first.device):
            raise InputError(
                f"states[{j}] is {tuple(state.shape)} {state.dtype} on {state.device}; every state "
                f"must match states[0]: {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    if not isinstance(coeffs, torch.Tensor) or not coeffs.is_floating_point():
        raise InputError(f"coeffs must be a floating-point tensor, got {coeffs!r}")
    if coeffs.ndim not in (1, 2) or coeffs.shape[0] != len(states):
        raise InputError(
            f"coeffs must have shape ({len(states)},) or ({len(states)}, channels), one row per "
            f"state, got {tuple(coeffs.shape)}"
        )
    if coeffs.ndim == 2 and coeffs.shape[1] > 1:
        if not -first.ndim <= channel_dim < first.ndim:
            raise InputError(
                f"channel_dim must be in [{-first.ndim}, {first.ndim}) for states of shape "
                f"{tuple(first.shape)}, got {channel_dim}"
            )
        if first.shape[channel_dim] != coeffs.shape[1]:
            raise InputError(
                f"coeffs has {coeffs.shape[1]} channels but the states have "
                f"{first.shape[channel_dim]} along channel_dim={channel_dim}"
            )


def routed_sum_reference(
    states: Sequence[torch.Tensor], coeffs: torch.Tensor, channel_dim: int = -1
) -> torch.Tensor:
    """``sum_j coeffs[j] * states[j]`` term by term in the states' dtype (the specification).

    Args:
        states: ``n`` tensors of one shape and dtype.
        coeffs: ``(n,)`` or ``(n, 1)`` (one coefficient per state) or ``(n, C)`` (one per state
            and channel); cast to the states' dtype.
        channel_dim: Dimension of the ``C`` channels in the states (per-channel ``coeffs``).

    Returns:
        A tensor shaped like each state.

    Examples:
        >>> x = [torch.ones(2, 3), torch.full((2, 3), 2.0)]
        >>> routed_sum_reference(x, torch.tensor([0.5, -1.0]))[0].tolist()
        [-1.5, -1.5, -1.5]
    """
    like = states[0]
    shape = _coefficient_shape(coeffs, like, channel_dim)
    coeffs = coeffs.to(like.dtype)
    total = states[0] * coeffs[0].reshape(shape)
    # Without autograd (inference, or inside the deferred-gradient row), add in place: the same
    # arithmetic without a new tensor per term. Mixed dtypes promote, so they stay out of place.
    in_place = not torch.is_grad_enabled() and all(s.dtype == total.dtype for s in states)
    for state, c in zip(states[1:], coeffs[1:], strict=True):
        if in_place:
            total.addcmul_(state, c.reshape(shape))
        else:
            total = torch.addcmul(total, state, c.reshape(shape))
    return total


def _layout(shape: torch.Size, width: int, channel_dim: int) -> tuple[int, int, bool]:
    """``(rows, cols, coefficients on rows)``: the 2-D view the kernels use.

    One coefficient per state, or channels last: rows of the last dimension, coefficients indexed
    by column. Channels before the last dimension: rows of ``prod(shape[channel_dim + 1:])``
    elements, each row within one channel (``row % C``).
    """
    numel = math.prod(shape)
    ndim = len(shape)
    if width == 1 or channel_dim % ndim == ndim - 1:
        cols = shape[-1] if ndim else 1
        return numel // max(cols, 1), cols, False
    cols = math.prod(shape[channel_dim % ndim + 1 :])
    return numel // max(cols, 1), cols, True


def _launch(n_rows: int, n_cols: int) -> tuple[int, int, tuple[int, int]]:
    """``(BLOCK_R, BLOCK_C, grid)`` of the kernels for an ``(n_rows, n_cols)`` view."""
    block_c = min(max(triton.next_power_of_2(n_cols), 16), _MAX_BLOCK_C)
    block_r = _TILE // block_c
    return block_r, block_c, (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(s, min(s + _STATES_PER_LAUNCH, n)) for s in range(0, n, _STATES_PER_LAUNCH)]


def _pointers(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Exactly ``_STATES_PER_LAUNCH`` pointer arguments; the unused ones repeat the first."""
    return list(tensors) + [tensors[0]] * (_STATES_PER_LAUNCH - len(tensors))


def _forward_triton(
    states: Sequence[torch.Tensor], coeffs: torch.Tensor, layout: tuple[int, int, bool]
) -> torch.Tensor:
    n_rows, n_cols, on_rows = layout
    like = states[0]
    chunks = _chunks(len(states))
    # several launches add up in fp32; one launch writes the states' dtype directly
    out_dtype = like.dtype if len(chunks) == 1 else torch.float32
    out = torch.empty(like.shape, dtype=out_dtype, device=like.device)
    block_r, block_c, grid = _launch(n_rows, n_cols)
    for k, (start, stop) in enumerate(chunks):
        _routed_sum_forward_kernel[grid](
            out,
            coeffs[start:stop],
            *_pointers(states[start:stop]),
            n_rows,
            n_cols,
            coeffs.shape[1],
            NUM=stop - start,
            ACCUMULATE=k > 0,
            COEF_ON_ROWS=on_rows,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
        )
    return out.to(like.dtype)


def _backward_triton(
    grad: torch.Tensor,
    states: Sequence[torch.Tensor],
    coeffs: torch.Tensor,
    layout: tuple[int, int, bool],
    need_dc: bool,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    n_rows, n_cols, on_rows = layout
    block_r, block_c, grid = _launch(n_rows, n_cols)
    n = len(states)
    width = coeffs.shape[1]
    if on_rows:
        part_shape = (n, n_rows, grid[1])
    else:
        part_shape = (n, grid[0], grid[1] if width == 1 else n_cols)
    part = torch.empty(part_shape if need_dc else (1,), dtype=torch.float32, device=grad.device)
    dxs = [torch.empty_like(state) for state in states]
    for start, stop in _chunks(n):
        _routed_sum_backward_kernel[grid](
            grad,
            coeffs[start:stop],
            part[start:stop] if need_dc else part,
            *_pointers(states[start:stop]),
            *_pointers(dxs[start:stop]),
            part.stride(0),
            n_rows,
            n_cols,
            coeffs.shape[1],
            NUM=stop - start,
            COEF_ON_ROWS=on_rows,
            NEED_DC=need_dc,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
        )
    if not need_dc:
        return dxs, None
    if on_rows:  # rows run over (outer, channel)
        return dxs, part.view(n, n_rows // width, width, -1).sum(dim=(1, 3))
    if width == 1:
        return dxs, part.sum(dim=(1, 2)).unsqueeze(1)
    return dxs, part.sum(dim=1)


class _RoutedSum(torch.autograd.Function):
    """The Triton routed sum, forward and backward (coefficients as ``(n, C)``, fp32 inside).

    Differentiable once: a double backward (e.g. a gradient penalty) raises instead of silently
    missing terms; use ``impl="torch"`` for it.
    """

    @staticmethod
    def forward(ctx, coeffs: torch.Tensor, channel_dim: int, *states: torch.Tensor) -> torch.Tensor:
        layout = _layout(states[0].shape, coeffs.shape[1], channel_dim)
        states = tuple(s.contiguous() for s in states)
        c32 = coeffs.detach().float().contiguous()
        ctx.save_for_backward(c32, *states)
        ctx.layout = layout
        ctx.coeff_dtype = coeffs.dtype
        return _forward_triton(states, c32, layout)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        c32, *states = ctx.saved_tensors
        need_dc = ctx.needs_input_grad[0]
        dxs, dc = _backward_triton(grad.contiguous(), states, c32, ctx.layout, need_dc)
        dc = None if dc is None else dc.to(ctx.coeff_dtype)
        dxs = [dx if need else None for dx, need in zip(dxs, ctx.needs_input_grad[2:], strict=True)]
        return (dc, None, *dxs)


def routed_sum(
    states: Sequence[torch.Tensor],
    coeffs: torch.Tensor,
    channel_dim: int = -1,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``sum_j coeffs[j] * states[j]``, differentiable in the states and the coefficients.

    Args:
        states: ``n`` floating-point tensors of one shape, dtype and device (any strides); the
            kernels take fp32, fp16 and bf16 (``"auto"`` runs float64 in torch).
        coeffs: ``(n,)`` or ``(n, 1)`` (one coefficient per state) or ``(n, C)`` (one per state
            and channel, the ``C`` channels along ``channel_dim``), on the states' device.
        channel_dim: Dimension of the channels in the states (per-channel ``coeffs`` only).
        impl: ``"auto"`` (the Triton kernels on CUDA tensors, torch otherwise), ``"triton"`` or
            ``"torch"`` (:func:`routed_sum_reference`).

    Returns:
        A tensor shaped like each state, in their dtype.

    Raises:
        ValueError: If the states differ in shape, dtype or device, ``coeffs`` has the wrong
            shape, ``channel_dim`` is out of range, or ``impl`` cannot run (see
            :func:`~ada_modules.kernels.resolve_impl`), naming the value.

    Examples:
        >>> x = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
        >>> c = torch.tensor([0.2, 0.3, 0.5], requires_grad=True)
        >>> out = routed_sum(x, c)
        >>> out.sum().backward()
        >>> tuple(out.shape), tuple(c.grad.shape)
        ((4, 8), (3,))
    """
    _check(states, coeffs, channel_dim)
    use_torch = resolve_impl(impl, *states, coeffs) == "torch" or states[0].numel() == 0
    if not use_torch and states[0].dtype not in _KERNEL_DTYPES:
        if impl == "triton":
            raise InputError(
                f"impl='triton' needs states in {_KERNEL_DTYPES}, got {states[0].dtype}"
            )
        use_torch = True  # "auto": float64 runs the reference
    if use_torch:
        return routed_sum_reference(states, coeffs, channel_dim)
    return _RoutedSum.apply(coeffs.reshape(len(states), -1), channel_dim, *states)
