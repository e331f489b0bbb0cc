"""A vectorised warehouse-consolidation simulator: pick K of a variable number of orders per epoch.

Each decision epoch an environment holds a backlog of open orders (the candidates). Every order has
a volume, a weight, a fill ratio (the share of it that is in stock and can ship now), a due-time
slack in epochs and a zone. The agent picks ``pick`` orders for the next wave; they ship and leave
the backlog. Then every slack drops by one, orders more than ``grace`` epochs late expire (the
customer is lost) and new orders arrive (Poisson, at a rate drawn per episode, so one episode
holds around 50 and another several hundred candidates).

The reward of a wave is ``shipped units - travel_cost * zones visited - expiry_cost * orders
expired``; the source and target objectives differ only in the two costs (the target makes travel
and lost orders three times dearer), so they share the dynamics but not the reward. The
backlog carries the consequences of a pick into later epochs.

Everything is batched over environments (padded to ``max_candidates`` slots with a validity mask)
and drawn from a seeded ``torch.Generator``: equal seeds give equal episodes.

Example:
    >>> import torch
    >>> sim = ConsolidationSimulator(min_candidates=20, max_candidates=64, horizon=3)
    >>> state = sim.reset(num_envs=2, seed=0)
    >>> while not state.done:
    ...     scores = heuristic_scores(state, "edd")
    ...     state, reward = sim.step(state, select_top_k(scores, state.mask, sim.pick))
    >>> tuple(reward.source.shape), state.epoch
    ((2,), 3)
"""

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from ada_modules.errors import InputError

__all__ = [
    "CANDIDATE_FEATURES",
    "HEURISTICS",
    "ConsolidationSimulator",
    "ConsolidationState",
    "Objective",
    "WaveReward",
    "action_summary",
    "candidate_features",
    "heuristic_scores",
    "select_top_k",
    "state_summary",
]

NUM_ZONES = 4
# Per-candidate features: volume, weight, fill, slack (all scaled to about [0, 1]), an
# about-to-expire flag and the zone one-hot.
CANDIDATE_FEATURES = 5 + NUM_ZONES
HEURISTICS = ("edd", "volume", "zone", "random", "greedy_source", "greedy_target")


@dataclass(frozen=True)
class Objective:
    """The costs of one reward: ``units - travel_cost * zones - expiry_cost * expired``."""

    travel_cost: float
    expiry_cost: float


SOURCE = Objective(travel_cost=2.0, expiry_cost=4.0)
TARGET = Objective(travel_cost=6.0, expiry_cost=12.0)


@dataclass(frozen=True)
class ConsolidationState:
    """The backlogs of a batch of environments, padded to ``max_candidates`` slots.

    Attributes:
        volume: Order volumes ``[B, S]`` (units, 1-10).
        weight: Order weights ``[B, S]`` (kg, correlated with volume).
        fill: Share of each order in stock ``[B, S]`` (0.3-1); ``volume * fill`` units ship.
        slack: Epochs until the due time ``[B, S]``; below ``-grace`` the order expires.
        zone: Warehouse zone ``[B, S]`` (long, 0-3).
        mask: Which slots hold an open order ``[B, S]`` (bool).
        arrival_rate: Mean arrivals per epoch of each environment ``[B]``.
        epoch: Epochs played so far (the same for the whole batch).
        horizon: Epochs per episode.
        grace: Epochs an order may be late before it expires.
        pick: Orders shipped per wave.
    """

    volume: Tensor
    weight: Tensor
    fill: Tensor
    slack: Tensor
    zone: Tensor
    mask: Tensor
    arrival_rate: Tensor
    epoch: int
    horizon: int
    grace: int
    pick: int

    @property
    def done(self) -> bool:
        """Whether the episode is over."""
        return self.epoch >= self.horizon

    @property
    def num_candidates(self) -> Tensor:
        """Open orders per environment ``[B]``."""
        return self.mask.sum(dim=1)


@dataclass(frozen=True)
class WaveReward:
    """The reward of one wave under both objectives, and its parts (all ``[B]``)."""

    source: Tensor
    target: Tensor
    units: Tensor
    zones: Tensor
    expired: Tensor


def _reward(units: Tensor, zones: Tensor, expired: Tensor, objective: Objective) -> Tensor:
    return units - objective.travel_cost * zones - objective.expiry_cost * expired


