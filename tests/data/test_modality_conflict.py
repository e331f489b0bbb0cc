"""The modality-conflict digit questions: seeded determinism, split sizes and kinds, the test
split's option-order pairs, the labelling rule of every kind, prompt and answer encodings, disjoint
image splits, the ablation helpers (without copying into the input), and bad input."""

import re

import numpy as np
import pytest
import torch

from ada_modules.data.modality_conflict import (
    ITEM_KINDS,
    ModalityConflictDataModule,
    ModalityConflictItems,
    make_conflict_items,
    with_instruction,
    without_image,
    without_text,
)
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError

SIZES = {"train_size": 200, "val_size": 50, "test_size": 20}
FIELDS = (
    "patches",
    "image_present",
    "image_class",
    "text_class",
    "hedged",
    "instruction",
    "options",
    "target",
    "kind",
    "prompt_ids",
    "answer_ids",
)
KIND = {name: i for i, name in enumerate(ITEM_KINDS)}
PROMPT = re.compile(r"^([nit])([=?]\d|##)\|A(\d)B(\d)>$")
TOKENIZER = CharTokenizer()


def _setup(seed: int = 0, **kwargs) -> ModalityConflictDataModule:
    dm = ModalityConflictDataModule(seed=seed, **{**SIZES, **kwargs})
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def dm() -> ModalityConflictDataModule:
    return _setup()


def _batch(items: ModalityConflictItems) -> dict[str, torch.Tensor]:
    return {name: getattr(items, name) for name in FIELDS}


# ------------------------------------------------------------------ determinism and sizes


def test_equal_seeds_give_identical_items_and_different_seeds_differ(dm) -> None:
    again, other = _setup(0), _setup(1)
    for split in ("train", "val", "test"):
        for name in FIELDS:
            assert torch.equal(getattr(dm.items(split), name), getattr(again.items(split), name))
        assert not torch.equal(dm.items(split).patches, other.items(split).patches)
        assert not torch.equal(dm.items(split).prompt_ids, other.items(split).prompt_ids)


def test_split_sizes_and_kinds(dm) -> None:
    assert len(dm.items("train")) == 200
    assert len(dm.items("val")) == 50
    test = dm.items("test")
    assert len(test) == 4 * 20
    counts = torch.bincount(test.kind, minlength=len(ITEM_KINDS))
    assert counts.tolist() == [40, 40, 0, 0, 0]  # consistent and conflict only
    # train mixes every kind by the default shares 0.35/0.25/0.2/0.1/0.1
    assert torch.bincount(dm.items("train").kind).tolist() == [70, 50, 40, 20, 20]
    for split in ("train", "val", "test"):
        items = dm.items(split)
        n = len(items)
        assert items.patches.shape == (n, 4, 16)
        assert items.prompt_ids.shape == (n, 9)
        assert items.answer_ids.shape == (n, 3)


def test_train_loader_batches_by_key(dm) -> None:
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == set(FIELDS)
    assert batch["patches"].shape == (32, 4, 16)
    assert batch["image_present"].dtype == torch.bool


def test_split_size_is_exact_for_any_mix() -> None:
    """Rounding the shares never changes a split's size (five equal shares of 3 items: 3)."""
    mix = dict.fromkeys(ITEM_KINDS, 1.0)
    dm = ModalityConflictDataModule(seed=0, train_size=3, val_size=8, test_size=1, mix=mix)
    dm.setup()
    assert len(dm.items("train")) == 3


# ------------------------------------------------------------------ test split pairs


def test_each_test_item_is_asked_in_both_option_orders(dm) -> None:
    test = dm.items("test")
    first, second = slice(0, None, 2), slice(1, None, 2)
    assert torch.equal(test.options[first], test.options[second].flip(-1))
    assert torch.equal(test.target[first], 1 - test.target[second])
    for name in ("patches", "image_class", "text_class", "hedged", "kind", "instruction"):
        assert torch.equal(getattr(test, name)[first], getattr(test, name)[second]), name
    answer = test.options.gather(1, test.target[:, None])[:, 0]
    assert torch.equal(answer[first], answer[second])
    # both orders occur in first place
    assert 0 < test.target[first].sum() < len(test) // 2


# ------------------------------------------------------------------ labels and encodings


def _check_labels(items: ModalityConflictItems) -> None:
    """The rule of ``make_conflict_items`` for every row."""
    answer = items.options.gather(1, items.target[:, None])[:, 0]
    for i in range(len(items)):
        kind = ITEM_KINDS[int(items.kind[i])]
        image, text = int(items.image_class[i]), int(items.text_class[i])
        hedged, instruction = bool(items.hedged[i]), int(items.instruction[i])
        present = bool(items.image_present[i])
        assert items.options[i, 0] != items.options[i, 1]
        assert (instruction != 0) == (kind == "instructed")
        assert present == (kind != "no_image")
        if kind == "consistent":
            assert text == image == answer[i]
        elif kind == "conflict":
            assert text != image
            assert sorted(items.options[i].tolist()) == sorted([image, text])
            assert answer[i] == (image if hedged else text)
        elif kind == "instructed":
            assert answer[i] == (image if "nit"[instruction] == "i" else text)
            if text != image:
                assert sorted(items.options[i].tolist()) == sorted([image, text])
        elif kind == "no_image":
            assert answer[i] == text and text >= 0
            assert torch.equal(items.patches[i], torch.zeros(4, 16))
        else:  # no_text
            assert text == -1 and not hedged
            assert answer[i] == image


def test_labels_follow_the_documented_rule(dm) -> None:
    for split in ("train", "val", "test"):
        _check_labels(dm.items(split))


