"""ANCRe adapters: identity at init on HF Llama/Qwen2, timm ViT/ResNet/ConvNeXt/Swin, DiT."""

import copy
import warnings
from functools import partial

import pytest
import timm
import torch
from helpers.tiny_adapter_models import (
    perturb,
    tiny_cogview3plus,
    tiny_dit,
    tiny_llama,
    tiny_llava,
    tiny_qwen2,
    tiny_sana,
    tiny_sd3,
    tiny_vit,
)
from torch import nn

from ada_modules.errors import InputError
from ada_modules.nn import (
    ConnectivityWrapper,
    RoutedBlock,
    export_hard,
    find_routers,
    wrap_diffusers_dit,
    wrap_hf_decoder,
    wrap_timm,
)

MODES = ("source", "input", "denseformer")
OPTIONS = [{}, {"per_channel": True}, {"dilation": 2, "top_k": 2}]
OPTION_IDS = ["per_layer", "per_channel", "dilation_top_k"]


def _options(mode: str, options: dict) -> dict:
    if mode == "denseformer":
        return {k: v for k, v in options.items() if k != "top_k"}
    return options


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("build", [partial(tiny_llama, 4), tiny_qwen2], ids=["llama", "qwen2"])
def test_hf_decoder_is_unchanged_at_init(seed, build, mode, options):
    model = build()
    ids = torch.randint(0, 32, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    reference = model(input_ids=ids, attention_mask=mask).logits
    wrapped = wrap_hf_decoder(copy.deepcopy(model), mode=mode, **_options(mode, options))
    assert all(isinstance(layer, RoutedBlock) for layer in wrapped.model.layers)
    assert torch.equal(wrapped(input_ids=ids, attention_mask=mask).logits, reference)


def test_hf_generate_with_kv_cache_is_unchanged_and_routing_trains(seed):
    model = tiny_llama(4)
    ids = torch.randint(3, 32, (2, 5))
    expected = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    wrapped = ConnectivityWrapper(mode="source")(copy.deepcopy(model))
    out = wrapped.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, expected)
    wrapped.train()
    wrapped(input_ids=ids, labels=ids).loss.backward()
    router = wrapped.model.connectivity
    assert router.gate.grad is not None and router.gate.grad.abs().sum() > 0


def test_hf_overhead_is_below_one_percent_on_the_tiny_lm():
    from ada_modules.models import CausalLMModule

    module = CausalLMModule(
        hidden_size=64,
        num_layers=8,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=256,
        model_wrapper=ConnectivityWrapper(mode="source"),
    )
    extra = sum(p.numel() for _, r in find_routers(module) for p in r.parameters())
    total = sum(p.numel() for p in module.parameters())
    assert extra == 8 * 9 // 2 - 1 + 7
    assert extra / (total - extra) < 0.01


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_timm_vit_is_unchanged_at_init(seed, mode, options):
    vit = tiny_vit()
    x = torch.randn(2, 3, 16, 16)
    reference = vit(x)
    wrapped = wrap_timm(copy.deepcopy(vit), mode=mode, **_options(mode, options))
    assert torch.equal(wrapped(x), reference)


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_timm_resnet_stages_are_unchanged_at_init(seed, mode, options):
    resnet = perturb(
        timm.models.ResNet(
            block=timm.models.resnet.BasicBlock,
            layers=[2, 3, 1, 2],
            num_classes=4,
            stem_width=8,
            channels=(8, 16, 24, 32),
        )
    )
    x = torch.randn(2, 3, 32, 32)
    reference = resnet(x)
    wrapped = wrap_timm(copy.deepcopy(resnet), mode=mode, **_options(mode, options))
    assert len(wrapped.connectivity) == 3  # stage 3 has a single block: left as it is
    assert [r.num_layers for r in wrapped.connectivity] == [1, 2, 1]
    assert torch.equal(wrapped(x), reference)


def test_timm_resnet_channels_come_from_the_stages_not_an_attention_modules_norm(seed):
    resnet = timm.models.ResNet(  # CBAM blocks hold a 1-channel BatchNorm
        block=timm.models.resnet.BasicBlock,
        layers=[2, 2, 1, 1],
        channels=(8, 16, 24, 32),
        stem_width=8,
        num_classes=4,
        block_args={"attn_layer": "cbam"},
    )
    wrapped = wrap_timm(resnet, mode="input", per_channel=True)
    assert [r._width for r in wrapped.connectivity] == [8, 16]
    assert wrapped(torch.randn(2, 3, 32, 32)).shape == (2, 4)


