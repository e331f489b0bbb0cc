"""ABC-Align's modules: closed-form head gradients against autograd, training with each estimator,
the re-estimation schedule, DPO's frozen reference, the estimator study, and bad input."""

import copy
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningDataModule

from ada_modules.data.preference_world import PreferenceDataModule
from ada_modules.errors import InputError
from ada_modules.models.abc_estimator_study import EstimatorStudyModule
from ada_modules.models.dpo import DPOModule
from ada_modules.models.preference import RewardModelModule, pair_tokens
from ada_modules.posttrain.abc import (
    ESTIMATORS,
    margin_gradients,
    preference_loss,
    semi_supervised_weights,
)

TINY = {"hidden_size": 16, "intermediate_size": 32}


def _data(**kwargs) -> PreferenceDataModule:
    defaults = {
        "num_labelled": 8,
        "num_unlabelled": 32,
        "num_val": 8,
        "num_test": 8,
        "batch_size": 16,
        "labelled_batch_size": 4,
        "seed": 0,
    }
    return PreferenceDataModule(**{**defaults, **kwargs})


def _batch(count: int = 4) -> dict[str, torch.Tensor]:
    data = _data()
    data.setup("fit")
    labelled, _ = data.statistics_batches(2)
    return {key: value[:count] for key, value in labelled.items()}


def _fit(cpu_trainer, model, data=None, max_steps: int = 3):
    trainer = cpu_trainer(max_steps=max_steps, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=_data() if data is None else data)
    return trainer


def _spy(monkeypatch, model, name: str) -> list:
    """Record every call of ``model.<name>`` (it still runs) with the batch keys or the step."""
    calls = []
    original = getattr(model, name)

    def spying(*args):
        calls.append(sorted(args[0]) if args else model.global_step)
        return original(*args)

    monkeypatch.setattr(model, name, spying)
    return calls


# ------------------------------------------------------------------ closed-form head gradients


def test_pair_tokens_stacks_and_right_pads_both_sides():
    first = torch.tensor([[1, 5, 6, 2, 0], [1, 7, 2, 0, 0]])
    second = torch.tensor([[1, 8, 2], [1, 2, 0]])
    ids, count = pair_tokens({"first": first, "second": second})
    assert count == 2
    assert ids.tolist() == [
        [1, 5, 6, 2, 0],
        [1, 7, 2, 0, 0],
        [1, 8, 2, 0, 0],
        [1, 2, 0, 0, 0],
    ]


def test_reward_model_head_gradients_equal_autograd(seed):
    model = RewardModelModule(**TINY).eval()
    batch = _batch(5)
    margin, gradients = model.margin_and_head_gradients(batch)
    expected_margin = model.margin(batch)
    torch.testing.assert_close(margin, expected_margin)
    assert gradients.shape == (5, 16)
    for i in range(5):
        (grad,) = torch.autograd.grad(expected_margin[i], model.head.weight, retain_graph=True)
        torch.testing.assert_close(gradients[i], grad[0])
    assert gradients.abs().sum() > 0


def test_dpo_head_gradients_equal_autograd(seed):
    model = DPOModule(**TINY, num_samples=0, beta=0.5).eval()
    with torch.no_grad():  # move the policy away from the reference: a non-zero margin
        for parameter in model.policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    batch = _batch(3)
    margin, gradients = model.margin_and_head_gradients(batch)
    expected_margin = model.margin(batch)
    torch.testing.assert_close(margin, expected_margin)
    assert expected_margin.abs().min() > 1e-4
    weight = model.policy.lm_head.weight
    assert gradients.shape == (3, weight.numel())
    for i in range(3):
        (grad,) = torch.autograd.grad(expected_margin[i], weight, retain_graph=True)
        torch.testing.assert_close(gradients[i], grad.flatten(), atol=1e-6, rtol=1e-4)


