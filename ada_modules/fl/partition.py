"""Splitting a data set's samples among federated clients: IID or Dirichlet label skew.

:func:`partition` returns, per client, a tensor of sample indices. The clients' index sets are
disjoint and together cover every sample exactly once; equal arguments give equal partitions.

- ``"iid"``: a random permutation of the samples cut into ``num_clients`` consecutive pieces
  whose sizes differ by at most one.
- ``"dirichlet"``: label skew (Hsu et al., 2019). For each class, the shares of the clients are
  drawn from ``Dirichlet(alpha, ..., alpha)`` and the class's shuffled samples are cut in those
  shares. Small ``alpha`` (``0.1``) gives each client few classes; large ``alpha`` (``100``)
  approaches the IID split. The draw is repeated until every client has at least ``min_size``
  samples, at most :data:`MAX_TRIES` times.

Examples:
    >>> import torch
    >>> labels = torch.arange(10) % 2
    >>> [part.tolist() for part in partition(labels, 3, seed=0)]
    [[1, 4, 5, 7], [0, 3, 9], [2, 6, 8]]
    >>> parts = partition(labels, 2, scheme="dirichlet", alpha=0.5, seed=0)
    >>> sorted(torch.cat(parts).tolist()) == list(range(10))
    True
"""

import math

import numpy as np
import torch
from torch import Tensor

from ada_modules.errors import InputError

__all__ = ["MAX_TRIES", "SCHEMES", "partition"]

SCHEMES = ("iid", "dirichlet")
#: How many Dirichlet draws :func:`partition` makes before giving up on ``min_size``.
MAX_TRIES = 100


def partition(
    labels: Tensor,
    num_clients: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 1,
) -> list[Tensor]:
    """Each client's sample indices (``int64``, ascending, on ``labels``' device).

    Args:
        labels: The integer class label of every sample, shape ``(num_samples,)``. Only its length
            matters for ``"iid"``.
        num_clients: How many clients, in ``[1, num_samples]``.
        scheme: ``"iid"`` or ``"dirichlet"`` (see the module docstring).
        alpha: Concentration of the Dirichlet distribution, ``> 0`` (``"dirichlet"`` only).
        seed: Non-negative seed of the draw: equal seeds give equal partitions.
        min_size: The fewest samples a client may get, ``>= 1`` (``num_clients * min_size`` must
            not exceed the number of samples). Always met by ``"iid"``.

    Returns:
        ``num_clients`` index tensors, disjoint and covering ``range(num_samples)``.

    Raises:
        InputError: On a bad argument (naming it and what is allowed), or when ``MAX_TRIES``
            Dirichlet draws all left a client with fewer than ``min_size`` samples.
    """
    num_samples = _check_labels(labels)
    _check_int("num_clients", num_clients, 1)
    if num_clients > num_samples:
        raise InputError(
            f"num_clients must be at most the number of samples ({num_samples}), got {num_clients}"
        )
    if scheme not in SCHEMES:
        raise InputError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise InputError(f"alpha must be a finite number > 0, got {alpha!r}")
    _check_int("seed", seed, 0)
    _check_int("min_size", min_size, 1)
    if num_clients * min_size > num_samples:
        raise InputError(
            f"min_size must be at most num_samples // num_clients = {num_samples // num_clients} "
            f"({num_samples} samples, {num_clients} clients), got {min_size}"
        )
    if scheme == "iid":
        generator = torch.Generator().manual_seed(seed)
        pieces = torch.tensor_split(torch.randperm(num_samples, generator=generator), num_clients)
        parts = [piece.numpy() for piece in pieces]
    else:
        parts = _dirichlet(labels.detach().cpu().numpy(), num_clients, alpha, seed, min_size)
    return [torch.from_numpy(np.sort(part)).to(torch.int64).to(labels.device) for part in parts]


def _dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int
) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    classes = [np.flatnonzero(labels == label) for label in np.unique(labels)]
    for _ in range(MAX_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for members in classes:
            members = rng.permutation(members)
            shares = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
            for client, piece in enumerate(np.split(members, cuts)):
                parts[client].append(piece)
        merged = [np.concatenate(pieces) for pieces in parts]
        if min(len(part) for part in merged) >= min_size:
            return merged
    raise InputError(
        f"partition could not give every client at least min_size={min_size} samples in "
        f"{MAX_TRIES} Dirichlet draws (alpha={alpha}, num_clients={num_clients}, "
        f"{len(labels)} samples); raise alpha, or lower num_clients or min_size"
    )


def _check_labels(labels: Tensor) -> int:
    if not isinstance(labels, Tensor):
        raise InputError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.ndim != 1 or labels.numel() == 0:
        raise InputError(f"labels must be a non-empty 1-D tensor, got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise InputError(f"labels must have an integer dtype, got {labels.dtype}")
    return labels.numel()


def _check_int(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
