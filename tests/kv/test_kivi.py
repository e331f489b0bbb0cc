"""KIVICache and QuantizedKVLayer: generate parity at 8 bits, packed bytes, flush-only-new-blocks,
batch operations (left padding, beam reorder), the decode-attention path and bad input."""

import pytest
import torch
import yaml
from helpers.tiny_kv_models import ARCHS, TINY, greedy_generate, left_padded_prompts, tiny_model
from jsonargparse import ArgumentParser
from transformers import (
    DynamicCache,
    Qwen2Config,
)

from ada_modules.kernels import kv_quant
from ada_modules.kernels.kv_quant import dequantize, quantize_keys, quantize_values
from ada_modules.kv import (
    QUANTIZED_KV_ATTENTION,
    AdaKVQCache,
    ADKVCache,
    KIVICache,
    LazyDequantizedStates,
    QuantizedKVLayer,
)
from ada_modules.kv.adakvq_layer import AdaKVQLayer
from ada_modules.models import CausalLMModule

# ----------------------------------------------------------------------------------------------
# generate
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS, ids=["llama", "qwen2"])
def test_8bit_generate_matches_dynamic_cache(arch):
    model = tiny_model(arch)
    for seed in range(3):
        ids, mask = left_padded_prompts(
            3, 45, seed
        )  # prefill flushes one block, decoding flushes more
        ref = greedy_generate(
            model, ids, mask, DynamicCache(config=model.config), max_new_tokens=24
        )
        cache = KIVICache(model.config, key_bits=8, value_bits=8, value_group_size=16)
        out = greedy_generate(model, ids, mask, cache, max_new_tokens=24)
        assert torch.equal(out.sequences, ref.sequences)
        scores, ref_scores = torch.stack(out.scores), torch.stack(ref.scores)
        assert (scores - ref_scores).norm() <= 1e-2 * ref_scores.norm()  # measured ~4e-3
        assert cache.get_seq_length() == 45 + 23  # the last new token is never fed back
        assert cache.layers[0].block_bits == [(8, 8)] * 2  # 69 tokens: 2 blocks of 32 packed


def test_logit_error_grows_as_bits_shrink():
    model = tiny_model(ARCHS[0])
    ids, mask = left_padded_prompts(2, 64, 0)
    # Teacher-force the reference continuation so every cache sees the same tokens.
    ref = greedy_generate(model, ids, mask, DynamicCache(config=model.config), max_new_tokens=16)
    full_mask = torch.cat([mask, torch.ones(2, 16, dtype=mask.dtype)], dim=1)
    ref_logits = model(ref.sequences, attention_mask=full_mask).logits[:, 64:]
    errors = {}
    for bits in (8, 4, 2):
        cache = KIVICache(model.config, bits, bits, 32, 16)
        model(ref.sequences[:, :64], attention_mask=mask, cache=cache)
        steps = [
            model(
                ref.sequences[:, t : t + 1], attention_mask=full_mask[:, : t + 1], cache=cache
            ).logits[:, -1]
            for t in range(64, 80)
        ]
        errors[bits] = (torch.stack(steps, 1) - ref_logits).norm() / ref_logits.norm()
    # The prefill attends at full precision; decoding reads the packed history.
    assert errors[8] < 1e-2 and errors[8] < errors[4] < errors[2]


def test_beam_search_reorders_the_packed_cache():
    model = tiny_model(ARCHS[0])
    ids, mask = left_padded_prompts(2, 40, 1)
    kwargs = {"max_new_tokens": 8, "num_beams": 3}
    ref = greedy_generate(model, ids, mask, DynamicCache(config=model.config), **kwargs)
    # Window larger than the sequence: nothing is quantized, so beam search must match exactly.
    unflushed = KIVICache(model.config, 2, 2, 32, 16, residual_length=64)
    out = greedy_generate(model, ids, mask, unflushed, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    # With packed history (8 bits), the beam scores stay close.
    packed = KIVICache(model.config, 8, 8, 16, 16, residual_length=16)
    out = greedy_generate(model, ids, mask, packed, **kwargs)
    assert packed.layers[0].segments
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=2e-3, atol=0)