def test_dpo_in_float64_computes_its_margins_in_float64(seed):
    model = DPOModule(**TINY, num_samples=0, beta=0.5).double().eval()
    with torch.no_grad():
        for parameter in model.policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    batch = _batch(3)
    margin, gradients = model.margin_and_head_gradients(batch)
    assert margin.dtype == gradients.dtype == torch.float64
    expected_margin = model.margin(batch)
    assert expected_margin.dtype == torch.float64
    weight = model.policy.lm_head.weight
    (grad,) = torch.autograd.grad(expected_margin[0], weight)
    torch.testing.assert_close(gradients[0], grad.flatten(), atol=1e-12, rtol=1e-10)


def test_dpo_reference_stays_frozen_while_the_policy_trains(seed, cpu_trainer):
    model = DPOModule(estimator="ppi", **TINY, num_samples=0)
    reference = {k: v.clone() for k, v in model.reference.state_dict().items()}
    policy = {k: v.clone() for k, v in model.policy.state_dict().items()}
    assert all(torch.equal(reference[k], policy[k]) for k in reference)
    _fit(cpu_trainer, model)
    assert model.global_step == 3
    assert not any(p.requires_grad for p in model.reference.parameters())
    assert not model.reference.training
    after = model.reference.state_dict()
    assert all(torch.equal(after[k], reference[k]) for k in reference)
    trained = model.policy.state_dict()
    assert any(not torch.equal(trained[k], policy[k]) for k in policy)
    # The optimizer only holds the policy's parameters.
    held = {id(p) for group in model.optimizers().optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.policy.parameters()}


def test_dpo_test_scores_margins_and_samples_responses(seed, cpu_trainer):
    model = DPOModule(**TINY, num_samples=8)
    data = _data()
    metrics = cpu_trainer().test(model, datamodule=data, verbose=False)[0]
    # Untrained, the policy is its reference: every margin is 0, "second preferred" everywhere.
    truth = data.splits["test"].truth
    assert metrics["test/accuracy"] == pytest.approx(1.0 - truth.mean().item())
    assert 0.0 <= metrics["test/sample_length"] <= data.world.max_length + 4
    assert math.isfinite(metrics["test/sample_reward"])
    assert "test/lambda" not in metrics  # never fitted: no estimate to report


# ------------------------------------------------------------------ training with each estimator


FIXED = {
    "human": (0.0, 0.0),
    "pseudo": (0.0, 0.0),
    "concat": (0.0, 0.0),
    "ppi": (1.0, 1.0),
}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_short_fit_logs_lambda_and_weight_in_range(seed, cpu_trainer, estimator):
    model = RewardModelModule(estimator=estimator, **TINY)
    trainer = _fit(cpu_trainer, model)
    metrics = trainer.callback_metrics
    lam, weight = metrics["train/lambda"].item(), metrics["train/abc_weight"].item()
    assert 0.0 <= lam <= 1.0 and 0.0 <= weight <= 1.0
    assert lam == pytest.approx(model.weights.lam) and weight == pytest.approx(model.weights.weight)
    if estimator in FIXED:
        assert (lam, weight) == FIXED[estimator]
    if estimator == "ppi++":
        assert weight == 1.0
    assert ("train/bias2" in metrics) == (estimator == "abc")
    assert math.isfinite(metrics["train/loss"].item())
    assert math.isfinite(metrics["train/estimator_variance"].item())


