"""Logged consolidation datasets (offline RL) and their DataModule.

Behaviour policies are noisy hand-written heuristics (``edd``, ``volume``, ``zone``, ``random``,
one per episode): each epoch they sample ``pick`` orders from a Plackett-Luce distribution over
their own ranking, ``logits = -rank / temperature``. A log keeps, per decision epoch, the candidate
features, the picks in order, the aggregate state and action statistics the AIQL critic reads, the
reward under the log's objective (with optional noise: the logged reward only approximates the
objective) and the next state's statistics.

Example:
    >>> from ada_modules.data.consolidation import ConsolidationSimulator
    >>> sim = ConsolidationSimulator(min_candidates=20, max_candidates=40, horizon=4)
    >>> logs = collect_logs(sim, episodes=3, seed=0, objective="target")
    >>> len(logs), logs.candidates.shape[-1], logs.objective
    (12, 9, 'target')
"""

import math
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from ada_modules.data.consolidation import (
    ACTION_FEATURES,
    CANDIDATE_FEATURES,
    STATE_FEATURES,
    ConsolidationSimulator,
    action_summary,
    candidate_features,
    heuristic_scores,
    state_summary,
)
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError
from ada_modules.offline_rl.losses import sample_plackett_luce

__all__ = [
    "BEHAVIOUR_HEURISTICS",
    "ConsolidationLogs",
    "ConsolidationLogsDataModule",
    "EpisodeSeeds",
    "collect_logs",
]

BEHAVIOUR_HEURISTICS = ("edd", "volume", "zone", "random")


