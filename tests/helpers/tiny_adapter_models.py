"""Tiny perturbed models for the adapter tests (ANCRe and multi-stream): HF Llama/Qwen2, a timm
ViT, a diffusers DiT. Random non-zero weights everywhere, so that zero-initialised parts of a
wrapper cannot hide a bug.

Imported by ``tests/nn`` (``pythonpath = ["tests"]`` in pyproject.toml).
"""

import timm
import torch
from diffusers import DiTTransformer2DModel
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def perturb(model: nn.Module) -> nn.Module:
    """Add ``0.1 * N(0, 1)`` to every parameter; eval mode."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def tiny_llama(layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return perturb(LlamaForCausalLM(config))


def tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return perturb(Qwen2ForCausalLM(config))


def tiny_vit() -> nn.Module:
    return perturb(
        timm.models.VisionTransformer(
            img_size=16, patch_size=8, embed_dim=16, depth=3, num_heads=2, num_classes=4
        )
    )


def tiny_dit() -> nn.Module:
    return perturb(
        DiTTransformer2DModel(
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            num_layers=3,
            sample_size=8,
            norm_num_groups=4,
            num_embeds_ada_norm=10,
        )
    )
