import pytest
import torch

from ada_modules.data.shapes import CLASS_NAMES, FAMILIES, SHAPES, ShapesDataModule, generate_shapes
from ada_modules.errors import InputError


def test_equal_seeds_give_equal_images_and_other_seeds_do_not():
    images, labels = generate_shapes(50, seed=7)
    again, again_labels = generate_shapes(50, seed=7)
    assert torch.equal(images, again) and torch.equal(labels, again_labels)
    other, _ = generate_shapes(50, seed=8)
    assert not torch.equal(images, other)


def test_shapes_dtypes_ranges_and_balance():
    images, labels = generate_shapes(1003, seed=0)
    assert images.shape == (1003, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (1003,) and labels.dtype == torch.int64
    assert images.min() >= -1.0 and images.max() <= 1.0
    assert images.min() < -0.5 and images.max() > 0.5  # uses the range
    counts = torch.bincount(labels, minlength=10)
    assert counts.min() == 100 and counts.max() == 101 and counts.sum() == 1003
    assert len(CLASS_NAMES) == len(SHAPES) * len(FAMILIES) == 10
    assert CLASS_NAMES[5] == "cool triangle"


def test_other_sizes_and_empty():
    images, labels = generate_shapes(4, seed=1, size=16)
    assert images.shape == (4, 3, 16, 16)
    empty, empty_labels = generate_shapes(0, seed=1)
    assert empty.shape == (0, 3, 32, 32) and empty_labels.shape == (0,)


def test_families_have_their_hues():
    """Pixels far from the background's low saturation: warm ones red-dominant, cool blue."""
    images, labels = generate_shapes(200, seed=3)
    rgb = (images + 1) / 2
    for image, label in zip(rgb, labels, strict=True):
        saturated = (rgb_max := image.max(0).values) - image.min(0).values > 0.4
        assert saturated.any()
        red, blue = image[0][saturated].mean(), image[2][saturated].mean()
        assert (red > blue) if label % 2 == 0 else (blue > red), (label, rgb_max.max())


def test_images_have_layout_and_fine_detail():
    images, _ = generate_shapes(64, seed=2)
    # the shape moves: per-pixel variance across images is large
    assert images.var(0).mean() > 0.05
    # fine detail: neighbouring-pixel differences inside images are not all tiny
    assert (images[..., 1:] - images[..., :-1]).abs().mean() > 0.02


def test_datamodule_splits_are_disjoint_deterministic_and_batched():
    dm = ShapesDataModule(
        train_size=40, val_size=20, test_size=30, batch_size=8, eval_batch_size=16
    )
    dm.setup("fit")
    sizes = {split: len(dm.datasets[split]) for split in ("train", "val", "test")}
    assert sizes == {"train": 40, "val": 20, "test": 30}
    flat = {s: dm.datasets[s].tensors[0].flatten(1) for s in ("train", "val", "test")}
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert torch.cdist(flat[a], flat[b]).min() > 1.0  # no shared images
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 3, 32, 32) and labels.dtype == torch.int64
    assert next(iter(dm.val_dataloader()))[0].shape[0] == 16
    other = ShapesDataModule(train_size=40, val_size=20, test_size=30, batch_size=8)
    other.setup("fit")
    assert torch.equal(other.datasets["test"].tensors[0], dm.datasets["test"].tensors[0])
    expected, _ = generate_shapes(30, ShapesDataModule.split_seed(0, "test"))
    assert torch.equal(dm.datasets["test"].tensors[0], expected)


def test_seed_none_follows_seed_everything(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    assert ShapesDataModule(seed=None).seed == 5
    assert ShapesDataModule().seed == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: generate_shapes(-1, 0), "n must be"),
        (lambda: generate_shapes(2.0, 0), "n must be"),
        (lambda: generate_shapes(2, "a"), "seed must be"),
        (lambda: generate_shapes(2, 0, size=4), "size must be"),
        (lambda: generate_shapes(2, True), "seed must be"),
        (lambda: generate_shapes(2, -1), "seed must be"),
        (lambda: ShapesDataModule(train_size=0), "train_size"),
        (lambda: ShapesDataModule(val_size=1.5), "val_size"),
        (lambda: ShapesDataModule(test_size=None), "test_size"),
        (lambda: ShapesDataModule(batch_size=0), "batch_size"),
        (lambda: ShapesDataModule(seed="x"), "seed"),
        (lambda: ShapesDataModule(seed=-3), "seed"),
        (lambda: ShapesDataModule.split_seed(0, "dev"), "split"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(InputError, match=match):
        call()
