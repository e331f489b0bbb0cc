"""Federated-learning simulation: clients, aggregators and attacks (ASAP).

- :mod:`~ada_modules.fl.aggregators`: robust aggregation rules, each a pure function
  ``(updates[n, d], f) -> Aggregation(update, kept)``, and :func:`aggregate`, which drops
  non-finite updates first.
- :mod:`~ada_modules.fl.attack`: what an attack sees (:class:`AttackContext`) and its interface
  (:class:`Attack`); :mod:`~ada_modules.fl.baseline_attacks`: LIE, IPM, Min-Max, Min-Sum, Fang;
  :class:`ASAP`: poisoning as adaptive sliding-mode control
  (:class:`~ada_modules.fl.sliding_mode.SlidingModeController`).
- :mod:`~ada_modules.fl.partition` and :mod:`~ada_modules.fl.clients`: data partitions and
  vectorised client updates; :mod:`~ada_modules.fl.round_metrics`: attack round complexity.

The LightningModule that runs a simulation is :class:`ada_modules.models.FederatedSimulationModule`
with :class:`ada_modules.data.FederatedDataModule`.
"""

from ada_modules.fl.aggregators import AGGREGATORS, aggregate, max_tolerated
from ada_modules.fl.asap import ASAP
from ada_modules.fl.attack import Aggregation, Attack, AttackContext
from ada_modules.fl.baseline_attacks import (
    ATTACKS,
    IPM,
    LIE,
    FangKrum,
    FangTrimmedMean,
    MinMax,
    MinSum,
    NoAttack,
)
from ada_modules.fl.round_metrics import deviation_after, rounds_to_reach_and_stay
from ada_modules.fl.sliding_mode import SlidingModeController

__all__ = [
    "AGGREGATORS",
    "ASAP",
    "ATTACKS",
    "IPM",
    "LIE",
    "Aggregation",
    "Attack",
    "AttackContext",
    "FangKrum",
    "FangTrimmedMean",
    "MinMax",
    "MinSum",
    "NoAttack",
    "SlidingModeController",
    "aggregate",
    "deviation_after",
    "max_tolerated",
    "rounds_to_reach_and_stay",
]
