"""Sparse prefill study: one policy's block plans against dense attention (issue 16, AdaCal).

:class:`SparsePrefillStudyModule` evaluates one *arm* (a sparse prefill policy of
:mod:`ada_modules.attention`) on layers of queries, keys and values with known structure
(:class:`~ada_modules.data.planted_attention.PlantedAttentionDataModule`), and calibrates
AdaCal's task dispatcher. It trains no network: ``fit`` is a calibration pass and ``test`` a
measurement, so the module has no parameters and no optimizer.

**Fit** (``arm="adacal"``): every training batch gives AdaCal's dispatch features
(:meth:`~ada_modules.attention.AdaCalPolicy.dispatch_features`, from the last-block probe) and
the instance's regime label; at the end of the epoch a logistic
:class:`~ada_modules.attention.TaskDispatcher` is fitted on them and written to
``dispatch_path`` as JSON (its ``state_dict()``; the format
``policy_from_config(..., {"dispatch_path": ...})`` reads). Logs
``train/dispatch_accuracy`` (fitted, on the fit instances) beside
``train/rule_dispatch_accuracy`` (the default threshold rule on the same instances).

**Test**: per instance, the arm plans a block mask, the kernel
(:func:`~ada_modules.kernels.sparse_prefill.sparse_prefill_attention`) runs it, and a dense
causal softmax in fp32 gives the reference. Logged at the end of the epoch (rows: every query
row of every head of every instance):

- ``test/recall``: mean over rows of the dense attention mass inside the computed blocks,
- ``test/recall_p5``: 5th percentile of that over rows,
- ``test/needle_recall``: over the *needle rows* (rows of needle heads that retrieve a needle;
  only when the split has needles), the mean of the needle keys' dense mass inside the computed
  blocks over the needle keys' dense mass (1 when every block of the needle is computed; the
  sink and local mass a row also has does not count),
- ``test/needle_hit``: share of needle rows whose needle key blocks are all computed,
- ``test/needle_recall_unprobed``, ``test/needle_hit_unprobed``: the same over the *unprobed*
  needle rows: rows before the last query block (the probe block of FlexPrefill and AdaCal)
  that read a needle no row of the last query block reads, so a last-block probe cannot see it,
- ``test/needle_mass``: mean dense mass of the needle rows on their needle's keys (a property of
  the data, the same for every arm: how much a plan that misses the needle loses),
- ``test/output_error``: mean over instances of ``||o - o_dense|| / ||o_dense||``,
- ``test/density``: mean over instances of computed over causal blocks
  (:func:`~ada_modules.attention.plan_density`),
- ``test/probe_overhead``: mean over instances of the plan's probe multiply-adds over those of
  dense causal attention (``2 * D * L (L + 1) / 2`` per head: ``Q K^T`` and ``P V``),
- ``test/dispatch_accuracy``: share of instances whose dispatched regime is the label (arms
  that dispatch: AdaCal).

Matched density: ``match_density`` names a second arm (with its default settings) whose plan
density on each batch becomes this arm's ``target_density`` (fixed-budget arms: ``a_shape``,
``vertical_slash``, ``block_topk``), so a static baseline spends what the adaptive one did on
the same input.

The module saves no hyperparameters: the test-time choices (arm, policy settings) come from
the command line even with ``ada test --ckpt_path`` (LightningCLI would otherwise restore the
fit's), and the calibration lives in ``dispatch_path``, not in the checkpoint.

Example:
    >>> from ada_modules.data.planted_attention import planted_attention
    >>> layer = planted_attention(256, num_heads=2, head_dim=32,
    ...                           generator=torch.Generator().manual_seed(0))
    >>> batch = {name: x[None] for name, x in vars(layer).items()}  # a batch of one
    >>> module = SparsePrefillStudyModule(arm="a_shape", block_size=32, min_sparse_length=0)
    >>> metrics = module.evaluate(batch)
    >>> round(metrics["density"].item(), 3), bool(metrics["recall"].min() > 0)
    (0.583, True)

    In YAML (``ada test -c cli_configs/adacal/study.yaml``)::

        model:
          class_path: ada_modules.models.SparsePrefillStudyModule
          init_args: {arm: flexprefill, block_size: 64, policy_kwargs: {gamma: 0.9}}
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import CatMetric, MeanMetric

from ada_modules.attention.adacal import AdaCalPolicy
from ada_modules.attention.baselines import (
    AShapePolicy,
    BlockTopKPolicy,
    DensePolicy,
    FlexPrefillPolicy,
    VerticalSlashPolicy,
)
from ada_modules.attention.dispatch import REGIMES, TaskDispatcher
from ada_modules.attention.plan import check_block_size, num_blocks, plan_density
from ada_modules.errors import InputError
from ada_modules.kernels.sparse_prefill import sparse_prefill_attention

__all__ = ["ARMS", "SparsePrefillStudyModule", "dense_head_attention"]

ARMS: dict[str, type] = {
    "dense": DensePolicy,
    "a_shape": AShapePolicy,
    "vertical_slash": VerticalSlashPolicy,
    "flexprefill": FlexPrefillPolicy,
    "block_topk": BlockTopKPolicy,
    "adacal": AdaCalPolicy,
}
"""The policies ``arm`` can name."""

_BUDGET_ARMS = ("a_shape", "vertical_slash", "block_topk")
"""Arms with a ``target_density`` (fixed budgets), the ones ``match_density`` applies to."""

_NEEDLE_MEANS = (
    "needle_recall",
    "needle_hit",
    "needle_recall_unprobed",
    "needle_hit_unprobed",
    "needle_mass",
)
_MEANS = ("recall", *_NEEDLE_MEANS, "output_error", "density", "probe_overhead")


def dense_head_attention(
    query: torch.Tensor, key: torch.Tensor, scaling: float, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal fp32 softmax attention probabilities ``(L, L)`` of one head (``query``, ``key``
    ``(L, D)``) and their mass per key block ``(L, key blocks)``.

    Example:
        >>> q, k = torch.randn(40, 8), torch.randn(40, 8)
        >>> probs, block_mass = dense_head_attention(q, k, scaling=0.35, block_size=16)
        >>> block_mass.shape, torch.allclose(block_mass.sum(-1), torch.ones(40))
        (torch.Size([40, 3]), True)
    """
    length = query.shape[0]
    scores = (query.float() @ key.float().T) * scaling
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    probs = scores.masked_fill_(~causal, float("-inf")).softmax(-1)
    pad = num_blocks(length, block_size) * block_size - length
    block_mass = F.pad(probs, (0, pad)).unflatten(-1, (-1, block_size)).sum(-1)
    return probs, block_mass


