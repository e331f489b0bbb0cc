"""Activation statistics of linear layers (for RegMean and AMARIS) and diagonal Fisher (for Fisher
merging), collected in one streamed pass over a few batches.

For a linear layer with input ``x`` the statistics are the uncentered second moments of
``x~ = [x; 1]`` (the constant 1 only when the layer has a bias), summed over every input row in
float64, with the number of rows: ``E[x~ x~ᵀ] = sum / count``. Sums of two collections pool.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2, bias=False))
    >>> stats = collect_activation_stats(model, [(torch.randn(8, 3), None)] * 2)
    >>> {name: (s.dim, s.count, s.has_bias) for name, s in stats.items()}
    {'0': (4, 16, True), '2': (4, 16, False)}
    >>> check_stats(stats)
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.merging.state_dicts import key, linear_layers

__all__ = [
    "ActivationCollector",
    "ActivationStats",
    "check_stats",
    "check_stats_fit",
    "collect_activation_stats",
    "collect_fisher",
    "default_forward",
    "load_stats",
    "save_stats",
]

_FORMAT = "ada_modules.activation_stats/1"


@dataclass
class ActivationStats:
    """Summed second moments of one linear layer's (augmented) inputs.

    Attributes:
        second_moment_sum: ``Σ x~ x~ᵀ`` over the rows seen, float64, shape ``(d, d)``.
        count: The number of rows.
        has_bias: Whether the last coordinate is the constant 1 of the bias.

    Examples:
        >>> import torch
        >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
        >>> a = ActivationStats(x.T @ x, 2, has_bias=False)
        >>> (a + a).count, a.covariance.tolist()
        (4, [[5.0, 7.0], [7.0, 10.0]])
    """

    second_moment_sum: torch.Tensor
    count: int
    has_bias: bool

    def __post_init__(self) -> None:
        total = self.second_moment_sum
        if (
            not isinstance(total, torch.Tensor)
            or total.ndim != 2
            or total.shape[0] != total.shape[1]
        ):
            shape = tuple(total.shape) if isinstance(total, torch.Tensor) else type(total).__name__
            raise InputError(f"second_moment_sum must be a square matrix, got {shape}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise InputError(f"count must be an int >= 0, got {self.count!r}")
        self.second_moment_sum = total.to(torch.float64)

    @property
    def dim(self) -> int:
        """``d``: the layer's input size, plus 1 with a bias."""
        return self.second_moment_sum.shape[0]

    @property
    def covariance(self) -> torch.Tensor:
        """The uncentered second moment ``E[x~ x~ᵀ] = sum / count`` (float64)."""
        if self.count == 0:
            raise InputError("covariance of statistics with count 0 (no samples)")
        return self.second_moment_sum / self.count

    def merge(self, other: ActivationStats) -> ActivationStats:
        """Pool two collections of the same layer (sums and counts add)."""
        if not isinstance(other, ActivationStats):
            raise InputError(f"can only merge ActivationStats, got {type(other).__name__}")
        if (other.dim, other.has_bias) != (self.dim, self.has_bias):
            raise InputError(
                f"cannot pool statistics of dim {other.dim} (bias {other.has_bias}) into dim "
                f"{self.dim} (bias {self.has_bias})"
            )
        total = self.second_moment_sum + other.second_moment_sum.to(self.second_moment_sum.device)
        return ActivationStats(total, self.count + other.count, self.has_bias)

    __add__ = merge


def default_forward(model: nn.Module, batch: Any) -> Any:
    """Run ``model`` on a batch: ``model(batch[0])`` for a tuple or list,
    ``model(input_ids=..., attention_mask=...)`` for a dict, ``model(batch)`` for a tensor."""
    if isinstance(batch, tuple | list):
        return model(batch[0])
    if isinstance(batch, Mapping):
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    return model(batch)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _model_device(model: nn.Module) -> torch.device | None:
    tensor = next(model.parameters(), None)
    return None if tensor is None else tensor.device


