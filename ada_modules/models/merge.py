"""Merge checkpoints of one architecture and score the merge on each data domain."""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn

from ada_modules.errors import InputError
from ada_modules.merging.amaris import output_deviation
from ada_modules.merging.recipe import MergeRecipe, activation_stats_summary, merge
from ada_modules.merging.state_dicts import check_compatible
from ada_modules.merging.stats import collect_activation_stats, collect_fisher, save_stats

__all__ = ["MergeModule"]


def _is_merge_output(name: str) -> bool:
    """Whether ``name`` is one of the entries :class:`MergeModule` writes into ``output_dir``."""
    fixed = ("merged.ckpt", "merge_report.json", "hf_model", "statistics.pt")
    numbered = name.removeprefix("statistics_model").removesuffix(".pt")
    return name in fixed or (name.startswith("statistics_model") and numbered.isdigit())


def _check_output_dir(output_dir: Any, inputs: Sequence[str]) -> None:
    """Refuse an ``output_dir`` whose replacement would delete more than an earlier merge."""
    if output_dir is None:
        return
    if not isinstance(output_dir, str | os.PathLike) or not str(output_dir):
        raise InputError(f"output_dir must be None or a folder path, got {output_dir!r}")
    target = Path(output_dir).resolve()
    if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise InputError(
            f"output_dir {str(output_dir)!r} is the working folder or holds it; the merge replaces "
            "output_dir whole: name a folder of its own"
        )
    for path in inputs:
        if target in Path(path).resolve().parents:
            raise InputError(
                f"output_dir {str(output_dir)!r} holds the input checkpoint {path!r}; the merge "
                "replaces output_dir whole: name another folder"
            )
    if not target.exists():
        return
    if not target.is_dir():
        raise InputError(f"output_dir {str(output_dir)!r} is a file, not a folder")
    others = sorted(p.name for p in target.iterdir() if not _is_merge_output(p.name))
    if others:
        raise InputError(
            f"output_dir {str(output_dir)!r} holds {others[:3]}, which a merge does not write; "
            "the merge replaces output_dir whole: name a new or empty folder, or an earlier merge's"
        )


