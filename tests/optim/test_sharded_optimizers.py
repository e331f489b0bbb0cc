"""The optimizers on FSDP2-sharded parameters (``DTensor``, ``Shard(0)``, 2 gloo ranks).

One forked pair of ranks runs every case (a module fixture); each test checks its part of the
results. Per optimizer, a sharded model and two unsharded twins take ``STEPS`` steps:

- *same gradients*: the first twin's ``.grad`` is the full sharded gradient, so only the
  optimizers' arithmetic can differ. Updates computed on full tensors or element-wise are bitwise
  equal; norms that each rank sums over its shard before an all-reduce (AcceleGrad's gradient
  norm, the projection of ``z``, the ``sign`` dual norm) are equal to rounding, hence the cases'
  ``INEXACT`` parameters are compared to a relative ``1e-6``;
- *end to end*: the second twin backpropagates the global batch itself (its loss is the mean of
  the ranks' losses), as a single-device run would.

Then a distributed-checkpoint round trip (``get_optimizer_state_dict`` → ``dcp.save`` → a fresh
model and optimizer, loaded as Lightning's ``ModelParallelStrategy`` loads them) must resume
bit for bit. Sizes are odd so that the shards are uneven (6 + 5 rows).
"""

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.distributed import run_ranks, set_rank_env
from torch import nn
from torch.nn import functional as F

from ada_modules.optim import (
    AcceleGrad,
    AcceleGradSharp,
    Muon,
    OptimizerChain,
    Scion,
    geometry_param_groups,
    split_param_groups,
    weight_decay_param_groups,
)
from ada_modules.optim.lmo import Norm, get_norm

WORLD_SIZE = 2
STEPS = 3
VOCAB, DIM, HIDDEN, BATCH, SEQ = 11, 8, 12, 4, 6
RTOL = 1e-6
HEAD = "6.weight"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, DIM),
        nn.LayerNorm(DIM),
        nn.Linear(DIM, HIDDEN),  # tall: transposed inside Newton–Schulz
        nn.GELU(),
        nn.Linear(HIDDEN, DIM),
        nn.LayerNorm(DIM),
        nn.Linear(DIM, VOCAB),  # the head (sign)
    )


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _muon_chain(model: nn.Module) -> OptimizerChain:
    """Muon on the hidden matrices, AdamW on the rest (``CausalLMModule``'s recipe)."""
    roles = geometry_param_groups(model)
    hidden = [p for g in roles if g["role"] == "hidden" for p in g["params"]]
    main, aux = split_param_groups(weight_decay_param_groups(model), hidden)
    return OptimizerChain([Muon(main, lr=0.02), torch.optim.AdamW(aux, lr=1e-2)])


CASES: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "accelegrad_sharp": lambda m: AcceleGradSharp(
        geometry_param_groups(m, radii={"head": 5.0}), lr=0.01, output="average"
    ),
    "accelegrad_sharp_scalar_sharp_proj": lambda m: AcceleGradSharp(
        geometry_param_groups(m), lr=0.01, anchor="scalar", geometry="sharp", proj_radius=3.0
    ),
    "scion": lambda m: Scion(geometry_param_groups(m, radii={"head": 5.0}), lr=0.05, momentum=0.5),
    "muon_chain": _muon_chain,
    "accelegrad": lambda m: AcceleGrad(m.parameters(), lr=0.1, proj_radius=3.0),
}
ALL = "all"
INEXACT: dict[str, set[str] | str] = {
    "accelegrad_sharp": {HEAD},  # the head group's step size uses the sign dual norm
    "accelegrad_sharp_scalar_sharp_proj": ALL,  # ‖z‖ for the projection
    "accelegrad": ALL,  # the group's gradient norm and ‖z‖
}
# Tensors gathered per step (Newton–Schulz, colnorm, rms): all but the sign head, or the two
# hidden matrices for Muon. No other collective than these and scalar all-reduces.
GATHERS = {
    "accelegrad_sharp": 10,
    "accelegrad_sharp_scalar_sharp_proj": 10,
    "scion": 10,
    "muon_chain": 2,
    "accelegrad": 0,
}
END_TO_END_ATOL = {"muon_chain": 1e-3}  # bfloat16 Newton–Schulz; float32 elsewhere: 1e-5

NORMS = [
    ("spectral", {}, (12, 8)),
    ("spectral", {}, (5, 12)),
    ("spectral", {}, (3, 6, 5)),
    ("spectral_conv", {}, (5, 2, 3, 3)),
    ("colnorm", {}, (11, 8)),
    ("colnorm", {"transpose": True}, (11, 8)),
    ("rownorm", {}, (11, 8)),
    ("rms", {}, (11,)),
    ("sign", {}, (11, 8)),
    ("euclidean", {}, (11, 8)),
]
NORM_OPS = ("lmo_and_dual", "lmo", "dual_norm", "sharp", "norm")
# Operations on the local shards (element-wise, or one scalar all-reduce); the others gather.
LOCAL_OPS = {("sign", op) for op in NORM_OPS} | {
    ("euclidean", op) for op in ("sharp", "dual_norm", "norm")
}
# Of those, the sums over shards: equal to rounding only.
SUMMED = {
    ("sign", "lmo_and_dual"),
    ("sign", "dual_norm"),
    ("sign", "sharp"),
    ("euclidean", "dual_norm"),
    ("euclidean", "norm"),
}


