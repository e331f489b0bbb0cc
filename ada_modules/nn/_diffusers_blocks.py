"""The transformer blocks of a diffusers model that block wrappers (ANCRe, AOT-POT) can wrap, and
how a wrapper takes their hidden state (first, or as ``hidden_states=`` as diffusers passes it)
and hands it on the same way."""

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ada_modules.errors import InputError

# diffusers blocks that take encoder_hidden_states and return (encoder_hidden_states,
# hidden_states): their model reads the hidden state from the tuple's second element
ENCODER_FIRST_BLOCKS = frozenset(
    {
        "BriaFiboTransformerBlock",
        "BriaTransformerBlock",
        "ChromaTransformerBlock",
        "Flux2TransformerBlock",
        "FluxTransformerBlock",
        "JointTransformerBlock",  # SD3
        "LongCatImageTransformerBlock",
        "OvisImageTransformerBlock",
        "QwenImageTransformerBlock",
    }
)


def take_hidden_state(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], who: str
) -> tuple[torch.Tensor, tuple[Any, ...], dict[str, Any], bool]:
    """The hidden state a wrapper was called with, the other arguments, and whether it came as
    ``hidden_states=`` (else it is the first positional argument).

    Raises:
        InputError: Naming ``who``, if there is neither.

    Examples:
        >>> take_hidden_state((), {"hidden_states": 1, "temb": 2}, "block 0")
        (1, (), {'temb': 2}, True)
    """
    if "hidden_states" in kwargs:
        rest = dict(kwargs)
        return rest.pop("hidden_states"), tuple(args), rest, True
    if args:
        return args[0], tuple(args[1:]), dict(kwargs), False
    raise InputError(f"{who} got no hidden state: pass it first or as hidden_states=")


def call_block(
    block: nn.Module,
    hidden: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    by_keyword: bool,
) -> Any:
    """``block`` called with ``hidden`` the way the wrapper got its own (see
    :func:`take_hidden_state`)."""
    if by_keyword:
        return block(*args, hidden_states=hidden, **kwargs)
    return block(hidden, *args, **kwargs)


def wrappable_transformer_blocks(model: nn.Module) -> tuple[nn.ModuleList, int]:
    """``model.transformer_blocks`` and their width ``model.inner_dim``, checked for wrapping.

    Raises:
        InputError: Naming the model, if it has no ``transformer_blocks`` ``nn.ModuleList``, no
            integer ``inner_dim``, or blocks that return ``(encoder_hidden_states,
            hidden_states)`` (SD3, Flux, ...), whose hidden state a wrapper cannot take first.
    """
    name = type(model).__name__
    blocks = getattr(model, "transformer_blocks", None)
    width = getattr(model, "inner_dim", None)
    if not isinstance(blocks, nn.ModuleList):
        raise InputError(f"{name} has no transformer_blocks ModuleList")
    if isinstance(width, bool) or not isinstance(width, int):
        raise InputError(
            f"{name} has transformer_blocks but no integer inner_dim (the blocks' width), "
            f"got inner_dim={width!r}"
        )
    dual = next(
        (type(b).__name__ for b in blocks if type(b).__name__ in ENCODER_FIRST_BLOCKS), None
    )
    if dual is not None:
        raise InputError(
            f"{name} is not supported: its blocks ({dual}) take encoder_hidden_states and return "
            "the tuple (encoder_hidden_states, hidden_states): the model reads the hidden state "
            "from the second element, past the wrapper; only blocks that return the hidden state "
            "(or a tuple that starts with it) can be wrapped"
        )
    return blocks, width
