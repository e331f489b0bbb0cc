"""NeedleRecallDataModule: fixed prompt length, needles in the context, short training split."""

import random

import pytest

from ada_modules.data import NeedleRecallDataModule
from ada_modules.errors import InputError


def test_prompt_structure_and_answer():
    dm = NeedleRecallDataModule(num_pairs=5, filler_segments=10, filler_length=8, extra_queries=3)
    for seed in range(20):
        ex = dm.make_example(random.Random(seed))
        assert len(ex.prompt) + 1 == dm.prompt_length
        context, queries = ex.prompt.split("|")
        key = queries[-1]
        assert f"#{key}{ex.completion}" in context  # the needle is in the context
        assert key not in queries[:-1]  # the answered queries never ask the final key
        value_position = len(ex.prompt) - ex.metadata["distance"]
        assert ex.prompt[value_position] == ex.completion
        for start, end in ex.loss_spans:  # loss on filler repeats and on answered values
            assert "#" not in ex.prompt[start:end] and "|" not in ex.prompt[start:end]


def test_short_training_split():
    dm = NeedleRecallDataModule(
        num_pairs=3,
        filler_segments=20,
        filler_length=8,
        train_filler_segments=4,
        num_train=8,
        num_val=4,
        num_test=4,
        batch_size=4,
    )
    dm.setup("fit")
    dm.setup("test")
    assert len(dm.datasets["train"][0]["prompt_ids"]) < dm.prompt_length
    assert all(len(x["prompt_ids"]) == dm.prompt_length for x in dm.datasets["test"])


def test_training_length_range():
    dm = NeedleRecallDataModule(
        num_pairs=1,
        filler_segments=12,
        filler_length=4,
        train_filler_segments=[2, 3, 5, 6],
        num_train=64,
        num_val=4,
        num_test=4,
        batch_size=4,
    )
    dm.setup("fit")
    lengths = {len(x["prompt_ids"]) for x in dm.datasets["train"]}
    # 2, 3, 5 or 6 segments of 4 characters, one needle of 3, "|" and the key, plus <bos>.
    assert lengths == {1 + 4 * k + 3 + 2 for k in (2, 3, 5, 6)}
    assert all(len(x["prompt_ids"]) == dm.prompt_length for x in dm.datasets["val"])
    ex = dm.make_example(random.Random(0))  # outside the training split: the full length
    assert len(ex.prompt) + 1 == dm.prompt_length
    loader = dm.train_dataloader()  # batches of one length: no padding
    batches = list(loader)
    assert len(batches) == len(loader)
    assert sum(len(b["prompt_ids"]) for b in batches) == 64
    assert all((b["prompt_mask"] == 1).all() for b in batches)
    assert [b["prompt_ids"].shape for b in batches] != [b["prompt_ids"].shape for b in loader]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_pairs": 27},
        {"extra_queries": 16},
        {"motif_length": 20},
        {"key_alphabet": "a#"},
        {"train_filler_segments": -1},
        {"train_filler_segments": [5, -2]},
        {"train_filler_segments": []},
        {"train_filler_segments": "4"},
        {"key_alphabet": "abc", "num_pairs": 2, "value_alphabet": "a1"},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(InputError):
        NeedleRecallDataModule(**kwargs)
