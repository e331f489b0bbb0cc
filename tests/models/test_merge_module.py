"""MergeModule end to end on tiny MLP checkpoints: what it writes, what it logs (the deviation
recomputed here from the layers' inputs), the reference methods, bad input, and atomic writes."""

import copy
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

import ada_modules.models.merge as merge_module
from ada_modules.data import DigitDomainsDataModule
from ada_modules.errors import InputError
from ada_modules.merging.stats import load_stats
from ada_modules.models import ImageClassifierModule, MergeModule

BATCH, CALIBRATION_BATCHES, BUDGET = 64, 2, 0.05


def _trainer(folder: Path) -> Trainer:
    return Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )


def _save(model: ImageClassifierModule, path: Path) -> str:
    trainer = _trainer(path.parent)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """A base, a specialist (the base with its weights moved) and a wider MLP."""
    folder = tmp_path_factory.mktemp("merge_checkpoints")
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    base = ImageClassifierModule(architecture="mlp", hidden_sizes=[16])
    specialist = copy.deepcopy(base)
    with torch.no_grad():
        for parameter in specialist.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    wide = ImageClassifierModule(architecture="mlp", hidden_sizes=[32])
    return {
        "base": _save(base, folder / "base.ckpt"),
        "specialist": _save(specialist, folder / "specialist.ckpt"),
        "wide": _save(wide, folder / "wide.ckpt"),
    }


@pytest.fixture(scope="module")
def datamodule() -> DigitDomainsDataModule:
    dm = DigitDomainsDataModule(
        eval_domains=["identity", "rot90"], seed=0, batch_size=BATCH, eval_batch_size=512
    )
    dm.setup("test")
    return dm


def _module(checkpoints, method="amaris", parameters=None, specialist="specialist", **kwargs):
    entry = {"model": checkpoints[specialist], "domain": kwargs.pop("domain", "rot90")}
    entry.update(kwargs.pop("entry", {}))
    return MergeModule(
        base_model=kwargs.pop("base_model", checkpoints["base"]),
        models=[entry],
        merge_method=method,
        parameters=(
            {"budget": BUDGET, "ridge": 1e-6}
            if parameters is None and method == "amaris"
            else parameters
        ),
        calibration_batches=kwargs.pop("calibration_batches", CALIBRATION_BATCHES),
        **kwargs,
    )


def _test(module, datamodule, folder) -> dict[str, float]:
    trainer = _trainer(folder)
    trainer.test(module, datamodule=datamodule, verbose=False)
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


@pytest.fixture(scope="module")
def amaris_run(checkpoints, datamodule, tmp_path_factory):
    """One AMARIS merge and test, written over an earlier merge of two specialists."""
    folder = tmp_path_factory.mktemp("amaris_run")
    output = folder / "merged"
    output.mkdir()
    (output / "statistics_model1.pt").write_text("from an earlier merge")
    module = _module(checkpoints, output_dir=str(output))
    return module, _test(module, datamodule, folder), output


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_amaris_writes_the_merge_and_only_the_merge(amaris_run):
    module, _, output = amaris_run
    assert sorted(p.name for p in output.iterdir()) == [
        "merge_report.json",
        "merged.ckpt",
        "statistics.pt",
        "statistics_model0.pt",
    ]
    assert not [p for p in output.parent.iterdir() if p.name.startswith(".merged.")]
    loaded = ImageClassifierModule.load_from_checkpoint(output / "merged.ckpt")
    assert loaded.hparams.hidden_sizes == [16]
    assert _same(loaded.state_dict(), module.merged.state_dict())
    assert not _same(module.merged.state_dict(), module.base.state_dict())
    checkpoint = torch.load(output / "merged.ckpt", map_location="cpu", weights_only=False)
    assert "optimizer_states" not in checkpoint


def test_amaris_report_has_ranks_per_layer_and_statistics_counts(amaris_run):
    module, metrics, output = amaris_run
    report = json.loads((output / "merge_report.json").read_text())
    assert report["method"] == "amaris" and report["budget"] == BUDGET
    assert report["models"] == [
        {"model": module.recipe.models[0].model, "domain": "rot90", "parameters": {}}
    ]
    assert set(report["layers"]) == {"features.1", "head"}
    ranks = [report["layers"][layer]["specialists"][0]["rank"] for layer in ("features.1", "head")]
    assert all(isinstance(rank, int) and rank >= 0 for rank in ranks) and sum(ranks) > 0
    assert metrics["test/mean_rank"] == pytest.approx(sum(ranks) / 2)
    samples = CALIBRATION_BATCHES * BATCH
    assert report["statistics"]["base"] == {
        "features.1": {"count": samples, "dim": 65},
        "head": {"count": samples, "dim": 17},
    }
    stats = load_stats(output / "statistics.pt")
    assert {name: (s.count, s.dim) for name, s in stats.items()} == {
        "features.1": (samples, 65),
        "head": (samples, 17),
    }


