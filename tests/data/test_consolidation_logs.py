"""Logged consolidation data: ``collect_logs`` (determinism, row count, legal and distinct picks,
the stored action statistics, reward noise and objectives), ``ConsolidationLogs`` validation of
malformed fields, and ``ConsolidationLogsDataModule`` (splits, seeds, loaders, bad input)."""

import dataclasses

import pytest
import torch

from ada_modules.data.consolidation import (
    ACTION_FEATURES,
    CANDIDATE_FEATURES,
    STATE_FEATURES,
    ConsolidationSimulator,
    action_summary,
)
from ada_modules.data.consolidation_logs import (
    ConsolidationLogs,
    ConsolidationLogsDataModule,
    collect_logs,
)
from ada_modules.errors import InputError

SIM = {"min_candidates": 20, "max_candidates": 40, "horizon": 4}
TENSOR_FIELDS = (
    "candidates",
    "mask",
    "chosen",
    "state",
    "action",
    "reward",
    "next_state",
    "done",
    "domain",
)


def _logs(episodes: int = 5, seed: int = 0, **kwargs) -> ConsolidationLogs:
    return collect_logs(ConsolidationSimulator(**SIM), episodes, seed=seed, **kwargs)


def _data(**kwargs) -> ConsolidationLogsDataModule:
    defaults = {
        **SIM,
        "source_episodes": 6,
        "target_episodes": 2,
        "val_episodes": 4,
        "test_episodes": 10,
        "seed": 0,
        "batch_size": 8,
    }
    return ConsolidationLogsDataModule(**{**defaults, **kwargs})


# ------------------------------------------------------------------ collect_logs


def test_collect_logs_is_deterministic_for_a_seed():
    first, second, other = _logs(seed=4), _logs(seed=4), _logs(seed=5)
    for name in TENSOR_FIELDS:
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert not torch.equal(first.reward, other.reward)
    assert not torch.equal(first.state, other.state)


def test_logs_hold_one_row_per_decision_epoch():
    logs = _logs(episodes=5)
    assert len(logs) == 5 * SIM["horizon"]
    assert logs.candidates.shape[1:] == (logs.mask.shape[1], CANDIDATE_FEATURES)
    assert logs.chosen.shape == (20, 8)
    assert logs.state.shape == logs.next_state.shape == (20, STATE_FEATURES)
    assert logs.action.shape == (20, ACTION_FEATURES)
    assert logs.reward.shape == logs.done.shape == logs.domain.shape == (20,)
    # Rows run epoch by epoch (all episodes of epoch 0 first); only the last epoch ends one.
    assert logs.done.tolist() == [0.0] * 15 + [1.0] * 5
    assert len(logs[3]) == len(TENSOR_FIELDS) and logs[3]["chosen"].shape == (8,)


def test_picks_are_distinct_and_point_at_valid_candidates():
    logs = _logs(episodes=6)
    assert logs.mask.gather(1, logs.chosen).all()
    ordered = logs.chosen.sort(1).values
    assert (ordered[:, 1:] != ordered[:, :-1]).all()
    # Valid candidates are packed to the front and zero beyond the mask.
    count = logs.mask.sum(1)
    assert torch.equal(logs.mask, torch.arange(logs.mask.shape[1]) < count[:, None])
    assert (logs.candidates[~logs.mask] == 0).all()
    assert int(count.max()) == logs.mask.shape[1] and (count >= SIM["min_candidates"]).all()


def test_stored_action_matches_the_stored_candidates_and_picks():
    logs = _logs(episodes=6)
    torch.testing.assert_close(logs.action, action_summary(logs.candidates, logs.chosen))
    # The state's episode progress follows the epoch; next_state is one epoch on.
    torch.testing.assert_close(logs.state[:, -1], torch.arange(4).repeat_interleave(6) / 4)
    torch.testing.assert_close(
        logs.next_state[:, -1], (torch.arange(4) + 1).repeat_interleave(6) / 4
    )
    # The next state of epoch t is the state of epoch t + 1 of the same episode.
    torch.testing.assert_close(logs.next_state[:-6], logs.state[6:])


def test_reward_noise_changes_the_rewards_only():
    clean, noisy = _logs(seed=1), _logs(seed=1, reward_noise=3.0)
    difference = noisy.reward - clean.reward
    assert difference.abs().min() > 0
    assert 1.0 < float(difference.std()) < 6.0
    for name in TENSOR_FIELDS:
        if name != "reward":
            assert torch.equal(getattr(clean, name), getattr(noisy, name)), name