def _check_max_batches(max_batches: int | None) -> None:
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
    ):
        raise InputError(f"max_batches must be a positive int or None, got {max_batches!r}")


class ActivationCollector:
    """Forward pre-hooks that add each chosen ``nn.Linear``'s input moments to running sums.

    Nothing is stored but the ``(d, d)`` sums. Call :meth:`start_batch` before each batch (it
    sets the batch index for messages and, for a dict batch, the ``attention_mask`` whose zero
    positions are left out), then :meth:`stats`, and :meth:`remove` when done. Used by
    :func:`collect_activation_stats` and :class:`~ada_modules.callbacks.ActivationStatsCallback`.

    Args:
        model: The module whose linear layers are hooked (names are relative to it).
        layers: Names of ``nn.Linear`` submodules; ``None``: all of them.

    Examples:
        >>> import torch
        >>> collector = ActivationCollector(torch.nn.Linear(2, 1))
        >>> collector.start_batch(torch.ones(3, 2), 0)
        >>> _ = collector.model(torch.ones(3, 2))
        >>> collector.remove()
        >>> collector.stats()[""].second_moment_sum.tolist()
        [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
    """

    def __init__(self, model: nn.Module, layers: Sequence[str] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.modules = self._resolve(model, layers)
        self.explicit = layers is not None
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = dict.fromkeys(self.modules, 0)
        self._mask: torch.Tensor | None = None
        self._batch_index = 0
        self._handles = [
            module.register_forward_pre_hook(self._hook(name))
            for name, module in self.modules.items()
        ]

    @staticmethod
    def _resolve(model: nn.Module, layers: Sequence[str] | None) -> dict[str, nn.Linear]:
        modules = dict(model.named_modules())
        linear = {name: m for name, m in modules.items() if isinstance(m, nn.Linear)}
        if layers is None:
            if not linear:
                raise InputError(f"{type(model).__name__} has no nn.Linear layers to collect")
            return linear
        if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
            raise InputError(f"layers must be a non-empty list of layer names, got {layers!r}")
        shown = ", ".join(repr(n) for n in list(linear)[:20]) + (" ..." if len(linear) > 20 else "")
        for name in layers:
            if name not in modules:
                raise InputError(f"layers: no module {name!r} (linear layers: {shown or 'none'})")
            if name not in linear:
                raise InputError(
                    f"layers: {name!r} is a {type(modules[name]).__name__}, not an nn.Linear "
                    f"(linear layers: {shown or 'none'})"
                )
        return {name: linear[name] for name in layers}

    def start_batch(self, batch: Any, index: int) -> None:
        """Note the batch index and the ``attention_mask`` of a dict batch."""
        self._batch_index = index
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        self._mask = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None

    def _hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            if self._mask is not None and x.ndim == 3 and x.shape[:2] == self._mask.shape:
                x = x[self._mask.to(device=x.device, dtype=torch.bool)]
            x = x.reshape(-1, module.in_features).to(torch.float64)
            if not bool(torch.isfinite(x).all()):
                raise InputError(
                    f"layer {name!r}: non-finite (NaN or inf) input activation in batch "
                    f"{self._batch_index}"
                )
            if module.bias is not None:
                x = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)
            gram = x.T @ x
            if name in self._sums:
                self._sums[name] += gram
            else:
                self._sums[name] = gram
            self._counts[name] += x.shape[0]

        return hook

    def remove(self) -> None:
        """Remove the hooks (the sums are kept)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stats(self) -> dict[str, ActivationStats]:
        """The statistics so far, as ordinary CPU tensors; layers that never ran are left out
        (an error for layers named explicitly)."""
        missing = [name for name in self.modules if self._counts[name] == 0]
        if self.explicit and missing:
            raise InputError(f"layer {missing[0]!r} saw no input (is it used in forward?)")
        with torch.inference_mode(False):
            return {
                name: ActivationStats(
                    self._sums[name].detach().cpu().clone(),
                    self._counts[name],
                    self.modules[name].bias is not None,
                )
                for name in self.modules
                if self._counts[name] > 0
            }


def _modes(model: nn.Module) -> dict[nn.Module, bool]:
    return {module: module.training for module in model.modules()}


def _restore(modes: Mapping[nn.Module, bool]) -> None:
    for module, training in modes.items():
        module.training = training


def collect_activation_stats(
    model: nn.Module,
    batches: Iterable[Any],
    layers: Sequence[str] | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    max_batches: int | None = None,
) -> dict[str, ActivationStats]:
    """Second moments of the inputs of ``model``'s linear layers over ``batches``.

    The model runs in eval mode under ``torch.no_grad()`` (each module's training flag is
    restored afterwards) and its hooks are removed whatever happens. Tensors in a batch are
    moved to the model's device. Inputs are flattened to ``(-1, in_features)``; for a dict batch
    with a ``(batch, seq)`` ``attention_mask``, inputs of shape ``(batch, seq, d)`` keep only the
    positions where the mask is 1.

    Args:
        model: The model.
        batches: An iterable of batches (e.g. a DataLoader).
        layers: Names of ``nn.Linear`` submodules; ``None``: all of them (those that never run
            are left out).
        forward: ``forward(model, batch)`` runs one batch; default :func:`default_forward`.
        max_batches: Stop after this many batches.

    Raises:
        InputError: An unknown or non-linear layer name, no batches, or a NaN/inf activation
            (naming the layer and the batch index).
    """
    _check_max_batches(max_batches)
    forward = forward or default_forward
    collector = ActivationCollector(model, layers)
    device = _model_device(model)
    modes = _modes(model)
    seen = 0
    try:
        model.eval()
        with torch.no_grad():
            for index, batch in enumerate(batches):
                if max_batches is not None and index >= max_batches:
                    break
                batch = batch if device is None else _to_device(batch, device)
                collector.start_batch(batch, index)
                forward(model, batch)
                seen += 1
    finally:
        collector.remove()
        _restore(modes)
    if seen == 0:
        raise InputError("batches gave no batch to collect activation statistics from")
    return collector.stats()


def check_stats(
    stats: Mapping[str, ActivationStats], ridge: float = 0.0, *, count: bool = True
) -> None:
    """Check that each layer's covariance is usable: finite, symmetric, positive semi-definite,
    and (with ``count``) from at least ``dim`` samples unless ``ridge > 0`` regularises it.

    Examples:
        >>> import torch
        >>> x = torch.randn(40, 65, dtype=torch.float64)
        >>> check_stats({"x": ActivationStats(x.T @ x, 40, True)})
        Traceback (most recent call last):
        ...
        ada_modules.errors.InputError: layer 'x': 40 samples for a 65-dim covariance; at least 65 are needed (or set ridge > 0 to regularise)
        >>> check_stats({"x": ActivationStats(x.T @ x, 40, True)}, ridge=1e-6)
    """
    if isinstance(ridge, bool) or not isinstance(ridge, int | float) or not ridge >= 0:
        raise InputError(f"ridge must be a number >= 0, got {ridge!r}")
    if not isinstance(stats, Mapping):
        raise InputError(f"stats must be a mapping of layer name to ActivationStats, got {stats!r}")
    for name, layer in stats.items():
        if not isinstance(layer, ActivationStats):
            raise InputError(
                f"layer {name!r}: expected ActivationStats, got {type(layer).__name__}"
            )
        if layer.count == 0:
            raise InputError(f"layer {name!r}: no samples (count 0)")
        if count and layer.count < layer.dim and ridge == 0:
            raise InputError(
                f"layer {name!r}: {layer.count} samples for a {layer.dim}-dim covariance; at "
                f"least {layer.dim} are needed (or set ridge > 0 to regularise)"
            )
        covariance = layer.covariance
        if not bool(torch.isfinite(covariance).all()):
            raise InputError(f"layer {name!r}: the covariance has non-finite entries")
        scale = float(covariance.abs().max())
        asymmetry = float((covariance - covariance.T).abs().max())
        if asymmetry > 1e-6 * scale:
            raise InputError(
                f"layer {name!r}: the covariance is not symmetric (max |C - Cᵀ| = {asymmetry:.3g})"
            )
        eigenvalues = torch.linalg.eigvalsh((covariance + covariance.T) / 2)
        smallest, largest = float(eigenvalues[0]), float(eigenvalues[-1])
        if smallest < -1e-8 * max(largest, 0.0):
            raise InputError(
                f"layer {name!r}: the covariance is not positive semi-definite (smallest "
                f"eigenvalue {smallest:.3g}, largest {largest:.3g})"
            )


def check_stats_fit(
    state_dict: Mapping[str, torch.Tensor],
    stats: Mapping[str, ActivationStats],
    who: str = "the base's",
) -> None:
    """Check that each layer in ``stats`` is a linear layer of ``state_dict`` with input size
    ``dim`` (``dim − 1`` plus a bias when ``has_bias``).

    >>> import torch
    >>> check_stats_fit({"fc.weight": torch.zeros(2, 3)}, {"fc": ActivationStats(torch.eye(4), 9, True)})
    Traceback (most recent call last):
    ...
    ada_modules.errors.InputError: layer 'fc': the base's statistics have dim 4 (bias True), the layer needs 3 (3 inputs, no bias)
    """
    linear = set(linear_layers(state_dict))
    for name, layer in stats.items():
        if name not in linear:
            absent = key(name, "weight") not in state_dict
            hint = (
                " (a state dict from save_pretrained stores a tied output head once, under the "
                "embedding's key: pass the model's state_dict())"
                if absent
                else ""
            )
            raise InputError(
                f"{who} statistics name layer {name!r}, which is not a linear layer of the state "
                f"dict (no 2-D {key(name, 'weight')!r}){hint}"
            )
        inputs = state_dict[key(name, "weight")].shape[1]
        bias = key(name, "bias") in state_dict
        if (layer.dim, layer.has_bias) != (inputs + bias, bias):
            raise InputError(
                f"layer {name!r}: {who} statistics have dim {layer.dim} (bias {layer.has_bias}), "
                f"the layer needs {inputs + bias} ({inputs} inputs, {'a' if bias else 'no'} bias)"
            )


def require_layers_with_stats(layers: Sequence[str], method: str) -> None:
    """Refuse a statistics merge that would gate no layer (it would silently be its fallback)."""
    if not layers:
        raise InputError(
            f"{method}: no linear layer of the base has statistics, so no layer would be merged "
            "by them. Statistics come from nn.Linear modules (collect_activation_stats); a model "
            "built on transformers' Conv1D (GPT-2) has none but its tied output head, which is "
            "merged under the embedding's key"
        )


def save_stats(stats: Mapping[str, ActivationStats], path: str | os.PathLike[str]) -> None:
    """Write statistics with ``torch.save``, atomically (a temporary file, then ``os.replace``).

    >>> import tempfile, torch
    >>> stats = {"fc": ActivationStats(torch.eye(2), 5, has_bias=True)}
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     save_stats(stats, f"{folder}/stats.pt")
    ...     load_stats(f"{folder}/stats.pt")["fc"].count
    5
    """
    if not isinstance(stats, Mapping):
        raise InputError(f"stats must be a mapping of layer name to ActivationStats, got {stats!r}")
    layers = {}
    for name, layer in stats.items():
        if not isinstance(layer, ActivationStats):
            raise InputError(
                f"layer {name!r}: expected ActivationStats, got {type(layer).__name__}"
            )
        layers[name] = {
            "second_moment_sum": layer.second_moment_sum.detach().cpu(),
            "count": layer.count,
            "has_bias": layer.has_bias,
        }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # a unique name, created by torch.save with the umask's permissions (mkstemp's are 0600)
    temporary = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        torch.save({"format": _FORMAT, "layers": layers}, temporary)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_stats(path: str | os.PathLike[str]) -> dict[str, ActivationStats]:
    """Read statistics written by :func:`save_stats` (``torch.load(weights_only=True)``)."""
    target = Path(path)
    if not target.is_file():
        raise InputError(f"statistics file not found: {target}")
    data = torch.load(target, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise InputError(f"{target} is not an activation statistics file (written by save_stats)")
    return {
        name: ActivationStats(
            layer["second_moment_sum"], int(layer["count"]), bool(layer["has_bias"])
        )
        for name, layer in data["layers"].items()
    }


def collect_fisher(
    model: nn.Module,
    batches: Iterable[Any],
    log_likelihood: Callable[[nn.Module, Any], torch.Tensor],
    max_batches: int | None = None,
) -> dict[str, torch.Tensor]:
    """Diagonal *empirical* Fisher ``E[(∂ log p(y|x) / ∂θ)²]`` of each trainable parameter.

    It is the empirical Fisher: ``y`` is the label in the data, not sampled from the model. The
    squared gradients are per example (one backward pass per example, so for small models),
    averaged over all examples in float64, with the model in eval mode (training flags restored
    afterwards). Parameters that do not affect the log-likelihood get zeros.

    Args:
        model: The model.
        batches: An iterable of batches.
        log_likelihood: ``log_likelihood(model, batch)`` returns a ``(batch,)`` tensor of
            per-example log-likelihoods ``log p(y_n | x_n)``.
        max_batches: Stop after this many batches.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(1, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(0.0)
        >>> def ll(m, batch):  # Gaussian log-likelihood up to a constant
        ...     x, y = batch
        ...     return -0.5 * (m(x)[:, 0] - y) ** 2
        >>> batch = (torch.tensor([[1.0], [2.0]]), torch.tensor([1.0, 1.0]))
        >>> collect_fisher(model, [batch], ll)["weight"].item()  # mean of (x·y)²: (1 + 4) / 2
        2.5
    """
    _check_max_batches(max_batches)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise InputError(f"{type(model).__name__} has no trainable parameters")
    sums = [torch.zeros_like(p, dtype=torch.float64) for _, p in named]
    params = [p for _, p in named]
    device = _model_device(model)
    modes = _modes(model)
    examples = 0
    try:
        model.eval()
        with torch.inference_mode(False), torch.enable_grad():
            for index, batch in enumerate(batches):
                if max_batches is not None and index >= max_batches:
                    break
                batch = batch if device is None else _to_device(batch, device)
                values = log_likelihood(model, batch)
                if not isinstance(values, torch.Tensor) or values.ndim != 1 or not len(values):
                    shape = tuple(values.shape) if isinstance(values, torch.Tensor) else values
                    raise InputError(
                        "log_likelihood must return a (batch,) tensor of per-example "
                        f"log-likelihoods, got {shape!r}"
                    )
                if not bool(torch.isfinite(values).all()):
                    raise InputError(f"log_likelihood is not finite in batch {index}")
                for n in range(len(values)):
                    grads = torch.autograd.grad(
                        values[n], params, retain_graph=n + 1 < len(values), allow_unused=True
                    )
                    for total, grad in zip(sums, grads, strict=True):
                        if grad is not None:
                            total += grad.detach().to(torch.float64) ** 2
                examples += len(values)
    finally:
        _restore(modes)
    if examples == 0:
        raise InputError("batches gave no example to compute the Fisher information from")
    return {name: total / examples for (name, _), total in zip(named, sums, strict=True)}
