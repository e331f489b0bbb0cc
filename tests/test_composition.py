"""The composition matrix: the library's techniques run together, pairwise.

Factors (one entry per technique or baseline of that kind; a technique added later adds its
entry, see docs/contributing.md):

- ``STRATEGIES``: one process, Lightning's FSDP2 ``ModelParallelStrategy`` on 2 ranks, AdERA on 2;
- ``OPTIMIZERS``: AdamW, AcceleGrad#, Scion, Muon on the hidden matrices chained with AdamW;
- ``WRAPPERS``: none, ANCRe's ``ConnectivityWrapper``, AOT-POT's multi-stream ``StreamsWrapper``
  (mHC streams around the decoder layers); the matrix also has ANCRe with deferred state
  gradients (``state_grads="deferred"``), which the other tests below leave out;
- ``CACHES`` (at test): transformers' ``DynamicCache``, KIVI, AdaKVQ, ADKV;
- ``ATTENTIONS`` (at test): transformers' SDPA, AdaCal's sparse prefill (every test prompt takes
  the sparse path: blocks of 16, no minimum length).

aNCA's maze solver is a model of its own: its test below trains it with each optimizer. AVSD's
self-distillation module is a training loop of its own (sampling, teacher views, manual
optimization): its test below trains a policy of each wrapper with each optimizer that takes plain
parameter groups. ASAP's federated simulator is one too: its test below uses each such optimizer as
the server optimizer (FedOpt) while ASAP attacks. ABC-Align's DPO module trains a policy of each
wrapper with each such optimizer from scarce human and abundant judge labels, then generates
through every cache.

Merging (AMARIS) is not a factor of a training run: it acts on checkpoints afterwards. Its test
below merges a specialist of each wrapper into its base and generates through every cache. The
reliability layer's operators sample a trained model; their test below runs them on a model of
each wrapper through every cache. AMPS's steering hooks act on a trained model at inference: their
test below steers a model of each wrapper while it generates through every cache.

:func:`covering_rows` picks rows of the product that together hold every ``strength``-tuple of
values of that many distinct factors (greedy). The fast suite runs the pairwise rows (strength 2,
:func:`pairwise_rows`); each row fits a tiny Llama ``CausalLMModule`` on one fixed recall batch
for a few steps (loss must go down), then tests it with a short ``generate`` through the row's
cache. Every AdERA row also runs with ``ModelParallelStrategy`` and must end bitwise equal. All
2-rank runs share one forked pair of gloo processes. The ``slow`` suite runs the 3-wise rows
(strength 3: every triple of values of three factors) the same way; the full product runs
instead on request, with ``ADA_COMPOSITION_FULL=1`` (384 rows, an estimated 12 minutes on CI's 2
cores, scaled from 9 for 288 rows)::

    ADA_COMPOSITION_FULL=1 pytest -m slow tests/test_composition.py::test_three_wise_rows
"""

import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from helpers.distributed import run_ranks, set_rank_env
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy
from transformers import DynamicCache

import ada_modules.attention  # noqa: F401  (registers the sparse prefill attention functions)
from ada_modules.callbacks import ConnectivityMonitor, SparsePrefillMonitor
from ada_modules.data import (
    ConsolidationLogsDataModule,
    DigitsDataModule,
    EnvTaskDataModule,
    FederatedDataModule,
    MazeDataModule,
    PreferenceDataModule,
    RecallDataModule,
    generate_shapes,
)
from ada_modules.fl import ASAP
from ada_modules.kv import AdaKVQCache, ADKVCache, KIVICache
from ada_modules.merging import amaris, collect_activation_stats, output_deviation
from ada_modules.models import (
    CandidateSelectionModule,
    CausalLMModule,
    DiTModule,
    DPOModule,
    FederatedSimulationModule,
    MazeNCAModule,
    SelfDistillationModule,
)
from ada_modules.nn import ConnectivityWrapper, StreamsWrapper
from ada_modules.optim import AcceleGradSharp, Muon, Scion
from ada_modules.posttrain.envs import SortingEnv
from ada_modules.reliability import (
    CausalLMChannel,
    DiversityCombining,
    HybridRetransmission,
    SimulatedVerifier,
)
from ada_modules.steering import SteeringVector, capture_hidden_states, steer
from ada_modules.strategies import AdERAStrategy

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
STEPS = 6
BATCH = 8
SIZES = {"data_parallel_size": WORLD_SIZE, "tensor_parallel_size": 1}

