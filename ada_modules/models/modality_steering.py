"""Steers a trained two-modality model's modality preference, with a uniform or per-instance
(AMPS) strength, and measures preference shift, consistent-pair accuracy and generation collapse."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor
from torch.nn import functional as F
from torchmetrics.classification import BinaryAUROC

from ada_modules.data.modality_conflict import (
    ITEM_KINDS,
    ModalityConflictDataModule,
    ModalityConflictItems,
    with_instruction,
)
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError
from ada_modules.models.image_text_qa import (
    ImageTextQAModule,
    answer_state,
    image_contribution_ratio,
    option_logits,
)
from ada_modules.nn.image_prefix_lm import ImagePrefixLM
from ada_modules.steering import (
    SteeringVector,
    StrengthPredictor,
    compression_ratio,
    mcr_scaled_strength,
    repeated_ngram_fraction,
    steer,
)

__all__ = ["ModalitySteeringModule", "instruction_steering_vector"]

_CONFLICT = ITEM_KINDS.index("conflict")
_CONSISTENT = ITEM_KINDS.index("consistent")


@torch.no_grad()
def instruction_steering_vector(
    model: ImagePrefixLM, items: ModalityConflictItems, layer: int, contrast_items: int = 512
) -> SteeringVector:
    """MC²'s steering vector towards the image: the mean difference of ``layer``'s output at the
    prompt's last position between the first ``contrast_items`` training conflicts (and
    instructed items) asked with "follow the image" and the same asked with "follow the text".
    Negate it to steer towards the text."""
    kinds = items.kind
    rows = torch.nonzero((kinds == _CONFLICT) | (kinds == ITEM_KINDS.index("instructed")))
    rows = rows[:contrast_items, 0]
    if len(rows) == 0:
        raise InputError("the training split holds no conflicts to compute a steering vector")
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in items[rows].items()}
    follow_image = answer_state(model, with_instruction(batch, "i"), layer)
    follow_text = answer_state(model, with_instruction(batch, "t"), layer)
    return SteeringVector.from_activations({layer: follow_image}, {layer: follow_text})


class ModalitySteeringModule(LightningModule):
    """Steer a trained :class:`~ada_modules.models.ImageTextQAModule` towards one modality.

    ``configure_model`` loads the frozen model from ``base_checkpoint``, and ``setup`` computes
    the steering vector from the datamodule's training split as MC² does: the mean difference of
    the hidden state at the prompt's last position, ``layer``'s output, between training
    conflicts instructed to follow the image and the same items instructed to follow the text
    (negated to steer towards the text). It is then added, times a strength, to that layer's
    output while the model answers un-instructed questions.

    A checkpoint of the module holds the base model, the steering vector and the learned
    predictor: ``Trainer.test(..., ckpt_path=...)`` or ``load_from_checkpoint`` (which then tests
    on plain dataloaders, no datamodule needed) restore them; both read ``base_checkpoint`` to
    build the base model first.

    ``strength`` picks the strength per question:

    - ``none``: no steering (the baseline row);
    - ``uniform``: ``alpha`` for every question (conventional steering);
    - ``mcr``: AMPS's scaling rule ``alpha * relu(threshold - MCR) / threshold``, where MCR is the
      target modality's Modality Contribution Ratio by ablation (three forward passes);
    - ``learned``: AMPS's learnable module, a :class:`~ada_modules.steering.StrengthPredictor`
      on the steered layer's hidden state and the MCR, bounded by ``alpha``. ``fit`` trains it on
      the training split: cross-entropy of the target modality's option on conflicts (preference)
      plus ``collapse_weight`` times the KL divergence from the unsteered to the steered answer
      distribution on consistent questions (collapse regulariser) plus ``strength_weight`` times
      the mean strength. The other modes have nothing to train: run ``test`` only.

    Validation and test answer conflicts and consistent pairs by greedy generation (up to
    ``max_new_tokens``) with and without steering, and log: ``target_rate`` (share of conflicts
    answered with the target modality's digit), ``base_target_rate``, ``preference_shift`` (their
    difference), ``image_rate``, ``text_rate``, ``consistent_accuracy``, ``accuracy_drop``
    (unsteered minus steered consistent accuracy), collapse measures ``unparseable`` (answers
    that are not an option's letter and digit), ``repetition`` (repeated character 2-grams of the
    generations, read past ``<eos>``) and ``compression`` (zlib ratio of the batch's generations
    joined, lower is more degenerate); strengths ``mean_strength``, ``strength_dominant``
    (conflicts the unsteered model already answers with the target modality) and
    ``strength_needed`` (the others); and ``mcr_auroc``, how well the target MCR ranks the
    conflicts the unsteered model already answers with the target modality.

    Args:
        base_checkpoint: Checkpoint of a trained :class:`~ada_modules.models.ImageTextQAModule`.
        direction: The modality to steer towards, ``image`` or ``text``.
        strength: ``none``, ``uniform``, ``mcr`` or ``learned``.
        alpha: The uniform strength, or the largest strength of ``mcr`` and ``learned``, >= 0
            (in units of the steering vector, the instruction's effect).
        threshold: ``mcr``: target MCR at and above which a question is not steered, in (0, 1].
        layer: Decoder layer whose output is steered.
        token_scope: ``last`` (default: the prompt's end, then each generated token, as MC²
            steers while decoding) or ``all`` positions.
        contrast_items: Training conflicts used for the steering vector.
        collapse_weight: ``learned``: weight of the collapse regulariser, >= 0.
        strength_weight: ``learned``: weight of the mean-strength penalty, >= 0.
        max_new_tokens: Tokens generated per answer (an answer needs 3).
        optimizer: Optimizer factory of the strength predictor.

    Example:
        In YAML, after ``ada fit -c cli_configs/amps/base.yaml``::

            model:
              class_path: ada_modules.models.ModalitySteeringModule
              init_args: {base_checkpoint: runs/amps/base/checkpoints/last.ckpt,
                          direction: image, strength: mcr, alpha: 8.0}
    """

    def __init__(
        self,
        base_checkpoint: str,
        direction: Literal["image", "text"] = "image",
        strength: Literal["none", "uniform", "mcr", "learned"] = "uniform",
        alpha: float = 1.0,
        threshold: float = 0.5,
        layer: int = 0,
        token_scope: Literal["all", "last"] = "last",
        contrast_items: int = 512,
        collapse_weight: float = 1.0,
        strength_weight: float = 0.01,
        max_new_tokens: int = 6,
        optimizer: OptimizerCallable = torch.optim.Adam,
    ) -> None:
        super().__init__()
        choices = {
            "direction": (direction, ("image", "text")),
            "strength": (strength, ("none", "uniform", "mcr", "learned")),
            "token_scope": (token_scope, ("all", "last")),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise InputError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        for name, value in (
            ("alpha", alpha),
            ("collapse_weight", collapse_weight),
            ("strength_weight", strength_weight),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise InputError(f"{name} must be a number >= 0, got {value!r}")
        if not 0 < threshold <= 1:
            raise InputError(f"threshold must be in (0, 1], got {threshold!r}")
        if strength == "learned" and not alpha > 0:
            raise InputError(f"alpha must be > 0 for strength='learned', got {alpha!r}")
        for name, value, low in (
            ("layer", layer, 0),
            ("contrast_items", contrast_items, 1),
            ("max_new_tokens", max_new_tokens, 3),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an int >= {low}, got {value!r}")
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer = optimizer
        self.base: ImageTextQAModule | None = None
        self.predictor: StrengthPredictor | None = None
        self.register_buffer("direction_vector", torch.zeros(0))
        self.auroc = BinaryAUROC()
        self._tokenizer = CharTokenizer()

    # -- setup ----------------------------------------------------------------------------------

    def configure_model(self) -> None:
        """Load the frozen base model from ``base_checkpoint`` and create the strength predictor
        (once). ``setup`` calls it, and so does ``load_from_checkpoint`` before loading weights."""
        if self.base is not None:
            return
        if not Path(self.hparams.base_checkpoint).is_file():
            raise InputError(
                f"base_checkpoint {self.hparams.base_checkpoint!r} is not a file; train the model "
                "first: ada fit -c cli_configs/amps/base.yaml"
            )
        base = ImageTextQAModule.load_from_checkpoint(
            self.hparams.base_checkpoint, map_location="cpu"
        )
        base.eval().requires_grad_(False)
        num_layers = len(base.model.lm.model.layers)
        if self.hparams.layer >= num_layers:
            raise InputError(
                f"layer {self.hparams.layer} is out of range: the base model has {num_layers} "
                f"decoder layers (0..{num_layers - 1})"
            )
        self.base = base.to(self.device)
        if self.hparams.strength == "learned":
            hidden = int(base.model.lm.config.hidden_size)
            self.predictor = StrengthPredictor(hidden, max_strength=float(self.hparams.alpha)).to(
                self.device
            )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take the saved steering vector's shape: loading restores the vector ``setup`` would
        compute, so a module from ``load_from_checkpoint`` needs no datamodule."""
        self.direction_vector = torch.empty_like(checkpoint["state_dict"]["direction_vector"])

    def setup(self, stage: str) -> None:
        """Load the base model and compute the steering vector from the datamodule's training
        split (unless a checkpoint restored it)."""
        if stage == "fit" and self.hparams.strength != "learned":
            raise InputError(
                f"strength={self.hparams.strength!r} has nothing to train; run `ada test` (only "
                "strength='learned' is fitted)"
            )
        if self.direction_vector.numel() > 0:
            return
        datamodule = self.trainer.datamodule
        if not isinstance(datamodule, ModalityConflictDataModule):
            raise InputError(
                "ModalitySteeringModule needs the ModalityConflictDataModule to compute its "
                f"steering vector from the training split, got datamodule={datamodule!r}: pass "
                "datamodule=..., or load a trained module with "
                "ModalitySteeringModule.load_from_checkpoint(path), which restores the vector"
            )
        self.configure_model()
        vector = instruction_steering_vector(
            self.base.model, datamodule.items("train"), self.hparams.layer,
            self.hparams.contrast_items,
        )  # fmt: skip
        direction = vector.directions[self.hparams.layer]
        self.direction_vector = direction if self.hparams.direction == "image" else -direction

    def _hidden_at_answer(self, batch: dict[str, Tensor]) -> Tensor:
        """The steered layer's output at the prompt's last position, ``(batch, hidden)``."""
        return answer_state(self.base.model, batch, self.hparams.layer)

    @property
    def steering_vector(self) -> SteeringVector:
        """The steering direction (after ``setup``)."""
        return SteeringVector({self.hparams.layer: self.direction_vector})

    # -- strength -------------------------------------------------------------------------------

    @torch.no_grad()
    def target_mcr(self, batch: dict[str, Tensor]) -> Tensor:
        """The target modality's Modality Contribution Ratio per question (by ablation)."""
        image_share = image_contribution_ratio(self.base.model, batch)
        return image_share if self.hparams.direction == "image" else 1 - image_share

    def strengths(self, batch: dict[str, Tensor], target_mcr: Tensor) -> Tensor:
        """The strength per question, ``(batch,)``."""
        mode, alpha = self.hparams.strength, float(self.hparams.alpha)
        if mode == "none":
            return torch.zeros_like(target_mcr)
        if mode == "uniform":
            return torch.full_like(target_mcr, alpha)
        if mode == "mcr":
            return mcr_scaled_strength(target_mcr, alpha, self.hparams.threshold)
        with torch.no_grad():
            hidden = self._hidden_at_answer(batch)
        return self.predictor(hidden, target_mcr)

    def _target_option(self, batch: dict[str, Tensor]) -> Tensor:
        digit = batch["image_class" if self.hparams.direction == "image" else "text_class"]
        return (batch["options"][:, 1] == digit).long()

    # -- training (strength="learned") ----------------------------------------------------------

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.predictor.parameters())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        conflict = batch["kind"] == _CONFLICT
        consistent = batch["kind"] == _CONSISTENT
        mcr = self.target_mcr(batch)
        alpha = self.strengths(batch, mcr)
        with torch.no_grad():
            _, plain = option_logits(self.base.model, batch)
        with steer(self.base.model.lm, self.steering_vector, alpha, self.hparams.token_scope):
            letters, steered = option_logits(self.base.model, batch)
        zero = letters.sum() * 0
        preference = (
            F.cross_entropy(letters[conflict], self._target_option(batch)[conflict])
            if conflict.any()
            else zero
        )
        collapse = (
            F.kl_div(
                torch.log_softmax(steered[consistent], -1),
                torch.log_softmax(plain[consistent], -1),
                log_target=True,
                reduction="batchmean",
            )
            if consistent.any()
            else zero
        )
        loss = (
            preference
            + self.hparams.collapse_weight * collapse
            + self.hparams.strength_weight * alpha.mean()
        )
        self.log_dict(
            {
                "train/loss": loss,
                "train/preference": preference,
                "train/collapse": collapse,
                "train/mean_strength": alpha.mean(),
            },
            prog_bar=True,
            batch_size=len(alpha),
        )
        return loss

    # -- evaluation -----------------------------------------------------------------------------

    def _answers(self, batch: dict[str, Tensor], alpha: Tensor | None) -> tuple[Tensor, list[str]]:
        """The digit answered per question (-1: not an option's letter and digit) and the raw
        generations."""
        args = (batch["patches"], batch["image_present"], batch["prompt_ids"])
        if alpha is None:
            tokens = self.base.model.generate(*args, max_new_tokens=self.hparams.max_new_tokens)
        else:
            with steer(self.base.model.lm, self.steering_vector, alpha, self.hparams.token_scope):
                tokens = self.base.model.generate(*args, max_new_tokens=self.hparams.max_new_tokens)
        texts = [self._tokenizer.decode(row) for row in tokens]
        raw = [self._tokenizer.decode(row, stop_at_eos=False) for row in tokens]
        digits = []
        for text, (first, second) in zip(texts, batch["options"].tolist(), strict=True):
            digits.append({f"A{first}": first, f"B{second}": second}.get(text, -1))
        return torch.tensor(digits, device=tokens.device), raw

    def _evaluate(self, batch: dict[str, Tensor], prefix: str) -> None:
        keep = (batch["kind"] == _CONFLICT) | (batch["kind"] == _CONSISTENT)
        if not keep.any():
            return
        batch = {key: value[keep] for key, value in batch.items()}
        mcr = self.target_mcr(batch)
        with torch.no_grad():
            alpha = self.strengths(batch, mcr)
        base_digit, _ = self._answers(batch, None)
        digit, raw = self._answers(batch, alpha)
        target_digit = batch["image_class" if self.hparams.direction == "image" else "text_class"]
        conflict = batch["kind"] == _CONFLICT
        consistent = ~conflict
        metrics: dict[str, tuple[Tensor, Tensor]] = {
            "unparseable": ((digit < 0).float(), torch.ones_like(conflict)),
            "mean_strength": (alpha, torch.ones_like(conflict)),
            "repetition": (
                torch.tensor([repeated_ngram_fraction(text) for text in raw]),
                torch.ones_like(conflict),
            ),
        }
        if conflict.any():
            follows = (digit == target_digit).float()
            base_follows = base_digit == target_digit
            metrics |= {
                "target_rate": (follows, conflict),
                "base_target_rate": (base_follows.float(), conflict),
                "preference_shift": (follows - base_follows.float(), conflict),
                "image_rate": ((digit == batch["image_class"]).float(), conflict),
                "text_rate": ((digit == batch["text_class"]).float(), conflict),
                "strength_dominant": (alpha, conflict & base_follows),
                "strength_needed": (alpha, conflict & ~base_follows),
            }
            if prefix == "test":
                self.auroc.update(mcr[conflict], base_follows[conflict].long())
        if consistent.any():
            correct = (digit == batch["image_class"]).float()
            base_correct = (base_digit == batch["image_class"]).float()
            metrics |= {
                "consistent_accuracy": (correct, consistent),
                "accuracy_drop": (base_correct - correct, consistent),
            }
        for name, (values, rows) in metrics.items():
            if rows.any():
                self.log(
                    f"{prefix}/{name}",
                    values.to(alpha.device)[rows].float().mean(),
                    batch_size=int(rows.sum()),
                )
        self.log(f"{prefix}/compression", compression_ratio("\n".join(raw)), batch_size=len(raw))

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def on_test_epoch_end(self) -> None:
        self.log("test/mcr_auroc", self.auroc.compute())
        self.auroc.reset()