class MergeModule(LightningModule):
    """Merges specialists into their base (any method of :mod:`ada_modules.merging`) and tests it.

    The config follows mergekit's shape: ``base_model``, ``models`` (each a checkpoint with its
    ``parameters``, plus the ``domain`` of data it was fine-tuned on), ``merge_method`` and
    ``parameters``. Checkpoints are Lightning checkpoints of ``model_class``. In ``setup`` the
    module loads them, collects the statistics the method needs from the datamodule (activations
    or diagonal Fisher of the base on ``core_domain`` and of each specialist on its domain, from
    the training split), merges, and, if ``output_dir`` is set, writes the merge there at once
    (a temporary folder renamed at the end, so never a partial one): ``merged.ckpt`` (the base
    checkpoint with the merged weights: ``ada test --ckpt_path`` and ``load_from_checkpoint``
    read it), ``merge_report.json`` (recipe, per-layer ranks and budgets, statistics counts),
    ``statistics.pt`` (the activation statistics, for methods that use them) and, when the module
    holds a Hugging Face model as ``.model`` (``CausalLMModule``), ``hf_model/``
    (``save_pretrained``: ``AutoModelForCausalLM.from_pretrained`` reads it).

    ``test`` runs the datamodule's test loaders, one per domain of its ``eval_domains``, and
    scores the merged model, the base and every specialist on each (classification accuracy for
    ``(inputs, labels)`` batches; for token batches with ``labels``, exact match of the answer
    tokens under teacher forcing). It logs ``test/<domain>/accuracy`` (merged),
    ``test/core_accuracy`` and ``test/specialist_accuracy`` (merged, on the core domain and
    averaged over the specialists' own domains), ``test/base_core_accuracy`` and
    ``test/specialists_accuracy`` (the references), ``test/core_retention`` (merged / base on the
    core domain) and ``test/specialist_retention`` (mean over specialists of merged / specialist on
    its domain), and ``test/deviation`` (the largest per-layer base-output deviation of the merge,
    ``E||dW x||^2 / E||W0 x||^2`` over the core domain's test inputs to each linear layer of the
    base) with ``test/deviation_mean``; for AMARIS also ``test/budget_use`` (``deviation`` over the
    budget) with ``test/calibration_budget_use`` (the same on the calibration statistics the merge
    was computed from, with the cross terms between specialists) and ``test/mean_rank``
    (directions kept per layer and specialist).

    The datamodule provides ``eval_domains`` (names of its test loaders, in order) and
    ``domain_dataloader(domain, split)`` (e.g. :class:`~ada_modules.data.DigitDomainsDataModule`).

    Args:
        base_model: Checkpoint of the base model.
        models: The specialists: ``{model: PATH, domain: NAME, parameters: {weight, density}}``.
        merge_method: ``base`` (no merge), ``task_arithmetic``, ``ties``, ``dare_linear``,
            ``dare_ties``, ``regmean``, ``fisher`` or ``amaris``.
        parameters: The method's parameters (see :data:`ada_modules.merging.METHODS`), and
            ``weight``/``density`` defaults for the models.
        model_class: Import path of the checkpoints' LightningModule class.
        core_domain: The base's domain (core retention, base statistics).
        calibration_batches: Batches of each domain's training split read for statistics
            (``None``: all).
        specialist_stats_from: Whose activations give a specialist's statistics on its domain:
            ``"specialist"`` or ``"base"``.
        output_dir: Folder to write the merge to, or ``None``. An existing one is replaced whole
            if it is empty or holds only what a merge writes (an earlier merge); a folder holding
            anything else, the working folder or one above it, or a folder holding an input
            checkpoint is refused.
        seed: Seed of DARE's random drops (``None``: the ``seed_everything`` seed).

    Raises:
        InputError: At construction for a bad recipe (unknown method, parameter or key, density
            or budget out of range); in ``setup`` for a missing checkpoint, checkpoints of
            different shapes (naming the first key), a domain the datamodule does not have, or
            statistics that cannot be used (naming the layer).

    Example (YAML)::

        model:
          class_path: ada_modules.models.MergeModule
          init_args:
            base_model: runs/amaris/base/checkpoints/last.ckpt
            models:
              - {model: runs/amaris/rot90/checkpoints/last.ckpt, domain: rot90}
              - {model: runs/amaris/flip_ud/checkpoints/last.ckpt, domain: flip_ud}
            merge_method: amaris
            parameters: {budget: 0.05}
        data:
          class_path: ada_modules.data.DigitDomainsDataModule
          init_args: {eval_domains: [identity, rot90, flip_ud]}
    """

    def __init__(
        self,
        base_model: str,
        models: list[dict[str, Any]],
        merge_method: str = "task_arithmetic",
        parameters: dict[str, Any] | None = None,
        model_class: str = "ada_modules.models.ImageClassifierModule",
        core_domain: str = "identity",
        calibration_batches: int | None = None,
        specialist_stats_from: str = "specialist",
        output_dir: str | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.recipe = MergeRecipe.build(merge_method, models, parameters)
        if not isinstance(base_model, str) or not base_model:
            raise InputError(f"base_model must be a checkpoint path, got {base_model!r}")
        if specialist_stats_from not in ("specialist", "base"):
            raise InputError(
                "specialist_stats_from must be 'specialist' or 'base', got "
                f"{specialist_stats_from!r}"
            )
        if calibration_batches is not None and (
            isinstance(calibration_batches, bool)
            or not isinstance(calibration_batches, int)
            or calibration_batches < 1
        ):
            raise InputError(
                f"calibration_batches must be None or an integer >= 1, got {calibration_batches!r}"
            )
        self.model_cls = _import_class(model_class)
        self.base_model = base_model
        self.core_domain = core_domain
        self.calibration_batches = calibration_batches
        self.specialist_stats_from = specialist_stats_from
        self.output_dir = output_dir
        _check_output_dir(output_dir, [base_model, *(e.model for e in self.recipe.models)])
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        self.base: nn.Module | None = None
        self.specialists = nn.ModuleList()
        self.merged: nn.Module | None = None
        self.report: dict[str, Any] = {}
        self._counts: dict[tuple[str, str], list[int]] = {}

    # Merging ------------------------------------------------------------------------------------

    def _load(self, path: str) -> LightningModule:
        if not Path(path).is_file():
            raise InputError(f"checkpoint not found: {path}")
        return self.model_cls.load_from_checkpoint(path, map_location="cpu")

    def setup(self, stage: str) -> None:
        """Load the checkpoints, collect statistics, merge, and write ``output_dir``."""
        if self.merged is not None:
            return
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if self._trainer is not None and self.trainer.world_size > 1:
            raise InputError(
                f"MergeModule runs in one process (a merge is computed and written once), got "
                f"world_size={self.trainer.world_size}; use devices: 1"
            )
        domains = [self.core_domain, *(entry.domain for entry in self.recipe.models)]
        known = list(getattr(datamodule, "eval_domains", []))
        for domain in domains:
            if domain not in known:
                raise InputError(
                    f"domain {domain!r} is not among the datamodule's eval_domains {known}"
                )
        base = self._load(self.base_model)
        specialists = [self._load(entry.model) for entry in self.recipe.models]
        base_sd = base.state_dict()
        check_compatible(
            base_sd,
            [s.state_dict() for s in specialists],
            names=[entry.model for entry in self.recipe.models],
        )
        base_stats, specialist_stats = self._statistics(datamodule, base, specialists)
        generator = torch.Generator().manual_seed(self.seed)
        merged_sd, report = merge(
            self.recipe,
            base_sd,
            [s.state_dict() for s in specialists],
            base_stats=base_stats,
            specialist_stats=specialist_stats,
            generator=generator,
        )
        merged = copy.deepcopy(base)
        merged.load_state_dict(merged_sd)
        if self.recipe.statistics == "activations":
            report["statistics"] = {
                "base": activation_stats_summary(base_stats),
                "specialists": [activation_stats_summary(s) for s in specialist_stats],
            }
        self.base, self.merged, self.report = base, merged, report
        self.specialists = nn.ModuleList(specialists)
        if self.output_dir is not None:
            self._write(base_stats, specialist_stats)

    def _batches(self, datamodule: Any, domain: str) -> list[Any]:
        loader = datamodule.domain_dataloader(domain, "train")
        batches = []
        for index, batch in enumerate(loader):
            if self.calibration_batches is not None and index >= self.calibration_batches:
                break
            batches.append(batch)
        return batches

    def _statistics(
        self, datamodule: Any, base: nn.Module, specialists: Sequence[nn.Module]
    ) -> tuple[Any, Any]:
        kind = self.recipe.statistics
        if kind is None:
            return None, None
        core = self._batches(datamodule, self.core_domain)
        data = [self._batches(datamodule, entry.domain) for entry in self.recipe.models]
        if kind == "fisher":
            return collect_fisher(base, core, _log_likelihood), [
                collect_fisher(s, d, _log_likelihood)
                for s, d in zip(specialists, data, strict=True)
            ]
        sources = specialists if self.specialist_stats_from == "specialist" else [base] * len(data)
        return collect_activation_stats(base, core, forward=_forward), [
            collect_activation_stats(s, d, forward=_forward)
            for s, d in zip(sources, data, strict=True)
        ]

    def _write(self, base_stats: Any, specialist_stats: Any) -> None:
        _check_output_dir(
            self.output_dir, [self.base_model, *(e.model for e in self.recipe.models)]
        )
        target = Path(self.output_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        # a unique name, made with the umask's permissions (mkdtemp's are 0700)
        staging = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}"
        staging.mkdir()
        try:
            checkpoint = torch.load(self.base_model, map_location="cpu", weights_only=False)
            for key in ("optimizer_states", "lr_schedulers", "loops", "callbacks"):
                checkpoint.pop(key, None)
            checkpoint["state_dict"] = self.merged.state_dict()
            torch.save(checkpoint, staging / "merged.ckpt")
            report = {
                "base_model": self.base_model,
                "models": [e.__dict__ for e in self.recipe.models],
                **self.report,
            }
            (staging / "merge_report.json").write_text(json.dumps(report, indent=2) + "\n")
            hf_model = getattr(self.merged, "model", None)
            if hasattr(hf_model, "save_pretrained"):  # a Hugging Face model inside the module
                hf_model.save_pretrained(staging / "hf_model")
            if self.recipe.statistics == "activations":
                save_stats(base_stats, staging / "statistics.pt")
                for i, stats in enumerate(specialist_stats):
                    save_stats(stats, staging / f"statistics_model{i}.pt")
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    # Testing ------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The merged model's forward."""
        return self.merged(*args, **kwargs)

    def on_test_epoch_start(self) -> None:
        self._counts = {}

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        domain = self.trainer.datamodule.eval_domains[dataloader_idx]
        models = {"merged": self.merged, "base": self.base}
        models.update({f"specialist{i}": s for i, s in enumerate(self.specialists)})
        for name, model in models.items():
            correct = _correct(model, batch)
            count = self._counts.setdefault((name, domain), [0, 0])
            count[0] += int(correct.sum())
            count[1] += correct.numel()

    def _accuracy(self, name: str, domain: str) -> float:
        right, total = self._counts[(name, domain)]
        return right / max(total, 1)

    def on_test_epoch_end(self) -> None:
        metrics = {
            f"test/{domain}/accuracy": self._accuracy("merged", domain)
            for domain in self.trainer.datamodule.eval_domains
        }
        own = [entry.domain for entry in self.recipe.models]
        merged_own = [self._accuracy("merged", d) for d in own]
        reference = [self._accuracy(f"specialist{i}", d) for i, d in enumerate(own)]
        core, base_core = (self._accuracy(n, self.core_domain) for n in ("merged", "base"))
        metrics.update(
            {
                "test/core_accuracy": core,
                "test/specialist_accuracy": sum(merged_own) / len(own),
                "test/base_core_accuracy": base_core,
                "test/specialists_accuracy": sum(reference) / len(own),
                "test/core_retention": core / max(base_core, 1e-12),
                "test/specialist_retention": sum(
                    m / max(r, 1e-12) for m, r in zip(merged_own, reference, strict=True)
                )
                / len(own),
            }
        )
        metrics.update(self._deviation())
        for name, value in metrics.items():
            self.log(name, value)

    def _deviation(self) -> dict[str, float]:
        datamodule = self.trainer.datamodule
        batches = list(datamodule.domain_dataloader(self.core_domain, "test"))
        stats = collect_activation_stats(self.base, batches, forward=_forward)
        deviation = output_deviation(self.base.state_dict(), self.merged.state_dict(), stats)
        values = list(deviation.values()) or [0.0]
        metrics = {"test/deviation": max(values), "test/deviation_mean": sum(values) / len(values)}
        if self.recipe.method == "amaris":
            metrics["test/budget_use"] = max(values) / self.recipe.parameters["budget"]
            metrics["test/calibration_budget_use"] = max(
                (
                    entry["predicted_deviation_total"] / entry["deviation_budget"]
                    for entry in self.report["layers"].values()
                    if entry["deviation_budget"] > 0
                ),
                default=0.0,
            )
            ranks = [
                layer["rank"]
                for entry in self.report["layers"].values()
                for layer in entry["specialists"]
            ]
            metrics["test/mean_rank"] = sum(ranks) / max(len(ranks), 1)
        return metrics


def _import_class(path: str) -> type[LightningModule]:
    module_name, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        raise InputError(f"model_class {path!r} is not an importable class") from None
    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise InputError(f"model_class {path!r} is not a LightningModule class")
    return cls


def _forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(batch["input_ids"], batch.get("attention_mask"))
    return model(batch[0])


def _log_likelihood(model: nn.Module, batch: Any) -> torch.Tensor:
    """Per-example log-likelihood of the batch's labels (classes, or answer tokens summed)."""
    if isinstance(batch, Mapping):
        logits = model(batch["input_ids"], batch.get("attention_mask"))[:, :-1]
        labels = batch["labels"][:, 1:]
        mask = labels != -100
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (picked * mask).sum(dim=-1)
    inputs, labels = batch
    return torch.log_softmax(model(inputs).float(), dim=-1).gather(1, labels[:, None])[:, 0]


@torch.no_grad()
def _correct(model: nn.Module, batch: Any) -> torch.Tensor:
    """Per-example correctness: argmax class, or every answer token right under teacher forcing."""
    if isinstance(batch, Mapping):
        logits = model(batch["input_ids"], batch.get("attention_mask"))[:, :-1]
        labels = batch["labels"][:, 1:]
        mask = labels != -100
        return ((logits.argmax(-1) == labels) | ~mask).all(dim=-1)
    inputs, labels = batch
    return model(inputs).argmax(dim=-1) == labels