@dataclass
class ConsolidationLogs(Dataset):
    """Logged decision epochs, one row each (candidates padded to the log's largest pool).

    Attributes:
        candidates: ``candidate_features`` of the pool ``[M, N, F]``.
        mask: Valid candidates ``[M, N]``.
        chosen: Picks in pick order ``[M, K]`` (indices into ``candidates``).
        state: ``state_summary`` ``[M, D_s]``.
        action: ``action_summary`` of the picks ``[M, D_a]``.
        reward: Logged reward ``[M]``.
        next_state: ``state_summary`` after the wave ``[M, D_s]``.
        done: Whether the wave ended its episode ``[M]`` (float).
        objective: The objective the rewards were logged under (``"source"`` or ``"target"``).
        domain: 0 for source logs, 1 for target logs ``[M]`` (long).
    """

    candidates: Tensor
    mask: Tensor
    chosen: Tensor
    state: Tensor
    action: Tensor
    reward: Tensor
    next_state: Tensor
    done: Tensor
    objective: str
    domain: Tensor

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check shapes, the feature schema, finiteness and the picks; raise naming the field.

        Raises:
            InputError: If a field is malformed (the whole log is rejected, nothing is used).
        """
        rows = self.candidates.shape[0]
        expected_width = {
            "candidates": CANDIDATE_FEATURES,
            "state": STATE_FEATURES,
            "action": ACTION_FEATURES,
            "next_state": STATE_FEATURES,
        }
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name == "objective":
                if value not in ("source", "target"):
                    raise InputError(f"objective must be 'source' or 'target', got {value!r}")
                continue
            if value.shape[0] != rows:
                raise InputError(
                    f"{field.name} has {value.shape[0]} rows but candidates has {rows}"
                )
            if field.name in expected_width and value.shape[-1] != expected_width[field.name]:
                raise InputError(
                    f"{field.name} has {value.shape[-1]} features per row, the consolidation "
                    f"schema has {expected_width[field.name]}"
                )
            if value.is_floating_point() and not torch.isfinite(value).all():
                bad = int((~torch.isfinite(value)).reshape(rows, -1).any(1).nonzero()[0, 0])
                raise InputError(f"{field.name} holds NaN or inf (first at row {bad})")
        valid = self.mask.sum(1)
        if (self.chosen.shape[1] > valid).any():
            bad = int((self.chosen.shape[1] > valid).nonzero()[0, 0])
            raise InputError(
                f"chosen picks K={self.chosen.shape[1]} orders but row {bad} has only "
                f"{int(valid[bad])} candidates"
            )
        if (self.chosen < 0).any() or (self.chosen >= self.mask.shape[1]).any():
            raise InputError("chosen holds an index outside the candidate pool")
        if not self.mask.gather(1, self.chosen).all():
            raise InputError("chosen points at a padded (invalid) candidate")

    def __len__(self) -> int:
        return self.candidates.shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {
            field.name: getattr(self, field.name)[index]
            for field in fields(self)
            if field.name != "objective"
        }


def _positions(order: Tensor) -> Tensor:
    """The inverse permutation of each row of ``order``: where each index landed."""
    return torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))


def _behaviour_picks(
    scores: Tensor, mask: Tensor, pick: int, temperature: float, generator: torch.Generator
) -> Tensor:
    """Plackett-Luce sample of ``pick`` candidates with ``logits = -rank / temperature``."""
    rank = _positions(scores.masked_fill(~mask, -math.inf).argsort(dim=1, descending=True))
    return sample_plackett_luce(-rank.float() / temperature, mask, pick, generator)


def collect_logs(
    simulator: ConsolidationSimulator,
    episodes: int,
    seed: int,
    objective: Literal["source", "target"] = "source",
    behaviour: tuple[str, ...] = BEHAVIOUR_HEURISTICS,
    temperature: float = 5.0,
    reward_noise: float = 0.0,
) -> ConsolidationLogs:
    """Run noisy behaviour heuristics for ``episodes`` episodes and log every decision epoch.

    Args:
        simulator: The environment.
        episodes: Episodes to log (each gives ``simulator.horizon`` rows).
        seed: Seed of the episodes, the behaviour draws and the reward noise.
        objective: Which reward the log records.
        behaviour: Heuristics the episodes are spread over (episode ``e`` uses
            ``behaviour[e % len(behaviour)]``).
        temperature: Plackett-Luce temperature in rank units (higher: noisier behaviour).
        reward_noise: Standard deviation of Gaussian noise added to the logged reward.

    Returns:
        The log, validated.
    """
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise InputError(f"episodes must be an integer >= 1, got {episodes!r}")
    if objective not in ("source", "target"):
        raise InputError(f"objective must be 'source' or 'target', got {objective!r}")
    unknown = [name for name in behaviour if name not in BEHAVIOUR_HEURISTICS]
    if not behaviour or unknown:
        raise InputError(
            f"behaviour must name heuristics among {', '.join(BEHAVIOUR_HEURISTICS)}, "
            f"got {behaviour!r}"
        )
    if not temperature > 0:
        raise InputError(f"temperature must be > 0, got {temperature!r}")
    if not reward_noise >= 0:
        raise InputError(f"reward_noise must be >= 0, got {reward_noise!r}")
    generator = torch.Generator().manual_seed(int(seed) + 7919)
    state = simulator.reset(episodes, seed=seed)
    which = torch.arange(episodes) % len(behaviour)
    rows: dict[str, list[Tensor]] = {name: [] for name in ("cand", "mask", "chosen", "s", "a")}
    rows |= {"r": [], "s2": [], "done": []}
    features = candidate_features(state)
    summary = state_summary(features, state.mask, torch.zeros(episodes))
    while not state.done:
        scores = torch.zeros(state.mask.shape)
        for index, name in enumerate(behaviour):
            scores = torch.where(
                (which == index)[:, None], heuristic_scores(state, name, generator), scores
            )
        chosen = _behaviour_picks(scores, state.mask, simulator.pick, temperature, generator)
        next_state, reward = simulator.step(state, chosen)
        # Pack the valid candidates to the front so that logs pad to their largest pool only.
        order = (~state.mask).float().argsort(dim=1, stable=True)
        position = _positions(order)
        next_features = candidate_features(next_state)
        next_summary = state_summary(
            next_features,
            next_state.mask,
            torch.full((episodes,), next_state.epoch / state.horizon),
        )
        rows["cand"].append(features.gather(1, order[..., None].expand_as(features)))
        rows["mask"].append(state.mask.gather(1, order))
        rows["chosen"].append(position.gather(1, chosen))
        rows["s"].append(summary)
        rows["a"].append(action_summary(features, chosen))
        logged = getattr(reward, objective)
        rows["r"].append(logged + reward_noise * torch.randn(episodes, generator=generator))
        rows["s2"].append(next_summary)
        rows["done"].append(torch.full((episodes,), float(next_state.done)))
        state, features, summary = next_state, next_features, next_summary
    width = max(int(mask.sum(1).max()) for mask in rows["mask"])
    return ConsolidationLogs(
        candidates=torch.cat([c[:, :width] for c in rows["cand"]]),
        mask=torch.cat([m[:, :width] for m in rows["mask"]]),
        chosen=torch.cat(rows["chosen"]),
        state=torch.cat(rows["s"]),
        action=torch.cat(rows["a"]),
        reward=torch.cat(rows["r"]),
        next_state=torch.cat(rows["s2"]),
        done=torch.cat(rows["done"]),
        objective=objective,
        domain=torch.full((episodes * simulator.horizon,), int(objective == "target")),
    )


def _pad_collate(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack rows, padding candidate pools of different logs to the widest in the batch."""
    width = max(item["mask"].shape[0] for item in items)
    batch = {}
    for name in items[0]:
        values = [item[name] for item in items]
        if name in ("candidates", "mask"):
            values = [
                torch.nn.functional.pad(v, (0, 0, 0, width - v.shape[0]))
                if v.dim() == 2
                else torch.nn.functional.pad(v, (0, width - v.shape[0]))
                for v in values
            ]
        batch[name] = torch.stack(values)
    return batch


