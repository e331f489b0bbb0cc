"""Multi-stream adapters: the original model at init on HF Llama/Qwen2, timm ViT, diffusers DiT."""

import copy
from functools import partial

import diffusers
import pytest
import timm
import torch
from helpers.tiny_adapter_models import (
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
from transformers import DynamicCache

from ada_modules.errors import InputError
from ada_modules.nn import (
    MLPStreamNet,
    MultiStreamResidual,
    StreamBlock,
    StreamsWrapper,
    stream_no_weight_decay,
    wrap_diffusers_dit_streams,
    wrap_hf_decoder_streams,
    wrap_timm_streams,
)

STATIC = ("pre_static", "post_static", "res_static")
NO_DECAY = (*STATIC, "dynamic_alpha")  # no_weight_decay(): static weights and dynamic scales
SETTINGS = [
    {"kind": "mhc", "dynamic": "token"},
    {"kind": "hyper", "dynamic": "token", "dynamic_input": "flat"},
    {"kind": "mhc", "mixing": "permutation", "dynamic": "none"},
]
SETTING_IDS = ["mhc_token", "hyper_flat", "mhc_permutation_static"]


def _perturb_streams(model: nn.Module, scale: float = 0.3) -> None:
    """Move the connection weights: unequal streams, every term carries gradient."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MultiStreamResidual):
                for param in module.parameters(recurse=False):
                    param.add_(scale * torch.randn_like(param))
                if hasattr(module, "dynamic_weight"):
                    module.dynamic_weight.normal_(0.0, scale)


_IMAGE = torch.randn(2, 3, 16, 16)
_LATENT = torch.randn(2, 4, 8, 8)
_DIT_KWARGS = {"timestep": torch.tensor([1, 5]), "class_labels": torch.tensor([0, 3])}


def _ids() -> torch.Tensor:
    return torch.randint(0, 32, (2, 7))


@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("build", [partial(tiny_llama, 3), tiny_qwen2], ids=["llama", "qwen2"])
def test_hf_decoder_is_the_original_at_init(seed, build, settings):
    model = build()
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    reference = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    wrapped = wrap_hf_decoder_streams(copy.deepcopy(model), n_streams=4, **settings)
    assert all(isinstance(layer, StreamBlock) for layer in wrapped.model.layers)
    out = wrapped(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
    # hooks on the blocks themselves (output_hidden_states) see unpacked states
    assert [h.shape for h in out.hidden_states] == [h.shape for h in reference.hidden_states]
    torch.testing.assert_close(out.hidden_states[2], reference.hidden_states[2])
    with torch.no_grad():  # the connection weights take part: moving them changes the output
        wrapped.model.layers[1].streams.post_static.add_(0.5)
    assert not torch.allclose(wrapped(input_ids=ids, attention_mask=mask).logits, out.logits)


def test_hf_generate_with_kv_cache_gives_the_same_tokens_and_trains(seed):
    model = tiny_llama(3)
    ids = torch.randint(3, 32, (2, 5))
    greedy = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(input_ids=ids, **greedy)
    wrapped = StreamsWrapper(n_streams=4, kind="mhc")(copy.deepcopy(model))
    cache = DynamicCache(config=wrapped.config)
    out = wrapped.generate(input_ids=ids, cache=cache, **greedy)
    assert torch.equal(out, expected)
    assert cache.get_seq_length() == ids.shape[1] + 4
    # with moved weights, cached decoding still equals a full forward pass per position
    _perturb_streams(wrapped)
    full = wrapped(input_ids=out).logits
    cache = DynamicCache(config=wrapped.config)
    prefix = wrapped(input_ids=out[:, :-2], cache=cache).logits
    step = wrapped(input_ids=out[:, -2:], cache=cache).logits
    torch.testing.assert_close(torch.cat([prefix, step], 1), full, rtol=1e-4, atol=1e-5)
    wrapped.train()
    wrapped(input_ids=ids, labels=ids).loss.backward()
    for layer in wrapped.model.layers:
        for name, param in layer.streams.named_parameters(recurse=False):
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_backward_reaches_the_stream_weights_at_init(seed):
    model = wrap_hf_decoder_streams(tiny_llama(3), n_streams=4, kind="hyper").train()
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    for layer in model.model.layers:
        streams = layer.streams
        for name in (*STATIC, "dynamic_alpha"):
            grad = getattr(streams, name).grad
            assert grad is not None and torch.isfinite(grad).all(), name
        for name in STATIC:
            assert getattr(streams, name).grad.abs().sum() > 0, name
        assert streams.dynamic_weight.grad.abs().sum() > 0


def test_no_weight_decay_names_the_static_weights():
    model = wrap_hf_decoder_streams(tiny_llama(2), n_streams=2)
    names = {f"model.layers.{i}.streams.{n}" for i in range(2) for n in NO_DECAY}
    assert model.no_weight_decay() == names
    assert names <= dict(model.named_parameters()).keys()
    assert model.model.layers[0].no_weight_decay() == {f"streams.{n}" for n in NO_DECAY}
    vit = tiny_vit()
    own = vit.no_weight_decay()
    wrapped = wrap_timm_streams(vit, n_streams=2)
    assert wrapped.no_weight_decay() == own | {
        f"blocks.{i}.streams.{n}" for i in range(3) for n in NO_DECAY
    }
    assert copy.deepcopy(wrapped).no_weight_decay() == wrapped.no_weight_decay()
    holder = nn.ModuleDict({"net": wrapped})
    assert "net.blocks.0.streams.pre_static" in stream_no_weight_decay(holder)
    assert wrap_hf_decoder_streams(tiny_llama(2), disable=True).no_weight_decay() == set()


@pytest.mark.parametrize("settings", SETTINGS, ids=SETTING_IDS)
def test_timm_vit_is_the_original_at_init(seed, settings):
    vit = tiny_vit()
    reference = vit(_IMAGE)
    wrapped = wrap_timm_streams(copy.deepcopy(vit), n_streams=4, **settings)
    torch.testing.assert_close(wrapped(_IMAGE), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings", [*SETTINGS, {"dynamic": "pooled"}], ids=[*SETTING_IDS, "pool"])
def test_diffusers_dit_is_the_original_at_init(seed, settings):
    dit = tiny_dit()
    reference = dit(_LATENT, **_DIT_KWARGS).sample
    wrapped = wrap_diffusers_dit_streams(copy.deepcopy(dit), n_streams=4, **settings)
    torch.testing.assert_close(wrapped(_LATENT, **_DIT_KWARGS).sample, reference)


def test_hf_llava_language_model_is_the_original_at_init(seed):
    model = tiny_llava()
    ids = torch.randint(0, 31, (2, 7))
    ids[:, 1:5] = 31  # the 4 image patches
    inputs = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16)}
    reference = model(**inputs).logits
    wrapped = wrap_hf_decoder_streams(copy.deepcopy(model), n_streams=3)  # get_decoder().layers
    assert all(isinstance(layer, StreamBlock) for layer in wrapped.get_decoder().layers)
    assert wrapped.get_decoder().layers[0].dim == 24  # the text config's width
    torch.testing.assert_close(wrapped(**inputs).logits, reference, rtol=1e-5, atol=1e-5)


class _KeywordBlock(nn.Module):
    """A block that takes its hidden state only by keyword, like diffusers blocks called so."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, *, hidden_states: torch.Tensor, scale: float) -> torch.Tensor:
        return hidden_states + scale * self.linear(hidden_states)


def test_stream_block_takes_the_hidden_state_by_keyword(seed):
    blocks = [_KeywordBlock() for _ in range(3)]
    layers = [StreamBlock(block, i, 3, dim=8, n_streams=4) for i, block in enumerate(blocks)]
    x = y = torch.randn(2, 5, 8)
    for block, layer in zip(blocks, layers, strict=True):
        y = block(hidden_states=y, scale=0.5)
        x = layer(hidden_states=x, scale=0.5)
    torch.testing.assert_close(x, y)
    with pytest.raises(InputError, match="stream block 0 got no hidden state"):
        layers[0](scale=0.5)


def test_diffusers_blocks_called_with_hidden_states_keyword(seed):
    # CogView3Plus calls its blocks with hidden_states= and they return (hidden, encoder states)
    model = tiny_cogview3plus()
    sizes = {name: torch.randn(2, 2) for name in ("original_size", "target_size", "crop_coords")}
    inputs = {"encoder_hidden_states": torch.randn(2, 5, 12), "timestep": torch.tensor([3, 7])}
    reference = model(_LATENT, **inputs, **sizes).sample
    wrapped = wrap_diffusers_dit_streams(copy.deepcopy(model), n_streams=4)
    torch.testing.assert_close(wrapped(_LATENT, **inputs, **sizes).sample, reference)


class _EncoderFirstBlock(nn.Module):
    """A dual-stream block of no known class: returns (encoder states, hidden states)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden_states, encoder_hidden_states):
        return encoder_hidden_states + 1, hidden_states + self.linear(hidden_states)


class _EncoderFirstModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner_dim = 8
        self.transformer_blocks = nn.ModuleList(_EncoderFirstBlock() for _ in range(2))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        for block in self.transformer_blocks:
            context, x = block(hidden_states=x, encoder_hidden_states=context)
        return x


def test_diffusers_blocks_that_return_encoder_states_first_are_rejected():
    sd3 = tiny_sd3()
    match = r"SD3Transformer2DModel is not supported: its blocks \(JointTransformerBlock\)"
    with pytest.raises(InputError, match=match):
        wrap_diffusers_dit_streams(sd3)
    with pytest.raises(InputError, match=match):
        StreamsWrapper()(sd3)
    flux = diffusers.FluxTransformer2DModel(
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        pooled_projection_dim=6,
        axes_dims_rope=(2, 2, 4),
    )
    with pytest.raises(
        InputError, match=r"FluxTransformer2DModel .* \(encoder_hidden_states, hidden"
    ):
        wrap_diffusers_dit_streams(flux)
    assert not isinstance(sd3.transformer_blocks[0], StreamBlock)  # left as it was
    # a block class not known to return (encoder, hidden): caught at the first forward pass
    model = wrap_diffusers_dit_streams(_EncoderFirstModel(), n_streams=2)
    with pytest.raises(InputError, match="must return the hidden state first"):
        model(torch.randn(2, 5, 8), torch.randn(2, 5, 8))


def test_diffusers_model_without_inner_dim_is_named():
    sana = tiny_sana()
    match = "SanaTransformer2DModel has transformer_blocks but no integer inner_dim"
    with pytest.raises(InputError, match=match):
        wrap_diffusers_dit_streams(sana)


def test_disable_is_bitwise_the_original(seed):
    model = tiny_qwen2()
    ids = _ids()
    wrapped = StreamsWrapper(disable=True)(copy.deepcopy(model))
    assert isinstance(wrapped.model.layers[0], StreamBlock)
    assert not list(wrapped.model.layers[0].streams.parameters(recurse=False))
    assert torch.equal(wrapped(input_ids=ids).logits, model(input_ids=ids).logits)
    vit = tiny_vit()
    assert torch.equal(wrap_timm_streams(copy.deepcopy(vit), disable=True)(_IMAGE), vit(_IMAGE))
    dit = tiny_dit()
    out = wrap_diffusers_dit_streams(copy.deepcopy(dit), disable=True)(_LATENT, **_DIT_KWARGS)
    assert torch.equal(out.sample, dit(_LATENT, **_DIT_KWARGS).sample)


_IDS = torch.randint(0, 32, (2, 7))
# name: (build, wrap, enable checkpointing, loss)
_CHECKPOINTING = {
    "timm_vit": (
        tiny_vit,
        wrap_timm_streams,
        lambda m: m.set_grad_checkpointing(True),
        lambda m: m(_IMAGE).square().sum(),
    ),
    "diffusers_dit": (
        tiny_dit,
        wrap_diffusers_dit_streams,
        lambda m: m.enable_gradient_checkpointing(),
        lambda m: m(_LATENT, **_DIT_KWARGS).sample.square().sum(),
    ),
    "hf_qwen2": (
        tiny_qwen2,
        wrap_hf_decoder_streams,
        lambda m: m.activation_checkpointing_enable(),
        lambda m: m(input_ids=_IDS, labels=_IDS, use_cache=False).loss,
    ),
}


@pytest.mark.parametrize("before", [False, True], ids=["enabled_after", "enabled_before"])
@pytest.mark.parametrize("name", list(_CHECKPOINTING))
def test_gradient_checkpointing_gives_the_same_gradients(seed, name, before):
    build, wrap, enable, loss_of = _CHECKPOINTING[name]
    model = build()
    reference = wrap(copy.deepcopy(model), n_streams=3).train()
    _perturb_streams(reference)
    checkpointed = copy.deepcopy(model).train()
    if before:
        enable(checkpointed)
        wrap(checkpointed, n_streams=3)
    else:
        enable(wrap(checkpointed, n_streams=3))
    checkpointed.load_state_dict(reference.state_dict())
    calls = []  # a leaf of a wrapped block runs twice per step under checkpointing
    leaf = next(m for m in checkpointed.modules() if isinstance(m, StreamBlock)).block
    attention = next(m for n, m in leaf.named_modules() if "attn" in n and isinstance(m, nn.Linear))
    attention.register_forward_hook(lambda *_: calls.append(1))
    params = dict(checkpointed.named_parameters())
    for module in (reference, checkpointed):
        torch.manual_seed(0)  # the DiT drops class labels at random in training
        loss_of(module).backward()
    streams = 0
    for key, param in reference.named_parameters():
        torch.testing.assert_close(params[key].grad, param.grad, rtol=1e-5, atol=1e-6)
        streams += ".streams." in key and bool(param.grad.abs().sum() > 0)
    assert streams == 3 * 5  # pre, post, res, dynamic alpha and projection of three blocks
    assert len(calls) == 2


def test_adapters_reject_models_and_settings_they_do_not_know():
    with pytest.raises(InputError, match="Linear has no decoder"):
        wrap_hf_decoder_streams(nn.Linear(2, 2))
    with pytest.raises(InputError, match="Linear is not ViT-like"):
        wrap_timm_streams(nn.Linear(2, 2))
    with pytest.raises(InputError, match="Linear has no transformer_blocks"):
        wrap_diffusers_dit_streams(nn.Linear(2, 2))
    resnet = timm.models.ResNet(
        block=timm.models.resnet.BasicBlock, layers=[1, 1, 1, 1], stem_width=8
    )
    with pytest.raises(InputError, match="ResNet is none of the supported models"):
        StreamsWrapper()(resnet)
    with pytest.raises(InputError, match="pooled"):
        wrap_hf_decoder_streams(tiny_llama(2), dynamic="pooled")
    with pytest.raises(InputError, match="layer_index"):
        wrap_timm_streams(tiny_vit(), layer_index=1)
    with pytest.raises(InputError, match="kind"):
        StreamsWrapper(kind="dense")
    with pytest.raises(InputError, match="n_streams"):
        StreamsWrapper(n_streams=0)
    for scale in ("1e-2", None, True):
        with pytest.raises(
            InputError, match=f"dynamic_scale must be a finite number, got {scale!r}"
        ):
            wrap_hf_decoder_streams(tiny_llama(2), dynamic_scale=scale)
    with pytest.raises(InputError, match="already has stream residuals"):
        wrap_timm_streams(wrap_timm_streams(tiny_vit()))


def test_a_skipped_layer_is_reported(seed):
    vit = wrap_timm_streams(tiny_vit(), n_streams=2)
    with pytest.raises(InputError, match="stream block 1 of 3 expected 2 packed streams"):
        vit.blocks[1](torch.randn(2, 5, 16))


def test_causal_lm_module_takes_the_wrapper_from_yaml():
    from ada_modules.models import CausalLMModule

    module = CausalLMModule(
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        model_wrapper=StreamsWrapper(n_streams=2, kind="hyper"),
    )
    assert isinstance(module.model.model.layers[1], StreamBlock)
    ids = torch.randint(3, 10, (2, 6))
    assert module(ids).shape[:2] == (2, 6)


@pytest.mark.parametrize("kind", ["hyper", "mhc"])
def test_mlp_stream_net_is_the_residual_mlp_at_init(seed, kind):
    net = MLPStreamNet(8, depth=5, expansion=2, n_streams=4, kind=kind)
    assert len(net.layers) == 5 and net.layers[0].branch[1].out_features == 16
    x = torch.randn(3, 8)
    y = x
    for layer in net.layers:
        y = y + layer.branch(y)
    torch.testing.assert_close(net(x), y, rtol=1e-5, atol=1e-5)
    assert all(layer.geometry_role == "routing" for layer in net.layers)
    assert len(net.no_weight_decay()) == 20
    unnormalised = MLPStreamNet(8, depth=2, norm=False, kind=kind)
    assert not any(isinstance(m, nn.LayerNorm) for m in unnormalised.layers[0].branch)
    plain = MLPStreamNet(8, depth=5, disable=True)
    assert plain.n_streams == 1 and plain.no_weight_decay() == set()
    with pytest.raises(InputError, match="depth"):
        MLPStreamNet(8, depth=0)


def test_mlp_stream_net_is_an_image_classifier_trunk(seed):
    from ada_modules.models import ImageClassifierModule

    module = ImageClassifierModule(
        hidden_sizes=[16], trunk=partial(MLPStreamNet, depth=2, kind="mhc", n_streams=2)
    )
    images = torch.rand(4, 64)
    labels = torch.randint(0, 10, (4,))
    nn.functional.cross_entropy(module(images), labels).backward()
    trunk = module.features[-1]
    assert isinstance(trunk, MLPStreamNet)
    assert trunk.layers[0].pre_static.grad.abs().sum() > 0
