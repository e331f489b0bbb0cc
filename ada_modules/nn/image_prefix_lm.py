"""A two-modality model: image patches projected into a causal LM's embedding space as a prefix."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from ada_modules.errors import InputError

__all__ = ["ImagePrefixLM"]


class ImagePrefixLM(nn.Module):
    """``[<bos>, image tokens, text tokens]`` into a transformers causal LM, LLaVA-style.

    Each image patch goes through a linear projector into the LM's embedding space; an absent
    image (``image_present`` false) is replaced by learned "no image" tokens, so "remove the
    image" is an input the model is trained on. Steering hooks and captures go on ``self.lm``
    (:func:`ada_modules.steering.steer`).

    Args:
        lm: A transformers causal LM (e.g. from :func:`~ada_modules.models.build_causal_lm`).
        patch_dim: Values per image patch.
        num_patches: Image tokens per image.

    Example:
        >>> from ada_modules.data import CharTokenizer
        >>> from ada_modules.models.causal_lm import build_causal_lm
        >>> lm = build_causal_lm(CharTokenizer(), hidden_size=32, num_layers=1, num_heads=2,
        ...                      num_kv_heads=2, intermediate_size=64)
        >>> model = ImagePrefixLM(lm, patch_dim=16, num_patches=4)
        >>> logits = model(torch.rand(2, 4, 16), torch.tensor([True, False]),
        ...                torch.randint(3, 20, (2, 9)))
        >>> tuple(logits.shape)  # 1 + 4 + 9 positions
        (2, 14, 84)
        >>> tuple(model.generate(torch.rand(2, 4, 16), torch.tensor([True, True]),
        ...                      torch.randint(3, 20, (2, 9)), max_new_tokens=3).shape)
        (2, 3)
    """

    def __init__(self, lm: PreTrainedModel, patch_dim: int = 16, num_patches: int = 4) -> None:
        super().__init__()
        for name, value in (("patch_dim", patch_dim), ("num_patches", num_patches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an int >= 1, got {value!r}")
        hidden = int(lm.config.hidden_size)
        self.lm = lm
        self.patch_dim = patch_dim
        self.num_patches = num_patches
        self.projector = nn.Sequential(
            nn.Linear(patch_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden)
        )
        self.position = nn.Parameter(torch.randn(num_patches, hidden) * 0.02)
        self.no_image = nn.Parameter(torch.randn(num_patches, hidden) * 0.02)

    @property
    def prefix_length(self) -> int:
        """Positions before the text: ``<bos>`` and the image tokens."""
        return 1 + self.num_patches

    def embed(self, patches: Tensor, image_present: Tensor, input_ids: Tensor) -> Tensor:
        """``(batch, prefix_length + text, hidden)`` input embeddings."""
        if patches.dim() != 3 or patches.shape[1:] != (self.num_patches, self.patch_dim):
            raise InputError(
                f"patches must be (batch, {self.num_patches}, {self.patch_dim}), got "
                f"{tuple(patches.shape)}"
            )
        table = self.lm.get_input_embeddings()
        image = self.projector(patches) + self.position
        image = torch.where(image_present.view(-1, 1, 1), image, self.no_image.expand_as(image))
        bos = table(torch.full_like(input_ids[:, :1], int(self.lm.config.bos_token_id)))
        return torch.cat([bos, image.to(bos.dtype), table(input_ids)], dim=1)

    def forward(self, patches: Tensor, image_present: Tensor, input_ids: Tensor) -> Tensor:
        """Next-token logits at every position, ``(batch, prefix_length + text, vocab)``."""
        return self.lm(inputs_embeds=self.embed(patches, image_present, input_ids)).logits

    @torch.no_grad()
    def generate(
        self, patches: Tensor, image_present: Tensor, input_ids: Tensor, max_new_tokens: int = 3
    ) -> Tensor:
        """Greedy continuation of the prompts with a KV cache: ``(batch, max_new_tokens)`` ids.

        Rows that emitted ``<eos>`` continue with ``<pad>``.
        """
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1
        ):
            raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        cache = DynamicCache()
        out = self.lm(
            inputs_embeds=self.embed(patches, image_present, input_ids), cache=cache, use_cache=True
        )
        eos, pad = int(self.lm.config.eos_token_id), int(self.lm.config.pad_token_id)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        tokens = []
        for _ in range(max_new_tokens):
            token = out.logits[:, -1].argmax(-1)
            token = torch.where(done, torch.full_like(token, pad), token)
            tokens.append(token)
            done |= token == eos
            if len(tokens) < max_new_tokens:
                out = self.lm(input_ids=token[:, None], cache=out.cache, use_cache=True)
        return torch.stack(tokens, dim=1)
