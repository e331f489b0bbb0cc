"""``CandidateSelectionModule`` (BC / IQL / AIQL / A²IQL): every critic and adaptation fits and
tests with finite logged returns, runs repeat on a fixed seed, Polyak updates of the target
critic, the behaviour-cloning loss against an independent Plackett–Luce likelihood, the target
reward predictor fitted at fit start, the reward scale, sampled negatives, and bad input."""

import copy
import math

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from ada_modules.data.consolidation import HEURISTICS, heuristic_scores
from ada_modules.data.consolidation_logs import ConsolidationLogsDataModule
from ada_modules.errors import InputError
from ada_modules.models.candidate_selection import CandidateSelectionModule, rollout
from ada_modules.offline_rl.reward_predictors import BayesianLinearRewardPredictor


def _data(**kwargs) -> ConsolidationLogsDataModule:
    defaults = {
        "min_candidates": 20,
        "max_candidates": 40,
        "horizon": 4,
        "source_episodes": 8,
        "target_episodes": 2,
        "val_episodes": 4,
        "test_episodes": 4,
        "seed": 0,
        "batch_size": 16,
    }
    return ConsolidationLogsDataModule(**{**defaults, **kwargs})


def _trainer(max_steps: int = 5) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )


def _fit(module, data=None, max_steps: int = 5):
    data = _data() if data is None else data
    trainer = _trainer(max_steps)
    trainer.fit(module, datamodule=data)
    return trainer, data


def _batch(data=None) -> dict[str, torch.Tensor]:
    data = _data() if data is None else data
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _quiet(module) -> None:
    """Let ``training_step`` run without a Trainer (its logging is a no-op here)."""
    module.log = lambda *args, **kwargs: None
    module.log_dict = lambda *args, **kwargs: None


# ------------------------------------------------------------------ every variant fits and tests


@pytest.mark.parametrize(
    ("critic", "adaptation", "train_on"),
    [
        ("none", "none", "source"),
        ("per_candidate", "none", "source"),
        ("aggregate", "none", "source"),
        ("aggregate", "bonus", "source"),
        ("per_candidate", "bonus", "source"),
        ("aggregate", "relabel", "pooled"),
    ],
)
def test_each_variant_fits_and_tests(critic, adaptation, train_on):
    seed_everything(0, verbose=False)
    module = CandidateSelectionModule(critic=critic, adaptation=adaptation, hidden=16)
    before = copy.deepcopy(module.actor.state_dict())
    trainer, data = _fit(module, _data(train_on=train_on))
    assert trainer.global_step == 5
    changed = [
        not torch.equal(before[name], value) for name, value in module.actor.state_dict().items()
    ]
    assert any(changed)  # the actor trained
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    expected = {"test/return", "test/return_source", "test/return_target"}
    expected |= {f"test/{name}_return_source" for name in HEURISTICS}
    expected |= {f"test/{name}_return_target" for name in HEURISTICS}
    assert expected <= set(metrics)
    assert all(math.isfinite(metrics[name]) for name in expected)
    assert metrics["test/return"] == metrics["test/return_source"]
    # The target objective costs more: every policy earns less under it.
    assert metrics["test/return_target"] < metrics["test/return_source"]


def test_heuristic_returns_match_an_independent_rollout():
    seed_everything(0, verbose=False)
    module = CandidateSelectionModule(critic="none", hidden=16, eval_objective="target")
    trainer, data = _fit(module, max_steps=1)
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    assert metrics["test/return"] == metrics["test/return_target"]
    item = data.datasets["test"][0]  # one batch of test episodes
    edd = rollout(
        data.simulator, lambda state: heuristic_scores(state, "edd"), item["envs"], item["seed"]
    )
    assert metrics["test/edd_return_source"] == pytest.approx(edd["source"], rel=1e-5)
    assert metrics["test/edd_return_target"] == pytest.approx(edd["target"], rel=1e-5)
    policy = rollout(data.simulator, module.policy_scores, item["envs"], item["seed"])
    assert metrics["test/return_source"] == pytest.approx(policy["source"], rel=1e-5)


def _fit_and_test_once(seed: int = 7) -> dict[str, float]:
    seed_everything(seed, verbose=False)
    module = CandidateSelectionModule(critic="aggregate", adaptation="bonus", hidden=16)
    trainer, data = _fit(module, _data(seed=3))
    return trainer.test(module, datamodule=data, verbose=False)[0]