STRATEGIES: dict[str, Callable[[], Any] | None] = {
    "single": None,
    "fsdp2": lambda: ModelParallelStrategy(**SIZES),
    "adera": lambda: AdERAStrategy(**SIZES, mode="always", min_numel=256, check_caches=True),
}
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer": partial(torch.optim.AdamW, lr=3e-3)},
    "accelegrad_sharp": {
        "optimizer": partial(AcceleGradSharp, lr=0.05),
        "param_groups": "geometry",
    },
    "scion": {"optimizer": partial(Scion, lr=0.01), "param_groups": "geometry"},
    "muon_chain": {
        "optimizer": partial(Muon, lr=0.02),
        "aux_optimizer": partial(torch.optim.AdamW, lr=3e-3),
    },
}
WRAPPERS: dict[str, Callable[[], Any] | None] = {
    "none": None,
    "ancre": lambda: ConnectivityWrapper(mode="source"),
    "streams": lambda: StreamsWrapper(n_streams=2, kind="mhc"),
}
# the matrix's wrappers: also ANCRe's opt-in deferred state gradients (its own autograd Functions)
MATRIX_WRAPPERS = {
    **WRAPPERS,
    "ancre_deferred": lambda: ConnectivityWrapper(mode="source", state_grads="deferred"),
}
CACHES: dict[str, Callable[..., Any]] = {
    "dynamic": DynamicCache,
    "kivi": partial(
        KIVICache,
        key_bits=2,
        value_bits=2,
        key_group_size=16,
        value_group_size=16,
        residual_length=16,
    ),
    "adakvq": partial(
        AdaKVQCache, profile=[0.6, 0.3], budget=5.0, key_group_size=16, residual_length=16
    ),
    "adkv": partial(ADKVCache, key_bits=2, value_bits=4, residual_length=16, keyframe_period=32),
}
ATTENTIONS: dict[str, dict[str, Any] | None] = {
    "sdpa": None,
    "adacal": {"block_size": 16, "min_sparse_length": 16},
}
FACTORS = {
    "strategy": list(STRATEGIES),
    "optimizer": list(OPTIMIZERS),
    "wrapper": list(MATRIX_WRAPPERS),
    "cache": list(CACHES),
    "attention": list(ATTENTIONS),
}


def covering_rows(factors: dict[str, list[str]], strength: int) -> list[dict[str, str]]:
    """Rows of the product of ``factors`` that hold every ``strength``-tuple of values of
    ``strength`` distinct factors (strength 2: every pair, 3: every triple).

    Greedy: repeatedly take the row of the product that holds the most tuples not yet held
    (first in product order on ties), until every tuple is held.
    """
    names = list(factors)
    product = [
        dict(zip(names, values, strict=True)) for values in itertools.product(*factors.values())
    ]

    def tuples(row: dict[str, str]) -> set[tuple[tuple[str, str], ...]]:
        return {
            tuple((name, row[name]) for name in combo)
            for combo in itertools.combinations(names, strength)
        }

    missing = set().union(*(tuples(row) for row in product))
    rows = []
    while missing:
        best = max(product, key=lambda row: len(tuples(row) & missing))
        rows.append(best)
        missing -= tuples(best)
    return rows


def pairwise_rows(factors: dict[str, list[str]]) -> list[dict[str, str]]:
    """Rows of the product of ``factors`` that hold every pair of values of two factors."""
    return covering_rows(factors, 2)


def _row_id(row: dict[str, str]) -> str:
    return "-".join(row[name] for name in FACTORS)


ROWS = pairwise_rows(FACTORS)
TRIPLE_ROWS = covering_rows(FACTORS, 3)
PRODUCT = [
    dict(zip(FACTORS, values, strict=True)) for values in itertools.product(*FACTORS.values())
]
# the slow suite's rows: the 3-wise rows, or the full product with ADA_COMPOSITION_FULL=1
FULL = os.environ.get("ADA_COMPOSITION_FULL") == "1"
SLOW_ROWS = PRODUCT if FULL else TRIPLE_ROWS


