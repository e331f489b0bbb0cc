"""The clients of the federated simulator, all computed at once with ``torch.func.vmap``.

The global model lives as one flat parameter vector (:func:`flatten_params`, in the order of
``model.named_parameters()``); the ``model`` object only supplies the architecture to
``torch.func.functional_call`` and is never modified. :class:`ClientData` holds each client's
samples and draws equal-size batches for all clients (with replacement, so clients of different
sizes vectorise). :func:`client_updates` returns every client's update (the convention of
:mod:`ada_modules.fl.attack`): FedSGD ``-lr * gradient`` at the global parameters; FedAvg the
local parameters after ``local_steps`` plain SGD steps minus the global parameters, one fresh batch
per step.

Examples:
    >>> import torch
    >>> model = torch.nn.Linear(3, 2)
    >>> flat = flatten_params(model)
    >>> flat.shape, list(unflatten_params(model, flat))
    (torch.Size([8]), ['weight', 'bias'])
    >>> data = ClientData([torch.randn(5, 3), torch.randn(9, 3)], [torch.zeros(5, dtype=torch.long),
    ...                    torch.ones(9, dtype=torch.long)])
    >>> x, y = data.sample_batches(4, torch.Generator().manual_seed(0))
    >>> x.shape, y.shape
    (torch.Size([2, 4, 3]), torch.Size([2, 4]))
    >>> client_updates(model, flat, x, y, lr=0.1).shape
    torch.Size([2, 8])
    >>> x, y = data.sample_batches(4, torch.Generator().manual_seed(0), num_steps=3)
    >>> client_updates(model, flat, x, y, algorithm="fedavg", local_steps=3).shape
    torch.Size([2, 8])
"""

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from ada_modules.errors import InputError

__all__ = ["ALGORITHMS", "ClientData", "client_updates", "flatten_params", "unflatten_params"]

ALGORITHMS = ("fedsgd", "fedavg")


def flatten_params(model: nn.Module) -> Tensor:
    """The model's parameters as one detached vector (``parameters_to_vector`` order)."""
    params = [param.detach().reshape(-1) for param in model.parameters()]
    if not params:
        raise InputError(f"model must have parameters, got a {type(model).__name__} with none")
    return torch.cat(params)


def unflatten_params(model: nn.Module, flat: Tensor) -> dict[str, Tensor]:
    """``{name: tensor}`` for ``torch.func.functional_call``, cut from ``flat`` (views of it).

    Args:
        model: Gives the names and shapes (``model.named_parameters()`` order).
        flat: A vector of length ``sum(p.numel() for p in model.parameters())``.
    """
    shapes = _shapes(model)
    _check_flat(flat, shapes)
    return _unflatten(shapes, flat)


