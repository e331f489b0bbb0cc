import pytest
import torch

from ada_modules.attention.dispatch import REGIMES
from ada_modules.data.planted_attention import (
    HEAD_KINDS,
    PlantedAttentionDataModule,
    planted_attention,
)
from ada_modules.errors import InputError

L = 256


def _layer(seed: int, regime: str = "retrieval", **kwargs):
    kwargs = {"num_heads": 4, "head_dim": 32, "needle_heads": 2, **kwargs}
    return planted_attention(
        L, regime=regime, generator=torch.Generator().manual_seed(seed), **kwargs
    )


def _dense_probs(layer) -> torch.Tensor:
    scores = layer.query @ layer.key.transpose(-1, -2) / layer.query.shape[-1] ** 0.5
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def test_generator_is_deterministic_per_seed():
    a, b, c = _layer(0), _layer(0), _layer(1)
    for name in ("query", "key", "value", "head_kind", "needle_target"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.key, c.key)


def test_shapes_and_labels():
    layer = _layer(3, num_needles=3)
    assert layer.query.shape == layer.key.shape == layer.value.shape == (4, L, 32)
    kinds = [HEAD_KINDS[k] for k in layer.head_kind]
    assert kinds.count("needle") == 2 and REGIMES[layer.regime] == "retrieval"
    for h, kind in enumerate(kinds):
        starts, target = layer.needle_positions[h], layer.needle_target[h]
        if kind != "needle":
            assert (starts == -1).all() and (target == -1).all()
            continue
        assert ((starts >= L // 8) & (starts < L // 2)).all()  # mid context
        rows = (target >= 0).nonzero().squeeze(-1)
        assert len(rows) > 0 and (rows >= 5 * L // 8).all()
        assert set(target[rows].tolist()) <= set(starts.tolist())
        assert (rows >= L - 32).any()  # the last rows always ask (a question at the end)
        # The last span (L / 8 = 32 rows here: one probe block of 32) reads half of the needles;
        # the others are read only by earlier rows, which a last-block probe never sees.
        last = set(target[L - 32 :][target[L - 32 :] >= 0].tolist())
        earlier = set(target[: L - 32][target[: L - 32] >= 0].tolist())
        assert len(last) == 3 // 2 and not last & earlier
        assert last | earlier == set(starts.tolist())  # every needle is read by some row
    structure = _layer(3, regime="structure")
    assert HEAD_KINDS.index("needle") not in structure.head_kind
    assert (structure.needle_target == -1).all()


def test_without_earlier_spans_the_last_span_reads_every_needle():
    layer = _layer(4, needle_query_spans=0)
    for h in (layer.needle_target >= 0).any(-1).nonzero().squeeze(-1).tolist():
        target = layer.needle_target[h]
        assert ((target >= 0).nonzero() >= L - 32).all()
        assert set(target[target >= 0].tolist()) <= set(layer.needle_positions[h].tolist())


def test_needle_heads_put_their_dense_mass_on_the_needles():
    masses = []
    for seed in range(3):
        layer = _layer(seed)
        probs = _dense_probs(layer)
        span = int(layer.needle_span)
        for h, i in (layer.needle_target >= 0).nonzero().tolist():
            start = layer.needle_target[h, i]
            masses.append(probs[h, i, start : start + span].sum().item())
    masses = torch.tensor(masses)
    assert masses.mean() > 0.7 and masses.median() > 0.8


def test_local_heads_are_local_and_diffuse_heads_are_not():
    probs, kinds = [], []
    for seed in range(4):
        layer = _layer(seed, regime="structure")
        probs.append(_dense_probs(layer))
        kinds += [HEAD_KINDS[k] for k in layer.head_kind]
    probs = torch.cat(probs)
    i, j = torch.arange(L)[:, None], torch.arange(L)
    a_shape = ((j < 4) | (i - j < 32)).float()
    kept = (probs * a_shape).sum(-1)[:, L // 2 :].mean(-1)  # late rows, per head
    for kind, value in zip(kinds, kept.tolist(), strict=True):
        if kind == "sink_local":
            assert value > 0.6, value
        if kind == "diffuse":
            assert value < 0.5, value


def test_datamodule_splits_are_disjoint_and_mixed_draws_both_regimes(monkeypatch):
    dm = PlantedAttentionDataModule(
        seq_len=L, num_heads=2, head_dim=32, needle_heads=1, num_fit=8, num_test=2, seed=5
    )
    assert not set(dm.split_seeds["train"]) & set(dm.split_seeds["test"])
    dm.setup("fit")
    regimes = {int(x["regime"]) for x in dm.datasets["train"]}
    assert regimes == {0, 1}
    again = PlantedAttentionDataModule(
        seq_len=L, num_heads=2, head_dim=32, needle_heads=1, num_fit=3, num_test=2, seed=5
    )
    again.setup("test")
    assert torch.equal(again.datasets["test"][1]["key"], dm.datasets["test"][1]["key"])
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert PlantedAttentionDataModule(seq_len=L, seed=None).seed == 7


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"regime": "haystack"}, "regime"),
        ({"seq_len": 100}, "seq_len"),
        ({"needle_heads": 9}, "needle_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"num_fit": 0}, "num_fit"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    with pytest.raises(InputError, match=name):
        PlantedAttentionDataModule(**kwargs)
