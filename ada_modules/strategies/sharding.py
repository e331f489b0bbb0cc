"""FSDP2 for any module: find its blocks, ``fully_shard`` each, then the roots.

The library's task modules call :func:`shard_module` from ``configure_model``, so they shard
themselves under Lightning's ``ModelParallelStrategy`` and under
:class:`~ada_modules.strategies.AdERAStrategy`; a user's own LightningModule can call it the same
way, or get it from ``AdERAStrategy(shard=[...])``.

Which modules are blocks (one FSDP2 parameter group each, gathered just before they run):

- ``shard`` given: every module whose class is in it (a type, or a class name such as
  ``"LlamaDecoderLayer"``) or whose qualified name matches one of its name patterns
  (``"net.*"``, ``"model.model.layers.*"``; :func:`fnmatch.fnmatch`), like FSDP1's auto-wrap policy;
- otherwise, the classes that Hugging Face models list in ``_no_split_modules`` (their decoder
  layers);
- otherwise, the layers with parameters of each outermost ``nn.ModuleList`` / ``nn.Sequential``
  (a timm model's ``blocks``, an MLP's layers).

Examples:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> [name for name, _ in find_blocks(net)]
    ['0', '2']
    >>> [name for name, _ in find_blocks(net, shard=["Linear"])]
    ['0', '2']
"""

from collections.abc import Sequence
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

from torch import nn

from ada_modules.errors import InputError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ShardSpec",
    "check_shard_spec",
    "find_blocks",
    "is_sharded",
    "shard_module",
    "sharding_mesh",
    "world_size",
]

ShardSpec = Sequence[type[nn.Module] | str]
"""Blocks to wrap: module classes, class names, or qualified-name patterns."""


def sharding_mesh(device_mesh: "DeviceMesh") -> "DeviceMesh":
    """The 1-D mesh to shard a model without a tensor-parallel plan over.

    The strategy's ``data_parallel`` dimension when it has more than one rank, otherwise its
    ``tensor_parallel`` dimension (Lightning's default on one node is ``data_parallel=1`` and
    ``tensor_parallel=devices``, under which all ranks see the same batches), otherwise the mesh.
    """
    names = device_mesh.mesh_dim_names or ()
    if "data_parallel" in names and device_mesh["data_parallel"].size() > 1:
        return device_mesh["data_parallel"]
    if "tensor_parallel" in names:
        return device_mesh["tensor_parallel"]
    return device_mesh


def world_size() -> int:
    """Processes in the default process group (1 when none is initialized)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or to one of its submodules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _matches(name: str, module: nn.Module, spec: ShardSpec) -> bool:
    for entry in spec:
        if isinstance(entry, type):
            if isinstance(module, entry):
                return True
        elif type(module).__name__ == entry or fnmatch(name, entry):
            return True
    return False


def check_shard_spec(shard: ShardSpec) -> None:
    """Raise ``InputError`` unless ``shard`` is a non-empty list of classes or strings."""
    if isinstance(shard, str | type) or not isinstance(shard, Sequence) or not shard:
        raise InputError(
            f"shard must be a non-empty list of module classes, class names or name patterns, "
            f"got {shard!r}"
        )
    for entry in shard:
        if not (isinstance(entry, str) and entry) and not (
            isinstance(entry, type) and issubclass(entry, nn.Module)
        ):
            raise InputError(
                f"shard entries must be nn.Module classes or non-empty strings, got {entry!r}"
            )


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def find_blocks(model: nn.Module, shard: ShardSpec | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` that :func:`shard_module` wraps, as ``(qualified name, module)``.

    See the module docstring for the rules. ``model`` itself is never a block; blocks without
    parameters are skipped.

    Raises:
        InputError: If ``shard`` is not a non-empty list of classes, class names or patterns.
    """
    named = [(n, m) for n, m in model.named_modules() if n and _has_params(m)]
    if shard is not None:
        check_shard_spec(shard)
        return [(n, m) for n, m in named if _matches(n, m, shard)]
    no_split: set[str] = set()
    for module in model.modules():
        no_split.update(getattr(module, "_no_split_modules", None) or ())
    if no_split:
        blocks = [(n, m) for n, m in named if type(m).__name__ in no_split]
        if blocks:
            return blocks
    blocks = []
    for name, module in model.named_modules():
        inside = any(name == b or name.startswith(f"{b}.") for b, _ in blocks)
        if isinstance(module, nn.ModuleList | nn.Sequential) and module is not model and not inside:
            for child_name, child in module.named_children():
                if _has_params(child):
                    blocks.append((f"{name}.{child_name}" if name else child_name, child))
    if not blocks and isinstance(model, nn.Sequential | nn.ModuleList):
        blocks = [(n, m) for n, m in model.named_children() if _has_params(m)]
    return blocks