class _GlobalLoss(Callback):
    """Records each step's training loss, averaged over the ranks."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        if trainer.world_size > 1:
            torch.distributed.all_reduce(loss)
            loss /= trainer.world_size
        self.losses.append(float(loss))


def _run(row: dict[str, str], tmp: str) -> dict[str, Any]:
    seed_everything(0)
    wrapper = MATRIX_WRAPPERS[row["wrapper"]]
    module = CausalLMModule(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        max_new_tokens=4,
        model_wrapper=wrapper() if wrapper else None,
        **OPTIMIZERS[row["optimizer"]],
    )
    make_strategy = STRATEGIES[row["strategy"]]
    world = 1 if make_strategy is None else WORLD_SIZE
    # one batch per rank and epoch: every step sees the same samples
    data = RecallDataModule(
        num_pairs=4,
        max_hops=1,
        key_length=1,
        num_train=BATCH * world,
        num_val=BATCH,
        num_test=BATCH * world,
        batch_size=BATCH,
        eval_batch_size=BATCH,
    )
    losses = _GlobalLoss()
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=make_strategy() if make_strategy else "auto",
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # reads ANCRe's coefficients between steps (gathered when sharded): no-op without a router
        callbacks=[
            losses,
            ConnectivityMonitor(every_n_steps=STEPS // 2, log_images=False),
            SparsePrefillMonitor(),
        ],
        default_root_dir=tmp,
    )
    trainer.fit(module, datamodule=data)
    module.cache_factory = CACHES[row["cache"]]  # the cache of the test's generate calls
    sparse_prefill = ATTENTIONS[row["attention"]]
    if sparse_prefill is not None:
        module.model.config.sparse_prefill = sparse_prefill
        module.model.set_attn_implementation(row["attention"])
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
    params = [
        (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for p in module.parameters()
    ]
    return {"losses": losses.losses, "metrics": metrics, "params": params}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def _distributed_runs(rows: list[dict[str, str]], tmp: str) -> dict[str, dict[str, Any]]:
    """Every 2-rank row, plus an FSDP2 twin of every AdERA row, in this rank's process."""
    results = {}
    for row in rows:
        if row["strategy"] == "single":
            continue
        try:
            result = _run(row, tmp)
            if row["strategy"] == "adera":
                twin = _run({**row, "strategy": "fsdp2"}, tmp)
                result["equal_to_fsdp2"] = _same(result["params"], twin["params"])
        except Exception as error:  # reported by the test of the row
            result = {"error": f"{type(error).__name__}: {error}"}
        result.pop("params", None)
        results[_row_id(row)] = result
    return results


def _worker(rank: int, port: int, rows: list, tmp: str, queue: "mp.Queue") -> None:
    set_rank_env(rank, port, WORLD_SIZE)
    torch.set_num_threads(1)
    try:
        queue.put((rank, _distributed_runs(rows, tmp)))
    except Exception as error:
        queue.put((rank, {"error": repr(error)}))
        raise


def _check(result: dict[str, Any], row: dict[str, str]) -> None:
    assert "error" not in result, result["error"]
    losses = result["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"loss did not go down on the fixed batch: {losses}"
    metrics = result["metrics"]
    assert math.isfinite(metrics["test/loss"]), metrics
    assert metrics["test/gen_length"] >= 1, metrics
    if row["attention"] != "sdpa":
        assert metrics["test/sparse_calls"] >= 2, metrics  # one prefill call per layer at least
    if row["strategy"] == "adera":
        assert result["equal_to_fsdp2"], "AdERA parameters differ from FSDP2's"


def _hold_every(rows: list[dict[str, str]], strength: int) -> None:
    held = {tuple(row.values()) for row in rows}
    for combo in itertools.combinations(enumerate(FACTORS), strength):
        for values in itertools.product(*(FACTORS[name] for _, name in combo)):
            assert any(
                all(r[i] == v for (i, _), v in zip(combo, values, strict=True)) for r in held
            ), (combo, values)


def test_the_rows_hold_every_pair():
    _hold_every(ROWS, 2)
    assert len(ROWS) < len(PRODUCT)


def test_the_slow_rows_hold_every_triple():
    _hold_every(TRIPLE_ROWS, 3)
    assert len(ROWS) < len(TRIPLE_ROWS) < len(PRODUCT)
    assert covering_rows(FACTORS, 2) == ROWS


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("composition"))
    results, codes = run_ranks(_worker, ROWS, tmp, world_size=WORLD_SIZE, timeout=600)
    assert codes == [0] * WORLD_SIZE, results
    return results


