"""ASAP: model poisoning as feedback control (adaptive sliding mode, Fourier drift estimate).

ASAP treats the whole federated training as an uncertain plant and steers a measured quantity of
the global model, the attackers' estimate ``y`` of its accuracy (``AttackContext.metric``), to the
objective ``y*`` (``AttackContext.target``, e.g. half the accuracy when the attack starts). The
reconstruction (the paper's code is not public) maps the pieces as follows:

- **Plant**: ``y[t+1] = y[t] + F[t] + b u[t]``. ``F`` lumps benign training and the aggregation
  rule's distortion (unknown, time-varying); ``b`` is the effective gain of the attack's input
  through the unknown rule. Both are estimated online
  (:class:`~ada_modules.fl.sliding_mode.SlidingModeController`: Fourier-basis drift, recursive
  least squares on the gain, adaptive switching gain, anti-windup).
- **Input**: a scalar ``u`` along a direction ``p``; the malicious update is ``m = mu - u * p``
  with ``mu`` the benign mean. ``direction="signed_std"`` (default): ``p = sign(mu) * sigma``, the
  benign coordinate-wise standard deviation with the sign of the benign change, so every
  coordinate moves against (``u > 0``) or along (``u < 0``) its benign change by ``|u|`` of its
  spread (LIE's and Min-Max's scale, which coordinate-wise rules do not trim away at small
  ``u``). ``direction="mean"``: ``p = mu`` (``u > 1`` reverses the benign step, like IPM with
  an adaptive scale). ``u`` in ``[-max_recovery, max_input]``: the recovery (``u < 0``, to climb
  back after an overshoot) is kept small, as amplified steps make training diverge.
- **Stealth envelope** (input saturation): ``||m - mu|| <= envelope * r`` with ``r`` the largest
  distance of a benign update to ``mu``, so ``|u| <= envelope * r / ||p||`` in every round.
  Distance-based filters see an update no farther out than ``envelope`` benign radii.
- **Pass-through** (the online estimate of what the rule lets through): the attackers see the new
  global model in the next round, so ``k = <a - mu, m - mu> / ||m - mu||^2`` with ``a`` the
  aggregate it implies is the share of the malicious deviation that the rule kept (``f / n`` under
  the mean, 1 when Krum selects the malicious update, 0 when a rule drops it). No rule is
  simulated.
- **Selection-based rules** (Krum, Multi-Krum, Bulyan): the ``f`` attackers send the same update
  (mutual distance 0, which wins them Krum's score inside the benign cloud), and the envelope
  adapts to the rule's acceptance region: when the input was at the envelope and less than
  ``min_pass_through`` of it passed, the envelope shrinks by ``envelope_shrink``; otherwise it grows
  back by ``envelope_growth`` (up to ``envelope``). Where larger inputs are trimmed but not dropped
  (coordinate-wise rules) the kept share falls slowly with the input and the envelope settles near
  its bound; where they are dropped outright (Krum), it settles at the edge of selection.

The attack uses the benign updates, its measurement and the global model it receives, never the
rule itself (aggregation-rule agnostic).

Examples:
    >>> import torch
    >>> from ada_modules.fl.attack import AttackContext
    >>> attack = ASAP()
    >>> benign = torch.randn(16, 10) + 1
    >>> context = AttackContext(num_clients=20, num_malicious=4, round=0, metric=0.9, target=0.45)
    >>> malicious = attack.craft(benign, context)
    >>> malicious.shape, attack.last_input > 0
    (torch.Size([4, 10]), True)
"""

import math

import torch
from torch import Tensor

from ada_modules.errors import InputError
from ada_modules.fl.attack import Attack, AttackContext
from ada_modules.fl.sliding_mode import SlidingModeController

__all__ = ["ASAP", "DIRECTIONS"]

DIRECTIONS = ("signed_std", "mean")


