"""Image + text questions whose two modalities agree or conflict, for modality-preference steering.

Each item pairs an 8x8 handwritten digit (scikit-learn's digits, as four 4x4 patches) with a short
text statement of a digit, and asks which of two options it shows; as in MC², conflicts are asked in
both option orders. The prompt, in :class:`~ada_modules.data.CharTokenizer` characters::

    n=3|A3B7>        instruction (n: none, i: follow the image, t: follow the text),
                     statement (=: sure, ?: hedged; "##" when the text is removed), options
    A3<eos>          the answer: the letter, then its digit

How the training labels resolve a conflict sets the model's modality preference: without an
instruction the text wins when it is sure and the image wins when it is hedged, so a trained model
prefers the text on most conflicts but not all, and how much each modality contributes varies per
instance (what the Modality Contribution Ratio measures).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError

__all__ = [
    "ITEM_KINDS",
    "ModalityConflictDataModule",
    "ModalityConflictItems",
    "make_conflict_items",
]

ITEM_KINDS = ("consistent", "conflict", "instructed", "no_image", "no_text")
"""Item kinds: both modalities agree; they disagree (no instruction); they disagree and the prompt
says which to follow; the image removed; the text removed."""
INSTRUCTIONS = "nit"
PROMPT_LENGTH = 9
ANSWER_LENGTH = 3
_STATEMENT = slice(1, 3)  # the statement characters in the prompt


@dataclass(frozen=True)
class ModalityConflictItems(Dataset):
    """Items as tensors; row ``i`` is a dict of the fields (batches of them collate by key).

    Fields: ``patches`` ``(n, 4, 16)`` pixels in ``[0, 1]`` plus noise; ``image_present``;
    ``image_class``; ``text_class`` (-1 when the text is removed); ``hedged``; ``instruction``
    (index into ``"nit"``); ``options`` ``(n, 2)`` digits; ``target`` (index of the labelled
    option); ``kind`` (index into :data:`ITEM_KINDS`); ``prompt_ids`` ``(n, 9)``;
    ``answer_ids`` ``(n, 3)`` (letter, digit, ``<eos>``).
    """

    patches: Tensor
    image_present: Tensor
    image_class: Tensor
    text_class: Tensor
    hedged: Tensor
    instruction: Tensor
    options: Tensor
    target: Tensor
    kind: Tensor
    prompt_ids: Tensor
    answer_ids: Tensor

    def __len__(self) -> int:
        return self.kind.shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name)[index] for f in fields(self)}


def _to_patches(images: Tensor) -> Tensor:
    """``(n, 64)`` 8x8 images -> ``(n, 4, 16)``: the four 4x4 quadrants, row-major."""
    grid = images.reshape(-1, 2, 4, 2, 4).permute(0, 1, 3, 2, 4)
    return grid.reshape(-1, 4, 16)


def _prompt(instruction: int, hedged: bool, text_class: int, options: tuple[int, int]) -> str:
    statement = "##" if text_class < 0 else f"{'?' if hedged else '='}{text_class}"
    return f"{INSTRUCTIONS[instruction]}{statement}|A{options[0]}B{options[1]}>"


def make_conflict_items(
    images: Tensor,
    labels: Tensor,
    counts: dict[str, int],
    rng: np.random.Generator,
    hedge_probability: float = 0.3,
    max_noise: float = 0.5,
    both_orders: bool = False,
) -> ModalityConflictItems:
    """Draw items of each kind in ``counts`` from ``images`` ``(n, 64)`` with digit ``labels``.

    Each item takes a random image and adds Gaussian pixel noise of a standard deviation drawn in
    ``[0, max_noise]``. Conflicts and instructed items state another digit than the image's; the
    options are the image's and the text's digit (a random other digit for consistent items, and
    for the one modality left in ``no_image`` / ``no_text`` items). Labels: consistent: the
    digit; conflict: the text's digit if the statement is sure, the image's if hedged;
    instructed: the modality the instruction names; ``no_*``: the modality left.

    Args:
        images: ``(n, 64)`` pixels in ``[0, 1]``.
        labels: ``(n,)`` digits 0-9.
        counts: Items per kind, keys from :data:`ITEM_KINDS`.
        rng: The random generator (the seed of the items).
        hedge_probability: Share of statements that are hedged.
        max_noise: Largest pixel-noise standard deviation.
        both_orders: Ask each item in both option orders (the count is then of pairs).

    Example:
        >>> from sklearn.datasets import load_digits
        >>> x, y = load_digits(return_X_y=True)
        >>> items = make_conflict_items(torch.tensor(x / 16.0, dtype=torch.float32),
        ...                             torch.tensor(y), {"conflict": 2}, np.random.default_rng(0),
        ...                             both_orders=True)
        >>> len(items), tuple(items.patches.shape), CharTokenizer().decode(items.prompt_ids[0])
        (4, (4, 4, 16), 'n?8|A8B2>')
    """
    unknown = sorted(set(counts) - set(ITEM_KINDS))
    if unknown:
        raise InputError(f"unknown item kind {unknown[0]!r}; allowed: {', '.join(ITEM_KINDS)}")
    if not 0 <= hedge_probability <= 1:
        raise InputError(f"hedge_probability must be in [0, 1], got {hedge_probability!r}")
    if not max_noise >= 0:
        raise InputError(f"max_noise must be >= 0, got {max_noise!r}")
    tokenizer = CharTokenizer()
    rows: dict[str, list] = {f.name: [] for f in fields(ModalityConflictItems)}
    for kind_name, count in counts.items():
        kind = ITEM_KINDS.index(kind_name)
        for _ in range(count):
            index = int(rng.integers(len(labels)))
            image_class = int(labels[index])
            other = int((image_class + rng.integers(1, 10)) % 10)
            noise = rng.normal(0.0, rng.uniform(0.0, max_noise), size=64)
            image = images[index] + torch.from_numpy(noise).float()
            hedged = bool(rng.random() < hedge_probability)
            instruction, present = 0, True
            if kind_name == "consistent":
                text_class, answer = image_class, image_class
            elif kind_name == "conflict":
                text_class = other
                answer = image_class if hedged else text_class
            elif kind_name == "instructed":  # a conflict, or (a third of them) agreeing
                text_class = other if rng.random() < 2 / 3 else image_class
                instruction = int(rng.integers(1, 3))
                answer = image_class if instruction == 1 else text_class
            elif kind_name == "no_image":
                text_class, present, answer = other, False, other
                image = torch.zeros(64)
            else:  # no_text
                text_class, answer = -1, image_class
            if present and text_class not in (-1, image_class):  # a conflict: both digits
                pair = [answer, text_class if answer == image_class else image_class]
            else:  # one digit in play: a random other digit as the distractor
                pair = [answer, int((answer + rng.integers(1, 10)) % 10)]
            first = int(rng.integers(2))
            orders = [first, 1 - first] if both_orders else [first]
            for order in orders:
                options = (pair[order], pair[1 - order])
                target = 0 if options[0] == answer else 1
                rows["patches"].append(_to_patches(image.unsqueeze(0))[0])
                rows["image_present"].append(present)
                rows["image_class"].append(image_class)
                rows["text_class"].append(text_class)
                rows["hedged"].append(hedged and text_class >= 0)
                rows["instruction"].append(instruction)
                rows["options"].append(options)
                rows["target"].append(target)
                rows["kind"].append(kind)
                rows["prompt_ids"].append(
                    tokenizer.encode(_prompt(instruction, hedged, text_class, options))
                )
                letter = "AB"[target]
                rows["answer_ids"].append(tokenizer.encode(f"{letter}{answer}", add_eos=True))
    return ModalityConflictItems(
        patches=torch.stack(rows["patches"]) if rows["patches"] else torch.zeros(0, 4, 16),
        image_present=torch.tensor(rows["image_present"], dtype=torch.bool),
        image_class=torch.tensor(rows["image_class"], dtype=torch.long),
        text_class=torch.tensor(rows["text_class"], dtype=torch.long),
        hedged=torch.tensor(rows["hedged"], dtype=torch.bool),
        instruction=torch.tensor(rows["instruction"], dtype=torch.long),
        options=torch.tensor(rows["options"], dtype=torch.long).reshape(-1, 2),
        target=torch.tensor(rows["target"], dtype=torch.long),
        kind=torch.tensor(rows["kind"], dtype=torch.long),
        prompt_ids=torch.tensor(rows["prompt_ids"], dtype=torch.long).reshape(-1, PROMPT_LENGTH),
        answer_ids=torch.tensor(rows["answer_ids"], dtype=torch.long).reshape(-1, ANSWER_LENGTH),
    )


def without_image(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The batch with every image removed (the model sees its learned "no image" tokens)."""
    return {**batch, "image_present": torch.zeros_like(batch["image_present"])}