class ClientData:
    """Each client's samples, and equal-size batches drawn for all clients at once.

    Args:
        xs: Per client, its inputs ``(size_i, *feature_shape)`` (same feature shape and dtype for
            every client, ``size_i >= 1``).
        ys: Per client, its targets ``(size_i, *target_shape)``.

    Attributes:
        sizes: ``(num_clients,)`` sample counts.
    """

    def __init__(self, xs: Sequence[Tensor], ys: Sequence[Tensor]) -> None:
        if len(xs) == 0 or len(xs) != len(ys):
            raise InputError(
                f"xs and ys must be equally long, non-empty lists, got {len(xs)} and {len(ys)}"
            )
        for name, tensors in (("xs", xs), ("ys", ys)):
            if not all(isinstance(t, Tensor) for t in tensors):
                raise InputError(f"{name} must hold torch.Tensors")
            shapes = {(tuple(t.shape[1:]), t.dtype, t.device) for t in tensors}
            if len(shapes) != 1 or tensors[0].ndim == 0:
                raise InputError(
                    f"{name} must share one per-sample shape, dtype and device, got {shapes}"
                )
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if len(x) != len(y) or len(x) == 0:
                raise InputError(
                    f"client {i}: xs and ys must hold the same number (>= 1) of samples, "
                    f"got shapes {tuple(x.shape)} and {tuple(y.shape)}"
                )
        self.x = torch.cat(list(xs))
        self.y = torch.cat(list(ys)).to(self.x.device)
        self.sizes = torch.tensor([len(x) for x in xs], device=self.x.device)
        self.offsets = torch.cumsum(self.sizes, 0) - self.sizes

    @classmethod
    def from_partition(cls, x: Tensor, y: Tensor, parts: Sequence[Tensor]) -> "ClientData":
        """Client ``i`` holds ``x[parts[i]], y[parts[i]]`` (``parts`` as from ``partition``)."""
        return cls([x[part] for part in parts], [y[part] for part in parts])

    def __len__(self) -> int:
        return len(self.sizes)

    def sample_batches(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        num_steps: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``batch_size`` samples per client, uniformly with replacement from its own data.

        Returns ``(x[n, B, ...], y[n, B, ...])``, or with ``num_steps`` (FedAvg: one batch per
        local step) ``(x[n, num_steps, B, ...], y[n, num_steps, B, ...])``. The draw comes from
        ``generator`` (on its device; the default generator when ``None``), so a seeded generator
        gives the same batches.
        """
        _check_int("batch_size", batch_size, 1)
        shape = (batch_size,)
        if num_steps is not None:
            shape = (_check_int("num_steps", num_steps, 1), batch_size)
        device = self.x.device if generator is None else generator.device
        uniform = torch.rand(
            len(self), *shape, generator=generator, device=device, dtype=torch.float64
        ).to(self.x.device)
        view = (-1,) + (1,) * len(shape)
        sizes = self.sizes.view(view)
        local = torch.minimum((uniform * sizes).long(), sizes - 1)
        index = self.offsets.view(view) + local
        return self.x[index], self.y[index]


def client_updates(
    model: nn.Module,
    flat_params: Tensor,
    x: Tensor,
    y: Tensor,
    *,
    algorithm: str = "fedsgd",
    lr: float = 0.1,
    local_steps: int = 1,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = nn.functional.cross_entropy,
) -> Tensor:
    """Every client's update of the global parameters ``flat_params``, shape ``(n, d)``.

    Args:
        model: The architecture (only read: its parameters and buffers are not changed; buffers
            must not be updated by ``forward``, e.g. no BatchNorm in training mode).
        flat_params: The global parameters, ``(d,)`` as from :func:`flatten_params`.
        x: The clients' inputs: ``(n, B, ...)`` for ``"fedsgd"``; ``(n, local_steps, B, ...)`` for
            ``"fedavg"``, step ``s`` using batch ``x[:, s]``.
        y: The targets, shaped like ``x`` up to the batch dimension.
        algorithm: ``"fedsgd"``: ``-lr * grad`` of each client's batch loss at ``flat_params``.
            ``"fedavg"``: ``local_steps`` SGD steps ``w <- w - lr * grad`` from ``flat_params``,
            then ``w - flat_params``.
        lr: The clients' learning rate, ``> 0``.
        local_steps: FedAvg's local steps, ``>= 1``; must be 1 for FedSGD.
        loss_fn: ``loss_fn(outputs, targets)`` -> the scalar (mean) loss of one batch.

    Returns:
        The updates, without autograd history. Random layers (dropout) draw differently per client.
    """
    if algorithm not in ALGORITHMS:
        raise InputError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr <= 0:
        raise InputError(f"lr must be a finite number > 0, got {lr!r}")
    _check_int("local_steps", local_steps, 1)
    if algorithm == "fedsgd" and local_steps != 1:
        raise InputError(f"local_steps must be 1 with algorithm='fedsgd', got {local_steps}")
    shapes = _shapes(model)
    _check_flat(flat_params, shapes, name="flat_params")
    _check_batches(x, y, local_steps if algorithm == "fedavg" else None)
    flat_params = flat_params.detach()

    def loss(flat: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
        return loss_fn(functional_call(model, _unflatten(shapes, flat), (inputs,)), targets)

    gradient = grad(loss)

    def fedsgd(flat: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
        return -lr * gradient(flat, inputs, targets)

    def fedavg(flat: Tensor, inputs: Tensor, targets: Tensor) -> Tensor:
        local = flat
        for step in range(local_steps):
            local = local - lr * gradient(local, inputs[step], targets[step])
        return local - flat

    client = fedsgd if algorithm == "fedsgd" else fedavg
    return vmap(client, in_dims=(None, 0, 0), randomness="different")(flat_params, x, y).detach()


def _shapes(model: nn.Module) -> list[tuple[str, torch.Size]]:
    shapes = [(name, param.shape) for name, param in model.named_parameters()]
    if not shapes:
        raise InputError(f"model must have parameters, got a {type(model).__name__} with none")
    return shapes


def _unflatten(shapes: list[tuple[str, torch.Size]], flat: Tensor) -> dict[str, Tensor]:
    params, offset = {}, 0
    for name, shape in shapes:
        numel = shape.numel()
        params[name] = flat[offset : offset + numel].reshape(shape)
        offset += numel
    return params


def _check_flat(flat: Tensor, shapes: list[tuple[str, torch.Size]], name: str = "flat") -> None:
    total = sum(shape.numel() for _, shape in shapes)
    if not isinstance(flat, Tensor) or flat.shape != (total,) or not flat.is_floating_point():
        got = tuple(flat.shape) if isinstance(flat, Tensor) else type(flat).__name__
        raise InputError(f"{name} must be a floating 1-D tensor of shape ({total},), got {got}")


def _check_batches(x: Tensor, y: Tensor, local_steps: int | None) -> None:
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise InputError("x and y must be torch.Tensors")
    lead = 2 if local_steps is None else 3
    layout = "(n, B, ...)" if local_steps is None else f"(n, local_steps={local_steps}, B, ...)"
    if (
        x.ndim < lead
        or y.ndim < lead
        or x.shape[:lead] != y.shape[:lead]
        or (local_steps is not None and x.shape[1] != local_steps)
        or 0 in x.shape[:lead]
    ):
        raise InputError(
            f"x and y must share the non-empty leading dimensions {layout}, got shapes "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )


def _check_int(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    return value
