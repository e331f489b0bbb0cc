"""The baseline policies: plan shape, causality, diagonals, density targets, padding, fallback."""

import pytest
import torch

from ada_modules.attention import (
    AdaCalPolicy,
    AShapePolicy,
    BlockTopKPolicy,
    DensePolicy,
    FlexPrefillPolicy,
    SparsePrefillPolicy,
    VerticalSlashPolicy,
    causal_block_mask,
    diagonal_block_mask,
    plan_density,
)
from ada_modules.attention.block_masks import fit_budget
from ada_modules.errors import InputError

BLOCK = 32
POLICIES = {
    "dense": lambda m=0: DensePolicy(block_size=BLOCK, min_sparse_length=m),
    "a_shape": lambda m=0: AShapePolicy(block_size=BLOCK, min_sparse_length=m),
    "vertical_slash": lambda m=0: VerticalSlashPolicy(
        block_size=BLOCK, num_vertical=2, num_slash=2, min_sparse_length=m
    ),
    "flexprefill": lambda m=0: FlexPrefillPolicy(block_size=BLOCK, min_sparse_length=m),
    "block_topk": lambda m=0: BlockTopKPolicy(block_size=BLOCK, top_k=3, min_sparse_length=m),
    "adacal": lambda m=0: AdaCalPolicy(block_size=BLOCK, min_sparse_length=m),
}


@pytest.fixture(params=sorted(POLICIES))
def make_policy(request):
    return POLICIES[request.param]


@pytest.fixture
def policy(make_policy):
    return make_policy()


@pytest.mark.parametrize(("q_len", "k_len"), [(320, 320), (200, 456)])
def test_plan_is_causal_keeps_diagonals_and_has_the_contract_shape(policy, seed, q_len, k_len):
    assert isinstance(policy, SparsePrefillPolicy)
    query, key = torch.randn(2, 4, q_len, 8), torch.randn(2, 2, k_len, 8)
    plan = policy.plan(query, key, key_padding_mask=None, scaling=0.35)
    causal = causal_block_mask(2, 4, q_len, k_len, BLOCK)
    assert plan.block_mask.dtype == torch.bool and plan.block_mask.shape == causal.shape
    assert plan.block_size == BLOCK
    assert not (plan.block_mask & ~causal).any()
    assert (plan.block_mask | ~diagonal_block_mask(q_len, k_len, BLOCK)).all()
    assert 0 < plan_density(plan.block_mask, q_len, k_len, BLOCK) <= 1
    for name, value in plan.stats.items():
        assert value.shape[:2] == (2, 4), name


def test_left_padding_leaves_the_unpadded_element_unchanged(policy, seed):
    query, key = torch.randn(1, 4, 256, 8), torch.randn(1, 2, 256, 8)
    pad = 2 * BLOCK
    other_q = torch.cat([torch.zeros(1, 4, pad, 8), torch.randn(1, 4, 256 - pad, 8)], 2)
    other_k = torch.cat([torch.zeros(1, 2, pad, 8), torch.randn(1, 2, 256 - pad, 8)], 2)
    mask = torch.ones(2, 256, dtype=torch.bool)
    mask[1, :pad] = False
    alone = policy.plan(query, key, key_padding_mask=None, scaling=0.35)
    batched = policy.plan(
        torch.cat([query, other_q]), torch.cat([key, other_k]), key_padding_mask=mask, scaling=0.35
    )
    assert torch.equal(batched.block_mask[:1], alone.block_mask)
    assert batched.regime is None or batched.regime[0] == alone.regime[0]


