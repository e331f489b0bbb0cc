"""AdERAStrategy in a Lightning ``Trainer``: 2 gloo processes, bitwise equal to ModelParallelStrategy.

The test forks the two ranks itself and sets ``LOCAL_RANK`` & co., so Lightning does not launch
processes (it would re-run the pytest command line).
"""

import os

import pytest
import torch
import torch.multiprocessing as mp
from helpers.distributed import run_ranks, set_rank_env
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ada_modules.strategies import AdERAStrategy

WORLD_SIZE = 2
STEPS = 12


class _MLP(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4)
        )

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(STEPS * WORLD_SIZE * 8, 16, generator=gen)
        return DataLoader(TensorDataset(x, torch.sin(x[:, :4])), batch_size=8)


def _fit(
    strategy, tmp: str, max_steps: int = STEPS, ckpt: str | None = None
) -> tuple[list, Trainer]:
    model = _MLP()
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    trainer.fit(model, ckpt_path=ckpt)
    params = [p.to_local().detach().clone() for p in model.parameters()]
    return params, trainer


def _same(a: list, b: list) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def _worker(rank: int, port: int, tmp: str, queue: "mp.Queue") -> None:
    set_rank_env(rank, port, WORLD_SIZE)
    torch.set_num_threads(1)
    sizes = {"data_parallel_size": WORLD_SIZE, "tensor_parallel_size": 1}
    try:
        plain, _ = _fit(ModelParallelStrategy(**sizes), tmp)
        adera_strategy = AdERAStrategy(**sizes, mode="always", min_numel=1024, check_caches=True)
        adera, trainer = _fit(adera_strategy, tmp)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if "adera" in k}
        auto, _ = _fit(AdERAStrategy(**sizes, min_numel=1024), tmp)  # calibrates at setup
        # Value reuse, alternating compressed and raw steps (raw gathers refresh value caches).
        alternate = AdERAStrategy(
            **sizes, mode="always", min_numel=1024, alternate_steps=True, reuse="value"
        )
        alternating, trainer = _fit(alternate, tmp)
        value_metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if "adera" in k}
        # resume halfway, with each strategy: AdERA's caches are rebuilt, so both runs agree
        factories = {
            "plain": lambda: ModelParallelStrategy(**sizes),
            "adera": lambda: AdERAStrategy(**sizes, mode="always", min_numel=1024),
        }
        resumed = {}
        for name, make in factories.items():
            _, trainer = _fit(make(), tmp, STEPS // 2)
            path = os.path.join(tmp, f"{name}.ckpt")
            trainer.save_checkpoint(path)
            resumed[name], trainer = _fit(make(), tmp, ckpt=path)
        resumed_metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if "adera" in k}
        queue.put(
            (
                rank,
                {
                    "equal": _same(plain, adera),
                    "auto_equal": _same(plain, auto),
                    "alternating_equal": _same(plain, alternating),
                    "resumed_equal": _same(resumed["plain"], resumed["adera"]),
                    "metrics": metrics,
                    "value_metrics": value_metrics,
                    "value_cache_bytes": sum(c.cache_nbytes for c in alternate.comms.values()),
                    "exponent_cache_bytes": sum(
                        c.cache_nbytes for c in adera_strategy.comms.values()
                    ),
                    "resumed_metrics": resumed_metrics,
                },
            )
        )
    except Exception as exc:
        queue.put((rank, {"error": repr(exc)}))
        raise


@pytest.mark.distributed
def test_strategy_matches_model_parallel_and_resumes_exactly(tmp_path):
    results, _ = run_ranks(_worker, str(tmp_path), world_size=WORLD_SIZE, timeout=300)
    for rank in range(WORLD_SIZE):
        result = results[rank]
        assert "error" not in result, result
        assert result["equal"] and result["auto_equal"] and result["resumed_equal"], result
        assert result["alternating_equal"], result
        assert result["resumed_metrics"]["train/adera_compressed_gathers"] > 0
        metrics = result["metrics"]
        assert metrics["train/adera_compressed_gathers"] > 0
        assert metrics["train/adera_compressed_bytes_ratio"] < 0.85
        assert 0.5 < metrics["train/adera_reuse_rate"] <= 1.0
        assert metrics["train/adera_cache_bytes"] == result["exponent_cache_bytes"] > 0
        # the alternating value-reuse run's last step sent raw gathers; its caches are fp32 values
        assert result["value_metrics"]["train/adera_cache_bytes"] == result["value_cache_bytes"]
        assert result["value_cache_bytes"] == 4 * result["exponent_cache_bytes"]


TRACE_STEPS = 6


def _trace_worker(rank: int, port: int, tmp: str, queue: "mp.Queue") -> None:
    set_rank_env(rank, port, WORLD_SIZE)
    torch.set_num_threads(1)
    sizes = {"data_parallel_size": WORLD_SIZE, "tensor_parallel_size": 1}
    try:
        for name, mode in (("always", "always"), ("never", "never"), ("alternate", "always")):
            path = os.path.join(tmp, name, "trace.json")  # the folder does not exist yet
            strategy = AdERAStrategy(
                **sizes,
                mode=mode,
                min_numel=1024,
                alternate_steps=name == "alternate",
                trace_path=path,
            )
            _fit(strategy, tmp, max_steps=TRACE_STEPS)
        queue.put((rank, {}))
    except Exception as exc:
        queue.put((rank, {"error": repr(exc)}))
        raise


