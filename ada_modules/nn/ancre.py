"""ANCRe: learned residual connectivity over a stack of shape-preserving blocks.

A stack of ``K`` blocks keeps its states ``x_0`` (the stack input) and ``x_1..x_K`` (the block
outputs). A :class:`~ada_modules.nn.ancre_router.ConnectivityRouter` learns how earlier states
feed each block; a :class:`RoutedBlock` wraps one block and asks the router for its input and its
skip. The layouts (``mode``):

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
elsewhere, and under ``torch.compile``, term by term (``addcmul``). Backward, autograd gives each
state one gradient term per later row that reads it; ``state_grads="deferred"`` adds them in a few
matrix-vector products per state instead (:mod:`ada_modules.nn._ancre_deferred`).
``export_hard()`` keeps the strongest source per layer: one extra addition per re-routed layer and
only the states that some layer reads.

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

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.nn._diffusers_blocks import call_block, take_hidden_state
from ada_modules.nn.ancre_router import ConnectivityRouter

__all__ = [
    "ANCReStack",
    "RoutedBlock",
    "export_hard",
    "find_routers",
    "wrap_module_list",
]


class RoutedBlock(nn.Module):
    """One block of a routed stack: asks its router for the input, checks the shape, routes.

    The router is shared by all blocks of the stack and is not registered here (the stack or the
    wrapped model owns it). Attributes that the block has and the wrapper does not are read from
    the block, so model code that inspects its layers (``layers[0].attention_type``) still works.

    Args:
        block: The wrapped block; ``block(x, *args, **kwargs)`` returns a tensor shaped like
            ``x`` (or a tuple whose first element is). A hidden state passed as
            ``hidden_states=`` (as diffusers models do) reaches the block the same way.
        index: Position of the block in the stack.
        router: The stack's :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`.

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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x, args, kwargs, by_keyword = take_hidden_state(args, kwargs, f"routed block {self.index}")
        router: ConnectivityRouter = self._router
        p = router.enter(self.index, x)
        inputs = router.block_input(p, self.index, x)
        out = call_block(self.block, inputs, args, kwargs, by_keyword)
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
        **router_kwargs: Arguments of :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`
            (``mode``, ``temperature``, ...).

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
    routed = next((i for i, block in enumerate(blocks) if isinstance(block, RoutedBlock)), None)
    if routed is not None:
        raise InputError(
            f"block {start + routed} is already a RoutedBlock: the model is wrapped already "
            "(wrapping twice would leave the first routers in the blocks but out of the model)"
        )
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
    layout chosen by ``mode`` (see :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`); at
    init, ``"source"``, ``"input"`` and ``"denseformer"`` compute bitwise the same outputs as
    ``"residual"``.
    ``forward(x, *args, **kwargs)`` passes the extra arguments to every block.

    Args:
        blocks: The blocks (any sequence of modules, e.g. an ``nn.ModuleList``).
        **router_kwargs: Arguments of
            :class:`~ada_modules.nn.ancre_router.ConnectivityRouter` except ``num_layers``.

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
    """``(name, router)`` for every router inside ``module``.

    The routers are :class:`~ada_modules.nn.ancre_router.ConnectivityRouter` modules.

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
