import json

import pytest
import torch

from ada_modules.attention import TaskDispatcher, plan_density
from ada_modules.data.planted_attention import PlantedAttentionDataModule, planted_attention
from ada_modules.errors import InputError
from ada_modules.models.sparse_prefill_study import SparsePrefillStudyModule

L, BLOCK = 256, 32


def _module(arm: str, **kwargs) -> SparsePrefillStudyModule:
    return SparsePrefillStudyModule(arm=arm, block_size=BLOCK, min_sparse_length=0, **kwargs)


def _data(regime: str, **kwargs) -> PlantedAttentionDataModule:
    kwargs = {"num_fit": 8, "num_test": 2, "seed": 3, "needle_heads": 2, **kwargs}
    return PlantedAttentionDataModule(seq_len=L, num_heads=4, head_dim=32, regime=regime, **kwargs)


def _batch(regime: str = "retrieval", seed: int = 0) -> dict[str, torch.Tensor]:
    layer = planted_attention(
        L,
        num_heads=4,
        head_dim=32,
        regime=regime,
        needle_heads=2,
        generator=torch.Generator().manual_seed(seed),
    )
    return {name: x[None] for name, x in vars(layer).items()}


def test_dense_arm_recalls_everything_exactly():
    metrics = _module("dense").evaluate(_batch())
    assert torch.allclose(metrics["recall"], torch.ones(1, 4, L), rtol=0, atol=1e-6)
    for name in ("needle_recall", "needle_hit", "needle_recall_unprobed", "needle_hit_unprobed"):
        assert metrics[name].numel() > 0 and (metrics[name] == 1).all(), name
    # The kernel's fp32 reference sums in another order than the fp32 dense softmax: rounding
    # only (~1e-7 per element, ~1e-6 relative over a layer).
    assert metrics["output_error"].item() < 1e-5
    assert metrics["density"].item() == 1.0 and metrics["probe_overhead"].item() == 0.0
    assert 0.5 < metrics["needle_mass"].mean() <= 1.0


def test_a_shape_misses_every_needle_that_dense_attention_reads():
    # By construction: needles lie in keys [L/8, L/2) = [32, 128), needle rows at >= 5L/8 = 160
    # (query block >= 5), whose 2-block local window starts at key 128; the sink block ends at 32.
    batch = _batch()
    a_shape = _module("a_shape").evaluate(batch)
    dense = _module("dense").evaluate(batch)
    assert (a_shape["needle_hit"] == 0).all() and (a_shape["needle_recall"] == 0).all()
    assert (dense["needle_hit"] == 1).all()
    # The old metric (total kept mass of the needle rows) still credited A-shape with the sink
    # and local mass; the needle metrics do not.
    rows = batch["needle_target"][0] >= 0
    assert a_shape["recall"][0][rows].mean() > 0


def test_adacal_retrieval_finds_the_needles_its_probe_sees():
    # Augmentation (retrieval regime) adds, to every query block of an activated head, the
    # mid-zone blocks in decreasing probe mass until 90% of the mid-zone mass (cap 8 >= the 5
    # mid-zone blocks here): a probed needle holds ~1/4 of its head's probe mass (half of the
    # last rows read one of two needles with most of their mass), more than 10% of the mid zone.
    module = _module("adacal", policy_kwargs={"regime": "retrieval"})
    for seed in range(3):
        metrics = module.evaluate(_batch(seed=seed))
        probed = ~metrics["needle_unprobed"]
        assert probed.any() and metrics["needle_unprobed"].any()
        assert (metrics["needle_hit"][probed] == 1).all(), seed
        assert torch.equal(
            metrics["needle_hit_unprobed"], metrics["needle_hit"][metrics["needle_unprobed"]]
        )


