"""Preference learning from scarce human and abundant AI labels: a base module and a reward model.

:class:`PreferenceModule` trains any model that gives a pair a margin ``h`` (``> 0``: the first
response is preferred) with the Bradley–Terry loss, combining the labelled and unlabelled parts of
each batch by one of the estimators of :mod:`ada_modules.posttrain.abc` (``human``, ``pseudo``,
``concat``, ``ppi``, ``ppi++``, ``abc``). At the first training step (and, with
``refresh_every_n_steps``, every that many steps) it estimates PPI++'s λ̂ and ABC's ŵ from
per-example gradients of the output layer on the whole labelled set and a fixed subset of the
unlabelled set (``datamodule.statistics_batches``), and logs them (``train/lambda``,
``train/abc_weight``, ``train/bias2``, ``train/estimator_variance``); a clip of λ̂ or ŵ is logged
with its reason. The labelled examples are also trained on: once the model fits their human
labels their gradients vanish, and re-estimated values drift to λ̂ = 0 and ŵ = 1 (PPI++ becomes
human-only), which is why the default estimates once, before training has seen them. Validation and test report ``accuracy``: the share of held-out
pairs whose margin sign matches the true preference.

:class:`RewardModelModule` is the reward model: a Hugging Face decoder built from a config, a
scalar head on the last token, ``h = r(first) - r(second)``. The DPO policy is
:class:`~ada_modules.models.dpo.DPOModule`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn

from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError
from ada_modules.models.causal_lm import build_causal_lm
from ada_modules.posttrain.abc import (
    ESTIMATORS,
    SemiSupervisedWeights,
    combine_losses,
    margin_gradients,
    preference_loss,
    semi_supervised_weights,
)

__all__ = ["PreferenceModule", "RewardModelModule"]

log = logging.getLogger(__name__)


def pair_tokens(batch: dict[str, Tensor]) -> tuple[Tensor, int]:
    """``first`` and ``second`` stacked into one right-padded batch, and the number of pairs.

    Raises:
        InputError: If a pair's two responses are identical (its label carries no information).
    """
    first, second = batch["first"], batch["second"]
    width = max(first.shape[1], second.shape[1])
    first = nn.functional.pad(first, (0, width - first.shape[1]))
    second = nn.functional.pad(second, (0, width - second.shape[1]))
    same = (first == second).all(1)
    if same.any():
        index = int(same.nonzero()[0])
        raise InputError(
            f"pair {index} of the batch has identical first and second responses; a preference "
            "between a response and itself carries no information"
        )
    return torch.cat([first, second]), len(first)


class PreferenceModule(LightningModule):
    """Bradley–Terry training on labelled + unlabelled pairs with a semi-supervised estimator.

    Subclasses implement :meth:`margin` and :meth:`margin_and_head_gradients`. The training batch
    is ``{"labelled": {first, second, human, judge}, "unlabelled": {first, second, judge}}``, as
    :class:`~ada_modules.data.preference_world.PreferenceDataModule` serves it.

    Args:
        estimator: One of ``human``, ``pseudo``, ``concat``, ``ppi``, ``ppi++``, ``abc``.
        refresh_every_n_steps: Steps between two estimates of λ̂ and ŵ (``None``: only at the
            first step).
        statistics_unlabelled: Unlabelled pairs those estimates use (the whole labelled set is
            used).
        optimizer: Optimizer factory.
    """

    def __init__(
        self,
        estimator: Literal["human", "pseudo", "concat", "ppi", "ppi++", "abc"] = "abc",
        refresh_every_n_steps: int | None = None,
        statistics_unlabelled: int = 512,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        super().__init__()
        if estimator not in ESTIMATORS:
            raise InputError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
        if refresh_every_n_steps is not None and refresh_every_n_steps < 1:
            raise InputError(
                f"refresh_every_n_steps must be at least 1, got {refresh_every_n_steps}"
            )
        if statistics_unlabelled < 2:
            raise InputError(
                f"statistics_unlabelled must be at least 2, got {statistics_unlabelled}"
            )
        self.estimator = estimator
        self.refresh_every_n_steps = refresh_every_n_steps
        self.statistics_unlabelled = statistics_unlabelled
        self.optimizer = optimizer
        self.weights: SemiSupervisedWeights | None = None
        self._notes: tuple[str, ...] = ()

    def margin(self, batch: dict[str, Tensor]) -> Tensor:
        """``h`` per pair (``> 0``: the first response is preferred)."""
        raise NotImplementedError

    def margin_and_head_gradients(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``h`` per pair and its gradient with respect to the output layer, ``(m, d)``."""
        raise NotImplementedError

    @torch.no_grad()
    def refresh_weights(self) -> SemiSupervisedWeights:
        """Re-estimate the estimator's coefficients from the datamodule's statistics batches."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if not hasattr(datamodule, "statistics_batches"):
            raise InputError(
                f"{type(self).__name__} needs a datamodule with statistics_batches(max_unlabelled)"
                f" (e.g. PreferenceDataModule), got {type(datamodule).__name__}"
            )
        labelled, unlabelled = datamodule.statistics_batches(self.statistics_unlabelled)
        labelled = {k: v.to(self.device) for k, v in labelled.items()}
        unlabelled = {k: v.to(self.device) for k, v in unlabelled.items()}
        margin_l, grads_l = self.margin_and_head_gradients(labelled)
        margin_u, grads_u = self.margin_and_head_gradients(unlabelled)
        self.weights = semi_supervised_weights(
            margin_gradients(margin_l, labelled["human"], grads_l),
            margin_gradients(margin_l, labelled["judge"], grads_l),
            margin_gradients(margin_u, unlabelled["judge"], grads_u),
            self.estimator,
            num_unlabelled=datamodule.num_unlabelled,
        )
        if self.weights.notes and self.weights.notes != self._notes:
            log.info("step %d: %s", self.global_step, "; ".join(self.weights.notes))
        self._notes = self.weights.notes
        return self.weights

    def training_step(self, batch: dict[str, dict[str, Tensor]], batch_idx: int) -> Tensor:
        refresh = self.refresh_every_n_steps
        if self.weights is None or (refresh is not None and self.global_step % refresh == 0):
            self.refresh_weights()
        weights = self.weights
        labelled, unlabelled = batch["labelled"], batch["unlabelled"]
        zero = labelled["human"].new_zeros(1)
        loss_h = loss_p = loss_u = zero
        if weights.a_h != 0.0 or weights.a_p != 0.0:
            margin_l = self.margin(labelled)
            loss_h = preference_loss(margin_l, labelled["human"])
            loss_p = preference_loss(margin_l, labelled["judge"])
        if weights.a_u != 0.0:
            loss_u = preference_loss(self.margin(unlabelled), unlabelled["judge"])
        loss = combine_losses(loss_h, loss_p, loss_u, weights)
        metrics = {
            "train/loss": loss,
            "train/lambda": weights.lam,
            "train/abc_weight": weights.weight,
            "train/estimator_variance": weights.variance,
        }
        if not math.isnan(weights.bias2):
            metrics["train/bias2"] = weights.bias2
        self.log_dict(metrics, prog_bar=False, batch_size=len(unlabelled["judge"]))
        return loss

    def _accuracy(self, batch: dict[str, Tensor], stage: str) -> None:
        correct = ((self.margin(batch) > 0).float() == batch["truth"]).float().mean()
        self.log(f"{stage}/accuracy", correct, prog_bar=True, batch_size=len(batch["truth"]))

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._accuracy(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._accuracy(batch, "test")

    def on_test_epoch_end(self) -> None:
        if self.weights is not None:
            self.log_dict({"test/lambda": self.weights.lam, "test/abc_weight": self.weights.weight})

    def configure_optimizers(self) -> Any:
        return self.optimizer([p for p in self.parameters() if p.requires_grad])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the estimator's coefficients: a resumed run goes on with them instead of
        re-estimating them on a model that has since fitted the labelled pairs."""
        if self.weights is not None:
            checkpoint["abc_weights"] = dataclasses.asdict(self.weights)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("abc_weights")
        if saved is not None:
            self.weights = SemiSupervisedWeights(**{**saved, "notes": tuple(saved["notes"])})
            self._notes = self.weights.notes


