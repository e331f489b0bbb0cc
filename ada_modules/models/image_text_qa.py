"""Trains a tiny two-modality model (image prefix + causal LM) to answer image/text questions."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor
from torch.nn import functional as F

from ada_modules.data.modality_conflict import ITEM_KINDS, without_image, without_text
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError
from ada_modules.models.causal_lm import build_causal_lm
from ada_modules.nn.image_prefix_lm import ImagePrefixLM
from ada_modules.steering import capture_hidden_states, modality_contribution_ratio

__all__ = ["ImageTextQAModule", "answer_state", "image_contribution_ratio", "option_logits"]


def option_logits(model: ImagePrefixLM, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The answer position's logits over the two option letters ``(batch, 2)`` and over the whole
    vocabulary ``(batch, vocab)``, for the prompts of ``batch``."""
    logits = model(batch["patches"], batch["image_present"], batch["prompt_ids"])[:, -1]
    letters = torch.tensor(CharTokenizer().encode("AB"), device=logits.device)
    return logits[:, letters], logits


def answer_state(model: ImagePrefixLM, batch: dict[str, Tensor], layer: int) -> Tensor:
    """Decoder ``layer``'s output at the prompt's last position, ``(batch, hidden)``."""
    with capture_hidden_states(model.lm, [layer]) as states:
        model(batch["patches"], batch["image_present"], batch["prompt_ids"])
    return states[layer][0][:, -1]


def image_contribution_ratio(model: ImagePrefixLM, batch: dict[str, Tensor]) -> Tensor:
    """The image's Modality Contribution Ratio per question, by ablation of the option-letter
    distribution (three forward passes; the text's share is one minus it)."""
    full, _ = option_logits(model, batch)
    no_image, _ = option_logits(model, without_image(batch))
    no_text, _ = option_logits(model, without_text(batch))
    return modality_contribution_ratio(full, no_image, no_text)


class ImageTextQAModule(LightningModule):
    """A randomly initialised :class:`~ada_modules.nn.ImagePrefixLM` trained on
    :class:`~ada_modules.data.ModalityConflictDataModule` questions.

    Training minimises the answer tokens' cross-entropy (letter, digit, ``<eos>``). Validation
    logs ``val/loss`` and ``val/accuracy`` (the option letter with the higher logit is the label's).
    Test logs, per item kind, ``test/accuracy_<kind>``, and on the conflicts ``test/text_rate``
    and ``test/image_rate`` (share of answers that follow each modality; the option letters
    always name one of the two digits), also for sure and hedged statements apart
    (``test/image_rate_sure``, ``test/image_rate_hedged``, ...): the model's modality preference,
    which :class:`~ada_modules.models.ModalitySteeringModule` then steers.

    Args:
        hidden_size: Width of the decoder (a Llama built from config).
        num_layers: Decoder layers.
        num_heads: Attention heads.
        intermediate_size: MLP width.
        optimizer: Optimizer factory.

    Example:
        >>> module = ImageTextQAModule(hidden_size=32, num_layers=1, num_heads=2,
        ...                            intermediate_size=64)
        >>> type(module.model.lm).__name__
        'LlamaForCausalLM'
    """

    def __init__(
        self,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        intermediate_size: int = 256,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        super().__init__()
        if hidden_size % num_heads:
            raise InputError(
                f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}"
            )
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer = optimizer
        lm = build_causal_lm(
            CharTokenizer(),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=64,
        )
        self.model = ImagePrefixLM(lm, patch_dim=16, num_patches=4)

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.parameters())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        prompt, answer = batch["prompt_ids"], batch["answer_ids"]
        ids = torch.cat([prompt, answer[:, :-1]], dim=1)
        logits = self.model(batch["patches"], batch["image_present"], ids)
        answer_logits = logits[:, -answer.shape[1] :]
        loss = F.cross_entropy(
            answer_logits.reshape(-1, answer_logits.shape[-1]), answer.reshape(-1)
        )
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        letters, _ = option_logits(self.model, batch)
        loss = F.cross_entropy(letters, batch["target"])
        accuracy = (letters.argmax(-1) == batch["target"]).float().mean()
        self.log_dict({"val/loss": loss, "val/accuracy": accuracy}, batch_size=len(letters))

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        letters, _ = option_logits(self.model, batch)
        chosen = batch["options"].gather(1, letters.argmax(-1, keepdim=True)).squeeze(1)
        correct = letters.argmax(-1) == batch["target"]
        for index, kind in enumerate(ITEM_KINDS):
            rows = batch["kind"] == index
            if rows.any():
                self.log(
                    f"test/accuracy_{kind}",
                    correct[rows].float().mean(),
                    batch_size=int(rows.sum()),
                )
        conflicts = batch["kind"] == ITEM_KINDS.index("conflict")
        follows_image = (chosen == batch["image_class"]).float()
        groups = {
            "": conflicts,
            "_sure": conflicts & ~batch["hedged"],
            "_hedged": conflicts & batch["hedged"],
        }
        for suffix, rows in groups.items():
            if rows.any():
                image = follows_image[rows].mean()
                self.log(f"test/image_rate{suffix}", image, batch_size=int(rows.sum()))
                self.log(f"test/text_rate{suffix}", 1 - image, batch_size=int(rows.sum()))