@pytest.mark.parametrize("arch", ARCHS, ids=["llama", "qwen2"])
def test_fused_decode_attention_matches_the_dequantizing_path(arch):
    model = tiny_model(arch)
    ids, mask = left_padded_prompts(3, 45, 0)
    kwargs = {"max_new_tokens": 24}
    runs = {}
    for attn in ("sdpa", QUANTIZED_KV_ATTENTION):
        model.set_attn_implementation(attn)
        runs[attn] = [
            greedy_generate(model, ids, mask, KIVICache(model.config, 2, 3, 32, 16), **kwargs),
            greedy_generate(
                model, ids, mask, KIVICache(model.config, 2, 3, 32, 16), num_beams=2, **kwargs
            ),
            greedy_generate(model, ids, mask, DynamicCache(config=model.config), **kwargs),
        ]
    for fused, plain in zip(runs[QUANTIZED_KV_ATTENTION], runs["sdpa"], strict=True):
        assert torch.equal(fused.sequences, plain.sequences)
        torch.testing.assert_close(
            torch.stack(fused.scores), torch.stack(plain.scores), rtol=0, atol=1e-4
        )


def test_fused_path_never_dequantizes(monkeypatch):
    model = tiny_model(ARCHS[0])
    model.set_attn_implementation(QUANTIZED_KV_ATTENTION)
    ids, mask = left_padded_prompts(2, 40, 0)

    def fail(*args, **kwargs):
        raise AssertionError("the packed history was dequantized")

    monkeypatch.setattr("ada_modules.kv.quantized_layer.dequantize", fail)
    cache = KIVICache(model.config, 2, 2, 32, 16)
    greedy_generate(model, ids, mask, cache, max_new_tokens=10)
    assert len(cache.layers[0].block_bits) == 1  # 49 tokens: one packed block was read


def test_decode_lse_hook_sees_the_mass_on_each_segment():
    class Recording(QuantizedKVLayer):
        records_decode_lse = True

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.seen = []

        def observe_decode_lse(self, lse):
            self.seen.append((len(self.segments), lse))

    class RecordingCache(KIVICache):
        layer_class = Recording

    model = tiny_model(ARCHS[1])
    model.set_attn_implementation(QUANTIZED_KV_ATTENTION)
    ids, mask = left_padded_prompts(2, 40, 0)
    cache = RecordingCache(model.config, 4, 4, 16, 16, residual_length=16)
    greedy_generate(model, ids, mask, cache, max_new_tokens=12)
    seen = cache.layers[1].seen
    assert len(seen) == 11  # one per decode step
    for segments, lse in seen:
        assert lse.shape == (2, 4, segments + 1)
        mass = (lse - lse.logsumexp(-1, keepdim=True)).exp()
        torch.testing.assert_close(mass.sum(-1), torch.ones(2, 4))
    with pytest.raises(NotImplementedError, match="observe_decode_lse"):
        QuantizedKVLayer().observe_decode_lse(torch.zeros(1))


def test_returned_states_dequantize_lazily_and_once(monkeypatch):
    layer = QuantizedKVLayer(key_group_size=16, value_group_size=16, residual_length=16)
    layer.update(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16))
    calls = []
    original = kv_quant.dequantize

    def counting(packed, **kwargs):
        calls.append(packed.kind)
        return original(packed, **kwargs)

    monkeypatch.setattr("ada_modules.kv.quantized_layer.dequantize", counting)
    keys, values = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    assert isinstance(keys, LazyDequantizedStates) and keys.shape == (1, 2, 41, 16)
    assert not calls  # nothing dequantized until an operation reads the states
    first = keys * 1.0
    second = keys[..., :32, :].sum()
    assert calls == ["key"]  # one segment, dequantized once
    torch.testing.assert_close(second, first[..., :32, :].sum())
    assert keys.window.shape[-2] == 9  # the 8 tokens left in the window and the new one
    assert torch.equal(keys[..., 32:, :], keys.window)


def test_causal_lm_module_takes_kivi_from_yaml(tmp_path):
    config = tmp_path / "model.yaml"
    model_args = {
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
        "intermediate_size": 32,
        "max_new_tokens": 3,
        "cache_factory": {
            "class_path": "ada_modules.kv.KIVICache",
            "init_args": {"key_bits": [2, 4], "value_bits": 3, "value_group_size": 16},
        },
    }
    config.write_text(yaml.safe_dump({"model": model_args}))
    parser = ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_class_arguments(CausalLMModule, "model")
    module = parser.instantiate(parser.parse_args(["--config", str(config)])).model
    cache = module.cache_factory(config=module.model.config)
    assert isinstance(cache, KIVICache)
    assert [(layer.key_bits, layer.value_bits) for layer in cache.layers] == [(2, 3), (4, 3)]
    completions, _, used = module.generate(
        torch.full((2, 40), 5), torch.ones(2, 40, dtype=torch.long)
    )
    assert len(completions) == 2 and isinstance(used, KIVICache) and used.nbytes() > 0