def test_a_resumed_fit_keeps_the_estimated_coefficients(seed, cpu_trainer, tmp_path):
    model = RewardModelModule(estimator="abc", **TINY)
    trainer = _fit(cpu_trainer, model, max_steps=2)
    trainer.save_checkpoint(tmp_path / "abc.ckpt")
    resumed = RewardModelModule(estimator="abc", **TINY)
    refreshed = []
    resumed.refresh_weights = lambda: refreshed.append(resumed.global_step)
    trainer = cpu_trainer(max_steps=3, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(resumed, datamodule=_data(), ckpt_path=tmp_path / "abc.ckpt")
    assert refreshed == [] and resumed.weights == model.weights
    loaded = RewardModelModule.load_from_checkpoint(tmp_path / "abc.ckpt")
    assert loaded.weights == model.weights


def test_training_loss_weights_the_three_groups_by_the_estimated_coefficients(seed, cpu_trainer):
    model = RewardModelModule(estimator="abc", statistics_unlabelled=16, **TINY)
    before = copy.deepcopy(model)
    data = _data()
    trainer = _fit(cpu_trainer, model, data, max_steps=1)
    # The coefficients: from the untrained model's head gradients on the statistics batches,
    # with the whole unlabelled set's size (32) as N.
    labelled, unlabelled = data.statistics_batches(16)
    assert len(unlabelled["judge"]) == 16
    with torch.no_grad():
        margin_l, grads_l = before.margin_and_head_gradients(labelled)
        margin_u, grads_u = before.margin_and_head_gradients(unlabelled)
    expected = semi_supervised_weights(
        margin_gradients(margin_l, labelled["human"], grads_l),
        margin_gradients(margin_l, labelled["judge"], grads_l),
        margin_gradients(margin_u, unlabelled["judge"], grads_u),
        "abc",
        num_unlabelled=32,
    )
    weights = model.weights
    assert (weights.a_h, weights.a_p, weights.a_u) == pytest.approx(
        (expected.a_h, expected.a_p, expected.a_u), rel=1e-4, abs=1e-6
    )
    assert weights.a_u != 0.0 and weights.a_p != 0.0
    # The loss of the first step: a_h·mean ℓ(human) + a_p·mean ℓ(judge) + a_u·mean ℓ_U(judge).
    batch, _, _ = next(iter(data.train_dataloader()))
    lab, unl = batch["labelled"], batch["unlabelled"]
    with torch.no_grad():
        margin_lab, margin_unl = before.margin(lab), before.margin(unl)
    loss = (
        weights.a_h * preference_loss(margin_lab, lab["human"]).mean()
        + weights.a_p * preference_loss(margin_lab, lab["judge"]).mean()
        + weights.a_u * preference_loss(margin_unl, unl["judge"]).mean()
    )
    assert trainer.callback_metrics["train/loss"].item() == pytest.approx(loss.item(), rel=1e-4)


@pytest.mark.parametrize(("estimator", "uses_unlabelled"), [("human", False), ("pseudo", True)])
def test_margin_on_the_unlabelled_batch_only_when_its_coefficient_is_not_zero(
    seed, cpu_trainer, monkeypatch, estimator, uses_unlabelled
):
    model = RewardModelModule(estimator=estimator, **TINY)
    calls = _spy(monkeypatch, model, "margin")
    _fit(cpu_trainer, model)
    unlabelled = ["first", "judge", "second"]
    assert len(calls) >= 3
    assert (unlabelled in calls) == uses_unlabelled
    assert ["first", "human", "judge", "second"] in calls  # the labelled part, every time


@pytest.mark.parametrize(("refresh", "steps"), [(None, [0]), (2, [0, 2, 4])])
def test_refresh_every_n_steps_re_estimates_on_schedule(
    seed, cpu_trainer, monkeypatch, refresh, steps
):
    model = RewardModelModule(estimator="ppi++", refresh_every_n_steps=refresh, **TINY)
    calls = _spy(monkeypatch, model, "refresh_weights")
    _fit(cpu_trainer, model, max_steps=5)
    assert calls == steps


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"estimator": "ppi+"}, "estimator must be one of human, pseudo, concat, ppi, ppi++, abc"),
        ({"refresh_every_n_steps": 0}, "refresh_every_n_steps must be at least 1, got 0"),
        ({"statistics_unlabelled": 1}, "statistics_unlabelled must be at least 2, got 1"),
    ],
)
@pytest.mark.parametrize("module", [RewardModelModule, DPOModule])
def test_bad_module_arguments_raise_input_error(module, kwargs, message):
    with pytest.raises(InputError) as error:
        module(**kwargs, **TINY)
    assert message in str(error.value)


@pytest.mark.parametrize("beta", [0.0, -1.0])
def test_dpo_beta_must_be_positive(beta):
    with pytest.raises(InputError, match=f"beta must be positive, got {beta}"):
        DPOModule(beta=beta, **TINY)
    with pytest.raises(InputError, match="num_samples must be at least 0, got -1"):
        DPOModule(num_samples=-1, **TINY)


