"""Stepping several optimizers over disjoint parameters as one ``torch.optim.Optimizer``."""

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from ada_modules.errors import InputError

__all__ = ["OptimizerChain"]


class OptimizerChain(Optimizer):
    """Several optimizers over disjoint parameters, stepped together as one ``Optimizer``.

    The usual "Muon for hidden matrices, AdamW for the rest" recipe as a single optimizer, so that
    Lightning's automatic optimization, ``max_steps``, gradient clipping and one learning-rate
    scheduler cover both. ``param_groups`` is the list of the children's groups (the same dicts,
    so a scheduler of the chain sets the children's rates) and ``state`` a read view of their
    states (for moving them between devices).

    :meth:`state_dict` has ``torch.optim.Optimizer``'s format (the children's state dicts merged,
    parameter ids numbered through the chain's ``param_groups``), so that
    ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict``/``set_optimizer_state_dict``
    (Lightning's ``ModelParallelStrategy`` checkpoints, FSDP2) handle the chain like any optimizer.

    The closure, if any, is evaluated once and every child steps on the gradients it left, so a
    child that re-evaluates the loss itself (``torch.optim.LBFGS``) is refused.

    Args:
        optimizers: Optimizers whose parameters do not overlap.

    Raises:
        InputError: A child that is not an ``Optimizer`` or is an ``LBFGS``, or a parameter held
            by two children.

    Examples:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        >>> matrices = [p for p in net.parameters() if p.ndim == 2]
        >>> vectors = [p for p in net.parameters() if p.ndim < 2]
        >>> chain = OptimizerChain(
        ...     [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(vectors, lr=1e-3)]
        ... )
        >>> net(torch.randn(3, 4)).sum().backward()
        >>> _ = chain.step()
        >>> len(chain.param_groups)
        2
    """

    def __init__(self, optimizers: list[Optimizer]) -> None:
        for index, opt in enumerate(optimizers):
            if not isinstance(opt, Optimizer) or isinstance(opt, torch.optim.LBFGS):
                raise InputError(
                    f"optimizers[{index}] must be a torch.optim.Optimizer that steps without a "
                    f"closure (not LBFGS), got {type(opt).__name__}"
                )
        owner: dict[int, int] = {}
        for index, opt in enumerate(optimizers):
            for p in (p for group in opt.param_groups for p in group["params"]):
                if owner.setdefault(id(p), index) != index:
                    raise InputError(
                        f"optimizers[{index}] holds a parameter of shape {tuple(p.shape)} that "
                        f"optimizers[{owner[id(p)]}] holds too: the optimizers of a chain must "
                        "hold disjoint parameters (it would step twice)"
                    )
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        super().__init__(params, {})
        self.optimizers = optimizers
        self.param_groups = [group for opt in optimizers for group in opt.param_groups]
        self.state = _StateView(optimizers)  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The children's state dicts as one, in ``torch.optim.Optimizer``'s format.

        Each child's parameter ids are shifted by the number of parameters of the children before
        it, so the ids count through :attr:`param_groups` as for a single optimizer.
        """
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        offset = 0
        for opt in self.optimizers:
            child = opt.state_dict()
            merged["state"].update({offset + key: value for key, value in child["state"].items()})
            for group in child["param_groups"]:
                ids = [offset + key for key in group["params"]]
                merged["param_groups"].append({**group, "params": ids})
            offset += sum(len(group["params"]) for group in opt.param_groups)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict`'s format (or the older per-child list).

        The groups are handed to the children in order, each with the states of its parameters;
        parameter keys may be ids or names (as ``torch.distributed.checkpoint`` passes them).
        """
        if "optimizers" in state_dict:
            children = state_dict["optimizers"]
            if len(children) != len(self.optimizers):
                raise InputError(
                    f"state_dict holds {len(children)} optimizers, the chain has "
                    f"{len(self.optimizers)}"
                )
        else:
            groups, state = state_dict["param_groups"], state_dict["state"]
            if len(groups) != len(self.param_groups):
                raise InputError(
                    f"state_dict holds {len(groups)} parameter groups, the chain has "
                    f"{len(self.param_groups)}"
                )
            children, start = [], 0
            for opt in self.optimizers:
                own = groups[start : start + len(opt.param_groups)]
                start += len(opt.param_groups)
                keys = {key for group in own for key in group["params"]}
                own_state = {key: value for key, value in state.items() if key in keys}
                children.append({"state": own_state, "param_groups": own})
        for opt, child in zip(self.optimizers, children, strict=True):
            opt.load_state_dict(child)
        # Children replace their group dicts on load; share the new ones again.
        self.param_groups = [group for opt in self.optimizers for group in opt.param_groups]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "optimizers"):
            raise InputError("add parameter groups to one of the chained optimizers instead")
        super().add_param_group(param_group)


class _StateView(Mapping):
    """Read view of the per-parameter states of optimizers over disjoint parameters.

    Unlike a ``ChainMap`` of their ``defaultdict`` states, a lookup never creates an entry.
    """

    def __init__(self, optimizers: list[Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, key: Any) -> Any:
        for opt in self._optimizers:
            if key in opt.state:
                return opt.state[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)