class ConsolidationSimulator:
    """Batched warehouse-consolidation episodes (see the module docstring).

    Args:
        min_candidates: Fewest open orders at a decision epoch (arrivals top the backlog up).
        max_candidates: Most open orders (slots); arrivals beyond it are turned away.
        pick: Orders shipped per wave (K).
        horizon: Decision epochs per episode.
        grace: Epochs an order may be late before it expires.
        max_slack: Due-time slack of a new order is drawn from ``0..max_slack``.

    Raises:
        InputError: If an argument is out of range, naming it.
    """

    def __init__(
        self,
        min_candidates: int = 50,
        max_candidates: int = 200,
        pick: int = 8,
        horizon: int = 20,
        grace: int = 2,
        max_slack: int = 12,
    ) -> None:
        for name, value, low in (
            ("min_candidates", min_candidates, 1),
            ("max_candidates", max_candidates, 1),
            ("pick", pick, 1),
            ("horizon", horizon, 1),
            ("grace", grace, 0),
            ("max_slack", max_slack, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        if max_candidates < min_candidates:
            raise InputError(
                f"max_candidates must be >= min_candidates ({min_candidates}), "
                f"got {max_candidates!r}"
            )
        if pick > min_candidates:
            raise InputError(
                f"pick must be <= min_candidates ({min_candidates}) so that every epoch has "
                f"enough candidates, got {pick!r}"
            )
        self.min_candidates = min_candidates
        self.max_candidates = max_candidates
        self.pick = pick
        self.horizon = horizon
        self.grace = grace
        self.max_slack = max_slack
        self._generator: torch.Generator | None = None

    def _orders(self, shape: tuple[int, ...]) -> dict[str, Tensor]:
        g = self._generator
        volume = torch.randint(1, 11, shape, generator=g).float()
        weight = volume * (0.5 + 1.5 * torch.rand(shape, generator=g, dtype=torch.float32))
        fill = 0.3 + 0.7 * torch.rand(shape, generator=g, dtype=torch.float32)
        slack = torch.randint(0, self.max_slack + 1, shape, generator=g)
        zone = torch.randint(0, NUM_ZONES, shape, generator=g)
        return {"volume": volume, "weight": weight, "fill": fill, "slack": slack, "zone": zone}

    def reset(self, num_envs: int, seed: int) -> ConsolidationState:
        """Start ``num_envs`` episodes drawn from ``seed``.

        The arrival rate of an episode is drawn so that its backlog settles anywhere between
        ``min_candidates`` and ``max_candidates``; the first backlog is drawn in that range too.
        """
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise InputError(f"num_envs must be an integer >= 1, got {num_envs!r}")
        self._generator = torch.Generator().manual_seed(int(seed))
        g = self._generator
        slots = self.max_candidates
        arrival_rate = self.pick * (
            0.9 + 0.7 * torch.rand(num_envs, generator=g, dtype=torch.float32)
        )
        first = torch.randint(self.min_candidates, slots + 1, (num_envs,), generator=g)
        orders = self._orders((num_envs, slots))
        # The first backlog mixes ages: some orders are already late.
        orders["slack"] = orders["slack"] - torch.randint(
            0, self.grace + 1, (num_envs, slots), generator=g
        )
        mask = torch.arange(slots).expand(num_envs, slots) < first[:, None]
        return ConsolidationState(
            **orders,
            mask=mask,
            arrival_rate=arrival_rate,
            epoch=0,
            horizon=self.horizon,
            grace=self.grace,
            pick=self.pick,
        )

    def step(
        self, state: ConsolidationState, chosen: Tensor
    ) -> tuple[ConsolidationState, WaveReward]:
        """Ship the orders ``chosen`` (``[B, pick]`` slot indices), age the backlog, add arrivals.

        Raises:
            InputError: If ``chosen`` has the wrong shape, repeats a slot or picks an empty one.
            RuntimeError: If the episode is over or the state was not made by this simulator.
        """
        if state.done:
            raise RuntimeError("the episode is over; call reset() for new episodes")
        if self._generator is None:
            raise RuntimeError("call reset() before step()")
        num_envs, slots = state.mask.shape
        if chosen.shape != (num_envs, self.pick) or chosen.dtype != torch.long:
            raise InputError(
                f"chosen must be a long tensor of shape ({num_envs}, {self.pick}), "
                f"got {tuple(chosen.shape)} {chosen.dtype}"
            )
        if chosen.min() < 0 or chosen.max() >= slots:
            raise InputError(f"chosen holds a slot outside 0..{slots - 1}")
        picked = torch.zeros_like(state.mask).scatter_(1, chosen, True)
        if (picked.sum(1) != self.pick).any():
            raise InputError("chosen picks the same slot twice in one environment")
        if (picked & ~state.mask).any():
            raise InputError("chosen picks a slot that holds no open order")
        units = (state.volume * state.fill * picked).sum(1)
        zone_hit = torch.zeros(num_envs, NUM_ZONES, dtype=torch.float32).scatter_add_(
            1, state.zone, picked.float()
        )
        zones = (zone_hit > 0).sum(1).float()
        mask = state.mask & ~picked
        slack = state.slack - 1
        expiring = mask & (slack < -state.grace)
        expired = expiring.sum(1).float()
        mask = mask & ~expiring
        # Arrivals fill the free slots, at least enough to keep min_candidates open.
        g = self._generator
        arrivals = torch.poisson(state.arrival_rate, generator=g).long()
        arrivals = torch.maximum(arrivals, self.min_candidates - mask.sum(1))
        free_rank = torch.cumsum(~mask, dim=1) - 1
        new = ~mask & (free_rank < arrivals[:, None])
        orders = self._orders((num_envs, slots))
        fields = {"volume": state.volume, "weight": state.weight, "fill": state.fill}
        fields |= {"slack": slack, "zone": state.zone}
        merged = {name: torch.where(new, orders[name], value) for name, value in fields.items()}
        next_state = replace(state, **merged, mask=mask | new, epoch=state.epoch + 1)
        reward = WaveReward(
            source=_reward(units, zones, expired, SOURCE),
            target=_reward(units, zones, expired, TARGET),
            units=units,
            zones=zones,
            expired=expired,
        )
        return next_state, reward


def candidate_features(state: ConsolidationState) -> Tensor:
    """Per-candidate features ``[B, S, CANDIDATE_FEATURES]`` (zeros in empty slots).

    Columns: volume / 10, weight / 20, fill, slack / 10, about to expire (slack <= -grace: it
    expires unless it ships now), then the zone one-hot.
    """
    about_to_expire = (state.slack <= -state.grace).float()
    zone = torch.nn.functional.one_hot(state.zone, NUM_ZONES).float()
    columns = [state.volume / 10, state.weight / 20, state.fill, state.slack / 10, about_to_expire]
    features = torch.cat([torch.stack(columns, dim=-1), zone], dim=-1)
    return features * state.mask[..., None]


# Column indices of candidate_features used by the aggregates and heuristics.
_VOLUME, _WEIGHT, _FILL, _SLACK, _EXPIRING, _ZONE = 0, 1, 2, 3, 4, 5


def _masked_quantiles(values: Tensor, mask: Tensor, quantiles: tuple[float, ...]) -> Tensor:
    count = mask.sum(1).clamp(min=1)
    ordered = values.masked_fill(~mask, math.inf).sort(dim=1).values
    index = torch.stack([((count - 1) * q).round().long() for q in quantiles], dim=1)
    return ordered.gather(1, index)


STATE_FEATURES = 2 + 3 * 5 + 2 + NUM_ZONES + 1


def state_summary(features: Tensor, mask: Tensor, epoch_fraction: Tensor) -> Tensor:
    """Aggregate statistics of a candidate pool: the AIQL critic's state input ``[B, D_s]``.

    Log count and count / 1000; mean, std and 10/50/90 % quantiles of units (volume x fill),
    slack and weight; the share and the number / 10 of orders about to expire; the zone shares; the episode's
    progress. O(N) pooling; its width does not depend on N.

    Args:
        features: ``candidate_features`` ``[B, N, F]``.
        mask: Valid candidates ``[B, N]``.
        epoch_fraction: ``epoch / horizon`` per row ``[B]``.
    """
    count = mask.sum(1).float().clamp(min=1)
    rows = [torch.log(count) / 7, count / 1000]
    units = features[..., _VOLUME] * features[..., _FILL]
    for values in (units, features[..., _SLACK], features[..., _WEIGHT]):
        mean = (values * mask).sum(1) / count
        std = ((values - mean[:, None]).square() * mask).sum(1).div(count).sqrt()
        rows += [mean, std, *_masked_quantiles(values, mask, (0.1, 0.5, 0.9)).unbind(1)]
    expiring = (features[..., _EXPIRING] * mask).sum(1)
    rows += [expiring / count, expiring / 10]
    rows += list(((features[..., _ZONE:] * mask[..., None]).sum(1) / count[:, None]).unbind(1))
    rows.append(epoch_fraction.float())
    return torch.stack(rows, dim=1)


ACTION_FEATURES = 6 + NUM_ZONES


def action_summary(features: Tensor, chosen: Tensor) -> Tensor:
    """Aggregate statistics of a chosen subset: the AIQL critic's action input ``[B, D_a]``.

    Sum of units / 10, mean weight, mean and min slack, orders about to expire picked, zones
    visited, and the zone histogram of the picks.

    Args:
        features: ``candidate_features`` ``[B, N, F]``.
        chosen: Indices of the picks ``[B, K]`` (or ``[B, M, K]`` for M subsets per row).
    """
    squeeze = chosen.dim() == 2
    if squeeze:
        chosen = chosen[:, None]
    batch, subsets, pick = chosen.shape
    picks = features.gather(1, chosen.reshape(batch, -1, 1).expand(-1, -1, features.shape[-1]))
    picks = picks.reshape(batch, subsets, pick, -1)
    units = (picks[..., _VOLUME] * picks[..., _FILL]).sum(-1)
    zone_hist = picks[..., _ZONE:].sum(2)
    summary = torch.cat(
        [
            torch.stack(
                [
                    units,
                    picks[..., _WEIGHT].sum(-1) / pick,
                    picks[..., _SLACK].mean(-1),
                    picks[..., _SLACK].amin(-1),
                    picks[..., _EXPIRING].sum(-1),
                    (zone_hist > 0).sum(-1).float(),
                ],
                dim=-1,
            ),
            zone_hist / pick,
        ],
        dim=-1,
    )
    return summary[:, 0] if squeeze else summary


def select_top_k(scores: Tensor, mask: Tensor, k: int) -> Tensor:
    """Indices ``[B, k]`` of the ``k`` best-scored valid candidates, best first.

    Raises:
        InputError: If a row has fewer than ``k`` valid candidates, naming ``k`` and the count.
    """
    fewest = int(mask.sum(1).min())
    if k > fewest:
        raise InputError(f"k={k} is larger than the number of candidates ({fewest}) in a row")
    return scores.masked_fill(~mask, -math.inf).topk(k, dim=1).indices


def heuristic_scores(
    state: ConsolidationState,
    heuristic: Literal["edd", "volume", "zone", "random", "greedy_source", "greedy_target"],
    generator: torch.Generator | None = None,
) -> Tensor:
    """Scores ``[B, S]`` of a hand-written policy (pick the top ``pick`` of them).

    ``edd``: earliest due date first. ``volume``: most shippable units first. ``zone``: units, but
    only in the zone holding the most units. ``random``: uniform. ``greedy_<objective>``: the
    orders' worth under that objective (units plus the expiry cost saved), restricted to the m
    zones whose best orders are worth most, m (1-4) chosen by the wave's reward net of travel; it
    knows the reward, so it is a reference, not a baseline.
    """
    features = candidate_features(state)
    units = features[..., _VOLUME] * features[..., _FILL] * 10
    if heuristic == "edd":
        return -state.slack.float() + 0.01 * units
    if heuristic == "volume":
        return units
    if heuristic == "random":
        return torch.rand(state.mask.shape, generator=generator, dtype=torch.float32)
    if heuristic == "zone":
        zone_units = (features[..., _ZONE:] * units[..., None]).sum(1)
        best = zone_units.argmax(1, keepdim=True)
        return units + 100.0 * (state.zone == best)
    if heuristic in ("greedy_source", "greedy_target"):
        objective = SOURCE if heuristic == "greedy_source" else TARGET
        return _greedy_scores(
            state, units + objective.expiry_cost * features[..., _EXPIRING], objective
        )
    raise InputError(f"heuristic must be one of {', '.join(HEURISTICS)}, got {heuristic!r}")


def _greedy_scores(state: ConsolidationState, worth: Tensor, objective: Objective) -> Tensor:
    """Scores whose top ``pick`` is the best wave restricted to the m most worthy zones (m = 1-4),
    zones ranked by the worth of their own best ``pick`` orders, m chosen by the wave's reward."""
    pick = state.pick
    worth = worth.masked_fill(~state.mask, -math.inf)
    in_zone = torch.stack(
        [worth.masked_fill(state.zone != z, -math.inf) for z in range(NUM_ZONES)], 1
    )
    zone_best = in_zone.topk(pick, dim=-1).values.clamp(min=0).sum(-1)
    ranked = zone_best.argsort(dim=1, descending=True)
    best_value = torch.full(worth.shape[:1], -math.inf, dtype=torch.float32)
    best_scores = worth.clone()
    for m in range(1, NUM_ZONES + 1):
        allowed = (state.zone[..., None] == ranked[:, None, :m]).any(-1) & state.mask
        if (allowed.sum(1) < pick).any():
            continue
        scores = worth + 1000.0 * allowed
        top = scores.topk(pick, dim=1).indices
        hit = torch.zeros(worth.shape[0], NUM_ZONES, dtype=torch.float32).scatter_(
            1, state.zone.gather(1, top), 1.0
        )
        value = worth.gather(1, top).sum(1) - objective.travel_cost * hit.sum(1)
        better = value > best_value
        best_value = torch.where(better, value, best_value)
        best_scores = torch.where(better[:, None], scores, best_scores)
    return best_scores
