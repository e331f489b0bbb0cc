"""What a model-poisoning attack sees in a round, and the interface every attack implements.

Conventions of the simulator: an *update* is the change a client proposes to the flattened global
parameters (FedSGD: ``-client_lr * gradient``; FedAvg: local weights minus global weights). The
server applies ``theta <- theta + server_lr * aggregate(updates)``. The attackers are omniscient
(the common threat model of LIE, Min-Max and Fang): they see the benign clients' updates of the
round before crafting theirs.

Examples:
    >>> import torch
    >>> class Flip(Attack):
    ...     def craft(self, benign, context):
    ...         return -benign.mean(0).expand(context.num_malicious, -1)
    >>> context = AttackContext(num_clients=5, num_malicious=2, round=0)
    >>> Flip().craft(torch.ones(3, 4), context).shape
    torch.Size([2, 4])
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

__all__ = ["Aggregation", "Attack", "AttackContext"]


class Aggregation(NamedTuple):
    """What an aggregation rule returns.

    Attributes:
        update: The aggregated update, shape ``(d,)``.
        kept: Per client, the share of its update that entered ``update``, shape ``(n,)``, in
            ``[0, 1]``: 1 for every client under the mean, the selection under Krum, the share of
            coordinates not trimmed under a trimmed mean (the metric "how often were the malicious
            updates kept").
    """

    update: Tensor
    kept: Tensor


@dataclass
class AttackContext:
    """What the attackers know in one round (besides the benign updates).

    Attributes:
        num_clients: ``n``, all clients of the round (benign and malicious).
        num_malicious: ``f``, how many updates the attack must craft.
        round: The round index, from 0.
        aggregator: The server's rule as ``aggregator(updates[n, d]) -> Aggregation`` (``f`` and
            any rule argument already bound), for attacks that simulate it (Fang); aggregation-
            agnostic attacks ignore it. ``None`` when unknown.
        own_updates: The honest updates the malicious clients would have sent, ``(f, d)``, or
            ``None``.
        global_params: The flattened global parameters before this round, or ``None``.
        metric: The attacker's measurement of the global model before this round (for example its
            accuracy on the attackers' own data), or ``None``.
        target: The value of ``metric`` the attackers want to reach and hold (the degradation
            objective of targeted attacks such as ASAP), or ``None``.
        server_lr: The server's step on the aggregate.
    """

    num_clients: int
    num_malicious: int
    round: int
    aggregator: Callable[[Tensor], Aggregation] | None = None
    own_updates: Tensor | None = None
    global_params: Tensor | None = None
    metric: float | None = None
    target: float | None = None
    server_lr: float = 1.0


class Attack:
    """A model-poisoning attack: crafts the malicious updates of a round.

    Stateful attacks (feedback controllers) keep their state between calls of :meth:`craft`;
    :meth:`reset` starts a new simulation.
    """

    def craft(self, benign: Tensor, context: AttackContext) -> Tensor:
        """The ``(context.num_malicious, d)`` malicious updates given the ``(n - f, d)`` benign."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the state of a previous simulation (stateless attacks have none)."""
