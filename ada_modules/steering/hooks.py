"""Forward hooks that read or steer the outputs of a model's decoder layers (no patching)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from numbers import Real
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ada_modules.errors import InputError
from ada_modules.steering.vectors import SteeringVector

__all__ = ["capture_hidden_states", "decoder_layers", "steer"]

TokenScope = Literal["all", "last"] | int


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers of a transformers model (or of a model holding one).

    Looks in ``model.model`` (Llama, Qwen2, Mistral, ...), ``model.get_decoder()`` (OPT, GPT-NeoX,
    GPT-2, ...) and ``model`` itself, then in ``model.language_model`` and ``model.lm``, for a
    ``.layers`` or ``.h`` (GPT-2, GPT-J, Falcon, Bloom) ``ModuleList``.

    Raises:
        TypeError: If none is found, naming the model's class.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=3, num_attention_heads=2)
        >>> len(decoder_layers(LlamaForCausalLM(config)))
        3
    """
    for candidate in (model, getattr(model, "language_model", None), getattr(model, "lm", None)):
        if candidate is None:
            continue
        holders = [getattr(candidate, "model", None), candidate]
        if hasattr(candidate, "get_decoder"):
            holders.insert(1, candidate.get_decoder())
        for holder in holders:
            for name in ("layers", "h"):
                layers = getattr(holder, name, None)
                if isinstance(layers, nn.ModuleList):
                    return layers
    raise InputError(
        f"{type(model).__name__} has no decoder layers to hook (no .layers or .h ModuleList in "
        ".model, .get_decoder(), the model itself, .language_model or .lm)"
    )


def _checked_layers(model: nn.Module, layer_ids: list[int]) -> list[nn.Module]:
    layers = decoder_layers(model)
    for layer in layer_ids:
        if not 0 <= layer < len(layers):
            raise InputError(
                f"layer {layer} is out of range: {type(model).__name__} has {len(layers)} decoder "
                f"layers (0..{len(layers) - 1})"
            )
    return [layers[i] for i in layer_ids]


