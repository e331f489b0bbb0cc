"""Average Attention Distance: exact values on hand-built attention, padding, sinks, profiles."""

import json
import math
import re

import pytest
import torch

from ada_modules.kv import AADAccumulator, AADProfile, average_attention_distance


def uniform(length: int) -> torch.Tensor:
    """Causal attention spreading each query evenly over all keys up to itself."""
    return torch.tril(torch.ones(length, length)) / torch.arange(1, length + 1)[:, None]


def one_hot_first(length: int) -> torch.Tensor:
    """Every query looks only at token 0 (the farthest key)."""
    attn = torch.zeros(length, length)
    attn[:, 0] = 1.0
    return attn


def nan_equal(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-6) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan())) and torch.allclose(
        a.nan_to_num(0.0), b.nan_to_num(0.0), atol=atol
    )


def reference(attn, mask, normalize, sink_tokens, renormalize):
    """Loop version of the definition in the module docstring."""
    batch, heads, length, _ = attn.shape
    out = torch.full((batch, heads, length), math.nan)
    for b in range(batch):
        real = [i for i in range(length) if mask is None or mask[b, i]]
        pos = {i: k for k, i in enumerate(real)}
        for h in range(heads):
            for t in real:
                keys = [j for j in real if j <= t and pos[j] >= sink_tokens]
                if not keys:
                    continue
                mass = sum(float(attn[b, h, t, j]) for j in keys)
                value = sum(float(attn[b, h, t, j]) * (pos[t] - pos[j]) for j in keys)
                if renormalize and sink_tokens:
                    if mass <= 0:
                        continue
                    value /= mass
                scale = {"none": 1, "position": pos[t], "max": pos[t] - sink_tokens}[normalize]
                if scale <= 0:
                    continue
                out[b, h, t] = value / scale
    return out


def test_uniform_attention_has_half_the_distance():
    aad = average_attention_distance(uniform(6)[None, None])
    assert torch.allclose(aad[0, 0], torch.arange(6) / 2)
    naad = average_attention_distance(uniform(6)[None, None], normalize="position")
    assert math.isnan(naad[0, 0, 0])
    assert torch.allclose(naad[0, 0, 1:], torch.full((5,), 0.5))


def test_diagonal_attention_has_zero_distance():
    aad = average_attention_distance(torch.eye(5)[None, None].repeat(2, 3, 1, 1))
    assert aad.shape == (2, 3, 5)
    assert torch.equal(aad, torch.zeros(2, 3, 5))


def test_one_hot_far_attention_has_the_largest_distance():
    attn = one_hot_first(5)[None, None]
    assert torch.equal(average_attention_distance(attn)[0, 0], torch.arange(5.0))
    naad = average_attention_distance(attn, normalize="position")[0, 0]
    assert torch.equal(naad[1:], torch.ones(4))


def test_attention_above_the_diagonal_is_ignored():
    attn = uniform(4) + torch.triu(torch.full((4, 4), 7.0), diagonal=1)
    assert torch.allclose(average_attention_distance(attn[None, None])[0, 0], torch.arange(4) / 2)


def test_sink_exclusion_renormalized_and_not():
    attn = torch.stack([uniform(5), one_hot_first(5)])[None]  # heads: uniform, sink-only
    renorm = average_attention_distance(attn, sink_tokens=1)
    # Uniform over keys 1..t: mean distance (t - 1) / 2; the sink-only head has no mass left.
    assert nan_equal(renorm[0, 0], torch.tensor([math.nan, 0.0, 0.5, 1.0, 1.5]))
    assert renorm[0, 1].isnan().all()
    dropped = average_attention_distance(attn, sink_tokens=1, renormalize=False)
    t = torch.arange(5.0)
    expected = t * (t - 1) / 2 / (t + 1)
    expected[0] = math.nan
    assert nan_equal(dropped[0, 0], expected)
    assert nan_equal(dropped[0, 1], torch.tensor([math.nan, 0.0, 0.0, 0.0, 0.0]))
    # "max" divides by the largest distance a counted key allows, t - sink_tokens.
    by_max = average_attention_distance(attn, sink_tokens=1, normalize="max")
    assert nan_equal(by_max[0, 0], torch.tensor([math.nan, math.nan, 0.5, 0.5, 0.5]))
    by_pos = average_attention_distance(attn, sink_tokens=1, normalize="position")
    assert nan_equal(by_pos[0, 0], torch.tensor([math.nan, 0.0, 0.25, 1 / 3, 0.375]))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_is_ignored_and_positions_are_real(side):
    length, pad = 5, 2
    clean = uniform(length)
    padded = torch.full((length + pad, length + pad), 0.3)  # junk on padding rows and columns
    mask = torch.ones(1, length + pad, dtype=torch.long)
    rows = slice(pad, None) if side == "left" else slice(0, length)
    padded[rows, rows] = clean
    padded[rows, : pad if side == "left" else 0] = 0.0
    mask[0, : pad if side == "left" else 0] = 0
    mask[0, length:] = 0 if side == "right" else 1
    aad = average_attention_distance(padded[None, None], mask, normalize="position")[0, 0]
    expected = average_attention_distance(clean[None, None], normalize="position")[0, 0]
    assert nan_equal(aad[rows], expected)
    pad_rows = aad[:pad] if side == "left" else aad[length:]
    assert pad_rows.isnan().all()


