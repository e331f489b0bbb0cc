"""The ``ada`` command: subcommands, --metrics_file, and one-line errors for user mistakes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ada_modules.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "cli_configs" / "quickstart.yaml"
# Overrides that make the quickstart config a seconds-long run.
TINY = [
    "--trainer.max_steps=2",
    "--trainer.limit_val_batches=1",
    "--trainer.limit_test_batches=1",
    "--trainer.val_check_interval=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.callbacks=[]",
]

NO_VALIDATION = ["--trainer.num_sanity_val_steps=0", "--trainer.limit_val_batches=0"]


def _run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_help_lists_all_five_subcommands():
    result = subprocess.run(
        [sys.executable, "-m", "ada_modules", "--help"], capture_output=True, text=True, check=True
    )
    for subcommand in ("fit", "validate", "test", "predict", "sweep"):
        assert f"    {subcommand} " in result.stdout, subcommand


def test_console_script_is_installed():
    result = subprocess.run(
        [str(Path(sys.executable).with_name("ada")), "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "0.1.0" in result.stdout


def test_print_config_resolves_defaults(capsys):
    code, out, _ = _run_main(["fit", "-c", str(QUICKSTART), "--print_config"], capsys)
    assert code == 0
    assert "class_path: ada_modules.models.CausalLMModule" in out
    assert "metrics_file: null" in out


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--model.class_path=ada_modules.models.NoSuchModel", "NoSuchModel"),
        ("--model.class_path=no_such_package.Model", "no_such_package"),
        ("--model.class_path=torch.nn.Linear", "torch.nn.Linear"),
        ("--trainer.max_steps=abc", "trainer.max_steps"),
        ("--trainer.max_stepz=3", "max_stepz"),
        ("--model.init_args.hiden_size=64", "model: Problem with given class_path"),
        ("--data.init_args.max_digits=abc", "data.max_digits: Expected a <class 'int'>"),
        ("--model.init_args.optimizer.class_path=torch.optim.Adamz", "model.optimizer: module"),
        ("--model.init_args.lr_scheduler.init_args.warmup_steps=x", "lr_scheduler.warmup_steps"),
        # the cause, not jsonargparse's try at reading the value as a file path
        (
            "--model.init_args.optimizer.init_args.lr=abc",
            "model.optimizer.lr: Expected a <class 'float'>, got abc",
        ),
        (
            '--trainer.callbacks=[{"class_path": "EarlyStoping"}]',
            "trainer.callbacks: Expected a dot import path string: EarlyStoping",
        ),
        # options the Trainer cannot use together (a MisconfigurationException traceback before)
        ("--trainer.enable_checkpointing=false", "trainer: Trainer was configured with"),
        ("--ckpt_path=/no/such/run.ckpt", "ckpt_path: checkpoint not found: /no/such/run.ckpt"),
    ],
)
def test_user_errors_exit_2_with_one_line(override, expected, capsys):
    code, _, err = _run_main(["fit", "-c", str(QUICKSTART), override], capsys)
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("ada: error:")]
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in err


def test_missing_config_file_names_the_path(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    code, _, err = _run_main(["fit", "-c", str(missing)], capsys)
    assert code == 2
    assert str(missing) in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("content", "expected"),
    [("- a\n- b\n", "got a list"), ("", "got nothing"), ("just text\n", "got a str")],
)
def test_a_config_that_is_not_a_mapping_is_named(tmp_path, capsys, content, expected):
    config = tmp_path / "config.yaml"
    config.write_text(content)
    code, _, err = _run_main(["fit", "-c", str(config)], capsys)
    assert code == 2
    assert (
        err
        == f"ada: error: config {config}: expected a mapping of keys (trainer:, model:, data:, ...), {expected}\n"
    )
    code, _, err = _run_main(["fit", "-c", str(tmp_path)], capsys)
    assert (code, err) == (2, f"ada: error: config {tmp_path} is a folder, not a YAML file\n")


def test_an_error_found_while_building_is_the_only_line_on_stderr(tmp_path):
    """Lightning's "Seed set to 0" came first: it is now printed once the classes are built."""
    result = subprocess.run(
        [sys.executable, "-m", "ada_modules", "test", "-c", str(QUICKSTART), "--ckpt_path=last",
         f"--trainer.callbacks=[{{'class_path': 'ModelCheckpoint', 'init_args': {{'dirpath': '{tmp_path}'}}}}]"],
        capture_output=True, text=True, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        f"ada: error: ckpt_path: no last checkpoint in {tmp_path} (run `ada fit` with this config "
        "first, or give a checkpoint's path)\n"
    )


def test_invalid_value_rejected_at_instantiation_is_one_line(capsys):
    code, _, err = _run_main(
        ["fit", "-c", str(QUICKSTART), *TINY, "--data.init_args.batch_size=0"], capsys
    )
    assert code == 2
    assert err == "ada: error: batch_size must be an integer >= 1, got 0\n"
    assert err.count("\n") == 1


def test_metrics_file_holds_logged_metrics(tmp_path):
    metrics_file = tmp_path / "out" / "metrics.json"
    main(
        [
            "validate",
            "-c",
            str(QUICKSTART),
            *TINY,
            f"--trainer.default_root_dir={tmp_path}",
            f"--metrics_file={metrics_file}",
        ]
    )
    metrics = json.loads(metrics_file.read_text())
    assert {"val/loss", "val/exact_match"} <= set(metrics)
    assert 0.0 <= metrics["val/exact_match"] <= 1.0


