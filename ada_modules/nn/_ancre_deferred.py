"""Deferred state gradients of a routed stack: each state's gradient as one column sum.

Term by term, autograd gives a state ``x_j`` one gradient term ``c_rj * g_r`` for every later row
``r`` that reads it (``g_r`` is the gradient of the row's routed sum) and adds the terms one at a
time, each a pass over a state-sized tensor. With ``state_grads="deferred"`` (see
:class:`~ada_modules.nn.ancre_router.ConnectivityRouter`) a row's backward only computes its
coefficients' gradients and copies ``g_r`` into a :class:`GradientLedger`. The state's own
backward (a tap placed on ``x_j`` when it was recorded) then adds ``sum_r c_rj g_r`` in one
matrix-vector product over the ledger. Autograd runs the tap only after every row that read
``x_j`` (they consume the tapped tensor), so the sum is complete when it is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = ["GradientLedger", "deferred_routed_sum", "tap_state"]


def _task() -> int:
    return torch._C._current_graph_task_id()


class GradientLedger:
    """The rows' output gradients of one forward pass, until the states they read collect them.

    ``tapped`` holds the positions of the states whose backward collects (block outputs; the stack
    input is not tapped, so rows return its gradient themselves). Entries are tagged with the
    backward pass (graph task) that made them, so a partial backward (``torch.autograd.grad`` of an
    intermediate state) leaves nothing that a later backward would count twice. The buffer is
    released as soon as no entry of the running backward pass is pending.
    """

    def __init__(self) -> None:
        self.tapped: set[int] = set()
        self._like: tuple[torch.dtype, torch.device, int] | None = None
        self._buffer: torch.Tensor | None = None
        self._pending: dict[int, list[tuple[int, int, torch.Tensor]]] = {}

    def accepts(self, state: torch.Tensor) -> bool:
        """Whether a row of states like ``state`` can defer: one dtype, device and size per pass,
        those of the first row that does (the buffer holds its gradients)."""
        like = (state.dtype, state.device, state.numel())
        if self._like is None:
            self._like = like
        return like == self._like

    def deposit(
        self,
        row: int,
        grad: torch.Tensor,
        sources: Sequence[int],
        coeffs: torch.Tensor,
        num_rows: int,
    ) -> None:
        """Keep row ``row``'s output gradient for the tapped ``sources`` (coefficients ``coeffs``)."""
        task = _task()
        if self._buffer is None:
            self._buffer = grad.new_empty(num_rows, grad.numel())
        self._buffer[row].copy_(grad.reshape(-1))
        for j, c in zip(sources, coeffs, strict=True):
            self._pending.setdefault(j, []).append((task, row, c))

    def collect(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """``grad + sum_r c_r,index g_r`` over the rows of this backward pass that read the state."""
        task = _task()
        entries = [(row, c) for t, row, c in self._pending.pop(index, ()) if t == task]
        entries.sort(key=lambda entry: entry[0])
        if entries:
            rows = [row for row, _ in entries]
            step = rows[1] - rows[0] if len(rows) > 1 else 1
            if rows == list(range(rows[0], rows[-1] + 1, step)):  # a strided view, no copy
                grads = self._buffer[rows[0] : rows[-1] + 1 : step]
            else:
                grads = self._buffer[rows]
            coeffs = torch.stack([c for _, c in entries]).to(grad.dtype)
            grad = torch.addmv(grad.reshape(-1), grads.t(), coeffs).view_as(grad)
        if not any(t == task for waiting in self._pending.values() for t, _, _ in waiting):
            self._pending.clear()
            self._buffer = None
        return grad


class _StateTap(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, ledger: GradientLedger, index: int
    ) -> torch.Tensor:
        ctx.ledger, ctx.index = ledger, index
        ledger.tapped.add(index)
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.ledger.collect(ctx.index, grad), None, None


class _DeferredRow(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        coeffs: torch.Tensor,
        ledger: GradientLedger,
        row: int,
        num_rows: int,
        sources: tuple[int, ...],
        summed: Callable[[Sequence[torch.Tensor], torch.Tensor], torch.Tensor],
        *states: torch.Tensor,
    ) -> torch.Tensor:
        ctx.ledger, ctx.row, ctx.num_rows, ctx.sources = ledger, row, num_rows, sources
        ctx.tapped = [j in ledger.tapped for j in sources]
        ctx.save_for_backward(coeffs, *states)
        return summed(states, coeffs)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        coeffs, *states = ctx.saved_tensors
        dcoeffs = None
        if ctx.needs_input_grad[0]:
            flat = grad.reshape(-1)
            dcoeffs = torch.stack([torch.dot(s.reshape(-1), flat) for s in states])
            dcoeffs = dcoeffs.to(coeffs.dtype).view_as(coeffs)
        used = coeffs.detach().reshape(-1).to(grad.dtype)
        tapped = [k for k, t in enumerate(ctx.tapped) if t]
        if tapped:
            ctx.ledger.deposit(
                ctx.row, grad, [ctx.sources[k] for k in tapped], used[tapped], ctx.num_rows
            )
        needs = ctx.needs_input_grad[6:]
        dstates = [None if t or not needs[k] else used[k] * grad for k, t in enumerate(ctx.tapped)]
        return (dcoeffs, None, None, None, None, None, *dstates)


def tap_state(x: torch.Tensor, ledger: GradientLedger, index: int) -> torch.Tensor:
    """``x`` (a view of it) whose backward adds the deferred gradients of state ``index``."""
    return _StateTap.apply(x, ledger, index)


def deferred_routed_sum(
    states: Sequence[torch.Tensor],
    coeffs: torch.Tensor,
    sources: Sequence[int],
    row: int,
    num_rows: int,
    ledger: GradientLedger,
    summed: Callable[[Sequence[torch.Tensor], torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``summed(states, coeffs)``, whose backward defers the tapped states' gradients to ``ledger``.

    Args:
        states: The row's states, the state at position ``sources[k]`` being ``states[k]``.
        coeffs: One coefficient per state, ``(n,)`` or ``(n, 1)``.
        sources: Positions of the states in the stack.
        row: The row's index in the ledger, below ``num_rows``.
        num_rows: Rows of the ledger's buffer.
        ledger: The pass's ledger.
        summed: The forward routed sum (fused or term by term).

    Examples:
        >>> ledger = GradientLedger()
        >>> x0 = torch.ones(3, requires_grad=True)
        >>> x1 = tap_state(x0 * 2, ledger, 1)
        >>> c = torch.tensor([0.5, 0.25], requires_grad=True)
        >>> out = deferred_routed_sum(
        ...     [x0, x1], c, [0, 1], 0, 1, ledger, lambda s, c: c[0] * s[0] + c[1] * s[1]
        ... )
        >>> out.sum().backward()
        >>> x0.grad.tolist(), c.grad.tolist()  # 0.5 + 2 * 0.25 per element; sum(x0), sum(x1)
        ([1.0, 1.0, 1.0], [3.0, 6.0])
    """
    return _DeferredRow.apply(coeffs, ledger, row, num_rows, tuple(sources), summed, *states)
