import pytest
import torch

from ada_modules.data.digits import DigitsDataModule


def test_equal_seeds_give_equal_splits_and_batches():
    first, second = DigitsDataModule(seed=3), DigitsDataModule(seed=3)
    first.setup("fit")
    second.setup("fit")
    for split in ("train", "val", "test"):
        assert torch.equal(first.datasets[split].tensors[0], second.datasets[split].tensors[0])
    batch_a, batch_b = next(iter(first.train_dataloader())), next(iter(second.train_dataloader()))
    assert torch.equal(batch_a[1], batch_b[1])
    other = DigitsDataModule(seed=4)
    other.setup("fit")
    assert not torch.equal(first.datasets["test"].tensors[1], other.datasets["test"].tensors[1])


def test_splits_are_disjoint_stratified_and_cover_the_data():
    dm = DigitsDataModule(seed=0)
    dm.setup("test")
    sizes = {split: len(dm.datasets[split]) for split in ("train", "val", "test")}
    assert sum(sizes.values()) == 1797
    train, val, test = (set(dm.indices[s].tolist()) for s in ("train", "val", "test"))
    assert not (train & val or train & test or val & test)
    assert train | val | test == set(range(1797))
    counts = torch.bincount(dm.datasets["test"].tensors[1], minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38  # ~20 % of each class's ~180 images


@pytest.mark.parametrize(("flatten", "shape"), [(True, (8, 64)), (False, (8, 1, 8, 8))])
def test_shapes_dtypes_and_scaling(flatten, shape):
    dm = DigitsDataModule(seed=0, flatten=flatten, batch_size=8, eval_batch_size=100)
    dm.setup("fit")
    images, labels = next(iter(dm.train_dataloader()))
    assert tuple(images.shape) == shape and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() <= 9
    everything = dm.datasets["train"].tensors[0]
    assert everything.min() == 0.0 and everything.max() == 1.0
    assert next(iter(dm.val_dataloader()))[0].shape[0] == 100


def test_seed_none_follows_seed_everything(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert DigitsDataModule().seed == 7
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert DigitsDataModule().seed == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"test_fraction": 1.5}, "test_fraction"),
        ({"val_fraction": 0.3, "test_fraction": 0.3}, "val_fraction \\+ test_fraction"),
        ({"batch_size": 0}, "batch_size"),
        ({"eval_batch_size": -1}, "eval_batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"seed": "a"}, "seed"),
        ({"flatten": "yes"}, "flatten"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsDataModule(**kwargs)


def test_loaders_need_setup():
    with pytest.raises(RuntimeError, match="setup"):
        DigitsDataModule().train_dataloader()
