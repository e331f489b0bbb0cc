"""AdaCal: head activation, mid-zone augmentation, task dispatch, configuration."""

import dataclasses
import json
import math

import pytest
import torch
from jsonargparse import ArgumentParser

from ada_modules.attention import (
    DISPATCH_FEATURES,
    AdaCalConfig,
    AdaCalPolicy,
    AShapePolicy,
    RetrievalParams,
    StructureParams,
    TaskDispatcher,
    causal_block_mask,
)
from ada_modules.errors import InputError

BLOCK, LENGTH, DIM = 32, 512, 32
NEEDLE_BLOCK = 6


def _positional(offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary-style channels whose scores peak where ``query - key == offset``."""
    freqs = math.pi * (1 / LENGTH) ** (torch.arange(DIM // 2) / (DIM // 2 - 1))
    angles = torch.arange(LENGTH)[:, None] * freqs
    query = torch.cat([angles.cos(), angles.sin()], -1)
    key_angles = (torch.arange(LENGTH)[:, None] + offset) * freqs
    return query, torch.cat([key_angles.cos(), key_angles.sin()], -1)


def _needle(second_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weak random scores, except that the second half's queries match one mid-context block
    (and, a little less, ``second_block``)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(LENGTH, DIM, generator=generator) * 0.3
    key = torch.randn(LENGTH, DIM, generator=generator) * 0.3
    key[NEEDLE_BLOCK * BLOCK : (NEEDLE_BLOCK + 1) * BLOCK, 0] += 6
    if second_block is not None:
        key[second_block * BLOCK : (second_block + 1) * BLOCK, 0] += 5.9
    query[LENGTH // 2 :, 0] += 6
    return query, key


def _layer(*heads: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([q for q, _ in heads])[None], torch.stack([k for _, k in heads])[None]


def _plan(policy, query, key):
    return policy.plan(query, key, key_padding_mask=None, scaling=1.0)


def test_needle_block_is_kept_for_retrieval_while_a_local_head_stays_static():
    query, key = _layer(_positional(), _needle())
    policy = AdaCalPolicy(block_size=BLOCK, min_sparse_length=0)
    plan = _plan(policy, query, key)
    assert plan.regime == ["retrieval"]
    local, needle = plan.block_mask[0]
    assert needle[LENGTH // 2 // BLOCK :, NEEDLE_BLOCK].all()  # every retrieving query block
    assert plan.stats["query_aware"].tolist() == [[False, True]]
    expected_local = AShapePolicy(block_size=BLOCK, min_sparse_length=0)
    assert torch.equal(local, _plan(expected_local, query, key).block_mask[0, 0])
    assert plan.stats["mid_coverage"][0, 1] >= 0.9
    a_shape = _plan(AShapePolicy(block_size=BLOCK, min_sparse_length=0), query, key).block_mask
    assert not a_shape[0, 1, -1, NEEDLE_BLOCK]


def test_augmentation_adds_the_mid_block_the_selection_missed():
    query, key = _layer(_needle(second_block=10))

    def policy(augment: bool) -> AdaCalPolicy:
        retrieval = {"gamma": 0.01, "min_budget": 1, "augment": augment, "max_extra_blocks": 1}
        return AdaCalPolicy(
            block_size=BLOCK, min_sparse_length=0, regime="retrieval", retrieval=retrieval
        )

    without, with_ = _plan(policy(False), query, key), _plan(policy(True), query, key)
    assert without.stats["mid_coverage"] < 0.9 <= with_.stats["mid_coverage"]
    added = with_.block_mask & ~without.block_mask
    assert added.any(2)[0, 0].nonzero().flatten().tolist() == [10]
    assert with_.block_mask[0, 0, 10:, 10].all()  # every query block where it is causal


def test_structure_regime_never_augments_and_spends_less():
    query, key = _layer(_needle(second_block=10))
    params = {"gamma": 0.01, "min_budget": 1, "max_extra_blocks": 1, "tau_coverage": 0.9}
    structure = _plan(
        AdaCalPolicy(block_size=BLOCK, min_sparse_length=0, regime="structure", structure=params),
        query,
        key,
    )
    retrieval = _plan(
        AdaCalPolicy(
            block_size=BLOCK,
            min_sparse_length=0,
            regime="retrieval",
            retrieval={**params, "augment": True},
        ),
        query,
        key,
    )
    assert structure.regime == ["structure"]
    assert retrieval.block_mask[0, 0, 10:, 10].all()  # augmentation adds the mid block...
    assert not structure.block_mask[0, 0, 10:, 10].all()  # ...which structure never does
    assert structure.block_mask.sum() < retrieval.block_mask.sum()


def test_dispatch_rule_separates_structure_from_retrieval():
    policy = AdaCalPolicy(block_size=BLOCK, min_sparse_length=0)
    structural = _layer(_positional(), _positional(offset=4 * BLOCK))  # local + periodic
    retrieving = _layer(_needle(), _needle())
    features = torch.cat(
        [
            policy.dispatch_features(*structural, scaling=1.0),
            policy.dispatch_features(*retrieving, scaling=1.0),
        ]
    )
    assert features.shape == (2, len(DISPATCH_FEATURES))
    names = dict(zip(DISPATCH_FEATURES, features.T, strict=True))
    assert names["peaky_heads"].tolist() == [0.0, 1.0]
    assert names["slash_ratio"][0] > 0.5 > names["slash_ratio"][1]
    assert TaskDispatcher().predict(features).tolist() == [False, True]
    assert _plan(policy, *structural).regime == ["structure"]


def test_logistic_fit_separates_separable_features_deterministically(seed):
    structure = torch.rand(20, 4) * torch.tensor([0.6, 0.3, 0.1, 1.0])
    retrieval = structure + torch.tensor([0.1, 0.4, 0.5, -0.2])
    features = torch.cat([structure, retrieval])
    labels = ["structure"] * 20 + ["retrieval"] * 20
    fitted = TaskDispatcher().fit(features, labels)
    assert fitted.predict(features).tolist() == [False] * 20 + [True] * 20
    state = json.loads(json.dumps(fitted.state_dict()))
    assert TaskDispatcher.from_dict(state).state_dict() == fitted.state_dict()
    assert TaskDispatcher().fit(features, labels).state_dict() == fitted.state_dict()


def test_batch_with_left_padding_plans_each_element_like_alone():
    query, key = _layer(_positional(), _needle())
    pad = 2 * BLOCK
    other_q, other_k = _layer(_needle(), _positional())
    other_q[:, :, :pad] = 0
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    mask[1, :pad] = False
    policy = AdaCalPolicy(block_size=BLOCK, min_sparse_length=0)
    batched = policy.plan(
        torch.cat([query, other_q]), torch.cat([key, other_k]), key_padding_mask=mask, scaling=1.0
    )
    alone = _plan(policy, query, key)
    assert torch.equal(batched.block_mask[:1], alone.block_mask)
    assert batched.regime[0] == alone.regime[0]
    for name, value in alone.stats.items():
        assert torch.allclose(batched.stats[name][:1].float(), value.float(), atol=1e-5), name


@pytest.mark.parametrize("max_density", [1.0, 0.3])
def test_a_left_padded_element_gets_the_plan_of_its_unpadded_sequence(max_density):
    query, key = _layer(_positional(), _needle())
    pad = 2 * BLOCK
    mask = torch.ones(1, LENGTH, dtype=torch.bool)
    mask[0, :pad] = False
    policy = AdaCalPolicy(block_size=BLOCK, min_sparse_length=0, max_density=max_density)
    padded = policy.plan(query, key, key_padding_mask=mask, scaling=1.0)
    unpadded = _plan(policy, query[:, :, pad:], key[:, :, pad:])
    skip = pad // BLOCK
    assert torch.equal(padded.block_mask[:, :, skip:, skip:], unpadded.block_mask)
    assert padded.regime == unpadded.regime


def test_a_non_finite_probe_gets_the_dense_plan():
    query, key = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    key[0, :, 5] = float("nan")  # every probe row sees it
    plan = AdaCalPolicy(block_size=16, min_sparse_length=0).plan(query, key, scaling=0.25)
    assert torch.equal(plan.block_mask, causal_block_mask(1, 2, 64, 64, block_size=16))
    assert plan.regime is None


def test_config_round_trips_and_yaml_overrides_single_fields():
    config = AdaCalConfig(block_size=32, retrieval={"gamma": 0.97})
    assert config.retrieval == dataclasses.replace(RetrievalParams(), gamma=0.97)
    policy = AdaCalPolicy.from_config(config)
    assert policy.config == config and policy.block_size == 32
    parser = ArgumentParser()
    parser.add_argument("--policy", type=AdaCalPolicy)
    parsed = parser.parse_string(
        "policy:\n"
        "  class_path: ada_modules.attention.AdaCalPolicy\n"
        "  init_args: {tau_entropy: 0.4, structure: {gamma: 0.8},"
        " dispatcher: {class_path: ada_modules.attention.TaskDispatcher,"
        " init_args: {peaky_threshold: 0.3}}}\n"
    )
    built = parser.instantiate(parsed).policy
    assert built.config.tau_entropy == 0.4
    assert built.config.structure == dataclasses.replace(StructureParams(), gamma=0.8)
    assert built.dispatcher.peaky_threshold == 0.3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 48}, "block_size"),
        ({"sink_blocks": -1}, "sink_blocks"),
        ({"local_blocks": 0}, "local_blocks"),
        ({"tau_entropy": 1.5}, "tau_entropy"),
        ({"max_density": 0.0}, "max_density"),
        ({"tau_pooled": -0.1}, "tau_pooled"),
        ({"regime": "code"}, "regime"),
        ({"retrieval": {"gamma": 0.0}}, "retrieval.gamma"),
        ({"structure": {"gamma": 1.1}}, "structure.gamma"),
        ({"retrieval": {"max_extra_blocks": -1}}, "retrieval.max_extra_blocks"),
        ({"structure": {"budget": 3}}, "no field"),
        ({"dispatcher": "rule"}, "dispatcher"),
    ],
)
def test_bad_configuration_raises_input_error(kwargs, message):
    with pytest.raises(InputError, match=message):
        AdaCalPolicy(**kwargs)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: TaskDispatcher(peaky_threshold=2.0), "peaky_threshold"),
        (lambda: TaskDispatcher().predict(torch.zeros(3, 2)), "features"),
        (lambda: TaskDispatcher().fit(torch.zeros(2, 4), [0, 0]), "both regimes"),
        (lambda: TaskDispatcher().fit(torch.zeros(2, 4), ["code", 1]), "label"),
        (lambda: TaskDispatcher(logistic={"weight": [1.0]}), "logistic"),
    ],
)
def test_bad_dispatcher_input_raises_input_error(call, message):
    with pytest.raises(InputError, match=message):
        call()