class _NoStatistics(LightningDataModule):
    """Serves the right training batches but has no ``statistics_batches``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _data()

    def setup(self, stage: str | None = None) -> None:
        self.inner.setup(stage)

    def train_dataloader(self):
        return self.inner.train_dataloader()


def test_a_datamodule_without_statistics_batches_is_rejected_naming_it(seed, cpu_trainer):
    model = RewardModelModule(**TINY)
    with pytest.raises(InputError) as error:
        _fit(cpu_trainer, model, data=_NoStatistics())
    assert "statistics_batches(max_unlabelled)" in str(error.value)
    assert "_NoStatistics" in str(error.value)


# ------------------------------------------------------------------ the estimator study


def test_estimator_study_writes_one_cell_per_grid_point(cpu_trainer, tmp_path, monkeypatch):
    out = tmp_path / "study"
    out.mkdir()
    (out / "grid.json").write_text("stale")
    written = []
    write_text = Path.write_text

    def recording(self, *args, **kwargs):
        written.append(self.name)
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", recording)
    accuracies, biases = [0.3, 0.9], [0.0, 1.0]
    study = EstimatorStudyModule(
        judge_accuracies=accuracies,
        length_biases=biases,
        num_labelled=[20],
        num_unlabelled=300,
        trials=20,
        truth_pairs=20_000,
        seed=0,
        output_dir=str(out),
    )
    metrics = cpu_trainer().test(study, verbose=False)[0]
    assert written == ["grid.json.tmp"]  # written aside, then moved into place
    assert sorted(p.name for p in out.iterdir()) == ["grid.json"]
    grid = json.loads((out / "grid.json").read_text())
    cells = grid["cells"]
    assert len(cells) == 4
    points = [(c["judge_accuracy"], c["length_bias"], c["n"]) for c in cells]
    assert sorted(points) == sorted(itertools.product(accuracies, biases, [20]))
    assert grid["truth"] == pytest.approx(metrics["test/truth"])
    assert 0.45 < grid["truth"] < 0.55
    for cell in cells:
        for method in ESTIMATORS:
            assert 0.0 <= cell[f"coverage_{method}"] <= 1.0
            assert cell[f"rmse_{method}"] >= abs(cell[f"bias_{method}"])
        assert 0.0 <= cell["lambda"] <= 1.0 and 0.0 <= cell["abc_weight"] <= 1.0
    by_point = {point: cell for point, cell in zip(points, cells, strict=True)}
    # The length-loving judge over-states the verbose side's win rate; PPI corrects it.
    assert by_point[(0.9, 1.0, 20)]["bias_pseudo"] > by_point[(0.9, 0.0, 20)]["bias_pseudo"] + 0.1
    assert metrics["test/lambda_anti"] < 0.1  # the anti-correlated judge gets λ̂ near 0
    assert metrics["test/coverage_ppipp_min"] <= metrics["test/coverage_ppipp_max"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"judge_accuracies": [0.8, 1.2]}, "judge_accuracies must lie in [0, 1], got 1.2"),
        ({"trials": 1}, "trials must be at least 2, got 1"),
        ({"num_labelled": [50, 1]}, "num_labelled must be at least 2 each, got 1"),
        ({"num_unlabelled": 1}, "num_unlabelled must be at least 2, got 1"),
    ],
)
def test_bad_study_arguments_raise_input_error(kwargs, message):
    with pytest.raises(InputError) as error:
        EstimatorStudyModule(**kwargs)
    assert message in str(error.value)


def test_a_pair_of_identical_responses_is_rejected_naming_it():
    batch = {
        "first": torch.tensor([[1, 4, 2], [1, 5, 2]]),
        "second": torch.tensor([[1, 6, 2], [1, 5, 2]]),
    }
    with pytest.raises(InputError, match="pair 1 of the batch has identical"):
        pair_tokens(batch)
