"""Tiny Llama/Qwen2 models, left-padded prompts and greedy ``generate`` for the KV-cache tests.

Imported by ``tests/kv`` (``pythonpath = ["tests"]`` in pyproject.toml).
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

TINY = {
    "vocab_size": 48,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "pad_token_id": 0,
    "eos_token_id": None,  # generate exactly max_new_tokens
    "initializer_range": 0.1,  # peakier logits than the default 0.02: fewer near-ties
}
ARCHS = [(LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM)]


def tiny_model(arch, seed=0, **overrides):
    """A seeded eval-mode model of ``arch`` (a ``(config class, model class)`` pair)."""
    torch.manual_seed(seed)
    config_class, model_class = arch
    return model_class(config_class(**{**TINY, **overrides})).eval()


def left_padded_prompts(batch, length, seed):
    """Left-padded prompts: row b has ``3 * b`` pad tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY["vocab_size"], (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(batch):
        ids[b, : 3 * b] = 0
        mask[b, : 3 * b] = 0
    return ids, mask


def greedy_generate(model, ids, mask, cache, **kwargs):
    """Greedy ``generate`` with ``cache``, returning sequences and scores."""
    return model.generate(
        ids,
        attention_mask=mask,
        cache=cache,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )
