"""AdaKVQCache: 8-bit generate parity, the running-budget invariant, allocation JSON round trip,
demand-driven block bits on hand-built cases, beam search / left padding, YAML and bad input."""

import pytest
import torch
import yaml
from helpers.tiny_kv_models import ARCHS, TINY, greedy_generate, left_padded_prompts, tiny_model
from jsonargparse import ArgumentParser
from transformers import (
    DynamicCache,
    LlamaConfig,
    Qwen2Config,
)

from ada_modules.kv import (
    QUANTIZED_KV_ATTENTION,
    AADProfile,
    AdaKVQCache,
    AdaKVQLayer,
    ADKVCache,
    BitAllocation,
    KIVICache,
    allocate_bits,
    block_bits_per_element,
)
from ada_modules.models import CausalLMModule


def _block_cost(layer, bits):
    return block_bits_per_element(
        *bits, layer.keys.shape[-1], layer.key_group_size, layer.value_group_size, layer.keys.dtype
    )


# ----------------------------------------------------------------------------------------------
# generate
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS, ids=["llama", "qwen2"])
def test_8bit_generate_matches_dynamic_cache(arch):
    model = tiny_model(arch)
    allocation = BitAllocation.uniform(num_layers=2, bits=8, group_size=16)
    for seed in range(3):
        ids, mask = left_padded_prompts(
            3, 45, seed
        )  # left padding; prefill flushes blocks, decoding more
        ref = greedy_generate(
            model, ids, mask, DynamicCache(config=model.config), max_new_tokens=24
        )
        # Dynamic layers on, with a one-width ladder: the demand is measured, the bits stay 8.
        cache = AdaKVQCache(
            model.config, allocation, residual_length=32, dynamic_layers=1.0, dynamic_bits=(8,)
        )
        out = greedy_generate(model, ids, mask, cache, max_new_tokens=24)
        assert torch.equal(out.sequences, ref.sequences)
        scores, ref_scores = torch.stack(out.scores), torch.stack(ref.scores)
        assert (scores - ref_scores).norm() <= 1e-2 * ref_scores.norm()  # measured 2e-3..4e-3
        assert cache.layers[1].block_bits == [(8, 8)] * 2  # 68 tokens: 2 blocks of 32 packed
        assert any(d is not None for d in cache.layers[1].block_demand)


@pytest.mark.parametrize("arch", ARCHS, ids=["llama", "qwen2"])
def test_running_budget_holds_over_a_long_generation(arch):
    # head_dim 32 and fp16 states: stored bits per element equal the allocation's cost model.
    model = tiny_model(arch, hidden_size=128, num_hidden_layers=3).to(torch.float16)
    model.set_attn_implementation(QUANTIZED_KV_ATTENTION)  # decode demand from the real lse
    allocation = allocate_bits([0.1, 0.4, 0.5], budget=5.0, group_size=16)
    assert allocation.average_bits() <= 5.0
    cache = AdaKVQCache(
        model.config,
        allocation,
        residual_length=16,
        dynamic_layers=1.0,
        dynamic_bits=(2, 3, 4, 8),
        thresholds=(0.995, 1.005),  # a random model's lift stays near 1: tight, so bits move
        threshold_mode="absolute",
    )
    ids, mask = left_padded_prompts(2, 40, 3)
    greedy_generate(model, ids, mask, cache, max_new_tokens=200)
    changed = 0
    for layer in cache.layers:
        static = _block_cost(layer, (layer.key_bits, layer.value_bits))
        spent = 0.0
        for k, bits in enumerate(layer.block_bits, start=1):
            spent += _block_cost(layer, bits)
            assert spent <= k * static + 1e-6  # at every flush, not only at the end
            changed += bits != (layer.key_bits, layer.value_bits)
        assert layer.credit >= 0
        assert layer.packed_nbytes() <= layer.static_nbytes()
    assert changed >= 5  # the dynamic part did act
    assert cache.packed_nbytes() <= cache.static_nbytes()
    assert cache.average_bits() <= allocation.average_bits() + 1e-9 <= 5.0 + 1e-9