def test_target_and_source_logs_differ_only_in_rewards():
    source, target = _logs(seed=2), _logs(seed=2, objective="target")
    assert source.objective == "source" and target.objective == "target"
    assert (source.domain == 0).all() and (target.domain == 1).all()
    for name in ("candidates", "mask", "chosen", "state", "action", "next_state"):
        assert torch.equal(getattr(source, name), getattr(target, name)), name
    # The target's travel and expiry costs are dearer: at least one zone is always visited.
    zones = source.action[:, 5]
    assert (source.reward - target.reward >= 4.0 * zones - 1e-4).all()
    assert (source.reward > target.reward).all()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"episodes": 0}, "episodes"),
        ({"objective": "both"}, "objective"),
        ({"behaviour": ("edd", "greedy_source")}, "behaviour"),
        ({"temperature": 0.0}, "temperature"),
        ({"reward_noise": -1.0}, "reward_noise"),
    ],
)
def test_collect_logs_rejects_bad_arguments(kwargs, name):
    arguments = {"episodes": 2, **kwargs}
    with pytest.raises(InputError, match=name):
        collect_logs(ConsolidationSimulator(**SIM), seed=0, **arguments)


# ------------------------------------------------------------------ validation


@pytest.fixture(scope="module")
def logs() -> ConsolidationLogs:
    return _logs(episodes=3)


def _nan_at(tensor: torch.Tensor, index: tuple) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[index] = float("nan")
    return tensor


def test_nan_rewards_are_rejected(logs):
    with pytest.raises(InputError, match=r"reward holds NaN.*row 5"):
        dataclasses.replace(logs, reward=_nan_at(logs.reward, (5,)))


def test_nan_candidates_are_rejected(logs):
    with pytest.raises(InputError, match=r"candidates holds NaN.*row 2"):
        dataclasses.replace(logs, candidates=_nan_at(logs.candidates, (2, 0, 3)))


def test_inf_next_state_is_rejected(logs):
    bad = logs.next_state.clone()
    bad[1, 4] = float("inf")
    with pytest.raises(InputError, match="next_state"):
        dataclasses.replace(logs, next_state=bad)


def test_more_picks_than_candidates_are_rejected(logs):
    mask = logs.mask.clone()
    mask[4] = False
    mask[4, :5] = True  # five candidates, eight picks
    with pytest.raises(InputError, match=r"chosen.*K=8.*row 4.*5 candidates"):
        dataclasses.replace(logs, mask=mask)


def test_a_pick_of_padding_is_rejected(logs):
    chosen = logs.chosen.clone()
    row = int(logs.mask.sum(1).argmin())
    chosen[row, 0] = int(logs.mask.sum(1)[row])  # the first padded slot of that row
    assert not logs.mask[row, chosen[row, 0]]
    with pytest.raises(InputError, match="chosen.*padded"):
        dataclasses.replace(logs, chosen=chosen)


def test_a_pick_outside_the_pool_is_rejected(logs):
    chosen = logs.chosen.clone()
    chosen[0, 0] = logs.mask.shape[1]
    with pytest.raises(InputError, match="chosen"):
        dataclasses.replace(logs, chosen=chosen)


@pytest.mark.parametrize(("name", "width"), [("candidates", 8), ("state", 23), ("action", 11)])
def test_another_feature_schema_is_rejected(logs, name, width):
    value = getattr(logs, name)
    if width < value.shape[-1]:
        changed = value[..., :width]
    else:
        changed = torch.cat([value, value[..., :1]], dim=-1)
    with pytest.raises(InputError, match=rf"{name} has {width} features.*schema"):
        dataclasses.replace(logs, **{name: changed})


@pytest.mark.parametrize("name", ["reward", "chosen", "mask", "next_state", "domain"])
def test_fields_with_another_row_count_are_rejected(logs, name):
    with pytest.raises(InputError, match=rf"{name} has {len(logs) - 1} rows"):
        dataclasses.replace(logs, **{name: getattr(logs, name)[:-1]})


def test_an_unknown_objective_is_rejected(logs):
    with pytest.raises(InputError, match="objective"):
        dataclasses.replace(logs, objective="both")


# ------------------------------------------------------------------ DataModule