def _hidden(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def _replace_hidden(output: Any, hidden: Tensor) -> Any:
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


@contextmanager
def capture_hidden_states(model: nn.Module, layers: list[int]) -> Iterator[dict[int, list[Tensor]]]:
    """Record the output hidden states of decoder ``layers`` of every forward call in the block.

    Yields ``{layer: [tensor per call]}``, each ``(batch, seq, hidden)`` and detached. The hooks
    are removed on exit, also when the block raises. Opened inside :func:`steer`, it records
    the steered states (hooks run in the order they were registered).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=2, num_attention_heads=2)
        >>> model = LlamaForCausalLM(config)
        >>> with capture_hidden_states(model, [1]) as states:
        ...     _ = model(torch.tensor([[1, 2, 3]]))
        >>> [tuple(state.shape) for state in states[1]]  # one per forward call
        [(1, 3, 16)]
    """
    if len(set(layers)) != len(layers):
        raise InputError(f"layers must not repeat a layer, got {layers}")
    modules = _checked_layers(model, layers)
    states: dict[int, list[Tensor]] = {layer: [] for layer in layers}
    handles = []
    try:
        for layer, module in zip(layers, modules, strict=True):
            handles.append(module.register_forward_hook(partial(_record, states[layer])))
        yield states
    finally:
        for handle in handles:
            handle.remove()


def _record(states: list[Tensor], _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
    states.append(_hidden(output).detach())


def _strength_tensor(strength: float | Tensor) -> Tensor:
    if isinstance(strength, bool) or not isinstance(strength, Real | Tensor):
        raise InputError(f"strength must be a number or a tensor, got {type(strength).__name__}")
    if isinstance(strength, Tensor) and (strength.is_complex() or strength.dtype == torch.bool):
        raise InputError(f"strength must be real, got dtype {strength.dtype}")
    tensor = strength.float() if isinstance(strength, Tensor) else torch.tensor(float(strength))
    if tensor.dim() > 1:
        raise InputError(f"strength must be a scalar or (batch,), got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise InputError("strength must hold at least one value, got an empty tensor")
    if not torch.isfinite(tensor).all():
        raise InputError(f"strength must be finite, got {strength!r}")
    return tensor


def _scope_mask(token_scope: TokenScope, hidden: Tensor, kwargs: dict[str, Any]) -> Tensor | None:
    """``(batch or 1, seq, 1)`` of the positions to steer; ``None``: every position."""
    if token_scope == "all":
        return None
    seq = hidden.shape[1]
    if token_scope == "last":
        mask = torch.zeros(1, seq, 1, dtype=torch.bool, device=hidden.device)
        mask[:, -1] = True
        return mask
    positions = kwargs.get("position_ids")
    if positions is None:
        raise InputError(
            f"token_scope={token_scope} needs the decoder layers to receive position_ids; "
            "use 'all' or 'last' for this model"
        )
    return (positions >= token_scope).reshape(-1, seq, 1)


@contextmanager
def steer(
    model: nn.Module,
    vector: SteeringVector,
    strength: float | Tensor = 1.0,
    token_scope: TokenScope = "all",
) -> Iterator[None]:
    """Add ``strength * direction`` to the output of each steered decoder layer inside the block.

    Works with ``model(...)`` and ``model.generate(...)`` (any KV cache): a forward hook on each
    layer of ``vector`` adds the direction at the positions ``token_scope`` selects. The model's
    parameters are not touched, and the hooks are removed on exit, also when the block raises.

    Args:
        model: A transformers causal LM (or a model holding one, see :func:`decoder_layers`).
        vector: The directions, by layer index.
        strength: One multiplier, or one per batch row (``(batch,)``), e.g. from
            :func:`~ada_modules.steering.mcr_scaled_strength`. A batch that is a whole
            multiple ``k`` of its length gets each entry for ``k`` consecutive rows, as
            ``generate`` repeats each prompt for beam search and ``num_return_sequences``.
        token_scope: ``all`` positions; ``last``: the last position of each forward call (the
            end of the prompt, then each generated token when decoding with a cache; without a
            cache, ``generate`` recomputes the earlier generated tokens unsteered, and ``steer``
            warns); an int ``k``: positions ``>= k`` (from the layers' ``position_ids``, which
            ``generate`` derives from the attention mask but a plain ``model(...)`` call does
            not: pass ``position_ids`` for a left-padded batch).

    Raises:
        ValueError: If a layer is out of range, ``strength`` is not a finite real number or
            tensor or ``token_scope`` is unknown (on entry); if the vector's width is not the
            steered layer's output width (the hidden size; ``n * hidden`` for multi-stream
            layers) or a per-row strength does not match the batch (at the first forward call);
            if an int ``token_scope`` selected no token in any forward call of the block (on
            exit). The hooks are gone in each case.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=2, num_attention_heads=2)
        >>> model = LlamaForCausalLM(config).eval()
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> vector = SteeringVector({1: torch.ones(16)})
        >>> with steer(model, vector, strength=4.0, token_scope="last"):
        ...     steered = model(ids).logits
        >>> plain = model(ids).logits
        >>> bool(torch.equal(steered[:, :2], plain[:, :2])), bool(torch.equal(steered, plain))
        (True, False)
    """
    if not (token_scope in ("all", "last") or (type(token_scope) is int and token_scope >= 0)):
        raise InputError(f"token_scope must be 'all', 'last' or an int >= 0, got {token_scope!r}")
    scale = _strength_tensor(strength)
    modules = _checked_layers(model, vector.layers)
    hooks = [
        _SteeringHook(vector, layer, scale, token_scope, watch_cache=i == 0)
        for i, layer in enumerate(vector.layers)
    ]
    handles = []
    try:
        for hook, module in zip(hooks, modules, strict=True):
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
    if type(token_scope) is int and sum(hook.selected for hook in hooks) == 0:
        raise InputError(
            f"token_scope={token_scope} selected no token: every position seen was below it"
        )


class _SteeringHook:
    """Adds ``scale * direction`` of one layer at the scoped positions; counts them. With
    ``watch_cache``, warns once when ``last`` meets a generation without a KV cache."""

    def __init__(
        self,
        vector: SteeringVector,
        layer: int,
        scale: Tensor,
        token_scope: TokenScope,
        watch_cache: bool,
    ) -> None:
        self.direction = vector.directions[layer]
        self.layer = layer
        self.scale = scale
        self.token_scope = token_scope
        self.watch_cache = watch_cache and token_scope == "last"
        self.previous_length: int | None = None
        self.selected = 0

    def __call__(
        self, _module: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        hidden = _hidden(output)
        if hidden.shape[-1] != self.direction.numel():
            raise InputError(
                f"the steering vector's width {self.direction.numel()} differs from layer "
                f"{self.layer}'s output width {hidden.shape[-1]}"
            )
        if self.watch_cache:
            self._warn_without_cache(hidden.shape[1])
        factor = self.scale.to(hidden.device, torch.float32)
        if factor.dim() == 1:
            rows = hidden.shape[0]
            if rows % factor.numel() != 0:
                raise InputError(
                    f"strength has {factor.numel()} entries but the batch has {rows} rows: it "
                    "needs one per row, or one per prompt of a batch that repeats each prompt "
                    "a whole number of times in a row (beams, num_return_sequences)"
                )
            factor = factor.repeat_interleave(rows // factor.numel()).view(-1, 1, 1)
        delta = factor * self.direction.to(hidden.device, torch.float32)
        mask = _scope_mask(self.token_scope, hidden, kwargs)
        if mask is not None:
            delta = delta * mask
            self.selected += int(mask.sum())
        else:
            self.selected += hidden.shape[1]
        return _replace_hidden(output, (hidden.float() + delta).to(hidden.dtype))

    def _warn_without_cache(self, length: int) -> None:
        """A call one token longer than the previous one re-runs the sequence without a cache."""
        if self.previous_length is not None and length == self.previous_length + 1:
            warnings.warn(
                "token_scope='last' steers only the last position of each forward call, and a "
                "generation without a KV cache (use_cache=False) recomputes the earlier "
                "generated positions unsteered at each step; generate with a cache, or pass "
                "token_scope=<prompt length - 1> to steer the prompt's end and every generated "
                "token",
                stacklevel=2,
            )
            self.watch_cache = False
        self.previous_length = length
