"""Convergence rates of AcceleGrad and AcceleGrad# against GD, Nesterov and AdaGrad-norm (CPU).

Three convex problems, each deterministic from a seed (seeds 0, 1, 2; mean ± std over seeds):

1. **Quadratic** ``½ xᵀAx − bᵀx``, ``d = 500``, eigenvalues ``i⁻²`` in a random orthogonal basis,
   initial error spread evenly over ``log λ`` (:func:`ada_modules.optim.convex_problems.
   spectral_quadratic`; its docstring derives the expected slopes: ``−1`` for GD, ``−2`` for an
   accelerated method while ``k ≲ d``, steeper after ``k ≈ d = 1/√μ``).
2. **Logistic regression**, ``n = 5000``, ``d = 200``, no ridge, feature ``j`` scaled by ``j^{-1/2}``
   (ill-conditioned), labels drawn from a logistic teacher. ``f*`` comes from damped Newton to a
   gradient norm below ``1e-13``. Full gradients, and mini-batches of 64 (sampled with replacement).
3. **Matrix least squares** ``½‖XW − Y‖²_F``, ``W ∈ ℝ^{64×64}``, ``X ∈ ℝ^{256×64}`` with singular
   values log-spaced from 1 to ``1e-3`` (condition number 1e3), consistent targets ``Y = XW*``
   (``f* = 0``; with noise, ``‖W*‖`` would be dominated by noise amplified 1e3-fold). Euclidean
   AcceleGrad against AcceleGrad#'s spectral branches, each at its best ``D`` of a grid spanning
   ``R/100`` (the per-coordinate scale a diagonal anchor wants, ``R/√4096``) to ``3R``.

Methods: GD (step ``1/L``, last iterate), Nesterov's AGD for smooth convex functions (known ``L``,
momentum ``k/(k+3)``, last iterate), AdaGrad-norm (``x ← x − 2D g/√(G0² + Σ‖g‖²)``: AcceleGrad's own
step-size rule without the coupling, so "same ``D``" means the same rule; last iterate), the
library's :class:`~ada_modules.optim.AcceleGrad` (weighted average ``ȳ``) and
:class:`~ada_modules.optim.AcceleGradSharp` in the AcceleGrad-equivalent setting (scalar anchor,
Euclidean sharp step, average output) and in its default setting (diagonal anchor, clipped LMO,
automatic norm, last iterate). The adaptive methods get ``D = ‖x₀ − x*‖`` (a distance, never ``L``);
on the quadratic also ``D/4`` and ``4D``.

Columns: the fitted slope of ``log(f − f*)`` on ``log k`` at 40 log-spaced ``k`` in
``[100, K]`` (and ``[10, 250]`` on the quadratic, the regime ``k < d/2`` where the ``1/k²`` shape is
cleanest), the final suboptimality at ``K``, and on logistic regression the first iteration (checked
every 10) at which ``f − f* ≤ 1e-4``. Stochastic runs add the ratio of the final suboptimality to
AdaGrad-norm's at the same ``D``, the largest gap met on the way (relative to the starting gap:
with ``D = R`` the first steps of every adaptive method overshoot), and a divergence count (seeds
whose final gap is not finite or not below the starting gap).

4. **Optimizer cost** relative to AdamW on the networks of the sweeps (the digits MLPs
   64-128-128-10 and 64-1024-1024-10, and the tiny LM of ``repro_lm.yaml``): time of
   ``optimizer.step()`` alone (mean over 200 steps after 20 warm-up steps; 50 with ``--quick``,
   which also skips the wide MLP), and state memory = bytes of the tensors in ``optimizer.state``
   ÷ bytes of the parameters.

Runs on one thread (``torch.set_num_threads(1)``): the problems are small and on a shared 2-core
machine a second thread makes them several times slower.

Writes ``accelegrad_sharp.json`` (every number, per seed) and ``accelegrad_sharp.png`` (log–log
suboptimality, seed 0) to ``--out``. Reports only; no assertion on the numbers.
"""

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

import matplotlib
import torch
from torch import Tensor

from ada_modules.models import CausalLMModule
from ada_modules.models.classifier import ImageClassifierModule
from ada_modules.optim import lmo
from ada_modules.optim.accelegrad import AcceleGrad
from ada_modules.optim.accelegrad_sharp import AcceleGradSharp
from ada_modules.optim.convex_problems import (
    log_spaced_iterations,
    loglog_slope,
    spectral_quadratic,
    trace_gaps,
)
from ada_modules.optim.newton_schulz import newton_schulz
from ada_modules.optim.scion import Scion

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after selecting the non-interactive backend)