def shard_module(
    module: nn.Module,
    mesh: "DeviceMesh | None",
    shard: ShardSpec | None = None,
    *,
    reshard_after_forward: bool = True,
    **fsdp_kwargs: Any,
) -> list[str]:
    """Apply FSDP2 ``fully_shard`` to each block of ``module`` (innermost first), then the roots.

    The roots are ``module`` itself, or, for a ``LightningModule`` (whose ``training_step`` may call
    its submodules directly), each of its direct children with parameters. Call it from
    ``configure_model``; it does nothing when ``mesh`` is ``None`` (no ``ModelParallelStrategy``)
    or when the module is already sharded (``configure_model`` runs again for ``test`` after
    ``fit``).

    Args:
        module: The model, or a LightningModule.
        mesh: The device mesh to shard over (``self.device_mesh`` in a LightningModule; passed
            through :func:`sharding_mesh`).
        shard: Which modules are blocks (see :func:`find_blocks`); ``None``: found automatically.
        reshard_after_forward: FSDP2's ``reshard_after_forward`` for the blocks.
        **fsdp_kwargs: Further ``fully_shard`` arguments for blocks and roots (``mp_policy``, ...).

    Returns:
        The qualified names of the blocks that were wrapped (empty when nothing was done).

    Raises:
        InputError: If no block is found (the message names the module's class and how to pass
            ``shard=``), or a LightningModule holds parameters directly (they would stay
            unsharded and unsynchronised).

    Examples:
        In a LightningModule::

            def configure_model(self):
                shard_module(self, self.device_mesh, shard=["TransformerBlock"])
    """
    if mesh is None or is_sharded(module):
        return []
    from lightning.pytorch import LightningModule
    from torch.distributed.fsdp import FSDPModule, fully_shard

    blocks = find_blocks(module, shard)
    if not blocks:
        how = (
            f"nothing matched shard={list(shard)!r}"
            if shard is not None
            else "no Hugging Face _no_split_modules, no nn.ModuleList or nn.Sequential of layers"
        )
        raise InputError(
            f"cannot shard {type(module).__name__}: no blocks found ({how}). Name the blocks to "
            "wrap by class or qualified-name pattern, e.g. AdERAStrategy(shard=['Linear']) or "
            "shard=['net.*'], or call ada_modules.strategies.shard_module(self, "
            "self.device_mesh, shard=[...]) from configure_model"
        )
    if isinstance(module, LightningModule):
        direct = [n for n, _ in module.named_parameters(recurse=False)]
        if direct:
            raise InputError(
                f"cannot shard {type(module).__name__}: it holds parameters {direct} directly; "
                "move them into a submodule"
            )
        roots = [child for child in module.children() if _has_params(child)]
    else:
        roots = [module]
    shard_mesh = sharding_mesh(mesh)
    for _, block in sorted(blocks, key=lambda item: -item[0].count(".")):
        fully_shard(
            block, mesh=shard_mesh, reshard_after_forward=reshard_after_forward, **fsdp_kwargs
        )
    for root in roots:
        if not isinstance(root, FSDPModule):  # a root over blocks: one lazy init, prefetching
            fully_shard(root, mesh=shard_mesh, **fsdp_kwargs)
    return [name for name, _ in blocks]