def without_text(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The batch with every statement removed (its two characters become ``##``)."""
    prompt = batch["prompt_ids"].clone()
    prompt[:, _STATEMENT] = CharTokenizer().encode("#")[0]
    return {**batch, "prompt_ids": prompt}


def with_instruction(batch: dict[str, Tensor], instruction: str) -> dict[str, Tensor]:
    """The batch with the instruction character set to ``instruction`` (``n``, ``i`` or ``t``)."""
    if instruction not in INSTRUCTIONS:
        raise InputError(f"instruction must be one of n, i, t, got {instruction!r}")
    prompt = batch["prompt_ids"].clone()
    prompt[:, 0] = CharTokenizer().encode(instruction)[0]
    return {**batch, "prompt_ids": prompt}


class ModalityConflictDataModule(SplitDataModule):
    """Two-modality digit questions (see the module docstring) over disjoint image splits.

    scikit-learn's digit images are split once by ``seed`` (60/15/25 %); each split's items are
    drawn from its own images. ``train`` and ``val`` mix all kinds (``mix`` gives the shares);
    ``test`` holds ``test_size`` conflicts and as many consistent items, each asked in both
    option orders (``4 * test_size`` rows). ``datasets[split]`` is a :class:`ModalityConflictItems`.

    Args:
        seed: Seed of the split and the items (``None``: ``seed_everything``'s).
        train_size: Training items.
        val_size: Validation items.
        test_size: Test conflicts (and consistent items), each in both orders.
        mix: Shares of each item kind in train/val (keys from :data:`ITEM_KINDS`).
        hedge_probability: Share of hedged statements.
        max_noise: Largest pixel-noise standard deviation.
        batch_size: Training batch size.
        eval_batch_size: Evaluation batch size (default ``batch_size``).
        num_workers: Loader workers.

    Example:
        >>> dm = ModalityConflictDataModule(seed=0, train_size=64, val_size=16, test_size=8)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> tuple(batch["patches"].shape), tuple(batch["prompt_ids"].shape), len(dm.datasets["test"])
        ((32, 4, 16), (32, 9), 32)
    """

    def __init__(
        self,
        seed: int | None = None,
        train_size: int = 6000,
        val_size: int = 500,
        test_size: int = 250,
        mix: dict[str, float] | None = None,
        hedge_probability: float = 0.3,
        max_noise: float = 0.5,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seed, batch_size, eval_batch_size, num_workers)
        for name, value in (
            ("train_size", train_size),
            ("val_size", val_size),
            ("test_size", test_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an int >= 1, got {value!r}")
        mix = dict(
            mix
            or {
                "consistent": 0.35,
                "conflict": 0.25,
                "instructed": 0.2,
                "no_image": 0.1,
                "no_text": 0.1,
            }
        )
        unknown = sorted(set(mix) - set(ITEM_KINDS))
        if unknown:
            raise InputError(
                f"unknown kind {unknown[0]!r} in mix; allowed: {', '.join(ITEM_KINDS)}"
            )
        if any(not v >= 0 for v in mix.values()) or not sum(mix.values()) > 0:
            raise InputError(f"mix shares must be >= 0 and not all 0, got {mix}")
        if not 0 <= hedge_probability <= 1:
            raise InputError(f"hedge_probability must be in [0, 1], got {hedge_probability!r}")
        if not max_noise >= 0:
            raise InputError(f"max_noise must be >= 0, got {max_noise!r}")
        self.train_size, self.val_size, self.test_size = train_size, val_size, test_size
        self.mix = mix
        self.hedge_probability = hedge_probability
        self.max_noise = max_noise

    def _counts(self, size: int) -> dict[str, int]:
        """Items per kind summing to ``size`` (largest remainder of each share)."""
        total = sum(self.mix.values())
        exact = {kind: size * share / total for kind, share in self.mix.items()}
        counts = {kind: int(value) for kind, value in exact.items()}
        by_remainder = sorted(exact, key=lambda kind: counts[kind] - exact[kind])
        for kind in by_remainder[: size - sum(counts.values())]:
            counts[kind] += 1
        return counts

    def setup(self, stage: str | None = None) -> None:
        """Split the images and draw the items (once)."""
        if self.datasets:
            return
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        order = np.random.default_rng(self.seed).permutation(len(labels))
        cut = [int(0.6 * len(order)), int(0.75 * len(order))]
        x = torch.tensor(images / 16.0, dtype=torch.float32)
        y = torch.tensor(labels, dtype=torch.long)
        parts = np.split(order, cut)
        rng = np.random.default_rng([self.seed, 1])
        common = {"hedge_probability": self.hedge_probability, "max_noise": self.max_noise}
        plans = {
            "train": (self._counts(self.train_size), False),
            "val": (self._counts(self.val_size), False),
            "test": ({"conflict": self.test_size, "consistent": self.test_size}, True),
        }
        for (split, (counts, both)), idx in zip(plans.items(), parts, strict=True):
            idx = torch.from_numpy(np.sort(idx))
            self.datasets[split] = make_conflict_items(
                x[idx], y[idx], counts, rng, both_orders=both, **common
            )

    def items(self, split: str) -> ModalityConflictItems:
        """The items of ``split`` (after :meth:`setup`)."""
        if split not in self.datasets:
            raise RuntimeError(f"the {split} split is not set up; call setup() first")
        return self.datasets[split]
