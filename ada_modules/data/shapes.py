"""Procedural coloured shapes (10 classes) for the AHPA VAE, judge and diffusion experiments.

:func:`generate_shapes` draws images of one shape (disc, square, triangle, cross, ring) in a warm
(red to yellow) or cool (cyan to blue) colour on a smooth low-contrast background, with thin
stripes on the shape as fine detail. :class:`ShapesDataModule` serves disjoint train/val/test
splits of them. Everything is generated from a seed on the CPU (10,000 images take about a
second on one core), so there is nothing to download.
"""

import math

import torch
from torch.utils.data import TensorDataset

from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError

__all__ = ["CLASS_NAMES", "FAMILIES", "SHAPES", "ShapesDataModule", "generate_shapes"]

SHAPES: tuple[str, ...] = ("disc", "square", "triangle", "cross", "ring")
"""The five shapes; the class of an image is ``2 * shape + family``."""
FAMILIES: tuple[str, ...] = ("warm", "cool")
"""The two colour families: warm hues (red to yellow-orange) and cool hues (cyan to blue)."""
CLASS_NAMES: tuple[str, ...] = tuple(f"{f} {s}" for s in SHAPES for f in FAMILIES)
"""Name of each class label, ``CLASS_NAMES[2 * shape + family]`` (e.g. 5 is ``"cool triangle"``)."""

# Hue ranges (fractions of the colour wheel) of the two families; warm wraps around red.
_HUES = ((-0.03, 0.13), (0.47, 0.68))
_SPLITS = ("train", "val", "test")


def _hsv_to_rgb(hue: torch.Tensor, sat: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """RGB in ``[0, 1]`` of shape ``(*hue.shape, 3)`` from HSV tensors of equal shape."""
    channels = []
    for offset in (5.0, 3.0, 1.0):
        k = torch.remainder(offset + hue * 6.0, 6.0)
        ramp = torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0)
        channels.append(val - val * sat * ramp)
    return torch.stack(channels, dim=-1)


def _box(x: torch.Tensor, y: torch.Tensor, half_x: float, half_y: float) -> torch.Tensor:
    qx, qy = x.abs() - half_x, y.abs() - half_y
    outside = torch.hypot(qx.clamp(min=0.0), qy.clamp(min=0.0))
    return outside + torch.maximum(qx, qy).clamp(max=0.0)


def _triangle(x: torch.Tensor, y: torch.Tensor, r: float) -> torch.Tensor:
    """Equilateral triangle of side ``2 r`` centred on its centroid, apex at ``-y``."""
    k = math.sqrt(3.0)
    y = -y  # apex up in image coordinates (rows grow downwards)
    px = x.abs() - r
    py = y + r / k
    fold = px + k * py > 0
    px, py = (
        torch.where(fold, (px - k * py) / 2, px),
        torch.where(fold, (-k * px - py) / 2, py),
    )
    px = px - px.clamp(-2 * r, 0.0)
    return -torch.hypot(px, py) * torch.sign(py)