def test_library_classes_resolve_by_short_name(capsys):
    code, out, _ = _run_main(
        [
            "fit",
            "--model=CausalLMModule",
            "--model.lr_scheduler=WarmupCosineLR",
            "--model.lr_scheduler.warmup_steps=5",
            "--model.lr_scheduler.total_steps=50",
            "--data=ArithmeticDataModule",
            "--print_config",
        ],
        capsys,
    )
    assert code == 0
    assert "class_path: ada_modules.models.CausalLMModule" in out
    assert "class_path: ada_modules.optim.WarmupCosineLR" in out
    assert "class_path: ada_modules.data.ArithmeticDataModule" in out


def test_top_level_help_lists_the_subcommands_the_full_parser_registers(capsys):
    from ada_modules.ada_cli import AdaCLI
    from ada_modules.cli import SUBCOMMANDS, top_level_help

    main(["--help"])
    assert capsys.readouterr().out == top_level_help()
    with pytest.raises(SystemExit):
        AdaCLI(subclass_mode_model=True, subclass_mode_data=True, args=["--help"])
    full_help = capsys.readouterr().out
    registered = full_help.split("{", 1)[1].split("}", 1)[0].split(",")
    assert registered == list(SUBCOMMANDS)


def test_help_and_version_do_not_import_torch_or_lightning():
    code = (
        "import sys, contextlib, io\n"
        "from ada_modules.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help']); main(['--version'])\n"
        "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_input_error_raised_during_the_run_is_one_line(monkeypatch, capsys):
    from ada_modules.errors import InputError
    from ada_modules.models import CausalLMModule

    def bad_step(self, batch, batch_idx):
        raise InputError("window must be >= 1, got 0")

    monkeypatch.setattr(CausalLMModule, "training_step", bad_step)
    code, _, err = _run_main(["fit", "-c", str(QUICKSTART), *TINY, *NO_VALIDATION], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == "ada: error: window must be >= 1, got 0"
    assert "Traceback" not in err


def test_a_bug_during_the_run_keeps_its_traceback(monkeypatch):
    from ada_modules.models import CausalLMModule

    def buggy_step(self, batch, batch_idx):
        raise RuntimeError("a bug")

    monkeypatch.setattr(CausalLMModule, "training_step", buggy_step)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["fit", "-c", str(QUICKSTART), *TINY, *NO_VALIDATION])


def test_model_arguments_given_with_a_checkpoint_file_win_over_its_hyperparameters(tmp_path):
    """Lightning puts a checkpoint's hyperparameters over the parsed config (its issue #20801);
    ada keeps the model arguments given on the command line, the checkpoint's for the rest."""
    maze = REPO / "cli_configs" / "anca" / "maze.yaml"  # deformable: true, eval_steps: 20
    common = ["-c", str(maze), "--trainer.logger=false", "--trainer.enable_progress_bar=false",
              "--data.init_args.size=5", "--data.init_args.train_mazes=4",
              "--data.init_args.val_mazes=2", "--data.init_args.test_mazes=2"]  # fmt: skip
    main(["fit", *common, "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
          '--trainer.callbacks=[{"class_path": "ModelCheckpoint", "init_args": {"dirpath": "'
          + str(tmp_path / "fit") + '", "save_last": true, "save_top_k": 0}}]',
          "--model.init_args.state_channels=4", "--model.init_args.hidden_channels=8",
          "--model.init_args.deformable=false", "--model.init_args.steps=3",
          "--model.init_args.min_steps=3", "--model.init_args.eval_steps=3",
          f"--trainer.default_root_dir={tmp_path / 'fit'}"])  # fmt: skip
    checkpoint = tmp_path / "fit" / "last.ckpt"
    for extra, steps in (([], 3), (["--model.init_args.eval_steps=7"], 7),
                         (["--model.eval_steps=9"], 9)):  # fmt: skip
        root = tmp_path / f"steps_{steps}"
        main(["test", *common, "--trainer.callbacks=[]", f"--ckpt_path={checkpoint}", *extra,
              f"--trainer.default_root_dir={root}"])  # fmt: skip
        used = yaml.safe_load((root / "config.yaml").read_text())["model"]["init_args"]
        assert used["eval_steps"] == steps  # the command line's, else the checkpoint's
        assert used["deformable"] is False and used["state_channels"] == 4  # the checkpoint's


def test_a_schedule_longer_than_the_fit_is_warned_about(recwarn):
    """README's `--trainer.max_steps 200` on the quickstart (total_steps: 2000) left the rate near
    its peak, silently."""
    from jsonargparse import Namespace

    from ada_modules.ada_cli import _warn_if_schedule_outlasts_fit

    scheduler = Namespace(
        class_path="ada_modules.optim.WarmupCosineLR", init_args=Namespace(total_steps=2000)
    )
    config = Namespace(model=Namespace(init_args=Namespace(lr_scheduler=scheduler)))
    with pytest.warns(UserWarning, match=r"total_steps=2000, but the fit stops at .*=200: .* 10%"):
        _warn_if_schedule_outlasts_fit(config, 200)
    for max_steps in (2000, 5000, -1):
        _warn_if_schedule_outlasts_fit(config, max_steps)
    assert not [w for w in recwarn if "WarmupCosineLR" in str(w.message)]
