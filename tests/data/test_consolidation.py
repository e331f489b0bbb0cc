"""The warehouse-consolidation simulator: seeded determinism, backlog invariants (pool size,
shipped and expired orders, ageing), rewards recomputed from the state before a wave, the
candidate features and the aggregate state / action summaries (widths, permutation and padding
invariance), ``select_top_k``, the heuristics, and bad input."""

import math

import pytest
import torch

from ada_modules.data.consolidation import (
    ACTION_FEATURES,
    CANDIDATE_FEATURES,
    HEURISTICS,
    SOURCE,
    STATE_FEATURES,
    TARGET,
    ConsolidationSimulator,
    action_summary,
    candidate_features,
    heuristic_scores,
    select_top_k,
    state_summary,
)
from ada_modules.errors import InputError

SMALL = {"min_candidates": 20, "max_candidates": 40, "horizon": 6}


def _random_picks(state, pick: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return select_top_k(heuristic_scores(state, "random", generator), state.mask, pick)


def _episode(sim: ConsolidationSimulator, seed: int, envs: int = 8):
    """States and rewards of one episode under a seeded random policy."""
    state = sim.reset(envs, seed=seed)
    states, rewards = [state], []
    while not state.done:
        state, reward = sim.step(state, _random_picks(state, sim.pick, seed + state.epoch))
        states.append(state)
        rewards.append(reward)
    return states, rewards


FIELDS = ("volume", "weight", "fill", "slack", "zone", "mask")


# ------------------------------------------------------------------ determinism


def test_equal_seeds_give_equal_episodes():
    first_states, first_rewards = _episode(ConsolidationSimulator(**SMALL), seed=3)
    second_states, second_rewards = _episode(ConsolidationSimulator(**SMALL), seed=3)
    assert len(first_states) == SMALL["horizon"] + 1
    for a, b in zip(first_states, second_states, strict=True):
        for name in (*FIELDS, "arrival_rate"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.epoch == b.epoch
    for a, b in zip(first_rewards, second_rewards, strict=True):
        for name in ("source", "target", "units", "zones", "expired"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_different_seeds_give_different_episodes():
    first_states, first_rewards = _episode(ConsolidationSimulator(**SMALL), seed=3)
    second_states, second_rewards = _episode(ConsolidationSimulator(**SMALL), seed=4)
    assert not torch.equal(first_states[0].volume, second_states[0].volume)
    assert not torch.equal(first_states[-1].weight, second_states[-1].weight)
    assert not torch.equal(
        torch.stack([r.source for r in first_rewards]),
        torch.stack([r.source for r in second_rewards]),
    )


def test_reset_reseeds_the_same_simulator():
    sim = ConsolidationSimulator(**SMALL)
    first, _ = _episode(sim, seed=11)
    second, _ = _episode(sim, seed=11)
    assert torch.equal(first[-1].weight, second[-1].weight)
    assert torch.equal(first[-1].mask, second[-1].mask)


# ------------------------------------------------------------------ invariants


def test_pool_size_stays_within_bounds_every_epoch():
    sim = ConsolidationSimulator(min_candidates=20, max_candidates=40, horizon=12)
    states, _ = _episode(sim, seed=0, envs=32)
    counts = torch.stack([state.num_candidates for state in states])
    assert counts.min() >= 20 and counts.max() <= 40
    assert counts.min() < 40  # the bounds are not trivially met by a full backlog
    for state in states:
        assert state.mask.shape == (32, 40)


def test_a_wave_ships_ages_and_expires_orders_and_rewards_it():
    sim = ConsolidationSimulator(min_candidates=20, max_candidates=40, horizon=10, grace=1)
    state = sim.reset(16, seed=5)
    total_expired = 0
    while not state.done:
        chosen = _random_picks(state, sim.pick, 100 + state.epoch)
        next_state, reward = sim.step(state, chosen)
        assert next_state.epoch == state.epoch + 1
        for env in range(16):
            picked = set(chosen[env].tolist())
            slots = state.mask[env].nonzero()[:, 0].tolist()
            # Independent bookkeeping from the state before the wave.
            units = sum(float(state.volume[env, i] * state.fill[env, i]) for i in picked)
            zones = len({int(state.zone[env, i]) for i in picked})
            late = [i for i in slots if i not in picked and state.slack[env, i] - 1 < -sim.grace]
            staying = [i for i in slots if i not in picked and i not in late]
            expiring = late
            total_expired += len(expiring)
            for objective, logged in ((SOURCE, reward.source), (TARGET, reward.target)):
                expected = (
                    units - objective.travel_cost * zones - objective.expiry_cost * len(expiring)
                )
                assert math.isclose(float(logged[env]), expected, rel_tol=1e-5, abs_tol=1e-4)
            assert math.isclose(float(reward.units[env]), units, rel_tol=1e-5)
            assert reward.zones[env] == zones and reward.expired[env] == len(expiring)
            # Orders that stay keep their slot and their features, one epoch closer to due.
            for i in staying:
                assert next_state.mask[env, i]
                assert next_state.slack[env, i] == state.slack[env, i] - 1
                assert next_state.weight[env, i] == state.weight[env, i]
                assert next_state.zone[env, i] == state.zone[env, i]
            # Shipped and expired orders are gone (weights are continuous: they identify orders;
            # a freed slot may hold a new arrival, but not the same order).
            remaining = set(next_state.weight[env][next_state.mask[env]].tolist())
            for i in (*picked, *expiring):
                assert float(state.weight[env, i]) not in remaining
        # Nothing left in the backlog is later than the grace allows.
        assert (next_state.slack[next_state.mask] >= -sim.grace).all()
        state = next_state
    assert total_expired > 0  # the expiry branch was exercised


def test_rewards_of_the_two_objectives_differ_by_the_costs():
    sim = ConsolidationSimulator(**SMALL)
    _, rewards = _episode(sim, seed=2, envs=8)
    for reward in rewards:
        gap = reward.source - reward.target
        expected = (TARGET.travel_cost - SOURCE.travel_cost) * reward.zones + (
            TARGET.expiry_cost - SOURCE.expiry_cost
        ) * reward.expired
        torch.testing.assert_close(gap, expected)
        assert (reward.zones >= 1).all() and (reward.zones <= 4).all()


# ------------------------------------------------------------------ features and summaries


def test_candidate_features_are_zero_in_empty_slots():
    sim = ConsolidationSimulator(**SMALL)
    state = sim.reset(8, seed=0)
    features = candidate_features(state)
    assert features.shape == (8, 40, CANDIDATE_FEATURES)
    assert (~state.mask).any()
    assert (features[~state.mask] == 0).all()
    # Valid slots carry a one-hot zone and the scaled volume.
    valid = features[state.mask]
    torch.testing.assert_close(valid[:, 5:].sum(1), torch.ones(valid.shape[0]))
    torch.testing.assert_close(valid[:, 0], state.volume[state.mask] / 10)


def _pool(seed: int = 0, envs: int = 6):
    sim = ConsolidationSimulator(**SMALL)
    state = sim.reset(envs, seed=seed)
    chosen = _random_picks(state, sim.pick, seed)
    return candidate_features(state), state.mask, chosen


def test_summary_widths_match_the_constants():
    features, mask, chosen = _pool()
    assert state_summary(features, mask, torch.full((6,), 0.5)).shape == (6, STATE_FEATURES)
    assert action_summary(features, chosen).shape == (6, ACTION_FEATURES)
    several = torch.stack([chosen, chosen.flip(1)], dim=1)  # [B, M=2, K]
    assert action_summary(features, several).shape == (6, 2, ACTION_FEATURES)


def test_summaries_are_invariant_to_permuting_candidate_slots():
    features, mask, chosen = _pool(seed=1)
    progress = torch.rand(6)
    generator = torch.Generator().manual_seed(0)
    perm = torch.stack([torch.randperm(40, generator=generator) for _ in range(6)])
    inverse = perm.argsort(1)  # new position of each old slot
    shuffled = features.gather(1, perm[..., None].expand_as(features))
    shuffled_mask = mask.gather(1, perm)
    torch.testing.assert_close(
        state_summary(shuffled, shuffled_mask, progress),
        state_summary(features, mask, progress),
        atol=1e-5,
        rtol=1e-5,
    )
    moved = inverse.gather(1, chosen)
    width = (-1, -1, CANDIDATE_FEATURES)
    assert torch.equal(
        shuffled.gather(1, moved[..., None].expand(*width)),
        features.gather(1, chosen[..., None].expand(*width)),
    )
    order = torch.randperm(chosen.shape[1], generator=generator)
    torch.testing.assert_close(
        action_summary(shuffled, moved[:, order]),
        action_summary(features, chosen),
        atol=1e-5,
        rtol=1e-5,
    )
    # A different subset gives a different summary: the check is not vacuous.
    other = select_top_k(-features[..., 0], mask, chosen.shape[1])
    assert not torch.allclose(action_summary(features, other), action_summary(features, chosen))


def test_state_summary_does_not_depend_on_padding_width():
    features, mask, _ = _pool(seed=2)
    progress = torch.rand(6)
    padded = torch.cat([features, torch.zeros(6, 25, CANDIDATE_FEATURES)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(6, 25, dtype=torch.bool)], dim=1)
    torch.testing.assert_close(
        state_summary(padded, padded_mask, progress), state_summary(features, mask, progress)
    )
    # Packing the valid candidates to the front and cutting the padding changes nothing either.
    order = (~mask).float().argsort(dim=1, stable=True)
    width = int(mask.sum(1).max())
    packed = features.gather(1, order[..., None].expand_as(features))[:, :width]
    torch.testing.assert_close(
        state_summary(packed, mask.gather(1, order)[:, :width], progress),
        state_summary(features, mask, progress),
        atol=1e-5,
        rtol=1e-5,
    )


def test_state_summary_counts_the_pool():
    features, mask, _ = _pool(seed=3)
    summary = state_summary(features, mask, torch.zeros(6))
    count = mask.sum(1).float()
    torch.testing.assert_close(summary[:, 0], torch.log(count) / 7)
    torch.testing.assert_close(summary[:, 1], count / 1000)


# ------------------------------------------------------------------ select_top_k


def test_select_top_k_picks_the_best_valid_scores_best_first():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 30, generator=generator)
    mask = torch.rand(5, 30, generator=generator) < 0.5
    mask[:, :6] = True
    scores[~mask] += 100.0  # invalid slots score best: they must still be skipped
    chosen = select_top_k(scores, mask, 4)
    assert chosen.shape == (5, 4)
    for row in range(5):
        valid = [i for i in range(30) if mask[row, i]]
        expected = sorted(valid, key=lambda i: -float(scores[row, i]))[:4]
        assert chosen[row].tolist() == expected


def test_select_top_k_names_k_when_a_row_is_short():
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 4:] = False
    with pytest.raises(InputError, match=r"k=5"):
        select_top_k(torch.randn(3, 10), mask, 5)
    assert select_top_k(torch.randn(3, 10), mask, 4).shape == (3, 4)


# ------------------------------------------------------------------ heuristics


@pytest.mark.parametrize("name", HEURISTICS)
def test_heuristic_scores_are_finite_on_the_pool(name):
    sim = ConsolidationSimulator(**SMALL)
    state = sim.reset(8, seed=0)
    scores = heuristic_scores(state, name, torch.Generator().manual_seed(0))
    assert scores.shape == (8, 40)
    assert torch.isfinite(scores[state.mask]).all()
    chosen = select_top_k(scores, state.mask, sim.pick)
    sim.step(state, chosen)  # the top picks form a legal wave


def _mean_source_return(heuristic: str) -> float:
    sim = ConsolidationSimulator(min_candidates=20, max_candidates=64, horizon=8)
    state = sim.reset(32, seed=9)
    generator = torch.Generator().manual_seed(9)
    total = 0.0
    while not state.done:
        scores = heuristic_scores(state, heuristic, generator)
        state, reward = sim.step(state, select_top_k(scores, state.mask, sim.pick))
        total += float(reward.source.mean())
    return total / sim.horizon


def test_greedy_source_beats_random_on_the_source_objective():
    assert _mean_source_return("greedy_source") > _mean_source_return("random") + 1.0


def test_unknown_heuristic_is_rejected_by_name():
    state = ConsolidationSimulator(**SMALL).reset(2, seed=0)
    with pytest.raises(InputError, match="heuristic.*'fifo'"):
        heuristic_scores(state, "fifo")


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"pick": 60, "min_candidates": 50}, "pick"),
        ({"horizon": -1}, "horizon"),
        ({"grace": -2}, "grace"),
        ({"min_candidates": True}, "min_candidates"),
        ({"pick": 2.0}, "pick"),
        ({"max_slack": False}, "max_slack"),
        ({"min_candidates": 30, "max_candidates": 20}, "max_candidates"),
    ],
)
def test_bad_simulator_arguments_are_named(kwargs, name):
    with pytest.raises(InputError, match=name):
        ConsolidationSimulator(**kwargs)


