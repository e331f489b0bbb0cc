"""Calls our attention functions hand to dense attention: sinks and softcapping as in eager."""

import warnings

import pytest
import torch
import transformers

import ada_modules.attention  # noqa: F401  (registers "adacal")
from ada_modules.kv import QUANTIZED_KV_ATTENTION, KIVICache

_TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "layer_types": ["full_attention"] * 2,
    "sparse_prefill": {"block_size": 16, "min_sparse_length": 32},
}


def _gpt_oss(attn: str) -> transformers.PreTrainedModel:
    config = transformers.GptOssConfig(
        **_TINY, intermediate_size=32, num_local_experts=2, num_experts_per_tok=1
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(3.0)  # SDPA would drop them: logits change by ~0.5
    return model.eval()


def _gemma2(attn: str) -> transformers.PreTrainedModel:
    # SDPA refuses softcapping
    config = transformers.Gemma2Config(**_TINY, intermediate_size=64, attn_logit_softcapping=2.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


_MODELS = {"gpt_oss_sinks": _gpt_oss, "gemma2_softcap": _gemma2}


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("attn", ["adacal", QUANTIZED_KV_ATTENTION])
@pytest.mark.parametrize("name", list(_MODELS))
def test_prefill_equals_the_models_eager_attention(name, attn, padded):
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :7] = 0
    eager = _MODELS[name]("eager")
    model = _MODELS[name](attn)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adacal warns that these layers run dense attention
        expected = eager(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["adacal", QUANTIZED_KV_ATTENTION])
@pytest.mark.parametrize("name", list(_MODELS))
def test_a_static_cache_prefill_sees_only_the_prompt(name, attn):
    # the mask builder skips the mask here (SDPA's is_causal aligns at the top left, and the
    # cache's empty slots come after the prompt); eager attention needs it built
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    logits = []
    for implementation in ("eager", attn):
        model = _MODELS[name](implementation)
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits.append(model(ids, past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(_MODELS))
def test_quantized_kv_decodes_like_eager_over_the_same_packed_cache(name):
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    scores = []
    for attn in ("eager", QUANTIZED_KV_ATTENTION):
        model = _MODELS[name](attn)
        cache = KIVICache(
            model.config,
            key_bits=4,
            value_bits=4,
            key_group_size=16,
            value_group_size=8,
            residual_length=16,
        )
        out = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        scores.append(torch.stack(out.scores))
    torch.testing.assert_close(scores[1], scores[0], atol=1e-4, rtol=1e-4)
