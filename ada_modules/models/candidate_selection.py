"""Offline RL for picking K of a variable number of candidates: BC, IQL, AIQL and A²IQL.

One LightningModule; the algorithm is a choice of init args:

- ``critic="none"``: behaviour cloning, the Plackett-Luce likelihood of the logged picks.
- ``critic="per_candidate"``: IQL with ``Q(S, a) = Σ_{i∈a} q(x_i, φ(S))``.
- ``critic="aggregate"``: AIQL, ``Q(φ(S), ψ(a))`` on aggregate statistics of the state and of the
  chosen subset; the actor still scores every candidate.
- ``adaptation="bonus"``: A²IQL. A reward predictor with uncertainty is fitted on the scarce
  target-objective log (``datamodule.target_logs``); the actor's advantage becomes
  ``(Q - V) + η (b(S, a) - mean_{a'} b(S, a'))`` with the conservative bonus
  ``b = μ - λ σ`` and ``a'`` drawn from the actor's own policy on the same pool. Critics train on the source log
  only, unchanged.
- ``adaptation="relabel"``: source rows' rewards are replaced by the predictor's mean (the
  reward-relabelling baseline).

All critics follow IQL: expectile regression of ``V`` towards the target ``min(Q1, Q2)``, TD
regression of ``Q`` towards ``r + γ V(S')``, Polyak-averaged target Qs, and advantage-weighted
extraction of the actor, ``-exp(β A) log π(a|S)`` (weights clipped). One Adam optimises the
three losses, which touch disjoint parameters. Validation and test roll the greedy policy
(top-K scores) out in the DataModule's simulator on fresh episodes.

Example:
    >>> from lightning.pytorch import Trainer
    >>> from ada_modules.data.consolidation_logs import ConsolidationLogsDataModule
    >>> dm = ConsolidationLogsDataModule(min_candidates=20, max_candidates=40, horizon=4,
    ...     source_episodes=8, val_episodes=4, test_episodes=4, seed=0, batch_size=16)
    >>> module = CandidateSelectionModule(critic="aggregate", hidden=16)
    >>> trainer = Trainer(max_steps=3, logger=False, enable_progress_bar=False,
    ...     enable_model_summary=False, enable_checkpointing=False)
    >>> trainer.fit(module, dm)
    >>> metrics = trainer.test(module, dm, verbose=False)[0]
    >>> sorted(k for k in metrics if k.startswith("test/return"))
    ['test/return', 'test/return_source', 'test/return_target']
"""

import copy
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from ada_modules.checks import is_finite_real
from ada_modules.data.consolidation import (
    ACTION_FEATURES,
    CANDIDATE_FEATURES,
    HEURISTICS,
    STATE_FEATURES,
    ConsolidationSimulator,
    ConsolidationState,
    action_summary,
    candidate_features,
    heuristic_scores,
    select_top_k,
    state_summary,
)
from ada_modules.errors import InputError
from ada_modules.offline_rl.losses import (
    advantage_weights,
    expectile_loss,
    plackett_luce_log_likelihood,
    sample_plackett_luce,
    subsample_candidates,
)
from ada_modules.offline_rl.networks import (
    AggregateCritic,
    CandidateScorer,
    PerCandidateCritic,
    ValueNetwork,
)
from ada_modules.offline_rl.reward_predictors import (
    BayesianLinearRewardPredictor,
    EnsembleRewardPredictor,
    conservative_bonus,
)

__all__ = ["CandidateSelectionModule", "rollout"]