def test_test_stage_logs_every_metric_in_range(cpu_trainer):
    trainer = cpu_trainer()
    trainer.test(_module("flexprefill"), datamodule=_data("retrieval"), verbose=False)
    logged = {name: value.item() for name, value in trainer.callback_metrics.items()}
    expected = {
        "recall",
        "recall_p5",
        "needle_recall",
        "needle_hit",
        "needle_recall_unprobed",
        "needle_hit_unprobed",
        "needle_mass",
        "output_error",
        "density",
    }
    assert {f"test/{name}" for name in expected | {"probe_overhead"}} <= set(logged)
    for name in expected:
        assert 0.0 <= logged[f"test/{name}"] <= 1.0, name
    assert logged["test/recall_p5"] <= logged["test/recall"]
    assert 0.0 < logged["test/probe_overhead"] < 1.0


def test_fit_writes_a_dispatcher_that_test_loads(cpu_trainer, tmp_path):
    path = tmp_path / "dispatch.json"
    module = _module("adacal", dispatch_path=str(path))
    cpu_trainer(max_epochs=1).fit(module, datamodule=_data("mixed"))
    dispatcher = TaskDispatcher.from_dict(json.loads(path.read_text()))
    assert dispatcher.logistic is not None
    tester = _module("adacal", dispatch_path=str(path))
    trainer = cpu_trainer()
    trainer.test(tester, datamodule=_data("structure"), verbose=False)
    assert tester.policy.dispatcher.state_dict() == dispatcher.state_dict()
    assert "test/dispatch_accuracy" in trainer.callback_metrics
    assert "test/needle_recall" not in trainer.callback_metrics  # no needles in structure


def test_fitted_dispatcher_is_right_on_clearly_separated_layers(cpu_trainer, tmp_path):
    # Every head of a retrieval layer is a needle head: its last block reads mid-context
    # needles (peaky verticals), while structure layers have none. Calibrated on such layers,
    # the logistic dispatcher must separate its fit set and the held-out layers.
    path = tmp_path / "dispatch.json"
    fitter = _module("adacal", dispatch_path=str(path))
    trainer = cpu_trainer(max_epochs=1)
    trainer.fit(fitter, datamodule=_data("mixed", num_fit=16, needle_heads=4))
    assert trainer.callback_metrics["train/dispatch_accuracy"].item() == 1.0
    for regime in ("structure", "retrieval"):
        tester = _module("adacal", dispatch_path=str(path))
        trainer = cpu_trainer()
        trainer.test(tester, datamodule=_data(regime, needle_heads=4), verbose=False)
        assert trainer.callback_metrics["test/dispatch_accuracy"].item() == 1.0, regime


def test_matched_density_follows_the_reference_arm():
    batch = _batch()
    scaling = 32**-0.5
    reference = _module("flexprefill").policy.plan(
        batch["query"], batch["key"], key_padding_mask=None, scaling=scaling
    )
    plan = _module("block_topk", match_density="flexprefill")._plan(
        batch["query"], batch["key"], scaling
    )
    target = plan_density(reference.block_mask, L, L, BLOCK)
    assert abs(plan_density(plan.block_mask, L, L, BLOCK) - target) < 0.1


@pytest.mark.parametrize(
    ("kwargs", "value"),
    [
        ({"arm": "sparse_magic"}, "sparse_magic"),
        ({"arm": "a_shape", "block_size": 48}, "48"),
        ({"arm": "flexprefill", "match_density": "dense"}, "flexprefill"),
        ({"arm": "a_shape", "match_density": "oracle"}, "oracle"),
        ({"arm": "a_shape", "policy_kwargs": {"gamma": 0.9}}, "gamma"),
    ],
)
def test_bad_input_names_the_value(kwargs, value):
    with pytest.raises(InputError, match=value):
        SparsePrefillStudyModule(**kwargs)


def test_fit_needs_adacal_and_test_needs_the_dispatch_file(cpu_trainer, tmp_path):
    with pytest.raises(InputError, match="a_shape"):
        cpu_trainer(max_epochs=1).fit(_module("a_shape"), datamodule=_data("mixed"))
    single = _module("adacal")
    with pytest.raises(InputError, match="mixed"):  # before the pass, not after it
        cpu_trainer(max_epochs=1).fit(single, datamodule=_data("retrieval"))
    assert single._features == []
    missing = str(tmp_path / "nowhere.json")
    with pytest.raises(InputError, match="nowhere.json"):
        cpu_trainer().test(_module("adacal", dispatch_path=missing), datamodule=_data("retrieval"))
