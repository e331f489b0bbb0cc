"""The Modality Contribution Ratio on constructed answers (image-driven -> 1, text-driven -> 0,
agreeing modalities -> 0.5, always in [0, 1], swapping the ablations gives 1 - MCR), the answer
divergences (JS symmetric and at most log 2, KL >= 0, hand-computed values), the attention-share
variant, and bad input."""

import math

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.steering import answer_divergence, attention_share, modality_contribution_ratio


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ MCR


@pytest.mark.parametrize("divergence", ["js", "kl"])
def test_mcr_is_near_one_when_only_removing_the_image_moves_the_answer(divergence: str) -> None:
    full = torch.tensor([[6.0, 0.0, 0.0], [0.0, 0.0, 6.0]])
    without_image = torch.tensor([[0.0, 6.0, 0.0], [6.0, 0.0, 0.0]])  # the answer changes
    without_text = full.clone()  # the answer stays
    mcr = modality_contribution_ratio(full, without_image, without_text, divergence)
    assert mcr.shape == (2,)
    assert (mcr > 0.99).all()


@pytest.mark.parametrize("divergence", ["js", "kl"])
def test_mcr_is_near_zero_when_only_removing_the_text_moves_the_answer(divergence: str) -> None:
    full = torch.tensor([[6.0, 0.0, 0.0], [0.0, 0.0, 6.0]])
    without_text = torch.tensor([[0.0, 6.0, 0.0], [6.0, 0.0, 0.0]])
    mcr = modality_contribution_ratio(full, full.clone(), without_text, divergence)
    assert (mcr < 0.01).all()


def test_mcr_is_one_half_when_neither_removal_moves_the_answer() -> None:
    full = _randn(4, 3, seed=0)
    mcr = modality_contribution_ratio(full, full.clone(), full.clone())
    torch.testing.assert_close(mcr, torch.full((4,), 0.5))


def test_mcr_grows_with_what_removing_the_image_changes() -> None:
    """Text ablation fixed; a larger shift without the image gives a larger image share."""
    full = torch.tensor([[2.0, 0.0]]).expand(5, 2)
    without_text = torch.tensor([[1.0, 0.0]]).expand(5, 2)
    without_image = torch.stack([torch.tensor([2.0 - s, s]) for s in (0.5, 1, 2, 3, 4)])
    mcr = modality_contribution_ratio(full, without_image, without_text)
    assert (mcr.diff() > 0).all()


@pytest.mark.parametrize("divergence", ["js", "kl"])
def test_mcr_is_in_unit_interval_and_swapping_ablations_gives_the_complement(
    divergence: str,
) -> None:
    full, no_image, no_text = (3 * _randn(256, 5, seed=s) for s in (1, 2, 3))
    mcr = modality_contribution_ratio(full, no_image, no_text, divergence)
    assert ((mcr >= 0) & (mcr <= 1)).all()
    swapped = modality_contribution_ratio(full, no_text, no_image, divergence)
    torch.testing.assert_close(mcr + swapped, torch.ones(256))


@pytest.mark.parametrize("eps", [0.0, -1e-3, math.nan, math.inf, "1e-6"])
def test_mcr_with_non_positive_eps_raises(eps: float) -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(InputError, match="eps must be a finite number > 0"):
        modality_contribution_ratio(x, x, x, eps=eps)


# ------------------------------------------------------------------ answer divergence


def test_divergences_match_hand_computed_values() -> None:
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    m = (p + q) / 2
    kl = (p * (p / q).log()).sum()
    js = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
    # logits given up to a constant: the divergence is shift-invariant
    p_logits, q_logits = p.log()[None] + 3.0, q.log()[None] - 1.0
    torch.testing.assert_close(answer_divergence(p_logits, q_logits, "kl"), kl[None])
    torch.testing.assert_close(answer_divergence(p_logits, q_logits, "js"), js[None])


def test_js_is_symmetric_bounded_and_kl_non_negative() -> None:
    p, q = 5 * _randn(3, 64, 4, seed=4), 5 * _randn(3, 64, 4, seed=5)
    js = answer_divergence(p, q, "js")
    assert js.shape == (3, 64)
    torch.testing.assert_close(js, answer_divergence(q, p, "js"))
    assert (js >= 0).all() and (js <= math.log(2) + 1e-6).all()
    kl = answer_divergence(p, q, "kl")
    assert (kl >= 0).all()
    # convexity of KL: KL(p || m) <= KL(p || q) / 2, so JS <= (KL(p || q) + KL(q || p)) / 4
    assert (js <= (kl + answer_divergence(q, p, "kl")) / 4 + 1e-6).all()
    assert torch.equal(answer_divergence(p, p, "kl"), torch.zeros(3, 64))


def test_answer_divergence_shape_mismatch_raises() -> None:
    with pytest.raises(
        InputError, match=r"differ in shape: p_logits \(2, 3\) vs q_logits \(2, 4\)"
    ):
        answer_divergence(torch.zeros(2, 3), torch.zeros(2, 4))