SINGLE = [row for row in ROWS if row["strategy"] == "single"]
SHARDED = [row for row in ROWS if row["strategy"] != "single"]


@pytest.mark.parametrize("row", SINGLE, ids=_row_id)
def test_single_process_row(row, tmp_path):
    _check(_run(row, str(tmp_path)), row)


@pytest.mark.distributed
@pytest.mark.parametrize("row", SHARDED, ids=_row_id)
def test_two_rank_row(row, distributed_results):
    for rank in range(WORLD_SIZE):
        _check(distributed_results[rank][_row_id(row)], row)
    first, second = (distributed_results[rank][_row_id(row)] for rank in range(WORLD_SIZE))
    assert first["losses"] == second["losses"], "ranks disagree on the global loss"


@pytest.mark.slow
@pytest.mark.distributed
def test_three_wise_rows(tmp_path):
    """The 3-wise rows (the full product with ADA_COMPOSITION_FULL=1): single rows here, the
    2-rank rows through one forked pair of processes."""
    for row in (r for r in SLOW_ROWS if r["strategy"] == "single"):
        _check(_run(row, str(tmp_path)), row)
    timeout = 3000 if FULL else 1500
    results, codes = run_ranks(
        _worker, SLOW_ROWS, str(tmp_path), world_size=WORLD_SIZE, timeout=timeout
    )
    assert codes == [0] * WORLD_SIZE, results
    for row in (r for r in SLOW_ROWS if r["strategy"] != "single"):
        for rank in range(WORLD_SIZE):
            _check(results[rank][_row_id(row)], row)


