"""Multi-stream residuals (Hyper-Connections, mHC) on existing models: HF decoders, timm, DiT.

Each adapter replaces the blocks of a model in place by :class:`StreamBlock` wrappers, without
copying or forking the model's code: the model's own loop over its layers runs the multi-stream
stack (:mod:`ada_modules.nn.multistream`). Wrap after loading weights: a wrapped block's
parameters are renamed ``<layer>.block.<name>`` and its connection weights are
``<layer>.streams.<name>``.

Block level: third-party blocks add their input inside the block (``out = x + attn(...);
out = out + mlp(...)``) and expose no hook between their sub-layers, so each whole block is one
branch ``F(h) = block(h) - h`` with one aggregation and one redistribution per block, not one per
sub-layer as in the papers (which would need the model's code to be rewritten). The subtraction
is exact in fp32 up to rounding; in bf16 it costs the block's rounding once more.

Streams across the model's loop: the model calls each layer with one hidden-state tensor
``(batch, ..., dim)`` (first, or as ``hidden_states=``) and passes the result on. The first
wrapped layer expands the hidden state into ``n`` equal streams, the layers in between carry the
streams packed along the channel axis, ``(batch, ..., n * dim)`` (stream-major: ``[..., s * dim
+ c]`` is channel ``c`` of stream ``s``), and the last wrapped layer returns the stream mean
``(batch, ..., dim)``. Batch and positions keep their axes, so attention masks, rotary
embeddings, KV caches (``generate`` with a ``DynamicCache``), timestep and class conditioning, and
gradient checkpointing (transformers ``activation_checkpointing_enable()``, timm
``set_grad_checkpointing()``, diffusers ``enable_gradient_checkpointing()``, before or after
wrapping) work unchanged. The model must call all wrapped layers, in order, once per forward
pass: what runs between two wrapped layers (hooks on the wrappers, ``forward_intermediates``) sees
the packed streams. Hooks on the blocks themselves (transformers' ``output_hidden_states``) see
each block's own output ``block(h)``. A block that returns a tuple (older transformers layers)
keeps its other elements; the hidden state must be the first (blocks returning
``(encoder_hidden_states, hidden_states)``, as in SD3 and Flux, are rejected).

The connection weights are float32 (cast where used) and claim the ``"routing"`` role of
:func:`~ada_modules.optim.param_groups.geometry_param_groups`, like ANCRe's coefficients, so
that they are never spectrally normed nor given to Muon as hidden matrices.

At init the streams stay equal, so the wrapped model computes what it computed before up to
rounding (about 1e-6 relative in fp32). ``disable=True`` calls every block as it is (one stream,
no parameters): bitwise the original model. Decoders reject ``dynamic="pooled"``: its weights
average over all positions, which would let a causal LM see the future (and break KV caches).

- :func:`wrap_hf_decoder_streams`: the decoder layers of a transformers ``LlamaForCausalLM`` /
  ``Qwen2ForCausalLM`` (any causal LM whose decoder has ``.layers``, LLaVA-style models too).
- :func:`wrap_timm_streams`: the ``.blocks`` of a timm ViT-like model.
- :func:`wrap_diffusers_dit_streams`: ``transformer_blocks`` of diffusers'
  ``DiTTransformer2DModel`` (PixArt, Allegro, CogView3Plus: blocks that return the hidden state).
- :class:`StreamsWrapper`: picks the adapter from the model; a callable that YAML can set
  (``CausalLMModule(model_wrapper=...)``).
- :class:`MLPStreamNet`: the blocks of :class:`~ada_modules.nn.MLPResNet` with multi-stream
  residuals (the digits reproduction, ``ImageClassifierModule(trunk=...)``).
- :func:`stream_no_weight_decay`: the static connection weights of a module, by qualified name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.nn._diffusers_blocks import (
    call_block,
    take_hidden_state,
    wrappable_transformer_blocks,
)
from ada_modules.nn.ancre_adapters import mlp_blocks
from ada_modules.nn.multistream import (
    Dynamic,
    DynamicInput,
    Kind,
    Mixing,
    MultiStreamResidual,
    MultiStreamStack,
    expand_streams,
    reduce_streams,
)

__all__ = [
    "MLPStreamNet",
    "StreamBlock",
    "StreamsWrapper",
    "stream_no_weight_decay",
    "wrap_diffusers_dit_streams",
    "wrap_hf_decoder_streams",
    "wrap_timm_streams",
]

_SET_BY_ADAPTER = ("layer_index", "channel_first")


class _BlockDelta(nn.Module):
    """The branch ``F(h) = block(h) - h`` of a block that adds its input itself.

    The block is not registered here (its :class:`StreamBlock` owns it). Outputs of the block
    beyond the hidden state (a tuple's other elements) are kept in ``extras`` for the wrapper.
    """

    def __init__(self, block: nn.Module, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "_block", block)
        self.index = index
        self.extras: tuple[type, list[Any]] | None = None

    def forward(
        self, h: torch.Tensor, *args: Any, hidden_by_keyword: bool = False, **kwargs: Any
    ) -> torch.Tensor:
        block: nn.Module = self._block
        out = call_block(block, h, args, kwargs, hidden_by_keyword)
        is_tuple = isinstance(out, tuple | list)
        y = out[0] if is_tuple else out
        if not isinstance(y, torch.Tensor) or y.shape != h.shape:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            what = "the first element of its tuple" if is_tuple else "its output"
            raise InputError(
                f"block {self.index} ({type(block).__name__}) returned shape {got} ({what}, taken "
                f"as the hidden state) for an input of shape {tuple(h.shape)}; blocks with stream "
                "residuals must preserve the shape"
            )
        self.extras = (type(out), list(out[1:])) if is_tuple else None
        return y - h


class StreamBlock(nn.Module):
    """One block of a model's own layer loop, with a multi-stream residual around it.

    Takes the hidden state ``(batch, ..., dim)`` if it is the first wrapped block, else the packed
    streams ``(batch, ..., n_streams * dim)``, as the first positional argument or as
    ``hidden_states=`` (the block gets its input the same way); returns the packed streams, or
    the stream mean if it is the last (see the module docstring). The block is the branch
    ``F(h) = block(h) - h``.
    Attributes that the block has and the wrapper does not are read from the block, so model code
    that inspects its layers (``layers[0].attention_type``, ``blocks[0].norm1``) still works.

    Args:
        block: The wrapped block; ``block(x, *args, **kwargs)`` returns a tensor shaped like ``x``
            (or a tuple whose first element is) and includes its own residual addition.
        index: Position of the block among the wrapped blocks.
        num_blocks: Number of wrapped blocks (the last one reduces the streams).
        dim: Channels of the hidden state (its last axis).
        n_streams: Number of streams (set to 1 by ``disable=True``).
        **stream_kwargs: Arguments of :class:`~ada_modules.nn.multistream.MultiStreamResidual`
            (``kind``, ``mixing``, ``dynamic``, ``dynamic_input``, ``dynamic_scale``,
            ``sinkhorn_iters``, ``disable``); ``layer_index`` is ``index``.

    Raises:
        ValueError: If an argument is out of range, naming it; in forward, if the input's last
            axis is not the expected width or the block changes the shape.

    Examples:
        >>> import torch
        >>> block = nn.Linear(4, 4)
        >>> layer = StreamBlock(block, 0, 1, dim=4, n_streams=2, kind="hyper")
        >>> x = torch.randn(3, 4)
        >>> bool(torch.allclose(layer(x), block(x), atol=1e-6))  # equal streams at init
        True
        >>> sorted(layer.no_weight_decay())
        ['streams.dynamic_alpha', 'streams.post_static', 'streams.pre_static', 'streams.res_static']
    """

    def __init__(
        self,
        block: nn.Module,
        index: int,
        num_blocks: int,
        dim: int,
        n_streams: int = 4,
        **stream_kwargs: Any,
    ) -> None:
        super().__init__()
        if not isinstance(block, nn.Module):
            raise InputError(f"block {index} must be an nn.Module, got {type(block).__name__}")
        for name in _SET_BY_ADAPTER:
            if name in stream_kwargs:
                raise InputError(f"{name} is set by the stream adapter; do not pass it")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InputError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_blocks:
            raise InputError(f"index must be an integer in [0, {num_blocks}), got {index!r}")
        n = 1 if stream_kwargs.get("disable") else n_streams
        self.block = block
        self.index, self.num_blocks = index, num_blocks
        self.streams = MultiStreamResidual(
            _BlockDelta(block, index), dim, n, layer_index=index, **stream_kwargs
        )
        self.dim, self.n_streams, self.disable = dim, n, self.streams.disable

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["block"], name)

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this wrapper) of the static connection weights."""
        return {f"streams.{name}" for name in self.streams.no_weight_decay()}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.disable:
            return self.block(*args, **kwargs)
        x, args, kwargs, by_keyword = take_hidden_state(args, kwargs, f"stream block {self.index}")
        n, dim = self.n_streams, self.dim
        first, last = self.index == 0, self.index == self.num_blocks - 1
        width = dim if first else n * dim
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != width:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            what = "the hidden state" if first else f"{n} packed streams"
            raise InputError(
                f"stream block {self.index} of {self.num_blocks} expected {what} with {width} "
                f"channels on the last axis, got shape {got}; the model must call every "
                "wrapped block, in order, once per forward pass, and pass on what each returns (a "
                "block that returns a tuple must return the hidden state first)"
            )
        # streams: (batch, n, ..., dim)
        streams = expand_streams(x, n) if first else x.unflatten(-1, (n, dim)).movedim(-2, 1)
        branch: _BlockDelta = self.streams.branch
        branch.extras = None
        out = self.streams(streams, *args, hidden_by_keyword=by_keyword, **kwargs)
        extras, branch.extras = branch.extras, None
        y = reduce_streams(out) if last else out.movedim(1, -2).flatten(-2)
        if extras is not None:
            kind, rest = extras
            return kind([y, *rest])
        return y


def stream_no_weight_decay(module: nn.Module) -> set[str]:
    """Qualified names (relative to ``module``) of the static connection weights inside it.

    Covers every :class:`~ada_modules.nn.multistream.MultiStreamResidual` in ``module``: the
    wrapped blocks of the adapters, :class:`MLPStreamNet` and any ``MultiStreamStack``.

    Examples:
        >>> net = MLPStreamNet(8, depth=2)
        >>> sorted(stream_no_weight_decay(nn.Sequential(net)))[:2]
        ['0.layers.0.dynamic_alpha', '0.layers.0.post_static']
    """
    names = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, MultiStreamResidual):
            dot = f"{prefix}." if prefix else ""
            names |= {dot + name for name in sub.no_weight_decay()}
    return names


