"""Trajectories of several time-dependent PDEs, for operator transformers (data for AOT-POT).

Every family lives on the periodic unit interval ``[0, 1)`` (unit square for 2D families, arrays
indexed ``[x, y]``), sampled at ``grid`` points ``j / grid`` per axis. A trajectory has ``frames``
snapshots ``frame_dt`` apart (frame 0 is the initial condition), its own coefficients, drawn
uniformly from :data:`PDE_PARAMETER_RANGES`, and a smooth random initial condition: the lowest
Fourier modes (wavenumbers up to 4 in 1D, up to 2 per axis in 2D, fewer on coarse grids) with
normal amplitudes damped as ``1 / |m|`` and uniform phases, zero mean, scaled to ``max|u0| = 1``
(Allen-Cahn: ``max|u0| ~ U[0.1, 0.5]``, else it saturates at +-1 within a few frames). The
``frame_dt`` (:data:`PDE_FRAME_DT`) make consecutive frames differ by about 5-30 % (relative L2;
median 5-16 % per family) while the dynamics stay smooth:

================  =================================  ========================================  ====
family            equation                           coefficients                              dt
================  =================================  ========================================  ====
``advection``     ``u_t + c u_x = 0``                ``|c| ~ U[0.5, 2]``, random sign          0.01
``diffusion``     ``u_t = nu u_xx``                  ``nu ~ U[0.01, 0.03]``                    0.05
``burgers``       ``u_t + u u_x = nu u_xx``          ``nu ~ U[0.02, 0.1]``                     0.02
``allen_cahn``    ``u_t = eps u_xx + u - u^3``       ``eps ~ U[0.001, 0.01]``                  0.2
``kdv``           ``u_t + u u_x + delta u_xxx = 0``  ``delta ~ U[0.0005, 0.002]``              0.02
``advection_2d``  ``u_t + cx u_x + cy u_y = 0``      speed ``U[0.5, 2]``, angle ``U[0, 2pi)``  0.01
``diffusion_2d``  ``u_t = nu (u_xx + u_yy)``         ``nu ~ U[0.01, 0.03]``                    0.05
================  =================================  ========================================  ====

The solvers are pseudo-spectral in float64 (``torch.fft``). Advection and diffusion are exact (a
phase shift and a decay per Fourier mode). Burgers, Allen-Cahn and KdV take integrating-factor RK4
steps (the linear part exact, the nonlinear part explicit with the 2/3 rule, which de-aliases
the quadratic terms exactly and Allen-Cahn's cubic term partly: its aliasing error is below 1e-4
at grid 64), as many per frame as a CFL-type bound on ``max|u|`` asks (at least 4). A solution
that turns non-finite or exceeds ``100 * max(1, max|u0|)`` raises :class:`PDEDivergenceError`; none is ever returned.
"""

import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import Dataset

from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError

__all__ = [
    "PDE_FAMILIES",
    "PDE_FRAME_DT",
    "PDE_PARAMETER_RANGES",
    "PDE_SPATIAL_DIMS",
    "PDEDataModule",
    "PDEDivergenceError",
    "PDETrajectories",
    "evolve_pde",
    "solve_pde",
]

_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")

PDE_FAMILIES: tuple[str, ...] = (
    "advection",
    "diffusion",
    "burgers",
    "allen_cahn",
    "kdv",
    "advection_2d",
    "diffusion_2d",
)
"""The PDE families, in the order of their integer labels."""

PDE_SPATIAL_DIMS: dict[str, int] = {f: 2 if f.endswith("_2d") else 1 for f in PDE_FAMILIES}
"""Spatial dimensions of each family (1 or 2)."""

PDE_FRAME_DT: dict[str, float] = dict(
    zip(PDE_FAMILIES, (0.01, 0.05, 0.02, 0.2, 0.02, 0.01, 0.05), strict=True)
)
"""Time between consecutive frames of each family (the table above)."""