def test_amaris_logs_the_scores_and_keeps_the_calibration_budget(amaris_run):
    _, metrics, _ = amaris_run
    expected = {
        "test/identity/accuracy",
        "test/rot90/accuracy",
        "test/core_accuracy",
        "test/specialist_accuracy",
        "test/base_core_accuracy",
        "test/specialists_accuracy",
        "test/core_retention",
        "test/specialist_retention",
        "test/deviation",
        "test/deviation_mean",
        "test/budget_use",
        "test/calibration_budget_use",
        "test/mean_rank",
    }
    assert set(metrics) == expected
    assert 0 < metrics["test/calibration_budget_use"] <= 1 + 1e-6
    assert metrics["test/budget_use"] == pytest.approx(metrics["test/deviation"] / BUDGET)
    assert metrics["test/core_accuracy"] == metrics["test/identity/accuracy"]
    assert metrics["test/core_retention"] == pytest.approx(
        metrics["test/core_accuracy"] / metrics["test/base_core_accuracy"]
    )


def test_the_logged_deviation_is_the_base_output_deviation_on_core_test_inputs(
    amaris_run, datamodule
):
    module, metrics, _ = amaris_run
    inputs: dict[str, list[torch.Tensor]] = {}
    linear = {name: m for name, m in module.base.named_modules() if isinstance(m, nn.Linear)}
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, args, n=name: inputs.setdefault(n, []).append(args[0])
        )
        for name, layer in linear.items()
    ]
    images = datamodule.domain_dataset("identity", "test").tensors[0]
    with torch.no_grad():
        module.base(images)
    for hook in hooks:
        hook.remove()
    merged = dict(module.merged.named_modules())
    deviations = []
    for name, layer in linear.items():
        x = torch.cat(inputs[name]).double()
        w0, b0 = layer.weight.double(), layer.bias.double()
        dw, db = merged[name].weight.double() - w0, merged[name].bias.double() - b0
        deviations.append(float(((x @ dw.T + db) ** 2).sum() / ((x @ w0.T + b0) ** 2).sum()))
    assert max(deviations) > 0
    assert metrics["test/deviation"] == pytest.approx(max(deviations), rel=1e-5)
    assert metrics["test/deviation_mean"] == pytest.approx(sum(deviations) / 2, rel=1e-5)


def test_base_method_keeps_the_base(checkpoints, datamodule, tmp_path):
    module = _module(checkpoints, "base", {})
    metrics = _test(module, datamodule, tmp_path)
    assert metrics["test/core_retention"] == 1.0 and metrics["test/deviation"] == 0.0
    assert metrics["test/deviation_mean"] == 0.0 and "test/budget_use" not in metrics
    assert _same(module.merged.state_dict(), module.base.state_dict())
    assert not list(tmp_path.iterdir())  # no output_dir: nothing written


def test_task_arithmetic_with_weight_one_gives_the_specialist(checkpoints, datamodule, tmp_path):
    module = _module(checkpoints, "task_arithmetic", entry={"parameters": {"weight": 1.0}})
    trainer = Trainer(
        accelerator="cpu", logger=False, limit_test_batches=0, default_root_dir=tmp_path
    )
    trainer.test(module, datamodule=datamodule, verbose=False)  # setup only
    specialist = ImageClassifierModule.load_from_checkpoint(checkpoints["specialist"])
    assert _same(module.merged.state_dict(), specialist.state_dict())


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "amaris_v2"}, "merge_method must be one of .*, got 'amaris_v2'"),
        ({"parameters": {"budget": 0.1, "temperature": 2}}, "unknown key 'temperature'"),
        ({"parameters": {"budget": 0}}, r"budget must be in \(0, 1\], got 0"),
        ({"parameters": {"budget": 1.5}}, r"budget must be in \(0, 1\], got 1.5"),
        ({"parameters": {"budget": True}}, "budget must be a finite number, got True"),
        ({"method": "ties", "parameters": {"density": 0}}, r"density must be in \(0, 1\], got 0"),
        (
            {"entry": {"parameters": {"density": 0}}, "method": "dare_linear"},
            r"models\[0\].parameters.density must be in \(0, 1\], got 0",
        ),
        ({"specialist_stats_from": "merged"}, "specialist_stats_from .* got 'merged'"),
        ({"calibration_batches": 0}, "calibration_batches .* got 0"),
        ({"model_class": "ada_modules.models.NoSuchModule"}, "'ada_modules.models.NoSuchModule'"),
        ({"base_model": ""}, "base_model must be a checkpoint path"),
    ],
    ids=[
        "method",
        "parameter-key",
        "budget-0",
        "budget-1.5",
        "budget-True",
        "density-0",
        "model-density-0",
        "stats-from",
        "calibration-batches-0",
        "model-class",
        "base-model",
    ],
)
def test_bad_construction_is_named(checkpoints, kwargs, message):
    with pytest.raises(InputError, match=message):
        _module(checkpoints, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_model": "missing/base.ckpt"}, "checkpoint not found: missing/base.ckpt"),
        (
            {"specialist": "wide"},
            r"specialist '.*wide.ckpt': key 'features.1.weight' has shape \(32, 64\), the base "
            r"has \(16, 64\)",
        ),
        (
            {"domain": "flip_ud"},
            r"domain 'flip_ud' is not among the datamodule's eval_domains \['identity', 'rot90'\]",
        ),
        ({"core_domain": "invert"}, "domain 'invert'"),
    ],
    ids=["missing-base", "other-architecture", "domain", "core-domain"],
)
def test_bad_setup_is_named_and_writes_nothing(checkpoints, datamodule, tmp_path, kwargs, message):
    module = _module(checkpoints, output_dir=str(tmp_path / "merged"), **kwargs)
    with pytest.raises(InputError, match=message):
        _trainer(tmp_path).test(module, datamodule=datamodule, verbose=False)
    assert not (tmp_path / "merged").exists()