class _NoWeightDecay:
    """``no_weight_decay()`` of a wrapped model: its own names and the streams' (picklable)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def __call__(self) -> set[str]:
        return set(self.names)


def _wrap_blocks(
    model: nn.Module,
    container: nn.ModuleList | nn.Sequential,
    dim: int,
    n_streams: int,
    stream_kwargs: dict[str, Any],
) -> nn.Module:
    """Replace ``container``'s blocks by :class:`StreamBlock` wrappers; set the model's
    ``no_weight_decay()``. Returns ``model``."""
    blocks = list(container)
    if not blocks:
        raise InputError(f"{type(model).__name__} has no blocks to wrap")
    if any(isinstance(block, StreamBlock) for block in blocks):
        raise InputError(f"{type(model).__name__} already has stream residuals")
    wrapped = [
        StreamBlock(block, i, len(blocks), dim, n_streams, **stream_kwargs)
        for i, block in enumerate(blocks)
    ]
    param = next((p for block in blocks for p in block.parameters()), None)
    for i, layer in enumerate(wrapped):
        if param is not None:  # the model may already be on its device (stream weights: fp32)
            layer.streams.to(param.device)
        container[i] = layer
    own = getattr(model, "no_weight_decay", None)
    names = set(own()) if callable(own) else set()
    model.no_weight_decay = _NoWeightDecay(names | stream_no_weight_decay(model))
    return model


def wrap_hf_decoder_streams(
    model: nn.Module, n_streams: int = 4, **stream_kwargs: Any
) -> nn.Module:
    """Put multi-stream residuals around the decoder layers of a transformers causal LM.

    In place; returns ``model``. Works on models whose decoder (``model.model`` or
    ``model.get_decoder()``) holds its layers in ``.layers`` and adds each layer's input inside
    the layer (Llama, Qwen2, Mistral, ..., and the language model of LLaVA-style models, of width
    ``config.get_text_config().hidden_size``). ``generate`` and KV caches work unchanged (the
    connections are per position). ``model.no_weight_decay()`` names the static connection
    weights (``model.layers.<i>.streams.pre_static``, ...).

    Args:
        model: E.g. ``LlamaForCausalLM(config)``.
        n_streams: Number of streams.
        **stream_kwargs: Arguments of :class:`~ada_modules.nn.multistream.MultiStreamResidual`
            (``kind``, ``mixing``, ``dynamic`` other than ``"pooled"``, ``dynamic_input``,
            ``dynamic_scale``, ``sinkhorn_iters``, ``disable``).

    Raises:
        ValueError: If the model has no decoder with ``.layers`` (naming the model's type), or a
            stream argument is out of range.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=3, num_attention_heads=2)
        >>> model = LlamaForCausalLM(config).eval()
        >>> ids = torch.randint(0, 32, (1, 5))
        >>> before = model(ids).logits
        >>> model = wrap_hf_decoder_streams(model, n_streams=4, kind="mhc")
        >>> type(model.model.layers[0]).__name__
        'StreamBlock'
        >>> bool(torch.allclose(model(ids).logits, before, atol=1e-5))
        True
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) and hasattr(model, "get_decoder"):
        layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise InputError(
            f"{type(model).__name__} has no decoder with a .layers ModuleList (neither "
            "model.model.layers nor model.get_decoder().layers)"
        )
    if stream_kwargs.get("dynamic") == "pooled" and not stream_kwargs.get("disable"):
        raise InputError(
            "dynamic='pooled' averages over all positions, which a causal decoder must not see "
            "(and which KV caches cannot reproduce); use dynamic='token' or 'none'"
        )
    width = int(model.config.get_text_config().hidden_size)  # LLaVA: the text_config's
    return _wrap_blocks(model, layers, width, n_streams, stream_kwargs)


