"""Instance-aware strengths (the MCR scaling rule's values, zero at/above the threshold,
monotonicity; the ``StrengthPredictor``'s bounds, initial value and gradients) and the collapse
measures (repeated n-grams, compressibility, parse failures), plus bad input."""

import math

import numpy as np
import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.steering import (
    StrengthPredictor,
    compression_ratio,
    mcr_scaled_strength,
    repeated_ngram_fraction,
    unparseable_fraction,
)

# ------------------------------------------------------------------ mcr_scaled_strength


def test_mcr_scaled_strength_values() -> None:
    mcr = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4])
    strength = mcr_scaled_strength(mcr, max_strength=2.0, threshold=0.4)
    torch.testing.assert_close(strength, torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0]))


@pytest.mark.parametrize("threshold", [0.3, 0.5, 1.0])
def test_mcr_scaled_strength_is_zero_at_and_above_the_threshold(threshold: float) -> None:
    mcr = torch.tensor([threshold, (threshold + 1) / 2, 1.0])
    assert torch.equal(mcr_scaled_strength(mcr, 5.0, threshold), torch.zeros(3))
    assert mcr_scaled_strength(torch.tensor([threshold - 0.01]), 5.0, threshold).item() > 0


def test_mcr_scaled_strength_is_non_increasing_and_bounded() -> None:
    mcr = torch.linspace(0, 1, 101)
    strength = mcr_scaled_strength(mcr, max_strength=8.0, threshold=0.6)
    assert (strength.diff() <= 0).all()
    assert (strength.diff()[:59] < 0).all()  # strictly decreasing below the threshold
    assert strength[0].item() == pytest.approx(8.0)
    assert ((strength >= 0) & (strength <= 8.0)).all()


def test_mcr_scaled_strength_max_zero_gives_zero() -> None:
    assert torch.equal(mcr_scaled_strength(torch.tensor([0.0, 0.2]), 0.0), torch.zeros(2))


@pytest.mark.parametrize("max_strength", [-1.0, math.nan, math.inf, "8", True, torch.ones(2)])
def test_mcr_scaled_strength_bad_max_strength_raises(max_strength: object) -> None:
    with pytest.raises(InputError, match="max_strength must be a finite number >= 0"):
        mcr_scaled_strength(torch.tensor([0.1]), max_strength)


@pytest.mark.parametrize("max_strength", [np.float32(2.0), torch.tensor(2.0), 2])
def test_mcr_scaled_strength_accepts_real_scalars(max_strength: object) -> None:
    strength = mcr_scaled_strength(torch.tensor([0.25, 0.9]), max_strength)
    torch.testing.assert_close(strength, torch.tensor([1.0, 0.0]))


def test_mcr_scaled_strength_of_a_list_raises() -> None:
    with pytest.raises(InputError, match="target_mcr must be a tensor, got list"):
        mcr_scaled_strength([0.1, 0.2], 2.0)


@pytest.mark.parametrize("threshold", [0.0, -0.1, 1.5, math.nan])
def test_mcr_scaled_strength_threshold_out_of_range_raises(threshold: float) -> None:
    with pytest.raises(InputError, match=r"threshold must be in \(0, 1\]"):
        mcr_scaled_strength(torch.tensor([0.1]), 4.0, threshold)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.5, 1.5])
def test_mcr_scaled_strength_mcr_outside_unit_interval_raises(bad: float) -> None:
    with pytest.raises(InputError, match=r"target_mcr must lie in \[0, 1\]"):
        mcr_scaled_strength(torch.tensor([0.1, bad]), 4.0)


# ------------------------------------------------------------------ StrengthPredictor


def test_predictor_starts_at_init_strength_for_any_input() -> None:
    torch.manual_seed(0)
    predictor = StrengthPredictor(hidden_size=8, width=4, max_strength=6.0, init_strength=1.5)
    hidden = 100 * torch.randn(5, 8)
    out = predictor(hidden, torch.tensor([0.0, 0.3, 0.5, 0.9, 1.0]))
    assert out.shape == (5,)
    torch.testing.assert_close(out, torch.full((5,), 1.5))


def test_predictor_output_stays_in_zero_to_max_strength() -> None:
    torch.manual_seed(0)
    predictor = StrengthPredictor(hidden_size=8, width=4, max_strength=3.0, init_strength=1.0)
    with torch.no_grad():
        predictor.mlp[-1].weight.normal_(0, 50.0)  # a far-from-init predictor
    out = predictor(1e3 * torch.randn(64, 8), torch.rand(64))
    assert ((out >= 0) & (out <= 3.0)).all()
    assert out.min() < 0.5 and out.max() > 2.5  # the bound is used on both sides


def test_predictor_gradients_reach_every_parameter() -> None:
    torch.manual_seed(0)
    predictor = StrengthPredictor(hidden_size=8, width=4, max_strength=4.0, init_strength=1.0)
    hidden, mcr = torch.randn(6, 8), torch.rand(6)
    predictor(hidden, mcr).sum().backward()
    last = predictor.mlp[-1]
    assert last.weight.grad.abs().sum() > 0 and last.bias.grad.abs().sum() > 0
    # the last layer starts at zero weight; after one step the gradient reaches every parameter
    optimizer = torch.optim.SGD(predictor.parameters(), lr=0.5)
    optimizer.step()
    optimizer.zero_grad()
    predictor(hidden, mcr).sum().backward()
    for name, parameter in predictor.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden_size": 0}, "hidden_size must be an int >= 1, got 0"),
        ({"hidden_size": 8.0}, "hidden_size must be an int >= 1, got 8.0"),
        ({"width": 0}, "width must be an int >= 1, got 0"),
        ({"max_strength": 0.0}, "max_strength must be a finite number > 0, got 0.0"),
        ({"max_strength": math.inf}, "max_strength must be a finite number > 0, got inf"),
        ({"max_strength": math.nan}, "max_strength must be a finite number > 0, got nan"),
        ({"init_strength": 0.0}, r"init_strength must be in \(0, max_strength=8.0\), got 0.0"),
        ({"init_strength": 8.0}, r"init_strength must be in \(0, max_strength=8.0\), got 8.0"),
        ({"max_strength": 2.0, "init_strength": 3.0}, "init_strength must be in"),
    ],
)
def test_predictor_bad_arguments_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(InputError, match=match):
        StrengthPredictor(**{"hidden_size": 8, **kwargs})


