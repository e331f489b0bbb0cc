"""The sparse prefill attention functions registered with transformers, and their monitor."""

import json
import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, StaticCache
from transformers.masking_utils import AttentionMaskInterface

from ada_modules.attention import (
    SPARSE_PREFILL_POLICIES,
    AdaCalPolicy,
    AShapePolicy,
    TaskDispatcher,
    policy_from_config,
    record_sparse_prefill,
    set_sparse_prefill_policy,
    sparse_prefill_forward,
)
from ada_modules.callbacks import SparsePrefillMonitor
from ada_modules.data import RecallDataModule
from ada_modules.errors import InputError
from ada_modules.models import CausalLMModule

SPARSE = {"block_size": 16, "min_sparse_length": 32}


def _model(attn_implementation: str, sparse_prefill: dict | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        attn_implementation=attn_implementation,
        sparse_prefill=sparse_prefill,
    )
    return LlamaForCausalLM(config).eval()


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 40, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0  # left padding of the second prompt
    return ids, mask


def test_every_policy_name_is_registered_with_its_mask():
    for name in SPARSE_PREFILL_POLICIES:
        assert name in AttentionInterface._global_mapping
        assert name in AttentionMaskInterface._global_mapping


def test_dense_plan_gives_the_logits_of_sdpa_with_padding():
    ids, mask = _padded_batch()
    reference = _model("sdpa")
    sparse = _model("sparse_dense", SPARSE)
    sparse.load_state_dict(reference.state_dict())
    with torch.no_grad(), record_sparse_prefill() as log:
        expected = reference(ids, attention_mask=mask).logits
        got = sparse(ids, attention_mask=mask).logits
    assert len(log.calls) == 2 and log.dense_fallbacks == 0  # one sparse call per layer
    assert log.calls[0].density == 1.0
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_static_cache_prefill_runs_sparse_on_the_prompt_keys(padded):
    ids, mask = _padded_batch()
    mask = mask if padded else torch.ones_like(mask)
    reference = _model("sdpa")
    sparse = _model("sparse_dense", SPARSE)
    sparse.load_state_dict(reference.state_dict())
    with torch.no_grad(), record_sparse_prefill() as log:
        expected = reference(ids, attention_mask=mask).logits
        cache = StaticCache(config=sparse.config, max_cache_len=90)  # 20 empty slots
        got = sparse(ids, attention_mask=mask, cache=cache).logits
    assert [(call.q_len, call.k_len) for call in log.calls] == [(70, 70)] * 2
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_a_mask_beyond_causal_with_padding_runs_sdpa_with_a_warning():
    ids = torch.randint(1, 40, (1, 80), generator=torch.Generator().manual_seed(1))
    documents = torch.ones(40, 40, dtype=torch.bool).tril()
    mask = torch.block_diag(documents, documents)[None, None]  # two packed documents
    positions = torch.arange(40).repeat(2)[None]
    reference = _model("sdpa")
    sparse = _model("sparse_dense", SPARSE)
    sparse.load_state_dict(reference.state_dict())
    with torch.no_grad(), record_sparse_prefill() as log:
        expected = reference(ids, attention_mask=mask, position_ids=positions).logits
        with pytest.warns(UserWarning, match="attention mask"):
            got = sparse(ids, attention_mask=mask, position_ids=positions).logits
    assert log.calls == [] and log.dense_fallbacks == 2
    torch.testing.assert_close(got, expected)


def test_an_additive_mask_runs_sparse_and_an_additive_bias_runs_sdpa():
    attention = _model("sparse_dense", SPARSE).model.layers[0].self_attn
    query, key = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, 40, 40).masked_fill(~causal, torch.finfo(torch.float32).min)
    with torch.no_grad(), record_sparse_prefill() as log:
        sparse_prefill_forward(attention, query, key, key, additive)
        with pytest.warns(UserWarning, match="attention mask"):
            sparse_prefill_forward(attention, query, key, key, additive - causal.float())
    assert len(log.calls) == 1 and log.dense_fallbacks == 1


def test_non_finite_activations_give_nan_like_sdpa():
    reference = _model("sdpa")
    adacal = _model("adacal", SPARSE)
    embeds = reference.model.embed_tokens(torch.randint(1, 40, (1, 40))).detach()
    embeds[0, 5] = float("nan")
    with torch.no_grad():
        expected = reference(inputs_embeds=embeds).logits
        got = adacal(inputs_embeds=embeds).logits
    assert torch.equal(got.isnan(), expected.isnan())


def test_adacal_is_sparse_on_long_prompts_and_dense_on_decode_and_short_prompts():
    ids, mask = _padded_batch()
    model = _model("adacal", {**SPARSE, "max_density": 0.5})
    with torch.no_grad(), record_sparse_prefill() as log:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        model(ids[:, :20])  # shorter than min_sparse_length
    assert out.shape == (2, 73)
    assert len(log.calls) == 2  # the prefill, one call per layer
    assert all(0 < call.density <= 1 and call.regime is not None for call in log.calls)
    assert log.dense_fallbacks == 2 * 2 + 2  # two decode steps and the short prompt, per layer
    summary = log.summary()
    assert set(summary) >= {"attention_density", "probe_overhead", "retrieval_fraction"}


def test_training_takes_the_dense_path():
    model = _model("adacal", SPARSE).train()
    with record_sparse_prefill() as log:
        model(torch.randint(0, 40, (1, 64)), labels=torch.randint(0, 40, (1, 64))).loss.backward()
    assert log.calls == [] and log.dense_fallbacks == 2


