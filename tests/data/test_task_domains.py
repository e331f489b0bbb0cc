"""TaskDomainsDataModule: named sequence tasks mixed for training and served per domain."""

import pytest

from ada_modules.data import ArithmeticDataModule, RecallDataModule, TaskDomainsDataModule
from ada_modules.errors import InputError


def _tasks():
    return {
        "addition": ArithmeticDataModule(num_train=24, num_val=4, num_test=6, seed=0),
        "recall": RecallDataModule(num_pairs=2, key_length=1, num_train=16, num_val=4,
                                   num_test=6, seed=0),
    }  # fmt: skip


def test_training_mixes_the_train_domains_and_tests_each_eval_domain_in_order():
    tasks = _tasks()
    dm = TaskDomainsDataModule(
        tasks, train_domains=["recall", "addition"], eval_domains=["recall", "addition"],
        batch_size=8, eval_batch_size=4, seed=0,
    )  # fmt: skip
    dm.setup("fit")
    mixed = dm.datasets["train"]
    assert mixed == tasks["recall"].datasets["train"] + tasks["addition"].datasets["train"]
    assert len(dm.datasets["val"]) == 8
    batch = next(iter(dm.train_dataloader()))
    assert {"input_ids", "attention_mask", "labels"} <= set(batch)
    assert batch["input_ids"].shape[0] == 8
    dm.setup("test")
    loaders = dm.test_dataloader()
    assert [loader.dataset for loader in loaders] == [
        tasks["recall"].datasets["test"],
        tasks["addition"].datasets["test"],
    ]
    calibration = dm.domain_dataloader("addition", "train")
    assert (
        calibration.batch_size == 8 and calibration.dataset is tasks["addition"].datasets["train"]
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"train_domains": ["nope"]}, "unknown domain 'nope'"),
        ({"train_domains": ["recall", "recall"]}, "lists a domain twice"),
        ({"train_domains": "recall"}, "non-empty list of domain names"),
        ({"train_domains": ["recall"], "eval_domains": ["other"]}, "eval_domains has an unknown"),
    ],
)
def test_bad_domains_are_named(kwargs, message):
    with pytest.raises(InputError, match=message):
        TaskDomainsDataModule(_tasks(), **kwargs)


def test_bad_tasks_and_splits():
    with pytest.raises(InputError, match="non-empty mapping"):
        TaskDomainsDataModule({}, train_domains=["recall"])
    with pytest.raises(InputError, match=r"tasks\['x'\] must be a SequenceTaskDataModule"):
        TaskDomainsDataModule({"x": object()}, train_domains=["x"])
    dm = TaskDomainsDataModule(_tasks(), train_domains=["recall"])
    with pytest.raises(InputError, match="split must be"):
        dm.domain_dataloader("recall", "calibration")
    with pytest.raises(InputError, match="unknown domain 'nope'"):
        dm.domain_dataloader("nope", "train")
