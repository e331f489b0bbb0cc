"""The bad-input catalogue (docs/bad-input.md): each bad input, the message it gets, the outcome.

Every row is run here: a CLI case through ``ada`` in-process (one line on stderr, exit code 2), a
Python case by calling the component (it raises ``InputError``, or warns). The page is generated
from these results, so it stays true: when a message changes, this test fails until the page is
regenerated with ``ADA_WRITE_DOCS=1 pytest tests/test_bad_input_catalogue.py``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from lightning.pytorch import LightningModule
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from ada_modules.attention import AdaCalPolicy, policy_from_config
from ada_modules.callbacks import TrainingCurves
from ada_modules.cli import main
from ada_modules.data import ArithmeticDataModule, RecallDataModule, SudokuDataModule
from ada_modules.data.consolidation import ConsolidationSimulator
from ada_modules.data.consolidation_logs import collect_logs
from ada_modules.data.mazes import generate_maze
from ada_modules.data.pde import PDEDataModule, solve_pde
from ada_modules.data.shapes import generate_shapes
from ada_modules.data.sudoku import generate_sudoku
from ada_modules.errors import InputError
from ada_modules.fl import aggregate
from ada_modules.kernels import delta_codec
from ada_modules.kernels.routed_sum import routed_sum
from ada_modules.kernels.sparse_prefill import sparse_prefill_attention
from ada_modules.kv import (
    AADAccumulator,
    AdaKVQCache,
    ADKVCache,
    ADKVEncoder,
    ADKVParams,
    KIVICache,
)
from ada_modules.merging import ActivationStats, amaris, task_arithmetic
from ada_modules.models import ADKVCalibrationModule, CausalLMModule, SelfDistillationModule
from ada_modules.models.autoencoder import load_autoencoder
from ada_modules.models.causal_lm import build_causal_lm
from ada_modules.models.dit import DiTModule
from ada_modules.nn import MultiStreamResidual, NeuralCellularAutomaton, wrap_timm
from ada_modules.nn.ahpa import HierarchicalPriorAligner
from ada_modules.offline_rl import plackett_luce_log_likelihood
from ada_modules.optim import AcceleGradSharp, OptimizerChain, Scion
from ada_modules.optim.param_groups import check_param_coverage
from ada_modules.posttrain.abc import estimate_mean, preference_loss
from ada_modules.reliability import (
    DiversityCombining,
    KNNRouter,
    RatelessSampling,
    SimulatedChannel,
    plurality,
)
from ada_modules.steering import SteeringVector, steer
from ada_modules.strategies import AdERAStrategy, shard_module

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "bad-input.md"
QUICKSTART = "cli_configs/quickstart.yaml"
TINY = ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.callbacks=[]"]
AMARIS = "cli_configs/amaris/merge.yaml"
RELIABILITY = "cli_configs/reliability/study.yaml"
AOT_POT = "cli_configs/aot_pot/pretrain.yaml"
ANCA_MAZE = "cli_configs/anca/maze.yaml"
AHPA_DIT = "cli_configs/ahpa/dit.yaml"
AVSD = "cli_configs/avsd/sorting.yaml"
ASAP_DIGITS = "cli_configs/asap/digits.yaml"
ASAP_TINY = ["--trainer.logger=false", "--data.init_args.rounds=2"]
ABC_REWARD = "cli_configs/abc_align/reward_model.yaml"
AIQL_SOURCE = "cli_configs/aiql/source.yaml"
AIQL_TARGET = "cli_configs/aiql/target.yaml"
AIQL_TINY = [
    "--trainer.max_steps=1",
    "--data.init_args.source_episodes=2",
    "--data.init_args.min_candidates=20",
    "--data.init_args.max_candidates=40",
]
AMPS_STEER = "cli_configs/amps/steer.yaml"
MERGED = "--model.output_dir={tmp}/merged"  # never runs/amaris/merged


def _logs_with(field: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A small consolidation log with one field edited, validated again."""
    logs = collect_logs(ConsolidationSimulator(min_candidates=20, max_candidates=40, horizon=2),
                        episodes=2, seed=0)  # fmt: skip
    setattr(logs, field, edit(getattr(logs, field)))
    logs.validate()


def _with_nan(values: torch.Tensor) -> torch.Tensor:
    values = values.clone()
    values[3] = float("nan")
    return values


def _steer_tiny_llama(vector: SteeringVector, **kwargs: object) -> None:
    """One forward call of a 2-layer Llama (hidden 32) under ``steer``."""
    model = LlamaForCausalLM(_tiny_llama_config())
    with steer(model, vector, **kwargs):
        model(torch.tensor([[1, 2, 3]]))


