"""Reliability study: fixed (channel, operator, budget) choices against the cost-aware router.

:class:`ReliabilityStudyModule` runs ``ada test`` on
:class:`~ada_modules.data.reliability_items.ReliabilityItemsDataModule`: simulated *channels*
(models with a per-difficulty-bucket accuracy, correlated samples and a cost per sample) answer
every item through every *option* (a channel with one of the reliability operators of
:mod:`ada_modules.reliability.operators` and its budget). The labelled (``train``) items' outcomes
fit a :class:`~ada_modules.reliability.router.KNNRouter` on hashed character n-grams of the item
texts; the held-out (``test``) items measure the fixed options and the router's frontier, one
point per ``λ`` of ``lambdas``. It trains no network: the module has no parameters. It runs in
one process; one generator draws every outcome, option by option within a batch, so outcomes
depend on the seed, the option list and the batch size.

Item ``i`` of bucket ``b`` with hardness ``h_i`` has single-sample accuracy
``sigmoid(logit(accuracy[b]) - hardness_scale * h_i)`` on a channel, so items vary within a bucket
and the same items are hard on every channel.

Logged at the end of the test epoch:

- ``test/quality/<option>``, ``test/cost/<option>``: each fixed option's mean correctness and cost,
- ``test/best_fixed_quality``, ``test/best_fixed_cost``: the *best fixed option*, the cheapest
  one whose quality is within ``matched_quality_tolerance`` (at least one item) of the highest
  fixed quality (the target quality),
- ``test/router_cost_ratio``: the router's lowest cost at matched quality (at least the target)
  over the best fixed option's cost (``nan`` when no ``λ`` reaches the target). Like the fixed
  options' points, the router's frontier is read on the held-out items: the ``λ`` that matches
  is picked there (as when one plots a frontier), which favours the router a little,
- ``test/router_quality_gain``: the router's highest quality at a cost no higher than the best
  fixed option's, minus that option's quality (matched cost),
- ``test/router_gain_over_single``: the same against the best single-sample option,
- ``test/router_pareto_gain_min``, ``test/router_pareto_gain_mean``: over the fixed options on
  the empirical Pareto front (no other fixed option is as good for less), the router's quality
  gain at each one's cost (a negative minimum: some fixed option lies above the router's
  frontier); ``test/router_pareto_unreached`` counts the Pareto options cheaper than every
  point of the router's frontier (no gain defined there),
- ``test/bucket_oracle_cost_ratio``: the cost ratio of routing by the true bucket (each bucket's
  best option by the labelled items' means): the premise, what per-item allocation can save when
  the difficulty is known,
- ``test/bucket_winners``: distinct options among the buckets' cost-efficient choices (per bucket,
  the cheapest option within ``matched_quality_tolerance`` of that bucket's best quality on the
  labelled items): 1 means one fixed choice serves every bucket and routing cannot help.

With ``output_dir``, ``frontier.json`` there holds the router's and the bucket oracle's frontiers,
the fixed options and the per-bucket table (written atomically).

Examples:
    >>> from lightning.pytorch import Trainer
    >>> from ada_modules.data.reliability_items import ReliabilityItemsDataModule
    >>> module = ReliabilityStudyModule(
    ...     channels={"small": {"accuracy": [0.95, 0.2], "cost": 1.0},
    ...               "large": {"accuracy": [0.95, 0.85], "cost": 8.0}},
    ...     options=[{"name": "small", "channel": "small", "operator": "single"},
    ...              {"name": "large", "channel": "large", "operator": "single"}],
    ...     k=5, seed=0)
    >>> data = ReliabilityItemsDataModule(num_labelled=60, num_test=60, num_topics=4,
    ...                                   num_buckets=2, seed=0)
    >>> trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    >>> metrics = trainer.test(module, data, verbose=False)[0]
    >>> metrics["test/bucket_winners"], metrics["test/best_fixed_cost"]  # each bucket its own
    (2.0, 8.0)
"""

import json
import math
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule

from ada_modules.checks import is_finite_real
from ada_modules.errors import InputError
from ada_modules.models.causal_lm import CausalLMModule
from ada_modules.reliability.channel import (
    Channel,
    SimulatedChannel,
    SimulatedCritic,
    SimulatedVerifier,
)
from ada_modules.reliability.lm_channel import CausalLMChannel
from ada_modules.reliability.operators import (
    DiversityCombining,
    GeneratorCritic,
    HybridRetransmission,
    Operator,
    RatelessSampling,
    RedundantVerification,
)
from ada_modules.reliability.router import (
    FixedOption,
    FrontierPoint,
    HashedNgramEmbedder,
    KNNRouter,
    cost_at_matched_quality,
    fixed_options,
    pareto_front,
    realised_point,
)