def test_a_missing_specialist_checkpoint_is_named(checkpoints, datamodule, tmp_path):
    module = MergeModule(
        checkpoints["base"], [{"model": str(tmp_path / "rot90.ckpt"), "domain": "rot90"}]
    )
    with pytest.raises(InputError, match=r"checkpoint not found: .*rot90.ckpt"):
        _trainer(tmp_path).test(module, datamodule=datamodule, verbose=False)


# --- atomic writes -------------------------------------------------------------------------------


def _fail(*args, **kwargs):
    raise OSError("disk full")


def test_a_failed_write_leaves_no_output_and_no_temporary_folder(
    checkpoints, datamodule, tmp_path, monkeypatch
):
    written = []

    def fail_after_the_checkpoint(stats, path):
        written.append(Path(path).parent)
        written.extend(sorted(p.name for p in Path(path).parent.iterdir()))
        _fail()

    monkeypatch.setattr(merge_module, "save_stats", fail_after_the_checkpoint)
    module = _module(checkpoints, output_dir=str(tmp_path / "out" / "merged"))
    with pytest.raises(OSError, match="disk full"):
        _trainer(tmp_path).test(module, datamodule=datamodule, verbose=False)
    staging, *names = written
    assert staging.name.startswith(".merged.") and names == ["merge_report.json", "merged.ckpt"]
    assert list((tmp_path / "out").iterdir()) == []


def test_a_failed_write_keeps_the_previous_output(checkpoints, datamodule, tmp_path, monkeypatch):
    output = tmp_path / "merged"
    output.mkdir()
    (output / "merged.ckpt").write_text("the previous merge")
    monkeypatch.setattr(merge_module.torch, "save", _fail)
    module = _module(checkpoints, "base", {}, output_dir=str(output))
    with pytest.raises(OSError, match="disk full"):
        _trainer(tmp_path).test(module, datamodule=datamodule, verbose=False)
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    assert [p.name for p in output.iterdir()] == ["merged.ckpt"]
    assert (output / "merged.ckpt").read_text() == "the previous merge"


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("where", ["working-folder", "above-it", "empty-string", "inputs-folder"])
def test_an_output_dir_holding_more_than_a_merge_is_refused(
    checkpoints, tmp_path, monkeypatch, where
):
    """output_dir is replaced whole: "." or the checkpoints' folder would have been deleted."""
    project = tmp_path / "project"
    (project / "ckpts").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    base = project / "ckpts" / "base.ckpt"
    base.write_bytes(Path(checkpoints["base"]).read_bytes())
    monkeypatch.chdir(project)
    output_dir = {"working-folder": ".", "above-it": "..", "empty-string": ""}.get(where, "ckpts")
    before = _tree(tmp_path)
    message = {
        "working-folder": "is the working folder or holds it",
        "above-it": "is the working folder or holds it",
        "empty-string": "output_dir must be None or a folder path, got ''",
        "inputs-folder": "holds the input checkpoint 'ckpts/base.ckpt'",
    }[where]
    with pytest.raises(InputError, match=message):
        _module(checkpoints, base_model="ckpts/base.ckpt", output_dir=output_dir)
    assert _tree(tmp_path) == before


def test_an_output_dir_with_other_files_is_refused_and_an_earlier_merge_is_not(
    checkpoints, tmp_path
):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"holds \['notes.txt'\], which a merge does not write"):
        _module(checkpoints, output_dir=str(mine))
    with pytest.raises(InputError, match="is a file, not a folder"):
        _module(checkpoints, output_dir=str(mine / "notes.txt"))
    earlier = tmp_path / "earlier"
    (earlier / "hf_model").mkdir(parents=True)
    for name in ("merged.ckpt", "merge_report.json", "statistics.pt", "statistics_model0.pt"):
        (earlier / name).write_text("an earlier merge")
    _module(checkpoints, output_dir=str(earlier))  # accepted: it is replaced when the merge is done


def test_output_dir_is_checked_again_when_the_merge_is_written(checkpoints, datamodule, tmp_path):
    output = tmp_path / "merged"
    module = _module(checkpoints, "base", {}, output_dir=str(output))
    output.mkdir()
    (output / "notes.txt").write_text("written after the module was built")
    with pytest.raises(InputError, match=r"holds \['notes.txt'\]"):
        _trainer(tmp_path).test(module, datamodule=datamodule, verbose=False)
    assert _tree(output) == ["notes.txt"]
