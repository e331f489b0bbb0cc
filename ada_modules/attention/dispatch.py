"""AdaCal's coarse task dispatch: structure-dominant or retrieval-intensive, per input.

:class:`TaskDispatcher` labels each batch element from the :data:`DISPATCH_FEATURES` that
:meth:`~ada_modules.attention.AdaCalPolicy.dispatch_features` aggregates over the heads of one
attention call: a threshold rule by default, or a logistic regression fitted on labelled inputs
(:meth:`TaskDispatcher.fit`; :meth:`TaskDispatcher.state_dict` is JSON, which
``ada fit -c cli_configs/adacal/study.yaml`` writes and ``sparse_prefill: {dispatch_path: ...}``
reads).
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ada_modules.attention.probe import check_count, check_fraction
from ada_modules.errors import InputError

__all__ = ["DISPATCH_FEATURES", "REGIMES", "TaskDispatcher"]

REGIMES: tuple[str, ...] = ("structure", "retrieval")
"""Task regimes, in the order of the dispatcher's labels (0, 1)."""

DISPATCH_FEATURES: tuple[str, ...] = ("entropy", "mid_mass", "peaky_heads", "slash_ratio")
"""Per batch element, over the query heads (see :meth:`AdaCalPolicy.dispatch_features`)."""


def _as_features(features: object) -> torch.Tensor:
    x = torch.as_tensor(features).detach().to("cpu", torch.float64)
    if x.dim() != 2 or x.shape[1] != len(DISPATCH_FEATURES) or not torch.isfinite(x).all():
        raise InputError(
            f"features must be finite, shape (n, {len(DISPATCH_FEATURES)}) "
            f"{DISPATCH_FEATURES}, got shape {tuple(x.shape)}"
        )
    return x