def test_running_budget_holds_for_any_demand_sequence():
    gen = torch.Generator().manual_seed(0)
    for base, ladder in (((2, 3), (2, 3, 4, 8)), ((4, 4), (2, 4, 8)), ((8, 2), (2, 3, 4, 8))):
        layer = AdaKVQLayer(*base, key_group_size=16, value_group_size=16, residual_length=16)
        layer.enable_dynamic(ladder, thresholds=(0.4, 0.6), threshold_mode="absolute")
        states = torch.randn(1, 2, 16, 32, dtype=torch.float16, generator=gen)
        layer.update(states, states)
        static = _block_cost(layer, base)
        for k in range(2, 60):
            far = float(torch.rand((), generator=gen)) * 0.98 + 0.01
            for _ in range(16):
                layer.observe_decode_lse(_lse_for_far_mass(far))
                layer.update(states[..., :1, :], states[..., :1, :])
            spent = sum(_block_cost(layer, bits) for bits in layer.block_bits)
            assert len(layer.block_bits) == k and spent <= k * static + 1e-9
            assert layer.packed_nbytes() <= layer.static_nbytes()
        assert len(set(layer.block_bits)) >= 3  # it stepped both ways


def test_beam_search_and_decode_demand_with_dynamic_layers():
    model = tiny_model(ARCHS[0])
    ids, mask = left_padded_prompts(2, 40, 1)
    kwargs = {"max_new_tokens": 8, "num_beams": 3}
    ref = greedy_generate(model, ids, mask, DynamicCache(config=model.config), **kwargs)
    allocation = BitAllocation.uniform(num_layers=2, bits=8, group_size=16)
    cache = AdaKVQCache(model.config, allocation, residual_length=16, dynamic_bits=(8,))
    out = greedy_generate(model, ids, mask, cache, **kwargs)
    assert cache.layers[1].segments and cache.layers[1].keys.shape[0] == 6
    torch.testing.assert_close(out.sequences_scores, ref.sequences_scores, rtol=2e-3, atol=0)
    # Low bits, dynamic, fused decode: beams reorder the packed cache and the demand is recorded.
    model.set_attn_implementation(QUANTIZED_KV_ATTENTION)
    cache = AdaKVQCache(
        model.config,
        key_bits=[2, 3],
        value_bits=3,
        key_group_size=16,
        value_group_size=16,
        residual_length=16,
        dynamic_layers=[1],
        dynamic_bits=(2, 3, 4),
    )
    out = greedy_generate(model, ids, mask, cache, max_new_tokens=30, num_beams=2)
    assert out.sequences.shape == (2, 70)
    layer = cache.layers[1]
    assert len(layer.block_demand) == 4 and layer.block_demand[0] is None
    assert all(d >= 0 for d in layer.block_demand[1:])


# ----------------------------------------------------------------------------------------------
# Dynamic bits on hand-built cases
# ----------------------------------------------------------------------------------------------


def _lse_for_far_mass(far, segments=1):
    """Per-segment lse of one decode step with far mass ``far`` on the packed history."""
    lse = torch.full((1, 2, segments + 1), float("-inf"))
    lse[..., 0] = torch.tensor(far).log()
    lse[..., -1] = torch.tensor(1 - far).log()
    return lse


def test_block_bits_follow_the_recorded_decode_demand():
    layer = AdaKVQLayer(
        key_bits=3, value_bits=3, key_group_size=16, value_group_size=16, residual_length=16
    )
    layer.enable_dynamic(
        dynamic_bits=(2, 3, 4),
        thresholds=(0.3, 0.7),
        threshold_mode="absolute",
        normalization="none",
    )
    gen = torch.Generator().manual_seed(0)

    def step(n=1):
        layer.update(
            torch.randn(1, 2, n, 32, generator=gen), torch.randn(1, 2, n, 32, generator=gen)
        )

    step(16)  # prefill: one block, no history before it -> no demand, static bits
    for far in (0.1, 0.9, 0.9, 0.5):  # one block of 16 decode steps per demand level
        for _ in range(16):
            layer.observe_decode_lse(_lse_for_far_mass(far))
            step()
    step()  # the 5th block flushes with the demand of the last 16 steps
    assert layer.block_demand[0] is None
    torch.testing.assert_close(
        torch.tensor(layer.block_demand[1:]), torch.tensor([0.1, 0.9, 0.9, 0.5])
    )
    # low -> down (banks 1 bit/element at fp32: 7 -> 6), high -> up with that credit (8),
    # high again -> no credit left, static; middle -> static.
    assert _block_cost(layer, (3, 3)) == 7.0
    assert layer.block_bits == [(3, 3), (2, 2), (4, 4), (3, 3), (3, 3)]
    assert layer.credit == 0.0
    assert [(s.keys.bits, s.num_tokens) for s in layer.segments] == [
        (3, 16),
        (2, 16),
        (4, 16),
        (3, 32),
    ]