DTYPE = torch.float64
THRESHOLD = 1e-4
BATCH = 64
PER_COORDINATE = "AcceleGrad#(default: diag,lmo), D = R/√d"


@dataclass(frozen=True)
class Problem:
    """A convex problem seen through its oracles; ``gap`` is ``f(x) − f*`` without cancellation."""

    x0: Tensor
    x_star: Tensor
    smoothness: float
    grad: Callable[[Tensor], Tensor]
    gap: Callable[[Tensor], float]
    batch_grad: Callable[[Tensor, torch.Generator], Tensor] | None = None

    @property
    def distance(self) -> float:
        """``R = ‖x₀ − x*‖``, the ``D`` given to the adaptive methods."""
        return float(torch.linalg.vector_norm(self.x0 - self.x_star))


def quadratic(seed: int, dim: int = 500) -> Problem:
    """Problem 1 of the module docstring (rotated eigenbasis, so diagonal anchors get no help)."""
    q = spectral_quadratic(dim, seed=seed, rotate=True, dtype=DTYPE)
    return Problem(q.x0, q.x_star, q.smoothness, q.grad, q.gap)


def logistic(seed: int, n: int = 5000, dim: int = 200) -> Problem:
    """Problem 2: mean logistic loss of ``w`` on ``n`` synthetic examples, ``f*`` by Newton."""
    gen = torch.Generator().manual_seed(1000 + seed)
    z = torch.randn(n, dim, generator=gen, dtype=DTYPE)
    teacher = torch.randn(dim, generator=gen, dtype=DTYPE)
    teacher = 3.0 * teacher / teacher.norm()
    labels = torch.rand(n, generator=gen, dtype=DTYPE) < torch.sigmoid(z @ teacher)
    features = z * torch.arange(1, dim + 1, dtype=DTYPE).rsqrt()
    signed = torch.where(labels, 1.0, -1.0).to(DTYPE)[:, None] * features  # rows y_i a_i

    def loss(w: Tensor) -> float:
        return float(torch.nn.functional.softplus(-(signed @ w)).mean())

    def grad(w: Tensor) -> Tensor:
        return -(signed.T @ torch.sigmoid(-(signed @ w))) / n

    def batch_grad(w: Tensor, g: torch.Generator) -> Tensor:
        rows = signed[torch.randint(n, (BATCH,), generator=g)]
        return -(rows.T @ torch.sigmoid(-(rows @ w))) / BATCH

    w_star = torch.zeros(dim, dtype=DTYPE)
    for _ in range(100):  # damped Newton with Armijo backtracking
        g = grad(w_star)
        if float(g.norm()) < 1e-13:
            break
        s = torch.sigmoid(signed @ w_star)
        hessian = (signed.T * (s * (1 - s))) @ signed / n
        direction = torch.linalg.solve(hessian, g)
        decrement, f0, t = float(g @ direction), loss(w_star), 1.0
        while loss(w_star - t * direction) > f0 - 0.25 * t * decrement and t > 1e-10:
            t *= 0.5
        w_star = w_star - t * direction
    f_star = loss(w_star)
    smoothness = float(torch.linalg.eigvalsh(signed.T @ signed / n).max()) / 4
    return Problem(
        torch.zeros(dim, dtype=DTYPE),
        w_star,
        smoothness,
        grad,
        lambda w: loss(w) - f_star,
        batch_grad,
    )


def matrix_least_squares(seed: int, n: int = 256, dim: int = 64) -> Problem:
    """Problem 3: ``½‖XW − XW*‖²_F`` with ``cond(X) = 1e3`` (``L = 1``)."""
    gen = torch.Generator().manual_seed(2000 + seed)
    left, _ = torch.linalg.qr(torch.randn(n, dim, generator=gen, dtype=DTYPE))
    right, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=DTYPE))
    singular = torch.logspace(0, -3, dim, dtype=DTYPE)
    x = (left * singular) @ right.T
    w_star = torch.randn(dim, dim, generator=gen, dtype=DTYPE) / math.sqrt(dim)
    y = x @ w_star

    def grad(w: Tensor) -> Tensor:
        return x.T @ (x @ w - y)

    def gap(w: Tensor) -> float:
        return 0.5 * float((x @ (w - w_star)).pow(2).sum())

    return Problem(torch.zeros(dim, dim, dtype=DTYPE), w_star, 1.0, grad, gap)


