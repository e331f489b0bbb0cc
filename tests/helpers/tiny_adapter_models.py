"""Tiny perturbed models for the adapter tests (ANCRe and multi-stream): HF Llama/Qwen2/LLaVA, a
timm ViT, diffusers DiT, CogView3Plus, SD3 and Sana. Random non-zero weights everywhere, so that zero-initialised parts of a
wrapper cannot hide a bug.

Imported by ``tests/nn`` (``pythonpath = ["tests"]`` in pyproject.toml).
"""

import diffusers
import timm
import torch
import transformers
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


def tiny_llava() -> nn.Module:
    """A LLaVA: a 16-wide vision tower, a 24-wide language model, image token 31 (4 patches)."""
    vision = transformers.CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    text = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=24,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=31)
    return perturb(transformers.LlavaForConditionalGeneration(config))


def tiny_cogview3plus() -> nn.Module:
    """Calls its blocks with ``hidden_states=``; they return (hidden, encoder states)."""
    return perturb(
        diffusers.CogView3PlusTransformer2DModel(
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            out_channels=4,
            text_embed_dim=12,
            time_embed_dim=8,
            condition_dim=4,
            pos_embed_max_size=8,
            sample_size=8,
        )
    )


def tiny_sd3() -> nn.Module:
    """Its blocks return (encoder states, hidden states): not wrappable."""
    return diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=12,
        caption_projection_dim=16,
        pooled_projection_dim=6,
        out_channels=4,
        pos_embed_max_size=8,
    )


def tiny_sana() -> nn.Module:
    """Has ``transformer_blocks`` but no ``inner_dim``."""
    return diffusers.SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=12,
        sample_size=8,
        patch_size=2,
    )
