"""Tests of ada_modules.fl.partition: IID and Dirichlet label-skew client partitions."""

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.fl.partition import MAX_TRIES, partition

LABELS = torch.arange(2000) % 10


def _assert_exact_cover(parts: list[torch.Tensor], num_samples: int) -> None:
    joined = torch.cat(parts)
    assert joined.dtype == torch.int64
    assert torch.equal(joined.sort().values, torch.arange(num_samples))


def _mean_max_class_share(parts: list[torch.Tensor], labels: torch.Tensor) -> float:
    shares = [torch.bincount(labels[p], minlength=10).max().item() / len(p) for p in parts]
    return sum(shares) / len(shares)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
@pytest.mark.parametrize("num_clients", [1, 7, 20])
def test_disjoint_complete_deterministic(scheme, num_clients):
    parts = partition(LABELS, num_clients, scheme=scheme, alpha=0.5, seed=3)
    assert len(parts) == num_clients
    _assert_exact_cover(parts, len(LABELS))
    for part in parts:
        assert torch.equal(part, part.sort().values)
    again = partition(LABELS, num_clients, scheme=scheme, alpha=0.5, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(parts, again, strict=True))
    if num_clients > 1:
        other = partition(LABELS, num_clients, scheme=scheme, alpha=0.5, seed=4)
        assert not all(torch.equal(a, b) for a, b in zip(parts, other, strict=True))


@pytest.mark.parametrize("num_samples, num_clients", [(10, 3), (101, 10), (5, 5), (1000, 7)])
def test_iid_sizes_differ_by_at_most_one(num_samples, num_clients):
    parts = partition(torch.zeros(num_samples, dtype=torch.long), num_clients)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    _assert_exact_cover(parts, num_samples)


def test_dirichlet_alpha_controls_label_skew():
    skewed = partition(LABELS, 10, scheme="dirichlet", alpha=0.1, seed=0)
    uniform = partition(LABELS, 10, scheme="dirichlet", alpha=100.0, seed=0)
    iid = partition(LABELS, 10, scheme="iid", seed=0)
    assert _mean_max_class_share(skewed, LABELS) > 0.45
    assert _mean_max_class_share(uniform, LABELS) < 0.16
    assert _mean_max_class_share(iid, LABELS) < 0.16


def test_dirichlet_min_size_respected():
    unconstrained = []
    for seed in range(5):
        parts = partition(LABELS, 10, scheme="dirichlet", alpha=0.5, seed=seed, min_size=100)
        assert min(len(p) for p in parts) >= 100
        _assert_exact_cover(parts, len(LABELS))
        free = partition(LABELS, 10, scheme="dirichlet", alpha=0.5, seed=seed)
        unconstrained.append(min(len(p) for p in free))
    assert min(unconstrained) < 100  # the constraint made partition redraw


def test_dirichlet_gives_up_after_bounded_tries():
    # 100 samples of one class, 50 clients, >= 2 each: only an exactly even split works.
    with pytest.raises(InputError, match=f"{MAX_TRIES} Dirichlet draws"):
        partition(torch.zeros(100, dtype=torch.long), 50, "dirichlet", alpha=0.1, min_size=2)


def test_keeps_device_and_accepts_other_integer_dtypes():
    parts = partition(LABELS.to(torch.int32), 4, scheme="dirichlet")
    assert all(p.device == LABELS.device and p.dtype == torch.int64 for p in parts)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_clients": 0}, "num_clients must be an integer >= 1, got 0"),
        ({"num_clients": 2001}, r"num_clients must be at most the number of samples \(2000\)"),
        ({"num_clients": 2.0}, "num_clients must be an integer"),
        ({"scheme": "shards"}, r"scheme must be one of \('iid', 'dirichlet'\), got 'shards'"),
        ({"alpha": 0.0}, "alpha must be a finite number > 0, got 0.0"),
        ({"alpha": -1}, "alpha must be a finite number > 0"),
        ({"alpha": float("inf")}, "alpha must be a finite number > 0"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"min_size": 0}, "min_size must be an integer >= 1, got 0"),
        ({"min_size": 201}, r"min_size must be at most num_samples // num_clients = 200"),
    ],
)
def test_bad_input(kwargs, match):
    args = {"labels": LABELS, "num_clients": 10, **kwargs}
    with pytest.raises(InputError, match=match):
        partition(**args)


@pytest.mark.parametrize(
    "labels, match",
    [
        ([0, 1], "labels must be a torch.Tensor, got list"),
        (torch.zeros(2, 3, dtype=torch.long), r"non-empty 1-D tensor, got shape \(2, 3\)"),
        (torch.zeros(0, dtype=torch.long), r"non-empty 1-D tensor, got shape \(0,\)"),
        (torch.zeros(4), "labels must have an integer dtype, got torch.float32"),
    ],
)
def test_bad_labels(labels, match):
    with pytest.raises(InputError, match=match):
        partition(labels, 1)