@pytest.mark.parametrize("normalize", ["none", "position", "max"])
@pytest.mark.parametrize("sink_tokens,renormalize", [(0, True), (2, True), (2, False)])
def test_matches_a_loop_reference_on_random_padded_attention(normalize, sink_tokens, renormalize):
    gen = torch.Generator().manual_seed(0)
    batch, heads, length = 3, 2, 7
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    mask[2, 5:] = 0  # right padding
    scores = torch.randn(batch, heads, length, length, generator=gen)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    allowed = causal & mask.bool()[:, None, None, :]
    attn = scores.masked_fill(~allowed, -math.inf).softmax(-1).nan_to_num(0.0)
    got = average_attention_distance(
        attn, mask, normalize=normalize, sink_tokens=sink_tokens, renormalize=renormalize
    )
    want = reference(attn, mask, normalize, sink_tokens, renormalize)
    assert nan_equal(got, want, atol=1e-5)


def test_accumulator_aligns_left_padded_rows_and_summarises_layers():
    length = 6
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    short = torch.zeros(length, length)
    short[2:, 2:] = uniform(4)
    layer0 = torch.stack([short, uniform(length)])[:, None].repeat(1, 2, 1, 1)  # (2, 2, T, T)
    layer1 = torch.eye(length)[None, None].repeat(2, 2, 1, 1)
    acc = AADAccumulator()
    acc.update([layer0, layer1], mask)
    profile = acc.compute()
    assert profile.counts.tolist() == [2, 2, 2, 2, 1, 1]
    assert torch.allclose(profile.aad[0, 0], torch.arange(length) / 2)
    assert torch.allclose(profile.layer_mean(), torch.tensor([0.5, 0.0]))
    assert torch.allclose(profile.layer_std(), torch.tensor([0.0, 0.0]))
    assert torch.allclose(profile.layer_mean(normalized=False), torch.tensor([1.25, 0.0]))


def test_layer_std_is_the_fluctuation_over_positions():
    # Head 0 looks one token back, head 1 at token 0: head-mean nAAD(t) = (1/t + 1) / 2.
    length = 5
    back = torch.diag(torch.ones(length - 1), -1)
    back[0, 0] = 1.0
    acc = AADAccumulator()
    acc.update([torch.stack([back, one_hot_first(length)])[None]])
    curve = (1 / torch.arange(1.0, length) + 1) / 2
    profile = acc.compute()
    assert torch.allclose(profile.layer_mean(), curve.mean()[None])
    assert torch.allclose(profile.layer_std(), curve.std(unbiased=False)[None])


def test_profile_json_and_accumulator_state_round_trip(tmp_path):
    acc = AADAccumulator(normalize="max", sink_tokens=1, renormalize=False)
    acc.update([uniform(5)[None, None], one_hot_first(5)[None, None]])
    restored = AADAccumulator()
    restored.load_state_dict(acc.state_dict())
    profile = restored.compute(metadata={"step": 3})
    assert restored.normalize == "max" and profile.metadata == {"num_batches": 1, "step": 3}
    path = tmp_path / "aad.json"
    profile.to_json(path)
    loaded = AADProfile.from_json(path)
    assert nan_equal(loaded.naad, profile.naad) and nan_equal(loaded.aad, profile.aad)
    assert (loaded.normalize, loaded.sink_tokens, loaded.renormalize) == ("max", 1, False)
    assert torch.allclose(loaded.layer_mean(), profile.layer_mean())


