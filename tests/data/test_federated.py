import pytest
import torch

from ada_modules.data import DigitsDataModule, FederatedDataModule


def _setup(**kwargs):
    dm = FederatedDataModule(DigitsDataModule(seed=0), **{"num_clients": 8, "rounds": 4, **kwargs})
    dm.setup("fit")
    return dm


def test_root_auxiliary_set_and_clients_split_the_training_data():
    dm = _setup(root_size=50, auxiliary_size=70)
    train_x, _ = dm.data.datasets["train"].tensors
    rows = torch.cat([dm.root[0], dm.auxiliary[0], dm.clients.x])
    assert len(dm.root[0]) == 50 and len(dm.auxiliary[0]) == 70 and len(rows) == len(train_x)
    # every training image is in exactly one of the root set, the auxiliary set and the clients
    assert torch.equal(torch.sort(rows.sum(1)).values, torch.sort(train_x.sum(1)).values)
    assert len(dm.clients) == 8 and int(dm.clients.sizes.min()) >= 1


def test_rounds_are_deterministic_and_shaped_for_local_steps():
    first = [b["x"] for b in _setup(local_steps=3, batch_size=5).train_dataloader()]
    again = [b["x"] for b in _setup(local_steps=3, batch_size=5).train_dataloader()]
    assert len(first) == 4 and first[0].shape == (8, 3, 5, 64)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])  # rounds draw different batches
    other = next(iter(_setup(local_steps=3, batch_size=5, seed=1).train_dataloader()))["x"]
    assert not torch.equal(first[0], other)


def test_dirichlet_skews_the_clients_labels_and_iid_does_not():
    def max_share(dm):
        shares = []
        for i in range(len(dm.clients)):
            start, size = int(dm.clients.offsets[i]), int(dm.clients.sizes[i])
            counts = torch.bincount(dm.clients.y[start : start + size], minlength=10)
            shares.append(float(counts.max()) / size)
        return sum(shares) / len(shares)

    assert max_share(_setup(partition="dirichlet", alpha=0.1)) > 2 * max_share(
        _setup(partition="iid")
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_clients": 1}, "num_clients"),
        ({"partition": "shards"}, "partition"),
        ({"alpha": 0.0}, "alpha"),
        ({"rounds": 0}, "rounds"),
        ({"local_steps": 0}, "local_steps"),
        ({"root_size": -1}, "root_size"),
        ({"auxiliary_size": -1}, "auxiliary_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FederatedDataModule(DigitsDataModule(seed=0), **kwargs)


def test_data_must_be_a_split_datamodule_and_large_enough():
    with pytest.raises(ValueError, match="SplitDataModule"):
        FederatedDataModule(data=[1, 2, 3])
    with pytest.raises(ValueError, match="root_size"):
        _setup(root_size=5000)