class EpisodeSeeds(Dataset):
    """Seeds of evaluation rollouts: ``episodes`` fresh episodes in batches of ``envs`` (the last
    batch holds the rest); item ``i`` is ``{"seed": base_seed + i, "envs": its episodes}``.

    Examples:
        >>> [item["envs"] for item in EpisodeSeeds(0, episodes=10, envs=4)]
        [4, 4, 2]
    """

    def __init__(self, base_seed: int, episodes: int, envs: int) -> None:
        self.base_seed, self.episodes, self.envs = base_seed, episodes, envs

    def __len__(self) -> int:
        return math.ceil(self.episodes / self.envs)

    def __getitem__(self, index: int) -> dict[str, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} batches")
        return {
            "seed": self.base_seed + index,
            "envs": min(self.envs, self.episodes - index * self.envs),
        }


class ConsolidationLogsDataModule(SplitDataModule):
    """Offline consolidation logs for training; fresh simulated episodes for evaluation.

    ``setup`` logs ``source_episodes`` episodes under the source objective and
    ``target_episodes`` under the target objective (different seeds; the same dynamics). The
    training split is the source log, the target log, or both (``train_on``); the target log is
    always available as ``target_logs`` (A²IQL fits its reward predictor on it). Validation and
    test batches are seeds of fresh episodes the LightningModule rolls out in ``simulator``.

    Args:
        min_candidates: ``ConsolidationSimulator`` argument.
        max_candidates: ``ConsolidationSimulator`` argument.
        pick: Orders per wave (K).
        horizon: Epochs per episode.
        source_episodes: Episodes in the source log.
        target_episodes: Episodes in the target log (0: none).
        train_on: Which log(s) the training split holds.
        behaviour_temperature: Behaviour noise (``collect_logs``'s ``temperature``).
        reward_noise: Noise on the logged rewards.
        val_episodes: Fresh episodes per validation.
        test_episodes: Fresh episodes for testing (in batches of ``val_episodes``, the last
            one holding the rest).
        seed: Seed of the logs and the evaluation episodes (``None``: ``seed_everything``'s).
        batch_size: Training batch size (rows).
        num_workers: Loader workers.

    Example:
        >>> dm = ConsolidationLogsDataModule(
        ...     min_candidates=20, max_candidates=40, horizon=4, source_episodes=6,
        ...     target_episodes=2, train_on="pooled", seed=0)
        >>> dm.setup("fit")
        >>> len(dm.datasets["train"]), len(dm.target_logs)
        (32, 8)
    """

    def __init__(
        self,
        min_candidates: int = 50,
        max_candidates: int = 200,
        pick: int = 8,
        horizon: int = 20,
        source_episodes: int = 300,
        target_episodes: int = 10,
        train_on: Literal["source", "target", "pooled"] = "source",
        behaviour_temperature: float = 5.0,
        reward_noise: float = 2.0,
        val_episodes: int = 50,
        test_episodes: int = 200,
        seed: int | None = None,
        batch_size: int = 128,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seed=seed, batch_size=batch_size, eval_batch_size=1)
        self.simulator = ConsolidationSimulator(
            min_candidates=min_candidates, max_candidates=max_candidates, pick=pick, horizon=horizon
        )
        for name, value, low in (
            ("source_episodes", source_episodes, 1),
            ("target_episodes", target_episodes, 0),
            ("val_episodes", val_episodes, 1),
            ("test_episodes", test_episodes, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        if train_on not in ("source", "target", "pooled"):
            raise InputError(f"train_on must be 'source', 'target' or 'pooled', got {train_on!r}")
        if train_on != "source" and target_episodes == 0:
            raise InputError(f"train_on={train_on!r} needs target_episodes >= 1, got 0")
        self.save_hyperparameters()
        self.num_workers = num_workers
        self.collate_fn = _pad_collate
        self.target_logs: ConsolidationLogs | None = None

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        if "train" not in self.datasets:
            source = collect_logs(
                self.simulator,
                hp.source_episodes,
                seed=self.seed * 1000 + 1,
                objective="source",
                temperature=hp.behaviour_temperature,
                reward_noise=hp.reward_noise,
            )
            if hp.target_episodes:
                self.target_logs = collect_logs(
                    self.simulator,
                    hp.target_episodes,
                    seed=self.seed * 1000 + 2,
                    objective="target",
                    temperature=hp.behaviour_temperature,
                    reward_noise=hp.reward_noise,
                )
            self.source_logs = source
            self.datasets["train"] = {
                "source": source,
                "target": self.target_logs,
                "pooled": ConcatDataset([source, self.target_logs])
                if self.target_logs is not None
                else None,
            }[hp.train_on]
        self.datasets["val"] = EpisodeSeeds(
            self.seed * 1000 + 500, hp.val_episodes, hp.val_episodes
        )
        self.datasets["test"] = EpisodeSeeds(
            self.seed * 1000 + 600, hp.test_episodes, hp.val_episodes
        )

    def _episodes(self, split: str) -> DataLoader:
        if split not in self.datasets:
            raise RuntimeError(f"the {split} split is not set up; call setup() first")
        return DataLoader(self.datasets[split], batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return self._episodes("val")

    def test_dataloader(self) -> DataLoader:
        return self._episodes("test")

    def predict_dataloader(self) -> DataLoader:
        return self._episodes("test")
