"""A federated-learning simulation as a LightningModule: one training step is one round."""

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils import vector_to_parameters
from torch.optim import Optimizer

from ada_modules.data.federated import FederatedDataModule
from ada_modules.errors import InputError
from ada_modules.fl.aggregators import AGGREGATORS, aggregate, max_tolerated
from ada_modules.fl.attack import Attack, AttackContext
from ada_modules.fl.clients import ALGORITHMS, client_updates, flatten_params, unflatten_params
from ada_modules.fl.round_metrics import deviation_after, rounds_to_reach_and_stay

__all__ = ["FederatedSimulationModule"]


class FederatedSimulationModule(LightningModule):
    """Federated training of a model under a robust aggregation rule and a poisoning attack.

    Needs a :class:`~ada_modules.data.FederatedDataModule` (one item per round). Each training
    step is a round: every client computes its update at the global parameters (vectorised,
    :func:`~ada_modules.fl.clients.client_updates`); from round ``attack_start`` on, the last
    ``num_malicious`` clients replace theirs by the ``attack``'s; the server aggregates with
    ``aggregator`` and adds ``server_lr`` times the result, or, with ``server_optimizer``
    (FedOpt: FedAdam with ``torch.optim.Adam``, or any optimizer of :mod:`ada_modules.optim`),
    steps that optimizer with the negated aggregate as gradient. Before each round the server measures
    its accuracy on the validation split (the curve of the round-complexity metrics), and the
    attackers measure theirs on their auxiliary set (``FederatedDataModule.auxiliary``: what a
    feedback attack such as :class:`~ada_modules.fl.ASAP` steers).

    The objective is ``target = target_fraction * clean``, ``clean`` being the accuracy at
    ``attack_start`` (the attackers use their own measurement of it). Logged at the end
    (``val/``): ``clean_accuracy``, ``target``, ``accuracy_final``, ``rounds_to_target`` (attacked
    rounds until the accuracy after a round is in the band ``target ± band`` for ``window``
    consecutive rounds, counting the first of them; a run that never is counts all its attacked
    rounds), ``reached`` (0/1),
    ``deviation_after_reach`` (mean ``|accuracy - target|`` from then on, only when reached),
    ``final_deviation`` (the same over the last ``tail_rounds`` rounds, always), and
    ``malicious_kept`` (mean share of the malicious updates that the rule kept).

    Args:
        in_features: Input size of the MLP (64 for 8x8 digits).
        num_classes: Classes.
        hidden_sizes: Hidden widths of the MLP (ReLU).
        model: Any classifier to train instead of the MLP (no buffers updated in the forward pass,
            e.g. GroupNorm rather than BatchNorm: clients are vectorised with ``torch.func``).
        aggregator: A rule of :data:`~ada_modules.fl.aggregators.AGGREGATORS`.
        aggregator_kwargs: Its extra arguments (e.g. ``{"tau": 1.0}``); FLTrust's root update and
            centered clipping's centre (the previous aggregate) are supplied here.
        attack: The attack, or ``None`` for clean training.
        num_malicious: ``f``, the last ``f`` clients.
        algorithm: ``"fedsgd"`` or ``"fedavg"`` (local steps come from the data).
        client_lr: Clients' SGD learning rate.
        server_lr: Step on the aggregate (without ``server_optimizer``).
        server_optimizer: ``params -> Optimizer`` stepped with ``-aggregate`` as the gradient of
            the global parameters (``None``: plain addition).
        attack_start: First attacked round (the model trains clean before).
        target_fraction: The objective as a share of the clean accuracy, in ``(0, 1)``.
        band: Half-width of the target band (``> 0``).
        window: Consecutive rounds in the band that count as reaching it.
        tail_rounds: Rounds of ``final_deviation``.

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> from ada_modules.data import DigitsDataModule
        >>> from ada_modules.fl import ASAP
        >>> data = FederatedDataModule(DigitsDataModule(seed=0), num_clients=10, rounds=30)
        >>> module = FederatedSimulationModule(
        ...     aggregator="median", attack=ASAP(), num_malicious=2, attack_start=10
        ... )
        >>> trainer = Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
        ...                   enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(module, data)
        >>> len(module.curve)
        30
    """

    def __init__(
        self,
        in_features: int = 64,
        num_classes: int = 10,
        hidden_sizes: Sequence[int] = (64,),
        model: nn.Module | None = None,
        aggregator: str = "mean",
        aggregator_kwargs: dict[str, Any] | None = None,
        attack: Attack | None = None,
        num_malicious: int = 4,
        algorithm: str = "fedsgd",
        client_lr: float = 0.5,
        server_lr: float = 1.0,
        server_optimizer: OptimizerCallable | None = None,
        attack_start: int = 20,
        target_fraction: float = 0.5,
        band: float = 0.05,
        window: int = 5,
        tail_rounds: int = 10,
    ) -> None:
        super().__init__()
        if aggregator not in AGGREGATORS:
            raise InputError(f"aggregator must be one of {sorted(AGGREGATORS)}, got {aggregator!r}")
        if algorithm not in ALGORITHMS:
            raise InputError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
        if attack is not None and not isinstance(attack, Attack):
            raise InputError(f"attack must be an ada_modules.fl Attack or None, got {attack!r}")
        for name, value, low in (
            ("num_malicious", num_malicious, 0),
            ("attack_start", attack_start, 0),
            ("window", window, 1),
            ("tail_rounds", tail_rounds, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(target_fraction, bool) or not 0.0 < target_fraction < 1.0:
            raise InputError(
                f"target_fraction must be in (0, 1) (the target accuracy as a share of the clean "
                f"accuracy), got {target_fraction!r}"
            )
        for name, value in (("band", band), ("client_lr", client_lr), ("server_lr", server_lr)):
            if not value > 0:
                raise InputError(f"{name} must be > 0, got {value!r}")
        if attack is not None and num_malicious == 0:
            raise InputError("an attack needs num_malicious >= 1 malicious clients, got 0")
        self.save_hyperparameters(ignore=["attack", "server_optimizer", "model"])
        self.aggregator = aggregator
        self.aggregator_kwargs = dict(aggregator_kwargs or {})
        self.attack = attack
        self.num_malicious = num_malicious
        self.algorithm = algorithm
        self.client_lr = client_lr
        self.server_lr = server_lr
        self.server_optimizer = server_optimizer
        self.attack_start = attack_start
        self.target_fraction = target_fraction
        self.band = band
        self.window = window
        self.tail_rounds = tail_rounds
        self.automatic_optimization = False
        if model is None:
            widths = [in_features, *hidden_sizes]
            layers: list[nn.Module] = []
            for width_in, width_out in zip(widths[:-1], widths[1:], strict=True):
                layers += [nn.Linear(width_in, width_out), nn.ReLU()]
            model = nn.Sequential(*layers, nn.Linear(widths[-1], num_classes))
        self.model = model
        self.curve: list[float] = []
        self.kept: list[float] = []
        self._clean: dict[str, float] = {}
        self._last_aggregate: Tensor | None = None
        self.diverged_at: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def configure_optimizers(self) -> Optimizer | None:
        """The ``server_optimizer`` over the global model, or ``None`` (the aggregate is added)."""
        if self.server_optimizer is None:
            return None
        return self.server_optimizer(self.model.parameters())

    def _data(self) -> FederatedDataModule:
        data = self.trainer.datamodule
        if not isinstance(data, FederatedDataModule):
            raise InputError(
                f"FederatedSimulationModule needs a FederatedDataModule, got {type(data).__name__}"
            )
        return data

    def prepare_data(self) -> None:
        """Checks the rule, the attack and the data against each other (before anything is
        written)."""
        n, f = self._data().num_clients, self.num_malicious
        if 2 * f >= n:
            raise InputError(f"num_malicious={f} of num_clients={n}: must be < n/2")
        bound = max_tolerated(self.aggregator, n)
        if f > bound:
            raise InputError(
                f"aggregator {self.aggregator!r} tolerates at most f={bound} of n={n} clients, "
                f"got num_malicious={f}"
            )
        if self.algorithm == "fedsgd" and self._data().local_steps != 1:
            raise InputError(
                f"fedsgd takes one gradient per round: the data's local_steps must be 1, got "
                f"{self._data().local_steps}"
            )
        if self.aggregator == "fltrust" and self._data().root_size == 0:
            raise InputError("fltrust needs the server's root set: set the data's root_size > 0")
        if self.attack is not None and self._data().auxiliary_size == 0:
            raise InputError(
                "the attackers measure the global model on their auxiliary set: set the data's "
                "auxiliary_size > 0"
            )
        probe = dict(self.aggregator_kwargs)
        if self.aggregator == "fltrust":
            probe["root_update"] = torch.ones(2)
        aggregate(self.aggregator, torch.zeros(n, 2), f, **probe)  # the rule's own arguments

    def on_fit_start(self) -> None:
        self.curve, self.kept, self._clean, self._last_aggregate = [], [], {}, None
        self.diverged_at = None
        if self.attack is not None:
            self.attack.reset()

    @torch.no_grad()
    def _accuracy(self, flat: Tensor, x: Tensor, y: Tensor) -> float:
        params = unflatten_params(self.model, flat)
        logits = functional_call(self.model, params, (x.to(flat.device),))
        return float((logits.argmax(-1) == y.to(flat.device)).float().mean())

    def _updates(self, flat: Tensor, x: Tensor, y: Tensor) -> Tensor:
        if self.algorithm == "fedsgd":
            x, y = x[:, 0], y[:, 0]
        return client_updates(
            self.model,
            flat,
            x,
            y,
            algorithm=self.algorithm,
            lr=self.client_lr,
            local_steps=x.shape[1] if self.algorithm == "fedavg" else 1,
        )

    def _rule_kwargs(self, flat: Tensor) -> dict[str, Any]:
        kwargs = dict(self.aggregator_kwargs)
        if self.aggregator == "fltrust":
            root_x, root_y = self._data().root
            steps = self._data().local_steps
            x = root_x.to(flat.device).expand(1, steps, *root_x.shape)
            y = root_y.to(flat.device).expand(1, steps, *root_y.shape)
            kwargs["root_update"] = self._updates(flat, x, y)[0]
        if self.aggregator == "centered_clipping" and self._last_aggregate is not None:
            kwargs.setdefault("center", self._last_aggregate)
        return kwargs

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        data = self._data()
        n, f = data.num_clients, self.num_malicious
        round_ = int(batch["round"])
        flat = flatten_params(self.model)
        accuracy = self.curve[-1] if self.curve else self._accuracy(flat, *data.eval_tensors("val"))
        updates = self._updates(flat, batch["x"], batch["y"])
        rule_kwargs = self._rule_kwargs(flat)
        attacked = self.attack is not None and round_ >= self.attack_start
        if round_ == self.attack_start:
            self._clean["server"] = accuracy
        logs = {}
        if attacked:
            measured = self._accuracy(flat, *data.auxiliary)
            self._clean.setdefault("attacker", measured)
            context = AttackContext(
                num_clients=n,
                num_malicious=f,
                round=round_,
                aggregator=lambda u: aggregate(self.aggregator, u, f, **rule_kwargs),
                own_updates=updates[n - f :],
                global_params=flat,
                metric=measured,
                target=self.target_fraction * self._clean["attacker"],
                server_lr=self.server_lr,
            )
            crafted = self.attack.craft(updates[: n - f], context)
            updates = torch.cat([updates[: n - f], crafted.to(updates)])
            logs["train/attacker_accuracy"] = measured
            if hasattr(self.attack, "last_input"):
                logs["train/attack_input"] = float(self.attack.last_input)
        if not torch.isfinite(updates).all(dim=1).any():
            # Every client's update overflowed: the global model has diverged (the attack's
            # denial of service). Nothing can be aggregated; the model stays where it is.
            if self.diverged_at is None:  # round 0 is a round
                rank_zero_warn(f"the global model diverged in round {round_}; it stays as is")
                self.diverged_at = round_
            self.curve.append(accuracy)
            self.log_dict({**logs, "train/accuracy": accuracy}, batch_size=1)
            return
        result = aggregate(self.aggregator, updates, f, **rule_kwargs)
        if attacked:
            kept = float(result.kept[n - f :].mean())
            self.kept.append(kept)
            logs["train/malicious_kept"] = kept
        self._last_aggregate = result.update
        update = result.update.to(flat)
        if self.server_optimizer is None:
            vector_to_parameters(flat + self.server_lr * update, self.model.parameters())
        else:
            optimizer = self.optimizers()
            gradients = unflatten_params(self.model, -update)
            for name, param in self.model.named_parameters():
                param.grad = gradients[name].clone()
            optimizer.step()
            optimizer.zero_grad()
        flat = flatten_params(self.model)
        self.curve.append(self._accuracy(flat, *data.eval_tensors("val")))
        logs["train/accuracy"] = self.curve[-1]
        self.log_dict(logs, batch_size=1)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        accuracy = (self(x).argmax(-1) == y).float().mean()
        self.log("val/accuracy", accuracy, batch_size=len(y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        accuracy = (self(x).argmax(-1) == y).float().mean()
        self.log("test/accuracy", accuracy, batch_size=len(y))

    def round_metrics(self) -> dict[str, float]:
        """The round-complexity metrics of the rounds played so far (see the class doc)."""
        if "server" not in self._clean:
            return {}
        clean = self._clean["server"]
        target = self.target_fraction * clean
        attacked = self.curve[self.attack_start :]  # the accuracy after each attacked round
        reached = rounds_to_reach_and_stay(attacked, target, self.band, window=self.window)
        metrics = {
            "clean_accuracy": clean,
            "target": target,
            "accuracy_final": attacked[-1],
            "rounds_to_target": float(len(attacked) if reached is None else reached + 1),
            "reached": float(reached is not None),
            "final_deviation": deviation_after(
                attacked, target, max(0, len(attacked) - self.tail_rounds)
            ),
        }
        if reached is not None:
            metrics["deviation_after_reach"] = deviation_after(attacked, target, reached)
        if self.kept:
            metrics["malicious_kept"] = sum(self.kept) / len(self.kept)
        return metrics

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        for name, value in self.round_metrics().items():
            self.log(f"val/{name}", value)