def test_bad_input_raises_naming_the_value():
    with pytest.raises(ValueError, match="attn must have shape"):
        average_attention_distance(torch.ones(3, 3))
    with pytest.raises(ValueError, match="normalize"):
        average_attention_distance(uniform(3)[None, None], normalize="t")
    with pytest.raises(ValueError, match="sink_tokens"):
        average_attention_distance(uniform(3)[None, None], sink_tokens=-1)
    with pytest.raises(ValueError, match="attention_mask"):
        average_attention_distance(uniform(3)[None, None], torch.ones(1, 4))
    with pytest.raises(ValueError, match="'none'"):
        AADAccumulator(normalize="none")
    acc = AADAccumulator()
    with pytest.raises(RuntimeError, match="before any update"):
        acc.compute()
    acc.update([uniform(3)[None, None]])
    with pytest.raises(ValueError, match="heads"):
        acc.update([uniform(3)[None, None].repeat(1, 2, 1, 1)])


def _profile_dict() -> dict:
    acc = AADAccumulator()
    acc.update([uniform(4)[None, None], one_hot_first(4)[None, None]])
    return acc.compute().to_dict()


def _set(path: tuple, value):
    def edit(data: dict) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set(("naad", 0, 0, 2), math.nan), r"'naad\[0\]\[0\]\[2\]' must be a finite number"),
        (_set(("aad", 1, 0, 3), -1.0), r"'aad\[1\]\[0\]\[3\]' must be a finite number >= 0"),
        (_set(("aad", 1, 0, 3), "7"), r"'aad\[1\]\[0\]\[3\]' must be a number or null"),
        (_set(("layer_mean", 1), math.nan), r"'layer_mean\[1\]' must be a finite number"),
        (_set(("layer_std", 0), math.inf), r"'layer_std\[0\]' must be a finite number"),
        (_set(("layer_mean_tokens", 0), "x"), r"'layer_mean_tokens\[0\]' must be a number"),
        (_set(("head_mean", 1, 0), math.nan), r"'head_mean\[1\]\[0\]' must be a finite"),
        (_set(("layer_mean", 0), 0.9), r"'layer_mean\[0\]' is 0.9 but .* give 0.5"),
        (_set(("layer_std_tokens",), 3), "'layer_std_tokens' must be a list of shape"),
        (_set(("num_layers",), 3), "'num_layers' is 3 but 'aad' has 2 layers"),
        (_set(("counts",), [1, 1]), "'counts' must be a list of 4 whole numbers"),
        (_set(("counts", 1), 0.5), r"'counts' must be a list of 4 whole numbers .* 0.5"),
        (_set(("sink_tokens",), 1.5), "'sink_tokens' must be an integer >= 0, got 1.5"),
        (_set(("normalize",), "none"), "'normalize' must be 'position' or 'max'"),
        (_set(("renormalize",), "yes"), "'renormalize' must be true or false"),
        (lambda data: data.pop("naad"), "'naad' is missing"),
        (
            lambda data: data["aad"][0].append([0.1] * 4),
            r"'aad\[1\]' has 1 entries but the others at this level have 2",
        ),
    ],
)
def test_profile_load_errors_name_the_file_and_the_field(tmp_path, edit, match):
    # Issue 13: NaN/inf/wrong types in summary fields were silently ignored, and load errors
    # did not name the file.
    from ada_modules.errors import InputError
    from ada_modules.kv import AdaKVQCache

    data = _profile_dict()
    AADProfile.from_dict(data)  # the unedited dict loads
    edit(data)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))  # NaN and Infinity as JSON's non-standard literals
    with pytest.raises(InputError, match=f"AAD profile {re.escape(str(path))}: field {match}"):
        AADProfile.from_json(path)
    with pytest.raises(InputError, match=f"AAD profile {re.escape(str(path))}: field {match}"):
        AdaKVQCache(profile=str(path), budget=4.0, num_layers=2)


def test_profile_that_is_not_json_names_the_file(tmp_path):
    from ada_modules.errors import InputError

    path = tmp_path / "broken.json"
    path.write_text('{"aad": [')
    with pytest.raises(InputError, match=f"AAD profile {re.escape(str(path))} is not valid JSON"):
        AADProfile.from_json(path)
    path.write_text("[1, 2]")
    with pytest.raises(
        InputError, match=f"AAD profile {re.escape(str(path))} must be a JSON object"
    ):
        AADProfile.from_json(path)
