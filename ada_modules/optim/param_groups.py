"""Parameter groups with a norm per layer role, for optimizers with per-layer geometry.

:func:`geometry_param_groups` plays the part of timm's param-group helpers for
:class:`~ada_modules.optim.accelegrad_sharp.AcceleGradSharp` and Scion: it decides which layer gets
which norm of :mod:`ada_modules.optim.lmo` (Scion's recipe) and returns groups with the keys
``params``, ``param_names``, ``norm`` and, when given, ``radius``.
"""

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from torch import nn
from torch.optim import Optimizer

from ada_modules.errors import InputError
from ada_modules.optim.lmo import NORM_NAMES, Norm

__all__ = [
    "DEFAULT_HEAD_NAMES",
    "DEFAULT_ROLE_NORMS",
    "DEFAULT_ROLE_NORM_KWARGS",
    "ROLES",
    "Role",
    "check_param_coverage",
    "check_radii",
    "geometry_param_groups",
    "split_param_groups",
    "weight_decay_param_groups",
]

Role = Literal["embedding", "hidden", "conv", "vector", "head", "routing"]
ROLES: tuple[Role, ...] = ("embedding", "hidden", "conv", "vector", "head", "routing")
"""Layer roles, in the order the groups are returned."""
DEFAULT_ROLE_NORMS: dict[Role, str] = {
    "embedding": "colnorm",
    "hidden": "spectral",
    "conv": "spectral_conv",
    "vector": "rms",
    "head": "sign",
    "routing": "rms",
}
"""Norm per role (embeddings use ``colnorm`` transposed: one column per token)."""
DEFAULT_ROLE_NORM_KWARGS: dict[Role, dict[str, Any]] = {"embedding": {"transpose": True}}
"""Options of the default norms (``norm_kwargs`` of the group)."""
DEFAULT_HEAD_NAMES: tuple[str, ...] = ("lm_head", "head", "classifier", "output", "fc_out")
"""Module names (last component) recognised as the output head."""


def geometry_param_groups(
    model: nn.Module,
    *,
    head: str | None = None,
    head_names: Iterable[str] = DEFAULT_HEAD_NAMES,
    norms: Mapping[Role, str | Norm] | None = None,
    radii: Mapping[Role, float] | None = None,
    **overrides: Any,
) -> list[dict[str, Any]]:
    """One parameter group per layer role, each with its norm.

    Roles, decided per trainable parameter (shared parameters once):

    - ``"embedding"``: weights of :class:`~torch.nn.Embedding` → ``colnorm`` with
      ``norm_kwargs={"transpose": True}``
      (the weight is ``(vocab, dim)``: each token's vector is one column of the linear map);
    - ``"head"``: the weight of the output head → ``sign``. The head is the module named ``head``
      if given, else the last module whose name ends in one of ``head_names`` and has a 2-D
      weight, else the last :class:`~torch.nn.Linear` of the model;
    - ``"conv"``: weights with three or more dimensions (convolutions) → ``spectral_conv``;
    - ``"hidden"``: the other 2-D weights → ``spectral``;
    - ``"vector"``: 0-D and 1-D tensors (biases, norm gains, the head's bias) → ``rms``;
    - a module may claim the role of its own parameters with a ``geometry_role`` attribute:
      ANCRe's :class:`~ada_modules.nn.ConnectivityRouter` sets ``"routing"`` (its routing
      coefficients, a group of their own, never spectrally normed) → ``rms``.

    Args:
        model: The model.
        head: Qualified module name of the output head (``None``: found as described above).
        head_names: Last name components that mark a head.
        norms: Norm per role, replacing the defaults (a name or a :class:`~ada_modules.optim.lmo.Norm`).
        radii: ``radius`` per role (Scion's ``rho``; the clip in AcceleGrad#'s ``"lmo"`` geometry).
        **overrides: Keys added to every group (e.g. ``lr``).

    Returns:
        Non-empty groups in the order of :data:`ROLES`, each with ``params``, ``param_names``,
        ``norm`` (a name, so that optimizer state dicts stay plain data), ``norm_kwargs`` (the
        default norm's options, else ``None``), ``role`` and ``radius`` when given in ``radii``.

    Raises:
        ValueError: If ``head`` names no module, a role or norm name is unknown, or
            ``overrides`` sets ``params``/``norm``.

    Examples:
        >>> import torch
        >>> from ada_modules.optim.accelegrad_sharp import AcceleGradSharp
        >>> class TinyLM(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = nn.Embedding(50, 16)
        ...         self.block = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        ...         self.lm_head = nn.Linear(16, 50, bias=False)
        >>> groups = geometry_param_groups(TinyLM(), radii={"head": 50.0})
        >>> [(g["role"], len(g["params"])) for g in groups]
        [('embedding', 1), ('hidden', 4), ('vector', 8), ('head', 1)]
        >>> groups[0]["norm"], groups[0]["norm_kwargs"], groups[-1]["norm"], groups[-1]["radius"]
        ('colnorm', {'transpose': True}, 'sign', 50.0)
        >>> opt = AcceleGradSharp(groups, lr=0.01)
    """
    for key in ("params", "norm", "norm_kwargs", "param_names", "role"):
        if key in overrides:
            raise InputError(f"overrides must not set {key!r}; it is decided per role")
    role_norms: dict[Role, str | Norm] = dict(DEFAULT_ROLE_NORMS)
    role_kwargs: dict[Role, dict[str, Any] | None] = dict(DEFAULT_ROLE_NORM_KWARGS)
    for role, norm in (norms or {}).items():
        _check_role(role)
        if not isinstance(norm, Norm) and norm not in NORM_NAMES:
            raise InputError(f"unknown norm {norm!r} for role {role!r}; allowed: {NORM_NAMES}")
        role_norms[role] = norm
        role_kwargs[role] = None
    check_radii(radii)

    modules = dict(model.named_modules())
    head_module = _find_head(modules, head, tuple(head_names))
    buckets: dict[Role, list[tuple[str, nn.Parameter]]] = {role: [] for role in ROLES}
    seen: set[int] = set()
    for mod_name, module in modules.items():
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            role = getattr(module, "geometry_role", None) or _role(module, p, head_module)
            _check_role(role)
            buckets[role].append((full, p))

    groups = []
    for role in ROLES:
        if not buckets[role]:
            continue
        group: dict[str, Any] = {
            "params": [p for _, p in buckets[role]],
            "param_names": [n for n, _ in buckets[role]],
            "norm": role_norms[role],
            "norm_kwargs": role_kwargs.get(role),
            "role": role,
            **overrides,
        }
        if radii and role in radii:
            group["radius"] = radii[role]
        groups.append(group)
    return groups