def test_bad_waves_are_rejected():
    sim = ConsolidationSimulator(**SMALL)
    state = sim.reset(2, seed=0)
    good = select_top_k(heuristic_scores(state, "volume"), state.mask, sim.pick)
    with pytest.raises(InputError, match="shape"):
        sim.step(state, good[:, :-1])
    with pytest.raises(InputError, match="shape"):
        sim.step(state, good[:1])
    with pytest.raises(InputError, match="long"):
        sim.step(state, good.float())
    repeated = good.clone()
    repeated[0, 1] = repeated[0, 0]
    with pytest.raises(InputError, match="same slot twice"):
        sim.step(state, repeated)
    empty = good.clone()
    empty[1, 0] = int((~state.mask[1]).nonzero()[0, 0])
    with pytest.raises(InputError, match="no open order"):
        sim.step(state, empty)
    negative = good.clone()
    negative[0, 0] = -1
    with pytest.raises(InputError, match="outside"):
        sim.step(state, negative)
    sim.step(state, good)  # the rejected waves left the episode playable


def test_step_after_the_episode_ends_raises():
    sim = ConsolidationSimulator(min_candidates=20, max_candidates=40, horizon=1)
    state = sim.reset(2, seed=0)
    chosen = select_top_k(heuristic_scores(state, "edd"), state.mask, sim.pick)
    state, _ = sim.step(state, chosen)
    assert state.done
    with pytest.raises(RuntimeError, match="over"):
        sim.step(state, chosen)


def test_reset_rejects_a_bad_number_of_envs():
    with pytest.raises(InputError, match="num_envs"):
        ConsolidationSimulator(**SMALL).reset(0, seed=0)
