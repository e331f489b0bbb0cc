"""ABC-Align's estimator study: RMSE and interval coverage of every estimator over a judge grid.

:class:`EstimatorStudyModule` runs under ``ada test`` (it trains nothing and needs no datamodule:
its test loader yields the grid's cells). The estimand is a *win rate*,
``θ = P(a human prefers the first response)``, where the first responses are
``first_extra_length`` digits longer than the second on average (a verbose policy against a terse
one), so a judge that likes long answers over-states the verbose policy's win rate. For each cell
(judge accuracy × judge length bias × number of human labels ``n``), ``trials`` independent draws
of ``n`` labelled and ``num_unlabelled`` unlabelled pairs from a
:class:`~ada_modules.data.preference_world.PreferenceWorld` are estimated by every estimator of
:mod:`ada_modules.posttrain.abc`, with ``θ`` computed from ``truth_pairs`` pairs.

Logged at the end of the test epoch:

- ``test/rmse_ratio_abc_ppi_max``, ``_mean``: RMSE(ABC)/RMSE(PPI++) over the cells (max, mean),
- ``test/rmse_ratio_abc_human_max``: the same against human-only,
- ``test/rmse_ratio_abc_ppi_small_bias``: the mean ratio over the cells where the pseudo-only
  estimate's bias is at most human-only's standard error (where ABC should gain),
- ``test/coverage_<method>_min``, ``_max``: 95 % interval coverage over the cells,
- ``test/coverage_pseudo_biased``: pseudo-only's mean coverage where its bias exceeds twice its
  standard error (a negative control: it collapses),
- ``test/lambda_anti``: PPI++'s mean λ̂ in the cells whose judge accuracy is below 0.5,
- ``test/truth``: ``θ``.

With ``output_dir``, ``grid.json`` there holds every cell's RMSE, coverage, bias, λ̂ and ŵ
(written atomically).

Examples:
    >>> from lightning.pytorch import Trainer
    >>> study = EstimatorStudyModule(judge_accuracies=[0.8], length_biases=[0.0, 1.0],
    ...                              num_labelled=[50], num_unlabelled=500, trials=20,
    ...                              truth_pairs=20_000)
    >>> trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
    ...                   enable_model_summary=False)
    >>> metrics = trainer.test(study, verbose=False)[0]
    >>> metrics["test/coverage_human_min"] > 0.7
    True
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from ada_modules.data.preference_world import PreferenceWorld
from ada_modules.errors import InputError
from ada_modules.posttrain.abc import ESTIMATORS, estimate_mean

__all__ = ["EstimatorStudyModule"]


class EstimatorStudyModule(LightningModule):
    """Every estimator of :mod:`ada_modules.posttrain.abc` over a grid of judges (``ada test``).

    Args:
        judge_accuracies: Judge accuracies of the grid (``[0, 1]``; below 0.5: anti-correlated).
        length_biases: Judge length biases of the grid.
        num_labelled: Numbers of human labels ``n`` of the grid.
        num_unlabelled: Judge-labelled pairs ``N``.
        trials: Independent draws per cell.
        first_extra_length: How much longer the first responses are.
        truth_pairs: Pairs that fix the true win rate.
        min_length: Shortest response of the world.
        max_length: Longest response of the world.
        seed: Seed of every draw; ``None`` takes the seed of ``seed_everything``
            (``PL_GLOBAL_SEED``; 0 when unset).
        output_dir: Where ``grid.json`` goes (``None``: not written).
    """

    def __init__(
        self,
        judge_accuracies: list[float] = (0.3, 0.6, 0.8, 0.9),
        length_biases: list[float] = (0.0, 0.1, 0.25, 0.5, 1.0),
        num_labelled: list[int] = (50, 100, 400),
        num_unlabelled: int = 5000,
        trials: int = 1000,
        first_extra_length: int = 2,
        truth_pairs: int = 1_000_000,
        min_length: int = 2,
        max_length: int = 10,
        seed: int | None = None,
        output_dir: str | None = None,
    ) -> None:
        super().__init__()
        for accuracy in judge_accuracies:
            if not 0.0 <= accuracy <= 1.0:
                raise InputError(f"judge_accuracies must lie in [0, 1], got {accuracy}")
        for n in num_labelled:
            if n < 2:
                raise InputError(f"num_labelled must be at least 2 each, got {n}")
        if num_unlabelled < 2:
            raise InputError(f"num_unlabelled must be at least 2, got {num_unlabelled}")
        if trials < 2:
            raise InputError(f"trials must be at least 2, got {trials}")
        self.cells = list(itertools.product(judge_accuracies, length_biases, num_labelled))
        self.num_unlabelled, self.trials = num_unlabelled, trials
        self.first_extra_length, self.truth_pairs = first_extra_length, truth_pairs
        self.lengths = (min_length, max_length)
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        self.output_dir = output_dir
        self.results: list[dict[str, Any]] = []
        self.truth = math.nan

    def test_dataloader(self) -> DataLoader:
        return DataLoader(range(len(self.cells)), batch_size=None)

    def on_test_epoch_start(self) -> None:
        self.results = []
        world = PreferenceWorld(1.0, 0.0, 1.0, *self.lengths)
        generator = torch.Generator().manual_seed(self.seed)
        total, count = 0.0, 0
        while count < self.truth_pairs:
            size = min(200_000, self.truth_pairs - count)
            total += float(world.sample(size, generator, self.first_extra_length).truth.sum())
            count += size
        self.truth = total / count

    def test_step(self, index: int, batch_idx: int) -> None:
        accuracy, bias, n = self.cells[int(index)]
        world = PreferenceWorld(accuracy, bias, 1.0, *self.lengths)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + int(index) + 1)
        values = {method: [] for method in ESTIMATORS}
        covered = {method: 0 for method in ESTIMATORS}
        lambdas, weights = [], []
        for _ in range(self.trials):
            pairs = world.sample(n + self.num_unlabelled, generator, self.first_extra_length)
            human, judge = pairs.human[:n], pairs.judge[:n]
            for method in ESTIMATORS:
                estimate = estimate_mean(human, judge, pairs.judge[n:], method)
                values[method].append(float(estimate.value))
                low, high = estimate.interval()
                covered[method] += int(float(low) <= self.truth <= float(high))
                if method == "ppi++":
                    lambdas.append(estimate.weights.lam)
                if method == "abc":
                    weights.append(estimate.weights.weight)
        cell: dict[str, Any] = {"judge_accuracy": accuracy, "length_bias": bias, "n": n}
        for method in ESTIMATORS:
            errors = torch.tensor(values[method], dtype=torch.float64) - self.truth
            cell[f"rmse_{method}"] = float(errors.pow(2).mean().sqrt())
            cell[f"bias_{method}"] = float(errors.mean())
            cell[f"sd_{method}"] = float(errors.std())
            cell[f"coverage_{method}"] = covered[method] / self.trials
        cell["lambda"] = sum(lambdas) / len(lambdas)
        cell["abc_weight"] = sum(weights) / len(weights)
        self.results.append(cell)

    def on_test_epoch_end(self) -> None:
        cells = self.results
        ratio_ppi = [c["rmse_abc"] / c["rmse_ppi++"] for c in cells]
        small = [
            c["rmse_abc"] / c["rmse_ppi++"] for c in cells if abs(c["bias_pseudo"]) <= c["sd_human"]
        ]
        biased = [c["coverage_pseudo"] for c in cells if abs(c["bias_pseudo"]) > 2 * c["sd_pseudo"]]
        anti = [c["lambda"] for c in cells if c["judge_accuracy"] < 0.5]
        metrics = {
            "test/truth": self.truth,
            "test/rmse_ratio_abc_ppi_max": max(ratio_ppi),
            "test/rmse_ratio_abc_ppi_mean": sum(ratio_ppi) / len(ratio_ppi),
            "test/rmse_ratio_abc_human_max": max(c["rmse_abc"] / c["rmse_human"] for c in cells),
            "test/rmse_ratio_abc_ppi_small_bias": sum(small) / len(small) if small else math.nan,
            "test/coverage_pseudo_biased": sum(biased) / len(biased) if biased else math.nan,
            "test/lambda_anti": sum(anti) / len(anti) if anti else math.nan,
        }
        for method in ESTIMATORS:
            coverage = [c[f"coverage_{method}"] for c in cells]
            metrics[f"test/coverage_{method.replace('+', 'p')}_min"] = min(coverage)
            metrics[f"test/coverage_{method.replace('+', 'p')}_max"] = max(coverage)
        self.log_dict(metrics)
        if self.output_dir is not None:
            out = Path(self.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            tmp = out / "grid.json.tmp"
            tmp.write_text(json.dumps({"truth": self.truth, "cells": cells}, indent=2))
            tmp.replace(out / "grid.json")