def wrap_timm_streams(model: nn.Module, n_streams: int = 4, **stream_kwargs: Any) -> nn.Module:
    """Put multi-stream residuals around the ``.blocks`` of a timm ViT-like model, in place.

    Returns ``model``. The blocks (an ``nn.Sequential`` or ``nn.ModuleList`` of transformer
    blocks of width ``model.embed_dim``) are wrapped in place; ``set_grad_checkpointing()`` works
    before or after wrapping. ``model.no_weight_decay()`` (what timm's optimizer factory reads)
    names the model's own parameters (``pos_embed``, ``cls_token``, ...) and the static
    connection weights.

    Args:
        model: E.g. ``timm.models.VisionTransformer(...)``.
        n_streams: Number of streams.
        **stream_kwargs: Arguments of :class:`~ada_modules.nn.multistream.MultiStreamResidual`.

    Raises:
        ValueError: If the model has no ``.blocks`` with an ``embed_dim`` (naming its type), or a
            stream argument is out of range.

    Examples:
        >>> import timm
        >>> vit = timm.models.VisionTransformer(img_size=16, patch_size=8, embed_dim=16,
        ...                                     depth=3, num_heads=2, num_classes=4)
        >>> vit = wrap_timm_streams(vit, n_streams=2, kind="hyper")
        >>> "blocks.2.streams.res_static" in vit.no_weight_decay()
        True
    """
    blocks = getattr(model, "blocks", None)
    width = getattr(model, "embed_dim", None)
    if not isinstance(blocks, nn.Sequential | nn.ModuleList) or not isinstance(width, int):
        raise InputError(f"{type(model).__name__} is not ViT-like (no .blocks of width .embed_dim)")
    return _wrap_blocks(model, blocks, width, n_streams, stream_kwargs)