@pytest.mark.parametrize(
    ("train_on", "rows"), [("source", 6 * 4), ("target", 2 * 4), ("pooled", 8 * 4)]
)
def test_training_split_sizes(train_on, rows):
    data = _data(train_on=train_on)
    data.setup("fit")
    assert len(data.datasets["train"]) == rows
    assert len(data.source_logs) == 24 and len(data.target_logs) == 8
    assert data.source_logs.objective == "source" and data.target_logs.objective == "target"


def test_no_target_logs_without_target_episodes():
    data = _data(target_episodes=0)
    data.setup("fit")
    assert data.target_logs is None and len(data.datasets["train"]) == 24


def test_seeds_give_identical_or_different_data():
    first, second, other = _data(seed=3), _data(seed=3), _data(seed=4)
    for data in (first, second, other):
        data.setup("fit")
    for name in ("candidates", "chosen", "reward"):
        assert torch.equal(getattr(first.source_logs, name), getattr(second.source_logs, name))
        assert torch.equal(getattr(first.target_logs, name), getattr(second.target_logs, name))
    assert not torch.equal(first.source_logs.reward, other.source_logs.reward)
    # The two logs of one DataModule are different episodes, not relabelled copies.
    assert not torch.equal(first.source_logs.state[:8], first.target_logs.state)
    assert list(first.test_dataloader()) == list(second.test_dataloader())
    assert list(first.test_dataloader()) != list(other.test_dataloader())


def test_evaluation_loaders_yield_episode_seeds():
    data = _data()
    data.setup("fit")
    val = list(data.val_dataloader())
    test = list(data.test_dataloader())
    assert len(val) == 1 and set(val[0]) == {"seed", "envs"} and val[0]["envs"] == 4
    assert all(set(item) == {"seed", "envs"} for item in test)
    assert [item["envs"] for item in test] == [4, 4, 2]  # test_episodes=10 in batches of 4
    seeds = [int(item["seed"]) for item in test] + [int(val[0]["seed"])]
    assert len(set(seeds)) == len(seeds)
    assert list(data.predict_dataloader()) == test


def test_episode_seeds_end_at_their_length():
    data = _data()
    data.setup("fit")
    seeds = data.datasets["test"]
    assert len(seeds) == 3 and seeds[2]["envs"] == 2
    # A map-style dataset raises IndexError past its end (plain iteration relies on it).
    with pytest.raises(IndexError):
        seeds[3]


def test_evaluation_loaders_need_setup():
    with pytest.raises(RuntimeError, match="setup"):
        _data().val_dataloader()


@pytest.mark.parametrize("train_on", ["source", "pooled"])
def test_training_batches_have_the_fields_and_shapes(train_on):
    data = _data(train_on=train_on, batch_size=8)
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) == {"source": 3, "pooled": 4}[train_on]
    for batch in batches:
        assert set(batch) == set(TENSOR_FIELDS)
        rows, width = batch["mask"].shape
        assert rows == 8
        assert batch["candidates"].shape == (rows, width, CANDIDATE_FEATURES)
        assert batch["chosen"].shape == (rows, 8) and batch["chosen"].dtype == torch.long
        assert batch["state"].shape == batch["next_state"].shape == (rows, STATE_FEATURES)
        assert batch["action"].shape == (rows, ACTION_FEATURES)
        assert batch["reward"].shape == batch["done"].shape == batch["domain"].shape == (rows,)
        assert batch["mask"].dtype == torch.bool
        assert batch["mask"].gather(1, batch["chosen"]).all()
        torch.testing.assert_close(
            batch["action"], action_summary(batch["candidates"], batch["chosen"])
        )
    domains = torch.cat([batch["domain"] for batch in batches])
    assert int(domains.sum()) == (8 if train_on == "pooled" else 0)


def test_pooled_training_needs_target_episodes():
    with pytest.raises(InputError, match="target_episodes"):
        _data(train_on="pooled", target_episodes=0)
    with pytest.raises(InputError, match="target_episodes"):
        _data(train_on="target", target_episodes=0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"source_episodes": 0}, "source_episodes"),
        ({"target_episodes": -1}, "target_episodes"),
        ({"val_episodes": True}, "val_episodes"),
        ({"train_on": "both"}, "train_on"),
        ({"pick": 30}, "pick"),
    ],
)
def test_datamodule_rejects_bad_arguments(kwargs, name):
    with pytest.raises(InputError, match=name):
        _data(**kwargs)
