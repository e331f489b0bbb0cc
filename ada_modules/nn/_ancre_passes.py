"""The states of the forward passes through a routed stack, kept for gradient checkpointing.

A :class:`~ada_modules.nn.ancre_router.ConnectivityRouter` holds a :class:`PassStore`: the pass in
progress, the passes a non-reentrant checkpoint may still recompute, and the one being recomputed
(see :mod:`ada_modules.nn.ancre` for what this guarantees).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from ada_modules.nn._ancre_deferred import GradientLedger

__all__ = ["Pass", "PassStore", "in_backward", "saved_tensors_hooked"]


class Pass:
    """The states ``x_0..x_K`` of one forward pass through a routed stack, by block position.

    ``states[j]`` is ``x_j`` if some row reads it (``stored``), else ``None``; ``inputs[i]`` a weak
    reference to the tensor block ``i`` received; ``temperature`` the softmax temperature of the
    pass (a recomputation uses the same one); ``checkpointed`` whether a block ran under
    saved-tensor hooks (gradient checkpointing); ``done`` whether the pass is finished (a
    recomputed block then reads its states and records nothing); ``ledger`` the rows' output
    gradients when the router defers the states' gradients (``state_grads="deferred"``).
    """

    __slots__ = (
        "checkpointed",
        "done",
        "inputs",
        "ledger",
        "states",
        "stored",
        "temperature",
        "watch",
    )

    def __init__(
        self, num_layers: int, x: torch.Tensor | None, temperature: float, stored: set[int]
    ) -> None:
        self.states: list[torch.Tensor | None] = [x if 0 in stored else None]
        self.states += [None] * num_layers
        self.inputs: list[weakref.ref[torch.Tensor] | None] = [None] * num_layers
        self.temperature = temperature
        self.stored = stored
        self.checkpointed = False
        self.done = False
        self.watch: list[weakref.ref[torch.Tensor]] = []
        self.ledger: GradientLedger | None = None


class PassStore:
    """A router's passes: the one in progress, those kept for checkpoint recomputation, and the
    one being recomputed.

    A kept pass holds detached aliases of its stored states (so that it keeps no autograd graph
    alive) and watches the inputs its blocks received. The checkpoints hold those inputs until
    they recompute their blocks, so the states are dropped as soon as no input of blocks
    ``1..K-1`` is alive (after the backward pass, or when the graph is freed without one), and
    the pass itself (its temperature, for a recomputation of block 0) when block 0's input is
    gone too. Never copied or pickled.
    """

    def __init__(self) -> None:
        self.current: Pass | None = None
        self.kept: dict[int, Pass] = {}
        self.recomputing: tuple[Pass, int] | None = None  # (pass, next block) in a checkpoint
        self.queued = -1  # the backward pass that clears ``recomputing`` when it ends
        self._keys = itertools.count()

    def __deepcopy__(self, memo: dict[int, Any]) -> PassStore:
        return PassStore()

    def __reduce__(self) -> tuple[type[PassStore], tuple[()]]:
        return (PassStore, ())

    def finish(self, p: Pass) -> None:
        """End pass ``p``: drop its states, or keep them if a checkpoint may recompute a block."""
        if self.current is p:
            self.current = None
        if p.done:
            return
        p.done = True
        if torch.compiler.is_compiling():
            p.states = []
            return
        later = [t for ref in p.inputs[1:] if ref is not None and (t := ref()) is not None]
        first = p.inputs[0]() if p.inputs[0] is not None else None
        keep = p.checkpointed and p.stored and torch.is_grad_enabled()
        if not (keep and (later or first is not None)):
            p.states = []
            return
        p.states = [None if s is None else _alias(s) for s in p.states] if later else []
        key = next(self._keys)
        store_ref = weakref.ref(self)
        alive = [len(later), 1 if first is not None else 0]

        def released(group: int) -> None:  # group 0: inputs of blocks 1..K-1; 1: block 0's
            alive[group] -= 1
            store = store_ref()
            kept = None if store is None else store.kept.get(key)
            if kept is not None and alive[0] == 0:
                kept.states = []
                if alive[1] == 0:
                    del store.kept[key]

        p.watch = [weakref.ref(t, lambda _: released(0)) for t in later]
        if first is not None:
            p.watch.append(weakref.ref(first, lambda _: released(1)))
        self.kept[key] = p

    def find(self, index: int, x: torch.Tensor) -> Pass | None:
        """The kept pass in which block ``index`` received ``x``, if any."""
        for p in reversed(list(self.kept.values())):
            ref = p.inputs[index]
            if ref is not None and ref() is x:
                return p
        return None

    def continued(self, index: int) -> Pass | None:
        """The pass being recomputed if block ``index`` follows the last recomputed block."""
        if self.recomputing is not None and self.recomputing[1] == index:
            return self.recomputing[0]
        return None

    def chain(self, p: Pass, index: int) -> None:
        """Note that block ``index`` of ``p`` is being recomputed, until the backward pass ends."""
        self.recomputing = (p, index + 1)
        task = torch._C._current_graph_task_id()
        engine = getattr(torch.autograd.Variable, "_execution_engine", None)
        queue = getattr(engine, "queue_callback", None)
        if queue is None or self.queued == task:
            return
        self.queued = task
        store_ref = weakref.ref(self)

        def clear() -> None:
            store = store_ref()
            if store is not None:
                store.recomputing = None
                store.queued = -1

        queue(clear)


def _alias(state: torch.Tensor) -> torch.Tensor:
    """``state`` without its autograd history, requiring grad like it (so that a recomputation
    saves the same tensors as the forward pass did)."""
    return state.detach().requires_grad_(state.requires_grad)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass (e.g. a checkpoint recomputes)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are active (a non-reentrant gradient checkpoint runs)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # cannot tell: keep the states (correct, costs memory until the backward)
        return True
    return top(False) is not None