def test_cache_counts_the_blocks_its_dynamic_layers_changed():
    cache = AdaKVQCache(
        None,
        key_bits=[3, 3],
        value_bits=[3, 3],
        key_group_size=16,
        residual_length=16,
        dynamic_layers=[0],
        dynamic_bits=(2, 3, 4),
        thresholds=(0.3, 0.7),
        threshold_mode="absolute",
        normalization="none",
    )
    gen = torch.Generator().manual_seed(0)
    states = lambda n: torch.randn(1, 2, n, 32, generator=gen)  # noqa: E731
    for layer in cache.layers:
        layer.update(states(16), states(16))
    for far in (0.1, 0.9, 0.9, 0.5):  # as above: layer 0 goes down, up, static, static
        for _ in range(16):
            cache.layers[0].observe_decode_lse(_lse_for_far_mass(far))
            for layer in cache.layers:
                layer.update(states(1), states(1))
    for layer in cache.layers:
        layer.update(states(1), states(1))
    assert cache.layers[0].block_bits == [(3, 3), (2, 2), (4, 4), (3, 3), (3, 3)]
    assert cache.dynamic_block_changes() == (2, 5)  # layer 1 is static: not counted


def test_key_proxy_demand_sees_retrieval_of_the_history():
    # Keys stand in for queries (scale 1/4 at head_dim 16). Block 0: 8 e0. Block 1: 8 e1, whose
    # self-scores (16) dwarf its scores with the history (0): local. Block 2: 2 e0 (retrieval:
    # score 4 with block 0, 0 with block 1, 1 with itself) or 8 e2 (local again).
    def layer_with(retrieves, normalization):
        layer = AdaKVQLayer(
            key_bits=3, value_bits=3, key_group_size=16, value_group_size=16, residual_length=16
        )
        layer.enable_dynamic(
            dynamic_bits=(2, 3, 4),
            demand="key_proxy",
            thresholds=(0.2, 0.8),
            threshold_mode="absolute",
            normalization=normalization,
        )
        keys = torch.zeros(1, 1, 48, 16)
        keys[..., :16, 0] = 8.0
        keys[..., 16:32, 1] = 8.0
        if retrieves:
            keys[..., 32:, 0] = 2.0
        else:
            keys[..., 32:, 2] = 8.0
        layer.update(keys, torch.randn(1, 1, 48, 16))
        return layer

    far, local = layer_with(True, "none"), layer_with(False, "none")
    assert far.block_demand[0] is None and far.block_demand[1] < 1e-4
    assert far.block_demand[2] > 0.95 and local.block_demand[2] < 1e-4
    # local block -> down, banking credit; the retrieving block spends it -> up.
    assert far.block_bits == [(3, 3), (2, 2), (4, 4)]
    assert local.block_bits == [(3, 3), (2, 2), (2, 2)]
    # By hand: query i of block 2 puts exp(4) on 16 keys, exp(0) on 16, exp(1) on i + 1.
    e = torch.tensor([4.0, 1.0]).exp().tolist()
    far_i = [(16 * e[0] + 16) / (16 * e[0] + 16 + (i + 1) * e[1]) for i in range(16)]
    assert far.block_demand[2] == pytest.approx(sum(far_i) / 16, rel=1e-5)
    # The uniform normalisation divides by the history share 32 / (32 + i + 1).
    lift = layer_with(True, "uniform").block_demand[2]
    assert lift == pytest.approx(sum(f * (33 + i) / 32 for i, f in enumerate(far_i)) / 16, rel=1e-5)


def test_relative_thresholds_follow_the_moving_average():
    layer = AdaKVQLayer(
        key_bits=3, value_bits=3, key_group_size=16, value_group_size=16, residual_length=16
    )
    layer.enable_dynamic(
        dynamic_bits=(2, 3, 4), thresholds=(0.8, 1.25), ema_decay=0.5, normalization="none"
    )
    layer.update(torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32))
    for far in (0.4, 0.2, 0.6, 0.45):  # EMA before each block: -, 0.4, 0.3, 0.45
        for _ in range(16):
            layer.observe_decode_lse(_lse_for_far_mass(far))
            layer.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    layer.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
    # first measured block sets the average; 0.2 < 0.8*0.4 down; 0.6 > 1.25*0.3 up; 0.45 static
    assert layer.block_bits == [(3, 3), (3, 3), (2, 2), (4, 4), (3, 3)]