def wrap_diffusers_dit_streams(
    model: nn.Module, n_streams: int = 4, **stream_kwargs: Any
) -> nn.Module:
    """Put multi-stream residuals around the ``transformer_blocks`` of a diffusers DiT, in place.

    For ``DiTTransformer2DModel`` and other models with ``transformer_blocks`` of width
    ``inner_dim`` whose blocks return the hidden state (or a tuple that starts with it), e.g.
    ``PixArtTransformer2DModel``, ``AllegroTransformer3DModel``, ``CogView3PlusTransformer2DModel``.
    The model's own loop calls each block with its timestep, class labels or text states; those
    arguments pass through the wrappers. Returns ``model``. Dual-stream blocks that return
    ``(encoder_hidden_states, hidden_states)`` (SD3, Flux, QwenImage, ...) are rejected.

    Args:
        model: A model with a ``transformer_blocks`` ``nn.ModuleList`` and ``inner_dim``.
        n_streams: Number of streams.
        **stream_kwargs: Arguments of :class:`~ada_modules.nn.multistream.MultiStreamResidual`.

    Raises:
        ValueError: If the model has no ``transformer_blocks`` or no ``inner_dim``, or its blocks
            return ``(encoder_hidden_states, hidden_states)`` (naming its type), or a stream
            argument is out of range.

    Examples:
        >>> from diffusers import DiTTransformer2DModel
        >>> dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8,
        ...     in_channels=4, num_layers=2, sample_size=8, norm_num_groups=4,
        ...     num_embeds_ada_norm=10)
        >>> dit = wrap_diffusers_dit_streams(dit, n_streams=3)
        >>> dit.transformer_blocks[1].streams.n_streams
        3
    """
    blocks, width = wrappable_transformer_blocks(model)
    return _wrap_blocks(model, blocks, width, n_streams, stream_kwargs)


