import pytest
import torch

from ada_modules.data import DigitsDataModule, FederatedDataModule
from ada_modules.fl import ASAP, IPM, Attack
from ada_modules.models import FederatedSimulationModule


def _data(rounds=30, **kwargs):
    return FederatedDataModule(DigitsDataModule(seed=0), num_clients=10, rounds=rounds, **kwargs)


def _fit(cpu_trainer, module, data):
    trainer = cpu_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module, data)
    return trainer


def test_clean_federated_training_learns_the_digits(seed, cpu_trainer):
    module = FederatedSimulationModule(num_malicious=0, attack_start=20)
    trainer = _fit(cpu_trainer, module, _data())
    assert len(module.curve) == 30
    assert module.curve[0] < 0.5 < 0.8 < module.curve[-1]
    assert trainer.callback_metrics["val/accuracy"] == pytest.approx(module.curve[-1], abs=1e-6)
    assert trainer.callback_metrics["val/clean_accuracy"] == module.curve[19]


@pytest.mark.parametrize("algorithm", ["fedsgd", "fedavg"])
def test_one_round_is_the_mean_of_the_client_updates(seed, cpu_trainer, algorithm):
    steps = 2 if algorithm == "fedavg" else 1
    data = _data(rounds=1, local_steps=steps)
    module = FederatedSimulationModule(num_malicious=0, algorithm=algorithm, client_lr=0.1)
    before = [p.detach().clone() for p in module.parameters()]
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    # Each client's SGD from the global model, then the mean of the changes.
    expected = [torch.zeros_like(start) for start in before]
    for client in range(data.num_clients):
        model = FederatedSimulationModule(num_malicious=0).model
        for p, value in zip(model.parameters(), before, strict=True):
            p.data.copy_(value)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            optimizer.zero_grad()
            x, y = batch["x"][client, step], batch["y"][client, step]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        for total, p, start in zip(expected, model.parameters(), before, strict=True):
            total += (p.detach() - start) / data.num_clients
    _fit(cpu_trainer, module, data)
    for p, start, delta in zip(module.parameters(), before, expected, strict=True):
        torch.testing.assert_close(p.detach(), start + delta, atol=1e-5, rtol=1e-4)


class _Recorder(Attack):
    """Sends NaN from round 12 on, and records what it saw."""

    def reset(self):
        self.rounds, self.benign_rows, self.first = [], [], None

    def craft(self, benign, context):
        self.first = context.metric if self.first is None else self.first
        assert context.target == pytest.approx(0.5 * self.first)  # half the clean measurement
        self.rounds.append(context.round)
        self.benign_rows.append(benign.shape[0])
        fill = float("nan") if context.round >= 12 else 0.0
        return torch.full((context.num_malicious, benign.shape[1]), fill)


def test_the_attack_replaces_the_last_clients_from_attack_start_and_nan_is_dropped(
    seed, cpu_trainer
):
    attack = _Recorder()
    module = FederatedSimulationModule(
        aggregator="median", attack=attack, num_malicious=2, attack_start=10
    )
    with pytest.warns(RuntimeWarning, match="dropped 2 of 10"):
        trainer = _fit(cpu_trainer, module, _data(rounds=15))
    assert attack.rounds == list(range(10, 15)) and set(attack.benign_rows) == {8}
    assert all(torch.isfinite(p).all() for p in module.parameters())
    metrics = trainer.callback_metrics
    assert metrics["val/malicious_kept"] < 0.5
    assert metrics["train/malicious_kept"] == 0.0  # the NaN rows of the last round


def test_a_diverging_attack_leaves_the_model_stuck_and_counts_as_never_reaching(seed, cpu_trainer):
    module = FederatedSimulationModule(attack=IPM(epsilon=1e4), num_malicious=3, attack_start=5)
    with pytest.warns(UserWarning, match="diverged"):
        trainer = _fit(cpu_trainer, module, _data(rounds=20))
    metrics = trainer.callback_metrics
    assert module.diverged_at is not None
    assert metrics["val/reached"] == 0.0 and metrics["val/rounds_to_target"] == 15


def test_divergence_in_the_first_round_is_recorded_as_round_0(seed, cpu_trainer):
    module = FederatedSimulationModule(attack=None, num_malicious=0, client_lr=1e39)
    with pytest.warns(UserWarning, match="diverged") as caught:
        _fit(cpu_trainer, module, _data(rounds=3))
    assert module.diverged_at == 0
    assert sum("diverged" in str(w.message) for w in caught) == 1


def test_asap_on_the_mean_lowers_accuracy_within_its_envelope(seed, cpu_trainer):
    module = FederatedSimulationModule(attack=ASAP(), num_malicious=2, attack_start=15)
    clean = FederatedSimulationModule(num_malicious=2, attack_start=15)
    _fit(cpu_trainer, module, _data(rounds=30))
    torch.manual_seed(1234)
    _fit(cpu_trainer, clean, _data(rounds=30))
    assert sum(module.curve[15:]) < sum(clean.curve[15:]) - 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aggregator": "average"}, "aggregator"),
        ({"algorithm": "fedprox"}, "algorithm"),
        ({"target_fraction": 1.0}, "target_fraction"),
        ({"target_fraction": 0.0}, "target_fraction"),
        ({"band": 0.0}, "band"),
        ({"attack": "lie"}, "attack"),
        ({"attack": IPM(), "num_malicious": 0}, "num_malicious"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FederatedSimulationModule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "data_kwargs", "match"),
    [
        ({"num_malicious": 5}, {}, "must be < n/2"),
        ({"aggregator": "bulyan", "num_malicious": 2}, {}, "'bulyan' tolerates at most f=1"),
        ({"aggregator": "fltrust"}, {"root_size": 0}, "root_size"),
        ({}, {"local_steps": 2}, "local_steps"),
        ({"attack": IPM()}, {"auxiliary_size": 0}, "auxiliary_size"),
    ],
)
def test_settings_that_do_not_fit_the_data_fail_before_the_first_round(
    cpu_trainer, kwargs, data_kwargs, match
):
    module = FederatedSimulationModule(**kwargs)
    with pytest.raises(ValueError, match=match):
        _fit(cpu_trainer, module, _data(**data_kwargs))
    assert module.curve == []


def test_a_server_optimizer_steps_with_the_negated_aggregate(seed, cpu_trainer):
    """FedOpt: with SGD(lr=1) as the server optimizer, a round equals adding the aggregate."""
    plain = FederatedSimulationModule(num_malicious=0)
    fedopt = FederatedSimulationModule(
        num_malicious=0, server_optimizer=lambda params: torch.optim.SGD(params, lr=1.0)
    )
    fedopt.load_state_dict(plain.state_dict())
    _fit(cpu_trainer, plain, _data(rounds=3))
    _fit(cpu_trainer, fedopt, _data(rounds=3))
    for a, b in zip(plain.parameters(), fedopt.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "bad",
    [
        "--model.init_args.num_malicious=10",
        "--model.init_args.aggregator_kwargs={tau: -1.0}",
    ],
)
def test_a_bad_setting_is_refused_before_the_cli_writes_anything(tmp_path, bad):
    from pathlib import Path

    from ada_modules.cli import main

    config = Path(__file__).resolve().parents[2] / "cli_configs" / "asap" / "digits.yaml"
    args = ["fit", "-c", str(config), f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--model.init_args.aggregator=centered_clipping", bad]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert list(tmp_path.rglob("*")) == []