# ----------------------------------------------------------------------------------------------
# Storage
# ----------------------------------------------------------------------------------------------


def test_2bit_bytes_are_at_most_a_fifth_of_fp16_for_1k_tokens():
    cache = KIVICache(num_layers=2, key_bits=2, value_bits=2, residual_length=32)
    batch, heads, tokens, head_dim = 1, 8, 1024, 128
    for layer_idx in range(2):
        for start in (0, 1000):  # a prefill of 1000 tokens, then 24 decode steps
            n = 1000 if start == 0 else 1
            for _ in range(1 if start == 0 else tokens - 1000):
                kv = torch.randn(batch, heads, n, head_dim, dtype=torch.float16)
                cache.update(kv, kv.clone(), layer_idx)
    fp16 = 2 * 2 * batch * heads * tokens * head_dim * 2
    assert cache.fp_nbytes() == fp16
    # 2 layers x (K + V): 1024 packed tokens x 128 ch x 2 bits, fp16 scale+zero per group of 32.
    codes = 2 * 2 * batch * heads * tokens * head_dim * 2 // 8
    meta = 2 * 2 * batch * heads * tokens * head_dim // 32 * 2 * 2
    assert cache.nbytes() == codes + meta
    assert cache.nbytes() <= 0.2 * fp16
    assert all(layer.keys.shape[-2] == 0 for layer in cache.layers)


def test_nbytes_counts_residual_and_per_layer_bits():
    cache = KIVICache(key_bits=[2, 8], value_bits=[4, 3], residual_length=32, value_group_size=32)
    for layer_idx in range(2):
        cache.update(torch.randn(1, 1, 40, 32), torch.randn(1, 1, 40, 32), layer_idx)
    residual = 2 * 8 * 32 * 4
    meta = 2 * 32 * 4  # fp32 scale + zero: keys 1 group x 32 ch, values 32 tokens x 1 group
    expect = [32 * (2 + 4) * 4 + 2 * meta + residual, 32 * (8 + 3) * 4 + 2 * meta + residual]
    assert [layer.nbytes() for layer in cache.layers] == expect
    assert cache.nbytes() == sum(expect)


def test_flush_quantizes_only_the_new_block(monkeypatch):
    layer = QuantizedKVLayer(
        key_bits=3, value_bits=2, key_group_size=16, value_group_size=16, residual_length=32
    )
    quantized_tokens = []
    original = kv_quant.quantize_keys

    def counting(x, *args, **kwargs):
        quantized_tokens.append(x.shape[-2])
        return original(x, *args, **kwargs)

    monkeypatch.setattr("ada_modules.kv.quantized_layer.quantize_keys", counting)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 150, 16, generator=gen)
    values = torch.randn(1, 2, 150, 16, generator=gen)
    layer.update(keys[..., :70, :], values[..., :70, :])
    first_codes = layer.segments[0].keys.codes.clone()
    returned = None
    for t in range(70, 150):
        returned = layer.update(keys[..., t : t + 1, :], values[..., t : t + 1, :])
    assert quantized_tokens == [64, 32, 32]  # the prefill's 2 blocks, then one block per flush
    assert layer.get_seq_length() == 150 and layer.keys.shape[-2] == 150 % 32
    assert len(layer.segments) == 1 and layer.block_bits == [(3, 2)] * 4
    # History is never re-quantized: the first blocks' codes are unchanged.
    assert torch.equal(layer.segments[0].keys.codes[..., :64, :], first_codes)
    # What attention sees: history = dequantize(quantize(block)), the rest exactly as given.
    k_ret, v_ret = returned
    expect_k = dequantize(quantize_keys(keys[..., :128, :], 3, 16))
    expect_v = dequantize(quantize_values(values[..., :128, :], 2, 16))
    assert torch.equal(k_ret[..., :128, :], expect_k)
    assert torch.equal(v_ret[..., :128, :], expect_v)
    assert torch.equal(k_ret[..., 128:, :], keys[..., 128:, :])


