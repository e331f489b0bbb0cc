"""Learned residual connectivity (ANCRe) on existing models: HF decoders, timm, diffusers DiT.

Each adapter replaces the blocks of a model in place by
:class:`~ada_modules.nn.ancre.RoutedBlock` wrappers and registers one
:class:`~ada_modules.nn.ancre_router.ConnectivityRouter` on the model, without copying or forking
the model's code: its own loop over its layers runs the routed stack. At init
the wrapped model computes exactly what it computed before (modes ``"source"``, ``"input"``,
``"denseformer"``). Wrap after loading weights: the wrapped blocks' parameters are renamed
``<layer>.block.<name>``. Gradient checkpointing works with every adapter, switched on before or
after wrapping (timm ``set_grad_checkpointing()``, diffusers ``enable_gradient_checkpointing()``,
transformers ``activation_checkpointing_enable()``), and gives the same gradients as without it.
An adapter whose ``"source"`` layout would route nothing (a single routed block, e.g. the stages
of a resnet18) warns instead of silently adding no parameters.

- :func:`wrap_hf_decoder`: the decoder layers of a transformers ``LlamaForCausalLM`` /
  ``Qwen2ForCausalLM`` (any model whose decoder has ``.layers``); router at
  ``<decoder>.connectivity``.
- :func:`wrap_timm`: a timm ViT-like model (``.blocks``; router at ``model.connectivity``),
  ResNet (the shape-preserving blocks ``layerN[1:]`` of each stage, one router per stage at
  ``model.connectivity[N-1]``), ConvNeXt or Swin (the blocks ``stages[i].blocks`` /
  ``layers[i].blocks`` after each stage's downsampling, routers at ``model.connectivity[i]``).
- :func:`wrap_diffusers_dit`: ``transformer_blocks`` of diffusers' ``DiTTransformer2DModel``.
- :class:`ConnectivityWrapper`: picks the adapter from the model; a callable that YAML can set
  (``CausalLMModule(model_wrapper=...)``).
- :class:`MLPResNet`: a deep residual MLP trunk with a selectable layout (the digits
  reproduction, ``ImageClassifierModule(trunk=...)``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import nn

from ada_modules.errors import InputError
from ada_modules.kernels import Impl
from ada_modules.nn._diffusers_blocks import wrappable_transformer_blocks
from ada_modules.nn.ancre import ANCReStack, RoutedBlock, wrap_module_list
from ada_modules.nn.ancre_router import MODES, ConnectivityRouter, Mode, StateGrads

__all__ = [
    "ConnectivityWrapper",
    "MLPResNet",
    "mlp_blocks",
    "wrap_diffusers_dit",
    "wrap_hf_decoder",
    "wrap_timm",
]


def _channel_kwargs(router_kwargs: dict[str, Any], channels: int, dim: int) -> dict[str, Any]:
    if router_kwargs.get("per_channel"):
        return {"num_channels": channels, "channel_dim": dim, **router_kwargs}
    return router_kwargs


def _decoder(model: nn.Module) -> nn.Module | None:
    """The module holding a transformers model's decoder ``.layers`` (``None``: there is none)."""
    decoder = getattr(model, "model", None)
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList) and hasattr(
        model, "get_decoder"
    ):
        decoder = model.get_decoder()  # LLaVA-style: model.model holds the language model
    return decoder if isinstance(getattr(decoder, "layers", None), nn.ModuleList) else None


def wrap_hf_decoder(model: nn.Module, **router_kwargs: Any) -> nn.Module:
    """Route the decoder layers of a transformers causal LM in place; returns ``model``.

    Works on models whose decoder (``model.model`` or ``model.get_decoder()``) holds its layers
    in ``.layers`` and adds each layer's input inside the layer (Llama, Qwen2, Mistral, ..., and
    the language model of LLaVA-style models).
    ``generate`` and KV caches work unchanged (the routing is per position).

    Args:
        model: E.g. ``LlamaForCausalLM(config)``.
        **router_kwargs: Arguments of :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`
            (``num_channels`` and ``channel_dim`` are filled in for ``per_channel=True``).

    Raises:
        TypeError: If the model has no decoder with ``.layers``.

    Examples:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=3, num_attention_heads=2)
        >>> model = wrap_hf_decoder(LlamaForCausalLM(config), mode="source")
        >>> model.model.connectivity.num_layers
        3
    """
    decoder = _decoder(model)
    if decoder is None:
        raise InputError(
            f"{type(model).__name__} has no decoder with a .layers ModuleList (neither "
            "model.model.layers nor model.get_decoder().layers)"
        )
    layers = decoder.layers
    hidden = int(model.config.get_text_config().hidden_size)
    router = wrap_module_list(layers, decoder, **_channel_kwargs(router_kwargs, hidden, -1))
    why = f"its decoder has one layer and {_SINGLE_SOURCE}"
    _warn_if_nothing_routed("wrap_hf_decoder", model, [router], router.mode, why, _USE_INPUT)
    return model