def rollout(
    simulator: ConsolidationSimulator,
    score: Callable[[ConsolidationState], Tensor],
    envs: int,
    seed: int,
) -> dict[str, float]:
    """Mean reward per decision epoch of the greedy policy ``top-K(score(state))``.

    Args:
        simulator: The environment.
        score: ``ConsolidationState -> [B, S]`` scores.
        envs: Episodes run in parallel.
        seed: Seed of the episodes.

    Returns:
        ``{"source": ..., "target": ..., "units": ..., "zones": ..., "expired": ...}``, each the
        per-epoch mean over episodes.
    """
    state = simulator.reset(envs, seed=seed)
    totals: dict[str, float] = {}
    while not state.done:
        chosen = select_top_k(score(state), state.mask, simulator.pick)
        state, reward = simulator.step(state, chosen)
        for name in ("source", "target", "units", "zones", "expired"):
            totals[name] = totals.get(name, 0.0) + float(getattr(reward, name).mean())
    return {name: value / simulator.horizon for name, value in totals.items()}


class CandidateSelectionModule(LightningModule):
    """BC / IQL / AIQL / A²IQL for selecting K candidates from logged consolidation data.

    Args:
        critic: ``"aggregate"`` (AIQL), ``"per_candidate"`` (IQL) or ``"none"`` (behaviour
            cloning).
        adaptation: ``"none"``, ``"bonus"`` (A²IQL) or ``"relabel"`` (source rewards replaced
            by the target reward predictor's mean).
        hidden: Hidden width of every network.
        expectile: IQL's expectile τ of the value regression.
        temperature: Inverse temperature β of the advantage weights.
        max_weight: Clip of the advantage weights.
        discount: Discount γ.
        target_update: Polyak rate of the target Qs.
        reward_scale: Multiplies rewards (and the bonus) before the critics see them; ``None``:
            one over the standard deviation of the training log's rewards.
        num_negatives: Candidates kept besides the picks in the actor's likelihood (sampled
            negatives for large pools); ``None``: all.
        predictor: Target reward predictor: ``"bayes_linear"`` or ``"ensemble"``.
        uncertainty_penalty: λ of the conservative bonus ``μ - λ σ``.
        bonus_scale: η, the bonus's weight in the advantage.
        bonus_samples: Subsets drawn from the actor per state for the bonus's baseline.
        eval_objective: Objective whose return is logged as ``val/return`` and ``test/return``.
        optimizer: Optimizer factory (all three losses).

    Raises:
        InputError: If an argument is out of range, naming it.
    """

    def __init__(
        self,
        critic: Literal["aggregate", "per_candidate", "none"] = "aggregate",
        adaptation: Literal["none", "bonus", "relabel"] = "none",
        hidden: int = 64,
        expectile: float = 0.7,
        temperature: float = 3.0,
        max_weight: float = 100.0,
        discount: float = 0.9,
        target_update: float = 0.005,
        reward_scale: float | None = None,
        num_negatives: int | None = None,
        predictor: Literal["bayes_linear", "ensemble"] = "bayes_linear",
        uncertainty_penalty: float = 1.0,
        bonus_scale: float = 1.0,
        bonus_samples: int = 8,
        eval_objective: Literal["source", "target"] = "source",
        optimizer: OptimizerCallable = torch.optim.Adam,
    ) -> None:
        super().__init__()
        choices = {
            "critic": (critic, ("aggregate", "per_candidate", "none")),
            "adaptation": (adaptation, ("none", "bonus", "relabel")),
            "predictor": (predictor, ("bayes_linear", "ensemble")),
            "eval_objective": (eval_objective, ("source", "target")),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise InputError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if adaptation != "none" and critic == "none":
            raise InputError(f"adaptation={adaptation!r} needs a critic, got critic='none'")
        if not (is_finite_real(expectile) and 0 < expectile < 1):
            raise InputError(f"expectile must be a number in (0, 1), got {expectile!r}")
        for name, value in (("discount", discount), ("target_update", target_update)):
            if not (is_finite_real(value) and 0 <= value <= 1):
                raise InputError(f"{name} must be a number in [0, 1], got {value!r}")
        for name, value in (
            ("temperature", temperature),
            ("uncertainty_penalty", uncertainty_penalty),
            ("bonus_scale", bonus_scale),
        ):
            if not (is_finite_real(value) and value >= 0):
                raise InputError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (is_finite_real(max_weight) and max_weight > 0):
            raise InputError(f"max_weight must be a finite number > 0, got {max_weight!r}")
        if reward_scale is not None and not (is_finite_real(reward_scale) and reward_scale > 0):
            raise InputError(
                f"reward_scale must be None or a finite number > 0, got {reward_scale!r}"
            )
        for name, value in (("hidden", hidden), ("bonus_samples", bonus_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}")
        if num_negatives is not None and (
            isinstance(num_negatives, bool) or not isinstance(num_negatives, int)
            or num_negatives < 1
        ):  # fmt: skip
            raise InputError(
                f"num_negatives must be None or an integer >= 1, got {num_negatives!r}"
            )
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer = optimizer
        self.actor = CandidateScorer(CANDIDATE_FEATURES, STATE_FEATURES, hidden)
        self.value = ValueNetwork(STATE_FEATURES, hidden) if critic != "none" else None
        if critic == "aggregate":
            self.critic = AggregateCritic(STATE_FEATURES, ACTION_FEATURES, hidden)
        elif critic == "per_candidate":
            self.critic = PerCandidateCritic(CANDIDATE_FEATURES, STATE_FEATURES, hidden)
        else:
            self.critic = None
        self.target_critic = copy.deepcopy(self.critic)
        if self.target_critic is not None:
            self.target_critic.requires_grad_(False)
        self.reward_predictor: torch.nn.Module | None = None
        if adaptation != "none":
            self.reward_predictor = (
                BayesianLinearRewardPredictor()
                if predictor == "bayes_linear"
                else EnsembleRewardPredictor()
            )
        self.register_buffer("reward_multiplier", torch.tensor(reward_scale or 1.0))

    # -- setup ---------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        train = datamodule.datasets["train"]
        if self.reward_predictor is not None:
            logs = getattr(datamodule, "target_logs", None)
            if logs is None:
                raise InputError(
                    f"adaptation={self.hparams.adaptation!r} needs target logs; set the "
                    "DataModule's target_episodes >= 1"
                )
            self.reward_predictor.fit(torch.cat([logs.state, logs.action], dim=1), logs.reward)
            self.reward_predictor.to(self.device)
        if self.hparams.reward_scale is None:
            rewards = torch.cat([part.reward for part in getattr(train, "datasets", [train])])
            self.reward_multiplier.fill_(1.0 / float(rewards.std().clamp(min=1e-6)))

    def configure_optimizers(self) -> Any:
        return self.optimizer([p for p in self.parameters() if p.requires_grad])

    # -- training ------------------------------------------------------------------------------

    def _q(self, critic: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        if self.hparams.critic == "aggregate":
            return critic(batch["state"], batch["action"])
        return critic(batch["state"], batch["candidates"], batch["chosen"])

    def _bonus(self, batch: dict[str, Tensor], scores: Tensor) -> Tensor:
        """``b(S, a) - mean_{a'} b(S, a')``, ``a'`` drawn from the actor's Plackett-Luce policy."""
        hp = self.hparams
        state, candidates, mask = batch["state"], batch["candidates"], batch["mask"]
        logits = scores.detach()[:, None].expand(-1, hp.bonus_samples, -1)
        others = sample_plackett_luce(logits, mask[:, None], batch["chosen"].shape[1])
        actions = torch.cat([batch["action"][:, None], action_summary(candidates, others)], 1)
        states = state[:, None].expand(-1, actions.shape[1], -1)
        features = torch.cat([states, actions], dim=-1).flatten(0, 1)
        mean, std = self.reward_predictor.predict(features)
        bonus = conservative_bonus(mean, std, hp.uncertainty_penalty).view(actions.shape[:2])
        return bonus[:, 0] - bonus[:, 1:].mean(1)

    def training_step(self, batch: dict[str, Tensor], batch_index: int) -> Tensor:
        hp = self.hparams
        mask = batch["mask"]
        if hp.num_negatives is not None:
            mask = subsample_candidates(mask, batch["chosen"], hp.num_negatives)
        scores = self.actor(batch["candidates"], batch["mask"], batch["state"])
        log_likelihood = plackett_luce_log_likelihood(scores, mask, batch["chosen"])
        if self.critic is None:
            loss = -log_likelihood.mean()
            self.log("train/actor_loss", loss, prog_bar=True)
            return loss
        reward = batch["reward"]
        if hp.adaptation == "relabel":
            with torch.no_grad():
                mean, _ = self.reward_predictor.predict(
                    torch.cat([batch["state"], batch["action"]], 1)
                )
            reward = torch.where(batch["domain"] == 0, mean, reward)
        reward = reward * self.reward_multiplier
        with torch.no_grad():
            target_q = torch.minimum(*self._q(self.target_critic, batch))
            next_value = self.value(batch["next_state"])
            td_target = reward + hp.discount * (1 - batch["done"]) * next_value
        value = self.value(batch["state"])
        value_loss = expectile_loss(target_q - value, hp.expectile)
        q1, q2 = self._q(self.critic, batch)
        q_loss = (q1 - td_target).square().mean() + (q2 - td_target).square().mean()
        advantage = target_q - value.detach()
        if hp.adaptation == "bonus":
            with torch.no_grad():
                advantage = advantage + hp.bonus_scale * self.reward_multiplier * self._bonus(
                    batch, scores
                )
        weights = advantage_weights(advantage, hp.temperature, hp.max_weight)
        actor_loss = -(weights * log_likelihood).mean()
        self.log_dict(
            {
                "train/actor_loss": actor_loss,
                "train/value_loss": value_loss,
                "train/q_loss": q_loss,
                "train/mean_weight": weights.mean(),
                "train/clipped_weights": (weights >= hp.max_weight).float().mean(),
            },
            prog_bar=False,
        )
        return actor_loss + value_loss + q_loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_index: int) -> None:
        if self.critic is None:
            return
        rate = self.hparams.target_update
        with torch.no_grad():
            for target, online in zip(
                self.target_critic.parameters(), self.critic.parameters(), strict=True
            ):
                target.lerp_(online, rate)

    # -- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def policy_scores(self, state: ConsolidationState) -> Tensor:
        """Actor scores ``[B, S]`` of a ``ConsolidationState`` (pick the top K)."""
        features = candidate_features(state).to(self.device)
        mask = state.mask.to(self.device)
        progress = torch.full((mask.shape[0],), state.epoch / state.horizon, device=self.device)
        summary = state_summary(features, mask, progress)
        dtype = next(self.actor.parameters()).dtype  # e.g. bfloat16 under precision="bf16-true"
        return self.actor(features.to(dtype), mask, summary.to(dtype)).float().cpu()

    def _evaluate(self, batch: dict[str, int], stage: str) -> dict[str, float]:
        simulator = self.trainer.datamodule.simulator
        returns = rollout(simulator, self.policy_scores, batch["envs"], batch["seed"])
        metrics = {
            f"{stage}/return": returns[self.hparams.eval_objective],
            f"{stage}/return_source": returns["source"],
            f"{stage}/return_target": returns["target"],
        }
        self.log_dict(metrics, batch_size=batch["envs"])
        return returns

    def validation_step(self, batch: dict[str, int], batch_index: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, int], batch_index: int) -> None:
        self._evaluate(batch, "test")
        simulator = self.trainer.datamodule.simulator
        for name in HEURISTICS:
            generator = torch.Generator().manual_seed(batch["seed"])
            score = functools.partial(heuristic_scores, heuristic=name, generator=generator)
            returns = rollout(simulator, score, batch["envs"], batch["seed"])
            self.log_dict(
                {
                    f"test/{name}_return_source": returns["source"],
                    f"test/{name}_return_target": returns["target"],
                },
                batch_size=batch["envs"],
            )