def test_per_block_bits_hook_makes_segments():
    class Alternating(QuantizedKVLayer):
        def choose_block_bits(self, block_index, keys, values):
            return (2, 4) if block_index % 3 < 2 else (8, 3)

    layer = Alternating(residual_length=16, key_group_size=16, value_group_size=16)
    layer.update(torch.randn(2, 1, 100, 16), torch.randn(2, 1, 100, 16))
    assert layer.block_bits == [(2, 4), (2, 4), (8, 3), (2, 4), (2, 4), (8, 3)]
    assert [(s.keys.bits, s.values.bits, s.num_tokens) for s in layer.segments] == [
        (2, 4, 32),
        (8, 3, 16),
        (2, 4, 32),
        (8, 3, 16),
    ]


# ----------------------------------------------------------------------------------------------
# Batch operations and the decode-attention path
# ----------------------------------------------------------------------------------------------


def _filled_layer(keys, values, **kwargs):
    layer = QuantizedKVLayer(key_group_size=16, value_group_size=16, residual_length=32, **kwargs)
    layer.update(keys[..., :40, :], values[..., :40, :])
    for t in range(40, keys.shape[-2]):
        layer.update(keys[..., t : t + 1, :], values[..., t : t + 1, :])
    return layer


def _state(layer):
    tensors = [layer.keys, layer.values]
    for s in layer.segments:
        tensors += [s.keys.codes, s.keys.scale, s.keys.zero, s.values.codes, s.values.scale]
    return tensors


def test_reorder_and_select_are_exact():
    gen = torch.Generator().manual_seed(1)
    keys, values = (
        torch.randn(3, 2, 75, 16, generator=gen),
        torch.randn(3, 2, 75, 16, generator=gen),
    )
    idx = torch.tensor([2, 0, 0])
    layer = _filled_layer(keys, values)
    layer.reorder_cache(idx)
    expected = _filled_layer(keys[idx], values[idx])
    assert all(torch.equal(a, b) for a, b in zip(_state(layer), _state(expected), strict=True))

    layer = _filled_layer(keys, values)
    layer.batch_select_indices(torch.tensor([1]))
    expected = _filled_layer(keys[1:2], values[1:2])
    assert all(torch.equal(a, b) for a, b in zip(_state(layer), _state(expected), strict=True))

    layer.batch_repeat_interleave(2)
    assert layer.keys.shape[0] == 2 and layer.segments[0].keys.codes.shape[0] == 2


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_attend_equals_attention_over_the_returned_states(impl):
    gen = torch.Generator().manual_seed(2)
    keys, values = (
        torch.randn(2, 2, 77, 16, generator=gen),
        torch.randn(2, 2, 77, 16, generator=gen),
    )
    layer = _filled_layer(keys[..., :76, :], values[..., :76, :], key_bits=2, value_bits=3)
    k_all, v_all = layer.update(keys[..., 76:, :], values[..., 76:, :])
    layer.impl = impl  # filled with the torch reference (fast); attend with `impl`
    query = torch.randn(2, 4, 16, generator=gen)
    mask = torch.ones(2, 77, dtype=torch.bool)
    mask[1, :9] = False  # left padding of row 1
    out = layer.attend(query, key_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.unsqueeze(2), k_all, v_all, attn_mask=mask[:, None, None, :], enable_gqa=True
    ).squeeze(2)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_crop_only_inside_the_residual_window():
    layer = _filled_layer(torch.randn(1, 1, 70, 16), torch.randn(1, 1, 70, 16))
    layer.crop(-3)
    assert layer.get_seq_length() == 67 and layer.keys.shape[-2] == 3
    with pytest.raises(ValueError, match="cannot crop 4"):
        layer.crop(-4)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0 and not layer.segments


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 2, "key_bits": 5}, "key_bits must be one of .* got 5"),
        ({"num_layers": 2, "value_bits": [2, 1]}, r"value_bits\[1\] .* got 1"),
        ({"num_layers": 2, "key_bits": [2, 2, 2]}, "one per layer \\(2\\), got 3"),
        ({"num_layers": 2, "residual_length": 48}, "multiple of key_group_size=32, got 48"),
        ({"num_layers": 2, "key_group_size": 24}, "power of two, got 24"),
        ({"num_layers": 0}, "num_layers must be a positive integer, got 0"),
        ({}, "needs a config"),
        ({"config": Qwen2Config(**TINY), "value_group_size": 32}, r"divide the head dim \(16\)"),
        (
            {
                "config": Qwen2Config(
                    **TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1
                ),
                "value_group_size": 16,
            },
            "sliding_attention",
        ),
    ],
    ids=[
        "bits",
        "layer_bits",
        "list_length",
        "residual",
        "group",
        "layers",
        "no_layers",
        "value_group",
        "sliding",
    ],
)
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KIVICache(**kwargs)


