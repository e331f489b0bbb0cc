"""The router of a routed stack: ANCRe's connectivity coefficients and routed sums.

The layouts, the identity at init and gradient checkpointing are described in
:mod:`ada_modules.nn.ancre`, which also has the blocks and stacks that call the router.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import nn

from ada_modules.checks import is_finite_real, is_int
from ada_modules.errors import InputError
from ada_modules.kernels import Impl, routed_sum, routed_sum_reference
from ada_modules.nn._ancre_deferred import GradientLedger, deferred_routed_sum
from ada_modules.nn._ancre_passes import Pass, PassStore, in_backward, saved_tensors_hooked

__all__ = ["MODES", "ConnectivityRouter", "Mode", "StateGrads"]

Mode = Literal["source", "input", "denseformer", "rezero", "residual"]
StateGrads = Literal["autograd", "deferred"]
MODES: tuple[str, ...] = ("source", "input", "denseformer", "rezero", "residual")
_SOFTMAX_MODES = ("source", "input")
_INPUT_MODES = ("input", "denseformer")


class ConnectivityRouter(nn.Module):
    """The learned connectivity of a stack of ``num_layers`` blocks.

    The layouts and gradient checkpointing are described in :mod:`ada_modules.nn.ancre`. The router
    owns the coefficients and the states of the forward passes; the
    :class:`~ada_modules.nn.ancre.RoutedBlock` wrappers call it. Coefficients are stored as flat
    1-D parameters (``logits`` and ``gate`` for the softmax modes, ``weights`` for
    ``"denseformer"``, ``alpha`` for ``"rezero"``), so optimizers that decay only matrices leave
    them alone; :meth:`no_weight_decay` names them for the others.

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
        state_grads: How a state gets the gradients of the later rows that read it:
            ``"autograd"`` adds them term by term; ``"deferred"`` adds them in a few
            matrix-vector products per state (:mod:`ada_modules.nn._ancre_deferred`; on CPU, term
            by term and float32 states, an estimated 38 % fewer bytes for the routed sums, and a
            step's peak memory near the residual stack's, on CPU and as the CUDA allocator counts
            it: ``bench/ancre_memory.py``).
            ``"deferred"`` needs one coefficient per state (not ``per_channel``) and takes no
            double backward nor compiled autograd. Blocks that run under saved-tensor hooks
            (gradient checkpointing, ``save_on_cpu``) or ``torch.compile``, and states changed
            in place, keep autograd's terms.

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
        state_grads: StateGrads = "autograd",
    ) -> None:
        super().__init__()
        if impl not in get_args(Impl):
            raise InputError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
        if state_grads not in get_args(StateGrads):
            raise InputError(f"state_grads must be 'autograd' or 'deferred', got {state_grads!r}")
        if state_grads == "deferred" and per_channel:
            raise InputError(
                "state_grads='deferred' needs one coefficient per state; got per_channel=True "
                "(use state_grads='autograd')"
            )
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise InputError(f"num_layers must be a positive integer, got {num_layers!r}")
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        for name, value in (("temperature", temperature), ("final_temperature", final_temperature)):
            if value is not None and not (is_finite_real(value) and value > 0):
                raise InputError(f"{name} must be a finite number > 0, got {value!r}")
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
        if not (is_finite_real(lr_scale) and lr_scale > 0):
            raise InputError(f"lr_scale must be a finite number > 0, got {lr_scale!r}")
        if not is_finite_real(prev_logit):
            raise InputError(f"prev_logit must be a finite number, got {prev_logit!r}")
        if not is_int(channel_dim):
            raise InputError(f"channel_dim must be an integer, got {channel_dim!r}")
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
        self.state_grads = state_grads
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
        self._passes = PassStore()

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

    def _state(self, p: Pass, j: int) -> torch.Tensor:
        state = p.states[j]
        if state is None:
            raise RuntimeError(f"state x_{j} was not kept; this is a bug in ConnectivityRouter")
        return state

    def _routed(self, p: Pass, r: int, current: torch.Tensor) -> torch.Tensor:
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

    def enter(self, index: int, x: torch.Tensor) -> Pass:
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
        if in_backward():
            if index == 0:
                kept = store.find(0, x)
                tau = self.current_temperature() if kept is None else kept.temperature
                p = Pass(self.num_layers, x, tau, self._stored_states())
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
                    p = Pass(self.num_layers, None, self.current_temperature(), set())
            store.chain(p, index)
            return p
        if index == 0:
            p = self._begin(x)
        elif store.current is None:
            raise RuntimeError(f"routed block {index} ran before block 0 of its stack")
        else:
            p = store.current
        p.inputs[index] = weakref.ref(x)
        if not p.checkpointed and torch.is_grad_enabled() and saved_tensors_hooked():
            p.checkpointed = True
        return p

    def _begin(self, x: torch.Tensor) -> Pass:
        """Start a forward pass with stack input ``x``."""
        if self.training and self.final_temperature is not None and torch.is_grad_enabled():
            self.step += 1
        stored = self._stored_states()
        p = Pass(self.num_layers, x, self.current_temperature(), stored)
        if (
            self.state_grads == "deferred"
            and self._rows
            and not self.hard
            and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            p.ledger = GradientLedger(x, len(self._rows))
        self._passes.current = p
        return p

    def _check_channels(self, x: torch.Tensor) -> None:
        """Name a ``channel_dim`` / ``num_channels`` that does not fit the states."""
        if not -x.ndim <= self.channel_dim < x.ndim:
            raise InputError(
                f"channel_dim={self.channel_dim} is out of range for states of shape "
                f"{tuple(x.shape)}"
            )
        if x.shape[self.channel_dim] != self._width:
            raise InputError(
                f"num_channels={self._width}, but the states have {x.shape[self.channel_dim]} "
                f"channels on dim {self.channel_dim} (shape {tuple(x.shape)})"
            )

    def block_input(self, p: Pass, index: int, x: torch.Tensor) -> torch.Tensor:
        """The input of block ``index`` given the previous block's output ``x``."""
        if self.per_channel and index == 0:
            self._check_channels(x)
        if self.mode in _INPUT_MODES and index in self._rows:
            return self._routed(p, index, x)
        return x

    def block_output(self, p: Pass, index: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
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

    def _correction(self, p: Pass, r: int, current: torch.Tensor) -> torch.Tensor:
        """``sum_j w_j x_j`` over row ``r``'s sources (``"denseformer"``: the mixture itself)."""
        sources, coeffs = self._row_weights(r, p.temperature)
        states = [current if j == r else self._state(p, j) for j in sources]
        if (
            p.ledger is not None
            and not p.done
            and not saved_tensors_hooked()  # a checkpoint recomputes what autograd saved
            and not torch.compiler.is_compiling()
            and all(p.ledger.fits(s) for s in states)
        ):
            return deferred_routed_sum(states, coeffs, sources, r, p.ledger, self._weighted_sum)
        return self._weighted_sum(states, coeffs)

    def record(self, p: Pass, index: int, y: torch.Tensor) -> torch.Tensor:
        """Store block ``index``'s output; after the last block, return the stack output.

        A recomputed block stores nothing. After the last block the pass ends: its states are
        dropped, or kept for the recomputation if its blocks ran inside gradient checkpoints.
        """
        if not p.done and index + 1 in p.stored:
            p.states[index + 1] = y
            if p.ledger is not None and y.requires_grad and not torch.compiler.is_compiling():
                p.ledger.watch(y, index + 1)
        if index < self.num_layers - 1:
            return y
        out = self._routed(p, self.num_layers, y) if self.num_layers in self._rows else y
        if not p.done:
            self._passes.finish(p)
        return out