class TaskDispatcher:
    """Labels each input structure-dominant or retrieval-intensive from its dispatch features.

    Default rule (thresholds are arguments), on :data:`DISPATCH_FEATURES`: *retrieval* iff
    ``peaky_heads >= peaky_threshold`` (a share of heads reads a few mid-context keys: needles,
    key-value lookups) or ``mid_mass >= mid_mass_threshold`` and ``slash_ratio <
    slash_threshold`` (most attention lands mid-context and is not periodic structure).

    :meth:`fit` replaces the rule by a logistic regression on labelled features (standardised,
    L2-regularised, L-BFGS from zeros: deterministic). :meth:`state_dict` is JSON-serialisable
    and is exactly the constructor's keyword arguments, so a fitted dispatcher can be saved,
    loaded with :meth:`from_dict`, or written inline in a YAML config.

    Args:
        peaky_threshold: Share of peaky heads in ``[0, 1]`` (0.2: more than one head in eight).
        mid_mass_threshold: Mean mid-zone mass in ``[0, 1]`` (0.6).
        slash_threshold: Mean slash ratio in ``[0, 1]`` (0.5: slashes dominate verticals).
        logistic: A fitted model ``{"weight", "bias", "mean", "std"}`` (from :meth:`fit`), or
            ``None`` for the rule.

    Example:
        >>> features = torch.tensor([[0.3, 0.1, 0.0, 0.6], [0.5, 0.5, 0.5, 0.1]])
        >>> TaskDispatcher().predict(features).tolist()
        [False, True]
        >>> fitted = TaskDispatcher().fit(features, ["structure", "retrieval"])
        >>> TaskDispatcher.from_dict(fitted.state_dict()).predict(features).tolist()
        [False, True]
    """

    def __init__(
        self,
        *,
        peaky_threshold: float = 0.2,
        mid_mass_threshold: float = 0.6,
        slash_threshold: float = 0.5,
        logistic: dict[str, Any] | None = None,
    ) -> None:
        self.peaky_threshold = check_fraction(peaky_threshold, "peaky_threshold", allow_zero=True)
        self.mid_mass_threshold = check_fraction(
            mid_mass_threshold, "mid_mass_threshold", allow_zero=True
        )
        self.slash_threshold = check_fraction(slash_threshold, "slash_threshold", allow_zero=True)
        self.logistic = None if logistic is None else self._check_logistic(logistic)

    @staticmethod
    def _check_logistic(logistic: object) -> dict[str, Any]:
        n = len(DISPATCH_FEATURES)
        keys = {"weight", "bias", "mean", "std"}
        if not isinstance(logistic, Mapping) or set(logistic) != keys:
            raise InputError(f"logistic must be a dict with keys {sorted(keys)}, got {logistic!r}")
        try:
            out = {"bias": float(logistic["bias"])}
            for name in ("weight", "mean", "std"):
                out[name] = [float(v) for v in logistic[name]]
        except (TypeError, ValueError) as error:
            raise InputError(f"logistic values must be numbers, got {logistic!r}") from error
        for name in ("weight", "mean", "std"):
            if len(out[name]) != n:
                raise InputError(f"logistic[{name!r}] must have {n} values, got {len(out[name])}")
        if not all(math.isfinite(v) for v in [out["bias"], *out["weight"], *out["mean"]]):
            raise InputError(f"logistic values must be finite, got {logistic!r}")
        if not min(out["std"]) > 0 or not all(math.isfinite(v) for v in out["std"]):
            raise InputError(f"logistic['std'] must be positive, got {out['std']}")
        return out

    def retrieval_probability(self, features: object) -> torch.Tensor:
        """``(n,)`` probability of *retrieval* (the rule gives 0 or 1)."""
        x = _as_features(features)
        if self.logistic is None:
            _, mid_mass, peaky, slash = x.unbind(-1)  # entropy is for fitted models
            retrieval = (peaky >= self.peaky_threshold) | (
                (mid_mass >= self.mid_mass_threshold) & (slash < self.slash_threshold)
            )
            return retrieval.double()
        z = (x - torch.tensor(self.logistic["mean"], dtype=x.dtype)) / torch.tensor(
            self.logistic["std"], dtype=x.dtype
        )
        logits = z @ torch.tensor(self.logistic["weight"], dtype=x.dtype) + self.logistic["bias"]
        return torch.sigmoid(logits)

    def predict(self, features: object) -> torch.Tensor:
        """``(n,)`` boolean, ``True`` for *retrieval*."""
        return self.retrieval_probability(features) >= 0.5

    def fit(
        self, features: object, labels: object, *, steps: int = 200, l2: float = 1e-2
    ) -> "TaskDispatcher":
        """Fit the logistic regression (replacing the rule) and return ``self``.

        Args:
            features: ``(n, 4)`` dispatch features (e.g. from :meth:`AdaCalPolicy.dispatch_features`).
            labels: ``n`` labels, ``"structure"``/``"retrieval"`` or 0/1 (1 = retrieval); both
                classes must occur.
            steps: L-BFGS iterations (>= 1).
            l2: Weight penalty (>= 0) on the standardised features; it keeps the weights finite
                on separable data.
        """
        x = _as_features(features)
        y = self._labels(labels, x.shape[0])
        check_count(steps, "steps", minimum=1)
        if isinstance(l2, bool) or not isinstance(l2, int | float) or not l2 >= 0:
            raise InputError(f"l2 must be a number >= 0, got {l2!r}")
        mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
        z = (x - mean) / std
        weight = torch.zeros(x.shape[1], dtype=x.dtype, requires_grad=True)
        bias = torch.zeros((), dtype=x.dtype, requires_grad=True)
        optimizer = torch.optim.LBFGS(
            [weight, bias], max_iter=steps, line_search_fn="strong_wolfe", tolerance_grad=1e-10
        )

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.binary_cross_entropy_with_logits(z @ weight + bias, y)
            loss = loss + l2 * weight.square().sum()
            loss.backward()
            return loss

        optimizer.step(closure)
        self.logistic = {
            "weight": weight.detach().tolist(),
            "bias": float(bias.detach()),
            "mean": mean.tolist(),
            "std": std.tolist(),
        }
        return self

    @staticmethod
    def _labels(labels: object, n: int) -> torch.Tensor:
        if isinstance(labels, torch.Tensor):
            labels = labels.tolist()
        if not isinstance(labels, Sequence) or isinstance(labels, str) or len(labels) != n:
            raise InputError(f"labels must be a sequence of {n} labels, got {labels!r}")
        codes = []
        for label in labels:
            if label in REGIMES:
                codes.append(REGIMES.index(label))
            elif not isinstance(label, str) and label in (0, 1):
                codes.append(int(label))
            else:
                raise InputError(f"a label must be 'structure', 'retrieval', 0 or 1, got {label!r}")
        if len(set(codes)) < 2:
            raise InputError("labels must contain both regimes to fit a dispatcher")
        return torch.tensor(codes, dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable keyword arguments that rebuild this dispatcher."""
        return {
            "peaky_threshold": self.peaky_threshold,
            "mid_mass_threshold": self.mid_mass_threshold,
            "slash_threshold": self.slash_threshold,
            "logistic": None if self.logistic is None else dict(self.logistic),
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "TaskDispatcher":
        """Rebuild a dispatcher from :meth:`state_dict`."""
        if not isinstance(state, Mapping):
            raise InputError(f"a dispatcher state must be a dict, got {state!r}")
        unknown = sorted(
            set(state) - {"peaky_threshold", "mid_mass_threshold", "slash_threshold", "logistic"}
        )
        if unknown:
            raise InputError(f"a dispatcher state has unknown keys {unknown}")
        return cls(**state)

    def __repr__(self) -> str:
        kind = "logistic" if self.logistic is not None else "rule"
        return f"TaskDispatcher({kind}, peaky_threshold={self.peaky_threshold}, " + (
            f"mid_mass_threshold={self.mid_mass_threshold}, slash_threshold={self.slash_threshold})"
        )