class StreamsWrapper:
    """Puts multi-stream residuals around a model's blocks when called on it.

    Picks the adapter from the model: diffusers DiT (``transformer_blocks``), timm ViT-like
    (``blocks``), or a transformers causal LM (``model`` or ``get_decoder()``). A callable with
    the connections' settings, for YAML (``CausalLMModule(model_wrapper=...)``). The settings are
    checked when it is built.

    Args:
        n_streams: Number of streams.
        kind: ``"hyper"`` (Hyper-Connections) or ``"mhc"`` (manifold-constrained).
        mixing: How ``"mhc"`` makes the mixing matrix doubly stochastic: ``"sinkhorn"``,
            ``"sinkhorn_log"`` or ``"permutation"``.
        dynamic: ``"none"``, ``"token"`` or ``"pooled"`` (not for decoders) input-dependent
            weights.
        dynamic_input: ``"stream"`` or ``"flat"`` features of the dynamic weights.
        dynamic_scale: Initial scale of the dynamic terms.
        sinkhorn_iters: Sinkhorn iterations.
        disable: Call the blocks as they are (bitwise the original model; no parameters).

    Raises:
        ValueError: If a setting is out of range, naming it; when called, if the model is of none
            of the supported kinds (naming its type).

    Examples:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
        >>> model = StreamsWrapper(n_streams=2)(Qwen2ForCausalLM(config))
        >>> type(model.model.layers[0]).__name__
        'StreamBlock'

        In YAML::

            model_wrapper:
              class_path: ada_modules.nn.StreamsWrapper
              init_args: {n_streams: 4, kind: mhc, dynamic: token}
    """

    def __init__(
        self,
        n_streams: int = 4,
        kind: Kind = "mhc",
        mixing: Mixing = "sinkhorn",
        dynamic: Dynamic = "token",
        dynamic_input: DynamicInput = "stream",
        dynamic_scale: float = 1e-2,
        sinkhorn_iters: int = 20,
        disable: bool = False,
    ) -> None:
        self.n_streams = n_streams
        self.stream_kwargs: dict[str, Any] = {
            "kind": kind,
            "mixing": mixing,
            "dynamic": dynamic,
            "dynamic_input": dynamic_input,
            "dynamic_scale": dynamic_scale,
            "sinkhorn_iters": sinkhorn_iters,
            "disable": disable,
        }
        # Check the settings now (config time), not when the model is built.
        MultiStreamResidual(nn.Identity(), 1, 1 if disable else n_streams, **self.stream_kwargs)

    def __call__(self, model: nn.Module) -> nn.Module:
        """Wrap ``model`` in place with the adapter that fits it; return it."""
        if hasattr(model, "transformer_blocks"):
            return wrap_diffusers_dit_streams(model, self.n_streams, **self.stream_kwargs)
        if hasattr(model, "blocks"):
            return wrap_timm_streams(model, self.n_streams, **self.stream_kwargs)
        if hasattr(model, "model") or hasattr(model, "get_decoder"):
            return wrap_hf_decoder_streams(model, self.n_streams, **self.stream_kwargs)
        raise InputError(
            f"{type(model).__name__} is none of the supported models: a transformers causal LM "
            "(a decoder with .layers), a timm ViT-like model (.blocks) or a diffusers DiT "
            "(.transformer_blocks)"
        )