def test_predictor_accepts_real_scalar_strengths() -> None:
    predictor = StrengthPredictor(8, max_strength=np.float32(4.0), init_strength=torch.tensor(2.0))
    alpha = predictor(torch.randn(2, 8), torch.tensor([0.1, 0.9]))
    torch.testing.assert_close(alpha, torch.full((2,), 2.0))


def test_predictor_in_bfloat16_computes_in_its_parameter_dtype() -> None:
    """Lightning's ``bf16-true`` casts the predictor; its inputs may come in another dtype."""
    predictor = StrengthPredictor(8, max_strength=4.0, init_strength=1.0).to(torch.bfloat16)
    hidden = torch.randn(3, 8, requires_grad=True)
    alpha = predictor(hidden, torch.tensor([0.1, 0.5, 0.9]))
    assert alpha.dtype == torch.bfloat16 and alpha.shape == (3,)
    torch.testing.assert_close(alpha.float(), torch.ones(3), atol=0.02, rtol=0)
    alpha.sum().backward()
    assert all(p.grad is not None for p in predictor.parameters())


@pytest.mark.parametrize(
    ("hidden", "mcr", "match"),
    [
        (torch.randn(2, 9), torch.rand(2), r"hidden must be \(batch, 8\), got \(2, 9\)"),
        (torch.randn(8), torch.rand(1), r"hidden must be \(batch, 8\), got \(8,\)"),
        (torch.randn(2, 8), torch.rand(3), r"target_mcr must be \(batch,\) = \(2,\), got \(3,\)"),
        (
            torch.randn(2, 8),
            torch.rand(2, 1),
            r"target_mcr must be \(batch,\) = \(2,\), got \(2, 1\)",
        ),
        (torch.randn(2, 8), torch.tensor([math.nan, 0.5]), r"target_mcr must lie in \[0, 1\]"),
        (torch.randn(2, 8), torch.tensor([5.0, 0.5]), r"target_mcr must lie in \[0, 1\]"),
        ([[0.0] * 8], torch.rand(1), "hidden must be a tensor, got list"),
        (torch.randn(2, 8), [0.1, 0.2], "target_mcr must be a tensor, got list"),
    ],
)
def test_predictor_bad_inputs_raise(hidden: object, mcr: object, match: str) -> None:
    with pytest.raises(InputError, match=match):
        StrengthPredictor(8)(hidden, mcr)


# ------------------------------------------------------------------ collapse measures


def test_repeated_ngram_fraction_values() -> None:
    assert repeated_ngram_fraction("abcdef") == 0.0
    assert repeated_ngram_fraction("aaaaaa") == 1.0
    assert repeated_ngram_fraction("abab") == pytest.approx(
        0.5
    )  # ab ba [ab]: 1 of the 2 after the first
    assert repeated_ngram_fraction("abcabc", n=3) == pytest.approx(1 / 3)  # abc bca cab [abc]
    assert repeated_ngram_fraction("aab", n=1) == pytest.approx(0.5)
    assert repeated_ngram_fraction("ab") == 0.0  # a single bigram cannot repeat
    assert repeated_ngram_fraction("") == 0.0


def test_repeated_ngram_fraction_grows_with_repetition() -> None:
    varied = "the cat sat on a mat"
    looping = "the cat the cat the c"
    assert repeated_ngram_fraction(looping) > repeated_ngram_fraction(varied)


@pytest.mark.parametrize("n", [0, -2])
def test_repeated_ngram_fraction_bad_n_raises(n: int) -> None:
    with pytest.raises(InputError, match=f"n must be >= 1, got {n}"):
        repeated_ngram_fraction("abc", n)


def test_repetitive_text_compresses_more_than_varied_text() -> None:
    varied = "Q: which digit? A3 because the image shows a three, the text says seven."
    repetitive = ("A3" * 100)[: len(varied)]
    assert len(repetitive) == len(varied)
    assert compression_ratio(repetitive) < compression_ratio(varied)
    assert compression_ratio("a" * 1000) < 0.05
    assert compression_ratio("") == 1.0


def test_unparseable_fraction_values() -> None:
    texts = ["A3", "B7", "C1", "A", "A3x", "A33"]
    assert unparseable_fraction(texts, r"[AB]\d") == pytest.approx(4 / 6)  # full matches only
    assert unparseable_fraction(["A3", "B7"], r"[AB]\d") == 0.0
    assert unparseable_fraction([""], r"[AB]\d") == 1.0


def test_unparseable_fraction_without_texts_raises() -> None:
    with pytest.raises(InputError, match="at least one text"):
        unparseable_fraction([], r"\d")


def test_unparseable_fraction_with_an_invalid_pattern_raises() -> None:
    with pytest.raises(InputError, match="pattern '\\(' is not a valid regular expression"):
        unparseable_fraction(["a"], "(")