class SparsePrefillStudyModule(LightningModule):
    """Calibrates AdaCal's dispatcher (fit) and measures one sparse prefill arm (test).

    See the module docstring for what each stage does and logs. Batches are dicts as
    :class:`~ada_modules.data.planted_attention.PlantedAttentionDataModule` serves them:
    ``query``, ``key``, ``value`` ``(B, H, L, D)``, ``regime`` ``(B,)`` and, for the needle
    metrics, ``needle_target`` ``(B, H, L)`` and ``needle_span`` ``(B,)``.

    Args:
        arm: Policy evaluated by ``test``, a key of :data:`ARMS`; ``fit`` needs ``"adacal"``.
        block_size: Block side of the plans and the kernel (a power of two >= 16).
        min_sparse_length: Prompts with fewer keys take the dense plan (every policy's argument).
        policy_kwargs: Further keyword arguments of the arm's policy (e.g. ``{"gamma": 0.9}``
            for FlexPrefill, ``{"target_density": 0.2}`` for A-shape, ``{"retrieval": {"gamma":
            0.97}}`` for AdaCal).
        dispatch_path: AdaCal's dispatcher as JSON: ``fit`` writes the calibrated one there;
            ``test`` loads it (the file must exist). ``None``: ``test`` uses the threshold rule.
        match_density: An arm whose density (default settings, same ``block_size``) is given to
            this arm, per batch, as ``target_density``; only for ``a_shape``,
            ``vertical_slash`` and ``block_topk``.

    Raises:
        InputError: For an unknown arm, a block size that is not a power of two, policy
            arguments the arm rejects, or a ``match_density`` that does not apply, naming the
            value.
    """

    def __init__(
        self,
        arm: str = "adacal",
        block_size: int = 64,
        min_sparse_length: int = 1024,
        policy_kwargs: dict[str, Any] | None = None,
        dispatch_path: str | None = None,
        match_density: str | None = None,
    ) -> None:
        super().__init__()
        if arm not in ARMS:
            raise InputError(f"arm must be one of {sorted(ARMS)}, got {arm!r}")
        check_block_size(block_size)
        if policy_kwargs is not None and not isinstance(policy_kwargs, Mapping):
            raise InputError(f"policy_kwargs must be a dict or None, got {policy_kwargs!r}")
        if dispatch_path is not None and not isinstance(dispatch_path, str | Path):
            raise InputError(f"dispatch_path must be a path or None, got {dispatch_path!r}")
        self.arm, self.block_size = arm, block_size
        self.min_sparse_length = min_sparse_length
        self.policy_kwargs = dict(policy_kwargs or {})
        self.dispatch_path = dispatch_path
        self.match_density = match_density
        self.policy = self._build(arm, self.policy_kwargs)
        if match_density is not None:
            if arm not in _BUDGET_ARMS:
                raise InputError(
                    f"match_density applies to the arms {_BUDGET_ARMS}, not arm={arm!r}"
                )
            if match_density not in ARMS or match_density == arm:
                others = sorted(set(ARMS) - {arm})
                raise InputError(f"match_density must be one of {others}, got {match_density!r}")
            if "target_density" in self.policy_kwargs:
                raise InputError("give either match_density or policy_kwargs.target_density")
        self.reference = None if match_density is None else self._build(match_density, {})
        self.automatic_optimization = False
        self.means = nn.ModuleDict({name: MeanMetric() for name in _MEANS})
        self.dispatch_accuracy = MeanMetric()
        self.row_recall = CatMetric()
        self._features: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []

    def _build(self, arm: str, kwargs: dict[str, Any]) -> Any:
        """The policy of ``arm`` with this module's block size and minimum length."""
        try:
            return ARMS[arm](
                block_size=self.block_size, min_sparse_length=self.min_sparse_length, **kwargs
            )
        except InputError:
            raise
        except TypeError as error:  # an unknown keyword
            raise InputError(f"policy_kwargs do not fit arm {arm!r}: {error}") from error

    def _adacal_policies(self) -> list[AdaCalPolicy]:
        return [p for p in (self.policy, self.reference) if isinstance(p, AdaCalPolicy)]

    def configure_optimizers(self) -> None:
        """None: nothing is trained (the dispatcher is fitted in closed form at epoch end)."""
        return None

    # ------------------------------------------------------------------------------------------
    # Fit: calibrate the dispatcher
    # ------------------------------------------------------------------------------------------

    def on_train_epoch_start(self) -> None:
        if self.arm != "adacal":
            raise InputError(
                f"fit calibrates AdaCal's dispatcher: arm must be 'adacal', got {self.arm!r}"
            )
        # Fail before the pass, not after it: a single-regime fit cannot calibrate a dispatcher.
        regime = getattr(getattr(self.trainer, "datamodule", None), "regime", None)
        if isinstance(regime, str) and regime != "mixed":
            raise InputError(
                "calibrating the dispatcher needs instances of both regimes: set the data "
                f"regime to 'mixed', got {regime!r}"
            )
        self._features, self._labels = [], []

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        query, key = batch["query"], batch["key"]
        features = self.policy.dispatch_features(query, key, None, query.shape[-1] ** -0.5)
        self._features.append(features.detach().cpu())
        self._labels.append(batch["regime"].detach().cpu())

    def calibrate(self, features: torch.Tensor, labels: torch.Tensor) -> TaskDispatcher:
        """Fit the logistic dispatcher on ``features`` ``(n, 4)`` and ``labels`` ``(n,)``
        (indices into ``REGIMES``), install it in the AdaCal policy and return it."""
        if labels.unique().numel() < 2:
            raise InputError(
                "calibrating the dispatcher needs instances of both regimes (data regime "
                f"'mixed'), got only {[REGIMES[int(i)] for i in labels.unique()]}"
            )
        dispatcher = TaskDispatcher().fit(features, labels)
        for policy in self._adacal_policies():
            policy.dispatcher = dispatcher
        return dispatcher

    def on_train_epoch_end(self) -> None:
        features, labels = torch.cat(self._features), torch.cat(self._labels)
        dispatcher = self.calibrate(features, labels)
        truth = labels.bool()
        fitted = (dispatcher.predict(features) == truth).double().mean()
        rule = (TaskDispatcher().predict(features) == truth).double().mean()
        self.log("train/dispatch_accuracy", fitted.float())
        self.log("train/rule_dispatch_accuracy", rule.float())
        if self.dispatch_path is not None and self.trainer.is_global_zero:
            path = Path(self.dispatch_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dispatcher.state_dict(), indent=2) + "\n")

    # ------------------------------------------------------------------------------------------
    # Test: plan, run, compare with dense
    # ------------------------------------------------------------------------------------------

    def on_test_start(self) -> None:
        if self.dispatch_path is None or not self._adacal_policies():
            return
        path = Path(self.dispatch_path)
        if not path.is_file():
            raise InputError(f"dispatch_path {str(path)!r} is not a file; run the fit first")
        dispatcher = TaskDispatcher.from_dict(json.loads(path.read_text()))
        for policy in self._adacal_policies():
            policy.dispatcher = dispatcher

    def _plan(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> Any:
        policy = self.policy
        if self.reference is not None:
            reference = self.reference.plan(query, key, key_padding_mask=None, scaling=scaling)
            target = plan_density(
                reference.block_mask, query.shape[2], key.shape[2], self.block_size
            )
            policy = self._build(
                self.arm, {**self.policy_kwargs, "target_density": max(target, 1e-6)}
            )
        return policy.plan(query, key, key_padding_mask=None, scaling=scaling)

    @torch.no_grad()
    def evaluate(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Plan, run and compare one batch with dense attention (what ``test_step`` logs).

        Returns:
            Per instance ``(B,)``: ``density``, ``output_error``, ``probe_overhead`` and, for
            dispatching arms, ``dispatch_correct``; per row: ``recall`` ``(B, H, L)``; per
            needle row (flat, instance by instance and head by head): ``needle_recall``,
            ``needle_hit`` (float 0/1), ``needle_mass`` and ``needle_unprobed`` (bool); and
            ``needle_recall_unprobed``, ``needle_hit_unprobed``: the unprobed rows' values.
        """
        query, key, value = batch["query"], batch["key"], batch["value"]
        batch_size, heads, length, head_dim = query.shape
        scaling, device = head_dim**-0.5, query.device
        plan = self._plan(query, key, scaling)
        output = sparse_prefill_attention(
            query, key, value, plan.block_mask, block_size=self.block_size, scaling=scaling
        )
        row_block = torch.arange(length, device=device) // self.block_size
        recall = torch.empty(batch_size, heads, length, device=device)
        error = torch.empty(batch_size, device=device)
        needle: dict[str, list[torch.Tensor]] = {
            "recall": [],
            "hit": [],
            "mass": [],
            "unprobed": [],
        }
        target = batch.get("needle_target")
        probe_first = (num_blocks(length, self.block_size) - 1) * self.block_size
        for b in range(batch_size):
            diff = norm = 0.0
            for h in range(heads):
                probs, block_mass = dense_head_attention(
                    query[b, h], key[b, h], scaling, self.block_size
                )
                dense_out = probs @ value[b, h].float()
                diff += (output[b, h].float() - dense_out).square().sum()
                norm += dense_out.square().sum()
                kept = plan.block_mask[b, h][row_block]  # (L, key blocks)
                recall[b, h] = (block_mass * kept).sum(-1)
                if target is not None:
                    rows = self._needle_rows(
                        probs, kept, target[b, h], int(batch["needle_span"][b]), probe_first
                    )
                    for name, per_row in rows.items():
                        needle[name].append(per_row)
            error[b] = (diff / norm).sqrt()
        dense_flops = 2 * heads * head_dim * length * (length + 1) // 2
        metrics = {
            "recall": recall,
            "output_error": error,
            "density": torch.tensor(
                [
                    plan_density(plan.block_mask[b : b + 1], length, length, self.block_size)
                    for b in range(batch_size)
                ],
                device=device,
            ),
            "probe_overhead": torch.full(
                (batch_size,), plan.probe_flops / batch_size / dense_flops, device=device
            ),
        }
        for name, values in needle.items():
            empty = recall.new_zeros(0, dtype=torch.bool if name == "unprobed" else None)
            metrics[f"needle_{name}"] = torch.cat(values) if values else empty
        unprobed = metrics["needle_unprobed"]
        metrics["needle_recall_unprobed"] = metrics["needle_recall"][unprobed]
        metrics["needle_hit_unprobed"] = metrics["needle_hit"][unprobed]
        if plan.regime is not None:
            labels = [REGIMES[int(r)] for r in batch["regime"]]
            metrics["dispatch_correct"] = torch.tensor(
                [float(a == b) for a, b in zip(plan.regime, labels, strict=True)], device=device
            )
        return metrics

    def _needle_rows(
        self,
        probs: torch.Tensor,
        kept: torch.Tensor,
        target: torch.Tensor,
        span: int,
        probe_first: int,
    ) -> dict[str, torch.Tensor]:
        """Per needle row of one head (``target`` ``(L,)``, ``kept`` ``(L, key blocks)`` the plan
        per row): the share of its needle keys' dense mass the plan keeps, whether all their
        blocks are computed, their dense mass, and whether the row is unprobed (before
        ``probe_first`` and reading a needle no row from ``probe_first`` on reads)."""
        rows = (target >= 0).nonzero().squeeze(-1)
        keys = target[rows, None] + torch.arange(span, device=rows.device)  # (rows, span)
        mass = probs[rows].gather(1, keys)
        computed = kept[rows].gather(1, keys // self.block_size)
        hit = computed.all(-1)
        dense = mass.sum(-1)
        share = (mass * computed).sum(-1) / dense.clamp_min(1e-30)
        probed = target[probe_first:]
        unprobed = (rows < probe_first) & ~torch.isin(target[rows], probed[probed >= 0])
        return {
            "recall": torch.where(hit, torch.ones_like(share), share.clamp(max=1.0)),
            "hit": hit.float(),
            "mass": dense,
            "unprobed": unprobed,
        }

    def test_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        metrics = self.evaluate(batch)
        for name in _MEANS:
            if metrics[name].numel():
                self.means[name].update(metrics[name].float().flatten())
        self.row_recall.update(metrics["recall"].flatten().cpu())
        if "dispatch_correct" in metrics:
            self.dispatch_accuracy.update(metrics["dispatch_correct"])

    def on_test_epoch_end(self) -> None:
        for name in _MEANS:
            metric = self.means[name]
            if metric.weight > 0:  # no needles in a structure split: no needle metrics
                self.log(f"test/{name}", metric.compute())
            metric.reset()
        rows = self.row_recall.compute()
        self.log("test/recall_p5", torch.quantile(rows.float(), 0.05))
        self.row_recall.reset()
        if self.dispatch_accuracy.weight > 0:
            self.log("test/dispatch_accuracy", self.dispatch_accuracy.compute())
        self.dispatch_accuracy.reset()
