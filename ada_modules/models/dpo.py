"""DPO on a tiny causal LM with scarce human and abundant AI preference labels."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError
from ada_modules.models.causal_lm import build_causal_lm
from ada_modules.models.preference import PreferenceModule, pair_tokens
from ada_modules.posttrain.abc import dpo_margin

__all__ = ["DPOModule"]


def _at_least_float32(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 if it is narrower (bf16/fp16 logits), else as it is (float64 stays)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class DPOModule(PreferenceModule):
    """DPO of a causal LM against a frozen copy of itself, with a semi-supervised estimator.

    The margin is DPO's ``β·[(log π - log π_ref)(first) - (log π - log π_ref)(second)]`` over the
    response tokens (everything after ``<bos>``, ``<eos>`` included). The reference is the policy
    as built (a copy frozen at construction). The statistics for λ̂ and ŵ are per-example
    gradients of the LM head: ``∇_W log π(y) = Σ_t (e_{y_t} - p_t) z_tᵀ`` (``z_t``: the final
    hidden state), differenced between the two responses and scaled by β. At test time it also
    samples ``num_samples`` responses and logs their mean true reward and length
    (``test/sample_reward``, ``test/sample_length``), when the datamodule has a ``world``.

    Args:
        beta: DPO's β.
        num_samples: Responses sampled at test time (0: none).
        architecture: The policy's architecture
            (:func:`~ada_modules.models.causal_lm.build_causal_lm`, CharTokenizer vocabulary).
        hidden_size: The policy's width.
        num_layers: Decoder layers.
        num_heads: Attention heads (as many key-value heads).
        intermediate_size: MLP width.
        model_wrapper: Called once as ``model_wrapper(policy)`` on the built policy, before the
            reference is copied from it (e.g. ANCRe's ``ConnectivityWrapper`` or AOT-POT's
            ``StreamsWrapper``); ``None`` keeps the policy as built.
        estimator: See :class:`~ada_modules.models.preference.PreferenceModule`.
        refresh_every_n_steps: See :class:`~ada_modules.models.preference.PreferenceModule`.
        statistics_unlabelled: See :class:`~ada_modules.models.preference.PreferenceModule`.
        optimizer: Optimizer factory (given the policy's parameters).

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> from ada_modules.data.preference_world import PreferenceDataModule
        >>> dm = PreferenceDataModule(num_labelled=16, num_unlabelled=64, num_val=32,
        ...                           num_test=32, batch_size=32, labelled_batch_size=8)
        >>> model = DPOModule(estimator="abc", hidden_size=16, intermediate_size=32,
        ...                   num_samples=0)
        >>> trainer = Trainer(max_steps=2, accelerator="cpu", logger=False,
        ...                   enable_checkpointing=False, enable_progress_bar=False,
        ...                   enable_model_summary=False)
        >>> trainer.fit(model, datamodule=dm)
        >>> 0.0 <= model.weights.weight <= 1.0
        True
    """

    def __init__(
        self,
        estimator: Literal["human", "pseudo", "concat", "ppi", "ppi++", "abc"] = "abc",
        beta: float = 0.1,
        num_samples: int = 256,
        architecture: Literal["llama", "qwen2"] = "llama",
        hidden_size: int = 32,
        num_layers: int = 1,
        num_heads: int = 2,
        intermediate_size: int = 64,
        model_wrapper: Callable[[PreTrainedModel], Any] | None = None,
        refresh_every_n_steps: int | None = None,
        statistics_unlabelled: int = 512,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        super().__init__(estimator, refresh_every_n_steps, statistics_unlabelled, optimizer)
        if not beta > 0.0:
            raise InputError(f"beta must be positive, got {beta}")
        if num_samples < 0:
            raise InputError(f"num_samples must be at least 0, got {num_samples}")
        self.save_hyperparameters(ignore=["optimizer", "model_wrapper"])
        self.beta, self.num_samples = beta, num_samples
        self.tokenizer = CharTokenizer()
        self.policy = build_causal_lm(
            self.tokenizer,
            architecture,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=256,
        )
        if model_wrapper is not None:
            model_wrapper(self.policy)
        self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()

    def train(self, mode: bool = True) -> DPOModule:
        super().train(mode)
        self.reference.eval()
        return self

    def _logits_and_targets(self, model: nn.Module, ids: Tensor, hidden: bool = False):
        mask = (ids != self.tokenizer.pad_id).long()
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=hidden)
        targets = ids[:, 1:]
        return out, targets, (targets != self.tokenizer.pad_id)

    def _sequence_logps(self, model: nn.Module, ids: Tensor) -> Tensor:
        out, targets, mask = self._logits_and_targets(model, ids)
        logps = F.log_softmax(_at_least_float32(out.logits[:, :-1]), -1)
        return (logps.gather(-1, targets[..., None]).squeeze(-1) * mask).sum(1)

    def margin(self, batch: dict[str, Tensor]) -> Tensor:
        ids, count = pair_tokens(batch)
        policy = self._sequence_logps(self.policy, ids)
        with torch.no_grad():
            reference = self._sequence_logps(self.reference, ids)
        return dpo_margin(
            policy[:count], policy[count:], reference[:count], reference[count:], self.beta
        )

    def margin_and_head_gradients(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        ids, count = pair_tokens(batch)
        out, targets, mask = self._logits_and_targets(self.policy, ids, hidden=True)
        logits = _at_least_float32(out.logits[:, :-1])
        probs = logits.softmax(-1)
        residual = F.one_hot(targets, probs.shape[-1]).to(probs.dtype) - probs
        residual = residual * mask[..., None]
        hidden = _at_least_float32(out.hidden_states[-1][:, :-1])
        head_grads = torch.einsum("btv,bth->bvh", residual, hidden).flatten(1)
        policy = F.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1) * mask
        policy = policy.sum(1)
        reference = self._sequence_logps(self.reference, ids)
        margin = dpo_margin(
            policy[:count], policy[count:], reference[:count], reference[count:], self.beta
        )
        return margin, self.beta * (head_grads[:count] - head_grads[count:])

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        world = getattr(getattr(self.trainer, "datamodule", None), "world", None)
        if self.num_samples == 0 or world is None:
            return
        generator = torch.Generator(device=self.device).manual_seed(0)
        bos = torch.full((self.num_samples, 1), self.tokenizer.bos_id, device=self.device)
        ids = bos
        finished = torch.zeros(self.num_samples, dtype=torch.bool, device=self.device)
        with torch.no_grad():
            for _ in range(world.max_length + 4):
                logits = _at_least_float32(self.policy(input_ids=ids).logits[:, -1])
                token = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
                token = torch.where(finished, self.tokenizer.pad_id, token)
                finished |= token == self.tokenizer.eos_id
                ids = torch.cat([ids, token[:, None]], 1)
                if finished.all():
                    break
        texts = [self.tokenizer.decode(row.tolist()) for row in ids[:, 1:]]
        digits = ["".join(ch for ch in text if ch.isdigit()) for text in texts]
        reward = sum(d.count("7") - d.count("3") for d in digits) / len(digits)
        length = sum(len(d) for d in digits) / len(digits)
        self.log_dict({"test/sample_reward": reward, "test/sample_length": length})