def _convnext(depths: tuple[int, ...] = (2, 3, 1, 2), conv_mlp: bool = False) -> nn.Module:
    return perturb(
        timm.models.ConvNeXt(depths=depths, dims=(8, 16, 24, 32), num_classes=4, conv_mlp=conv_mlp)
    )


@pytest.mark.parametrize("conv_mlp", [False, True], ids=["linear_mlp", "conv_mlp"])
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_timm_convnext_stages_are_unchanged_at_init(seed, mode, options, conv_mlp):
    convnext = _convnext(conv_mlp=conv_mlp)
    x = torch.randn(2, 3, 32, 32)
    reference = convnext(x)
    wrapper = ConnectivityWrapper(mode=mode, **_options(mode, options))
    wrapped = wrapper(copy.deepcopy(convnext))
    assert [r.num_layers for r in wrapped.connectivity] == [2, 3, 1, 2]  # every block is routed
    assert all(isinstance(b, RoutedBlock) for stage in wrapped.stages for b in stage.blocks)
    assert torch.equal(wrapped(x), reference)


def _swin(version: int = 1) -> nn.Module:
    swin = timm.models.SwinTransformer if version == 1 else timm.models.SwinTransformerV2
    return perturb(  # v2's post-norms start at zero: perturbed, its blocks are not the identity
        swin(
            img_size=32,
            patch_size=2,
            window_size=4,
            embed_dim=8,
            depths=(2, 3),
            num_heads=(1, 2),
            num_classes=4,
        )
    )


@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2"])
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_timm_swin_stages_are_unchanged_at_init(seed, mode, options, version):
    swin = _swin(version)
    x = torch.randn(2, 3, 32, 32)
    reference = swin(x)
    wrapped = ConnectivityWrapper(mode=mode, **_options(mode, options))(copy.deepcopy(swin))
    assert [r.num_layers for r in wrapped.connectivity] == [2, 3]
    assert all(isinstance(b, RoutedBlock) for stage in wrapped.layers for b in stage.blocks)
    assert torch.equal(wrapped(x), reference)


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_diffusers_dit_is_unchanged_at_init(seed, mode, options):
    dit = tiny_dit()
    x = torch.randn(2, 4, 8, 8)
    kwargs = {"timestep": torch.tensor([1, 5]), "class_labels": torch.tensor([0, 3])}
    reference = dit(x, **kwargs).sample
    wrapped = wrap_diffusers_dit(copy.deepcopy(dit), mode=mode, **_options(mode, options))
    assert torch.equal(wrapped(x, **kwargs).sample, reference)


@pytest.mark.parametrize("mode", MODES)
def test_hf_llava_language_model_is_unchanged_at_init(seed, mode):
    model = tiny_llava()
    ids = torch.randint(0, 31, (2, 7))
    ids[:, 1:5] = 31  # the 4 image patches
    inputs = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16)}
    reference = model(**inputs).logits
    wrapped = wrap_hf_decoder(copy.deepcopy(model), mode=mode, per_channel=True)
    assert wrapped.get_decoder().connectivity.num_layers == 2  # model.model has no .layers
    assert torch.equal(wrapped(**inputs).logits, reference)


@pytest.mark.parametrize("mode", MODES)
def test_diffusers_blocks_called_with_hidden_states_keyword_are_unchanged_at_init(seed, mode):
    model = tiny_cogview3plus()  # calls block(hidden_states=..., ...)
    sizes = {name: torch.randn(2, 2) for name in ("original_size", "target_size", "crop_coords")}
    inputs = {"encoder_hidden_states": torch.randn(2, 5, 12), "timestep": torch.tensor([3, 7])}
    latent = torch.randn(2, 4, 8, 8)
    reference = model(latent, **inputs, **sizes).sample
    wrapped = wrap_diffusers_dit(copy.deepcopy(model), mode=mode)
    assert torch.equal(wrapped(latent, **inputs, **sizes).sample, reference)
    with pytest.raises(ValueError, match="routed block 0 got no hidden state"):
        wrapped.transformer_blocks[0](encoder_hidden_states=inputs["encoder_hidden_states"])