def _calibrate_on_wrong_head_dim() -> None:
    module = ADKVCalibrationModule(num_heads=2, head_dim=16, bits=2)
    batch = {
        "keys": torch.randn(1, 2, 32, 64),
        "values": torch.randn(1, 2, 32, 64),
        "queries": torch.randn(1, 2, 4, 64),
    }
    module.training_step(batch, 0)


def _teacher_with_other_vocabulary() -> None:
    module = SelfDistillationModule(views={"solution": "[{solution}]"}, hidden_size=32,
                                    num_layers=1, num_heads=2, num_kv_heads=1)  # fmt: skip
    other = build_causal_lm(module.tokenizer, "llama", 32, 1, 2, 1, 64, 64, None)
    other.resize_token_embeddings(module.tokenizer.vocab_size + 4, mean_resizing=False)
    module.use_teacher(other)


def _updates_with_a_nan_row() -> torch.Tensor:
    updates = torch.arange(12.0).reshape(6, 2)
    updates[2, 0] = float("nan")
    return updates


@dataclass(frozen=True)
class Case:
    area: str
    given: str  # what the user wrote, as shown on the page
    run: Callable[[Path], tuple[str, str]]  # -> (message, outcome)


def _cli(args: list[str]) -> Callable[[Path], tuple[str, str]]:
    def run(tmp: Path) -> tuple[str, str]:
        import contextlib
        import io

        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            with pytest.raises(SystemExit) as exit_info:
                main([a.replace("{tmp}", str(tmp)) for a in args])
        lines = [
            line
            for line in stderr.getvalue().splitlines()
            if line.startswith(("ada:", "ada sweep:"))
        ]
        assert len(lines) == 1, stderr.getvalue()
        assert "Traceback" not in stderr.getvalue()
        return lines[0].replace(str(tmp), "TMP"), f"exit {exit_info.value.code}"

    return run


def _raises(build: Callable[[Path], object]) -> Callable[[Path], tuple[str, str]]:
    def run(tmp: Path) -> tuple[str, str]:
        with pytest.raises(InputError) as error:
            build(tmp)
        return str(error.value).replace(str(tmp), "TMP"), "raises InputError"

    return run


def _ahpa_grid_mismatch(tmp: Path) -> object:
    """An aligner told the DiT has a 8x8 token grid, on a DiT whose grid is 4x4."""
    module = DiTModule(num_layers=2, num_attention_heads=2, attention_head_dim=16, num_samples=0)
    aligner = HierarchicalPriorAligner(
        module.vae, module.dit.transformer_blocks, ["encoder.mid_block"], [64], block_index=1,
        hidden_size=32, token_grid=(8, 8),
    )  # fmt: skip
    images, labels = generate_shapes(2, seed=0)
    z = module.encode(images)
    module.dit(z, timestep=torch.tensor([1.0, 2.0]), class_labels=labels)
    return aligner.loss(torch.rand(2))


def _warns(build: Callable[[Path], object]) -> Callable[[Path], tuple[str, str]]:
    def run(tmp: Path) -> tuple[str, str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build(tmp)
        ours = [w for w in caught if issubclass(w.category, (UserWarning, RuntimeWarning))]
        assert ours, [str(w.message) for w in caught]
        return str(ours[0].message), f"warns {ours[0].category.__name__}"

    return run


def _write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(2, 2))


def _tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=64, vocab_size=64,
    )  # fmt: skip


def _nan_profile(tmp: Path) -> Path:
    accumulator = AADAccumulator()
    attention = torch.full((1, 2, 8, 8), 1.0).tril().softmax(-1)
    accumulator.update([attention, attention])
    data = accumulator.compute().to_dict()
    data["naad"][0][0][1] = float("nan")
    return _write(tmp, "profile.json", json.dumps(data))


class _OneLayer(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)


def _twice() -> None:
    model = torch.nn.Linear(2, 2)
    OptimizerChain(
        [torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1)]
    )


def _missing() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    check_param_coverage(model, OptimizerChain([torch.optim.AdamW(model[0].parameters())]))


TINY_LM = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2}


def _tied_and_untied():
    """A state dict whose head is its embedding, and one where the two keys differ."""
    shared = torch.zeros(6, 4)
    return {"embed.weight": shared, "head.weight": shared}, [
        {"embed.weight": torch.zeros(6, 4), "head.weight": torch.ones(6, 4)}
    ]


def _fc(out: int = 3, inputs: int = 4) -> dict[str, torch.Tensor]:
    return {"fc.weight": torch.zeros(out, inputs), "fc.bias": torch.zeros(out)}


