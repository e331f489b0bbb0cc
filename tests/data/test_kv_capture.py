"""Capturing post-RoPE Q/K/V from a tiny Llama, and serving a saved capture as data."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ada_modules.data import (
    CapturedKV,
    CapturedKVDataModule,
    apply_rope,
    capture_kv,
    load_captured_kv,
    save_captured_kv,
)
from ada_modules.errors import InputError


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
    )
    return LlamaForCausalLM(config).eval()


def _projections(model: LlamaForCausalLM, input_ids: torch.Tensor) -> list[dict]:
    """Pre-RoPE q_proj/k_proj outputs of every layer, (B, H, T, D), recorded by hooks."""
    seen: list[dict] = [{} for _ in model.model.layers]
    hooks = []
    for layer, store in zip(model.model.layers, seen, strict=True):
        for name in ("q_proj", "k_proj"):

            def hook(module, args, output, store=store, name=name):
                store[name] = output.unflatten(-1, (-1, 16)).transpose(1, 2)

            hooks.append(getattr(layer.self_attn, name).register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids, use_cache=False)
    for handle in hooks:
        handle.remove()
    return seen


def test_capture_equals_dynamic_cache_and_rope_of_projections(model):
    input_ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    captured = capture_kv(model, input_ids)
    with torch.no_grad():
        cache = model(input_ids, use_cache=True).cache
    assert len(captured) == len(cache.layers) == 2
    projections = _projections(model, input_ids)
    for layer, cached, proj in zip(captured, cache.layers, projections, strict=True):
        assert layer.keys.shape == layer.values.shape == (2, 2, 12, 16)
        assert layer.queries.shape == (2, 4, 12, 16) and layer.queries.dtype == torch.float32
        torch.testing.assert_close(layer.keys, cached.keys)
        torch.testing.assert_close(layer.values, cached.values)
        torch.testing.assert_close(layer.queries, apply_rope(proj["q_proj"], torch.arange(12)))
        torch.testing.assert_close(layer.keys, apply_rope(proj["k_proj"], torch.arange(12)))
    assert model.config._attn_implementation == "sdpa"


def test_capture_restores_the_attention_implementation_on_error(model):
    with pytest.raises(IndexError):
        capture_kv(model, torch.tensor([[0, 99]]))  # token id past the vocabulary
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(InputError, match="Linear"):
        capture_kv(torch.nn.Linear(2, 2), torch.zeros(1, 2))


def test_datamodule_splits_sequences_and_inverts_rope(model, tmp_path):
    input_ids = torch.randint(0, 32, (4, 20), generator=torch.Generator().manual_seed(2))
    captured = capture_kv(model, input_ids)
    path = tmp_path / "kv.pt"
    save_captured_kv(path, captured)
    torch.testing.assert_close(load_captured_kv(path)[1].queries, captured[1].queries)
    dm = CapturedKVDataModule(path, num_queries=5, rope_base=10000.0, batch_size=4)
    dm.setup("fit")
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [4, 2, 2]
    batch = next(iter(dm.val_dataloader()))
    assert set(batch) == {"keys", "values", "queries", "keys_pre_rope", "layer"}
    assert batch["keys"].shape == batch["keys_pre_rope"].shape == (2, 2, 15, 16)
    assert batch["queries"].shape == (2, 4, 5, 16) and batch["layer"].tolist() == [0, 1]
    # Val is sequence 2 (the 4 sequences are cut 2/1/1); keys precede the queries.
    torch.testing.assert_close(batch["keys"][1], captured[1].keys[2, :, :15])
    torch.testing.assert_close(batch["queries"][1], captured[1].queries[2, :, 15:])
    pre_rope = _projections(model, input_ids)[1]["k_proj"][2, :, :15]
    torch.testing.assert_close(batch["keys_pre_rope"][1], pre_rope, atol=1e-5, rtol=1e-4)


def test_datamodule_token_ranges_cut_one_sequence(tmp_path):
    layer = CapturedKV(torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 4, 40, 8))
    path = tmp_path / "kv.pt"
    save_captured_kv(path, [layer])
    ranges = {"train": (0, 20), "val": (20, 30), "test": (30, 40)}
    dm = CapturedKVDataModule(path, num_queries=4, token_ranges=ranges)
    dm.setup("test")
    item = dm.datasets["test"][0]
    assert "keys_pre_rope" not in item
    torch.testing.assert_close(item["keys"], layer.keys[0, :, 30:36])
    torch.testing.assert_close(item["queries"], layer.queries[0, :, 36:40])
    with pytest.raises(InputError, match="fractions=.*without any of the 1 sequences"):
        CapturedKVDataModule(path, num_queries=4).setup("fit")
    past_end = {**ranges, "test": (30, 50)}
    with pytest.raises(InputError, match=r"token_ranges\['test'\] ends at 50"):
        CapturedKVDataModule(path, num_queries=4, token_ranges=past_end).setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_queries": 0}, "num_queries must be an integer >= 1, got 0"),
        ({"fractions": (0.6, 0.3, 0.3)}, r"fractions.*\(0.6, 0.3, 0.3\)"),
        (
            {"token_ranges": {"train": (0, 20), "val": (10, 30), "test": (30, 40)}},
            "must not overlap",
        ),
        (
            {"token_ranges": {"train": (0, 20), "val": (20, 22), "test": (30, 40)}},
            r"token_ranges\['val'\].*\(20, 22\)",
        ),
    ],
)
def test_datamodule_bad_arguments_name_the_value(kwargs, message, tmp_path):
    with pytest.raises(InputError, match=message):
        CapturedKVDataModule(tmp_path / "kv.pt", **{"num_queries": 4, **kwargs})