def test_set_policy_wins_over_the_config():
    ids, _ = _padded_batch()
    model = _model("sparse_a_shape", SPARSE)
    assert set_sparse_prefill_policy(model, AShapePolicy(**SPARSE, local_blocks=1)) == 2
    with torch.no_grad(), record_sparse_prefill() as log:
        model(ids)
    default = _model("sparse_a_shape", SPARSE)
    with torch.no_grad(), record_sparse_prefill() as default_log:
        default(ids)
    assert log.calls[0].density < default_log.calls[0].density


def test_set_policy_warns_when_the_model_does_not_run_a_sparse_attention():
    model = _model("sdpa")
    with pytest.warns(UserWarning, match=r"attn_implementation is \['sdpa'\], not one of"):
        assert set_sparse_prefill_policy(model, AShapePolicy(**SPARSE, local_blocks=1)) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_sparse_prefill_policy(model, None)  # going back needs no sparse implementation
        set_sparse_prefill_policy(_model("adacal"), AShapePolicy(**SPARSE, local_blocks=1))


def test_dispatch_path_loads_a_fitted_dispatcher(tmp_path):
    features = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]] * 4)
    dispatcher = TaskDispatcher().fit(features, torch.tensor([0, 1] * 4))
    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps(dispatcher.state_dict()))
    policy = policy_from_config("adacal", {**SPARSE, "dispatch_path": str(path)})
    assert isinstance(policy, AdaCalPolicy)
    assert policy.dispatcher.state_dict() == dispatcher.state_dict()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not JSON"),
        ('{"thresholds": 1}', "unknown keys"),
        (
            '{"logistic": {"weight": [NaN, 0, 0, 0], "bias": 0, "mean": [0, 0, 0, 0],'
            ' "std": [1, 1, 1, 1]}}',
            "must be finite",
        ),
        (
            '{"logistic": {"weight": ["a", 0, 0, 0], "bias": 0, "mean": [0, 0, 0, 0],'
            ' "std": [1, 1, 1, 1]}}',
            "must be numbers",
        ),
    ],
)
def test_a_bad_dispatch_file_is_named(tmp_path, text, message):
    path = tmp_path / "dispatch.json"
    path.write_text(text)
    with pytest.raises(InputError, match=f"dispatch_path .*{message}"):
        policy_from_config("adacal", {**SPARSE, "dispatch_path": str(path)})


def test_sliding_window_layers_run_sdpa_with_a_warning():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    kwargs = {
        "vocab_size": 40,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "sliding_window": 16,
    }
    reference = MistralForCausalLM(MistralConfig(**kwargs, attn_implementation="sdpa")).eval()
    sparse = MistralForCausalLM(
        MistralConfig(**kwargs, attn_implementation="adacal", sparse_prefill=SPARSE)
    ).eval()
    sparse.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 40, (1, 64))
    with torch.no_grad(), record_sparse_prefill() as log:
        expected = reference(ids).logits
        with pytest.warns(UserWarning, match="sliding_window"):
            got = sparse(ids).logits
    assert log.calls == [] and log.dense_fallbacks == 1
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("sparse_nope", None, "no sparse prefill policy named 'sparse_nope'"),
        ("adacal", [1], "config.sparse_prefill must be a dict"),
        ("sparse_a_shape", {"gamma": 0.9}, "does not fit 'sparse_a_shape'"),
        ("sparse_a_shape", {"dispatch_path": "x.json"}, "applies to 'adacal' only"),
        ("adacal", {"dispatch_path": "missing.json"}, "is not a file"),
        ("adacal", {"block_size": 48}, "block_size must be a power of two >= 16, got 48"),
    ],
)
def test_bad_options_are_named(name, options, message):
    with pytest.raises(InputError, match=message):
        policy_from_config(name, options)


def test_monitor_logs_density_of_a_causal_lm_test(tmp_path):
    torch.manual_seed(0)
    module = CausalLMModule(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=64,
        max_new_tokens=2,
        attn_implementation="adacal",
        config_overrides={"sparse_prefill": {"block_size": 16, "min_sparse_length": 16}},
    )
    data = RecallDataModule(num_pairs=6, num_train=8, num_val=4, num_test=4, batch_size=4)
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SparsePrefillMonitor()],
        default_root_dir=tmp_path,
    )
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    assert metrics["test/sparse_calls"] >= 2
    assert 0 < metrics["test/attention_density"] <= 1
    assert metrics["test/dense_fallbacks"] >= 2  # the decode step


def test_monitor_evaluates_an_sdpa_model_with_a_policy_and_restores_it(tmp_path):
    torch.manual_seed(0)
    module = CausalLMModule(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=64,
        max_new_tokens=2,
    )
    data = RecallDataModule(num_pairs=6, num_train=8, num_val=4, num_test=4, batch_size=4)
    monitor = SparsePrefillMonitor("sparse_a_shape", {"block_size": 16, "min_sparse_length": 16})
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
        default_root_dir=tmp_path,
    )
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    assert metrics["test/sparse_calls"] >= 2
    assert module.model.config._attn_implementation == "sdpa"  # restored after the loop
    with torch.no_grad(), record_sparse_prefill() as log:
        module.model(torch.randint(0, 10, (1, 40)))
    assert log.calls == [] and log.dense_fallbacks == 0  # plain SDPA again


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attn_implementation": "sdpa"}, "attn_implementation must be one of"),
        ({"sparse_prefill": {"block_size": 16}}, "sparse_prefill needs attn_implementation"),
        ({"attn_implementation": "adacal", "sparse_prefill": {"gamma": 2}}, "does not fit"),
    ],
)
def test_monitor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        SparsePrefillMonitor(**kwargs)