def weight_decay_param_groups(module: nn.Module) -> list[dict[str, Any]]:
    """Two groups of ``module``'s trainable parameters: matrices (decayed) and the rest (not).

    The usual AdamW recipe: weight decay on weights of 2 or more dimensions, none on biases,
    norms and other vectors, nor on the parameters a submodule names in its ``no_weight_decay()``
    (the timm convention: names relative to that submodule; e.g. the stream-mixing matrices of
    :class:`~ada_modules.nn.StreamsWrapper`).

    Examples:
        >>> decay, no_decay = weight_decay_param_groups(nn.Linear(4, 3))
        >>> [p.shape for p in decay["params"]], no_decay["weight_decay"]
        ([torch.Size([3, 4])], 0.0)
    """
    kept = _no_weight_decay_ids(module)
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 and id(param) not in kept else no_decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _no_weight_decay_ids(module: nn.Module) -> set[int]:
    """``id`` of every parameter that a submodule of ``module`` names in ``no_weight_decay()``."""
    ids = set()
    for submodule in module.modules():
        names = getattr(submodule, "no_weight_decay", None)
        if not callable(names):
            continue
        for name in names():
            try:
                ids.add(id(submodule.get_parameter(name)))
            except AttributeError:
                continue  # a name that is not a parameter of this submodule (e.g. a buffer)
    return ids