class MLPStreamNet(MultiStreamStack):
    """A deep MLP trunk with multi-stream residuals around ``F_i = Linear(ReLU(Linear(LN(x))))``.

    The blocks of :class:`~ada_modules.nn.MLPResNet` (each a sub-layer without its own residual)
    in a :class:`~ada_modules.nn.multistream.MultiStreamStack`: expand to ``n_streams`` streams,
    the ``depth`` layers, the stream mean. At init it computes the plain residual MLP up to
    rounding. Built with the width as first argument, so it is a ``Callable[[int], nn.Module]``
    for ``ImageClassifierModule(trunk=...)``.

    Args:
        width: Input and output width.
        depth: Number of blocks.
        expansion: Hidden width of each block as a multiple of ``width``.
        norm: Begin each branch with a ``LayerNorm`` (see :func:`mlp_blocks`).
        n_streams: Number of streams.
        kind: ``"hyper"`` (Hyper-Connections) or ``"mhc"`` (manifold-constrained).
        mixing: How ``"mhc"`` makes the mixing matrix doubly stochastic.
        dynamic: ``"none"``, ``"token"`` or ``"pooled"`` input-dependent weights (for a
            ``(batch, width)`` input, ``"token"`` and ``"pooled"`` are both per sample).
        dynamic_input: ``"stream"`` or ``"flat"`` features of the dynamic weights.
        dynamic_scale: Initial scale of the dynamic terms.
        sinkhorn_iters: Sinkhorn iterations.
        disable: The plain residual MLP (one stream, no connection parameters).

    Raises:
        ValueError: If ``width``, ``depth`` or ``expansion`` is below 1, or a stream argument is
            out of range.

    Examples:
        >>> import torch
        >>> trunk = MLPStreamNet(16, depth=4, kind="hyper")
        >>> trunk(torch.zeros(3, 16)).shape
        torch.Size([3, 16])
        >>> len(trunk.no_weight_decay())
        16

        In YAML (``ImageClassifierModule``)::

            trunk:
              class_path: ada_modules.nn.MLPStreamNet
              init_args: {depth: 16, n_streams: 4, kind: mhc}
    """

    def __init__(
        self,
        width: int,
        depth: int = 16,
        expansion: int = 1,
        norm: bool = True,
        n_streams: int = 4,
        kind: Kind = "mhc",
        mixing: Mixing = "sinkhorn",
        dynamic: Dynamic = "token",
        dynamic_input: DynamicInput = "stream",
        dynamic_scale: float = 1e-2,
        sinkhorn_iters: int = 20,
        disable: bool = False,
    ) -> None:
        blocks = mlp_blocks(width, depth, expansion, norm)
        super().__init__(
            blocks,
            width,
            n_streams,
            kind=kind,
            mixing=mixing,
            dynamic=dynamic,
            dynamic_input=dynamic_input,
            dynamic_scale=dynamic_scale,
            sinkhorn_iters=sinkhorn_iters,
            disable=disable,
        )
