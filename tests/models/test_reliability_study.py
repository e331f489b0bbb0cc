"""ReliabilityStudyModule: fixed options and the router on simulated channels (``ada test``)."""

import json

import pytest
from lightning.pytorch import Trainer

from ada_modules.data import ReliabilityItemsDataModule
from ada_modules.errors import InputError
from ada_modules.models import ReliabilityStudyModule

CHANNELS = {
    "small": {
        "accuracy": [0.95, 0.1],
        "cost": 1.0,
        "critic": {"keep": [0.9, 0.9], "fix": [0.2, 0.1]},
    },
    "large": {"accuracy": [0.95, 0.9], "cost": 10.0},
}
OPTIONS = [
    {"name": "small_single", "channel": "small", "operator": "single"},
    {"name": "small_vote3", "channel": "small", "operator": "majority", "num_samples": 3},
    {"name": "small_critic1", "channel": "small", "operator": "critic", "rounds": 1},
    {"name": "large_single", "channel": "large", "operator": "single"},
    {"name": "large_harq2", "channel": "large", "operator": "harq", "max_rounds": 2},
]


def _test(module, num_labelled=200, num_test=200, seed=0):
    data = ReliabilityItemsDataModule(num_labelled=num_labelled, num_test=num_test, num_topics=4,
                                      num_buckets=2, seed=seed)  # fmt: skip
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    return trainer.test(module, data, verbose=False)[0]


def test_router_routes_easy_queries_cheap_and_hard_ones_to_the_large_model(tmp_path):
    # A clear-cut case: the small model solves the easy bucket only, the large one everything.
    channels = {
        "small": {"accuracy": [1.0, 0.0], "cost": 1.0},
        "large": {"accuracy": [1.0, 1.0], "cost": 10.0},
    }
    options = [{"name": name, "channel": name, "operator": "single"} for name in ("small", "large")]
    module = ReliabilityStudyModule(channels, options, hardness_scale=0.0, k=15, seed=0,
                                    output_dir=str(tmp_path))  # fmt: skip
    metrics = _test(module)
    assert metrics["test/bucket_winners"] == 2  # each bucket its own cheapest solver
    assert metrics["test/best_fixed_quality"] == pytest.approx(1.0)
    assert metrics["test/best_fixed_cost"] == 10.0
    report = json.loads((tmp_path / "frontier.json").read_text())
    easy_share = report["bucket_oracle"][0]["shares"][0]  # what routing by bucket sends small
    assert 0.3 < easy_share < 0.7
    # The router finds the split from the texts alone: same quality for the oracle's cost.
    expected = (easy_share * 1.0 + (1 - easy_share) * 10.0) / 10.0
    assert metrics["test/router_cost_ratio"] == pytest.approx(expected, abs=0.02)
    assert metrics["test/bucket_oracle_cost_ratio"] == pytest.approx(expected)
    assert metrics["test/router_quality_gain"] == pytest.approx(0.0, abs=0.02)
    costs = [point["cost"] for point in report["router"]]
    assert costs == sorted(costs, reverse=True)  # larger lambda, cheaper choices
    assert report["router"][-1]["shares"] == [1.0, 0.0]  # lambda 10: everything to small


def test_same_seed_same_metrics_and_the_fixed_options_do_not_depend_on_k():
    first = _test(ReliabilityStudyModule(CHANNELS, OPTIONS, k=5, seed=3))
    again = _test(ReliabilityStudyModule(CHANNELS, OPTIONS, k=5, seed=3))
    other_k = _test(ReliabilityStudyModule(CHANNELS, OPTIONS, k=50, seed=3))
    assert first == again
    fixed = [name for name in first if name.startswith(("test/quality/", "test/cost/"))]
    assert len(fixed) == 2 * len(OPTIONS)
    assert all(first[name] == other_k[name] for name in fixed)


def test_held_out_items_do_not_change_with_the_labelled_count():
    a = ReliabilityItemsDataModule(num_labelled=10, num_test=5, seed=1)
    b = ReliabilityItemsDataModule(num_labelled=30, num_test=5, seed=1)
    a.setup(), b.setup()
    assert a.datasets["test"].texts == b.datasets["test"].texts
    assert a.datasets["test"].start == 10 and b.datasets["test"].start == 30


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"channels": {}}, "channels must be a non-empty mapping"),
        ({"channels": {"small": {"cost": 1.0}}}, r"channels\['small'\] needs 'accuracy'"),
        (
            {"channels": {"small": {"accuracy": [0.5], "cost": -1.0}}},
            r"cost must be a number >= 0, got -1.0",
        ),
        (
            {"options": [{"name": "x", "channel": "tiny", "operator": "single"}]},
            "channel must be one of",
        ),
        (
            {"options": [{"name": "x", "channel": "small", "operator": "vote"}]},
            "operator must be one of",
        ),
        ({"options": [OPTIONS[0], OPTIONS[0]]}, "distinct string names"),
        ({"channels": {"small": {"accuracy": [0.5, 0.5]}}}, r"channels\['small'\] needs a 'cost'"),
        ({"verifier": {"fpp": 0.0}}, r"verifier takes tpr, fpr and cost, got \['fpp'\]"),
        ({"lambdas": [0.0, float("nan")]}, r"lambdas must be numbers >= 0"),
        ({"hardness_scale": float("nan")}, r"hardness_scale must be a number >= 0, got nan"),
        ({"lambdas": [0.0, -1.0]}, r"lambdas must be numbers >= 0"),
        (
            {"matched_quality_tolerance": 1.5},
            r"matched_quality_tolerance must be in \[0, 1\), got 1.5",
        ),
    ],
)
def test_bad_configuration_is_an_input_error_naming_it(kwargs, match):
    with pytest.raises(InputError, match=match):
        ReliabilityStudyModule(**{"channels": CHANNELS, "options": OPTIONS, **kwargs})


def test_bad_values_found_at_test_start_name_the_option():
    zero_votes = [{"name": "v0", "channel": "small", "operator": "majority", "num_samples": 0}]
    with pytest.raises(InputError, match="option .v0.: num_samples must be an integer >= 1, got 0"):
        _test(ReliabilityStudyModule(CHANNELS, zero_votes, k=5), num_labelled=20, num_test=10)
    no_critic = [{"name": "c", "channel": "large", "operator": "critic", "rounds": 1}]
    with pytest.raises(InputError, match="channel 'large' has no critic"):
        _test(ReliabilityStudyModule(CHANNELS, no_critic, k=5), num_labelled=20, num_test=10)
    short = {"small": {"accuracy": [0.9], "cost": 1.0}}
    with pytest.raises(InputError, match=r"one value per bucket \(2\)"):
        _test(ReliabilityStudyModule(short, OPTIONS[:1], k=5), num_labelled=20, num_test=10)