class _MaxEntry(Norm):
    """A norm defined outside the library: its methods see full tensors on ``DTensor``s."""

    name = "max_entry"

    def lmo_and_dual(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = torch.zeros_like(g).flatten()
        i = g.abs().argmax()
        flat[i] = -g.flatten()[i].sign()
        return flat.reshape(g.shape), g.abs().amax()

    def norm(self, v: torch.Tensor) -> torch.Tensor:
        return v.abs().sum()


def _shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """(bitwise equal, max abs difference relative to ``b``'s largest entry)."""
    scale = b.abs().max().clamp_min(1e-30).item()
    return torch.equal(a, b), (a - b).abs().max().item() / scale


def _tokens(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (WORLD_SIZE * BATCH, SEQ), generator=gen)


def _run_case(name: str, mesh, rank: int, tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    make = CASES[name]
    twin, e2e = _model(), _model()
    sharded = _shard(_model(), mesh)
    opt_twin, opt, opt_e2e = make(twin), make(sharded), make(e2e)
    if name == "scion":  # on the norm balls, from the same draw
        for o in (opt_twin, opt, opt_e2e):
            o.init(torch.Generator().manual_seed(1))
    comms: dict[str, int] = {}
    for step in range(STEPS):
        tokens = _tokens(step)
        for o in (opt_twin, opt, opt_e2e):
            o.zero_grad()
        _loss(sharded, tokens[rank * BATCH : (rank + 1) * BATCH]).backward()
        _loss(e2e, tokens).backward()
        for p, q in zip(twin.parameters(), sharded.parameters(), strict=True):
            p.grad = q.grad.full_tensor()
        mode = CommDebugMode()  # a dispatch mode: the twin steps under one too, for equal kernels
        with mode:
            opt.step()
        with CommDebugMode():
            opt_twin.step()
        if step == 0:
            comms = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
        opt_e2e.step()

    result: dict = {"exact": {}, "rel": {}, "e2e": {}, "comms": comms, "misplaced_state": []}
    named = list(twin.named_parameters())
    for (n, p), q, r in zip(named, sharded.parameters(), e2e.parameters(), strict=True):
        full = q.detach().full_tensor()
        result["exact"][n], result["rel"][n] = _compare(full, p.detach())
        result["e2e"][n] = (full - r.detach()).abs().max().item()
        for key, value in opt.state[q].items():
            placed = isinstance(value, DTensor) and value.placements == q.placements
            if isinstance(value, torch.Tensor) and value.ndim > 0 and not placed:
                result["misplaced_state"].append(f"{n}:{key}")
    if hasattr(opt, "swap_output"):
        with opt.swap_output(), opt_twin.swap_output():
            outputs = [
                _compare(q.detach().full_tensor(), p.detach())
                for (_, p), q in zip(named, sharded.parameters(), strict=True)
            ]
        result["output_exact"] = all(same for same, _ in outputs)
        result["output_rel"] = max(rel for _, rel in outputs)

    # Distributed checkpoint: save, take one more step; a fresh model and optimizer loaded as
    # Lightning loads them (weights first, then the optimizer) must take the same step.
    path = f"{tmp}/{name}"
    dcp.save({"optim": get_optimizer_state_dict(sharded, opt)}, checkpoint_id=path)
    weights = [p.detach().clone() for p in sharded.parameters()]
    tokens = _tokens(STEPS)
    local = tokens[rank * BATCH : (rank + 1) * BATCH]
    opt.zero_grad()
    _loss(sharded, local).backward()
    opt.step()
    resumed = _shard(_model(), mesh)
    with torch.no_grad():
        for p, w in zip(resumed.parameters(), weights, strict=True):
            p.copy_(w)
    opt_resumed = make(resumed)
    state = {"optim": get_optimizer_state_dict(resumed, opt_resumed)}  # steps once at lr 0
    result["load_kept_weights"] = all(
        torch.equal(p.detach().to_local(), w.to_local())
        for p, w in zip(resumed.parameters(), weights, strict=True)
    )
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(resumed, opt_resumed, state["optim"])
    opt_resumed.zero_grad()
    _loss(resumed, local).backward()
    opt_resumed.step()
    result["resumed_exact"] = all(
        torch.equal(p.detach().to_local(), q.detach().to_local())
        for p, q in zip(resumed.parameters(), sharded.parameters(), strict=True)
    )
    return result


def _run_norms(mesh) -> dict:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    results = {}
    gen = torch.Generator().manual_seed(3)
    norms = [(name, get_norm(name, **kw), shape) for name, kw, shape in NORMS]
    norms.append(("max_entry", _MaxEntry(), (11, 8)))
    for name, norm, shape in norms:
        g = torch.randn(shape, generator=gen)
        d = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
        for op in NORM_OPS:
            out, want = getattr(norm, op)(d), getattr(norm, op)(g)
            mode = CommDebugMode()  # a dispatch mode: may change kernels, so values come from above
            with mode:
                getattr(norm, op)(d)
            outs = out if isinstance(out, tuple) else (out,)
            wants = want if isinstance(want, tuple) else (want,)
            same, rel, placed = True, 0.0, True
            for o, w in zip(outs, wants, strict=True):
                if w.ndim == len(shape) and w.shape == g.shape and w.ndim > 0:
                    placed &= isinstance(o, DTensor) and o.placements == d.placements
                    o = o.full_tensor()
                else:
                    placed &= not isinstance(o, DTensor)
                s, r = _compare(o, w)
                same, rel = same and s, max(rel, r)
            comms = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
            results[f"{name}{shape}:{op}"] = (name, op, same, rel, placed, comms)
    return results


def _worker(rank: int, port: int, tmp: str, queue: "mp.Queue") -> None:
    set_rank_env(rank, port, WORLD_SIZE)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        out = {"norms": _run_norms(mesh)}
        for name in CASES:
            out[name] = _run_case(name, mesh, rank, tmp)
        dist.destroy_process_group()
        queue.put((rank, out))
    except Exception as exc:
        queue.put((rank, {"error": repr(exc)}))
        raise


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Rank 0's results (both ranks must finish without error)."""
    tmp = str(tmp_path_factory.mktemp("dcp"))
    results, codes = run_ranks(_worker, tmp, world_size=WORLD_SIZE, timeout=240)
    for rank in range(WORLD_SIZE):
        assert "error" not in results[rank], results[rank]
    assert codes == [0] * WORLD_SIZE
    return results[0]


@pytest.mark.distributed
def test_norm_operations_on_dtensors_equal_full_tensor_results(sharded_results: dict) -> None:
    for key, (name, op, same, rel, placed, comms) in sharded_results["norms"].items():
        assert placed, key  # tensors placed like the input, norms as ordinary tensors
        if (name, op) in LOCAL_OPS:
            assert set(comms) <= {"all_reduce"}, (key, comms)
        else:
            assert comms == {"all_gather_into_tensor": 1}, (key, comms)
        if (name, op) in SUMMED:
            assert rel <= RTOL, (key, rel)
        else:
            assert same, (key, rel)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_step_equals_unsharded_step(sharded_results: dict, case: str) -> None:
    result = sharded_results[case]
    inexact = INEXACT.get(case, set())
    for name, same in result["exact"].items():
        if inexact == ALL or name in inexact:
            assert result["rel"][name] <= RTOL, (name, result["rel"][name])
        else:
            assert same, (name, result["rel"][name])
    if "output_exact" in result:
        assert result["output_exact"] or (inexact and result["output_rel"] <= RTOL)
    atol = END_TO_END_ATOL.get(case, 1e-5)
    assert max(result["e2e"].values()) <= atol, result["e2e"]
    assert not result["misplaced_state"]  # states are DTensors placed like their parameter


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_step_does_no_implicit_redistribution(sharded_results: dict, case: str) -> None:
    comms = dict(sharded_results[case]["comms"])
    assert comms.pop("all_gather_into_tensor", 0) == GATHERS[case]
    assert set(comms) <= {"all_reduce"}, comms


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_optimizer_resumes_from_distributed_checkpoint(
    sharded_results: dict, case: str
) -> None:
    result = sharded_results[case]
    assert result["load_kept_weights"]  # the loader's step at lr 0 moves nothing
    assert result["resumed_exact"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": False, "weight_decay": 0.0},
        {"adjust_lr_fn": "match_rms_adamw", "momentum": 0.9},
    ],
)
def test_muon_equals_torch_muon_on_plain_tensors(options: dict) -> None:
    torch.manual_seed(0)
    params = [torch.randn(12, 8), torch.randn(5, 12)]
    ours = [nn.Parameter(p.clone()) for p in params]
    theirs = [nn.Parameter(p.clone()) for p in params]
    opt_ours = Muon(ours, lr=0.02, **options)
    opt_theirs = torch.optim.Muon(theirs, lr=0.02, **options)
    for step in range(3):
        grads = [
            torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) for p in params
        ]
        for group, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            for p, g in zip(group, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        opt_ours.state[ours[0]]["momentum_buffer"], opt_theirs.state[theirs[0]]["momentum_buffer"]
    )
    state = copy.deepcopy(opt_ours.state_dict())
    torch.optim.Muon(theirs, lr=0.02, **options).load_state_dict(state)  # same state format
