"""DigitDomainsDataModule: each domain's transform (checked against numpy), the train union, the
test loaders per eval domain, seeded splits, disjoint splits and bad domain names."""

import numpy as np
import pytest
import torch

from ada_modules.data import DIGIT_DOMAINS, DigitDomainsDataModule
from ada_modules.errors import InputError

# What each domain claims to be, written with numpy on one (8, 8) image.
EXPECTED = {
    "identity": lambda a: a,
    "rot90": lambda a: np.rot90(a, 1),  # counter-clockwise: out[i, j] = a[j, 7 - i]
    "rot180": lambda a: a[::-1, ::-1],
    "rot270": lambda a: np.rot90(a, 3),
    "flip_lr": lambda a: a[:, ::-1],
    "flip_ud": lambda a: a[::-1, :],
    "transpose": lambda a: a.T,
    "invert": lambda a: 1.0 - a,
}


@pytest.fixture(scope="module")
def datamodule() -> DigitDomainsDataModule:
    dm = DigitDomainsDataModule(
        train_domains=["identity", "invert"],
        eval_domains=["rot90", "identity", "flip_ud"],
        seed=0,
        batch_size=32,
        eval_batch_size=100,
    )
    dm.setup("fit")
    return dm


def test_every_domain_is_named_and_checked():
    assert set(EXPECTED) == set(DIGIT_DOMAINS)


@pytest.mark.parametrize("domain", list(EXPECTED))
def test_each_transform_is_what_it_claims_on_an_8x8_image(domain):
    image = np.arange(64, dtype=np.float32).reshape(8, 8) / 63  # every pixel distinct
    got = DIGIT_DOMAINS[domain](torch.from_numpy(image).reshape(1, 1, 8, 8))
    assert tuple(got.shape) == (1, 1, 8, 8)
    expected = np.ascontiguousarray(EXPECTED[domain](image))
    assert np.array_equal(got[0, 0].numpy(), expected)
    if domain == "rot90":  # the convention spelled out: the top row becomes the left column
        assert np.array_equal(got[0, 0, :, 0].numpy(), image[0, ::-1])


@pytest.mark.parametrize("domain", ["rot90", "transpose", "invert"])
def test_domain_datasets_are_the_transform_of_the_plain_split(datamodule, domain):
    plain, labels = datamodule.domain_dataset("identity", "test").tensors
    shifted, shifted_labels = datamodule.domain_dataset(domain, "test").tensors
    assert shifted.shape == plain.shape == (360, 64) and torch.equal(shifted_labels, labels)
    images = plain.reshape(-1, 8, 8).numpy()
    expected = np.stack([EXPECTED[domain](image) for image in images]).reshape(-1, 64)
    assert np.array_equal(shifted.numpy(), expected)


def test_train_and_val_are_the_union_of_the_train_domains(datamodule):
    for split in ("train", "val"):
        images, labels = datamodule.datasets[split].tensors
        parts = [datamodule.domain_dataset(d, split).tensors for d in ("identity", "invert")]
        assert torch.equal(images, torch.cat([part[0] for part in parts]))
        assert torch.equal(labels, torch.cat([part[1] for part in parts]))
    assert len(datamodule.datasets["train"]) == 2 * len(datamodule.domain_dataset("rot90", "train"))
    images, _ = next(iter(datamodule.train_dataloader()))
    assert tuple(images.shape) == (32, 64)


def test_test_loaders_follow_eval_domains_in_order(datamodule):
    loaders = datamodule.test_dataloader()
    assert len(loaders) == 3
    for loader, domain in zip(loaders, ["rot90", "identity", "flip_ud"], strict=True):
        expected = datamodule.domain_dataset(domain, "test").tensors
        assert all(torch.equal(a, b) for a, b in zip(loader.dataset.tensors, expected, strict=True))
        assert loader.batch_size == 100
    assert torch.equal(
        datamodule.datasets["test"].tensors[0],
        datamodule.domain_dataset("rot90", "test").tensors[0],
    )


def test_eval_domains_default_to_train_domains():
    assert DigitDomainsDataModule(train_domains=["flip_lr", "rot180"]).eval_domains == [
        "flip_lr",
        "rot180",
    ]


def test_equal_seeds_give_equal_splits():
    first, second, other = (
        DigitDomainsDataModule(train_domains=["rot90"], seed=s) for s in (5, 5, 6)
    )
    for dm in (first, second, other):
        dm.setup("fit")
    for split in ("train", "val", "test"):
        assert torch.equal(
            first.domain_dataset("rot90", split).tensors[0],
            second.domain_dataset("rot90", split).tensors[0],
        )
    assert not torch.equal(first.indices["test"], other.indices["test"])
    shuffled = [
        next(iter(dm.domain_dataloader("rot90", "train", shuffle=True))) for dm in (first, second)
    ]
    assert torch.equal(shuffled[0][1], shuffled[1][1])


def test_no_test_image_of_any_domain_is_a_training_image_of_any_domain(datamodule):
    def rows(split: str) -> set[bytes]:
        return {
            row.numpy().tobytes()
            for domain in DIGIT_DOMAINS
            for row in datamodule.domain_dataset(domain, split).tensors[0]
        }

    train, test = rows("train"), rows("test")
    assert len(test) == 8 * 360 and not train & test
    indices = [set(datamodule.indices[split].tolist()) for split in ("train", "val", "test")]
    assert not (indices[0] & indices[1] or indices[0] & indices[2] or indices[1] & indices[2])


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"train_domains": ["rot45"]}, "'rot45'"),
        ({"eval_domains": ["identity", "mirror"]}, "'mirror'"),
        ({"train_domains": ["rot90", "rot90"]}, "twice"),
        ({"train_domains": "rot90"}, "'rot90'"),
        ({"train_domains": []}, "train_domains"),
    ],
)
def test_bad_domain_lists_are_named(kwargs, named):
    with pytest.raises(InputError, match=named):
        DigitDomainsDataModule(**kwargs)


def test_domain_dataset_names_an_unknown_domain_or_split(datamodule):
    with pytest.raises(InputError, match="'rot45'"):
        datamodule.domain_dataset("rot45", "test")
    with pytest.raises(InputError, match="'holdout'"):
        datamodule.domain_dataloader("rot90", "holdout")
    with pytest.raises(RuntimeError, match="setup"):
        DigitDomainsDataModule().domain_dataset("rot90", "test")