def test_diffusers_models_the_wrapper_cannot_take_are_named():
    with pytest.raises(ValueError, match=r"SD3Transformer2DModel is not supported: .*\(encoder"):
        ConnectivityWrapper()(tiny_sd3())
    with pytest.raises(ValueError, match="SanaTransformer2DModel has transformer_blocks but no"):
        wrap_diffusers_dit(tiny_sana())


def test_hard_export_of_an_adapted_model_at_init_is_the_original(seed):
    model = tiny_llama(4)
    ids = torch.randint(0, 32, (2, 6))
    reference = model(input_ids=ids).logits
    wrapped = export_hard(ConnectivityWrapper(mode="source")(copy.deepcopy(model)))
    assert wrapped.model.connectivity.hard
    assert torch.equal(wrapped(input_ids=ids).logits, reference)


def test_residual_mode_leaves_the_model_untouched():
    model = tiny_llama(2)
    assert ConnectivityWrapper(mode="residual")(model) is model
    assert not list(find_routers(model))


def test_adapters_reject_models_they_do_not_know():
    with pytest.raises(TypeError, match="decoder"):
        wrap_hf_decoder(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="ViT-like"):
        wrap_timm(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="transformer_blocks"):
        wrap_diffusers_dit(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="mode"):
        ConnectivityWrapper(mode="dense")
    with pytest.raises(ValueError, match="temperature"):
        ConnectivityWrapper(temperature=0.0)(tiny_llama(2))
    with pytest.raises(InputError, match=r"routes a transformers decoder .*; Linear is none"):
        ConnectivityWrapper(mode="source")(nn.Linear(2, 2))


@pytest.mark.parametrize("build", ["resnet", "convnext", "vit", "llama"])
def test_a_wrapped_model_is_not_wrapped_again(build):
    """A second wrap_timm on a ResNet/ConvNeXt nested RoutedBlocks and dropped the first routers
    from the model's parameters (they kept running in the blocks, never trained nor saved)."""
    model = {
        "resnet": _resnet,
        "convnext": _convnext,
        "vit": tiny_vit,
        "llama": lambda: tiny_llama(2),
    }
    wrapped = ConnectivityWrapper(mode="source")(model[build]())
    keys = list(wrapped.state_dict())
    with pytest.raises(InputError, match="wrapped already"):
        ConnectivityWrapper(mode="source")(wrapped)
    assert list(wrapped.state_dict()) == keys


def _resnet() -> nn.Module:  # stage 1: two routed blocks; stage 2: one; stages 3, 4: none
    return perturb(
        timm.models.ResNet(
            block=timm.models.resnet.BasicBlock,
            layers=[3, 2, 1, 1],
            num_classes=4,
            stem_width=8,
            channels=(8, 8, 8, 8),
        )
    )


_IMAGE = torch.randn(2, 3, 16, 16)
_LATENT = torch.randn(2, 4, 8, 8)
_IDS = torch.randint(0, 32, (2, 7))
# name: (build, wrap, enable checkpointing, the routed blocks' container, loss)
_CHECKPOINTING = {
    "timm_vit": (
        tiny_vit,
        wrap_timm,
        lambda m: m.set_grad_checkpointing(True),
        lambda m: m.blocks,
        lambda m: m(_IMAGE).square().sum(),
    ),
    "timm_resnet": (
        _resnet,
        wrap_timm,
        lambda m: m.set_grad_checkpointing(True),
        lambda m: m.layer1,
        lambda m: m(2 * _IMAGE).square().sum(),
    ),
    "timm_convnext": (
        _convnext,
        wrap_timm,
        lambda m: m.set_grad_checkpointing(True),
        lambda m: m.stages[0].blocks,
        lambda m: m(_IMAGE.repeat(1, 1, 2, 2)).square().sum(),  # 32 x 32: four stages
    ),
    # v1 checkpoints its stage's blocks as one sequence, v2 each block on its own
    **{
        f"timm_swin_v{version}": (
            partial(_swin, version),
            wrap_timm,
            lambda m: m.set_grad_checkpointing(True),
            lambda m: m.layers[0].blocks,
            lambda m: m(_IMAGE.repeat(1, 1, 2, 2)).square().sum(),
        )
        for version in (1, 2)
    },
    "diffusers_dit": (
        tiny_dit,
        wrap_diffusers_dit,
        lambda m: m.enable_gradient_checkpointing(),
        lambda m: m.transformer_blocks,
        lambda m: (
            m(_LATENT, timestep=torch.tensor([1, 5]), class_labels=torch.tensor([0, 3]))
            .sample.square()
            .sum()
        ),
    ),
    "hf_qwen2": (
        tiny_qwen2,
        wrap_hf_decoder,
        lambda m: m.activation_checkpointing_enable(),
        lambda m: m.model.layers,
        lambda m: m(input_ids=_IDS, labels=_IDS, use_cache=False).loss,
    ),
}


