"""Activation statistics and the diagonal Fisher against moments and gradients computed by hand."""

import os

import numpy as np
import pytest
import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.merging import (
    ActivationStats,
    check_stats,
    collect_activation_stats,
    collect_fisher,
    load_stats,
    save_stats,
)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2, bias=False))


def _batches(count: int = 3, rows: int = 5) -> list[tuple[torch.Tensor, None]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 3, generator=g), None) for _ in range(count)]


def _layer_inputs(model: nn.Sequential, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The inputs of layers '0' and '2', computed with numpy from the parameters."""
    w0 = model[0].weight.detach().double().numpy()
    b0 = model[0].bias.detach().double().numpy()
    x0 = x.double().numpy()
    return x0, np.tanh(x0 @ w0.T + b0)


def _gram(rows: np.ndarray, bias: bool) -> np.ndarray:
    if bias:
        rows = np.hstack([rows, np.ones((rows.shape[0], 1))])
    return rows.T @ rows


def test_second_moments_equal_the_gram_of_the_recorded_inputs():
    model, batches = _mlp(), _batches()
    stats = collect_activation_stats(model, batches)
    x = torch.cat([b[0] for b in batches])
    x0, x2 = _layer_inputs(model, x)
    assert set(stats) == {"0", "2"}
    # layer 0 has a bias: the augmented input [x; 1], so the last row/column hold Σx and the count
    assert stats["0"].has_bias and stats["0"].dim == 4 and stats["0"].count == 15
    np.testing.assert_allclose(stats["0"].second_moment_sum.numpy(), _gram(x0, True), rtol=1e-6)
    assert stats["0"].second_moment_sum[-1, -1].item() == 15.0
    # layer 2 has no bias: no constant column
    assert not stats["2"].has_bias and stats["2"].dim == 4 and stats["2"].count == 15
    np.testing.assert_allclose(stats["2"].second_moment_sum.numpy(), _gram(x2, False), rtol=1e-5)
    np.testing.assert_allclose(stats["2"].covariance.numpy(), _gram(x2, False) / 15, rtol=1e-5)
    assert stats["0"].second_moment_sum.dtype == torch.float64


def test_max_batches_and_layer_selection():
    model, batches = _mlp(), _batches(count=4)
    stats = collect_activation_stats(model, batches, layers=["2"], max_batches=2)
    assert list(stats) == ["2"]
    _, x2 = _layer_inputs(model, torch.cat([b[0] for b in batches[:2]]))
    assert stats["2"].count == 10
    np.testing.assert_allclose(stats["2"].second_moment_sum.numpy(), _gram(x2, False), rtol=1e-5)


def test_sequence_inputs_are_flattened_and_masked_positions_left_out():
    model = nn.Linear(3, 2)
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    batch = {"input_ids": x, "attention_mask": mask}
    stats = collect_activation_stats(model, [batch], forward=lambda m, b: m(b["input_ids"]))
    kept = x[mask.bool()].double().numpy()  # the 5 unmasked positions
    assert stats[""].count == 5
    np.testing.assert_allclose(stats[""].second_moment_sum.numpy(), _gram(kept, True), rtol=1e-6)
    plain = collect_activation_stats(model, [x])  # a tensor batch: every position counts
    assert plain[""].count == 8
    flat = x.reshape(-1, 3).double().numpy()
    np.testing.assert_allclose(plain[""].second_moment_sum.numpy(), _gram(flat, True), rtol=1e-6)


def test_collection_runs_in_eval_mode_and_restores_the_modes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.9), nn.Linear(3, 2))
    model.train()
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(3))
    stats = collect_activation_stats(model, [(x, None)])
    # dropout off: the linear layer saw x itself
    np.testing.assert_allclose(
        stats["1"].second_moment_sum.numpy(), _gram(x.double().numpy(), True), rtol=1e-6
    )
    assert all(m.training for m in model.modules())
    assert not model[1]._forward_pre_hooks


def test_pooled_statistics_add():
    model, batches = _mlp(), _batches(count=4)
    first = collect_activation_stats(model, batches[:2])
    second = collect_activation_stats(model, batches[2:])
    both = collect_activation_stats(model, batches)
    pooled = first["0"] + second["0"]
    assert pooled.count == both["0"].count == 20
    assert torch.allclose(pooled.second_moment_sum, both["0"].second_moment_sum)
    with pytest.raises(InputError, match=r"cannot pool statistics of dim 4 \(bias False\)"):
        first["0"] + first["2"]


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (["nope"], "layers: no module 'nope' (linear layers: '0', '2')"),
        (["1"], "layers: '1' is a Tanh, not an nn.Linear (linear layers: '0', '2')"),
        ("0", "layers must be a non-empty list of layer names, got '0'"),
    ],
)
def test_bad_layer_names_are_rejected(layers, message):
    with pytest.raises(InputError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        collect_activation_stats(_mlp(), _batches(), layers=layers)


def test_other_bad_input():
    model = _mlp()
    with pytest.raises(InputError, match="max_batches must be a positive int or None, got 0"):
        collect_activation_stats(model, _batches(), max_batches=0)
    with pytest.raises(InputError, match="batches gave no batch"):
        collect_activation_stats(model, [])
    bad = [(torch.ones(2, 3), None), (torch.tensor([[1.0, float("nan"), 0.0]]), None)]
    with pytest.raises(InputError, match="^layer '0': non-finite .* in batch 1"):
        collect_activation_stats(model, bad)
    assert not model[0]._forward_pre_hooks  # removed despite the error
    unused = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2)})
    with pytest.raises(InputError, match="layer 'b' saw no input"):
        collect_activation_stats(unused, [torch.ones(1, 3)], layers=["a", "b"], forward=_only_a)


def _only_a(model, batch):
    return model["a"](batch)


def test_save_and_load_round_trip(tmp_path):
    stats = collect_activation_stats(_mlp(), _batches())
    path = tmp_path / "sub" / "stats.pt"
    save_stats(stats, path)
    loaded = load_stats(path)
    assert list(loaded) == list(stats)
    for name, layer in stats.items():
        assert loaded[name].count == layer.count and loaded[name].has_bias == layer.has_bias
        assert torch.equal(loaded[name].second_moment_sum, layer.second_moment_sum)
    assert os.listdir(path.parent) == ["stats.pt"]  # no temporary file left


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "stats.pt"
    save_stats({"fc": ActivationStats(torch.eye(2), 5, has_bias=False)}, path)
    before = path.read_bytes()

    def half_written(obj, target):
        with open(target, "wb") as handle:
            handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_stats({"fc": ActivationStats(3 * torch.eye(2), 7, has_bias=False)}, path)
    with pytest.raises(OSError, match="disk full"):
        save_stats({"fc": ActivationStats(torch.eye(2), 1, has_bias=False)}, tmp_path / "new.pt")
    assert path.read_bytes() == before  # the old file is intact
    assert os.listdir(tmp_path) == ["stats.pt"]  # no new file, no temporary file left
    monkeypatch.undo()
    assert load_stats(path)["fc"].count == 5


def test_load_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(InputError, match="statistics file not found"):
        load_stats(tmp_path / "missing.pt")
    torch.save({"weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(InputError, match="is not an activation statistics file"):
        load_stats(tmp_path / "other.pt")
    with pytest.raises(InputError, match="layer 'fc': expected ActivationStats, got Tensor"):
        save_stats({"fc": torch.eye(2)}, tmp_path / "x.pt")


@pytest.mark.parametrize(
    ("matrix", "count", "message"),
    [
        (torch.diag(torch.tensor([1.0, -1.0])), 4, "^layer 'bad': the covariance is not positive"),
        (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), 4, "^layer 'bad': .* non-finite"),
        (torch.tensor([[1.0, float("inf")], [0.0, 1.0]]), 4, "^layer 'bad': .* non-finite"),
        (torch.tensor([[1.0, 0.5], [0.0, 1.0]]), 4, "^layer 'bad': the covariance is not symm"),
        (torch.eye(2), 0, r"^layer 'bad': no samples \(count 0\)"),
        (torch.eye(2), 1, "^layer 'bad': 1 samples for a 2-dim covariance"),
    ],
)
def test_check_stats_names_the_layer(matrix, count, message):
    good = ActivationStats(torch.eye(2), 4, has_bias=False)
    with pytest.raises(InputError, match=message):
        check_stats({"good": good, "bad": ActivationStats(matrix, count, has_bias=False)})


def test_check_stats_accepts_psd_and_regularised_rank_deficient():
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    rank_deficient = ActivationStats(x.T @ x, 3, has_bias=False)
    check_stats({"x": rank_deficient}, ridge=1e-6)
    check_stats({"x": rank_deficient}, count=False)
    with pytest.raises(InputError, match="ridge must be a number >= 0, got -1"):
        check_stats({"x": rank_deficient}, ridge=-1)


def test_activation_stats_validates_its_fields():
    with pytest.raises(InputError, match=r"square matrix, got \(2, 3\)"):
        ActivationStats(torch.zeros(2, 3), 1, has_bias=False)
    with pytest.raises(InputError, match="count must be an int >= 0, got -1"):
        ActivationStats(torch.eye(2), -1, has_bias=False)
    with pytest.raises(InputError, match="count 0"):
        _ = ActivationStats(torch.eye(2), 0, has_bias=False).covariance


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
        self.unused = nn.Linear(2, 2)  # never called: zero Fisher

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return _Classifier()


def _log_likelihood(model, batch):
    x, y = batch
    return torch.log_softmax(model(x), dim=-1).gather(1, y[:, None])[:, 0]


def test_collect_fisher_is_the_mean_squared_per_example_gradient():
    model = _classifier()
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 3, generator=g), torch.randint(0, 3, (4,), generator=g))] * 2
    batches[1] = (torch.randn(3, 3, generator=g), torch.randint(0, 3, (3,), generator=g))
    fisher = collect_fisher(model, batches, _log_likelihood)

    expected = {
        name: torch.zeros_like(p, dtype=torch.float64) for name, p in model.named_parameters()
    }
    examples = [(x[n : n + 1], y[n : n + 1]) for x, y in batches for n in range(len(x))]
    for example in examples:
        model.zero_grad()
        _log_likelihood(model, example).sum().backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                expected[name] += p.grad.double() ** 2
    assert set(fisher) == set(expected)
    for name, value in fisher.items():
        assert value.dtype == torch.float64
        assert torch.allclose(value, expected[name] / len(examples), rtol=1e-5, atol=1e-12), name
    assert not fisher["unused.weight"].any()
    assert fisher["net.0.weight"].abs().sum() > 0

    first = collect_fisher(model, batches, _log_likelihood, max_batches=1)
    x, y = batches[0]
    manual = torch.zeros_like(first["net.2.bias"])
    for n in range(len(x)):
        model.zero_grad()
        _log_likelihood(model, (x[n : n + 1], y[n : n + 1])).sum().backward()
        manual += model.net[2].bias.grad.double() ** 2
    assert torch.allclose(first["net.2.bias"], manual / len(x), rtol=1e-5)


def test_collect_fisher_bad_input():
    model = _classifier()
    batch = (torch.randn(2, 3), torch.tensor([0, 1]))
    with pytest.raises(InputError, match=r"must return a \(batch,\) tensor .* got \(\)"):
        collect_fisher(model, [batch], lambda m, b: _log_likelihood(m, b).sum())
    with pytest.raises(InputError, match="not finite in batch 0"):
        collect_fisher(model, [batch], lambda m, b: _log_likelihood(m, b) * float("inf"))
    with pytest.raises(InputError, match="no example"):
        collect_fisher(model, [], _log_likelihood)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(InputError, match="Linear has no trainable parameters"):
        collect_fisher(frozen, [batch], _log_likelihood)