def test_short_prompts_and_decode_steps_take_the_dense_plan(make_policy):
    policy = make_policy(128)
    assert policy.min_sparse_length == 128
    for q_len, k_len in [(100, 100), (1, 300)]:
        query, key = torch.randn(1, 2, q_len, 8), torch.randn(1, 2, k_len, 8)
        plan = policy.plan(query, key, key_padding_mask=None, scaling=0.35)
        assert torch.equal(plan.block_mask, causal_block_mask(1, 2, q_len, k_len, BLOCK))
        assert plan.probe_flops == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda t: AShapePolicy(block_size=BLOCK, target_density=t, min_sparse_length=0),
        lambda t: VerticalSlashPolicy(block_size=BLOCK, target_density=t, min_sparse_length=0),
        lambda t: BlockTopKPolicy(block_size=BLOCK, target_density=t, min_sparse_length=0),
    ],
    ids=["a_shape", "vertical_slash", "block_topk"],
)
@pytest.mark.parametrize("target", [0.3, 0.6])
def test_target_density_is_met_within_one_block_per_row(make, target, seed):
    length = 512
    query, key = torch.randn(1, 3, length, 8), torch.randn(1, 3, length, 8)
    plan = make(target).plan(query, key, key_padding_mask=None, scaling=0.35)
    causal = causal_block_mask(1, 1, length, length, BLOCK)
    rows, causal_blocks = causal.shape[-2], causal.sum().item()
    for head in range(3):
        density = plan_density(plan.block_mask[:, head : head + 1], length, length, BLOCK)
        assert abs(density - target) * causal_blocks <= rows, (head, density)


def test_a_shape_keeps_sink_and_local_window_after_left_padding():
    query = torch.randn(1, 1, 256, 8)
    mask = torch.ones(1, 256, dtype=torch.bool)
    mask[:, :BLOCK] = False
    policy = AShapePolicy(block_size=BLOCK, sink_blocks=1, local_blocks=2, min_sparse_length=0)
    plan = policy.plan(query, query, key_padding_mask=mask, scaling=0.35)
    assert plan.block_mask[0, 0, -1].int().tolist() == [0, 1, 0, 0, 0, 0, 1, 1]
    assert plan.probe_flops == 0


def test_flexprefill_tau_zero_makes_every_head_vertical_slash(seed):
    query, key = torch.randn(1, 4, 256, 8), torch.randn(1, 4, 256, 8)
    plan = FlexPrefillPolicy(block_size=BLOCK, tau=0.0, min_sparse_length=0).plan(
        query, key, key_padding_mask=None, scaling=0.35
    )
    assert not plan.stats["query_aware"].any() and plan.probe_flops > 0
    plan = FlexPrefillPolicy(block_size=BLOCK, tau=1.0, min_sparse_length=0).plan(
        query, key, key_padding_mask=None, scaling=0.35
    )
    assert plan.stats["query_aware"].all()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DensePolicy(block_size=48), "block_size"),
        (lambda: AShapePolicy(local_blocks=0), "local_blocks"),
        (lambda: AShapePolicy(sink_blocks=-1), "sink_blocks"),
        (lambda: AShapePolicy(target_density=0.0), "target_density"),
        (lambda: VerticalSlashPolicy(num_vertical=-2), "num_vertical"),
        (lambda: FlexPrefillPolicy(gamma=1.2), "gamma"),
        (lambda: FlexPrefillPolicy(tau=-0.1), "tau"),
        (lambda: FlexPrefillPolicy(min_budget=4, max_budget=2), "max_budget"),
        (lambda: BlockTopKPolicy(top_k=0), "top_k"),
        (lambda: BlockTopKPolicy(min_sparse_length=-1), "min_sparse_length"),
    ],
)
def test_bad_constructor_arguments_raise_input_error(make, message):
    with pytest.raises(InputError, match=message):
        make()


def test_fit_budget_stays_within_max_budget_when_the_target_is_out_of_reach():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()

    def build(budget):  # head 0 saturates at one block per row; head 1 is always full
        capped = torch.arange(4) < budget[0, 0].clamp(max=1)
        return torch.stack([capped.expand(4, 4), torch.ones(4, 4, dtype=torch.bool)])[None]

    assert fit_budget(build, 8, 0.9, causal, (1, 2)).tolist() == [[8, 0]]