def run(
    method: str, problem: Problem, lr: float, checkpoints: list[int], seed: int | None
) -> list[float]:
    """Gaps of ``method``'s reported point at ``checkpoints``; mini-batches when ``seed`` is set."""
    gen = None if seed is None else torch.Generator().manual_seed(3000 + seed)

    def oracle(x: Tensor) -> Tensor:
        if gen is None:
            return problem.grad(x)
        assert problem.batch_grad is not None
        return problem.batch_grad(x, gen)

    x = problem.x0.clone()
    if method == "GD":

        def step() -> None:
            x.sub_(oracle(x), alpha=1 / problem.smoothness)

        return trace_gaps(step, lambda: problem.gap(x), checkpoints)
    if method == "Nesterov":
        y = x.clone()
        k = [0]

        def step() -> None:
            y_next = x - oracle(x) / problem.smoothness
            x.copy_(y_next + k[0] / (k[0] + 3) * (y_next - y))
            y.copy_(y_next)
            k[0] += 1

        return trace_gaps(step, lambda: problem.gap(y), checkpoints)
    if method == "AdaGrad-norm":
        sumsq = [0.0]

        def step() -> None:
            g = oracle(x)
            sumsq[0] += float(g.pow(2).sum())
            x.sub_(g, alpha=2 * lr / math.sqrt(1e-16 + sumsq[0]))

        return trace_gaps(step, lambda: problem.gap(x), checkpoints)
    p = x.requires_grad_(True)
    opt = make_library_optimizer(method, p, lr)

    def step() -> None:
        p.grad = oracle(p.detach())
        opt.step()

    def gap() -> float:
        swap = opt.swap_output("average") if isinstance(opt, AcceleGrad) else opt.swap_output()
        with swap:
            return problem.gap(p.detach())

    return trace_gaps(step, gap, checkpoints)


LIBRARY_METHODS: dict[str, dict[str, object]] = {
    "AcceleGrad#(scalar,sharp,euclid)": {
        "anchor": "scalar",
        "geometry": "sharp",
        "norm": "euclidean",
        "output": "average",
    },
    "AcceleGrad#(default: diag,lmo)": {},
    "AcceleGrad#(scalar,sharp,spectral)": {
        "anchor": "scalar",
        "geometry": "sharp",
        "norm": "spectral",
        "output": "average",
    },
    "AcceleGrad#(diag,lmo,spectral)": {"norm": "spectral"},
    "AcceleGrad#(scalar,lmo,spectral)": {
        "anchor": "scalar",
        "geometry": "lmo",
        "norm": "spectral",
        "output": "average",
    },
}


def ns_calls_per_step(method: str, problem: Problem, lr: float, steps: int = 10) -> float:
    """Newton–Schulz calls per optimizer step, counted by wrapping the one the norms call."""
    with mock.patch.object(lmo, "newton_schulz", wraps=newton_schulz) as counter:
        run(method, problem, lr, [steps], None)
    return counter.call_count / steps


def make_library_optimizer(method: str, p: Tensor, lr: float) -> AcceleGrad | AcceleGradSharp:
    """The library optimizer named ``method`` (``"AcceleGrad"`` or a key of LIBRARY_METHODS)."""
    if method == "AcceleGrad":
        return AcceleGrad([p], lr=lr)
    return AcceleGradSharp([p], lr=lr, **LIBRARY_METHODS[method])  # type: ignore[arg-type]


