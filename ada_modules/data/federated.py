"""Federated rounds over any of the library's split DataModules: clients, a root set, per-round
batches."""

from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError
from ada_modules.fl.clients import ClientData
from ada_modules.fl.partition import SCHEMES, partition

__all__ = ["FederatedDataModule"]


class _Rounds(Dataset):
    """Round ``r`` is every client's batches, drawn from a generator seeded by ``(seed, r)``."""

    def __init__(self, clients: ClientData, rounds: int, batch_size: int, steps: int, seed: int):
        self.clients, self.rounds, self.batch_size = clients, rounds, batch_size
        self.steps, self.seed = steps, seed

    def __len__(self) -> int:
        return self.rounds

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x, y = self.clients.sample_batches(self.batch_size, generator, num_steps=self.steps)
        return {"x": x, "y": y, "round": torch.tensor(index)}


class FederatedDataModule(LightningDataModule):
    """The training split of ``data`` shared among ``num_clients`` clients, one batch per round.

    ``setup`` holds out ``root_size`` training samples as the server's clean root set (FLTrust's)
    and ``auxiliary_size`` as the attackers' auxiliary set (drawn like the test data: what a
    feedback attack measures the global model on), then partitions the rest among the clients (IID or Dirichlet label skew with ``alpha``). The
    training loader yields ``rounds`` items, one per federated round, each a dict with ``x`` of
    shape ``(num_clients, local_steps, batch_size, ...)``, ``y`` ``(num_clients, local_steps,
    batch_size)`` and the ``round`` index; equal seeds give equal rounds. The evaluation loaders are
    ``data``'s (the server's held-out data).

    Args:
        data: A :class:`~ada_modules.data.split_datamodule.SplitDataModule` whose splits hold
            ``(x, y)`` pairs, e.g. ``DigitsDataModule(flatten=True)``.
        num_clients: Clients ``n``.
        partition: ``"iid"`` or ``"dirichlet"``.
        alpha: Dirichlet concentration (smaller: more label skew).
        rounds: Federated rounds (the length of the training loader).
        batch_size: Samples per client per local step.
        local_steps: Local SGD steps per round (FedAvg; 1 for FedSGD).
        root_size: Samples of the server's root set (0: none).
        auxiliary_size: Samples of the attackers' auxiliary set (0: none).
        seed: Seed of the root set, the partition and the batches (``None``: ``data.seed``).

    Examples:
        >>> from ada_modules.data import DigitsDataModule
        >>> dm = FederatedDataModule(DigitsDataModule(seed=0), num_clients=5, rounds=3)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> tuple(batch["x"].shape), tuple(batch["y"].shape), len(dm.root[0]), len(dm.auxiliary[0])
        ((5, 1, 32, 64), (5, 1, 32), 100, 200)
    """

    def __init__(
        self,
        data: SplitDataModule,
        num_clients: int = 20,
        partition: str = "dirichlet",
        alpha: float = 0.5,
        rounds: int = 100,
        batch_size: int = 32,
        local_steps: int = 1,
        root_size: int = 100,
        auxiliary_size: int = 200,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(data, SplitDataModule):
            raise InputError(
                f"data must be one of the library's SplitDataModules (e.g. DigitsDataModule), "
                f"got {type(data).__name__}"
            )
        if partition not in SCHEMES:
            raise InputError(f"partition must be one of {list(SCHEMES)}, got {partition!r}")
        for name, value, low in (
            ("num_clients", num_clients, 2),
            ("rounds", rounds, 1),
            ("batch_size", batch_size, 1),
            ("local_steps", local_steps, 1),
            ("root_size", root_size, 0),
            ("auxiliary_size", auxiliary_size, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        if not alpha > 0:
            raise InputError(f"alpha must be > 0, got {alpha!r}")
        self.data = data
        self.num_clients = num_clients
        self.partition = partition
        self.alpha = alpha
        self.rounds = rounds
        self.batch_size = batch_size
        self.local_steps = local_steps
        self.root_size = root_size
        self.auxiliary_size = auxiliary_size
        self.seed = data.seed if seed is None else seed
        self.clients: ClientData | None = None
        self.root: tuple[Tensor, Tensor] | None = None
        self.auxiliary: tuple[Tensor, Tensor] | None = None

    def setup(self, stage: str) -> None:
        self.data.setup(stage)
        if self.clients is not None or "train" not in self.data.datasets:
            return
        x, y = _tensors(self.data.datasets["train"])
        held_out = self.root_size + self.auxiliary_size
        if len(y) < held_out + self.num_clients:
            raise InputError(
                f"root_size={self.root_size}, auxiliary_size={self.auxiliary_size} and "
                f"num_clients={self.num_clients} need more than the {len(y)} training samples"
            )
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.seed))
        root, auxiliary = order[: self.root_size], order[self.root_size : held_out]
        rest = order[held_out:]
        self.root = (x[root], y[root])
        self.auxiliary = (x[auxiliary], y[auxiliary])
        parts = partition(
            y[rest], self.num_clients, scheme=self.partition, alpha=self.alpha, seed=self.seed
        )
        self.clients = ClientData.from_partition(x[rest], y[rest], parts)

    def train_dataloader(self) -> DataLoader:
        if self.clients is None:
            raise RuntimeError("the clients are not set up; call setup('fit') first")
        rounds = _Rounds(self.clients, self.rounds, self.batch_size, self.local_steps, self.seed)
        return DataLoader(rounds, batch_size=None)

    def val_dataloader(self) -> Any:
        return self.data.val_dataloader()

    def test_dataloader(self) -> Any:
        return self.data.test_dataloader()

    def eval_tensors(self, split: str = "val") -> tuple[Tensor, Tensor]:
        """All ``(x, y)`` of ``data``'s ``split`` as two tensors (the server's evaluation set)."""
        return _tensors(self.data.datasets[split])


def _tensors(dataset: Any) -> tuple[Tensor, Tensor]:
    """``(x, y)`` of a TensorDataset, or stacked from any dataset of pairs."""
    if hasattr(dataset, "tensors"):
        return dataset.tensors[0], dataset.tensors[1]
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    return torch.stack(list(xs)), torch.as_tensor(ys)