def _stats(second_moment: torch.Tensor, count: int = 100) -> dict[str, ActivationStats]:
    return {"fc": ActivationStats(second_moment, count, has_bias=True)}


def _sweep_spec(tmp: Path, text: str) -> Path:
    return _write(tmp, "spec.yaml", text)


CASES = [
    Case("CLI", "`ada` (no subcommand)", _cli([])),
    Case("CLI", "`ada fit -c missing.yaml`", _cli(["fit", "-c", "{tmp}/missing.yaml"])),
    Case(
        "CLI",
        "`ada fit -c bad.yaml`, a YAML syntax error (`max_steps: [1,`)",
        lambda tmp: _cli(
            ["fit", "-c", str(_write(tmp, "bad.yaml", "trainer:\n  max_steps: [1,\n"))]
        )(tmp),
    ),
    Case(
        "config",
        "`model.class_path: ada_modules.models.CausalLMModul` (misspelled)",
        _cli(["fit", "-c", QUICKSTART, "--model=ada_modules.models.CausalLMModul"]),
    ),
    Case(
        "config",
        "`optimizer.class_path: torch.optim.AdamX` (misspelled)",
        _cli(["fit", "-c", QUICKSTART, "--model.init_args.optimizer=torch.optim.AdamX"]),
    ),
    Case(
        "config",
        "`--trainer.max_steps abc`",
        _cli(["fit", "-c", QUICKSTART, "--trainer.max_steps=abc"]),
    ),
    Case(
        "config",
        "`--model.init_args.hiden_size 32` (unknown key)",
        _cli(["fit", "-c", QUICKSTART, "--model.init_args.hiden_size=32"]),
    ),
    Case(
        "config",
        "`--data.init_args.batch_size 0`",
        _cli(["fit", "-c", QUICKSTART, *TINY, "--data.init_args.batch_size=0"]),
    ),
    Case(
        "optimizers",
        "AdamW `lr: -0.003` in a config",
        _cli(["fit", "-c", QUICKSTART, *TINY, "--model.init_args.optimizer.init_args.lr=-0.003"]),
    ),
    Case(
        "optimizers",
        "AcceleGrad# `lr: -1` in a config",
        _cli(
            [
                "fit",
                "-c",
                QUICKSTART,
                *TINY,
                "--model.init_args.optimizer=ada_modules.optim.AcceleGradSharp",
                "--model.init_args.optimizer.init_args.lr=-1",
            ]
        ),  # fmt: skip
    ),
    Case(
        "optimizers",
        "`WarmupCosineLR(warmup_steps=3000, total_steps=2000)` in a config",
        _cli(
            [
                "fit",
                "-c",
                QUICKSTART,
                *TINY,
                "--model.init_args.lr_scheduler.init_args.warmup_steps=3000",
            ]
        ),  # fmt: skip
    ),
    Case(
        "caches",
        "`cache_factory: KIVICache` with `value_group_size: 32` (head dim 16) in a config",
        _cli(
            [
                "test",
                "-c",
                QUICKSTART,
                *TINY,
                "--model.init_args.cache_factory=ada_modules.kv.KIVICache",
                "--model.init_args.cache_factory.init_args.value_group_size=32",
            ]
        ),  # fmt: skip
    ),
    # fmt: off
    Case(
        "caches",
        "`KIVICache(config, key_bits=2.0)`",
        _raises(lambda tmp: KIVICache(_tiny_llama_config(), key_bits=2.0)),
    ),
    Case(
        "caches",
        "`KIVICache(config, key_bits=5)`",
        _raises(lambda tmp: KIVICache(_tiny_llama_config(), key_bits=5)),
    ),
    Case(
        "caches",
        "`KIVICache(config, value_group_size=0)`",
        _raises(lambda tmp: KIVICache(_tiny_llama_config(), value_group_size=0)),
    ),
    Case(
        "caches",
        "`AdaKVQCache(config, profile=..., budget=3.0)`, a profile JSON with NaN in `naad`",
        _raises(
            lambda tmp: AdaKVQCache(
                _tiny_llama_config(), profile=str(_nan_profile(tmp)), budget=3.0
            )
        ),
    ),
    Case(
        "caches",
        "`ADKVCache(config, key_bits=5)`",
        _raises(lambda tmp: ADKVCache(_tiny_llama_config(), key_bits=5)),
    ),
    Case(
        "caches",
        "`ADKVCache(config, keyframe_period=0)`",
        _raises(lambda tmp: ADKVCache(_tiny_llama_config(), keyframe_period=0)),
    ),
    Case(
        "caches",
        "`ADKVCache(config).mark_padding(mask)` with a pad after a real token (right padding)",
        _raises(
            lambda tmp: ADKVCache(_tiny_llama_config()).mark_padding(torch.tensor([[1, 1, 0]]))
        ),
    ),
    Case(
        "caches",
        "`ADKVEncoder(params).append(x)` with a NaN in `x`",
        _raises(
            lambda tmp: ADKVEncoder(ADKVParams.default(2)).append(
                torch.tensor([[[[0.0, float("nan")]]]])
            )
        ),
    ),
    Case(
        "caches",
        "`ADKVCalibrationModule(num_heads=2, head_dim=16)` fitted on keys of head dim 64",
        _raises(lambda tmp: _calibrate_on_wrong_head_dim()),
    ),
    Case(
        "attention",
        "`AdaCalPolicy(block_size=48)`",
        _raises(lambda tmp: AdaCalPolicy(block_size=48)),
    ),
    Case(
        "attention",
        '`AdaCalPolicy(retrieval={"gamma": 1.5})`',
        _raises(lambda tmp: AdaCalPolicy(retrieval={"gamma": 1.5})),
    ),
    Case(
        "attention",
        '`LlamaConfig(attn_implementation="sparse_a_shape", sparse_prefill={"gamma": 0.9})`,'
        " at the first long prompt",
        _raises(lambda tmp: policy_from_config("sparse_a_shape", {"gamma": 0.9})),
    ),
    Case(
        "attention",
        "`sparse_prefill_attention(q, k, v, block_mask)` with 3 query heads and 2 key heads",
        _raises(
            lambda tmp: sparse_prefill_attention(
                torch.zeros(1, 3, 32, 16),
                torch.zeros(1, 2, 32, 16),
                torch.zeros(1, 2, 32, 16),
                torch.ones(1, 3, 2, 2, dtype=torch.bool),
                block_size=16,
            )
        ),
    ),
    Case(
        "attention",
        "`sparse_prefill_attention(q, k, v, block_mask)` with a block mask of the wrong shape",
        _raises(
            lambda tmp: sparse_prefill_attention(
                torch.zeros(1, 2, 32, 16),
                torch.zeros(1, 2, 32, 16),
                torch.zeros(1, 2, 32, 16),
                torch.ones(1, 2, 3, 2, dtype=torch.bool),
                block_size=16,
            )
        ),
    ),
    Case(
        "kernels",
        "`routed_sum(states, coeffs)`: three (8, 16) states, coefficients for 12 channels",
        _raises(lambda tmp: routed_sum([torch.zeros(8, 16)] * 3, torch.zeros(3, 12))),
    ),
    Case(
        "optimizers",
        "`AcceleGradSharp(params, lr=-1.0)`",
        _raises(lambda tmp: AcceleGradSharp([_param()], lr=-1.0)),
    ),
    Case(
        "optimizers",
        "`AcceleGradSharp(model.half().parameters(), lr=0.1)`: float16 parameters",
        _raises(
            lambda tmp: AcceleGradSharp(
                [torch.nn.Parameter(torch.zeros(2, dtype=torch.half))], lr=0.1
            )
        ),
    ),
    Case("optimizers", "`Scion(params, lr=0)`", _raises(lambda tmp: Scion([_param()], lr=0))),
    Case(
        "optimizers",
        "`CausalLMModule(optimizer=lambda groups: AdamW(groups[:1]))`: groups that leave "
        "parameters out",
        _raises(
            lambda tmp: CausalLMModule(
                **TINY_LM, optimizer=lambda groups: torch.optim.AdamW(groups[:1])
            ).configure_optimizers()
        ),
    ),
    Case(
        "optimizers",
        "`OptimizerChain([AdamW(model.parameters()), SGD(model.parameters())])`",
        _raises(lambda tmp: _twice()),
    ),
    Case(
        "optimizers",
        "`check_param_coverage(model, chain)` with a chain that misses a layer",
        _raises(lambda tmp: _missing()),
    ),
    Case(
        "strategies",
        '`AdERAStrategy(impl="cuda")`',
        _raises(lambda tmp: AdERAStrategy(impl="cuda")),
    ),
    Case(
        "strategies",
        '`AdERAStrategy(mode="sometimes")`',
        _raises(lambda tmp: AdERAStrategy(mode="sometimes")),
    ),
    Case(
        "strategies",
        '`AdERAStrategy(reuse="auto")` without `value_cache_bytes`',
        _raises(lambda tmp: AdERAStrategy(reuse="auto")),
    ),
    Case(
        "strategies",
        "`delta_codec.encode(x, cache)` with bf16 `x` and an fp32 cache",
        _raises(lambda tmp: delta_codec.encode(torch.zeros(8).bfloat16(), torch.zeros(8))),
    ),
    Case(
        "strategies",
        '`AdERAStrategy(shard="Linear")`',
        _raises(lambda tmp: AdERAStrategy(shard="Linear")),
    ),
    Case(
        "strategies",
        "`shard_module(module, mesh)` (or `AdERAStrategy`) for a LightningModule whose only "
        "layer is one `nn.Linear` (no blocks)",
        _raises(lambda tmp: shard_module(_OneLayer(), mesh=object())),
    ),
    Case(
        "models",
        "`CausalLMModule(cache_factory=DynamicCache)` in a fit without validation",
        _warns(lambda tmp: CausalLMModule(**TINY_LM, cache_factory=DynamicCache).on_fit_end()),
    ),
    Case(
        "models",
        '`CausalLMModule(architecture="gpt5")`',
        _raises(lambda tmp: CausalLMModule(architecture="gpt5")),
    ),
    Case(
        "data",
        "`ArithmeticDataModule(min_digits=3, max_digits=1)`",
        _raises(lambda tmp: ArithmeticDataModule(min_digits=3, max_digits=1)),
    ),
    Case(
        "data",
        '`ArithmeticDataModule(numerals="abc")`',
        _raises(lambda tmp: ArithmeticDataModule(numerals="abc")),
    ),
    Case(
        "data",
        "`RecallDataModule(num_pairs=0)`",
        _raises(lambda tmp: RecallDataModule(num_pairs=0)),
    ),
    Case(
        "wrappers",
        '`wrap_timm(timm.create_model("resnet18"), mode="source")`',
        _warns(lambda tmp: wrap_timm(timm.create_model("resnet18", num_classes=2), mode="source")),
    ),
    Case(
        "callbacks",
        "`TrainingCurves(every_n_steps=0)`",
        _raises(lambda tmp: TrainingCurves(every_n_steps=0)),
    ),
    Case(
        "merging",
        "`ada test -c cli_configs/amaris/merge.yaml --model.parameters '{budget: 1.5}'`",
        _cli(["test", "-c", AMARIS, MERGED, "--model.parameters={budget: 1.5}"]),
    ),
    Case(
        "merging",
        "`ada test -c cli_configs/amaris/merge.yaml --model.merge_method slerp`",
        _cli(["test", "-c", AMARIS, MERGED, "--model.merge_method=slerp"]),
    ),
    Case(
        "merging",
        "`ada test -c cli_configs/amaris/merge.yaml --model.base_model missing.ckpt`",
        _cli(["test", "-c", AMARIS, MERGED, "--model.base_model={tmp}/missing.ckpt"]),
    ),
    Case(
        "merging",
        "`amaris(base, [specialist], ...)` with a specialist whose `fc` is 4 x 5 "
        "(the base's is 3 x 4)",
        _raises(
            lambda tmp: amaris(_fc(), [_fc(4, 5)], [_stats(torch.eye(5))], _stats(torch.eye(5)))
        ),
    ),
    Case(
        "merging",
        "`task_arithmetic(base, [tuned])` with a base whose `head.weight` is its `embed.weight` "
        "(tied) and a `tuned` model where they differ",
        _raises(lambda tmp: task_arithmetic(*_tied_and_untied())),
    ),
    Case(
        "merging",
        "`amaris(...)` with base statistics whose covariance has a negative eigenvalue",
        _raises(
            lambda tmp: amaris(
                _fc(),
                [_fc()],
                [_stats(torch.eye(5))],
                _stats(torch.diag(torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0]))),
            )
        ),
    ),
    Case(
        "merging",
        "`amaris(..., ridge=0)` with base statistics from 2 samples (5-dim inputs)",
        _raises(
            lambda tmp: amaris(
                _fc(), [_fc()], [_stats(torch.eye(5))], _stats(torch.eye(5), count=2), ridge=0
            )
        ),
    ),
    Case(
        "reliability",
        "`ada test -c cli_configs/reliability/study.yaml --model.k 0`",
        _cli(["test", "-c", RELIABILITY, "--model.k=0"]),
    ),
    Case(
        "reliability",
        "`DiversityCombining(num_samples=0)` (a budget of zero samples)",
        _raises(lambda tmp: DiversityCombining(num_samples=0)),
    ),
    Case(
        "reliability",
        "`SimulatedChannel([0.9, 0.4], cost=-1.0)`",
        _raises(lambda tmp: SimulatedChannel([0.9, 0.4], cost=-1.0)),
    ),
    Case(
        "reliability",
        "`RatelessSampling(max_samples=9, confidence=float('nan'))`",
        _raises(lambda tmp: RatelessSampling(max_samples=9, confidence=float("nan"))),
    ),
    Case(
        "reliability",
        "`plurality([1, '1', 1])` (answers of different types)",
        _raises(lambda tmp: plurality([1, "1", 1])),
    ),
    Case(
        "reliability",
        "`KNNRouter(k=20).fit(...)` with 10 labelled queries",
        _raises(
            lambda tmp: KNNRouter(k=20).fit(torch.eye(10), torch.ones(10, 2), torch.ones(10, 2))
        ),
    ),
    Case(
        "aot_pot",
        "`ada fit -c cli_configs/aot_pot/pretrain.yaml --model.init_args.patch_size 5`",
        _cli(["fit", "-c", AOT_POT, "--model.init_args.patch_size=5"]),
    ),
    Case(
        "aot_pot",
        "`MultiStreamResidual(branch, dim=8, n_streams=0)`",
        _raises(lambda tmp: MultiStreamResidual(torch.nn.Identity(), dim=8, n_streams=0)),
    ),
    Case(
        "aot_pot",
        "`MultiStreamResidual(branch, dim=8, sinkhorn_iters=0)`",
        _raises(lambda tmp: MultiStreamResidual(torch.nn.Identity(), dim=8, sinkhorn_iters=0)),
    ),
    Case(
        "aot_pot",
        "`solve_pde('navier_stokes', 4)`",
        _raises(lambda tmp: solve_pde("navier_stokes", 4)),
    ),
    Case(
        "aot_pot",
        "`PDEDataModule(families=['burgers', 'diffusion_2d'])` (1-D and 2-D together)",
        _raises(lambda tmp: PDEDataModule(families=["burgers", "diffusion_2d"])),
    ),
    Case(
        "anca",
        "`ada fit -c cli_configs/anca/maze.yaml --data.init_args.size 10`",
        _cli(["fit", "-c", ANCA_MAZE, "--data.init_args.size=10"]),
    ),
    Case(
        "anca",
        "`ada fit -c cli_configs/anca/maze.yaml --model.init_args.steps 0`",
        _cli(["fit", "-c", ANCA_MAZE, "--model.init_args.steps=0"]),
    ),
    Case(
        "anca",
        "`generate_maze(3, rng)`",
        _raises(lambda tmp: generate_maze(3, np.random.default_rng(0))),
    ),
    Case(
        "anca",
        "`generate_sudoku(3, givens=16, rng)` (unique)",
        _raises(lambda tmp: generate_sudoku(3, 16, np.random.default_rng(0))),
    ),
    Case(
        "anca",
        "`SudokuDataModule(box=3, givens=(10, 20))`",
        _raises(lambda tmp: SudokuDataModule(box=3, givens=(10, 20))),
    ),
    Case(
        "anca",
        "`NeuralCellularAutomaton(in_channels=3, out_channels=2)(x)` with 4-channel `x`",
        _raises(lambda tmp: NeuralCellularAutomaton(3, 2)(torch.zeros(1, 4, 9, 9), steps=2)),
    ),
    Case(
        "ahpa",
        "`ada fit -c cli_configs/ahpa/dit.yaml --model.init_args.alignment "
        "'{levels: [encoder.down_blocks.7], block_index: 1}'`",
        _cli(
            [
                "fit",
                "-c",
                AHPA_DIT,
                "--model.init_args.alignment={levels: [encoder.down_blocks.7], block_index: 1}",
            ]
        ),
    ),  # fmt: skip
    Case(
        "ahpa",
        "`ada fit -c cli_configs/ahpa/dit.yaml --model.init_args.alignment "
        "'{levels: [encoder.mid_block], block_index: 6}'` (6 blocks)",
        _cli(
            [
                "fit",
                "-c",
                AHPA_DIT,
                "--model.init_args.alignment={levels: [encoder.mid_block], block_index: 6}",
            ]
        ),
    ),  # fmt: skip
    Case(
        "ahpa",
        "`HierarchicalPriorAligner(..., token_grid=(8, 8))` on a DiT with a 4x4 token grid",
        _raises(_ahpa_grid_mismatch),
    ),
    Case(
        "ahpa",
        "`load_autoencoder('missing.pt')`",
        _raises(lambda tmp: load_autoencoder(tmp / "missing.pt")),
    ),
    Case(
        "avsd",
        "`ada fit -c cli_configs/avsd/sorting.yaml --model.init_args.views '{}'`",
        _cli(["fit", "-c", AVSD, "--model.init_args.views={}"]),
    ),
    Case(
        "avsd",
        "`ada fit -c cli_configs/avsd/sorting.yaml --model.init_args.views '{solution: \"[solution]\"}'`",
        _cli(["fit", "-c", AVSD, '--model.init_args.views={solution: "[solution]"}']),
    ),
    Case(
        "avsd",
        "`ada fit -c cli_configs/avsd/sorting.yaml --model.init_args.temperature 0`",
        _cli(["fit", "-c", AVSD, "--model.init_args.temperature=0"]),
    ),
    Case(
        "avsd",
        "`ada fit -c cli_configs/avsd/sorting.yaml` with `env: KeyDoorEnv` (multi-turn, no views)",
        _cli(
            ["fit", "-c", AVSD, *TINY, "--data.init_args.env=ada_modules.posttrain.envs.KeyDoorEnv"]
        ),
    ),
    Case(
        "avsd",
        "`SelfDistillationModule(views=...).use_teacher(model)`, `model` with 4 more tokens",
        _raises(lambda tmp: _teacher_with_other_vocabulary()),
    ),
    Case(
        "asap",
        "`ada fit -c cli_configs/asap/digits.yaml --model.init_args.num_malicious 10` (n = 20)",
        _cli(["fit", "-c", ASAP_DIGITS, *ASAP_TINY, "--model.init_args.num_malicious=10"]),
    ),
    Case(
        "asap",
        "`... --model.init_args.aggregator bulyan --model.init_args.num_malicious 5` (n = 20)",
        _cli(
            [
                "fit",
                "-c",
                ASAP_DIGITS,
                *ASAP_TINY,
                "--model.init_args.aggregator=bulyan",
                "--model.init_args.num_malicious=5",
            ]
        ),
    ),
    Case(
        "asap",
        "`... --model.init_args.aggregator multi_krum --model.init_args.aggregator_kwargs '{m: 30}'`",
        _cli(
            [
                "fit",
                "-c",
                ASAP_DIGITS,
                *ASAP_TINY,
                "--model.init_args.aggregator=multi_krum",
                "--model.init_args.aggregator_kwargs={m: 30}",
            ]
        ),
    ),
    Case(
        "asap",
        "`ada fit -c cli_configs/asap/digits.yaml --model.init_args.target_fraction 1.5`",
        _cli(["fit", "-c", ASAP_DIGITS, "--model.init_args.target_fraction=1.5"]),
    ),
    Case(
        "asap",
        '`aggregate("median", updates, f=1)` with a NaN row from client 2 (the defence goes on)',
        _warns(lambda tmp: aggregate("median", _updates_with_a_nan_row(), 1)),
    ),
    Case(
        "abc_align",
        "`ada fit -c cli_configs/abc_align/reward_model.yaml --data.init_args.judge_accuracy 1.5`",
        _cli(["fit", "-c", ABC_REWARD, "--data.init_args.judge_accuracy=1.5"]),
    ),
    Case(
        "abc_align",
        "`... --model.init_args.estimator ppi+` (misspelled `ppi++`)",
        _cli(["fit", "-c", ABC_REWARD, "--model.init_args.estimator=ppi+"]),
    ),
    Case(
        "abc_align",
        "`ada fit -c cli_configs/abc_align/reward_model.yaml --data.init_args.num_labelled 1`",
        _cli(["fit", "-c", ABC_REWARD, "--data.init_args.num_labelled=1"]),
    ),
    Case(
        "abc_align",
        "`preference_loss(torch.zeros(2), torch.tensor([0.0, 2.0]))` (a label outside [0, 1])",
        _raises(lambda tmp: preference_loss(torch.zeros(2), torch.tensor([0.0, 2.0]))),
    ),
    Case(
        "abc_align",
        '`estimate_mean(human, judge, judge_unlabelled, "ppi++")` with one human label',
        _raises(lambda tmp: estimate_mean(torch.ones(1), torch.ones(1), torch.ones(100), "ppi++")),
    ),
    Case(
        "aiql",
        "`ada fit -c cli_configs/aiql/source.yaml --data.init_args.pick 60` (50 candidates)",
        _cli(["fit", "-c", AIQL_SOURCE, "--data.init_args.pick=60"]),
    ),
    Case(
        "aiql",
        "`ada fit -c cli_configs/aiql/target.yaml --data.init_args.target_episodes 0` (A²IQL)",
        _cli(["fit", "-c", AIQL_TARGET, *AIQL_TINY, "--data.init_args.target_episodes=0"]),
    ),
    Case(
        "aiql",
        "`... --model.init_args.adaptation bonus --model.init_args.critic none`",
        _cli(
            [
                "fit",
                "-c",
                AIQL_SOURCE,
                "--model.init_args.adaptation=bonus",
                "--model.init_args.critic=none",
            ]
        ),  # fmt: skip
    ),
    Case(
        "aiql",
        "a consolidation log with a NaN reward in row 3",
        _raises(lambda tmp: _logs_with("reward", _with_nan)),
    ),
    Case(
        "aiql",
        "a target log whose candidates lack a feature column (another schema)",
        _raises(lambda tmp: _logs_with("candidates", lambda c: c[..., :-1])),
    ),
    Case(
        "aiql",
        "`plackett_luce_log_likelihood` picking K = 3 of a pool with 2 valid candidates",
        _raises(
            lambda tmp: plackett_luce_log_likelihood(
                torch.zeros(1, 4),
                torch.tensor([[True, True, False, False]]),
                torch.tensor([[0, 1, 2]]),
            )  # fmt: skip
        ),
    ),
    Case(
        "amps",
        "`steer(model, SteeringVector({5: v}))` on a model with 2 decoder layers",
        _raises(lambda tmp: _steer_tiny_llama(SteeringVector({5: torch.ones(32)}))),
    ),
    Case(
        "amps",
        "`steer(...)` with a steering vector of width 48 on a model of hidden size 32",
        _raises(lambda tmp: _steer_tiny_llama(SteeringVector({0: torch.ones(48)}))),
    ),
    Case(
        "amps",
        "`steer(..., token_scope=100)` on a 3-token prompt (selects no token)",
        _raises(
            lambda tmp: _steer_tiny_llama(SteeringVector({0: torch.ones(32)}), token_scope=100)
        ),
    ),
    Case(
        "amps",
        '`steer(..., strength=float("nan"))`',
        _raises(
            lambda tmp: _steer_tiny_llama(
                SteeringVector({0: torch.ones(32)}), strength=float("nan")
            )
        ),
    ),
    Case(
        "amps",
        "`ada fit -c cli_configs/amps/steer.yaml` (strength uniform: nothing to train)",
        _cli(["fit", "-c", AMPS_STEER, "--trainer.max_steps=1"]),
    ),
    Case(
        "amps",
        "`ada test -c cli_configs/amps/steer.yaml --model.init_args.base_checkpoint missing.ckpt`",
        _cli(["test", "-c", AMPS_STEER, "--model.init_args.base_checkpoint={tmp}/missing.ckpt"]),
    ),
    # fmt: on
    Case("sweeps", "`ada sweep missing.yaml`", _cli(["sweep", "{tmp}/missing.yaml"])),
    Case(
        "sweeps",
        "a sweep spec with `seed: [0, 1]` (misspelled `seeds`)",
        lambda tmp: _cli(
            [
                "sweep",
                str(
                    _sweep_spec(
                        tmp, f"base: {REPO / QUICKSTART}\nseed: [0, 1]\nvariants: {{a: {{}}}}\n"
                    )
                ),
                "--dry-run",
            ]
        )(tmp),
    ),
]


