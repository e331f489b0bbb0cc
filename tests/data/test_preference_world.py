"""The synthetic preference world: true, human and judge labels, token framing, the datamodule."""

import pytest
import torch

from ada_modules.data.preference_world import (
    PreferenceDataModule,
    PreferencePairs,
    PreferenceWorld,
)
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError


def _sample(count=2000, seed=0, first_extra_length=0, **kwargs) -> PreferencePairs:
    world = PreferenceWorld(**kwargs)
    return world.sample(count, torch.Generator().manual_seed(seed), first_extra_length)


def _count(texts: list[str], digit: str) -> torch.Tensor:
    return torch.tensor([text.count(digit) for text in texts])


def test_true_rewards_never_tie_and_truth_follows_them():
    pairs = _sample(1000)
    assert len(pairs) == 1000
    first, second = pairs.texts("first"), pairs.texts("second")
    # The true reward counted on the strings, independently of PreferenceWorld.true_reward.
    reward_first = _count(first, "7") - _count(first, "3")
    reward_second = _count(second, "7") - _count(second, "3")
    assert (reward_first != reward_second).all()
    assert torch.equal(pairs.truth, (reward_first > reward_second).double())
    assert 0.43 < pairs.truth.mean().item() < 0.57  # the reward does not favour either side
    assert torch.equal(pairs.human, pairs.truth)  # human_accuracy 1 by default
    lengths = torch.tensor([len(t) for t in first + second])
    assert lengths.min().item() == 2 and lengths.max().item() == 10


def test_perfect_judge_without_bias_agrees_with_the_truth():
    pairs = _sample(judge_accuracy=1.0, judge_length_bias=0.0)
    assert torch.equal(pairs.judge, pairs.truth)


def test_always_wrong_judge_without_bias_disagrees_with_the_truth():
    pairs = _sample(judge_accuracy=0.0, judge_length_bias=0.0)
    assert torch.equal(pairs.judge, 1.0 - pairs.truth)


def test_noisy_judge_and_humans_flip_at_their_rates():
    pairs = _sample(20_000, judge_accuracy=0.8, human_accuracy=0.9)
    assert (pairs.judge == pairs.truth).double().mean().item() == pytest.approx(0.8, abs=0.015)
    assert (pairs.human == pairs.truth).double().mean().item() == pytest.approx(0.9, abs=0.015)


def test_length_bias_inflates_the_verbose_sides_judged_win_rate():
    biased = _sample(2000, first_extra_length=3, judge_accuracy=1.0, judge_length_bias=1.0)
    lengths = (biased.first >= 0).sum(1)
    assert (lengths.min().item(), lengths.max().item()) == (5, 13)  # min/max_length + 3
    assert biased.first.shape[1] == 13 and biased.tokens("first").shape[1] == 15
    assert biased.judge.mean().item() > biased.truth.mean().item() + 0.1
    # Without the bias the same pairs' judge is the truth; a longer side alone changes nothing.
    fair = _sample(2000, first_extra_length=3, judge_accuracy=1.0, judge_length_bias=0.0)
    assert torch.equal(fair.judge, fair.truth)
    assert torch.equal(fair.truth, biased.truth)


def test_tokens_frame_the_digits_and_texts_round_trip():
    pairs = _sample(50)
    tok = CharTokenizer()
    for which in ("first", "second"):
        ids = pairs.tokens(which)
        texts = pairs.texts(which)
        assert ids.dtype == torch.long and ids.shape == (50, 12)  # max_length + bos + eos
        assert (ids[:, 0] == tok.bos_id).all()
        for row, text in zip(ids.tolist(), texts, strict=True):
            framed = tok.encode(text, add_bos=True, add_eos=True)
            assert row == framed + [tok.pad_id] * (12 - len(framed))
            assert tok.decode(row) == text
            assert all(ch.isdigit() for ch in text)