# ----------------------------------------------------------------------------------------------
# Allocation in, JSON round trip, YAML
# ----------------------------------------------------------------------------------------------


def test_allocation_json_round_trip_into_the_cache(tmp_path):
    model = tiny_model(ARCHS[1], num_hidden_layers=4)
    allocation = allocate_bits([0.05, 0.1, 0.6, 0.4], budget=5.0, group_size=16)
    path = tmp_path / "allocation.json"
    allocation.to_json(path)
    from_file = AdaKVQCache(model.config, str(path), residual_length=16)
    from_dict = AdaKVQCache(model.config, allocation.to_dict(), residual_length=16)
    for cache in (from_file, from_dict):
        assert cache.allocation == allocation
        assert [layer.key_bits for layer in cache.layers] == allocation.key_bits
        assert [layer.value_bits for layer in cache.layers] == allocation.value_bits
        assert cache.dynamic_layers == [2, 3]  # the two most important (long-range) layers
    ids, mask = left_padded_prompts(2, 40, 0)
    greedy_generate(model, ids, mask, from_file, max_new_tokens=4)
    assert (
        from_file.layers[0].block_bits == [(allocation.key_bits[0], allocation.value_bits[0])] * 2
    )
    profile_cache = AdaKVQCache.from_profile(
        model.config, [0.05, 0.1, 0.6, 0.4], budget=5.0, group_size=16, residual_length=16
    )
    # from_profile costs the widths as packed at the model's head dim.
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    packed = allocate_bits([0.05, 0.1, 0.6, 0.4], budget=5.0, group_size=16, head_dim=head_dim)
    assert profile_cache.allocation == packed and packed.head_dim == head_dim
    # An AAD profile JSON (per-layer mean of the normalised AAD over heads and positions).
    naad = torch.tensor([0.05, 0.1, 0.6, 0.4])[:, None, None].expand(4, 2, 3).clone()
    profile = AADProfile(aad=naad * 10, naad=naad, counts=torch.ones(3))
    profile.to_json(tmp_path / "profile.json")
    from_json = AdaKVQCache.from_profile(
        model.config,
        str(tmp_path / "profile.json"),
        budget=5.0,
        group_size=16,
        residual_length=16,
    )
    assert from_json.allocation.key_bits == packed.key_bits
    assert from_json.allocation.value_bits == packed.value_bits
    # The same from init arguments (what a YAML cache_factory gives), with the baselines.
    from_init = AdaKVQCache(
        model.config, profile=str(tmp_path / "profile.json"), budget=5.0, key_group_size=16
    )
    assert from_init.allocation == from_json.allocation
    reverse = AdaKVQCache(
        model.config,
        profile=[0.05, 0.1, 0.6, 0.4],
        budget=5.0,
        allocation_method="reverse",
        key_group_size=16,
    )
    assert reverse.allocation == allocate_bits(
        [0.05, 0.1, 0.6, 0.4], 5.0, method="reverse", group_size=16, head_dim=head_dim
    )


def test_random_allocation_from_init_follows_the_global_seed(monkeypatch):
    config = LlamaConfig(**{**TINY, "num_hidden_layers": 6})
    aad = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]

    def draw(seed: int | None = None) -> BitAllocation:
        cache = AdaKVQCache(
            config,
            profile=aad,
            budget=4.5,
            allocation_method="random",
            allocation_seed=seed,
            key_group_size=16,
        )
        return cache.allocation

    layouts = set()
    for seed in range(4):
        monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))
        assert draw() == draw(seed)
        layouts.add(tuple(draw().key_bits + draw().value_bits))
    assert len(layouts) > 1


def test_causal_lm_module_takes_adakvq_from_yaml_with_a_lazy_allocation_path(tmp_path):
    path = tmp_path / "allocation.json"  # does not exist when the YAML is parsed
    model_args = {
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 1,
        "intermediate_size": 32,
        "max_new_tokens": 3,
        "cache_factory": {
            "class_path": "ada_modules.kv.AdaKVQCache",
            "init_args": {"allocation": str(path), "residual_length": 16, "dynamic_layers": [1]},
        },
    }
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"model": model_args}))
    parser = ArgumentParser()
    parser.add_argument("--config", action="config")
    parser.add_class_arguments(CausalLMModule, "model")
    module = parser.instantiate(parser.parse_args(["--config", str(config)])).model
    BitAllocation([2, 4], [3, 4], group_size=16).to_json(path)
    cache = module.cache_factory(config=module.model.config)
    assert isinstance(cache, AdaKVQCache) and cache.dynamic_layers == [1]
    assert [(layer.key_bits, layer.value_bits) for layer in cache.layers] == [(2, 3), (4, 4)]
    completions, _, used = module.generate(
        torch.full((2, 40), 5), torch.ones(2, 40, dtype=torch.long)
    )
    assert len(completions) == 2 and isinstance(used, AdaKVQCache) and used.nbytes() > 0


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------