def test_a_fixed_seed_gives_identical_test_metrics():
    first, second = _fit_and_test_once(), _fit_and_test_once()
    assert first == second
    # Another seed (another initialisation) gives another policy on the same test episodes.
    other = _fit_and_test_once(seed=8)
    assert other["test/return_source"] != first["test/return_source"]
    assert other["test/edd_return_source"] == first["test/edd_return_source"]


def test_training_with_sampled_negatives_runs():
    seed_everything(0, verbose=False)
    module = CandidateSelectionModule(critic="aggregate", num_negatives=4, hidden=16)
    trainer, _ = _fit(module, max_steps=3)
    assert trainer.global_step == 3
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_sampled_negatives_change_the_actor_likelihood():
    torch.manual_seed(0)
    batch = _batch()
    losses = []
    for negatives in (None, 4):
        torch.manual_seed(0)
        module = CandidateSelectionModule(critic="none", num_negatives=negatives, hidden=16)
        _quiet(module)
        losses.append(float(module.training_step(batch, 0).detach()))
    # Fewer candidates in the normaliser: a larger likelihood, a smaller loss.
    assert losses[1] < losses[0]


# ------------------------------------------------------------------ target critic


def test_target_critic_follows_the_online_critic_by_polyak_averaging():
    seed_everything(0, verbose=False)
    module = CandidateSelectionModule(critic="aggregate", hidden=16, target_update=0.25)
    start = copy.deepcopy(module.critic.state_dict())
    for name, value in module.target_critic.state_dict().items():
        assert torch.equal(value, start[name])
    _fit(module, max_steps=1)
    online = module.critic.state_dict()
    target = module.target_critic.state_dict()
    moved = False
    for name, value in target.items():
        expected = start[name] + 0.25 * (online[name] - start[name])
        torch.testing.assert_close(value, expected)  # one update, after the one step
        moved |= not torch.equal(online[name], start[name])
    assert moved


def test_target_critic_moves_only_in_the_polyak_update():
    torch.manual_seed(0)
    module = CandidateSelectionModule(critic="per_candidate", hidden=16, target_update=0.1)
    _quiet(module)
    # The optimiser never touches the target critic.
    optimised = {
        id(p) for group in module.configure_optimizers().param_groups for p in group["params"]
    }
    assert not optimised & {id(p) for p in module.target_critic.parameters()}
    assert all(not p.requires_grad for p in module.target_critic.parameters())
    with torch.no_grad():
        for parameter in module.critic.parameters():
            parameter.add_(torch.randn_like(parameter))
    before = copy.deepcopy(module.target_critic.state_dict())
    online = copy.deepcopy(module.critic.state_dict())
    module.training_step(_batch(), 0).backward()
    for name, value in module.target_critic.state_dict().items():
        assert torch.equal(value, before[name])  # a training step alone leaves it
    module.on_train_batch_end(None, None, 0)
    for name, value in module.target_critic.state_dict().items():
        torch.testing.assert_close(value, before[name] + 0.1 * (online[name] - before[name]))


# ------------------------------------------------------------------ behaviour cloning


def _plackett_luce(scores, mask, chosen) -> torch.Tensor:
    """Log-probability of the ordered picks, written out row by row."""
    values = []
    for row in range(scores.shape[0]):
        remaining = [i for i in range(scores.shape[1]) if mask[row, i]]
        total = scores.new_zeros(())
        for index in chosen[row].tolist():
            total = total + scores[row, index] - torch.logsumexp(scores[row, remaining], 0)
            remaining.remove(index)
        values.append(total)
    return torch.stack(values)


def test_behaviour_cloning_loss_is_the_plackett_luce_likelihood():
    torch.manual_seed(0)
    module = CandidateSelectionModule(critic="none", hidden=16)
    _quiet(module)
    with torch.no_grad():  # spread the scores so that the picks' order and the pool matter
        module.actor.head[-1].weight.mul_(50.0)
    batch = _batch()
    loss = module.training_step(batch, 0)
    with torch.no_grad():
        scores = module.actor(batch["candidates"], batch["mask"], batch["state"])
    expected = -_plackett_luce(scores, batch["mask"], batch["chosen"]).mean()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-4, rtol=1e-5)
    # The order of the picks matters to the likelihood (and so to the loss).
    flipped = {**batch, "chosen": batch["chosen"].flip(1)}
    flipped_loss = module.training_step(flipped, 0).detach()
    expected_flipped = -_plackett_luce(scores, batch["mask"], flipped["chosen"]).mean()
    torch.testing.assert_close(flipped_loss, expected_flipped, atol=1e-4, rtol=1e-5)
    assert abs(float(flipped_loss - loss)) > 1e-3
    # The normaliser runs over the valid candidates only, not the padded slots.
    everything = torch.ones_like(batch["mask"])
    assert not torch.isclose(-_plackett_luce(scores, everything, batch["chosen"]).mean(), loss)


