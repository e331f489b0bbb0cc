"""ANCRe: learned residual connectivity over a stack of shape-preserving blocks.

A stack of ``K`` blocks keeps its states ``x_0`` (the stack input) and ``x_1..x_K`` (the block
outputs). A :class:`ConnectivityRouter` learns how earlier states feed each block; a
:class:`RoutedBlock` wraps one block and asks the router for its input and its skip. The
layouts (``mode``):

- ``"source"`` (ANCRe, primary reading: shortcut-source routing). Block ``i`` keeps its branch
  and learns where its shortcut comes from:
  ``x_{i+1} = B_i(x_i) + g_i * (sum_j a_ij x_j - x_i)``, ``a_i = softmax(c_i / tau)`` over the
  sources ``j <= i``. For a block that adds its own input (``B_i(x) = x + F_i(x)``) this is
  ``F_i(x_i) + sum_j W_ij x_j`` with ``W_i = e_i + g_i (a_i - e_i)``.
- ``"input"`` (ANCRe, second reading: DenseFormer-like input routing with the same softmax):
  block ``i`` reads ``h_i = y_i + g_i * (sum_j a_ij y_j - y_i)`` and the stack returns the routed
  mixture of all states after the last block.
- ``"denseformer"`` (baseline, DenseFormer's depth-weighted average): ``h_i = sum_j alpha_ij
  y_j`` with free linear weights, ``alpha_ij = [i == j]`` at init.
- ``"rezero"`` (baseline): ``x_{i+1} = x_i + alpha_i * F_i(x_i)``, ``alpha_i = 0`` at init.
- ``"residual"`` (baseline): the blocks unchanged, no parameters.

The gate ``g_i`` starts at exactly 0, so a ``"source"``, ``"input"`` or ``"denseformer"`` stack
computes bitwise the same outputs as the plain residual stack at initialisation, while the
logits ``c`` still receive gradient as soon as ``g`` moves. ``gate=False`` drops the gate
(``g_i = 1``): the pure softmax routing, close to but not exactly residual at init
(``prev_logit`` sets how close).

Memory and speed: the routed sums never stack the states, so the only activations kept are the
states themselves, which the blocks' backward needs anyway. On CUDA they run as one fused Triton
kernel per layer and direction (:func:`~ada_modules.kernels.routed_sum`: each state read once);
elsewhere, and under ``torch.compile``, term by term (``addcmul``). ``export_hard()`` keeps the
strongest source per layer: one extra addition per re-routed layer and only the states that some
layer reads.

Gradient checkpointing: the states of each forward pass are indexed by block position. Without
checkpointing the router drops them when the pass ends. When the blocks run inside non-reentrant
checkpoints (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, the default of
timm, diffusers and transformers), a checkpoint recomputes its blocks during the backward pass,
after the pass has ended: the router then keeps detached aliases of the states that some layer
reads (tensors the checkpoints mostly keep anyway, as their inputs) for as long as the
checkpoints hold the inputs of the pass's blocks, i.e. until the backward pass or until the
graph is freed without one. A recomputed block finds its pass by its input tensor (the one its
checkpoint saved), reads the same states and the same temperature as in the forward pass and
records nothing, so gradients equal those without checkpointing, also with several forward
passes before one backward pass, a retained graph, or checkpoints of several blocks. Reentrant
checkpointing (``use_reentrant=True``) runs the forward pass without autograd, so the learned
shortcuts would get no gradient: the recomputation raises an error instead. One case is not
exact: with an annealed temperature, several forward passes before one backward pass, and a
checkpoint that starts before the stack (so that it does not save the stack's input), the first
blocks are recomputed at the current temperature.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Literal, get_args

import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.kernels import Impl, routed_sum, routed_sum_reference

__all__ = [
    "MODES",
    "ANCReStack",
    "ConnectivityRouter",
    "RoutedBlock",
    "export_hard",
    "find_routers",
    "wrap_module_list",
]

Mode = Literal["source", "input", "denseformer", "rezero", "residual"]
MODES: tuple[str, ...] = ("source", "input", "denseformer", "rezero", "residual")
_SOFTMAX_MODES = ("source", "input")
_INPUT_MODES = ("input", "denseformer")


class ConnectivityRouter(nn.Module):
    """The learned connectivity of a stack of ``num_layers`` blocks (see the module docstring).

    The router owns the coefficients and the states of the forward passes (see the module
    docstring for gradient checkpointing); the :class:`RoutedBlock` wrappers call it. Coefficients are stored as flat 1-D parameters
    (``logits`` and ``gate`` for the softmax modes, ``weights`` for ``"denseformer"``, ``alpha``
    for ``"rezero"``), so optimizers that decay only matrices leave them alone;
    :meth:`no_weight_decay` names them for the others.

    Args:
        num_layers: Number of blocks ``K`` in the stack.
        mode: ``"source"``, ``"input"``, ``"denseformer"``, ``"rezero"`` or ``"residual"``.
        temperature: Softmax temperature ``tau`` of the routing (softmax modes).
        final_temperature: If given, ``tau`` is annealed geometrically from ``temperature`` to
            this value over ``anneal_steps`` training forward passes (counted by the router).
        anneal_steps: Length of the annealing (needed with ``final_temperature``).
        dilation: Block ``i`` may read state ``j`` only when ``(i - j) % dilation == 0``
            (the previous state is always allowed); fewer coefficients and less compute.
        top_k: If given, each layer mixes only its ``top_k`` highest-logit sources (softmax
            renormalised over them; the previous state keeps its place in the correction), so
            a layer sums at most ``top_k + 1`` states.
        per_channel: One coefficient per channel instead of one per layer and source.
        num_channels: Channel count (needed with ``per_channel``).
        channel_dim: Dimension of the channels in the states (``-1`` for ``(batch, seq,
            hidden)``, ``1`` for ``(batch, channels, height, width)``).
        gate: Use the exact-identity gate ``g`` (starts at 0); ``False`` uses ``g = 1``.
        prev_logit: Initial logit of the previous state (others start at 0).
        residual_in_block: ``True`` if each block already adds its input (HF decoder layers,
            timm and diffusers blocks); ``False`` if it returns only its branch ``F(x)``.
        lr_scale: Each coefficient is stored divided by this factor and used multiplied by it,
            so that with Adam-type optimizers (whose steps do not depend on the gradient's
            scale) the coefficients move ``lr_scale`` times faster than the blocks' weights,
            without a separate parameter group. Zero-initialised coefficients (gates, ReZero's
            alpha) keep the exact identity at init; DenseFormer's unit weights are exact when
            ``lr_scale`` is a power of two.
        impl: How the routed sums run: ``"auto"`` (the fused Triton kernel on CUDA, term by term
            in torch otherwise), ``"triton"`` or ``"torch"`` (see
            :func:`~ada_modules.kernels.routed_sum`).

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> router = ConnectivityRouter(4, mode="source")
        >>> sorted(router.no_weight_decay())
        ['gate', 'logits']
        >>> router.connectivity()[3]  # block 3 reads its shortcut from x_3 at init
        tensor([0., 0., 0., 1., 0.])
    """

    geometry_role = "routing"
    """Role of the coefficients in :func:`~ada_modules.optim.geometry_param_groups`."""

    def __init__(
        self,
        num_layers: int,
        mode: Mode = "source",
        temperature: float = 1.0,
        final_temperature: float | None = None,
        anneal_steps: int = 0,
        dilation: int = 1,
        top_k: int | None = None,
        per_channel: bool = False,
        num_channels: int | None = None,
        channel_dim: int = -1,
        gate: bool = True,
        prev_logit: float = 0.0,
        residual_in_block: bool = True,
        lr_scale: float = 1.0,
        impl: Impl = "auto",
    ) -> None:
        super().__init__()
        if impl not in get_args(Impl):
            raise InputError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise InputError(f"num_layers must be a positive integer, got {num_layers!r}")
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        for name, value in (("temperature", temperature), ("final_temperature", final_temperature)):
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise InputError(f"{name} must be > 0, got {value!r}")
        if isinstance(anneal_steps, bool) or not isinstance(anneal_steps, int) or anneal_steps < 0:
            raise InputError(f"anneal_steps must be an integer >= 0, got {anneal_steps!r}")
        if final_temperature is not None and anneal_steps < 1:
            raise InputError(f"final_temperature needs anneal_steps >= 1, got {anneal_steps!r}")
        if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
            raise InputError(f"dilation must be an integer >= 1, got {dilation!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
            raise InputError(f"top_k must be None or an integer >= 1, got {top_k!r}")
        if top_k is not None and top_k < 1:
            raise InputError(f"top_k must be None or an integer >= 1, got {top_k!r}")
        if isinstance(lr_scale, bool) or not isinstance(lr_scale, int | float) or lr_scale <= 0:
            raise InputError(f"lr_scale must be > 0, got {lr_scale!r}")
        if per_channel and (not isinstance(num_channels, int) or num_channels < 1):
            raise InputError(
                f"per_channel=True needs num_channels >= 1, got num_channels={num_channels!r}"
            )
        self.num_layers = num_layers
        self.mode = mode
        self.temperature = float(temperature)
        self.final_temperature = None if final_temperature is None else float(final_temperature)
        self.anneal_steps = anneal_steps
        self.dilation = dilation
        self.top_k = top_k
        self.per_channel = per_channel
        self.channel_dim = channel_dim
        self.use_gate = gate
        self.residual_in_block = residual_in_block
        self.lr_scale = float(lr_scale)
        self.impl = impl
        self.hard = False
        width = num_channels if per_channel else 1
        # Routed rows: source mode routes the skip of blocks 1..K-1 (block 0 has one source);
        # input modes route the input of blocks 1..K-1 and the stack output (row K).
        last_row = num_layers - 1 if mode == "source" else num_layers
        rows = list(range(1, last_row + 1)) if mode in _SOFTMAX_MODES + ("denseformer",) else []
        self._rows: dict[int, list[int]] = {
            r: [j for j in range(r + 1) if (r - j) % dilation == 0] for r in rows
        }
        self._offsets: dict[int, int] = {}
        total = 0
        for r, sources in self._rows.items():
            self._offsets[r] = total
            total += len(sources)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        if mode in _SOFTMAX_MODES:
            logits = torch.zeros(total, width)
            for r, sources in self._rows.items():
                logits[self._offsets[r] + len(sources) - 1] = prev_logit
            self.logits = nn.Parameter(logits.flatten() / self.lr_scale)
            if gate:
                self.gate = nn.Parameter(torch.zeros(len(rows) * width))
        elif mode == "denseformer":
            weights = torch.zeros(total, width)
            for r, sources in self._rows.items():
                weights[self._offsets[r] + len(sources) - 1] = 1.0
            self.weights = nn.Parameter(weights.flatten() / self.lr_scale)
        elif mode == "rezero":
            self.alpha = nn.Parameter(torch.zeros(num_layers * width))
        self._width = width
        self._passes = _PassStore()

    # Coefficients ---------------------------------------------------------------------------

    def current_temperature(self) -> float:
        """The softmax temperature at the router's current ``step``."""
        if self.final_temperature is None:
            return self.temperature
        progress = min(int(self.step) / self.anneal_steps, 1.0)
        return self.temperature * (self.final_temperature / self.temperature) ** progress

    def _coefficients(self, name: str) -> torch.Tensor:
        """A coefficient parameter as used, ``(entries, width)``: stored value times ``lr_scale``.

        Outside the forward of an FSDP2-sharded model the parameter is a sharded ``DTensor``: it
        is gathered (a collective, so every rank reads it, as callbacks do).
        """
        param = getattr(self, name)
        if hasattr(param, "full_tensor"):
            param = param.full_tensor()
        flat = param.view(-1, self._width)
        return flat if self.lr_scale == 1.0 else flat * self.lr_scale

    def _row_param(self, name: str, r: int) -> torch.Tensor:
        n = len(self._rows[r])
        return self._coefficients(name)[self._offsets[r] : self._offsets[r] + n]

    def _row_weights(
        self, r: int, temperature: float | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """Sources of row ``r`` and their coefficients ``(n, width)`` in the row's sum.

        Softmax modes: the coefficients of the correction ``sum_j w_j x_j`` added to ``x_r``
        (``w = g (a - e_r)``). ``"denseformer"``: the weights of the mixture itself.
        ``temperature`` defaults to :meth:`current_temperature`.
        """
        sources = self._rows[r]
        if self.mode == "denseformer":
            return sources, self._row_param("weights", r)
        tau = self.current_temperature() if temperature is None else temperature
        logits = self._row_param("logits", r) / tau
        used = list(range(len(sources)))
        if self.top_k is not None and len(sources) > self.top_k:
            # The selection is one small host sync per layer; only the selected sources and the
            # previous state (whose coefficient is -g when it is not selected) are summed.
            keep = logits.detach().mean(dim=1).topk(self.top_k).indices.tolist()
            used = sorted(set(keep) | {len(sources) - 1})
            mask = torch.full_like(logits, -math.inf)
            mask[keep] = 0.0
            logits = logits + mask
        probs = torch.softmax(logits, dim=0)
        onehot = torch.zeros_like(probs)
        onehot[-1] = 1.0
        delta = probs - onehot
        if self.use_gate:
            i = list(self._rows).index(r)
            delta = delta * self._coefficients("gate")[i]
        if len(used) < len(sources):
            return [sources[k] for k in used], delta[used]
        return sources, delta

    def connectivity(self) -> torch.Tensor:
        """The effective coefficient matrix ``W``, shape ``(rows, num_layers + 1)``, detached.

        Row ``i < num_layers`` gives the states that form block ``i``'s shortcut (``"source"``)
        or input (input modes) as weights on ``x_0..x_K``; input modes have a last row for the
        stack output. Per-channel coefficients are averaged over channels. After
        :meth:`export_hard` the rows are one-hot.
        """
        rows = self.num_layers + (1 if self.mode in _INPUT_MODES else 0)
        matrix = torch.zeros(rows, self.num_layers + 1)
        for i in range(rows):
            matrix[i, i] = 1.0
        if self.mode == "rezero":
            return matrix
        if self.hard:
            for r, s in self._sources().items():
                matrix[r, r] = 0.0
                matrix[r, s] = 1.0
            return matrix
        with torch.no_grad():
            for r in self._rows:
                sources, coeffs = self._row_weights(r)
                values = coeffs.float().mean(dim=1).cpu()
                if self.mode == "denseformer":
                    matrix[r, r] = 0.0
                matrix[r, sources] += values
        return matrix

    def entropies(self) -> torch.Tensor:
        """Entropy (nats) of each row of ``|connectivity()|`` normalised to sum to 1."""
        weights = self.connectivity().abs()
        probs = weights / weights.sum(dim=1, keepdim=True).clamp_min(1e-12)
        return -(probs * probs.clamp_min(1e-12).log()).sum(dim=1)

    def no_weight_decay(self) -> set[str]:
        """Names of the coefficient parameters, which should not be weight-decayed."""
        return {name for name, _ in self.named_parameters()}

    # Hard export ----------------------------------------------------------------------------

    def _sources(self) -> dict[int, int]:
        return {r: int(s) for r, s in enumerate(self.hard_sources.tolist()) if r in self._rows}

    @torch.no_grad()
    def export_hard(self) -> ConnectivityRouter:
        """Keep only the strongest source of each routed row; drop the coefficients.

        In ``"source"`` mode block ``i`` then computes ``B_i(x_i) + x_s - x_i`` (plain
        ``B_i(x_i)`` when ``s = i``); in ``"input"`` mode it reads ``y_s``. States no layer
        reads are not kept. Returns ``self``. A hard-exported state dict holds ``hard_sources``
        instead of the coefficients: call ``export_hard()`` on a fresh router before loading it.

        Raises:
            ValueError: For modes without a source choice (``"denseformer"``, ``"rezero"``).
        """
        if self.mode == "residual" or self.hard:
            return self
        if self.mode not in _SOFTMAX_MODES:
            raise InputError(f"export_hard() needs mode 'source' or 'input', got {self.mode!r}")
        matrix = self.connectivity()
        sources = torch.arange(matrix.shape[0])
        for r in self._rows:
            sources[r] = int(matrix[r, : r + 1].argmax())
        device = self.step.device
        for name in ("logits", "gate"):
            if hasattr(self, name):
                delattr(self, name)
        self.register_buffer("hard_sources", sources.to(device))
        self.hard = True
        return self

    # Forward-pass protocol (called by RoutedBlock) ---------------------------------------------

    def _weighted_sum(self, states: Sequence[torch.Tensor], coeffs: torch.Tensor) -> torch.Tensor:
        # Term by term off CUDA (without routed_sum's argument checks: the router built the
        # states), for states of mixed dtypes and under torch.compile (inductor fuses it); the
        # fused kernel otherwise.
        if (
            self.impl == "torch"
            or (self.impl == "auto" and not coeffs.is_cuda)
            or torch.compiler.is_compiling()
            or any(s.dtype != states[0].dtype for s in states)  # the reference promotes
        ):
            return routed_sum_reference(states, coeffs, self.channel_dim)
        return routed_sum(states, coeffs, self.channel_dim, impl=self.impl)

    def _state(self, p: _Pass, j: int) -> torch.Tensor:
        state = p.states[j]
        if state is None:
            raise RuntimeError(f"state x_{j} was not kept; this is a bug in ConnectivityRouter")
        return state

    def _routed(self, p: _Pass, r: int, current: torch.Tensor) -> torch.Tensor:
        """The routed combination of row ``r`` given the current state ``x_r``."""
        if self.hard:
            s = self._sources()[r]
            return current if s == r else self._state(p, s)
        if self.mode == "denseformer":
            return self._correction(p, r, current)
        return current + self._correction(p, r, current)

    def _stored_states(self) -> set[int]:
        """The states ``x_j`` that some row reads besides its own current state."""
        if self.hard:
            return {s for r, s in self._sources().items() if s != r}
        return {j for r, sources in self._rows.items() for j in sources if j != r}

    def enter(self, index: int, x: torch.Tensor) -> _Pass:
        """The forward pass that block ``index`` runs in, given its input ``x``.

        Block 0 starts a new pass. During a backward pass (a gradient checkpoint recomputing
        blocks), block 0 starts a pass too, with the temperature of the pass it first ran in; a
        later block gets the kept pass it ran in, found by its input (the tensor the checkpoint
        saved), or continues the recomputation of the block before it in the same checkpoint.
        """
        store = self._passes
        if torch.compiler.is_compiling():  # compiled checkpoints recompute in the graph
            if index == 0:
                return self._begin(x)
            if store.current is None:
                raise RuntimeError(f"routed block {index} ran before block 0 of its stack")
            return store.current
        if _in_backward():
            if index == 0:
                kept = store.find(0, x)
                tau = self.current_temperature() if kept is None else kept.temperature
                p = _Pass(self.num_layers, x, tau, self._stored_states())
            else:
                p = store.find(index, x) or store.continued(index)
                if p is None and self._stored_states():
                    raise RuntimeError(
                        f"routed block {index} is recomputed during the backward pass but the "
                        "states of its forward pass were not kept. Reentrant gradient "
                        "checkpointing (use_reentrant=True) runs the forward pass without "
                        "autograd, so the learned shortcuts could not get gradients: use "
                        "use_reentrant=False (the default of timm, diffusers and transformers; "
                        "timm: unset TIMM_REENTRANT_CKPT)"
                    )
                if p is None:  # this layout reads no stored state
                    p = _Pass(self.num_layers, None, self.current_temperature(), set())
            store.chain(p, index)
            return p
        if index == 0:
            p = self._begin(x)
        elif store.current is None:
            raise RuntimeError(f"routed block {index} ran before block 0 of its stack")
        else:
            p = store.current
        p.inputs[index] = weakref.ref(x)
        if not p.checkpointed and torch.is_grad_enabled() and _saved_tensors_hooked():
            p.checkpointed = True
        return p

    def _begin(self, x: torch.Tensor) -> _Pass:
        """Start a forward pass with stack input ``x``."""
        if self.training and self.final_temperature is not None and torch.is_grad_enabled():
            self.step += 1
        stored = self._stored_states()
        p = _Pass(self.num_layers, x, self.current_temperature(), stored)
        self._passes.current = p
        return p

    def block_input(self, p: _Pass, index: int, x: torch.Tensor) -> torch.Tensor:
        """The input of block ``index`` given the previous block's output ``x``."""
        if self.mode in _INPUT_MODES and index in self._rows:
            return self._routed(p, index, x)
        return x

    def block_output(self, p: _Pass, index: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Block ``index``'s routed output, from its input ``x`` and its raw output ``y``."""
        if self.mode == "rezero":
            alpha = self._coefficients("alpha")[index]
            branch = y - x if self.residual_in_block else y
            shape = [1] * y.ndim
            if self.per_channel:
                shape[self.channel_dim] = self._width
            return x + alpha.to(y.dtype).view(shape) * branch
        if not self.residual_in_block:
            y = x + y
        if self.mode == "source" and index in self._rows:
            if self.hard:
                s = self._sources()[index]
                return y if s == index else y + (self._state(p, s) - x)
            return y + self._correction(p, index, x)
        return y

    def _correction(self, p: _Pass, r: int, current: torch.Tensor) -> torch.Tensor:
        """``sum_j w_j x_j`` over row ``r``'s sources (``"denseformer"``: the mixture itself)."""
        sources, coeffs = self._row_weights(r, p.temperature)
        states = [current if j == r else self._state(p, j) for j in sources]
        return self._weighted_sum(states, coeffs)

    def record(self, p: _Pass, index: int, y: torch.Tensor) -> torch.Tensor:
        """Store block ``index``'s output; after the last block, return the stack output.

        A recomputed block stores nothing. After the last block the pass ends: its states are
        dropped, or kept for the recomputation if its blocks ran inside gradient checkpoints.
        """
        if not p.done and index + 1 in p.stored:
            p.states[index + 1] = y
        if index < self.num_layers - 1:
            return y
        out = self._routed(p, self.num_layers, y) if self.num_layers in self._rows else y
        if not p.done:
            self._passes.finish(p)
        return out


class _Pass:
    """The states ``x_0..x_K`` of one forward pass through a routed stack, by block position.

    ``states[j]`` is ``x_j`` if some row reads it (``stored``), else ``None``; ``inputs[i]`` a weak
    reference to the tensor block ``i`` received; ``temperature`` the softmax temperature of the
    pass (a recomputation uses the same one); ``checkpointed`` whether a block ran under
    saved-tensor hooks (gradient checkpointing); ``done`` whether the pass is finished (a
    recomputed block then reads its states and records nothing).
    """

    __slots__ = ("checkpointed", "done", "inputs", "states", "stored", "temperature", "watch")

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


class _PassStore:
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
        self.current: _Pass | None = None
        self.kept: dict[int, _Pass] = {}
        self.recomputing: tuple[_Pass, int] | None = None  # (pass, next block) in a checkpoint
        self.queued = -1  # the backward pass that clears ``recomputing`` when it ends
        self._keys = itertools.count()

    def __deepcopy__(self, memo: dict[int, Any]) -> _PassStore:
        return _PassStore()

    def __reduce__(self) -> tuple[type[_PassStore], tuple[()]]:
        return (_PassStore, ())

    def finish(self, p: _Pass) -> None:
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

    def find(self, index: int, x: torch.Tensor) -> _Pass | None:
        """The kept pass in which block ``index`` received ``x``, if any."""
        for p in reversed(list(self.kept.values())):
            ref = p.inputs[index]
            if ref is not None and ref() is x:
                return p
        return None

    def continued(self, index: int) -> _Pass | None:
        """The pass being recomputed if block ``index`` follows the last recomputed block."""
        if self.recomputing is not None and self.recomputing[1] == index:
            return self.recomputing[0]
        return None

    def chain(self, p: _Pass, index: int) -> None:
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


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass (e.g. a checkpoint recomputes)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are active (a non-reentrant gradient checkpoint runs)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # cannot tell: keep the states (correct, costs memory until the backward)
        return True
    return top(False) is not None


class RoutedBlock(nn.Module):
    """One block of a routed stack: asks its router for the input, checks the shape, routes.

    The router is shared by all blocks of the stack and is not registered here (the stack or the
    wrapped model owns it). Attributes that the block has and the wrapper does not are read from
    the block, so model code that inspects its layers (``layers[0].attention_type``) still works.

    Args:
        block: The wrapped block; ``block(x, *args, **kwargs)`` returns a tensor shaped like
            ``x`` (or a tuple whose first element is).
        index: Position of the block in the stack.
        router: The stack's :class:`ConnectivityRouter`.

    Examples:
        >>> router = ConnectivityRouter(1, mode="rezero", residual_in_block=False)
        >>> layer = RoutedBlock(nn.Linear(3, 3), 0, router)
        >>> torch.equal(layer(torch.ones(2, 3)), torch.ones(2, 3))  # alpha = 0 at init
        True
    """

    def __init__(self, block: nn.Module, index: int, router: ConnectivityRouter) -> None:
        super().__init__()
        if not isinstance(block, nn.Module):
            raise InputError(f"block {index} must be an nn.Module, got {type(block).__name__}")
        self.block = block
        self.index = index
        object.__setattr__(self, "_router", router)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        router: ConnectivityRouter = self._router
        p = router.enter(self.index, x)
        inputs = router.block_input(p, self.index, x)
        out = self.block(inputs, *args, **kwargs)
        y = out[0] if isinstance(out, tuple | list) else out
        if not isinstance(y, torch.Tensor) or y.shape != inputs.shape:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise InputError(
                f"block {self.index} ({type(self.block).__name__}) returned shape {got} for an "
                f"input of shape {tuple(inputs.shape)}; routed blocks must preserve the shape"
            )
        y = router.record(p, self.index, router.block_output(p, self.index, inputs, y))
        if isinstance(out, tuple | list):
            return type(out)([y, *out[1:]])
        return y


def wrap_module_list(
    container: nn.ModuleList | nn.Sequential,
    owner: nn.Module,
    name: str = "connectivity",
    start: int = 0,
    **router_kwargs: Any,
) -> ConnectivityRouter:
    """Route the blocks ``container[start:]`` in place and register the router on ``owner``.

    Each block is replaced by a :class:`RoutedBlock`; the container keeps its type, so model code
    that loops over it (``for layer in self.layers``) or calls it (``nn.Sequential``) runs the
    routed stack. The state before ``container[start]`` is the stack input ``x_0``. The router
    is created on the device of the blocks' parameters (its coefficients stay float32 and are
    cast to the states' dtype when used).

    Args:
        container: The blocks (an ``nn.ModuleList`` or ``nn.Sequential``).
        owner: Module that registers the router as ``name`` (not the container itself, which
            would then call or iterate it).
        name: Attribute name of the router on ``owner``.
        start: Index of the first block to route (earlier blocks are left as they are).
        **router_kwargs: Arguments of :class:`ConnectivityRouter` (``mode``, ``temperature``, ...).

    Returns:
        The router.

    Raises:
        ValueError: If no block is left to route or ``name`` is taken on ``owner``.

    Examples:
        >>> blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        >>> owner = nn.Module()
        >>> router = wrap_module_list(blocks, owner, residual_in_block=False)
        >>> type(blocks[0]).__name__, owner.connectivity is router
        ('RoutedBlock', True)
    """
    if not isinstance(container, nn.ModuleList | nn.Sequential):
        raise InputError(f"container must be nn.ModuleList or nn.Sequential, got {type(container)}")
    blocks = list(container)[start:]
    if not blocks:
        raise InputError(f"container has no blocks to route from index start={start}")
    if hasattr(owner, name):
        raise InputError(f"owner already has an attribute {name!r}; pass another name")
    router = ConnectivityRouter(len(blocks), **router_kwargs)
    param = next((p for block in blocks for p in block.parameters()), None)
    if param is not None:  # the model may already be on its device
        router.to(param.device)
    for i, block in enumerate(blocks):
        container[start + i] = RoutedBlock(block, i, router)
    owner.add_module(name, router)
    return router


class ANCReStack(nn.Module):
    """A stack of shape-preserving blocks with learned residual connectivity.

    ``ANCReStack(blocks, mode=...)`` behaves like running the blocks in sequence, with the
    layout chosen by ``mode`` (see :class:`ConnectivityRouter`); at init, ``"source"``,
    ``"input"`` and ``"denseformer"`` compute bitwise the same outputs as ``"residual"``.
    ``forward(x, *args, **kwargs)`` passes the extra arguments to every block.

    Args:
        blocks: The blocks (any sequence of modules, e.g. an ``nn.ModuleList``).
        **router_kwargs: Arguments of :class:`ConnectivityRouter` except ``num_layers``.

    Raises:
        ValueError: If ``blocks`` is empty, a router argument is out of range, or (in forward)
            a block changes the shape of its input (naming the block's index).
        TypeError: If a block is not an ``nn.Module``.

    Examples:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> def mlp():
        ...     return nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        >>> blocks = [mlp() for _ in range(6)]
        >>> plain = ANCReStack(blocks, mode="residual", residual_in_block=False)
        >>> routed = ANCReStack(blocks, mode="source", residual_in_block=False)
        >>> x = torch.randn(2, 8)
        >>> torch.equal(plain(x), routed(x))
        True
        >>> sum(p.numel() for p in routed.router.parameters())  # 20 logits + 5 gates
        25
    """

    def __init__(self, blocks: Sequence[nn.Module], **router_kwargs: Any) -> None:
        super().__init__()
        blocks = list(blocks)
        if not blocks:
            raise InputError("blocks must not be empty")
        for i, block in enumerate(blocks):
            if not isinstance(block, nn.Module):
                raise InputError(f"block {i} must be an nn.Module, got {type(block).__name__}")
        self.router = ConnectivityRouter(len(blocks), **router_kwargs)
        param = next((p for block in blocks for p in block.parameters()), None)
        if param is not None:  # blocks already on a device: keep the router with them
            self.router.to(param.device)
        self.layers = nn.ModuleList(RoutedBlock(b, i, self.router) for i, b in enumerate(blocks))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Run the routed blocks on ``x``."""
        for layer in self.layers:
            x = layer(x, *args, **kwargs)
        return x

    def connectivity(self) -> torch.Tensor:
        """The router's coefficient matrix (see :meth:`ConnectivityRouter.connectivity`)."""
        return self.router.connectivity()

    def export_hard(self) -> ANCReStack:
        """Keep the strongest source per layer (see :meth:`ConnectivityRouter.export_hard`)."""
        self.router.export_hard()
        return self

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this stack) of the coefficients, for timm-style optimizers."""
        return {f"router.{name}" for name in self.router.no_weight_decay()}


def find_routers(module: nn.Module) -> Iterator[tuple[str, ConnectivityRouter]]:
    """``(name, router)`` for every :class:`ConnectivityRouter` inside ``module``.

    Examples:
        >>> stack = ANCReStack([nn.Linear(2, 2)], residual_in_block=False)
        >>> [name for name, _ in find_routers(stack)]
        ['router']
    """
    for name, child in module.named_modules():
        if isinstance(child, ConnectivityRouter):
            yield name, child


def export_hard(module: nn.Module) -> nn.Module:
    """Call :meth:`ConnectivityRouter.export_hard` on every router inside ``module``; return it.

    Examples:
        >>> stack = ANCReStack([nn.Linear(2, 2), nn.Linear(2, 2)], residual_in_block=False)
        >>> export_hard(stack).router.hard
        True
    """
    for _, router in find_routers(module):
        router.export_hard()
    return module