class ASAP(Attack):
    """Adaptive Sliding Agnostic Poisoning: drives the measured accuracy to ``context.target``.

    Args:
        envelope: Stealth envelope in benign radii (``> 0``), or ``None`` for no envelope.
        direction: ``"signed_std"`` or ``"mean"`` (see the module doc).
        max_input: Largest ``u`` (``> 0``).
        max_recovery: Largest ``-u`` (``>= 0``): how far the attack may amplify the benign step.
        min_pass_through: The kept share below which an input at the envelope counts as rejected.
        envelope_shrink: Factor in ``(0, 1)`` applied to the envelope after a rejection.
        envelope_growth: Factor ``>= 1`` applied otherwise (up to ``envelope``).
        gain: Initial guess of the gain ``b`` (accuracy change per unit of ``u``; negative).
        reaching_rate: ``q`` of the reaching law, in ``(0, 1]``.
        boundary_layer: ``phi``, about the measurement noise of the accuracy (``> 0``).
        gain_adaptation: Growth rate of the switching gain.
        fourier_order: Harmonics of the drift estimate.
        period: Period in rounds of the first harmonic.
        forgetting: RLS forgetting factor in ``(0, 1]``.

    Raises:
        InputError: For an argument out of range (naming it), or in :meth:`craft` when the
            context has no ``metric`` or no ``target``.
    """

    def __init__(
        self,
        envelope: float | None = 2.0,
        direction: str = "signed_std",
        max_input: float = 50.0,
        max_recovery: float = 1.0,
        min_pass_through: float = 0.05,
        envelope_shrink: float = 0.5,
        envelope_growth: float = 1.25,
        gain: float = -0.02,
        reaching_rate: float = 0.5,
        boundary_layer: float = 0.03,
        gain_adaptation: float = 0.05,
        fourier_order: int = 2,
        period: float = 50.0,
        forgetting: float = 0.9,
    ) -> None:
        if envelope is not None and not envelope > 0:
            raise InputError(f"envelope must be > 0 (benign radii) or None, got {envelope!r}")
        if direction not in DIRECTIONS:
            raise InputError(f"direction must be one of {list(DIRECTIONS)}, got {direction!r}")
        if not max_input > 0:
            raise InputError(f"max_input must be > 0, got {max_input!r}")
        if not max_recovery >= 0:
            raise InputError(f"max_recovery must be >= 0, got {max_recovery!r}")
        if not 0 <= min_pass_through < 1:
            raise InputError(f"min_pass_through must be in [0, 1), got {min_pass_through!r}")
        if not 0 < envelope_shrink < 1:
            raise InputError(f"envelope_shrink must be in (0, 1), got {envelope_shrink!r}")
        if not envelope_growth >= 1:
            raise InputError(f"envelope_growth must be >= 1, got {envelope_growth!r}")
        if not gain < 0:
            raise InputError(
                f"gain must be < 0 (pushing against the benign direction lowers accuracy), "
                f"got {gain!r}"
            )
        self.envelope = envelope
        self.direction = direction
        self.min_pass_through = min_pass_through
        self.envelope_shrink = envelope_shrink
        self.envelope_growth = envelope_growth
        self.controller = SlidingModeController(
            target=0.0,  # the context's, in every round
            gain=gain,
            reaching_rate=reaching_rate,
            boundary_layer=boundary_layer,
            gain_adaptation=gain_adaptation,
            fourier_order=fourier_order,
            period=period,
            forgetting=forgetting,
            u_min=-max_recovery,
            u_max=max_input,
        )
        self.reset()

    def reset(self) -> None:
        """Forget the estimates, the switching gain and the adapted envelope."""
        self.controller.reset()
        self.last_input = 0.0
        self.pass_through: float | None = None
        self.envelope_scale = 1.0
        self._sent: tuple[Tensor, Tensor, Tensor] | None = None  # params, mu, m of last round

    def _observe(self, context: AttackContext) -> None:
        """The kept share of the last round's malicious deviation, from the new global model."""
        if self._sent is None or context.global_params is None:
            return
        params, mu, malicious = self._sent
        deviation = malicious - mu
        size = float(deviation.pow(2).sum())
        if size == 0.0 or context.global_params.shape != params.shape:
            return
        aggregate = (context.global_params.to(params) - params) / context.server_lr
        self.pass_through = float(((aggregate - mu) * deviation).sum()) / size
        if self.envelope is None or not self.controller.saturated:
            return
        if self.pass_through < self.min_pass_through:
            self.envelope_scale *= self.envelope_shrink
        else:
            self.envelope_scale = min(1.0, self.envelope_scale * self.envelope_growth)

    def craft(self, benign: Tensor, context: AttackContext) -> Tensor:
        """``num_malicious`` copies of ``mu - u * p``, ``u`` from the sliding-mode controller."""
        if benign.ndim != 2 or benign.shape[0] < 2:
            raise InputError(
                f"benign updates must have shape (clients >= 2, d), got {tuple(benign.shape)}"
            )
        if context.metric is None or not math.isfinite(context.metric):
            raise InputError(
                f"ASAP steers a measurement of the global model: AttackContext.metric must be a "
                f"finite number, got {context.metric!r}"
            )
        if context.target is None or not math.isfinite(context.target):
            raise InputError(
                f"ASAP steers the metric to an objective: AttackContext.target must be a finite "
                f"number, got {context.target!r}"
            )
        self.controller.target = context.target
        self._observe(context)
        mu = benign.mean(0)
        if self.direction == "mean":
            p = mu
        else:
            p = torch.sign(mu) * benign.std(0, correction=0)
        p_norm = float(p.norm())
        limit = math.inf
        if self.envelope is not None:
            radius = float((benign - mu).norm(dim=1).max())
            limit = self.envelope * self.envelope_scale * radius / max(p_norm, 1e-12)
        u = self.controller.step(context.metric, u_min=-limit, u_max=limit)
        self.last_input = u
        malicious = mu - u * p
        if context.global_params is not None:
            self._sent = (context.global_params.detach().clone(), mu, malicious)
        return malicious.expand(context.num_malicious, -1).clone()

    @property
    def saturated(self) -> bool:
        """Whether the last input hit a limit (the envelope or ``max_input``)."""
        return self.controller.saturated