def _model_name(model: nn.Module) -> str:
    cfg = getattr(model, "pretrained_cfg", None)
    name = cfg.get("architecture") if isinstance(cfg, dict) else None
    return str(name or type(model).__name__)


def _warn_if_nothing_routed(
    adapter: str,
    model: nn.Module,
    routers: Sequence[ConnectivityRouter],
    mode: str,
    why: str,
    alternative: str,
) -> None:
    """Warn when ``mode`` adds no routing at all to ``model`` (a silent no-op otherwise)."""
    if mode == "residual":
        return
    if routers and not (mode == "source" and all(r.num_layers < 2 for r in routers)):
        return
    warnings.warn(
        f"{adapter}: {_model_name(model)} in mode={mode!r} routes nothing and adds no "
        f"parameters: {why}. {alternative}",
        UserWarning,
        stacklevel=3,
    )


_SINGLE_SOURCE = "a single routed block has no earlier state to take its shortcut from"
_USE_INPUT = "Use mode='input' or mode='denseformer', which also route the output over the states."


def _out_channels(block: nn.Module) -> int:
    for module in reversed(list(block.modules())):
        if isinstance(module, nn.BatchNorm2d | nn.GroupNorm):
            return int(getattr(module, "num_features", None) or module.num_channels)
    raise InputError(f"cannot infer the output channels of {type(block).__name__}")


class _Stage(NamedTuple):
    """A stage of a timm CNN or hierarchical transformer: ``blocks[start:]`` keep the shape."""

    name: str  # the stage's module name, as in ``model.feature_info``
    blocks: nn.Sequential | nn.ModuleList
    start: int
    channel_dim: int


def _timm_stages(model: nn.Module) -> list[_Stage] | None:
    """A timm ResNet's, ConvNeXt's or Swin's stages; ``None`` for other models."""
    layers = [getattr(model, f"layer{i}", None) for i in range(1, 5)]
    if all(isinstance(layer, nn.Sequential) for layer in layers):
        # a ResNet stage's first block changes the shape
        return [_Stage(f"layer{i + 1}", layer, 1, 1) for i, layer in enumerate(layers)]
    name = "stages"
    stages = getattr(model, name, None)
    if not isinstance(stages, nn.Sequential):
        name = "layers"  # Swin's name (an HF decoder's is a ModuleList)
        stages = getattr(model, name, None)
    if not isinstance(stages, nn.Sequential) or len(stages) == 0:
        return None
    # imported for the models that need them; these stages downsample before their blocks
    from timm.models.convnext import ConvNeXtStage
    from timm.models.swin_transformer import SwinTransformerStage
    from timm.models.swin_transformer_v2 import SwinTransformerV2Stage

    if all(isinstance(stage, ConvNeXtStage) for stage in stages):
        channel_dim = 1  # NCHW
    elif all(isinstance(stage, SwinTransformerStage | SwinTransformerV2Stage) for stage in stages):
        channel_dim = -1  # NHWC
    else:
        return None
    return [_Stage(f"{name}.{i}", stage.blocks, 0, channel_dim) for i, stage in enumerate(stages)]


