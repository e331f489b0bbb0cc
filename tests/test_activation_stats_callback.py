"""ActivationStatsCallback: collects during validation only and matches collect_activation_stats."""

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ada_modules.callbacks import ActivationStatsCallback
from ada_modules.errors import InputError
from ada_modules.merging import collect_activation_stats, load_stats

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")


class _Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(rows: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(torch.randn(rows, 3, generator=g), torch.randn(rows, 2, generator=g)),
        batch_size=4,
    )


def _assert_same(stats, expected):
    assert list(stats) == list(expected)
    for name, layer in expected.items():
        assert stats[name].count == layer.count and stats[name].has_bias == layer.has_bias
        assert torch.allclose(stats[name].second_moment_sum, layer.second_moment_sum, rtol=1e-6)


def test_validate_writes_the_statistics_of_a_direct_collection(cpu_trainer, tmp_path):
    module, loader = _Tiny(), _loader(10, seed=1)
    path = tmp_path / "stats" / "core.pt"
    callback = ActivationStatsCallback(path=path)
    assert callback.stats == {}
    cpu_trainer(callbacks=[callback]).validate(module, loader, verbose=False)
    expected = collect_activation_stats(module, loader)
    assert list(expected) == ["net.0", "net.2"] and expected["net.0"].count == 10
    _assert_same(load_stats(path), expected)
    _assert_same(callback.stats, expected)
    assert not any(m._forward_pre_hooks for m in module.modules())  # hooks removed afterwards

    # a second run replaces the statistics (no pooling across runs); layers restrict them
    selected = ActivationStatsCallback(layers=["net.2"])
    cpu_trainer(callbacks=[callback, selected]).validate(module, loader, verbose=False)
    _assert_same(callback.stats, expected)
    _assert_same(selected.stats, {"net.2": expected["net.2"]})


def test_fit_collects_the_validation_run_only(cpu_trainer, tmp_path):
    module, train, val = _Tiny(), _loader(12, seed=2), _loader(6, seed=3)
    path = tmp_path / "val.pt"
    callback = ActivationStatsCallback(path=path)
    seen_after_sanity_check = []

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):  # after the sanity check
            seen_after_sanity_check.append((dict(callback.stats), path.exists()))

    trainer = cpu_trainer(callbacks=[callback, Probe()], max_epochs=1, num_sanity_val_steps=1)
    trainer.fit(module, train, val)
    assert seen_after_sanity_check == [({}, False)]  # the sanity check collected nothing
    # neither the 12 training rows nor the 4 rows of the sanity check count
    assert callback.stats["net.0"].count == 6
    # validation ran after the last training step: the trained model's statistics
    _assert_same(load_stats(path), collect_activation_stats(module, val))


class _Sequence(_Tiny):
    def validation_step(self, batch, batch_idx):
        self(batch["input_ids"])


def test_masked_positions_are_left_out(cpu_trainer):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, 3, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    samples = [{"input_ids": x[i], "attention_mask": mask[i]} for i in range(4)]
    callback = ActivationStatsCallback(layers=["net.0"])
    module = _Sequence()
    cpu_trainer(callbacks=[callback]).validate(
        module, DataLoader(samples, batch_size=2), verbose=False
    )
    kept = x[mask.bool()].double()  # the 11 unmasked positions
    rows = torch.cat([kept, torch.ones(len(kept), 1, dtype=torch.float64)], dim=1)
    assert callback.stats["net.0"].count == 11
    assert torch.allclose(callback.stats["net.0"].second_moment_sum, rows.T @ rows, rtol=1e-6)


def test_bad_input(cpu_trainer):
    module = _Tiny()
    callback = ActivationStatsCallback(layers=["net.nope"])
    with pytest.raises(
        InputError, match=r"^layers: no module 'net.nope' \(linear layers: 'net.0', 'net.2'\)"
    ):
        cpu_trainer(callbacks=[callback]).validate(module, _loader(4, seed=4), verbose=False)
    assert not any(m._forward_pre_hooks for m in module.modules())
    with pytest.raises(InputError, match="^layers: 'net.1' is a Tanh, not an nn.Linear"):
        cpu_trainer(callbacks=[ActivationStatsCallback(layers=["net.1"])]).validate(
            module, _loader(4, seed=4), verbose=False
        )
    with pytest.raises(
        InputError, match="layers must be a list of layer names or None, got 'net.0'"
    ):
        ActivationStatsCallback(layers="net.0")
    with pytest.raises(InputError, match="path must be a file path or None, got ''"):
        ActivationStatsCallback(path="")
    with pytest.raises(InputError, match="path must be a file path or None, got 3"):
        ActivationStatsCallback(path=3)