PDE_PARAMETER_RANGES: dict[str, dict[str, tuple[float, float]]] = {
    "advection": {"speed": (0.5, 2.0)},
    "diffusion": {"nu": (0.01, 0.03)},
    "burgers": {"nu": (0.02, 0.1)},
    "allen_cahn": {"eps": (0.001, 0.01)},
    "kdv": {"delta": (0.0005, 0.002)},
    "advection_2d": {"speed": (0.5, 2.0), "angle": (0.0, 2 * math.pi)},
    "diffusion_2d": {"nu": (0.01, 0.03)},
}
"""Uniform sampling ranges of each family's coefficients (advection: ``c = +-speed``, 2D:
``(cx, cy) = speed * (cos angle, sin angle)``)."""

# The coefficients evolve_pde() takes ("nu" for the families not named).
_EQUATION_PARAMETERS = {"advection": ("c",), "advection_2d": ("cx", "cy")}
_EQUATION_PARAMETERS |= {"allen_cahn": ("eps",), "kdv": ("delta",)}
_EXACT = ("advection", "diffusion", "advection_2d", "diffusion_2d")
_CFL = 0.5  # substep <= _CFL / (max|u| * largest de-aliased wavenumber) (Burgers, KdV)
_REACTION_STEP = 0.1  # Allen-Cahn substep <= _REACTION_STEP / max(1, max|u|^2)
_MIN_SUBSTEPS = 4  # per frame, for accuracy where those bounds are loose
_BLOW_UP = 100.0  # diverged once max|u| exceeds this times max(1, max|u0|)
_MAX_MODE = {1: 4, 2: 2}  # highest wavenumber (per axis) of the initial conditions
_ALLEN_CAHN_AMPLITUDE = (0.1, 0.5)  # max|u0| of Allen-Cahn (1 for the other families)
_SPLITS = ("train", "val", "test")
_DEFAULT_FAMILIES = ("advection", "diffusion", "burgers", "allen_cahn")


class PDEDivergenceError(RuntimeError):
    """A solver produced non-finite or exploding values; the message names the family, the
    coefficients of the trajectory and the time interval."""


def _check_family(family: object) -> str:
    if family not in PDE_FAMILIES:
        raise InputError(f"family must be one of {', '.join(PDE_FAMILIES)}; got {family!r}")
    return family  # type: ignore[return-value]


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _check_grid(grid: object) -> int:
    if isinstance(grid, bool) or not isinstance(grid, int) or grid < 8 or grid % 2:
        raise InputError(
            f"grid must be an even integer >= 8 (powers of two are fastest), got {grid!r}"
        )
    return grid


def _one_thread(function: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``function`` with torch single-threaded: the tensors are small, and MKL's threaded
    ``rfft`` of a small batch was measured 1000x slower than one thread when another process kept
    the second core busy."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return function(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return wrapper


def _mix_seed(*values: int) -> int:
    """A 64-bit seed hashed from integers, so nearby inputs give unrelated streams."""
    entropy = [part for value in values for part in (int(value < 0), abs(int(value)))]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0])