def test_divergences_do_not_depend_on_the_default_dtype() -> None:
    """Under Lightning's ``bf16-true`` the default dtype is bfloat16: log 2 must not follow it."""
    full = torch.tensor([[0.83, 0.72], [0.90, 0.60]])
    no_image = torch.tensor([[0.80, 0.75], [0.20, 1.00]])
    no_text = torch.tensor([[0.85, 0.70], [0.95, 0.55]])
    expected = modality_contribution_ratio(full, no_image, no_text)
    expected_js = answer_divergence(full, no_image)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        mcr = modality_contribution_ratio(full, no_image, no_text)
        js = answer_divergence(full, no_image)
    finally:
        torch.set_default_dtype(default)
    torch.testing.assert_close(js, expected_js)
    torch.testing.assert_close(mcr, expected)
    assert abs(mcr[0].item() - 0.5) > 0.1  # a small divergence is not rounded to 0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_positive_infinite_logits_raise(bad: float) -> None:
    full = torch.tensor([[bad, 0.0]])
    with pytest.raises(InputError, match="full_logits holds NaN or \\+inf"):
        modality_contribution_ratio(full, torch.zeros(1, 2), torch.zeros(1, 2))
    with pytest.raises(InputError, match="q_logits holds NaN or \\+inf"):
        answer_divergence(torch.zeros(1, 2), full)


def test_minus_infinite_logits_mark_impossible_options() -> None:
    impossible = torch.tensor([[0.0, -math.inf]])
    assert answer_divergence(impossible, impossible).item() == 0.0


def test_logits_that_are_not_tensors_raise() -> None:
    with pytest.raises(InputError, match="without_text_logits must be a tensor, got list"):
        modality_contribution_ratio(torch.zeros(1, 2), torch.zeros(1, 2), [[0.0, 1.0]])
    with pytest.raises(InputError, match="p_logits must be a tensor, got list"):
        answer_divergence([[1.0, 0.0]], torch.zeros(1, 2))


def test_unknown_divergence_raises() -> None:
    with pytest.raises(InputError, match="divergence must be 'kl' or 'js', got 'tv'"):
        answer_divergence(torch.zeros(2, 3), torch.zeros(2, 3), "tv")
    with pytest.raises(InputError, match="got 'tv'"):
        modality_contribution_ratio(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), "tv")


# ------------------------------------------------------------------ attention share


def test_attention_share_averages_the_last_query_over_layers_and_heads() -> None:
    # batch 2, heads 2, seq 4; image tokens: positions 0-1 (row 0), position 1 (row 1)
    first = torch.zeros(2, 2, 4, 4)
    second = torch.zeros(2, 2, 4, 4)
    first[:, :, :-1] = 0.25  # earlier queries must not count
    first[0, 0, -1] = torch.tensor([0.4, 0.2, 0.2, 0.2])
    first[0, 1, -1] = torch.tensor([0.1, 0.1, 0.4, 0.4])
    second[0, :, -1] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    first[1, :, -1] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    second[1, :, -1] = torch.tensor([0.5, 0.0, 0.0, 0.5])
    mask = torch.tensor([[True, True, False, False], [False, True, False, False]])
    share = attention_share((first, second), mask)
    # row 0: image attention per (layer, head): 0.6, 0.2, 0.5, 0.5 -> mean 0.45
    # row 1: 1.0, 1.0, 0.0, 0.0 -> mean 0.5
    torch.testing.assert_close(share, torch.tensor([0.45, 0.5]))


def test_attention_share_is_one_for_all_image_and_zero_for_no_image() -> None:
    attn = torch.softmax(_randn(3, 2, 5, 5, seed=6), dim=-1)
    torch.testing.assert_close(
        attention_share([attn], torch.ones(3, 5, dtype=torch.bool)), torch.ones(3)
    )
    assert torch.equal(attention_share([attn], torch.zeros(3, 5, dtype=torch.bool)), torch.zeros(3))


def test_attention_share_mask_shape_mismatch_raises() -> None:
    attn = torch.zeros(2, 1, 4, 4)
    with pytest.raises(
        InputError, match=r"image_mask must be \(batch, seq\) = \(2, 4\), got \(2, 3\)"
    ):
        attention_share([attn], torch.ones(2, 3, dtype=torch.bool))


def test_attention_share_without_layers_raises() -> None:
    with pytest.raises(InputError, match="one attention tensor per layer, got none"):
        attention_share([], torch.ones(1, 3, dtype=torch.bool))


@pytest.mark.parametrize("attentions", [(), (None, None)])
def test_attention_share_without_weights_points_to_eager_attention(attentions: tuple) -> None:
    """transformers returns no weights (``()`` or ``None`` per layer) with sdpa/flash attention."""
    with pytest.raises(InputError, match='attn_implementation="eager"'):
        attention_share(attentions, torch.ones(1, 3, dtype=torch.bool))


def test_attention_share_of_a_three_dimensional_attention_raises() -> None:
    with pytest.raises(
        InputError, match=r"attentions\[0\] must be \(batch, heads, seq, seq\), got \(2, 3, 3\)"
    ):
        attention_share([torch.rand(2, 3, 3)], torch.ones(2, 3, dtype=torch.bool))