@pytest.mark.parametrize("hedge_probability", [0.0, 1.0])
def test_hedging_decides_which_modality_wins_a_conflict(hedge_probability: float) -> None:
    dm = _setup(2, hedge_probability=hedge_probability, mix={"conflict": 1.0})
    items = dm.items("train")
    assert (items.kind == KIND["conflict"]).all()
    answer = items.options.gather(1, items.target[:, None])[:, 0]
    winner = items.image_class if hedge_probability == 1.0 else items.text_class
    assert torch.equal(answer, winner)
    assert bool(items.hedged.all()) == (hedge_probability == 1.0)


def test_answer_ids_are_letter_digit_eos(dm) -> None:
    items = dm.items("train")
    for i in range(len(items)):
        target = int(items.target[i])
        expected = f"{'AB'[target]}{int(items.options[i, target])}"
        assert TOKENIZER.decode(items.answer_ids[i]) == expected
        assert items.answer_ids[i, -1] == TOKENIZER.eos_id


def test_prompt_decodes_to_the_documented_format(dm) -> None:
    items = dm.items("train")
    for i in range(len(items)):
        match = PROMPT.fullmatch(TOKENIZER.decode(items.prompt_ids[i]))
        assert match is not None
        instruction, statement, a, b = match.groups()
        assert instruction == "nit"[int(items.instruction[i])]
        text = int(items.text_class[i])
        if text < 0:
            assert statement == "##"
        else:
            assert statement == f"{'?' if items.hedged[i] else '='}{text}"
        assert [int(a), int(b)] == items.options[i].tolist()


def test_splits_use_disjoint_digit_images() -> None:
    """Without noise the patches are the dataset's images; no image is in two splits."""
    from sklearn.datasets import load_digits

    dm = _setup(0, max_noise=0.0)
    images, labels = load_digits(return_X_y=True)
    label_of = {
        tuple((row / 16.0).astype(np.float32)): int(y)
        for row, y in zip(images, labels, strict=True)
    }
    used = {}
    for split in ("train", "val", "test"):
        items = dm.items(split)
        present = items.image_present
        # (n, 4, 16) quadrants back to (n, 64) row-major 8x8 images
        pixels = items.patches[present].reshape(-1, 2, 2, 4, 4).permute(0, 1, 3, 2, 4)
        keys = [tuple(row.tolist()) for row in pixels.reshape(-1, 64).numpy()]
        assert all(
            label_of.get(k) == int(c) for k, c in zip(keys, items.image_class[present], strict=True)
        )
        used[split] = set(keys)
    assert not used["train"] & used["val"]
    assert not used["train"] & used["test"]
    assert not used["val"] & used["test"]


# ------------------------------------------------------------------ ablation helpers


def _snapshot(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in batch.items()}


def test_without_image_removes_every_image_only(dm) -> None:
    batch = _batch(dm.items("val"))
    before = _snapshot(batch)
    ablated = without_image(batch)
    assert not ablated["image_present"].any()
    for name in FIELDS:
        assert torch.equal(batch[name], before[name]), name  # input untouched
        if name != "image_present":
            assert torch.equal(ablated[name], batch[name]), name


def test_without_text_replaces_the_statement_only(dm) -> None:
    batch = _batch(dm.items("val"))
    before = _snapshot(batch)
    ablated = without_text(batch)
    for i in range(len(ablated["prompt_ids"])):
        old = TOKENIZER.decode(batch["prompt_ids"][i])
        assert TOKENIZER.decode(ablated["prompt_ids"][i]) == old[0] + "##" + old[3:]
    for name in FIELDS:
        assert torch.equal(batch[name], before[name]), name
        if name != "prompt_ids":
            assert torch.equal(ablated[name], batch[name]), name


@pytest.mark.parametrize("instruction", ["n", "i", "t"])
def test_with_instruction_sets_the_first_character_only(dm, instruction: str) -> None:
    batch = _batch(dm.items("val"))
    before = _snapshot(batch)
    changed = with_instruction(batch, instruction)
    for i in range(len(changed["prompt_ids"])):
        old = TOKENIZER.decode(batch["prompt_ids"][i])
        assert TOKENIZER.decode(changed["prompt_ids"][i]) == instruction + old[1:]
    for name in FIELDS:
        assert torch.equal(batch[name], before[name]), name


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mix": {"conflict": 1.0, "surprise": 1.0}}, "unknown kind 'surprise' in mix"),
        ({"mix": {"conflict": 1.0, "consistent": -0.5}}, "mix shares must be >= 0"),
        ({"mix": {"conflict": 0.0}}, "not all 0"),
        ({"train_size": 0}, "train_size must be an int >= 1, got 0"),
        ({"test_size": 2.0}, "test_size must be an int >= 1, got 2.0"),
        ({"hedge_probability": 1.5}, r"hedge_probability must be in \[0, 1\], got 1.5"),
        ({"max_noise": -0.1}, "max_noise must be >= 0, got -0.1"),
    ],
)
def test_bad_datamodule_arguments_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(InputError, match=match):
        ModalityConflictDataModule(seed=0, **kwargs)


def test_make_conflict_items_unknown_kind_raises() -> None:
    with pytest.raises(InputError, match="unknown item kind 'contradiction'"):
        make_conflict_items(
            torch.zeros(3, 64), torch.arange(3), {"contradiction": 1}, np.random.default_rng(0)
        )


def test_unknown_instruction_letter_raises(dm) -> None:
    with pytest.raises(InputError, match="instruction must be one of n, i, t, got 'x'"):
        with_instruction(_batch(dm.items("val")), "x")