def _spectral(grid: int, dims: int) -> tuple[torch.Tensor, ...]:
    """``kx``, ``ky`` (angular wavenumbers of ``rfftn``, Nyquist zeroed as odd derivatives want;
    ``ky`` is ``kx`` in 1D), ``|k|^2`` and the 2/3-rule mask, broadcastable to the spectrum."""
    m_last = torch.arange(grid // 2 + 1, dtype=torch.float64)
    m_first = torch.fft.fftfreq(grid, 1.0 / grid, dtype=torch.float64)
    keep = (grid - 1) // 3  # a product of two fields with |m| <= keep aliases only above keep
    axes = [m_last] if dims == 1 else [m_first[:, None], m_last[None, :]]
    odd = [2 * math.pi * torch.where(m.abs() == grid // 2, 0.0, m) for m in axes]
    ksq = sum((2 * math.pi * m) ** 2 for m in axes)
    mask = functools.reduce(torch.logical_and, [m.abs() <= keep for m in axes]).double()
    return odd[0], odd[-1], ksq, mask


def _coefficients(family: str, params: Mapping[str, object], n: int) -> dict[str, torch.Tensor]:
    names = _EQUATION_PARAMETERS.get(family, ("nu",))
    if not isinstance(params, Mapping) or set(params) != set(names):
        got = sorted(params) if isinstance(params, Mapping) else params
        raise InputError(
            f"params of {family} must have exactly the keys {list(names)}, got {got!r}"
        )
    out = {}
    for name in names:
        value = torch.as_tensor(params[name], dtype=torch.float64).reshape(-1)
        if value.numel() not in (1, n) or not torch.isfinite(value).all():
            raise InputError(
                f"params[{name!r}] of {family} must be finite, one number or {n} (one per "
                f"trajectory), got {params[name]!r}"
            )
        if name in ("nu", "eps") and (value < 0).any():
            raise InputError(f"params[{name!r}] of {family} must be >= 0, got {params[name]!r}")
        out[name] = value.expand(n).clone()
    return out


def _linear(family: str, p: dict[str, torch.Tensor], spec: tuple, dims: int) -> torch.Tensor:
    """``L`` of ``u_hat_t = L u_hat + N(u)``, complex, ``(N, *spectrum)``."""
    kx, ky, ksq, _ = spec
    col = {name: value.reshape(-1, *([1] * dims)) for name, value in p.items()}
    if family == "advection":
        return -1j * col["c"] * kx
    if family == "advection_2d":
        return -1j * (col["cx"] * kx + col["cy"] * ky)
    if family == "allen_cahn":
        return (1.0 - col["eps"] * ksq).to(torch.complex128)
    if family == "kdv":
        return 1j * col["delta"] * kx**3  # -delta (ik)^3
    return (-col["nu"] * ksq).to(torch.complex128)  # diffusion, diffusion_2d, burgers


def _nonlinear(family: str, u_hat: torch.Tensor, spec: tuple, grid: int) -> torch.Tensor:
    """``N(u)`` of the 1D nonlinear families, de-aliased, in Fourier space."""
    k, _, _, mask = spec
    u = torch.fft.irfft(u_hat * mask, n=grid)
    if family == "allen_cahn":
        return -mask * torch.fft.rfft(u**3)
    return -0.5j * k * mask * torch.fft.rfft(u * u)  # burgers, kdv: -(u^2 / 2)_x


def _substep(family: str, u_max: float, grid: int) -> float:
    """Longest substep the explicit part takes at the current ``max|u|``."""
    if family == "allen_cahn":
        return _REACTION_STEP / max(1.0, u_max**2)
    return _CFL / max(u_max * 2 * math.pi * ((grid - 1) // 3), 1e-12)


@_one_thread
def evolve_pde(
    family: str,
    u0: torch.Tensor,
    params: Mapping[str, float | torch.Tensor],
    times: Sequence[float] | torch.Tensor,
    max_step: float | None = None,
) -> torch.Tensor:
    """Solve one family from given initial conditions and coefficients (under :func:`solve_pde`).

    Args:
        family: One of :data:`PDE_FAMILIES`.
        u0: Initial conditions, ``(N, grid)`` (1D) or ``(N, grid, grid)`` (2D), ``grid`` even and
            >= 8, on the periodic unit interval (square).
        params: The coefficients, one number or ``N`` values each: ``c`` (advection), ``cx`` and
            ``cy`` (advection_2d), ``eps`` (allen_cahn), ``delta`` (kdv), ``nu`` (the others).
        times: Non-decreasing output times >= 0 (``u0`` is the state at time 0).
        max_step: Longest RK4 substep (burgers, allen_cahn, kdv; the exact families ignore it).
            ``None`` bounds it by the CFL-type rule of the module; a number replaces that rule.

    Returns:
        ``float64`` tensor ``(N, len(times), *u0.shape[1:])``.

    Raises:
        ValueError: If an argument is out of range, naming the argument.
        PDEDivergenceError: If the solution turns non-finite or exceeds ``100 * max(1, max|u0|)``.

    Examples:
        >>> x = torch.arange(16, dtype=torch.float64) / 16
        >>> u = evolve_pde("advection", torch.sin(2 * math.pi * x)[None], {"c": 0.25}, [0, 1])
        >>> torch.allclose(u[0, 1], torch.sin(2 * math.pi * (x - 0.25)))
        True
    """
    dims = PDE_SPATIAL_DIMS[_check_family(family)]
    if not isinstance(u0, torch.Tensor) or u0.dim() != dims + 1 or len(set(u0.shape[1:])) != 1:
        shape = tuple(u0.shape) if isinstance(u0, torch.Tensor) else type(u0).__name__
        raise InputError(f"u0 of {family} must be a tensor (N{', grid' * dims}), got {shape}")
    grid = _check_grid(u0.shape[-1])
    if u0.shape[0] < 1 or not torch.isfinite(u0).all():
        raise InputError(f"u0 of {family} must be finite and hold N >= 1 fields")
    t = torch.as_tensor(times, dtype=torch.float64).reshape(-1)
    if t.numel() < 1 or not torch.isfinite(t).all() or (t < 0).any() or (t.diff() < 0).any():
        raise InputError(f"times must be finite, >= 0 and non-decreasing, got {times!r}")
    if max_step is not None and (
        isinstance(max_step, bool) or not isinstance(max_step, int | float) or not max_step > 0
    ):
        raise InputError(f"max_step must be None or a number > 0, got {max_step!r}")
    p = _coefficients(family, params, u0.shape[0])
    spec = _spectral(grid, dims)
    lin = _linear(family, p, spec, dims)
    axes = tuple(range(-dims, 0))
    u_hat = torch.fft.rfftn(u0.to(torch.float64), dim=axes)
    if family in _EXACT:
        exact = [torch.fft.irfftn(u_hat * torch.exp(lin * s), s=u0.shape[1:], dim=axes) for s in t]
        return torch.stack(exact, dim=1)
    limit = _BLOW_UP * max(1.0, float(u0.abs().max()))
    frames, now, u = [], 0.0, u0.to(torch.float64)
    for target in t.tolist():
        if target > now:  # integrating-factor (Lawson) RK4 substeps from now to target
            span = target - now
            bound = max_step or _substep(family, float(u.abs().max()), grid)
            steps = max(_MIN_SUBSTEPS if max_step is None else 1, math.ceil(span / bound))
            h = span / steps
            half, full = torch.exp(lin * (h / 2)), torch.exp(lin * h)
            for _ in range(steps):
                a = _nonlinear(family, u_hat, spec, grid)
                b = _nonlinear(family, half * (u_hat + h / 2 * a), spec, grid)
                c = _nonlinear(family, half * u_hat + h / 2 * b, spec, grid)
                d = _nonlinear(family, full * u_hat + h * half * c, spec, grid)
                u_hat = full * u_hat + h / 6 * (full * a + 2 * half * (b + c) + d)
            u = torch.fft.irfft(u_hat, n=grid)
            worst = torch.nan_to_num(u.abs(), nan=math.inf).amax(dim=-1)
            if (worst > limit).any():
                i = int(worst.argmax())
                values = ", ".join(f"{name}={float(v[i]):.6g}" for name, v in p.items())
                raise PDEDivergenceError(
                    f"the {family} solver diverged (max|u| = {float(worst[i]):.3g} > {limit:.3g}) "
                    f"between t={now:.6g} and t={target:.6g} in trajectory {i} with {values} "
                    f"({steps} substeps of {h:.3g}; sampled ranges {PDE_PARAMETER_RANGES[family]})"
                )
            now = target
        frames.append(u)
    return torch.stack(frames, dim=1)


def _initial_conditions(family: str, n: int, grid: int, gen: torch.Generator) -> torch.Tensor:
    """Random sums of the lowest Fourier modes, zero mean, ``max|u0|`` 1 (Allen-Cahn: random)."""
    dims = PDE_SPATIAL_DIMS[family]
    top = min(_MAX_MODE[dims], grid // 4)
    axis = torch.arange(-top, top + 1, dtype=torch.float64)
    if dims == 1:
        modes = axis[axis > 0][:, None]
    else:  # one of each pair +-(mx, my)
        mx, my = torch.meshgrid(axis, axis, indexing="ij")
        half = (mx > 0) | ((mx == 0) & (my > 0))
        modes = torch.stack([mx[half], my[half]], dim=1)
    amplitude = torch.randn(n, len(modes), generator=gen, dtype=torch.float64) / modes.norm(dim=1)
    phase = 2 * math.pi * torch.rand(n, len(modes), generator=gen, dtype=torch.float64)
    x = torch.arange(grid, dtype=torch.float64) / grid
    points = torch.stack(torch.meshgrid(*([x] * dims), indexing="ij"), dim=-1).reshape(-1, dims)
    angle = 2 * math.pi * points @ modes.T  # (grid**dims, modes)
    # a sin(angle + phase) = a cos(phase) sin(angle) + a sin(phase) cos(angle)
    u = (amplitude * phase.cos()) @ angle.sin().T + (amplitude * phase.sin()) @ angle.cos().T
    scale = 1 / u.abs().amax(dim=1)
    if family == "allen_cahn":
        low, high = _ALLEN_CAHN_AMPLITUDE
        scale = scale * (low + (high - low) * torch.rand(n, generator=gen, dtype=torch.float64))
    return (u * scale[:, None]).reshape(n, *([grid] * dims))


def _sample_coefficients(family: str, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    draws = {
        name: low + (high - low) * torch.rand(n, generator=gen, dtype=torch.float64)
        for name, (low, high) in PDE_PARAMETER_RANGES[family].items()
    }
    if family == "advection":
        return {"c": torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0) * draws["speed"]}
    if family == "advection_2d":
        speed, angle = draws["speed"], draws["angle"]
        return {"cx": speed * torch.cos(angle), "cy": speed * torch.sin(angle)}
    return draws


@_one_thread
def solve_pde(
    family: str,
    num_trajectories: int,
    grid: int = 64,
    frames: int = 20,
    seed: int | torch.Generator = 0,
    return_parameters: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Trajectories of one family from random coefficients and initial conditions (see the
    module's table).

    Args:
        family: One of :data:`PDE_FAMILIES`.
        num_trajectories: Number of trajectories ``N``, >= 1.
        grid: Points per axis, an even integer >= 8.
        frames: Snapshots per trajectory, >= 2, :data:`PDE_FRAME_DT` apart (frame 0 is ``u0``).
        seed: An integer (mixed with the family's index, so families differ under one seed) or a
            ``torch.Generator`` to draw from. Equal seeds give equal tensors.
        return_parameters: Also return the coefficients (:func:`evolve_pde`'s ``params``, ``(N,)``).

    Returns:
        ``float32`` tensor ``(N, frames, 1, grid)`` (1D) or ``(N, frames, 1, grid, grid)`` (2D),
        with the coefficients when ``return_parameters``.

    Raises:
        ValueError: If an argument is out of range, naming the argument.
        PDEDivergenceError: If a solver diverges (non-finite trajectories are never returned).

    Examples:
        >>> u = solve_pde("burgers", num_trajectories=3, grid=32, frames=5, seed=0)
        >>> tuple(u.shape), u.dtype, torch.equal(u, solve_pde("burgers", 3, 32, 5, seed=0))
        ((3, 5, 1, 32), torch.float32, True)
    """
    _check_family(family)
    _check_int("num_trajectories", num_trajectories, 1)
    _check_grid(grid)
    _check_int("frames", frames, 2)
    if isinstance(seed, torch.Generator):
        gen = seed
    elif isinstance(seed, int) and not isinstance(seed, bool):
        gen = torch.Generator().manual_seed(_mix_seed(seed, PDE_FAMILIES.index(family)))
    else:
        raise InputError(f"seed must be an integer or a torch.Generator, got {seed!r}")
    params = _sample_coefficients(family, num_trajectories, gen)
    u0 = _initial_conditions(family, num_trajectories, grid, gen)
    times = PDE_FRAME_DT[family] * torch.arange(frames, dtype=torch.float64)
    u = evolve_pde(family, u0, params, times).unsqueeze(2).to(torch.float32)
    if not torch.isfinite(u).all():  # evolve_pde bounds max|u|: a float32 overflow guard
        raise PDEDivergenceError(f"the {family} solver diverged: non-finite float32 values")
    return (u, params) if return_parameters else u


class PDETrajectories(Dataset):
    """Windows of consecutive frames cut from trajectories; item ``(frames, label)`` with
    ``frames`` ``float32`` ``(window, 1, *grid)`` and ``label`` a 0-d int64 tensor.

    Args:
        trajectories: ``(N, T, 1, grid)`` or ``(N, T, 1, grid, grid)`` (as from :func:`solve_pde`).
        labels: ``(N,)``, each trajectory's index in :data:`PDE_FAMILIES`.
        window: Frames per item, in ``[1, T]``.
        starts: ``"all"``: windows at every start ``0 .. T - window`` (item ``i`` is trajectory
            ``i // (T - window + 1)``); ``"first"``: one window per trajectory, from frame 0.

    Examples:
        >>> data = PDETrajectories(torch.zeros(2, 6, 1, 8), torch.tensor([0, 2]), window=3)
        >>> len(data), tuple(data[5][0].shape), int(data[5][1])
        (8, (3, 1, 8), 2)
    """

    def __init__(
        self, trajectories: torch.Tensor, labels: torch.Tensor, window: int, starts: str = "all"
    ) -> None:
        shape = getattr(trajectories, "shape", type(trajectories).__name__)
        if (
            not isinstance(trajectories, torch.Tensor)
            or trajectories.dim() not in (4, 5)
            or (shape[2] != 1)
        ):
            raise InputError(f"trajectories must be a tensor (N, T, 1, *grid), got {shape}")
        n, total = shape[:2]
        if not isinstance(labels, torch.Tensor) or labels.shape != (n,):
            raise InputError(f"labels must be a tensor ({n},), got {labels!r}")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= total:
            raise InputError(f"window must be an integer in [1, {total}], got {window!r}")
        if starts not in ("all", "first"):
            raise InputError(f"starts must be 'all' or 'first', got {starts!r}")
        self.trajectories = trajectories.to(torch.float32)
        self.labels = labels.to(torch.int64)
        self.window = window
        self.starts_per_trajectory = total - window + 1 if starts == "all" else 1

    def __len__(self) -> int:
        return len(self.labels) * self.starts_per_trajectory

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        trajectory, start = divmod(index % len(self), self.starts_per_trajectory)
        return self.trajectories[trajectory, start : start + self.window], self.labels[trajectory]


@functools.lru_cache(maxsize=2)
def _generate(
    families: tuple[str, ...], grid: int, frames: int, counts: tuple[int, ...], seed: int
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """Trajectories and labels of each split (each from its own seed), and the seconds taken."""
    began, splits = time.perf_counter(), {}
    for index, (split, count) in enumerate(zip(_SPLITS, counts, strict=True)):
        trajectories = [solve_pde(f, count, grid, frames, _mix_seed(seed, index)) for f in families]
        labels = [torch.full((count,), PDE_FAMILIES.index(f)) for f in families]
        splits[split] = (torch.cat(trajectories), torch.cat(labels))
    return splits, time.perf_counter() - began


class PDEDataModule(SplitDataModule):
    """Windows of trajectories of one PDE family (fine-tuning) or several (pre-training mixture).

    :meth:`setup` generates, per family, ``train_trajectories``, ``val_trajectories`` and
    ``test_trajectories`` trajectories with :func:`solve_pde`, each split from its own seed
    derived from ``seed`` (no trajectory is in two splits), and caches them in-process (equal
    arguments reuse them). Training items are windows of ``history + 1`` frames at every start
    time (next-frame prediction); validation and test items are one window of
    ``history + rollout`` frames per trajectory, from frame 0 (roll-out evaluation). Batches are
    ``(frames, labels)``: ``frames`` ``float32`` ``(batch, window, 1, grid)`` (1D) or
    ``(batch, window, 1, grid, grid)`` (2D), ``labels`` int64 ``(batch,)``, the family's index in
    :data:`PDE_FAMILIES` (per-family metrics; a classification head of :attr:`num_families`).

    Args:
        families: A family name (single-PDE data) or a list of them, all 1D or all 2D.
        grid: Points per axis, an even integer >= 8.
        frames: Frames per trajectory.
        history: Frames the model is given, >= 1.
        rollout: Frames predicted in evaluation, >= 1; ``history + rollout <= frames``.
        train_trajectories: Training trajectories per family.
        val_trajectories: Validation trajectories per family.
        test_trajectories: Test (and predict) trajectories per family.
        seed: Seed of the data and of the training shuffle. ``None`` takes the seed of
            ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset).
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Attributes:
        families: The families, a tuple; ``spatial_dims``: 1 or 2.
        generation_seconds: Wall time the generation took (set by :meth:`setup`).

    Raises:
        ValueError: If an argument is out of range, naming the argument.

    Examples:
        >>> dm = PDEDataModule(["burgers", "kdv"], grid=16, frames=8, history=3, rollout=4,
        ...     train_trajectories=4, val_trajectories=2, test_trajectories=2, seed=0)
        >>> dm.setup("fit")
        >>> frames, labels = next(iter(dm.val_dataloader()))
        >>> tuple(frames.shape), labels.tolist(), len(dm.datasets["train"])
        ((4, 7, 1, 16), [2, 2, 4, 4], 40)

        In YAML::

            data:
              class_path: ada_modules.data.PDEDataModule
              init_args: {families: [advection, diffusion, burgers, allen_cahn], grid: 64}
    """

    num_families = len(PDE_FAMILIES)

    def __init__(
        self,
        families: str | Sequence[str] = _DEFAULT_FAMILIES,
        grid: int = 64,
        frames: int = 20,
        history: int = 4,
        rollout: int = 5,
        train_trajectories: int = 256,
        val_trajectories: int = 32,
        test_trajectories: int = 64,
        seed: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seed, batch_size, eval_batch_size, num_workers)
        self.save_hyperparameters()  # in checkpoints: the data a model was trained on
        names = (families,) if isinstance(families, str) else families
        if not isinstance(names, Sequence) or not names or len(set(names)) != len(names):
            raise InputError(
                f"families must be a name or a list of distinct names, got {families!r}"
            )
        dims = {PDE_SPATIAL_DIMS[_check_family(family)] for family in names}
        if len(dims) > 1:
            raise InputError(f"families must be all 1D or all 2D, got {list(names)}")
        self.families, self.spatial_dims = tuple(names), dims.pop()
        self.grid = _check_grid(grid)
        self.frames = _check_int("frames", frames, 2)
        self.history = _check_int("history", history, 1)
        self.rollout = _check_int("rollout", rollout, 1)
        if history + rollout > frames:
            raise InputError(
                f"history + rollout must be <= frames, got {history} + {rollout} > {frames}"
            )
        self.counts = (
            _check_int("train_trajectories", train_trajectories, 1),
            _check_int("val_trajectories", val_trajectories, 1),
            _check_int("test_trajectories", test_trajectories, 1),
        )
        self.generation_seconds: float | None = None

    def setup(self, stage: str | None = None) -> None:
        """Generate (or reuse) the trajectories and cut the windows of all three splits."""
        if self.datasets:
            return
        hits = _generate.cache_info().hits
        splits, self.generation_seconds = _generate(
            self.families, self.grid, self.frames, self.counts, self.seed
        )
        _LOG.info(
            "PDEDataModule: %s trajectories of %s (%d per family, grid %d, %d frames; generated "
            "in %.2f s)",
            "reused cached" if _generate.cache_info().hits > hits else "generated",
            ", ".join(self.families),
            sum(self.counts),
            self.grid,
            self.frames,
            self.generation_seconds,
        )
        for split, (trajectories, labels) in splits.items():
            window = self.history + (1 if split == "train" else self.rollout)
            starts = "all" if split == "train" else "first"
            self.datasets[split] = PDETrajectories(trajectories, labels, window, starts)