# ------------------------------------------------------------------ adaptation and reward scale


def test_bonus_fits_the_reward_predictor_on_the_target_logs():
    seed_everything(0, verbose=False)
    module = CandidateSelectionModule(critic="aggregate", adaptation="bonus", hidden=16)
    assert not module.reward_predictor.is_fitted
    _, data = _fit(module, max_steps=1)
    assert module.reward_predictor.is_fitted
    logs = data.target_logs
    features = torch.cat([logs.state, logs.action], dim=1)
    mean, std = module.reward_predictor.predict(features)
    assert mean.shape == std.shape == (len(logs),) and (std > 0).all()
    reference = BayesianLinearRewardPredictor().fit(features, logs.reward)
    torch.testing.assert_close(mean, reference.predict(features)[0])
    source = data.source_logs
    on_source = BayesianLinearRewardPredictor().fit(
        torch.cat([source.state, source.action], dim=1), source.reward
    )
    assert not torch.allclose(mean, on_source.predict(features)[0])


@pytest.mark.parametrize("train_on", ["source", "pooled"])
def test_default_reward_scale_is_one_over_the_training_reward_std(train_on):
    seed_everything(0, verbose=False)
    module = CandidateSelectionModule(critic="aggregate", hidden=16)
    assert float(module.reward_multiplier) == 1.0
    _, data = _fit(module, _data(train_on=train_on), max_steps=1)
    rewards = data.source_logs.reward
    if train_on == "pooled":
        rewards = torch.cat([rewards, data.target_logs.reward])
    torch.testing.assert_close(module.reward_multiplier, 1.0 / rewards.std())
    assert float(module.reward_multiplier) < 0.5  # rewards spread over several units


def test_a_given_reward_scale_is_kept():
    seed_everything(0, verbose=False)
    module = CandidateSelectionModule(critic="aggregate", hidden=16, reward_scale=2.5)
    _fit(module, max_steps=1)
    assert float(module.reward_multiplier) == 2.5


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"critic": "foo"}, "critic"),
        ({"adaptation": "bonus", "critic": "none"}, "adaptation"),
        ({"adaptation": "relabel", "critic": "none"}, "adaptation"),
        ({"adaptation": "finetune"}, "adaptation"),
        ({"expectile": 1.0}, "expectile"),
        ({"expectile": 0.0}, "expectile"),
        ({"temperature": -1}, "temperature"),
        ({"num_negatives": 0}, "num_negatives"),
        ({"num_negatives": True}, "num_negatives"),
        ({"hidden": 0}, "hidden"),
        ({"reward_scale": 0}, "reward_scale"),
        ({"max_weight": 0.0}, "max_weight"),
        ({"discount": 1.5}, "discount"),
        ({"predictor": "gp"}, "predictor"),
        ({"max_weight": math.inf}, "max_weight"),
        ({"reward_scale": math.inf}, "reward_scale"),
        ({"expectile": "0.7"}, "expectile"),
        ({"discount": math.nan}, "discount"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(InputError, match=name):
        CandidateSelectionModule(**kwargs)


def test_tests_under_bf16_true_precision():
    seed_everything(0)
    module = CandidateSelectionModule(critic="aggregate", hidden=16)
    trainer = Trainer(
        max_steps=2,
        precision="bf16-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        limit_val_batches=0,
    )
    data = _data()
    trainer.fit(module, datamodule=data)
    (metrics,) = trainer.test(module, datamodule=data, verbose=False)
    assert math.isfinite(metrics["test/return"])


def test_bonus_without_target_logs_fails_when_fit_starts():
    module = CandidateSelectionModule(critic="aggregate", adaptation="bonus", hidden=16)
    with pytest.raises(InputError, match="target_episodes"):
        _fit(module, _data(target_episodes=0), max_steps=1)
