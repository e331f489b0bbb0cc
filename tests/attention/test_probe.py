"""The last-block probe, pooled block scores and the per-head metrics."""

import math

import pytest
import torch

from ada_modules.attention.probe import (
    concentration,
    coverage_count,
    last_block_probe,
    mid_zone_coverage,
    mid_zone_mass,
    normalized_entropy,
    pooled_block_scores,
    zone_masks,
)
from ada_modules.errors import InputError


@pytest.mark.parametrize("n", [2, 5, 64])
def test_entropy_is_zero_for_one_hot_and_one_for_uniform(n):
    one_hot = torch.zeros(n)
    one_hot[n // 2] = 1
    assert normalized_entropy(one_hot).item() == 0.0
    assert normalized_entropy(torch.full((n,), 1 / n)).item() == pytest.approx(1.0, abs=1e-6)
    # Normalised by the valid blocks: uniform over the first 2 of n is maximal for 2 valid.
    half = torch.zeros(n)
    half[:2] = 0.5
    assert normalized_entropy(half, num_valid=2).item() == pytest.approx(1.0, abs=1e-6)


def test_coverage_count_is_monotone_in_gamma(seed):
    p = torch.rand(6, 40).pow(4)
    p = p / p.sum(-1, keepdim=True)
    counts = torch.stack([coverage_count(p, g) for g in (0.1, 0.5, 0.8, 0.9, 0.99, 1.0)])
    assert (counts.diff(dim=0) >= 0).all()
    assert (counts[-1] <= 40).all() and (counts[0] >= 1).all()
    top = torch.sort(p, -1, descending=True).values.cumsum(-1)
    k = coverage_count(p, 0.8)
    assert (top.gather(-1, (k - 1)[:, None]) >= 0.8 - 1e-6).all()  # enough
    assert ((k == 1) | (top.gather(-1, (k - 2).clamp_min(0)[:, None])[:, 0] < 0.8)).all()  # fewest
    assert torch.allclose(concentration(p, 0.8), k / 40)


@pytest.mark.parametrize(
    ("sink", "local", "first", "last"), [(1, 2, 0, 9), (2, 1, 3, 7), (0, 4, 0, 5)]
)
def test_mid_zone_mass_and_sink_local_mass_sum_to_one(seed, sink, local, first, last):
    p = torch.rand(3, 10)
    p[:, :first] = 0
    p[:, last + 1 :] = 0
    p = p / p.sum(-1, keepdim=True)
    sink_local, mid = zone_masks(10, sink, local, first=first, last=last)
    mid_mass = mid_zone_mass(p, sink, local, first=first, last=last)
    assert torch.allclose(mid_mass + (p * sink_local).sum(-1), torch.ones(3))
    assert not (sink_local & mid).any()
    everything = torch.ones(10, dtype=torch.bool)
    assert torch.allclose(
        mid_zone_coverage(p, everything, sink, local, first=first, last=last), torch.ones(3)
    )
    assert torch.allclose(
        mid_zone_coverage(p, ~everything, sink, local, first=first, last=last), torch.zeros(3)
    )


def _dense_last_rows(query, key, rows, scaling):
    """Reference: full causal attention of the last ``rows`` queries (GQA by repetition)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, 1)
    k_len = key.shape[2]
    scores = query[:, :, -rows:] @ key.transpose(-1, -2) * scaling
    positions = torch.arange(k_len - rows, k_len)[:, None]
    scores = scores.masked_fill(torch.arange(k_len) > positions, float("-inf"))
    return scores.softmax(-1)


def test_probe_matches_dense_attention_of_the_last_block_with_gqa(seed):
    query, key = torch.randn(2, 4, 96, 8), torch.randn(2, 2, 160, 8)
    probe = last_block_probe(query, key, block_size=32, scaling=0.5)
    reference = _dense_last_rows(query, key, 32, 0.5)
    vertical = reference.mean(2)
    assert torch.allclose(probe.vertical, vertical, atol=1e-6)
    assert torch.allclose(probe.block_probs, vertical.unflatten(-1, (5, 32)).sum(-1), atol=1e-6)
    assert torch.allclose(probe.slash.sum(-1), torch.ones(2, 4), atol=1e-5)
    assert torch.allclose(probe.slash_blocks.sum(-1), torch.ones(2, 4), atol=1e-5)
    assert probe.slash[..., 0].sub(reference.diagonal(128, -2, -1).mean(-1)).abs().max() < 1e-6
    assert probe.flops == 2 * 4 * 32 * 160 * 8
    assert probe.last_block.tolist() == [4, 4] and probe.first_block.tolist() == [0, 0]


def test_padding_keys_carry_no_mass_and_left_padding_shifts_the_probe(seed):
    query, key = torch.randn(1, 2, 128, 8), torch.randn(1, 2, 128, 8)
    pad = 64
    padded_q = torch.cat([torch.randn(1, 2, pad, 8), query], 2)
    padded_k = torch.cat([torch.randn(1, 2, pad, 8), key], 2)
    mask = torch.ones(1, 128 + pad, dtype=torch.bool)
    mask[:, :pad] = False
    plain = last_block_probe(query, key, block_size=32)
    padded = last_block_probe(padded_q, padded_k, block_size=32, key_padding_mask=mask)
    assert (padded.block_probs[..., :2] == 0).all()
    assert torch.allclose(padded.block_probs[..., 2:], plain.block_probs, atol=1e-6)
    assert padded.first_block.item() == 2 and padded.num_valid.item() == 4
    assert torch.allclose(padded.entropy(), plain.entropy(), atol=1e-6)


def test_right_padding_probes_the_last_real_queries(seed):
    query, key = torch.randn(1, 1, 100, 8), torch.randn(1, 1, 100, 8)
    mask = torch.ones(1, 100, dtype=torch.bool)
    mask[:, 80:] = False
    probe = last_block_probe(query, key, block_size=32, key_padding_mask=mask)
    reference = last_block_probe(query[:, :, :80], key[:, :, :80], block_size=32)
    assert probe.last_query.item() == 79 and probe.last_block.item() == 2
    assert torch.allclose(probe.block_probs[..., :3], reference.block_probs, atol=1e-6)


def test_pooled_block_scores_are_causal_row_distributions(seed):
    query, key = torch.randn(1, 4, 64, 8), torch.randn(1, 2, 128, 8)  # a later chunk
    scores = pooled_block_scores(query, key, block_size=32)
    assert scores.shape == (1, 4, 2, 4)
    assert torch.allclose(scores.sum(-1), torch.ones(1, 4, 2), atol=1e-6)
    assert (scores[..., 0, 3] == 0).all() and (scores[..., 1, :] > 0).all()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: coverage_count(torch.rand(4), 0.0), "gamma"),
        (lambda: coverage_count(torch.rand(4), 1.5), "gamma"),
        (lambda: zone_masks(4, -1, 1), "sink_blocks"),
        (
            lambda: last_block_probe(
                torch.randn(1, 3, 8, 4), torch.randn(1, 2, 8, 4), block_size=16
            ),
            "multiple",
        ),
        (
            lambda: last_block_probe(
                torch.randn(1, 2, 9, 4), torch.randn(1, 2, 8, 4), block_size=16
            ),
            "query length",
        ),
        (
            lambda: last_block_probe(torch.randn(2, 2, 8), torch.randn(2, 2, 8), block_size=16),
            "4-d",
        ),
        (
            lambda: last_block_probe(
                torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), block_size=24
            ),
            "block_size",
        ),
        (
            lambda: last_block_probe(
                torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), block_size=16, scaling=-1.0
            ),
            "scaling",
        ),
        (
            lambda: last_block_probe(
                torch.randn(1, 2, 8, 4),
                torch.randn(1, 2, 8, 4),
                block_size=16,
                key_padding_mask=torch.ones(1, 8),
            ),
            "key_padding_mask",
        ),
    ],
)
def test_bad_input_raises_input_error(call, message):
    with pytest.raises(InputError, match=message):
        call()


def test_js_bound_and_entropy_range(seed):
    from ada_modules.attention.probe import js_divergence

    p, q = torch.rand(5, 7), torch.rand(5, 7)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    js = js_divergence(p, q)
    assert (js >= 0).all() and (js <= math.log(2) + 1e-6).all()
    assert torch.allclose(js_divergence(p, p), torch.zeros(5), atol=1e-6)
    entropy = normalized_entropy(p)
    assert ((entropy >= 0) & (entropy <= 1)).all()