def split_param_groups(
    groups: list[dict[str, Any]], selected: Iterable[nn.Parameter]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split every group into its ``selected`` parameters and the others, keeping group options.

    The "Muon for the hidden matrices, AdamW for the rest" recipe: build the groups once, split
    them, give each part its own optimizer and chain them with
    :class:`~ada_modules.optim.chain.OptimizerChain`. Empty parts are dropped; ``param_names``
    is split along with ``params``.

    Args:
        groups: Parameter groups (dicts with ``params`` and optional per-group options).
        selected: The parameters that go to the first part.

    Returns:
        ``(inside, outside)``: the groups restricted to the selected parameters, and to the rest.

    Examples:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        >>> groups = geometry_param_groups(model)
        >>> hidden = [p for g in groups if g["role"] == "hidden" for p in g["params"]]
        >>> inside, outside = split_param_groups(groups, hidden)
        >>> [g["role"] for g in inside], [g["role"] for g in outside]
        (['hidden'], ['vector', 'head'])
    """
    ids = {id(p) for p in selected}
    inside: list[dict[str, Any]] = []
    outside: list[dict[str, Any]] = []
    for group in groups:
        names = group.get("param_names")
        for target, keep in ((inside, True), (outside, False)):
            picked = [i for i, p in enumerate(group["params"]) if (id(p) in ids) == keep]
            if not picked:
                continue
            part = {**group, "params": [group["params"][i] for i in picked]}
            if names is not None:
                part["param_names"] = [names[i] for i in picked]
            target.append(part)
    return inside, outside


def check_radii(radii: Mapping[str, float] | None) -> None:
    """Raise ``InputError`` unless every key of ``radii`` is a role and every value is positive.

    Examples:
        >>> check_radii({"hidden": 3.0, "head": 10.0})
        >>> check_radii({"head": 0})
        Traceback (most recent call last):
        ...
        ada_modules.errors.InputError: radii['head'] must be a positive number, got 0
    """
    for role, radius in (radii or {}).items():
        if role not in ROLES:
            raise InputError(f"unknown role {role!r} in radii; allowed: {', '.join(ROLES)}")
        if isinstance(radius, bool) or not isinstance(radius, int | float) or radius <= 0:
            raise InputError(f"radii[{role!r}] must be a positive number, got {radius!r}")


def check_param_coverage(module: nn.Module, optimizer: Optimizer) -> None:
    """Raise ``InputError`` unless ``optimizer`` holds every trainable parameter of ``module`` once.

    Catches parameter groups built by hand or split between chained optimizers that forget a
    parameter (which then never trains) or list one twice (which then steps twice). The groups of
    an :class:`~ada_modules.optim.chain.OptimizerChain` are those of all its optimizers together
    (its ``param_groups``). Parameters are told apart by identity, so shared (tied) parameters
    count once; frozen parameters (``requires_grad=False``) need not be held, and parameters that
    are not the module's are allowed.

    Raises:
        InputError: Naming up to five missing parameters by qualified name, with how many are
            missing in all, and the parameters held more than once.

    Examples:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        >>> check_param_coverage(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> check_param_coverage(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
        Traceback (most recent call last):
        ...
        ada_modules.errors.InputError: the optimizer misses 2 of the 4 trainable parameters of the module: '1.weight', '1.bias'
    """
    names = {id(p): name for name, p in module.named_parameters()}
    trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    counts = Counter(id(p) for group in optimizer.param_groups for p in group["params"])
    shapes = {id(p): tuple(p.shape) for group in optimizer.param_groups for p in group["params"]}
    problems = []
    missing = [name for name, p in trainable if id(p) not in counts]
    if missing:
        listed = ", ".join(repr(name) for name in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        problems.append(
            f"the optimizer misses {len(missing)} of the {len(trainable)} trainable parameters "
            f"of the module: {listed}{more}"
        )
    twice = [
        f"{names[key]!r}"
        if key in names
        else f"a parameter of shape {shapes[key]} (not the module's)"
        for key, count in counts.items()
        if count > 1
    ]
    if twice:
        listed = ", ".join(twice[:5]) + (f" and {len(twice) - 5} more" if len(twice) > 5 else "")
        noun = "parameter" if len(twice) == 1 else "parameters"
        problems.append(
            f"the optimizer's parameter groups hold {len(twice)} {noun} more than once: {listed}"
        )
    if problems:
        raise InputError("; ".join(problems))


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise InputError(f"unknown role {role!r}; allowed: {', '.join(ROLES)}")


def _find_head(
    modules: dict[str, nn.Module], head: str | None, names: tuple[str, ...]
) -> nn.Module:
    if head is not None:
        if head not in modules:
            raise InputError(f"head={head!r} names no module of the model")
        return modules[head]
    named = [
        m
        for n, m in modules.items()
        if n.rsplit(".", 1)[-1] in names
        and getattr(m, "weight", None) is not None
        and m.weight.ndim == 2
    ]
    if named:
        return named[-1]
    linears = [m for m in modules.values() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else nn.Identity()


def _role(module: nn.Module, p: nn.Parameter, head: nn.Module) -> Role:
    if p.ndim <= 1:
        return "vector"
    if module is head and p is getattr(module, "weight", None):
        return "head"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "conv" if p.ndim >= 3 else "hidden"
