"""The transformer blocks of a diffusers model that block wrappers (ANCRe, AOT-POT) can wrap."""

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