__all__ = ["OPERATORS", "ReliabilityStudyModule"]

OPERATORS = ("single", "majority", "best_of_n", "harq", "critic", "rateless", "verify")
"""The ``operator`` names an option may use (see :meth:`ReliabilityStudyModule.build_operator`)."""

_CHANNEL_KEYS = {"accuracy", "cost", "correlation", "num_distractors", "zipf_exponent", "critic"}
_LM_CHANNEL_KEYS = {"checkpoint", "temperature", "max_new_tokens", "cost_per_token"}
_DEFAULT_LAMBDAS = (
    0.0,
    1e-4,
    2e-4,
    5e-4,
    1e-3,
    2e-3,
    5e-3,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    10.0,
)


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-6, 1 - 1e-6)
    return torch.log(p) - torch.log1p(-p)


class ReliabilityStudyModule(LightningModule):
    """Measures fixed reliability options and the kNN router on simulated channels (``test``).

    See the module docstring for what it logs.

    Args:
        channels: Channel name -> ``{"accuracy": [one per bucket], "cost": per sample,
            "correlation": rho (0), "num_distractors": (4), "zipf_exponent": (1.0), "critic":
            {"keep": [per bucket], "fix": [per bucket]}}`` (the critic only for ``critic``
            options; a critique costs one sample of its channel). Or a real model:
            ``{"checkpoint": a CausalLMModule checkpoint, "temperature": (1.0),
            "max_new_tokens": (the module's), "cost_per_token": (1.0)}``, sampled on the items'
            texts as prompts (:class:`~ada_modules.reliability.lm_channel.CausalLMChannel`) and
            judged against their answers (:class:`~ada_modules.data.TaskItemsDataModule`).
        options: Each ``{"name": ..., "channel": ..., "operator": one of OPERATORS, ...}`` with
            the operator's budget arguments (e.g. ``"num_samples": 5``), see
            :meth:`build_operator`.
        verifier: ``{"tpr", "fpr", "cost"}`` of the simulated verifier of ``best_of_n``,
            ``harq`` and ``verify`` options (default ``tpr=0.9, fpr=0.1, cost=0.5``).
        hardness_scale: How much an item's hardness moves its logit accuracy.
        k: Neighbours of the router.
        lambdas: Cost weights of the router's frontier (default: 0 to 1, log-spaced).
        matched_quality_tolerance: Quality the router may fall short of a target and still match
            it (sampling noise).
        embedding_dim: Hash buckets of the n-gram embedding.
        seed: Seed of the simulation; ``None`` takes the seed of ``seed_everything``.
        output_dir: Folder of ``frontier.json``; ``None`` writes nothing.

    Raises:
        InputError: For an unknown channel key or operator, an option naming no channel, or an
            out-of-range value, naming it.
    """

    def __init__(
        self,
        channels: Mapping[str, Mapping[str, Any]],
        options: Sequence[Mapping[str, Any]],
        verifier: Mapping[str, float] | None = None,
        hardness_scale: float = 0.5,
        k: int = 15,
        lambdas: Sequence[float] | None = None,
        matched_quality_tolerance: float = 0.01,
        embedding_dim: int = 1024,
        seed: int | None = None,
        output_dir: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(channels, Mapping) or not channels:
            raise InputError(f"channels must be a non-empty mapping of specs, got {channels!r}")
        for name, spec in channels.items():
            keys = _LM_CHANNEL_KEYS if "checkpoint" in spec else _CHANNEL_KEYS
            if set(spec) - keys or not {"accuracy", "checkpoint"} & set(spec):
                raise InputError(
                    f"channels[{name!r}] needs 'accuracy' (simulated, taking "
                    f"{sorted(_CHANNEL_KEYS)}) or 'checkpoint' (a CausalLMModule, taking "
                    f"{sorted(_LM_CHANNEL_KEYS)}), got {sorted(spec)}"
                )
            if "accuracy" in spec and "cost" not in spec:
                raise InputError(f"channels[{name!r}] needs a 'cost' (per sample), got none")
            cost = spec.get("cost", spec.get("cost_per_token", 1.0))
            if not is_finite_real(cost) or cost < 0:
                raise InputError(f"channels[{name!r}].cost must be a number >= 0, got {cost!r}")
        if isinstance(options, str | bytes) or not options:
            raise InputError(f"options must be a non-empty list of option specs, got {options!r}")
        names = [option.get("name") for option in options]
        if len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
            raise InputError(f"options need distinct string names, got {names!r}")
        for option in options:
            if option.get("channel") not in channels:
                raise InputError(
                    f"option {option['name']!r}: channel must be one of {sorted(channels)}, "
                    f"got {option.get('channel')!r}"
                )
            if option.get("operator") not in OPERATORS:
                raise InputError(
                    f"option {option['name']!r}: operator must be one of {OPERATORS}, "
                    f"got {option.get('operator')!r}"
                )
        if not is_finite_real(hardness_scale) or hardness_scale < 0:
            raise InputError(f"hardness_scale must be a number >= 0, got {hardness_scale!r}")
        if not is_finite_real(matched_quality_tolerance) or not 0 <= matched_quality_tolerance < 1:
            raise InputError(
                f"matched_quality_tolerance must be in [0, 1), got {matched_quality_tolerance!r}"
            )
        self.channel_specs = {name: dict(spec) for name, spec in channels.items()}
        self.option_specs = [dict(option) for option in options]
        self.option_names: list[str] = names
        unknown = set(verifier or {}) - {"tpr", "fpr", "cost"}
        if unknown:
            raise InputError(f"verifier takes tpr, fpr and cost, got {sorted(verifier)}")
        verifier = {"tpr": 0.9, "fpr": 0.1, "cost": 0.5, **(verifier or {})}
        self.verifier = SimulatedVerifier(verifier["tpr"], verifier["fpr"], cost=verifier["cost"])
        self.hardness_scale = float(hardness_scale)
        self.router = KNNRouter(k)
        self.embedder = HashedNgramEmbedder(dim=embedding_dim)
        self.lambdas = list(_DEFAULT_LAMBDAS if lambdas is None else lambdas)
        if any(not is_finite_real(lam) or lam < 0 for lam in self.lambdas):
            raise InputError(f"lambdas must be numbers >= 0, got {self.lambdas!r}")
        self.tolerance = float(matched_quality_tolerance)
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        self.output_dir = output_dir
        self._results: dict[str, list[Any]] = {}

    def configure_optimizers(self) -> None:
        """None: nothing is trained."""
        return None

    # ------------------------------------------------------------------------------------------
    # Channels and options
    # ------------------------------------------------------------------------------------------

    def _per_item(self, per_bucket: Sequence[float], name: str) -> torch.Tensor:
        values = torch.as_tensor(per_bucket, dtype=torch.float64)
        if values.ndim != 1 or values.numel() != self._num_buckets:
            raise InputError(
                f"{name} must give one value per bucket ({self._num_buckets}), got {per_bucket!r}"
            )
        if not bool(((values >= 0) & (values <= 1)).all()):
            raise InputError(f"{name} values must be in [0, 1], got {per_bucket!r}")
        return values[self._buckets]

    def build_channels(
        self,
        buckets: torch.Tensor,
        hardness: torch.Tensor,
        texts: Sequence[str] = (),
        answers: Sequence[Hashable] | None = None,
        extract_answer: Callable[[str], Hashable] | None = None,
    ) -> None:
        """Make every channel (and its critic) over the items with these buckets and hardness;
        a ``checkpoint`` channel samples a :class:`~ada_modules.models.CausalLMModule` on the
        ``texts`` (prompts) and is judged against ``answers``."""
        self._buckets, self._num_buckets = buckets, int(buckets.max()) + 1
        self.channels: dict[str, Channel] = {}
        self.critics: dict[str, SimulatedCritic] = {}
        self._answers = answers
        for name, spec in self.channel_specs.items():
            if "checkpoint" in spec:
                if answers is None:
                    raise InputError(
                        f"channels[{name!r}] samples a model, so the items need reference "
                        "answers (use TaskItemsDataModule)"
                    )
                lm = CausalLMModule.load_from_checkpoint(spec["checkpoint"], map_location="cpu")
                self.channels[name] = CausalLMChannel(
                    lm.model.to(self.device),
                    lm.tokenizer,
                    texts,
                    extract_answer=extract_answer,
                    temperature=spec.get("temperature", 1.0),
                    max_new_tokens=spec.get("max_new_tokens", lm.max_new_tokens),
                    cost_per_token=spec.get("cost_per_token", 1.0),
                    name=name,
                )
                continue
            base = self._per_item(spec["accuracy"], f"channels[{name!r}].accuracy")
            accuracy = torch.sigmoid(_logit(base) - self.hardness_scale * hardness.double())
            kwargs = {key: spec[key] for key in ("num_distractors", "zipf_exponent") if key in spec}
            self.channels[name] = SimulatedChannel(
                accuracy,
                correlation=spec.get("correlation", 0.0),
                cost=spec.get("cost", 1.0),
                name=name,
                **kwargs,
            )
            if "critic" in spec:
                critic = spec["critic"]
                self.critics[name] = SimulatedCritic(
                    self._per_item(critic["keep"], f"channels[{name!r}].critic.keep"),
                    self._per_item(critic["fix"], f"channels[{name!r}].critic.fix"),
                    cost=spec.get("cost", 1.0),
                    num_distractors=spec.get("num_distractors", 4),
                )

    def build_operator(self, option: Mapping[str, Any]) -> Operator:
        """The operator of ``option``: ``single``; ``majority``/``best_of_n``
        (``num_samples``); ``harq`` (``max_rounds``, ``samples_per_round``, ``mode``);
        ``critic`` (``rounds``); ``rateless`` (``max_samples``, ``confidence``,
        ``min_samples``); ``verify`` (``num_candidates``, ``num_verifiers``, ``min_pass``)."""
        kind = option["operator"]
        args = {key: v for key, v in option.items() if key not in ("name", "channel", "operator")}
        try:
            if kind == "single":
                return DiversityCombining(1, **args)
            if kind == "majority":
                return DiversityCombining(rule="majority", **args)
            if kind == "best_of_n":
                return DiversityCombining(rule="best_of_n", verifier=self.verifier, **args)
            if kind == "harq":
                return HybridRetransmission(verifier=self.verifier, **args)
            if kind == "critic":
                if option["channel"] not in self.critics:
                    raise InputError(
                        f"option {option['name']!r}: channel {option['channel']!r} has no critic"
                    )
                return GeneratorCritic(critic=self.critics[option["channel"]], **args)
            if kind == "rateless":
                return RatelessSampling(**args)
            num_verifiers = args.pop("num_verifiers", 3)
            return RedundantVerification(verifiers=[self.verifier] * num_verifiers, **args)
        except TypeError as error:
            raise InputError(f"option {option['name']!r}: {error}") from error

    def run_options(self, items: Sequence[int], generator: torch.Generator) -> tuple[Any, Any]:
        """Correctness and cost ``(len(items), options)`` of every option on ``items``."""
        quality = torch.zeros(len(items), len(self.option_specs), dtype=torch.float64)
        cost = torch.zeros_like(quality)
        for t, option in enumerate(self.option_specs):
            channel = self.channels[option["channel"]]
            operator = self._operators[t]
            for row, item in enumerate(items):
                if isinstance(channel, CausalLMChannel):
                    truth: Hashable = self._answers[item]
                else:
                    truth = channel.truth(item)
                outcome = operator(channel, item, truth=truth, generator=generator)
                quality[row, t] = float(outcome.is_correct(truth))
                cost[row, t] = outcome.cost
        return quality, cost

    # ------------------------------------------------------------------------------------------
    # Test
    # ------------------------------------------------------------------------------------------

    def on_test_start(self) -> None:
        if self.trainer.world_size > 1:
            raise InputError(
                f"ReliabilityStudyModule runs in one process, got world_size={self.trainer.world_size}"
            )
        datasets = self.trainer.datamodule.datasets
        splits = [datasets["train"], datasets["test"]]
        buckets = torch.tensor([b for split in splits for b in split.buckets])
        hardness = torch.tensor([h for split in splits for h in split.hardness])
        answers = None
        if all(getattr(split, "answers", None) is not None for split in splits):
            answers = [a for split in splits for a in split.answers]
        task = getattr(self.trainer.datamodule, "task", None)
        self.build_channels(
            buckets,
            hardness,
            [text for split in splits for text in split.texts],
            answers,
            getattr(task, "extract_answer", None),
        )
        self._operators = [self.build_operator(option) for option in self.option_specs]
        labelled = datasets["train"]
        generator = torch.Generator().manual_seed(self.seed)
        quality, cost = self.run_options(range(len(labelled)), generator)
        self._labelled = {"quality": quality, "cost": cost, "buckets": buckets[: len(labelled)]}
        texts = list(labelled.texts)
        self.embedder.fit(texts)
        self.router.fit(self.embedder(texts), quality, cost, option_names=self.option_names)
        self._generator = torch.Generator().manual_seed(self.seed + 1_000_003)
        self._results = {"quality": [], "cost": [], "texts": [], "buckets": []}

    def test_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        quality, cost = self.run_options(batch["item"].tolist(), self._generator)
        self._results["quality"].append(quality)
        self._results["cost"].append(cost)
        self._results["texts"].extend(batch["text"])
        self._results["buckets"].append(batch["bucket"])

    def _bucket_choices(self, lam: float) -> torch.Tensor:
        """Per bucket, the option maximising labelled mean quality - lam * cost."""
        q, c, b = (self._labelled[key] for key in ("quality", "cost", "buckets"))
        choices = []
        for bucket in range(self._num_buckets):
            rows = b == bucket
            if not bool(rows.any()):
                choices.append(0)
                continue
            score = q[rows].mean(0) - lam * c[rows].mean(0)
            choices.append(int(torch.argmax(score)))
        return torch.tensor(choices)

    def _bucket_winners(self) -> list[str]:
        q, c, b = (self._labelled[key] for key in ("quality", "cost", "buckets"))
        winners = []
        for bucket in range(self._num_buckets):
            rows = b == bucket
            if not bool(rows.any()):
                continue
            mean_q, mean_c = q[rows].mean(0), c[rows].mean(0)
            near_best = mean_q >= mean_q.max() - max(self.tolerance, 1.0 / int(rows.sum()))
            winners.append(
                self.option_names[int(torch.where(near_best, mean_c, math.inf).argmin())]
            )
        return winners

    def on_test_epoch_end(self) -> None:
        quality = torch.cat(self._results["quality"])
        cost = torch.cat(self._results["cost"])
        buckets = torch.cat(self._results["buckets"])
        queries = self.embedder(self._results["texts"])
        frontier = self.router.frontier(queries, quality, cost, self.lambdas)
        fixed = fixed_options(quality, cost, self.option_names)
        # The reference: the cheapest fixed option within the tolerance of the best quality (the
        # highest-quality one alone would let a near-tie with a far dearer option decide); the
        # tolerance is at least one item.
        tolerance = max(self.tolerance, 1.0 / len(buckets))
        target = max(option.quality for option in fixed) - tolerance
        best = min((f for f in fixed if f.quality >= target), key=lambda f: (f.cost, -f.quality))
        singles = [
            f for f, o in zip(fixed, self.option_specs, strict=True) if o["operator"] == "single"
        ]
        oracle = [
            realised_point(lam, self._bucket_choices(lam)[buckets], quality, cost)
            for lam in self.lambdas
        ]

        def cost_ratio(points: Sequence[FrontierPoint]) -> float:
            matched = cost_at_matched_quality(points, target)
            return math.nan if matched is None or best.cost == 0 else matched / best.cost

        def gain_at_cost(reference_quality: float, reference_cost: float) -> float:
            qualities = [p.quality for p in frontier if p.cost <= reference_cost + 1e-12]
            return (max(qualities) - reference_quality) if qualities else math.nan

        for option in fixed:
            self.log(f"test/quality/{option.name}", option.quality)
            self.log(f"test/cost/{option.name}", option.cost)
        pareto = pareto_front(fixed)
        # A Pareto option cheaper than every router point has no gain: counted, not averaged.
        pareto_gains = [g for f in pareto if not math.isnan(g := gain_at_cost(f.quality, f.cost))]
        winners = self._bucket_winners()
        metrics = {
            "best_fixed_quality": best.quality,
            "best_fixed_cost": best.cost,
            "router_cost_ratio": cost_ratio(frontier),
            "router_quality_gain": gain_at_cost(best.quality, best.cost),
            "router_pareto_gain_min": min(pareto_gains, default=math.nan),
            "router_pareto_gain_mean": (
                sum(pareto_gains) / len(pareto_gains) if pareto_gains else math.nan
            ),
            "router_pareto_unreached": float(len(pareto) - len(pareto_gains)),
            "bucket_oracle_cost_ratio": cost_ratio(oracle),
            "bucket_winners": float(len(set(winners))),
        }
        if singles:
            single = max(singles, key=lambda option: (option.quality, -option.cost))
            metrics["router_gain_over_single"] = gain_at_cost(single.quality, single.cost)
        for name, value in metrics.items():
            self.log(f"test/{name}", value)
        if self.output_dir is not None:
            self._write(frontier, oracle, fixed, winners, best.name)

    def _write(
        self,
        frontier: Sequence[FrontierPoint],
        oracle: Sequence[FrontierPoint],
        fixed: Sequence[FixedOption],
        winners: Sequence[str],
        best_name: str,
    ) -> None:
        out = Path(self.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "options": self.option_names,
            "best_fixed": best_name,
            "bucket_winners": winners,
            "fixed": [vars(option) for option in fixed],
            "router": [vars(point) for point in frontier],
            "bucket_oracle": [vars(point) for point in oracle],
        }
        tmp = out / "frontier.json.tmp"
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(out / "frontier.json")
