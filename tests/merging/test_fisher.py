"""Fisher merging against the weighted-average formula written out by hand."""

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.merging import fisher_merge


def _members():
    a = {"w": torch.tensor([1.0, 2.0, -1.0]), "buf": torch.tensor([1.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([5.0, 0.0, 3.0]), "buf": torch.tensor([4.0]), "n": torch.tensor(9)}
    fa = {"w": torch.tensor([3.0, 0.5, 0.0])}
    fb = {"w": torch.tensor([1.0, 1.5, 0.0])}
    return a, b, fa, fb


def test_weighted_fisher_average():
    a, b, fa, fb = _members()
    merged = fisher_merge([a, b], [fa, fb], weights=[1.0, 2.0], eps=0.5)
    # entry 0: (1·3.5·1 + 2·1.5·5) / (1·3.5 + 2·1.5) = 18.5 / 6.5
    # entry 1: (1·1.0·2 + 2·2.0·0) / (1·1.0 + 2·2.0) = 2 / 5
    # entry 2: both Fishers 0, so eps alone: (1·0.5·(-1) + 2·0.5·3) / (0.5 + 1) = 2.5 / 1.5
    expected = torch.tensor([18.5 / 6.5, 2 / 5, 2.5 / 1.5])
    assert torch.allclose(merged["w"], expected)
    # no Fisher for "buf": the weighted mean (1 + 2·4) / 3; integers from the first member
    assert torch.allclose(merged["buf"], torch.tensor([3.0]))
    assert merged["n"].item() == 3


def test_eps_floor():
    a, b, fa, fb = _members()
    exact = fisher_merge([a, b], [fa, fb], eps=0.0)["w"]
    assert torch.allclose(exact[:2], torch.tensor([(3 * 1 + 5) / 4, (0.5 * 2) / 2.0]))
    assert torch.isnan(exact[2])  # 0 / 0 where every Fisher is 0
    floored = fisher_merge([a, b], [fa, fb])["w"]  # eps 1e-8
    assert torch.allclose(floored[:2], exact[:2])
    assert floored[2].item() == pytest.approx(1.0)  # the plain mean of -1 and 3
    # a huge eps swamps the Fishers: the plain mean
    assert torch.allclose(
        fisher_merge([a, b], [fa, fb], eps=1e9)["w"], torch.tensor([3.0, 1.0, 1.0])
    )


def test_equal_fishers_give_the_plain_average():
    a, b, _, _ = _members()
    g = torch.Generator().manual_seed(0)
    same = {"w": torch.rand(3, generator=g) + 0.1}
    merged = fisher_merge([a, b], [same, {"w": same["w"].clone()}], eps=0.0)
    assert torch.allclose(merged["w"], (a["w"] + b["w"]) / 2)
    weighted = fisher_merge([a, b], [same, same], weights=[3.0, 1.0], eps=0.0)
    assert torch.allclose(weighted["w"], (3 * a["w"] + b["w"]) / 4)


def test_dtypes_kept_and_inputs_untouched():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    b = {"w": torch.tensor([3.0, 4.0], dtype=torch.bfloat16)}
    fa, fb = {"w": torch.tensor([1.0, 3.0])}, {"w": torch.tensor([1.0, 1.0])}
    merged = fisher_merge([a, b], [fa, fb], eps=0.0)
    assert merged["w"].dtype == torch.bfloat16
    assert merged["w"].tolist() == [2.0, 2.5]
    assert a["w"].tolist() == [1.0, 2.0] and fa["w"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize(
    ("fishers", "kwargs", "message"),
    [
        (lambda fa, fb: [fa], {}, r"one Fisher dict per member \(2\)"),
        (lambda fa, fb: [fa, {"w": -fb["w"]}], {}, "fishers.1.: key 'w' has negative"),
        (lambda fa, fb: [fa, {"w": torch.ones(2)}], {}, r"key 'w' has shape \(2,\), the param"),
        (lambda fa, fb: [fa, {}], {}, "fishers.1. lacks key 'w', which others have"),
        (lambda fa, fb: [fa, {**fb, "n": torch.ones(())}], {}, "key 'n' is not a floating"),
        (lambda fa, fb: [fa, fb], {"weights": [0.0, 0.0]}, "not all 0"),
        (lambda fa, fb: [fa, fb], {"weights": [1.0, -1.0]}, "weights must be >= 0"),
        (lambda fa, fb: [fa, fb], {"eps": -1.0}, "eps must be a number >= 0, got -1.0"),
    ],
)
def test_bad_input(fishers, kwargs, message):
    a, b, fa, fb = _members()
    with pytest.raises(InputError, match=message):
        fisher_merge([a, b], fishers(fa, fb), **kwargs)


def test_incompatible_members_are_rejected():
    a, b, fa, fb = _members()
    b["w"] = torch.zeros(4)
    with pytest.raises(InputError, match="^member 1: key 'w' has shape"):
        fisher_merge([a, b], [fa, fb])
    with pytest.raises(InputError, match="non-empty list"):
        fisher_merge([], [])