CONFIG = Qwen2Config(**TINY)  # 2 layers, head_dim 16


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: AdaKVQCache(CONFIG, BitAllocation.uniform(3, 4, group_size=16)),
            "3 layers but the model has num_layers=2",
        ),
        (
            lambda: AdaKVQCache.from_profile(CONFIG, [0.1, 0.2, 0.3], budget=4.0, group_size=16),
            "3 layers but the model has num_layers=2",
        ),
        (lambda: AdaKVQCache(CONFIG, key_bits=[2, 5], value_bits=2), r"key_bits\[1\] .* got 5"),
        (
            lambda: AdaKVQCache(CONFIG, {"key_bits": [2, 6], "value_bits": [2, 2]}),
            r"key_bits must be taken from .* got \[2, 6\]",
        ),
        (
            lambda: AdaKVQCache.from_profile(CONFIG, [0.1, 0.2], budget=4.0, bit_widths=(2, 7)),
            r"got \[2, 7\]",
        ),
        (
            lambda: AdaKVQCache(
                CONFIG, key_bits=2, value_bits=2, value_group_size=16, dynamic_bits=(2, 5)
            ),
            "dynamic_bits must be one of .* got 5",
        ),
        (
            lambda: AdaKVQCache.from_profile(CONFIG, [0.1, 0.2], budget=2.5, group_size=16),
            "budget=2.5 is below the cheapest width",
        ),
        (lambda: AdaKVQCache(CONFIG, profile=[0.1, 0.2]), "profile needs a budget"),
        (
            lambda: AdaKVQCache(CONFIG, key_bits=2, value_bits=2, budget=4.0),
            "budget=4.0 is only used with a profile",
        ),
        (
            lambda: AdaKVQCache(CONFIG, profile=[0.1, 0.2], budget=5.0, key_bits=2),
            "not several",
        ),
        (
            lambda: AdaKVQCache(
                CONFIG, BitAllocation.uniform(2, 4, group_size=16), key_group_size=32
            ),
            "key_group_size=32 differs from the allocation's group_size=16",
        ),
        (
            lambda: AdaKVQCache(
                CONFIG, key_bits=2, value_bits=2, value_group_size=16, dynamic_layers=[0, 2]
            ),
            r"layer indices in \[0, 2\), got 2",
        ),
        (
            lambda: AdaKVQCache(
                CONFIG, key_bits=2, value_bits=2, value_group_size=16, dynamic_layers=1.5
            ),
            r"in \[0, 1\], got 1.5",
        ),
        (
            lambda: AdaKVQCache(
                CONFIG, key_bits=2, value_bits=2, value_group_size=16, thresholds=(0.9, 0.5)
            ),
            r"thresholds .* got \(0.9, 0.5\)",
        ),
        (
            lambda: AdaKVQCache(CONFIG, key_bits=2, value_bits=2, value_group_size=16, demand="x"),
            "demand must be one of .* got 'x'",
        ),
        (
            lambda: AdaKVQCache(CONFIG, BitAllocation.uniform(2, 4, group_size=16), key_bits=2),
            "either allocation or inline",
        ),
        (lambda: AdaKVQCache(CONFIG), "needs an allocation or both key_bits and value_bits"),
        (
            lambda: AdaKVQCache(CONFIG, BitAllocation.uniform(2, 4, group_size=32)),
            r"value_group_size=32 must divide the head dim \(16\)",
        ),
    ],
    ids=[
        "allocation_layers",
        "profile_layers",
        "inline_bits",
        "allocation_bits",
        "profile_bits",
        "ladder_bits",
        "budget",
        "profile_without_budget",
        "budget_without_profile",
        "profile_and_bits",
        "group_mismatch",
        "dynamic_index",
        "dynamic_fraction",
        "thresholds",
        "demand",
        "both",
        "neither",
        "head_dim",
    ],
)
def test_bad_input_names_the_value(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_missing_allocation_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        AdaKVQCache(CONFIG, str(tmp_path / "nowhere.json"))


def test_static_layers_and_reset_clear_the_dynamic_state():
    cache = AdaKVQCache(num_layers=2, key_bits=3, value_bits=3, residual_length=32)
    assert cache.dynamic_layers == [1] and not cache.layers[0].dynamic
    for layer_idx in range(2):
        cache.update(torch.randn(1, 1, 70, 32), torch.randn(1, 1, 70, 32), layer_idx)
    assert cache.layers[0].block_demand == [] and len(cache.layers[1].block_demand) == 2
    cache.layers[1].reset()
    assert cache.layers[1].block_demand == [] and cache.layers[1].credit == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key_bits": 2.0, "value_bits": 2}, r"key_bits must be one of .* got 2.0 \(float\)"),
        ({"key_bits": 2, "value_bits": [2, 4.0]}, r"value_bits\[1\] must be one of .* got 4.0"),
        ({"key_bits": "24", "value_bits": 2}, r"key_bits must be one of .* got '24' \(str\)"),
        ({"key_bits": 2, "value_bits": 2, "key_group_size": 0}, "key_group_size .* got 0"),
        ({"profile": [0.1, 0.2], "budget": float("nan")}, "budget must be a finite number"),
        ({"profile": [0.1, 0.2], "budget": "4.5"}, "budget must be a finite number .* got '4.5'"),
        ({"profile": [0.1, 0.2], "budget": 4.5, "bit_widths": 2}, "bit_widths must be taken"),
        ({"key_bits": 2, "value_bits": 2, "dynamic_bits": 3}, "dynamic_bits must be a non-empty"),
        ({"key_bits": 2, "value_bits": 2, "dynamic_bits": (2, 3.0)}, "dynamic_bits must be one"),
        ({"key_bits": 2, "value_bits": 2, "thresholds": 0.8}, r"thresholds must be \(low, high\)"),
        ({"key_bits": 2, "value_bits": 2, "thresholds": "ab"}, r"thresholds .* got 'ab'"),
        ({"key_bits": 2, "value_bits": 2, "ema_decay": "x"}, "ema_decay must be a number"),
        ({"key_bits": 2, "value_bits": 2, "num_layers": 2.0}, "num_layers must be a positive"),
        ({"key_bits": 2, "value_bits": 2, "allocation_seed": 1.5}, "allocation_seed must be"),
    ],
)
def test_bits_and_sibling_arguments_are_checked_up_front(kwargs, match):
    # Checked before anything else, even where they are not used (dynamic_layers=[] here).
    from ada_modules.errors import InputError

    with pytest.raises(InputError, match=match):
        AdaKVQCache(CONFIG, value_group_size=16, dynamic_layers=[], **kwargs)


