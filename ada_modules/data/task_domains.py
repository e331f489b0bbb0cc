"""Several sequence tasks as named domains of one data module (a core task and specialist tasks).

Every :class:`~ada_modules.data.SequenceTaskDataModule` shares
:class:`~ada_modules.data.CharTokenizer`, so one language model can learn any mix of them: a base
model trained on a core task, specialists fine-tuned on others, and a merge scored on each.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader

from ada_modules.data.sequence_task import SequenceCollator, SequenceTaskDataModule
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError

__all__ = ["TaskDomainsDataModule"]


class _MixedCollator(SequenceCollator):
    """A :class:`SequenceCollator` for batches that mix tasks: keeps the metadata keys (e.g.
    ``hops``, ``digits``) that every example of the batch has, and drops the others."""

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Any]:
        shared = set.intersection(*(set(item["metadata"]) for item in items))
        return super().__call__(
            [{**item, "metadata": {k: item["metadata"][k] for k in shared}} for item in items]
        )


class TaskDomainsDataModule(SplitDataModule):
    """Named sequence tasks (domains); train on some, test on each.

    Training and validation read the union of ``train_domains`` (shuffled together); ``test``
    gives one loader per entry of ``eval_domains`` (Lightning's ``dataloader_idx`` is the position
    in that list), and :meth:`domain_dataloader` gives any split of any domain, e.g. calibration
    data for merging. Each task keeps its own seed and sizes; batches have the keys of
    :class:`~ada_modules.data.SequenceCollator` (of the metadata, those every example of the
    batch has).

    Args:
        tasks: Domain name -> task data module (its ``batch_size`` is not used).
        train_domains: Domains mixed in the train and val splits.
        eval_domains: Domains of the test loaders, in order (default: ``train_domains``).
        seed: Seed of the shuffle of the mixed training set (each task has its own data seed);
            ``None`` takes the seed of ``seed_everything``.
        batch_size: Batch size of the training loaders (and of ``domain_dataloader(d, "train")``).
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        InputError: No tasks, a task that is not a sequence task, or an unknown or repeated
            domain name.

    Examples:
        >>> from ada_modules.data import ArithmeticDataModule, RecallDataModule
        >>> dm = TaskDomainsDataModule(
        ...     {"recall": RecallDataModule(num_train=64, num_val=8, num_test=8, seed=0),
        ...      "addition": ArithmeticDataModule(num_train=64, num_val=8, num_test=8, seed=0)},
        ...     train_domains=["recall"], eval_domains=["recall", "addition"], batch_size=16)
        >>> dm.setup("fit")
        >>> len(dm.datasets["train"]), [len(loader.dataset) for loader in dm.test_dataloader()]
        (64, [8, 8])

        In YAML::

            data:
              class_path: ada_modules.data.TaskDomainsDataModule
              init_args:
                tasks:
                  recall: {class_path: ada_modules.data.RecallDataModule}
                  addition: {class_path: ada_modules.data.ArithmeticDataModule}
                train_domains: [recall]
    """

    def __init__(
        self,
        tasks: Mapping[str, SequenceTaskDataModule],
        train_domains: Sequence[str],
        eval_domains: Sequence[str] | None = None,
        seed: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed, batch_size=batch_size, eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )  # fmt: skip
        if not isinstance(tasks, Mapping) or not tasks:
            raise InputError(f"tasks must be a non-empty mapping of name -> task, got {tasks!r}")
        for name, task in tasks.items():
            if not isinstance(task, SequenceTaskDataModule):
                raise InputError(
                    f"tasks[{name!r}] must be a SequenceTaskDataModule, got {type(task).__name__}"
                )
        self.tasks = dict(tasks)
        self.train_domains = self._domains("train_domains", train_domains)
        self.eval_domains = self._domains("eval_domains", eval_domains or self.train_domains)
        self.tokenizer = CharTokenizer()
        self.collate_fn = _MixedCollator(self.tokenizer.pad_id)

    def _domains(self, name: str, domains: Sequence[str]) -> list[str]:
        if isinstance(domains, str) or not isinstance(domains, Sequence) or not domains:
            raise InputError(f"{name} must be a non-empty list of domain names, got {domains!r}")
        for domain in domains:
            if domain not in self.tasks:
                raise InputError(
                    f"{name} has an unknown domain {domain!r}; known: {', '.join(self.tasks)}"
                )
        if len(set(domains)) != len(domains):
            raise InputError(f"{name} lists a domain twice: {list(domains)}")
        return list(domains)

    def setup(self, stage: str | None = None) -> None:
        """Generate every task's splits for ``stage`` and mix the training domains."""
        for task in self.tasks.values():
            task.setup(stage)
        for split in ("train", "val"):
            if all(split in self.tasks[d].datasets for d in self.train_domains):
                self.datasets[split] = [
                    example for d in self.train_domains for example in self.tasks[d].datasets[split]
                ]

    def domain_dataloader(self, domain: str, split: str, shuffle: bool = False) -> DataLoader:
        """A loader of one split (``train``, ``val`` or ``test``) of one domain."""
        if domain not in self.tasks:
            raise InputError(f"unknown domain {domain!r}; known: {', '.join(self.tasks)}")
        if split not in ("train", "val", "test"):
            raise InputError(f"split must be 'train', 'val' or 'test', got {split!r}")
        task = self.tasks[domain]
        if split not in task.datasets:
            task.setup({"train": "fit", "val": "validate"}.get(split, "test"))
        return DataLoader(
            task.datasets[split],
            batch_size=self.batch_size if split == "train" else self.eval_batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
        )

    def test_dataloader(self) -> list[DataLoader]:
        return [self.domain_dataloader(domain, "test") for domain in self.eval_domains]

    def predict_dataloader(self) -> list[DataLoader]:
        return self.test_dataloader()