@pytest.mark.slow
@pytest.mark.distributed
def test_compose_yaml_fits_on_two_processes_then_tests_with_the_adakvq_cache(tmp_path):
    """`ada fit -c cli_configs/compose/lm.yaml`, then `ada test ... cache.yaml --ckpt_path last`."""
    configs = REPO / "cli_configs" / "compose"
    ada = [str(Path(sys.executable).parent / "ada")]
    quiet = ["--trainer.enable_progress_bar=false"]
    fit = subprocess.run(
        [*ada, "fit", "-c", str(configs / "lm.yaml"), *quiet, "--metrics_file=fit.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    # Both ranks write to this stderr: keep enough of it to show the rank that failed first.
    assert fit.returncode == 0, fit.stderr[-20000:]
    assert (tmp_path / "runs/compose_lm/aad/aad_profile.json").exists()
    assert list((tmp_path / "runs/compose_lm").rglob("connectivity/*.png"))
    fitted = json.loads((tmp_path / "fit.json").read_text())
    assert fitted["train/adera_compressed_gathers"] > 0
    test = subprocess.run(
        [*ada, "test", "-c", str(configs / "lm.yaml"), "-c", str(configs / "cache.yaml"),
         "--ckpt_path", "last", *quiet, "--metrics_file=test.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert test.returncode == 0, test.stderr[-3000:]
    metrics = json.loads((tmp_path / "test.json").read_text())
    assert math.isfinite(metrics["test/loss"]) and 0 <= metrics["test/exact_match"] <= 1
    # fp32 K and V of 4 layers x 64 channels: 2048 bytes per token. AdaKVQ stores 4.5 bits per
    # element, but keeps its last 16 tokens in fp32: on these ~30-token prompts about 0.42 x FP.
    assert metrics["test/kv_bytes_per_token"] < 2048 / 2


def _lm_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_amaris_merges_a_specialist_of_each_wrapper_and_generates_through_every_cache(
    wrapper, tmp_path
):
    """Fit a base on one recall task, fine-tune it on another (a specialist), merge with AMARIS
    (linear layers gated, the rest, ANCRe's connectivity included, by task arithmetic): the merge
    keeps its budget on the calibration data and generates through every cache."""
    seed_everything(0)
    module = CausalLMModule(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64,
        max_position_embeddings=128, max_new_tokens=4,
        model_wrapper=WRAPPERS[wrapper]() if WRAPPERS[wrapper] else None,
        optimizer=partial(torch.optim.AdamW, lr=3e-3),
    )  # fmt: skip
    tasks = {
        name: RecallDataModule(num_pairs=pairs, max_hops=1, key_length=1, num_train=BATCH,
                               num_val=BATCH, num_test=BATCH, batch_size=BATCH, seed=seed)
        for name, pairs, seed in (("core", 4, 0), ("specialist", 2, 1))
    }  # fmt: skip
    states = {}
    for name, data in tasks.items():  # the base, then the specialist fine-tuned from it
        Trainer(
            accelerator="cpu", max_steps=STEPS, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ).fit(module, datamodule=data)  # fmt: skip
        states[name] = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    batches = {}
    for name, data in tasks.items():
        data.setup("fit")
        batches[name] = list(data.train_dataloader())
    module.model.load_state_dict(states["core"])
    core_stats = collect_activation_stats(module.model, batches["core"], forward=_lm_forward)
    module.model.load_state_dict(states["specialist"])
    specialist_stats = collect_activation_stats(
        module.model, batches["specialist"], forward=_lm_forward
    )
    merged, report = amaris(
        states["core"], [states["specialist"]], [specialist_stats], core_stats, budget=0.05,
        ridge=1e-6,  # few distinct tokens: the inputs of the first layers are rank-deficient
    )  # fmt: skip
    assert report["layers"] and all(
        deviation <= 0.05 * (1 + 1e-6)
        for deviation in output_deviation(states["core"], merged, core_stats).values()
    )
    if wrapper == "ancre":  # its connectivity is not a linear layer: task arithmetic moves it
        connectivity = [k for k in merged if "connectivity" in k]
        assert any(not torch.equal(merged[k], states["core"][k]) for k in connectivity)
    module.model.load_state_dict(merged)
    for name, make_cache in CACHES.items():
        module.cache_factory = make_cache
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                          enable_model_summary=False)  # fmt: skip
        metrics = trainer.test(module, datamodule=tasks["specialist"], verbose=False)[0]
        assert math.isfinite(metrics["test/loss"]) and metrics["test/gen_length"] >= 1, name


def _fitted_recall_lm(wrapper: str) -> tuple[CausalLMModule, RecallDataModule]:
    """A tiny Llama of ``wrapper`` fitted for a few steps on a recall task (seed 0)."""
    seed_everything(0)
    module = CausalLMModule(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64,
        max_position_embeddings=128, max_new_tokens=4,
        model_wrapper=WRAPPERS[wrapper]() if WRAPPERS[wrapper] else None,
        optimizer=partial(torch.optim.AdamW, lr=3e-3),
    )  # fmt: skip
    data = RecallDataModule(num_pairs=4, max_hops=1, key_length=1, num_train=BATCH,
                            num_val=BATCH, num_test=BATCH, batch_size=BATCH, seed=0)  # fmt: skip
    Trainer(
        accelerator="cpu", max_steps=STEPS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(module, datamodule=data)  # fmt: skip
    return module, data


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_reliability_operators_sample_a_model_of_each_wrapper_through_every_cache(wrapper):
    """The reliability layer is not a factor of a training run either: it samples a trained
    model. Its operators run on a CausalLMChannel over a model of each wrapper, generating through
    every cache; an explicit DynamicCache replays the default cache's samples exactly, and every
    operator pays between one and max_new_tokens tokens per sample it drew (the exact count is
    tested in tests/reliability/test_lm_channel.py)."""
    module, data = _fitted_recall_lm(wrapper)
    data.setup("test")
    examples = data.datasets["test"][:3]
    prompts = [module.tokenizer.decode(example["prompt_ids"]) for example in examples]
    answers = [example["answer"] for example in examples]

    def run(cache_factory):
        channel = CausalLMChannel(module.model, module.tokenizer, prompts, max_new_tokens=4,
                                  cache_factory=cache_factory)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        vote = DiversityCombining(3)
        harq = HybridRetransmission(max_rounds=2, verifier=SimulatedVerifier(1.0, 0.0))
        return [
            op(channel, i, truth=answers[i], generator=g) for i in range(3) for op in (vote, harq)
        ]

    default = run(None)
    assert run(DynamicCache) == default
    for name, make_cache in CACHES.items():
        outcomes = run(make_cache)
        assert all(isinstance(o.answer, str) and o.samples <= o.cost <= 4 * o.samples
                   for o in outcomes), name  # fmt: skip


@pytest.mark.parametrize("optimizer", ["adamw", "accelegrad_sharp", "scion"])
def test_the_anca_solver_trains_with_each_optimizer_that_takes_its_layers(optimizer):
    """aNCA is a model of its own (a grid automaton, no decoder, cache or attention), so of the
    matrix's factors only the optimizer reaches it: each optimizer whose parameter groups it can
    form (all parameters, or one group per layer role) fits the deformable maze solver on one
    fixed batch, and the loss goes down. Muon's chain is left out: it splits a decoder's
    attention and MLP matrices from the rest, and an NCA has neither."""
    seed_everything(0)
    spec = OPTIMIZERS[optimizer]
    module = MazeNCAModule(
        state_channels=8, hidden_channels=16, steps=6, min_steps=6,
        param_groups="all" if "param_groups" not in spec else spec["param_groups"],
        optimizer=spec["optimizer"],
    )  # fmt: skip
    data = MazeDataModule(size=7, train_mazes=BATCH, val_mazes=1, test_mazes=1,
                          batch_size=BATCH, seed=0)  # fmt: skip
    data.setup("fit")
    inputs, target = data.datasets["train"].tensors

    def loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(module(inputs, 6), target).item()

    before = loss()
    Trainer(
        accelerator="cpu", max_steps=4 * STEPS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(module, datamodule=data)  # fmt: skip
    assert loss() < 0.9 * before, optimizer


@pytest.mark.parametrize("optimizer", ["adamw", "accelegrad_sharp"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_self_distillation_trains_a_policy_of_each_wrapper_with_each_optimizer(wrapper, optimizer):
    """AVSD: the policy wrapped in place (ANCRe, multi-stream), a warm start whose loss goes down,
    then RL steps whose frozen teacher is a copy of the wrapped policy (views pooled per token).
    Scion and Muon's chain are left out: they need the geometry / matrix groups that the on-policy
    module's plain weight-decay groups do not form."""
    seed_everything(0)
    module = SelfDistillationModule(
        views={"solution": "[{solution}]", "noisy": "[{noisy}]"}, group_size=4, sft_steps=12,
        max_sampled_tokens=80, eval_tasks=4, eval_samples=2, hidden_size=32, num_layers=2,
        num_heads=2, num_kv_heads=2, intermediate_size=64, max_position_embeddings=128,
        optimizer=OPTIMIZERS[optimizer]["optimizer"],
    )  # fmt: skip
    if WRAPPERS[wrapper] is not None:
        WRAPPERS[wrapper]()(module.model)
    sft_losses = []

    class SFTLoss(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if pl_module.rl_steps == 0:
                sft_losses.append(float(trainer.callback_metrics["train/sft_loss"]))

    data = EnvTaskDataModule(SortingEnv(length=3), num_train=64, num_val=8, num_test=8,
                             batch_size=4)  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", max_epochs=-1, limit_val_batches=0, logger=False, callbacks=[SFTLoss()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert sft_losses[-1] < 0.9 * sft_losses[0], sft_losses
    assert module.rl_steps >= 1
    assert math.isfinite(trainer.callback_metrics["train/distill_advantage"].item())
    teacher = module.teacher_model()
    assert teacher is not module.model
    assert [type(m) for m in teacher.modules()] == [type(m) for m in module.model.modules()]


@pytest.mark.parametrize("optimizer", ["adamw", "accelegrad_sharp"])
def test_federated_training_under_asap_steps_the_server_optimizer(optimizer):
    """ASAP: the federated simulator is a training loop of its own (clients, a rule, an attack),
    and of the matrix's factors only the optimizer reaches it, as the server optimizer (FedOpt)
    stepped with the negated aggregate. With each optimizer that takes plain parameters, clean
    rounds raise the server's accuracy, then ASAP under the median runs to the end with finite
    weights. Wrappers, caches and attention do not apply to its MLP."""
    seed_everything(0)
    lr = {"adamw": 1e-2, "accelegrad_sharp": 0.05}[optimizer]
    module = FederatedSimulationModule(
        aggregator="median", attack=ASAP(direction="mean"), num_malicious=2, attack_start=12,
        server_optimizer=partial(OPTIMIZERS[optimizer]["optimizer"].func, lr=lr),
    )  # fmt: skip
    data = FederatedDataModule(DigitsDataModule(seed=0), num_clients=10, rounds=20)
    Trainer(
        accelerator="cpu", max_epochs=1, logger=False, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(module, datamodule=data)  # fmt: skip
    assert module.curve[11] > module.curve[0] + 0.3, module.curve
    assert len(module.curve) == 20 and module.kept
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("optimizer", ["adamw", "accelegrad_sharp"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_abc_dpo_trains_a_policy_of_each_wrapper_and_generates_through_every_cache(
    wrapper, optimizer
):
    """ABC-Align: DPO of a wrapped policy (the frozen reference copied after wrapping) with the ABC
    estimator on 16 human and 128 judge labels; the combined loss falls below its starting value
    (log 2: every margin is 0 at the start, and the coefficients sum to 1) and the reference stays
    as it was; the policy then generates through every cache. Scion and Muon's chain are left out:
    the module hands the optimizer one plain parameter list."""
    seed_everything(0)
    module = DPOModule(
        estimator="abc", hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
        num_samples=0, model_wrapper=WRAPPERS[wrapper]() if WRAPPERS[wrapper] else None,
        optimizer=OPTIMIZERS[optimizer]["optimizer"],
    )  # fmt: skip
    reference = {k: v.clone() for k, v in module.reference.state_dict().items()}
    losses = []

    class Loss(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    data = PreferenceDataModule(judge_length_bias=1.0, num_labelled=16, num_unlabelled=128,
                                num_val=16, num_test=16, batch_size=32, labelled_batch_size=8,
                                seed=0)  # fmt: skip
    Trainer(
        accelerator="cpu", max_steps=12, limit_val_batches=0, logger=False, callbacks=[Loss()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(module, datamodule=data)  # fmt: skip
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert min(losses[-3:]) < math.log(2) - 0.02, losses
    assert all(torch.equal(v, reference[k]) for k, v in module.reference.state_dict().items())
    prompt = torch.tensor([[1, 10, 10, 5]])  # <bos> 7 7 2
    for name, make_cache in CACHES.items():
        out = module.policy.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
            past_key_values=make_cache(config=module.policy.config), pad_token_id=0,
        )  # fmt: skip
        assert out.shape[1] > prompt.shape[1], name


@pytest.mark.parametrize("optimizer", ["adamw", "accelegrad_sharp"])
def test_a2iql_trains_its_actor_and_critics_with_each_optimizer(optimizer):
    """AIQL / A²IQL: an offline-RL module on set-valued actions (no decoder, cache or attention),
    so of the matrix's factors only the optimizer reaches it. With each optimizer that takes
    plain parameters, A²IQL (aggregate critic, Bayesian bonus from 2 target episodes) fits on a
    fixed batch: the critics' TD loss goes down, the target critic moves, and greedy rollouts of
    the actor give finite returns under both objectives."""
    seed_everything(0)
    lr = {"adamw": 3e-3, "accelegrad_sharp": 0.05}[optimizer]
    module = CandidateSelectionModule(
        critic="aggregate", adaptation="bonus", hidden=16, eval_objective="target",
        reward_scale=0.05, optimizer=partial(OPTIMIZERS[optimizer]["optimizer"].func, lr=lr),
    )  # fmt: skip
    data = ConsolidationLogsDataModule(
        min_candidates=20, max_candidates=40, horizon=4, source_episodes=4, target_episodes=2,
        val_episodes=4, test_episodes=4, batch_size=16, seed=0,
    )  # fmt: skip
    data.setup("fit")
    batch = next(iter(data._loader("train", shuffle=False)))  # the batch overfit_batches=1 fits
    target_before = [p.clone() for p in module.target_critic.parameters()]

    def q_loss() -> float:
        with torch.no_grad():
            q1, _ = module.critic(batch["state"], batch["action"])
            reward = batch["reward"] * module.reward_multiplier
            target = reward + 0.9 * (1 - batch["done"]) * module.value(batch["next_state"])
            return (q1 - target).square().mean().item()

    trainer = Trainer(
        accelerator="cpu", max_steps=4 * STEPS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        overfit_batches=1,
    )  # fmt: skip
    before = q_loss()
    trainer.fit(module, datamodule=data)
    assert q_loss() < 0.9 * before, optimizer
    moved = zip(target_before, module.target_critic.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in moved)
    metrics = trainer.test(module, datamodule=data, verbose=False)[0]
    assert math.isfinite(metrics["test/return_source"]) and math.isfinite(metrics["test/return"])


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_amps_steers_a_model_of_each_wrapper_through_every_cache(wrapper):
    """Steering is not a factor of a training run: it hooks a trained model's decoder layers at
    inference. On a model of each wrapper, a steering vector computed from two prompts moves the
    generation's scores through every cache; per-row strength 0 leaves its row exactly as
    unsteered; and after the block the model generates as before (hooks gone)."""
    module, _ = _fitted_recall_lm(wrapper)
    model = module.model.eval()
    ids = torch.tensor([module.tokenizer.encode(p, add_bos=True) for p in ("a1b2:a", "c3d4:c")])
    with torch.no_grad(), capture_hidden_states(model, [0]) as states:
        model(ids[:1])
        model(ids[1:])
    vector = SteeringVector.from_activations(
        {0: states[0][0][0]}, {0: states[0][1][0]}
    ).normalized()

    def generate(cache_factory):
        out = model.generate(
            ids,
            max_new_tokens=4,
            do_sample=False,
            cache=cache_factory(config=model.config),
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=module.tokenizer.pad_id,
        )
        return torch.stack(out.scores, dim=1)  # fmt: skip

    for name, make_cache in CACHES.items():
        plain = generate(make_cache)
        with steer(model, vector, strength=torch.tensor([0.0, 0.0]), token_scope="last"):
            assert torch.equal(generate(make_cache), plain), name
        with steer(model, vector, strength=torch.tensor([0.0, 8.0]), token_scope="last"):
            steered = generate(make_cache)
        assert torch.equal(steered[0], plain[0]), name
        assert (steered[1, 0] - plain[1, 0]).abs().max() > 1e-3, name  # first token's scores
        assert torch.equal(generate(make_cache), plain), name


AHPA_LEVELS = ["encoder.down_blocks.0", "encoder.down_blocks.1", "encoder.mid_block"]


@pytest.mark.parametrize(
    ("wrapper", "optimizer"),
    [("none", "accelegrad_sharp"), ("ancre", "adamw"), ("streams", "accelegrad_sharp")],
)
def test_ahpa_aligns_a_dit_of_each_wrapper_with_each_optimizer(wrapper, optimizer):
    """AHPA's head is a training-time add-on of a diffusers DiT, not of the decoder LM the matrix
    trains: the DiT is wrapped in place (ANCRe routes its blocks; multi-stream residuals pack
    their streams, which the head reads as their mean), the head hooks the wrapped block, and
    an optimizer that takes plain parameters (AdamW or AcceleGrad#, each wrapper with one of them,
    both optimizers covered) fits DiT and head on one fixed batch: the flow
    loss on fixed noise and the alignment loss both go down, and the exported EMA denoiser
    carries the wrapper but nothing of the head."""
    seed_everything(0)
    module = DiTModule(
        num_layers=2, num_attention_heads=2, attention_head_dim=16, num_samples=0,
        alignment={"levels": AHPA_LEVELS, "block_index": 1, "router": "learned"},
        model_wrapper=WRAPPERS[wrapper]() if WRAPPERS[wrapper] else None,
        optimizer=partial(OPTIMIZERS[optimizer]["optimizer"].func, lr=3e-3),
    )  # fmt: skip
    images, labels = generate_shapes(16, seed=0)
    z = module.encode(images)
    t = torch.linspace(0.05, 0.95, 16)
    noise = torch.randn(z.shape, generator=torch.Generator().manual_seed(1))

    def losses() -> tuple[float, float]:
        module.train()
        module.dit.eval()  # no random label dropout; the head still catches (it is training)
        with torch.no_grad():
            module.encode(images)
            flow = module._flow_loss(module.dit, z, labels, t, noise)
            _, stats = module.aligner.loss(t)
        align = sum(stats[f"align/loss_{name}"] for name in AHPA_LEVELS)
        return flow.item(), float(align)

    flow_before, align_before = losses()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels),
                                         batch_size=16)  # fmt: skip
    Trainer(
        accelerator="cpu", max_steps=2 * STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    ).fit(module, train_dataloaders=loader)  # fmt: skip
    flow_after, align_after = losses()
    assert flow_after < flow_before and align_after < align_before, (wrapper, optimizer)
    exported = set(module.export().state_dict())
    assert not any("aligner" in key or "projector" in key for key in exported)
    assert exported == set(module.dit.state_dict())