def summary(values: list[float], fmt: str) -> str:
    """``mean ± std`` over seeds; non-finite values are left out and flagged."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return "n/a" if not finite else f"{format(statistics.fmean(finite), fmt)} (some n/a)"
    if len(finite) == 1:
        return format(finite[0], fmt)
    return f"{format(statistics.fmean(finite), fmt)} ± {format(statistics.stdev(finite), fmt)}"


def first_below(checkpoints: list[int], gaps: list[float], level: float) -> int | None:
    """First checkpoint whose gap is at most ``level`` (``None``: never within the run)."""
    return next((k for k, g in zip(checkpoints, gaps, strict=True) if g <= level), None)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


COST_METHODS: dict[str, dict[str, object]] = {
    "AdamW": {"optimizer": partial(torch.optim.AdamW, lr=1e-3)},
    "SGD-momentum": {"optimizer": partial(torch.optim.SGD, lr=0.03, momentum=0.9)},
    "Muon (+AdamW)": {
        "optimizer": partial(torch.optim.Muon, lr=0.02),
        "aux_optimizer": partial(torch.optim.AdamW, lr=1e-3),
    },
    "Scion (geometry)": {"optimizer": partial(Scion, lr=0.01), "param_groups": "geometry"},
    "AcceleGrad": {"optimizer": partial(AcceleGrad, lr=1.0)},
    "AcceleGrad# (default)": {"optimizer": partial(AcceleGradSharp, lr=0.01)},
    "AcceleGrad# (geometry)": {
        "optimizer": partial(AcceleGradSharp, lr=0.01),
        "param_groups": "geometry",
    },
}


def mlp_task(hidden_sizes: list[int], kwargs: dict) -> tuple[torch.nn.Module, Callable[[], Tensor]]:
    """A digits MLP and a closure computing the loss of one fixed batch of 64."""
    module = ImageClassifierModule(hidden_sizes=hidden_sizes, **kwargs)
    x, y = torch.rand(64, 64), torch.randint(0, 10, (64,))
    return module, lambda: torch.nn.functional.cross_entropy(module(x), y)


def lm_task(kwargs: dict) -> tuple[torch.nn.Module, Callable[[], Tensor]]:
    """The tiny LM of ``repro_lm.yaml`` and a closure computing the loss of one batch of 32."""
    if kwargs.get("param_groups") != "geometry":
        kwargs = {**kwargs, "param_groups": "weight_decay"}
    module = CausalLMModule(
        hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256, **kwargs
    )
    ids = torch.randint(4, module.tokenizer.vocab_size, (32, 40))
    return module, lambda: module.model(input_ids=ids, labels=ids).loss


def optimizer_cost(
    task: Callable[[dict], tuple[torch.nn.Module, Callable[[], Tensor]]],
    kwargs: dict,
    steps: int,
    warmup: int = 20,
) -> tuple[float, float]:
    """Mean milliseconds of ``optimizer.step()`` and optimizer-state bytes ÷ parameter bytes."""
    torch.manual_seed(0)
    module, loss_fn = task(kwargs)
    config = module.configure_optimizers()
    optimizer = config["optimizer"] if isinstance(config, dict) else config
    elapsed = 0.0
    for i in range(steps + warmup):
        optimizer.zero_grad()
        loss_fn().backward()
        start = time.perf_counter()
        optimizer.step()
        elapsed += (time.perf_counter() - start) if i >= warmup else 0.0
    state_bytes = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return elapsed / steps * 1e3, state_bytes / param_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="K = 1000, matrix grid of 3 values")
    parser.add_argument("--out", type=Path, default=Path("bench_out/accelegrad_sharp"))
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    horizon = 1000 if args.quick else 3000
    seeds = list(range(args.seeds))
    log_points = log_spaced_iterations(horizon, 40)
    log_set = set(log_points)
    dense = sorted(set(log_points) | set(range(10, horizon + 1, 10)))
    start = time.perf_counter()
    print(
        f"# AcceleGrad# convex bench (K = {horizon}, seeds {seeds}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads)\n"
    )
    results: dict[str, object] = {"horizon": horizon, "seeds": seeds}
    curves: dict[str, dict[str, tuple[list[int], list[float]]]] = {}

    # 1. Quadratic.
    accelerated = [
        "AcceleGrad",
        "AcceleGrad#(scalar,sharp,euclid)",
        "AcceleGrad#(default: diag,lmo)",
    ]
    runs = [("GD", 1.0), ("Nesterov", 1.0)]
    runs += [(m, f) for f in (1.0, 0.25, 4.0) for m in ["AdaGrad-norm", *accelerated]]
    records: dict[str, list[list[float]]] = {}
    for seed in seeds:
        problem = quadratic(seed)
        for method, factor in runs:
            gaps = run(method, problem, factor * problem.distance, log_points, None)
            records.setdefault(f"{method}|{factor}", []).append(gaps)
            if seed == 0 and factor == 1.0:
                curves.setdefault("quadratic (d=500), D=‖x0−x*‖", {})[method] = (log_points, gaps)
    rows, quad = [], {}
    for key, all_gaps in records.items():
        method, factor = key.split("|")
        d_label = "—" if method in ("GD", "Nesterov") else f"{float(factor):g}·R"
        slopes = [loglog_slope(log_points, g, 100, horizon) for g in all_gaps]
        early = [loglog_slope(log_points, g, 10, 250) for g in all_gaps]
        finals = [g[-1] for g in all_gaps]
        quad[key] = {"slope": slopes, "slope_10_250": early, "final": finals}
        rows.append(
            [method, d_label, summary(slopes, ".2f"), summary(early, ".2f"), summary(finals, ".2e")]
        )
    results["quadratic"] = quad
    print("## Quadratic, d = 500, λ_i = i⁻², R = ‖x0 − x*‖\n")
    print(
        table(
            ["method", "D", f"slope k∈[100,{horizon}]", "slope k∈[10,250]", f"f − f* at {horizon}"],
            rows,
        )
    )

    # 2. Logistic regression, deterministic and stochastic.
    det_methods = ["GD", "Nesterov", "AdaGrad-norm", *accelerated]
    sto_methods = ["AdaGrad-norm", *accelerated, PER_COORDINATE]
    det: dict[str, dict[str, list]] = {
        m: {"slope": [], "final": [], "iters": []} for m in det_methods
    }
    sto: dict[str, dict[str, list]] = {
        m: {"final": [], "ratio": [], "peak": [], "diverged": []} for m in sto_methods
    }
    for seed in seeds:
        problem = logistic(seed)
        start_gap = problem.gap(problem.x0)
        for method in det_methods:
            gaps = run(method, problem, problem.distance, dense, None)
            logged = [g for k, g in zip(dense, gaps, strict=True) if k in log_set]
            det[method]["slope"].append(loglog_slope(log_points, logged, 100, horizon))
            det[method]["final"].append(gaps[-1])
            det[method]["iters"].append(first_below(dense, gaps, THRESHOLD))
            if seed == 0:
                curves.setdefault("logistic, full gradient", {})[method] = (dense, gaps)
        finals = {}
        for method in sto_methods:
            optimizer, lr = method, problem.distance
            if method == PER_COORDINATE:
                optimizer, lr = accelerated[-1], lr / math.sqrt(problem.x0.numel())
            gaps = run(optimizer, problem, lr, log_points, seed)
            finals[method] = gaps[-1]
            sto[method]["final"].append(gaps[-1])
            sto[method]["peak"].append(max(gaps) / start_gap)
            sto[method]["diverged"].append(not (math.isfinite(gaps[-1]) and gaps[-1] < start_gap))
            if seed == 0:
                curves.setdefault("logistic, batch 64", {})[method] = (log_points, gaps)
        for method in sto_methods:
            sto[method]["ratio"].append(finals[method] / finals["AdaGrad-norm"])
    results["logistic"] = det
    results["logistic_stochastic"] = sto
    rows = []
    for method in det_methods:
        iters = det[method]["iters"]
        rows.append(
            [
                method,
                summary(det[method]["slope"], ".2f"),
                summary(det[method]["final"], ".2e"),
                ", ".join(f"> {horizon}" if i is None else str(i) for i in iters),
            ]
        )
    print("\n## Logistic regression, n = 5000, d = 200, full gradients, D = ‖w*‖\n")
    print(
        table(
            [
                "method",
                f"slope k∈[100,{horizon}]",
                f"f − f* at {horizon}",
                "iterations to 1e-4 (per seed)",
            ],
            rows,
        )
    )
    rows = [
        [
            m,
            summary(sto[m]["final"], ".2e"),
            summary(sto[m]["ratio"], ".2f"),
            summary(sto[m]["peak"], ".1f"),
            str(sum(sto[m]["diverged"])),
        ]
        for m in sto_methods
    ]
    print(f"\n## Logistic regression, mini-batch {BATCH}, same D, no retuning\n")
    print(
        table(
            [
                "method",
                f"f − f* at {horizon}",
                "÷ AdaGrad-norm's",
                "peak gap ÷ start gap",
                "diverged (seeds)",
            ],
            rows,
        )
    )

    # 3. Matrix least squares: each method at its best D of the grid.
    grid = [0.01, 0.1, 1.0, 10.0] if args.quick else [0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0]
    ls_methods = [
        "AcceleGrad",
        "AcceleGrad#(scalar,sharp,spectral)",
        "AcceleGrad#(scalar,lmo,spectral)",
        "AcceleGrad#(diag,lmo,spectral)",
    ]
    ls: dict[str, dict[str, list]] = {}
    ls_points = log_spaced_iterations(horizon // 3, 30)
    problems = [matrix_least_squares(seed) for seed in seeds]
    for method in ls_methods:
        by_factor = {
            f: [run(method, pb, f * pb.distance, ls_points, None) for pb in problems] for f in grid
        }
        mean_log = {
            f: statistics.fmean(math.log(max(g[-1], 1e-300)) for g in gs)
            for f, gs in by_factor.items()
        }
        best = min(mean_log, key=lambda f: mean_log[f])
        ls[method] = {
            "best_factor": best,
            "final": [g[-1] for g in by_factor[best]],
            "grid_final_geomean": {str(f): math.exp(v) for f, v in mean_log.items()},
            "slope": [loglog_slope(ls_points, g, 30, horizon // 3) for g in by_factor[best]],
            "ns_calls_per_step": ns_calls_per_step(
                method, problems[0], best * problems[0].distance
            ),
        }
        curves.setdefault("matrix least squares, best D", {})[method] = (
            ls_points,
            by_factor[best][0],
        )
    results["matrix_least_squares"] = ls
    rows = [
        [
            m,
            f"{ls[m]['best_factor']:g}·R"
            + (" (grid edge)" if ls[m]["best_factor"] in (grid[0], grid[-1]) else ""),
            summary(ls[m]["final"], ".2e"),
            summary(ls[m]["slope"], ".2f"),
            f"{ls[m]['ns_calls_per_step']:g}",
            ", ".join(f"{float(f):g}: {v:.1e}" for f, v in ls[m]["grid_final_geomean"].items()),
        ]
        for m in ls_methods
    ]
    print(
        f"\n## Matrix least squares, W ∈ ℝ^64×64, cond(X) = 1e3, K = {horizon // 3}, "
        "R = ‖W0 − W*‖_F\n"
    )
    print(
        table(
            [
                "method",
                "best D",
                f"f − f* at {horizon // 3}",
                f"slope k∈[30,{horizon // 3}]",
                "NS calls/step",
                "geomean f − f* per D",
            ],
            rows,
        )
    )

    # 4. Optimizer cost relative to AdamW.
    cost_steps = 50 if args.quick else 200
    tasks = {"MLP 64-128-128-10 (digits sweep)": partial(mlp_task, [128, 128])}
    if not args.quick:
        tasks["MLP 64-1024-1024-10"] = partial(mlp_task, [1024, 1024])
    tasks["tiny LM 2x64 Llama (repro_lm.yaml), batch 32x40"] = lm_task
    costs: dict[str, dict[str, list[float]]] = {}
    for task_name, task in tasks.items():
        rows_cost = {m: optimizer_cost(task, kw, cost_steps) for m, kw in COST_METHODS.items()}
        costs[task_name] = {m: list(v) for m, v in rows_cost.items()}
        base_ms, base_state = rows_cost["AdamW"]
        print(f"\n## Optimizer cost, {task_name}, mean of {cost_steps} steps, one thread\n")
        print(
            table(
                ["method", "step (ms)", "step ÷ AdamW", "state ÷ params", "state ÷ AdamW"],
                [
                    [m, f"{ms:.3f}", f"{ms / base_ms:.2f}", f"{st:.2f}", f"{st / base_state:.2f}"]
                    for m, (ms, st) in rows_cost.items()
                ],
            )
        )
    results["optimizer_cost"] = costs

    elapsed = time.perf_counter() - start
    results["wall_seconds"] = elapsed
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accelegrad_sharp.json").write_text(json.dumps(results, indent=1))
    names = list(dict.fromkeys(m for lines in curves.values() for m in lines))
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4.6))
    for ax, (title, lines) in zip(axes, curves.items(), strict=True):
        for method, (ks, gaps) in lines.items():
            identical = method == "AcceleGrad#(scalar,sharp,euclid)"  # draws over AcceleGrad
            ax.loglog(
                ks,
                [max(g, 1e-16) for g in gaps],
                label=method,
                color=f"C{names.index(method)}",
                linestyle="--" if identical else "-",
            )
        ax.set_title(f"{title} (seed 0)", fontsize=9)
        ax.set_xlabel("iteration k")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("f − f* of the reported point")
    fig.tight_layout()
    fig.savefig(args.out / "accelegrad_sharp.png", dpi=110)
    print(f"\nwall time {elapsed:.1f} s; wrote {args.out}/accelegrad_sharp.json and .png")


if __name__ == "__main__":
    main()