def _shape_sdf(shape: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Signed distance (negative inside) to a shape of unit scale, in local coordinates."""
    if shape == 0:
        return torch.hypot(x, y) - 0.8
    if shape == 1:
        return _box(x, y, 0.72, 0.72)
    if shape == 2:
        return _triangle(x, y, 1.05)
    if shape == 3:
        return torch.minimum(_box(x, y, 0.95, 0.32), _box(x, y, 0.32, 0.95))
    return (torch.hypot(x, y) - 0.68).abs() - 0.22


def generate_shapes(n: int, seed: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``n`` images of coloured shapes and their class labels from ``seed``.

    Each image holds one shape (:data:`SHAPES`) at a random position, scale and rotation,
    filled with a colour of its family (:data:`FAMILIES`; hue, saturation and brightness jitter
    within the family), with thin stripes of random direction and period (3-5 pixels at
    ``size=32``) on it, over a low-saturation background with a random linear gradient. Edges are
    anti-aliased (coverage from the signed distance). The labels are balanced: each class occurs
    ``n // 10`` or ``n // 10 + 1`` times, in random order. Equal ``(n, seed, size)`` give equal
    tensors.

    Args:
        n: Number of images (``>= 0``).
        seed: Seed of the ``torch.Generator`` that draws everything, in ``[0, 2**63)``.
        size: Height and width of the images, in pixels (``>= 8``).

    Returns:
        ``(images, labels)``: ``float32`` images in ``[-1, 1]`` of shape ``(n, 3, size, size)``
        and ``int64`` labels in ``[0, 10)`` (names in :data:`CLASS_NAMES`).

    Raises:
        InputError: If ``n``, ``seed`` or ``size`` is not an integer in range.

    Examples:
        >>> images, labels = generate_shapes(20, seed=0)
        >>> tuple(images.shape), images.dtype, labels.dtype
        ((20, 3, 32, 32), torch.float32, torch.int64)
        >>> bool(images.min() >= -1) and bool(images.max() <= 1)
        True
        >>> torch.bincount(labels, minlength=10).tolist()
        [2, 2, 2, 2, 2, 2, 2, 2, 2, 2]
        >>> torch.equal(generate_shapes(20, seed=0)[0], images)
        True
    """
    for name, value, low in (("n", n, 0), ("size", size, 8)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InputError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    gen = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(n, *shape, generator=gen)

    labels = torch.remainder(torch.randperm(n, generator=gen), len(CLASS_NAMES))
    shape_id, family = labels // 2, labels % 2
    # Per-image parameters, always drawn in this order (so the stream is fixed by (n, seed)).
    center = uniform(-0.25, 0.25, 2)
    scale = uniform(0.42, 0.62)
    angle = uniform(0.0, 2 * math.pi)
    hue_low = torch.tensor([h[0] for h in _HUES])[family]
    hue_high = torch.tensor([h[1] for h in _HUES])[family]
    hue = torch.remainder(hue_low + (hue_high - hue_low) * uniform(0.0, 1.0), 1.0)
    sat, val = uniform(0.65, 1.0), uniform(0.72, 1.0)
    stripe_angle, stripe_phase = uniform(0.0, math.pi), uniform(0.0, 2 * math.pi)
    stripe_period = uniform(3.0, 5.0) / 16.0  # 3-5 pixels at size 32 (a pixel is 2 / size)
    stripe_depth = uniform(0.15, 0.3)
    bg_hue, bg_sat, bg_val = uniform(0.0, 1.0), uniform(0.0, 0.2), uniform(0.15, 0.45)
    bg_angle, bg_slope = uniform(0.0, 2 * math.pi), uniform(0.0, 0.12)

    coords = (torch.arange(size, dtype=torch.float32) + 0.5) * (2.0 / size) - 1.0
    ys, xs = coords.view(1, size, 1), coords.view(1, 1, size)  # rows grow downwards

    def per_image(t: torch.Tensor) -> torch.Tensor:
        return t.view(n, 1, 1)

    dx, dy = xs - per_image(center[:, 0]), ys - per_image(center[:, 1])
    cos, sin = per_image(torch.cos(angle)), per_image(torch.sin(angle))
    s = per_image(scale)
    local_x, local_y = (cos * dx + sin * dy) / s, (cos * dy - sin * dx) / s
    sdf = torch.empty(n, size, size)
    for k in range(len(SHAPES)):
        rows = shape_id == k
        if rows.any():
            sdf[rows] = _shape_sdf(k, local_x[rows], local_y[rows]) * s[rows]
    alpha = torch.clamp(0.5 - sdf * (size / 2.0), 0.0, 1.0)  # coverage; one pixel is 2 / size

    along = per_image(torch.cos(stripe_angle)) * xs + per_image(torch.sin(stripe_angle)) * ys
    stripes = 0.5 + 0.5 * torch.sin(
        2 * math.pi * along / per_image(stripe_period) + per_image(stripe_phase)
    )
    shade = 1.0 - per_image(stripe_depth) * stripes
    fill = _hsv_to_rgb(hue, sat, val).view(n, 3, 1, 1) * shade.unsqueeze(1)

    # RGB is linear in the HSV value, so the gradient scales one colour per image.
    ramp = per_image(torch.cos(bg_angle)) * xs + per_image(torch.sin(bg_angle)) * ys
    bg_value = per_image(bg_val) + per_image(bg_slope) * ramp
    bg_rgb = _hsv_to_rgb(bg_hue, bg_sat, torch.ones(n)).view(n, 3, 1, 1)
    background = bg_value.unsqueeze(1) * bg_rgb
    images = background + alpha.unsqueeze(1) * (fill - background)
    images = images.mul_(2.0).sub_(1.0).clamp_(-1.0, 1.0)
    return images, labels.to(torch.int64)


class ShapesDataModule(SplitDataModule):
    """Disjoint train/val/test splits of :func:`generate_shapes` images, 10 classes.

    Each split is generated from its own seed, ``3 * seed + {train: 0, val: 1, test: 2}``
    (:meth:`split_seed`), so no two (seed, split) pairs share a generator and the splits never
    share images. Batches are ``(images, labels)``: ``float32`` images in ``[-1, 1]`` of shape
    ``(batch, 3, 32, 32)`` and ``int64`` labels. After :meth:`setup`, ``datasets[split]`` holds
    each split (predict reads the test split).

    Args:
        train_size: Number of training images (``>= 1``).
        val_size: Number of validation images (``>= 1``).
        test_size: Number of test (and predict) images (``>= 1``).
        seed: Seed of the splits and of the training shuffle, in ``[0, 2**61)``. ``None`` takes
            the seed of ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset).
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        InputError: If an argument is out of range, naming the argument.

    Examples:
        >>> dm = ShapesDataModule(train_size=64, val_size=16, test_size=16, batch_size=8)
        >>> dm.setup("fit")
        >>> images, labels = next(iter(dm.train_dataloader()))
        >>> tuple(images.shape), labels.dtype
        ((8, 3, 32, 32), torch.int64)
        >>> {split: len(dm.datasets[split]) for split in ("train", "val", "test")}
        {'train': 64, 'val': 16, 'test': 16}

        In YAML::

            data:
              class_path: ada_modules.data.ShapesDataModule
              init_args: {train_size: 8192, batch_size: 64}
    """

    num_classes = len(CLASS_NAMES)
    image_size = 32

    def __init__(
        self,
        train_size: int = 8192,
        val_size: int = 512,
        test_size: int = 1024,
        seed: int | None = 0,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        if not 0 <= self.seed < 2**61:
            raise InputError(f"seed must be None or an integer in [0, 2**61), got {seed!r}")
        sizes = {"train": train_size, "val": val_size, "test": test_size}
        for split, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{split}_size must be an integer >= 1, got {value!r}")
        self.sizes = sizes

    @staticmethod
    def split_seed(seed: int, split: str) -> int:
        """The :func:`generate_shapes` seed of ``split`` (``"train"``, ``"val"`` or ``"test"``).

        >>> seeds = [ShapesDataModule.split_seed(1, split) for split in ("train", "val", "test")]
        >>> seeds == [3, 4, 5]
        True
        """
        if split not in _SPLITS:
            raise InputError(f"split must be one of {_SPLITS}, got {split!r}")
        return 3 * seed + _SPLITS.index(split)

    def setup(self, stage: str | None = None) -> None:
        """Generate the three splits (once)."""
        if self.datasets:
            return
        for split in _SPLITS:
            images, labels = generate_shapes(
                self.sizes[split], self.split_seed(self.seed, split), self.image_size
            )
            self.datasets[split] = TensorDataset(images, labels)
