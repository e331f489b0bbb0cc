"""AIQL's networks: the candidate scorer is permutation-equivariant and ignores padded slots,
the aggregate critic's output does not depend on the pool size, and the per-candidate critic is
a sum of per-pick terms (so the order of the picks does not matter)."""

import torch

from ada_modules.data.consolidation import (
    ACTION_FEATURES,
    CANDIDATE_FEATURES,
    STATE_FEATURES,
    action_summary,
    state_summary,
)
from ada_modules.offline_rl.networks import (
    AggregateCritic,
    CandidateScorer,
    PerCandidateCritic,
    ValueNetwork,
)

BATCH, POOL, PICK = 4, 30, 5


def _pool(seed: int = 0, pool: int = POOL):
    generator = torch.Generator().manual_seed(seed)
    candidates = torch.rand(BATCH, pool, CANDIDATE_FEATURES, generator=generator)
    mask = torch.ones(BATCH, pool, dtype=torch.bool)
    mask[1, pool - 7 :] = False
    mask[3, pool - 2 :] = False
    candidates = candidates * mask[..., None]
    state = torch.randn(BATCH, STATE_FEATURES, generator=generator)
    return candidates, mask, state


def test_scorer_is_permutation_equivariant():
    torch.manual_seed(0)
    scorer = CandidateScorer(CANDIDATE_FEATURES, STATE_FEATURES, hidden=16)
    candidates, mask, state = _pool()
    scores = scorer(candidates, mask, state)
    assert scores.shape == (BATCH, POOL)
    perm = torch.stack([torch.randperm(POOL) for _ in range(BATCH)])
    shuffled = scorer(
        candidates.gather(1, perm[..., None].expand_as(candidates)), mask.gather(1, perm), state
    )
    torch.testing.assert_close(shuffled, scores.gather(1, perm), atol=1e-5, rtol=1e-5)
    # Scores depend on the candidate: equal scores everywhere would pass trivially.
    assert scores[0].std() > 1e-4


def test_scorer_scores_depend_on_the_rest_of_the_pool():
    torch.manual_seed(0)
    scorer = CandidateScorer(CANDIDATE_FEATURES, STATE_FEATURES, hidden=16)
    candidates, mask, state = _pool()
    changed = candidates.clone()
    changed[:, 1:] = torch.rand_like(changed[:, 1:]) * mask[:, 1:, None]
    before, after = scorer(candidates, mask, state), scorer(changed, mask, state)
    assert not torch.allclose(before[:, 0], after[:, 0], atol=1e-5)  # the pooled context moved
    assert not torch.allclose(scorer(candidates, mask, state + 1.0)[:, 0], before[:, 0])


def test_scorer_ignores_padded_slots():
    torch.manual_seed(0)
    scorer = CandidateScorer(CANDIDATE_FEATURES, STATE_FEATURES, hidden=16)
    candidates, mask, state = _pool()
    scores = scorer(candidates, mask, state)
    generator = torch.Generator().manual_seed(1)
    garbage = 100 * torch.randn(BATCH, 12, CANDIDATE_FEATURES, generator=generator)
    padded = torch.cat([candidates, garbage], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(BATCH, 12, dtype=torch.bool)], dim=1)
    # Garbage also in the padded slots that were already there.
    padded[~padded_mask] = 50 * torch.randn(int((~padded_mask).sum()), CANDIDATE_FEATURES)
    padded_scores = scorer(padded, padded_mask, state)
    assert padded_scores.shape == (BATCH, POOL + 12)
    torch.testing.assert_close(padded_scores[:, :POOL][mask], scores[mask], atol=1e-5, rtol=1e-5)


def test_aggregate_critic_shape_and_independence_from_pool_size():
    torch.manual_seed(0)
    critic = AggregateCritic(STATE_FEATURES, ACTION_FEATURES, hidden=16)
    chosen = torch.arange(PICK).expand(BATCH, PICK)
    for pool in (10, 30, 200):
        candidates, mask, _ = _pool(seed=pool, pool=pool)
        state = state_summary(candidates, mask, torch.full((BATCH,), 0.25))
        q1, q2 = critic(state, action_summary(candidates, chosen))
        assert q1.shape == q2.shape == (BATCH,)
    assert not torch.allclose(q1, q2)  # two independent heads
    # The same pool padded to a wider slot count gives the same Q: the critic never sees N.
    candidates, mask, _ = _pool(seed=3)
    wide = torch.cat([candidates, torch.zeros(BATCH, 50, CANDIDATE_FEATURES)], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(BATCH, 50, dtype=torch.bool)], dim=1)
    progress = torch.full((BATCH,), 0.5)
    narrow_q = critic(state_summary(candidates, mask, progress), action_summary(candidates, chosen))
    wide_q = critic(state_summary(wide, wide_mask, progress), action_summary(wide, chosen))
    for narrow, wide_value in zip(narrow_q, wide_q, strict=True):
        torch.testing.assert_close(wide_value, narrow, atol=1e-5, rtol=1e-5)


def test_per_candidate_critic_is_a_sum_over_the_picks():
    torch.manual_seed(0)
    critic = PerCandidateCritic(CANDIDATE_FEATURES, STATE_FEATURES, hidden=16)
    candidates, _, state = _pool()
    chosen = torch.stack([torch.randperm(20)[:PICK] for _ in range(BATCH)])
    q1, q2 = critic(state, candidates, chosen)
    assert q1.shape == q2.shape == (BATCH,)
    for head, total in ((critic.q1, q1), (critic.q2, q2)):
        expected = torch.zeros(BATCH)
        for row in range(BATCH):
            for index in chosen[row].tolist():
                joint = torch.cat([candidates[row, index], state[row]])
                expected[row] += head(joint[None])[0, 0]
        torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
    reordered = critic(state, candidates, chosen.flip(1)[:, torch.tensor([2, 0, 4, 1, 3])])
    torch.testing.assert_close(reordered[0], q1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reordered[1], q2, atol=1e-5, rtol=1e-5)
    # Another subset is worth something else.
    other = critic(state, candidates, (chosen + 1) % POOL)[0]
    assert not torch.allclose(other, q1)


def test_value_network_shape():
    torch.manual_seed(0)
    value = ValueNetwork(STATE_FEATURES, hidden=8)
    assert value(torch.randn(BATCH, STATE_FEATURES)).shape == (BATCH,)