@pytest.mark.distributed
def test_trace_path_records_raw_and_adera_runs(tmp_path):
    from ada_modules.strategies.adera_sim import Trace

    results, _ = run_ranks(_trace_worker, str(tmp_path), world_size=WORLD_SIZE, timeout=300)
    assert all("error" not in r for r in results.values()), results

    traces = {m: Trace.from_json(tmp_path / m / "trace.json") for m in ("always", "never")}
    adera, raw = traces["always"], traces["never"]
    assert set(adera.measured_step_s) == {"adera"} and set(raw.measured_step_s) == {"raw"}
    assert adera.world_size == raw.world_size == WORLD_SIZE
    assert adera.steps == raw.steps == list(range(TRACE_STEPS))
    sizes = {2176, 16512, 516}  # the three Linear layers' parameters (weights + biases)
    for trace in (adera, raw):
        for step in trace.steps:
            events = trace.step_events(step)
            phases = [e.phase for e in events]
            n_forward = phases.count("forward")
            assert phases == ["forward"] * n_forward + ["backward"] * (len(events) - n_forward)
            assert {e.numel for e in events} == sizes and n_forward == 3
            assert all(e.change_rate == 0 for e in events if e.phase == "backward")
            assert all(e.compute_s >= 0 and e.dtype == "fp32" for e in events)
            timed = sum((e.gather_s or 0) + (e.adera_gather_s or 0) + e.compute_s for e in events)
            assert timed <= trace.meta["steps"][step]["step_s"]
        # the first gather of a group has no cache: every exponent counts as new
        assert all(e.change_rate == 1 for e in trace.step_events(0) if e.phase == "forward")
    # Same weights in both runs (bitwise equal training), so the same exponent changes,
    # counted by the codec in one run and by the trace's own comparison in the other.
    for a, r in zip(adera.events, raw.events, strict=True):
        assert (a.group, a.phase, a.change_rate) == (r.group, r.phase, r.change_rate)
    assert sum(e.change_rate for e in adera.events if e.step > 0 and e.phase == "forward") > 0
    for e in adera.events:
        # tracked groups: all but the first gather (step 0's forward, which builds the cache)
        compressed = e.numel >= 1024 and (e.step > 0 or e.phase == "backward")
        assert (e.adera_gather_s is not None) == compressed
        assert (e.gather_s is None) == compressed
        assert e.codec_s is None or e.codec_s > 0
    assert all(e.gather_s is not None and e.adera_gather_s is None for e in raw.events)
    steps = adera.meta["steps"]
    assert [s["compressed_gathers"] for s in steps[1:]] == [4] * (TRACE_STEPS - 1)
    assert all(s["compressed_bytes_sent"] < s["compressed_raw_bytes"] for s in steps[1:])
    for trace, method in ((adera, "adera"), (raw, "raw")):
        step_s = [s["step_s"] for s in trace.meta["steps"]]
        assert trace.measured_step_s[method] == pytest.approx(sum(step_s) / len(step_s))

    # alternate_steps: even steps raw, odd steps compressed, the same exponent changes.
    alternate = Trace.from_json(tmp_path / "alternate" / "trace.json")
    steps = alternate.meta["steps"]
    assert [s["method"] for s in steps] == ["raw", "adera"] * (TRACE_STEPS // 2)
    assert [s["compressed_gathers"] for s in steps] == [0, 4] * (TRACE_STEPS // 2)
    for name in ("raw", "adera"):
        step_s = [s["step_s"] for s in steps if s["method"] == name]
        assert alternate.measured_step_s[name] == pytest.approx(sum(step_s) / len(step_s))
    for a, b in zip(alternate.events, adera.events, strict=True):
        assert (a.group, a.phase, a.change_rate) == (b.group, b.phase, b.change_rate)


def test_trace_path_is_validated():
    for bad in ("", 3):
        with pytest.raises(ValueError, match="trace_path"):
            AdERAStrategy(trace_path=bad)
    for name in ("calibrate", "shadow"):  # any non-empty string was read as true
        with pytest.raises(ValueError, match=f"{name} must be true or false, got 'no'"):
            AdERAStrategy(**{name: "no"})


def test_trace_from_records_needs_a_step():
    from ada_modules.strategies.adera_trace import trace_from_records

    with pytest.raises(ValueError, match="no training step"):
        trace_from_records([], world_size=2, method="raw")


def test_trace_from_records_needs_one_method_per_step():
    from ada_modules.strategies.adera_trace import GatherRecord, trace_from_records

    record = GatherRecord(
        "g", 4096, "bf16", "forward", 1.0, 1.25, 1.25, 0.0, False, False, 8192, 8192, 41
    )
    steps = [([record], 0.5, 2.0, 2.5)] * 2
    for bad in (["raw"], ["raw", "zip"], "zip"):
        with pytest.raises(ValueError, match="method must be"):
            trace_from_records(steps, world_size=2, method=bad)
    trace = trace_from_records(steps, world_size=2, method=["raw", "adera"])
    assert trace.measured_step_s == {"raw": 2.0, "adera": 2.0}


def test_impl_is_validated_at_construction(monkeypatch):
    from ada_modules.errors import InputError

    for mode in ("auto", "never"):
        with pytest.raises(InputError, match=r"impl must be one of .*got 'cuda'"):
            AdERAStrategy(mode=mode, impl="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InputError, match="impl='triton' cannot run"):
        AdERAStrategy(mode="never", impl="triton")
    assert AdERAStrategy(impl="auto").impl == "auto"