class RewardModelModule(PreferenceModule):
    """A reward model: a Hugging Face decoder from a config and a scalar head on the last token.

    The statistics for λ̂ and ŵ are per-example gradients of the head's weight,
    ``∇h = φ(first) - φ(second)`` (``φ``: the last token's hidden state).

    Args:
        architecture: The decoder's architecture
            (:func:`~ada_modules.models.causal_lm.build_causal_lm` with the
            :class:`~ada_modules.data.tokenizer.CharTokenizer` vocabulary).
        hidden_size: The decoder's width.
        num_layers: Decoder layers.
        num_heads: Attention heads (as many key-value heads).
        intermediate_size: MLP width.
        estimator: See :class:`PreferenceModule`.
        refresh_every_n_steps: See :class:`PreferenceModule`.
        statistics_unlabelled: See :class:`PreferenceModule`.
        optimizer: Optimizer factory.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> from ada_modules.data.preference_world import PreferenceDataModule
        >>> dm = PreferenceDataModule(num_labelled=16, num_unlabelled=64, num_val=32,
        ...                           num_test=32, batch_size=32, labelled_batch_size=8)
        >>> model = RewardModelModule(estimator="ppi++", hidden_size=16, intermediate_size=32)
        >>> trainer = Trainer(max_steps=2, accelerator="cpu", logger=False,
        ...                   enable_checkpointing=False, enable_progress_bar=False,
        ...                   enable_model_summary=False)
        >>> trainer.fit(model, datamodule=dm)
        >>> 0.0 <= model.weights.lam <= 1.0
        True
    """

    def __init__(
        self,
        estimator: Literal["human", "pseudo", "concat", "ppi", "ppi++", "abc"] = "abc",
        architecture: Literal["llama", "qwen2"] = "llama",
        hidden_size: int = 32,
        num_layers: int = 1,
        num_heads: int = 2,
        intermediate_size: int = 64,
        refresh_every_n_steps: int | None = None,
        statistics_unlabelled: int = 512,
        optimizer: OptimizerCallable = torch.optim.AdamW,
    ) -> None:
        super().__init__(estimator, refresh_every_n_steps, statistics_unlabelled, optimizer)
        self.save_hyperparameters(ignore=["optimizer"])
        self.tokenizer = CharTokenizer()
        language_model = build_causal_lm(
            self.tokenizer,
            architecture,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=256,
        )
        self.backbone = language_model.get_decoder()
        self.head = nn.Linear(hidden_size, 1)

    def features(self, ids: Tensor) -> Tensor:
        """The last non-padding token's final hidden state per sequence."""
        mask = ids != self.tokenizer.pad_id
        hidden = self.backbone(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        return hidden[torch.arange(len(ids), device=ids.device), mask.sum(1) - 1]

    def reward(self, ids: Tensor) -> Tensor:
        """The scalar reward of each sequence."""
        return self.head(self.features(ids)).squeeze(-1)

    def margin(self, batch: dict[str, Tensor]) -> Tensor:
        ids, count = pair_tokens(batch)
        rewards = self.reward(ids)
        return rewards[:count] - rewards[count:]

    def margin_and_head_gradients(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        ids, count = pair_tokens(batch)
        features = self.features(ids)
        gradient = features[:count] - features[count:]
        return gradient @ self.head.weight[0], gradient
