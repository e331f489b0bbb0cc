"""RopeDrift KV data: the RoPE convention, the generator, the drift premise and the DataModule."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from ada_modules.data import RopeDriftDataModule, apply_rope, drift_statistics, rope_drift_kv
from ada_modules.errors import InputError


def _sample(seed: int, **kwargs):
    return rope_drift_kv(512, generator=torch.Generator().manual_seed(seed), **kwargs)


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_apply_rope_matches_transformers_llama(base):
    q, k = torch.randn(2, 2, 3, 40, 16, generator=torch.Generator().manual_seed(0))
    config = LlamaConfig(hidden_size=48, num_attention_heads=3, rope_theta=base)
    positions = torch.arange(7, 47)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None].expand(2, -1))
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, positions, base), q_ref)
    torch.testing.assert_close(apply_rope(k, positions, base), k_ref)


def test_inverse_rope_recovers_the_input():
    x = torch.randn(3, 100, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(100) * 3.5
    torch.testing.assert_close(apply_rope(apply_rope(x, positions), positions, inverse=True), x)


def test_apply_rope_rejects_bad_shapes():
    with pytest.raises(InputError, match=r"\(5, 7\)"):
        apply_rope(torch.randn(5, 7), torch.arange(5))
    with pytest.raises(InputError, match=r"positions.*\(4,\)"):
        apply_rope(torch.randn(5, 8), torch.arange(4))


def test_sample_shapes_and_rope_consistency():
    sample = _sample(0, num_heads=3, head_dim=32, outlier_pairs=2, num_queries=10)
    assert sample.keys.shape == sample.keys_pre_rope.shape == sample.values.shape == (3, 512, 32)
    assert sample.queries.shape == (3, 10, 32)
    assert sample.outlier_channels.shape == (3, 4)
    assert all(t.dtype == torch.float32 for t in (sample.keys, sample.values, sample.queries))
    torch.testing.assert_close(sample.keys, apply_rope(sample.keys_pre_rope, torch.arange(512)))
    # Outlier pairs come from the low-frequency quarter of pairs (8 of 16) and pair up.
    pairs, partners = sample.outlier_channels.chunk(2, dim=1)
    assert ((pairs >= 8) & (pairs < 16)).all() and (partners == pairs + 16).all()


def test_generator_is_deterministic_and_seeds_differ():
    a, b, c = _sample(3), _sample(3), _sample(4)
    for name in ("keys", "values", "queries", "outlier_channels"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.keys, c.keys)


def test_outlier_channels_drift():
    sample = _sample(1)
    stats = drift_statistics(sample.keys, group_size=32)
    ratio = stats["range_ratio"]
    assert ratio.shape == (2, 64)
    outlier = torch.zeros_like(ratio, dtype=torch.bool)
    outlier[torch.arange(2)[:, None], sample.outlier_channels] = True
    assert ratio[outlier].mean() > 2 * ratio[~outlier].mean()
    assert stats["outlier_ratio_mean"] > 2 * stats["median_ratio"]
    assert 1.2 < stats["median_ratio"] < 2.0
    # Before RoPE the slow random walk alone barely drifts: the drift is RoPE's rotation.
    assert drift_statistics(sample.keys_pre_rope)["outlier_ratio_mean"] < 2.0


def test_queries_attend_neither_uniformly_nor_one_hot():
    sample = _sample(2)
    scores = sample.queries @ sample.keys.transpose(1, 2) / 64**0.5
    torch.testing.assert_close(scores.std(dim=-1, correction=0), torch.full((2, 64), 2.5))
    top = scores.softmax(dim=-1).amax(dim=-1)
    assert (top > 5 / 512).all() and (top < 0.95).all()


def test_drift_statistics_of_constant_and_noise_channels():
    keys = torch.randn(1, 256, 4)
    keys[..., 0] = 3.0
    ratio = drift_statistics(keys, group_size=16, top_k=1)["range_ratio"]
    assert ratio[0, 0] == 1.0 and (ratio[0, 1:] < 2.5).all()


def test_datamodule_splits_use_distinct_seeds_and_batch_shapes():
    small = {"num_tokens": 64, "head_dim": 16, "outlier_pairs": 2, "num_queries": 8, "seed": 5}
    dm = RopeDriftDataModule(num_train=3, num_val=2, num_test=2, batch_size=2, **small)
    seeds = [s for split in ("train", "val", "test") for s in dm.split_seeds[split]]
    assert len(seeds) == len(set(seeds)) == 7
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"keys", "values", "queries", "keys_pre_rope"}
    assert batch["keys"].shape == batch["keys_pre_rope"].shape == (2, 2, 64, 16)
    assert batch["queries"].shape == (2, 2, 8, 16) and batch["keys"].dtype == torch.float32
    held_out = torch.stack([item["keys"] for item in dm.datasets["test"]])
    train = torch.stack([item["keys"] for item in dm.datasets["train"]])
    assert not any(torch.equal(a, b) for a in held_out for b in train)
    # The held-out data does not depend on the number of calibration sequences.
    again = RopeDriftDataModule(num_train=1, num_val=2, num_test=2, **small)
    assert again.split_seeds["test"] == dm.split_seeds["test"]
    assert RopeDriftDataModule(seed=6).split_seeds["train"] != dm.split_seeds["train"][:1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"head_dim": 63}, "head_dim must be even.*63"),
        ({"head_dim": 16, "outlier_pairs": 5}, "outlier_pairs=5 exceeds the 4 low-frequency"),
        ({"num_tokens": 0}, "num_tokens must be an integer >= 1, got 0"),
        ({"outlier_mean": (20.0, 8.0)}, r"outlier_mean.*\(20.0, 8.0\)"),
        ({"aligned_fraction": 1.5}, "aligned_fraction.*1.5"),
        ({"num_val": 0}, "num_val must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(InputError, match=message):
        RopeDriftDataModule(**kwargs)


def test_all_frequencies_allow_more_outlier_pairs_and_group_size_is_checked():
    sample = rope_drift_kv(8, head_dim=16, outlier_pairs=6, low_frequency_outliers=False)
    assert sample.outlier_channels.shape == (2, 12)
    with pytest.raises(InputError, match="group_size=64 exceeds"):
        drift_statistics(sample.keys, group_size=64)


def test_fixed_layout_shares_outlier_channels_and_value_scales_across_splits():
    dm = RopeDriftDataModule(num_tokens=64, num_train=2, num_val=1, num_test=1, fixed_layout=True)
    dm.setup("fit")
    dm.setup("test")
    batches = [*dm.train_dataloader(), *dm.test_dataloader()]
    outliers = [
        set(b["keys_pre_rope"][0].abs().mean(1).topk(8, dim=-1).indices[0].tolist())
        for b in batches
    ]
    assert all(o == outliers[0] for o in outliers)
    scales = [b["values"][0].std(dim=1) for b in batches]
    assert torch.corrcoef(torch.stack([s.flatten() for s in scales]))[0, 1:].min() > 0.8
    assert not torch.equal(batches[0]["keys"], batches[1]["keys"])  # the noise still differs