def test_subclasses_and_adkv_are_named_in_their_own_messages():
    sliding = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match="^AdaKVQCache supports only full-attention"):
        AdaKVQCache(sliding, key_bits=2, value_bits=2, value_group_size=16)
    with pytest.raises(ValueError, match="^residual_length must be a positive int, got 0"):
        ADKVCache(Qwen2Config(**TINY), residual_length=0)  # it has no key_group_size to name


def test_value_group_must_divide_head_dim_at_first_update():
    layer = QuantizedKVLayer(value_group_size=32)
    with pytest.raises(ValueError, match="value_group_size=32 .* head_dim=16"):
        layer.update(torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16))


def test_batch_size_mismatch_is_an_error():
    layer = QuantizedKVLayer(value_group_size=16)
    layer.update(torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 16))
    with pytest.raises(ValueError, match="batch size 2, got .* batch size 3"):
        layer.update(torch.randn(3, 1, 1, 16), torch.randn(3, 1, 1, 16))


@pytest.mark.parametrize("layer_class", [QuantizedKVLayer, AdaKVQLayer])
def test_states_the_layer_cannot_take_are_refused_before_anything_is_stored(layer_class):
    """float64 states were taken until the first flush, which failed half-way: the layer then
    reported 20 tokens and held none (and AdaKVQ had updated its demand and credit)."""
    layer = layer_class(key_group_size=16, value_group_size=16, residual_length=16)
    with pytest.raises(
        ValueError, match=r"stores states of dtype torch.float32, .* got torch.float64"
    ):
        layer.update(*(torch.randn(1, 2, 20, 16, dtype=torch.float64),) * 2)
    assert layer.get_seq_length() == 0 and layer.block_bits == []
    layer.update(*(torch.randn(1, 2, 20, 16),) * 2)
    assert layer.get_seq_length() == 20 and len(layer.block_bits) == 1
    for states, match in [
        (
            torch.randn(1, 2, 1, 16, dtype=torch.float16),
            "holds torch.float32 states, got torch.float16",
        ),
        (
            torch.randn(1, 3, 1, 16),
            r"holds 2 kv heads of dim 16, got states of shape \(1, 3, 1, 16\)",
        ),
        (
            torch.randn(1, 2, 1, 32),
            r"holds 2 kv heads of dim 16, got states of shape \(1, 2, 1, 32\)",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            layer.update(states, states)
    assert layer.get_seq_length() == 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"key_bits": 2.0},
            r"key_bits must be one of \(2, 3, 4, 8\) \(an int\) .* got 2.0 \(float\)",
        ),
        ({"value_bits": "2"}, r"value_bits must be one of .* got '2' \(str\)"),
        ({"key_bits": True}, r"key_bits must be one of .* got True \(bool\)"),
        ({"key_bits": [2.0, 4]}, r"key_bits\[0\] must be one of .* got 2.0 \(float\)"),
        ({"value_bits": []}, "value_bits must be .* got an empty list"),
        ({"value_group_size": 0}, "value_group_size must be a positive power of two, got 0"),
        ({"key_group_size": 32.0}, "key_group_size must be a positive power of two, got 32.0"),
    ],
    ids=["float", "str", "bool", "float_in_list", "empty", "zero_group", "float_group"],
)
@pytest.mark.parametrize("with_config", [True, False], ids=["config", "no_config"])
def test_bits_and_group_arguments_are_checked_up_front(kwargs, match, with_config):
    # Issue 13: KIVICache(config, key_bits=2.0) raised "'float' object is not iterable".
    from ada_modules.errors import InputError

    where = {"config": Qwen2Config(**TINY)} if with_config else {}
    with pytest.raises(InputError, match=match):
        KIVICache(**where, **kwargs)