def test_same_seed_same_pairs_and_another_seed_differs():
    one, two, other = _sample(300, seed=4), _sample(300, seed=4), _sample(300, seed=5)
    for name in ("first", "second", "truth", "human", "judge"):
        assert torch.equal(getattr(one, name), getattr(two, name))
    assert not torch.equal(one.first, other.first)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"judge_accuracy": 1.5}, "judge_accuracy must lie in [0, 1], got 1.5"),
        ({"human_accuracy": -0.1}, "human_accuracy must lie in [0, 1], got -0.1"),
        ({"min_length": 6, "max_length": 5}, "min_length=6, max_length=5"),
        ({"min_length": 0}, "need 1 <= min_length <= max_length"),
    ],
)
def test_bad_world_raises_input_error_naming_the_argument(kwargs, message):
    with pytest.raises(InputError) as error:
        PreferenceWorld(**kwargs)
    assert message in str(error.value)
    with pytest.raises(InputError) as error:
        PreferenceDataModule(**kwargs)
    assert message in str(error.value)


# ------------------------------------------------------------------ the datamodule


def _datamodule(**kwargs) -> PreferenceDataModule:
    defaults = dict(
        num_labelled=12,
        num_unlabelled=40,
        num_val=10,
        num_test=20,
        batch_size=16,
        labelled_batch_size=5,
        seed=3,
    )
    dm = PreferenceDataModule(**{**defaults, **kwargs})
    dm.setup("fit")
    return dm


def test_training_batches_pair_labelled_and_unlabelled_parts():
    dm = _datamodule()
    batches = [batch for batch, _, _ in dm.train_dataloader()]
    assert len(batches) == 3  # the unlabelled set makes one epoch: ceil(40 / 16)
    labelled, unlabelled = batches[0]["labelled"], batches[0]["unlabelled"]
    assert sorted(labelled) == ["first", "human", "judge", "second"]
    assert sorted(unlabelled) == ["first", "judge", "second"]
    assert labelled["first"].shape == (5, 12) and labelled["first"].dtype == torch.long
    assert labelled["human"].shape == (5,) and labelled["human"].dtype == torch.float32
    assert unlabelled["second"].shape == (16, 12)
    assert [len(b["unlabelled"]["judge"]) for b in batches] == [16, 16, 8]
    # Every unlabelled pair is seen once in the epoch.
    seen = torch.cat([b["unlabelled"]["first"] for b in batches])
    expected = dm.splits["unlabelled"].tokens("first")
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))
    held_out = next(iter(dm.test_dataloader()))
    assert sorted(held_out) == ["first", "second", "truth"] and len(held_out["truth"]) == 20
    assert len(next(iter(dm.val_dataloader()))["truth"]) == 10


def test_statistics_batches_are_the_labelled_set_and_an_unlabelled_prefix():
    dm = _datamodule()
    labelled, unlabelled = dm.statistics_batches(25)
    assert sorted(labelled) == ["first", "human", "judge", "second"]
    assert sorted(unlabelled) == ["first", "judge", "second"]
    assert labelled["first"].shape == (12, 12) and labelled["human"].shape == (12,)
    assert unlabelled["first"].shape == (25, 12) and unlabelled["judge"].shape == (25,)
    split = dm.splits["unlabelled"]
    assert torch.equal(unlabelled["second"], split.tokens("second")[:25])
    assert torch.equal(unlabelled["judge"], split.judge[:25].float())
    assert torch.equal(labelled["human"], dm.splits["labelled"].human.float())
    # More than there are: the whole unlabelled set.
    assert dm.statistics_batches(1000)[1]["first"].shape[0] == 40


def test_datamodule_seed_fixes_the_data_and_defaults_to_the_global_seed(monkeypatch):
    assert torch.equal(
        _datamodule().splits["labelled"].first, _datamodule().splits["labelled"].first
    )
    other = _datamodule(seed=4).splits["labelled"].first
    assert not torch.equal(other, _datamodule().splits["labelled"].first)
    monkeypatch.setenv("PL_GLOBAL_SEED", "4")
    assert PreferenceDataModule().seed == 4
    assert torch.equal(_datamodule(seed=None).splits["labelled"].first, other)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_labelled": 1}, "num_labelled must be at least 2, got 1"),
        ({"num_unlabelled": 0}, "num_unlabelled must be at least 2, got 0"),
        ({"num_test": 0}, "num_test must be at least 1, got 0"),
        ({"labelled_batch_size": 0}, "labelled_batch_size must be at least 1, got 0"),
    ],
)
def test_bad_datamodule_raises_input_error_naming_the_argument(kwargs, message):
    with pytest.raises(InputError) as error:
        PreferenceDataModule(**kwargs)
    assert message in str(error.value)