def _table(rows: list[tuple[Case, str, str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "# Bad input: what you get",
        "",
        "Each row is run by `tests/test_bad_input_catalogue.py`, which generated this page; a",
        "message that changes fails that test until the page is regenerated",
        "(`ADA_WRITE_DOCS=1 pytest tests/test_bad_input_catalogue.py`). From the `ada` command a",
        "user error is one line on stderr and exit code 2; from Python the components raise",
        "`ada_modules.errors.InputError` (a `ValueError` and `TypeError` subclass). A bug keeps its",
        "traceback. `TMP` stands for the folder the test wrote its files to.",
        "",
        "| area | input | message | outcome |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {case.area} | {cell(case.given)} | `{cell(message)}` | {outcome} |"
        for case, message, outcome in rows
    ]
    return "\n".join(lines) + "\n"


def test_catalogue_page_is_what_the_cases_produce(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    rows = []
    for index, case in enumerate(CASES):
        folder = tmp_path / str(index)
        folder.mkdir()
        try:
            message, outcome = case.run(folder)
        except BaseException as error:
            raise AssertionError(f"case {case.given!r}: {error}") from error
        assert message and "\n" not in message, case.given
        rows.append((case, message, outcome))
    assert len(rows) >= 25
    assert len({case.area for case in CASES}) >= 8
    page = _table(rows)
    if os.environ.get("ADA_WRITE_DOCS") == "1":
        PAGE.write_text(page)
    assert PAGE.read_text() == page, "regenerate with ADA_WRITE_DOCS=1 (see the module docstring)"
