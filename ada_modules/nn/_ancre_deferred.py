"""Deferred state gradients of a routed stack: each state's gradient terms in a few products.

Term by term, autograd gives a state ``x_j`` one gradient term ``c_rj * g_r`` for every later row
``r`` that reads it (``g_r`` is the gradient of the row's routed sum) and adds the terms one at a
time, each a pass over a state-sized tensor. With ``state_grads="deferred"`` (see
:class:`~ada_modules.nn.ancre_router.ConnectivityRouter`) a row's backward computes its
coefficients' gradients and copies ``g_r`` into a :class:`GradientLedger`. A tensor hook that the
ledger registered on ``x_j`` when the block returned it then adds ``sum_r c_rj g_r``: one
matrix-vector product per piece of the kept gradients that the rows span (pieces double in size,
so at most ``log2`` of the depth plus one). Autograd runs a tensor's hooks once its gradient is
complete (after every row that read it) and before the hooks registered later, ``retain_grad``
and ``torch.autograd.grad`` of that tensor, so all of them see the full gradient (not
``torch.autograd.grad`` of the tensor together with an earlier one: the engine captures it on the
way, before the hooks). A row's own current state (its block's input, which need not be a
recorded state) gets its term through autograd as usual.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = ["GradientLedger", "deferred_routed_sum"]

_ROW_ARGS = 5  # _DeferredRow.forward's arguments before the states
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _task() -> int:
    return torch._C._current_graph_task_id()


def _in_compiled_autograd() -> bool:
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")  # imported when in use
    flag = getattr(compiled, "in_compiled_autograd_region", False)
    return bool(flag() if callable(flag) else flag)


class GradientLedger:
    """The rows' output gradients of one forward pass, until the states they read collect them.

    Built from the stack input ``like`` and the number of routed rows, ``num_rows``, each of which
    deposits at most once per backward pass. Rows whose states differ from ``like`` in dtype,
    device or shape keep autograd's sums (:meth:`fits`). Each backward pass (graph task) gets its
    own :class:`_PassGradients`, dropped when that backward pass ends, so a partial backward
    (``torch.autograd.grad`` of an intermediate state, ``backward(inputs=...)``) keeps nothing
    and a later one counts every term once.
    """

    def __init__(self, like: torch.Tensor, num_rows: int) -> None:
        # position -> the state and its version when watched
        self.watched: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.num_rows = num_rows
        self._layout = (like.dtype, like.device, like.shape)
        self._tasks: dict[int, _PassGradients] = {}

    def fits(self, state: torch.Tensor) -> bool:
        """Whether the gradients of a row of states like ``state`` fit the ledger's buffer."""
        return (state.dtype, state.device, state.shape) == self._layout

    def watch(self, state: torch.Tensor, index: int) -> None:
        """Complete the gradient of ``state`` (position ``index``) with the rows' deferred terms."""
        ledger = weakref.ref(self)

        def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
            owner = ledger()
            if owner is None:
                return grad
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "state_grads='deferred' takes no double backward (create_graph=True); "
                    "use state_grads='autograd'"
                )
            return owner.collect(index, grad)

        state.register_hook(hook)
        self.watched[index] = (weakref.ref(state), state._version)

    def defers(self, index: int, state: torch.Tensor) -> bool:
        """Whether a row's term for ``state`` (position ``index``) goes through the ledger: it is
        the watched tensor, unchanged since (a state changed in place gets its terms through
        autograd)."""
        ref, version = self.watched.get(index, (None, -1))
        return ref is not None and ref() is state and state._version == version

    def deposit(
        self, row: int, grad: torch.Tensor, terms: Sequence[tuple[int, torch.Tensor]]
    ) -> set[int]:
        """Keep row ``row``'s output gradient for its watched sources: ``(source, coefficient)``.

        Returns the sources that no other row of this backward pass deposited for: the row gives
        them a zero gradient through autograd, so that their hooks get a tensor to add to (a hook
        cannot replace a missing gradient).
        """
        task = _task()
        if task not in self._tasks:
            if _in_compiled_autograd():
                raise RuntimeError(
                    "state_grads='deferred' does not run under compiled autograd; "
                    "use state_grads='autograd'"
                )
            self._tasks[task] = _PassGradients(self.num_rows)
            ledger = weakref.ref(self)

            def drop() -> None:  # at the end of this backward pass
                owner = ledger()
                if owner is not None:
                    owner._tasks.pop(task, None)

            torch.autograd.Variable._execution_engine.queue_callback(drop)
        kept = self._tasks[task]
        kept.keep(row, grad)
        first = {j for j, _ in terms if j not in kept.pending}
        for j, c in terms:
            kept.pending.setdefault(j, []).append((row, c))
        return first

    def collect(self, index: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """``grad + sum_r c_r,index g_r`` over the rows of this backward pass that read the state
        (``grad`` is a tensor whenever a row deposited: that row gave it a zero)."""
        kept = self._tasks.get(_task())
        entries = kept.pending.pop(index, None) if kept is not None else None
        if not entries:
            return grad
        return kept.add_to(grad, entries)


class _PassGradients:
    """One backward pass's kept row gradients, in pieces allocated as the rows arrive.

    Pieces double in size (1, 2, 4, ... rows, the last cut to the rows left): the first row's
    backward, while every activation is still saved, allocates one state, and the larger pieces
    come once the blocks behind them have freed their activations. (On CUDA the caching allocator
    counts an allocation whole when made; on CPU only its written pages count.) A state's sum takes
    one matrix-vector product per piece its rows span, at most ``ceil(log2(num_rows + 1))``.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.pieces: list[torch.Tensor] = []
        self.where: dict[int, tuple[int, int]] = {}  # row -> (piece, slot)
        self.pending: dict[int, list[tuple[int, torch.Tensor]]] = {}  # state -> (row, coeff)
        self._free = 0  # unused slots of the last piece

    def keep(self, row: int, grad: torch.Tensor) -> None:
        """Copy row ``row``'s output gradient into the next free slot."""
        if self._free == 0:
            size = min(
                2 * len(self.pieces[-1]) if self.pieces else 1, self.num_rows - len(self.where)
            )
            self.pieces.append(grad.new_empty(size, grad.numel()))
            self._free = len(self.pieces[-1])
        piece = len(self.pieces) - 1
        slot = len(self.pieces[piece]) - self._free
        self.pieces[piece][slot].copy_(grad.reshape(-1))
        self.where[row] = (piece, slot)
        self._free -= 1

    def add_to(self, grad: torch.Tensor, entries: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """``grad + sum_r c_r g_r`` over ``entries`` ``(row, c_r)``: one product per piece."""
        by_piece: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for row, c in entries:
            piece, slot = self.where[row]
            by_piece.setdefault(piece, []).append((slot, c))
        total = None
        for piece, terms in by_piece.items():
            terms.sort(key=lambda t: t[0])
            slots = [slot for slot, _ in terms]
            step = slots[1] - slots[0] if len(slots) > 1 else 1
            if slots == list(range(slots[0], slots[-1] + 1, step)):  # a strided view, no copy
                grads = self.pieces[piece][slots[0] : slots[-1] + 1 : step]
            else:  # top_k rows: gathered
                grads = self.pieces[piece][slots]
            coeffs = torch.stack([c for _, c in terms])
            if total is None:  # out of place: grad stays as given
                total = torch.addmv(grad.reshape(-1), grads.t(), coeffs)
            else:
                total.addmv_(grads.t(), coeffs)
        return total.view_as(grad)


class _DeferredRow(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        coeffs: torch.Tensor,
        ledger: GradientLedger,
        row: int,
        sources: tuple[int, ...],
        summed: Callable[[Sequence[torch.Tensor], torch.Tensor], torch.Tensor],
        *states: torch.Tensor,
    ) -> torch.Tensor:
        ctx.ledger, ctx.row, ctx.sources = ledger, row, sources
        ctx.deferred = [
            j != row and ledger.defers(j, s) for j, s in zip(sources, states, strict=True)
        ]
        ctx.save_for_backward(coeffs, *states)
        return summed(states, coeffs)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        coeffs, *states = ctx.saved_tensors
        dcoeffs = None
        if ctx.needs_input_grad[0]:
            # half-precision states: summed in float32, as the fused kernel accumulates
            if grad.dtype in _LOW_PRECISION:
                dots = [(s * grad).sum(dtype=torch.float32) for s in states]
            else:
                flat = grad.reshape(-1)
                dots = [torch.dot(s.reshape(-1), flat) for s in states]
            dcoeffs = torch.stack(dots).to(coeffs.dtype).view_as(coeffs)
        used = coeffs.detach().reshape(-1).to(grad.dtype).unbind()
        deferred = [(ctx.sources[k], used[k]) for k, d in enumerate(ctx.deferred) if d]
        first = ctx.ledger.deposit(ctx.row, grad, deferred) if deferred else set()
        needs = ctx.needs_input_grad[_ROW_ARGS:]
        dstates = []
        for k, d in enumerate(ctx.deferred):
            if not needs[k]:
                dstates.append(None)
            elif not d:
                dstates.append(used[k] * grad)
            elif ctx.sources[k] in first:
                dstates.append(grad.new_zeros(()).expand_as(grad))
            else:
                dstates.append(None)
        return (dcoeffs, None, None, None, None, *dstates)


def deferred_routed_sum(
    states: Sequence[torch.Tensor],
    coeffs: torch.Tensor,
    sources: Sequence[int],
    row: int,
    ledger: GradientLedger,
    summed: Callable[[Sequence[torch.Tensor], torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``summed(states, coeffs)``, whose backward defers the watched states' terms to ``ledger``.

    Args:
        states: The row's states, the state at position ``sources[k]`` being ``states[k]``.
        coeffs: One coefficient per state, ``(n,)`` or ``(n, 1)``.
        sources: Positions of the states in the stack.
        row: The row's position: its state ``row`` (the current one) is never deferred.
        ledger: The pass's ledger; states it watches get their terms from it.
        summed: The forward routed sum (fused or term by term).

    Examples:
        >>> x0 = torch.ones(3, requires_grad=True)
        >>> ledger = GradientLedger(x0, num_rows=3)
        >>> x1 = x0 * 2
        >>> ledger.watch(x1, 1)
        >>> c = torch.tensor([0.5, 0.25, 1.0], requires_grad=True)
        >>> x2 = x1.tanh()
        >>> out = deferred_routed_sum(
        ...     [x0, x1, x2], c, [0, 1, 2], 2, ledger, lambda s, c: c[0] * s[0] + c[1] * s[1] + c[2] * s[2]
        ... )
        >>> out.sum().backward()
        >>> torch.allclose(x0.grad, 0.5 + 2 * (0.25 + 1.0 * (1 - x1.detach().tanh() ** 2)))
        True
    """
    return _DeferredRow.apply(coeffs, ledger, row, tuple(sources), summed, *states)