@pytest.mark.parametrize("before", [False, True], ids=["enabled_after", "enabled_before"])
@pytest.mark.parametrize("name", list(_CHECKPOINTING))
def test_gradient_checkpointing_gives_the_same_gradients(seed, name, before):
    build, wrap, enable, container, loss_of = _CHECKPOINTING[name]
    model = build()
    reference = wrap(copy.deepcopy(model), mode="source").train()
    with torch.no_grad():  # moved gates and logits: every routed term carries gradient
        for _, router in find_routers(reference):
            for param in router.parameters():
                param.add_(0.5 * torch.randn_like(param))
    checkpointed = copy.deepcopy(model).train()
    if before:
        enable(checkpointed)
        wrap(checkpointed, mode="source")
    else:
        enable(wrap(checkpointed, mode="source"))
    checkpointed.load_state_dict(reference.state_dict())
    calls = []  # a leaf of a routed block runs twice per step under checkpointing
    leaf = next(
        m for m in container(checkpointed)[1].modules() if isinstance(m, nn.Linear | nn.Conv2d)
    )
    leaf.register_forward_hook(lambda *_: calls.append(1))
    params = dict(checkpointed.named_parameters())
    for step in range(2):
        for module in (reference, checkpointed):
            module.zero_grad()
            torch.manual_seed(step)  # the DiT drops class labels at random in training
            loss_of(module).backward()
        routers = 0
        for key, param in reference.named_parameters():
            if param.grad is None:  # e.g. the empty coefficients of a one-block stage
                assert params[key].grad is None and param.numel() == 0
                continue
            torch.testing.assert_close(params[key].grad, param.grad, rtol=1e-5, atol=1e-6)
            routers += "connectivity" in key and bool(param.grad.abs().sum() > 0)
        assert routers >= 2  # the router's logits and gates got their gradients
        with torch.no_grad():
            for module in (reference, checkpointed):
                for param in module.parameters():
                    if param.grad is not None:
                        param.sub_(0.01 * param.grad)
    assert len(calls) == 4
    assert not any(r._passes.kept for _, r in find_routers(checkpointed))


def test_wrap_timm_warns_when_source_mode_routes_nothing_on_a_resnet18():
    def resnet18() -> nn.Module:
        return timm.create_model(
            "resnet18", pretrained=False, stem_width=8, channels=(8, 16, 24, 32), num_classes=4
        )

    with pytest.warns(UserWarning, match=r"resnet18 in mode='source' routes nothing.*'input'"):
        wrapped = wrap_timm(resnet18(), mode="source")
    assert [r.num_layers for r in wrapped.connectivity] == [1, 1, 1, 1]
    assert sum(p.numel() for p in wrapped.connectivity.parameters()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the alternatives route something: no warning
        routed = wrap_timm(resnet18(), mode="input")
        assert sum(p.numel() for p in routed.connectivity.parameters()) == 4 * 3
        wrap_timm(_resnet(), mode="source")  # stage 1 has two routed blocks


def test_wrap_timm_warns_when_source_mode_routes_nothing_on_one_block_convnext_stages():
    with pytest.warns(UserWarning, match=r"ConvNeXt in mode='source' routes nothing.*'input'"):
        wrapped = wrap_timm(_convnext(depths=(1, 1, 1, 1)), mode="source")
    assert sum(p.numel() for p in wrapped.connectivity.parameters()) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routed = wrap_timm(_convnext(depths=(1, 1, 1, 1)), mode="input")
        assert sum(p.numel() for p in routed.connectivity.parameters()) == 4 * 3