def wrap_timm(model: nn.Module, **router_kwargs: Any) -> nn.Module:
    """Route a timm model in place; returns ``model``.

    ViT-like models (``model.blocks``, an ``nn.Sequential`` of transformer blocks of width
    ``model.embed_dim``) get one router over all blocks. ResNets (``layer1..layer4``) get one
    router per stage over the blocks after the first (the first block of a stage changes the
    resolution or the width); stages with a single block are left as they are. A ResNet block
    applies its activation after its own residual addition, so the learned shortcut correction
    is added after that activation. ConvNeXts (``model.stages``) and Swin transformers, v1 or v2
    (``model.layers``), get one router per stage over all its blocks, whose stack input is the
    stage's downsampled input. Stages cannot be routed across (their states differ in resolution
    and width), so in ``"source"`` mode a ResNet stage with one block after its first has no
    shortcut to choose: a resnet18 (two blocks per stage) gets no parameters and a
    ``UserWarning`` suggests ``mode="input"`` / ``"denseformer"`` (which also route each stage's
    output) or a deeper ResNet. ``model.set_grad_checkpointing()`` works before or after
    wrapping.

    Args:
        model: E.g. ``timm.create_model("resnet18", pretrained=False)``.
        **router_kwargs: Arguments of :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`.

    Raises:
        TypeError: If the model is neither ViT-like, a ResNet, a ConvNeXt nor a Swin.

    Warns:
        UserWarning: If the layout routes nothing (``"source"`` mode with a single routed block
            per stack, or a ResNet whose stages all have a single block).

    Examples:
        >>> import timm
        >>> vit = timm.models.VisionTransformer(img_size=16, patch_size=8, embed_dim=16,
        ...                                     depth=3, num_heads=2, num_classes=4)
        >>> wrap_timm(vit).connectivity.num_layers
        3
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.Sequential | nn.ModuleList):
        width = int(model.embed_dim)
        router = wrap_module_list(blocks, model, **_channel_kwargs(router_kwargs, width, -1))
        why = f"it has one block and {_SINGLE_SOURCE}"
        _warn_if_nothing_routed("wrap_timm", model, [router], router.mode, why, _USE_INPUT)
        return model
    stages = _timm_stages(model)
    if stages is None:
        raise InputError(
            f"{type(model).__name__} is neither ViT-like (.blocks), a ResNet (.layer1-4), a "
            "ConvNeXt (.stages) nor a Swin (.layers)"
        )
    routed = [s.name for s in stages if any(isinstance(b, RoutedBlock) for b in s.blocks)]
    if routed or hasattr(model, "connectivity"):
        found = f"routed blocks in {routed}" if routed else "a .connectivity attribute"
        raise InputError(
            f"{type(model).__name__} is wrapped already (it has {found}): a model is wrapped once"
        )
    mode = router_kwargs.get("mode", "source")
    holder = nn.Module()  # owner of the routers, so that no stage calls them
    routers = nn.ModuleList()
    widths = {info["module"]: info["num_chs"] for info in getattr(model, "feature_info", [])}
    for i, stage in enumerate(stages):
        if len(stage.blocks) <= stage.start:
            continue
        width = widths.get(stage.name) or _out_channels(stage.blocks[0])
        kwargs = _channel_kwargs(router_kwargs, width, stage.channel_dim)
        routers.append(
            wrap_module_list(stage.blocks, holder, name=f"stage{i}", start=stage.start, **kwargs)
        )
    model.connectivity = routers
    if isinstance(getattr(model, "layer1", None), nn.Sequential):  # a ResNet
        single = (
            "every stage has a single block after its first one (the first block of a stage "
            "changes the resolution and the width, so it is not routed)"
        )
        deeper = "a ResNet with deeper stages (e.g. resnet34 or resnet50)"
    else:
        single, deeper = "every stage has a single block", "deeper stages"
    if not routers:
        why = "no stage has more than one block (the first block of a stage changes its shape)"
        alternative = f"Use {deeper}."
    else:
        why = f"{single}, and {_SINGLE_SOURCE}"
        alternative = (
            "Use mode='input' or mode='denseformer', which also route each stage's output over "
            f"its states, or {deeper}."
        )
    _warn_if_nothing_routed("wrap_timm", model, list(routers), mode, why, alternative)
    return model


def wrap_diffusers_dit(model: nn.Module, **router_kwargs: Any) -> nn.Module:
    """Route the transformer blocks of a diffusers DiT (``DiTTransformer2DModel``) in place.

    The model's own loop calls each block with its timestep and class labels (and the hidden
    state first or as ``hidden_states=``); those arguments pass through the wrappers. Also
    PixArt, Allegro, CogView3Plus: models whose blocks return the hidden state (or a tuple that
    starts with it). Returns ``model``.

    Args:
        model: A model with a ``transformer_blocks`` ``nn.ModuleList`` and ``inner_dim``.
        **router_kwargs: Arguments of :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`.

    Raises:
        TypeError: If the model has no ``transformer_blocks``, no ``inner_dim``, or blocks that
            return ``(encoder_hidden_states, hidden_states)`` (SD3, Flux, ...).

    Examples:
        >>> from diffusers import DiTTransformer2DModel
        >>> dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8,
        ...     in_channels=4, num_layers=2, sample_size=8, norm_num_groups=4,
        ...     num_embeds_ada_norm=10)
        >>> wrap_diffusers_dit(dit, mode="input").connectivity.mode
        'input'
    """
    blocks, width = wrappable_transformer_blocks(model)
    router = wrap_module_list(blocks, model, **_channel_kwargs(router_kwargs, width, -1))
    why = f"it has one transformer block and {_SINGLE_SOURCE}"
    _warn_if_nothing_routed("wrap_diffusers_dit", model, [router], router.mode, why, _USE_INPUT)
    return model


class ConnectivityWrapper:
    """Routes a model's blocks when called on it: HF decoder, timm, or diffusers DiT.

    A callable with the router's settings, for YAML (``CausalLMModule(model_wrapper=...)``).
    ``mode="residual"`` leaves the model untouched.

    Args:
        mode: Layout, see :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`.
        temperature: Softmax temperature of the routing.
        final_temperature: If given, anneal the temperature to this value.
        anneal_steps: Training steps of the annealing.
        dilation: Sources are restricted to every ``dilation``-th state.
        top_k: Mix only the ``top_k`` strongest sources per layer.
        per_channel: One coefficient per channel.
        gate: Exact-identity gate (``True``) or pure softmax (``False``).
        prev_logit: Initial logit of the previous state.
        lr_scale: Learning-rate multiplier of the coefficients (Adam-type optimizers).
        impl: Routed sums as the fused Triton kernel on CUDA (``"auto"``), always
            (``"triton"``) or term by term in torch (``"torch"``).
        state_grads: States' gradients term by term (``"autograd"``) or one sum per state
            (``"deferred"``), see :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`.

    Raises:
        ValueError: If ``mode`` is unknown (other arguments are checked when called).

    Examples:
        >>> from transformers import Qwen2Config, Qwen2ForCausalLM
        >>> config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
        >>> model = ConnectivityWrapper(mode="source")(Qwen2ForCausalLM(config))
        >>> type(model.model.layers[0]).__name__
        'RoutedBlock'

        In YAML::

            model_wrapper:
              class_path: ada_modules.nn.ConnectivityWrapper
              init_args: {mode: source, temperature: 1.0}
    """

    def __init__(
        self,
        mode: Mode = "source",
        temperature: float = 1.0,
        final_temperature: float | None = None,
        anneal_steps: int = 0,
        dilation: int = 1,
        top_k: int | None = None,
        per_channel: bool = False,
        gate: bool = True,
        prev_logit: float = 0.0,
        lr_scale: float = 1.0,
        impl: Impl = "auto",
        state_grads: StateGrads = "autograd",
    ) -> None:
        if mode not in MODES:
            raise InputError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.router_kwargs: dict[str, Any] = {
            "mode": mode,
            "temperature": temperature,
            "final_temperature": final_temperature,
            "anneal_steps": anneal_steps,
            "dilation": dilation,
            "top_k": top_k,
            "per_channel": per_channel,
            "gate": gate,
            "prev_logit": prev_logit,
            "lr_scale": lr_scale,
            "impl": impl,
            "state_grads": state_grads,
        }

    def __call__(self, model: nn.Module) -> nn.Module:
        """Route ``model`` in place with the adapter that fits it; return it."""
        if self.mode == "residual":
            return model
        if hasattr(model, "transformer_blocks"):
            return wrap_diffusers_dit(model, **self.router_kwargs)
        if hasattr(model, "blocks") or _timm_stages(model) is not None:
            return wrap_timm(model, **self.router_kwargs)
        if _decoder(model) is None:
            raise InputError(
                "ConnectivityWrapper routes a transformers decoder (model.model.layers), a timm "
                "ViT/ResNet/ConvNeXt/Swin or a diffusers DiT (transformer_blocks); "
                f"{type(model).__name__} is none of them"
            )
        return wrap_hf_decoder(model, **self.router_kwargs)


def mlp_blocks(width: int, depth: int, expansion: int = 1, norm: bool = True) -> list[nn.Module]:
    """``depth`` residual branches ``Linear(ReLU(Linear(LayerNorm(x))))`` of width ``width``.

    The blocks of the digits trunks (:class:`MLPResNet`, and ``MLPStreamNet`` of the
    multi-stream adapters), so every layout there wraps the same branches. ``norm=False`` drops
    the ``LayerNorm``: ``Linear(ReLU(Linear(x)))``.

    Raises:
        ValueError: If ``width``, ``depth`` or ``expansion`` is below 1, or ``norm`` is not a
            bool.

    Examples:
        >>> len(mlp_blocks(8, depth=3))
        3
        >>> mlp_blocks(8, depth=1, norm=False)[0][0]
        Linear(in_features=8, out_features=8, bias=True)
    """
    for name, value in (("width", width), ("depth", depth), ("expansion", expansion)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(norm, bool):
        raise InputError(f"norm must be True or False, got {norm!r}")
    return [
        nn.Sequential(
            *([nn.LayerNorm(width)] if norm else []),
            nn.Linear(width, expansion * width),
            nn.ReLU(),
            nn.Linear(expansion * width, width),
        )
        for _ in range(depth)
    ]


class MLPResNet(ANCReStack):
    """A deep residual MLP trunk ``x + F_i(x)``, ``F_i = Linear(ReLU(Linear(LayerNorm(x))))``.

    An :class:`~ada_modules.nn.ancre.ANCReStack` of ``depth`` branch blocks of width ``width``;
    ``mode`` selects the residual, ReZero, DenseFormer-like or ANCRe layout. Built with the width
    as first argument, so it is a ``Callable[[int], nn.Module]`` for
    ``ImageClassifierModule(trunk=...)``.

    Args:
        width: Input and output width.
        depth: Number of residual blocks.
        expansion: Hidden width of each block as a multiple of ``width``.
        norm: Begin each branch with a ``LayerNorm`` (``False``: no normalisation anywhere).
        mode: Layout, see :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`.
        temperature: Softmax temperature of the routing.
        final_temperature: If given, anneal the temperature to this value.
        anneal_steps: Training steps of the annealing.
        dilation: Sources are restricted to every ``dilation``-th state.
        top_k: Mix only the ``top_k`` strongest sources per layer.
        per_channel: One coefficient per channel.
        gate: Exact-identity gate (``True``) or pure softmax (``False``).
        prev_logit: Initial logit of the previous state.
        lr_scale: Learning-rate multiplier of the coefficients (Adam-type optimizers).
        impl: Routed sums as the fused Triton kernel on CUDA (``"auto"``), always
            (``"triton"``) or term by term in torch (``"torch"``).
        state_grads: States' gradients term by term (``"autograd"``) or one sum per state
            (``"deferred"``), see :class:`~ada_modules.nn.ancre_router.ConnectivityRouter`.

    Raises:
        ValueError: If ``width``, ``depth`` or ``expansion`` is below 1, or a router argument is
            out of range.

    Examples:
        >>> import torch
        >>> trunk = MLPResNet(16, depth=4, mode="source")
        >>> trunk(torch.zeros(3, 16)).shape
        torch.Size([3, 16])
    """

    def __init__(
        self,
        width: int,
        depth: int = 16,
        expansion: int = 1,
        norm: bool = True,
        mode: Mode = "residual",
        temperature: float = 1.0,
        final_temperature: float | None = None,
        anneal_steps: int = 0,
        dilation: int = 1,
        top_k: int | None = None,
        per_channel: bool = False,
        gate: bool = True,
        prev_logit: float = 0.0,
        lr_scale: float = 1.0,
        impl: Impl = "auto",
        state_grads: StateGrads = "autograd",
    ) -> None:
        blocks = mlp_blocks(width, depth, expansion, norm)
        super().__init__(
            blocks,
            mode=mode,
            temperature=temperature,
            final_temperature=final_temperature,
            anneal_steps=anneal_steps,
            dilation=dilation,
            top_k=top_k,
            per_channel=per_channel,
            num_channels=width,
            gate=gate,
            prev_logit=prev_logit,
            residual_in_block=False,
            lr_scale=lr_scale,
            impl=impl,
            state_grads=state_grads,
        )