def test_numpy_numbers_pick_the_dynamic_layers():
    """np.float32(0.5) raised "not iterable"; [np.int64(1)] was refused as not a layer index."""
    import numpy as np

    allocation = BitAllocation.uniform(2, 4, group_size=16)
    as_numpy = [np.float32(0.5), [np.int64(1)]]
    as_python = [0.5, [1]]
    for numpy_value, python_value in zip(as_numpy, as_python, strict=True):
        picked = AdaKVQCache(CONFIG, allocation, dynamic_layers=numpy_value, value_group_size=16)
        expected = AdaKVQCache(CONFIG, allocation, dynamic_layers=python_value, value_group_size=16)
        assert picked.dynamic_layers == expected.dynamic_layers == [1]


def test_a_budget_past_the_widest_bits_gives_the_widest_bits_at_once():
    """The DP table had budget-many entries: 1e9 raised MemoryError, 1e6 took seconds."""
    allocation = allocate_bits([0.1, 0.2], budget=1e9, group_size=16)
    assert allocation.key_bits == allocation.value_bits == [4, 4]


@pytest.mark.parametrize("cache_class", [KIVICache, ADKVCache])
def test_layers_the_cache_was_not_built_with_are_named(cache_class):
    kwargs = {"value_group_size": 16} if cache_class is KIVICache else {}
    with pytest.raises(ValueError, match="num_layers=5 disagrees with the config's 2 layers"):
        cache_class(CONFIG, num_layers=5, **kwargs)
    model = tiny_model(ARCHS[1])
    ids, mask = left_padded_prompts(1, 8, 0)
    one_layer = cache_class(None, num_layers=1, **kwargs)
    with pytest.raises(ValueError, match=r"built with 1 layers and the model updated layer 1"):
        model(ids, attention_mask=mask, cache=one_layer)
