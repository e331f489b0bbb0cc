"""The ``ada`` command: Lightning's CLI for every model, datamodule, callback and optimizer here.

``ada fit|validate|test|predict -c CONFIG.yaml`` are LightningCLI's subcommands, with the model and
the data chosen by class path in YAML (subclass mode), so a user's own LightningModule works as
well as ours. ``ada sweep SPEC.yaml`` runs a YAML config sweep (see :mod:`ada_modules.sweep`).

Optimizers are injected, never auto-configured: a LightningModule of this library takes
``optimizer: OptimizerCallable`` (and ``lr_scheduler: LRSchedulerCallable | None``) as init args and
builds them in ``configure_optimizers``, which runs after ``configure_model`` (so FSDP2 sharding
sees the real parameters). In YAML they sit under ``model.init_args``.

Example:
    From a shell::

        ada fit -c cli_configs/quickstart.yaml
        ada test -c cli_configs/quickstart.yaml --ckpt_path runs/quickstart/checkpoints/last.ckpt

    From Python (the same code path, in-process)::

        from ada_modules.cli import main
        main(["fit", "-c", "cli_configs/quickstart.yaml", "--trainer.max_steps=10"])
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from jsonargparse import ArgumentError
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import ada_modules

__all__ = ["AdaCLI", "main"]


class _InstantiationError(Exception):
    """A component rejected its configured arguments while the CLI instantiated it."""


# Subpackages whose classes may be named by their short name in YAML or on the command line
# (jsonargparse resolves short names among subclasses that are already imported).
_REGISTERED_PACKAGES = (
    "ada_modules.callbacks",
    "ada_modules.data",
    "ada_modules.models",
    "ada_modules.optim",
    "ada_modules.posttrain.envs",
    "ada_modules.strategies",
)


class AdaCLI(LightningCLI):
    """LightningCLI with the ``--metrics_file`` option and the ``sweep`` subcommand in its help.

    ``--metrics_file PATH`` writes the run's final ``trainer.callback_metrics`` as JSON (numbers
    only) after ``fit``/``validate``/``test``/``predict``; the sweep runner collects results with it.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--metrics_file",
            type=str | None,
            default=None,
            help="Write the final logged metrics (trainer.callback_metrics) as JSON to this path.",
        )

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: object) -> None:
        super()._add_subcommands(parser, **kwargs)
        # `sweep` is dispatched by `main` before LightningCLI parses anything; registering its
        # parser here makes `ada --help` list it beside Lightning's four subcommands.
        from ada_modules.sweep import build_parser

        sweep_parser = build_parser()
        parser._subcommands_action.add_subcommand(
            "sweep", sweep_parser, help=sweep_parser.description
        )

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            # Our components validate their arguments in __init__; a bad value is a user error.
            # jsonargparse wraps the component's own error: report the innermost one.
            cause: BaseException = error
            while isinstance(cause.__cause__ or cause.__context__, (ValueError, TypeError)):
                cause = cause.__cause__ or cause.__context__
            raise _InstantiationError(f"{type(cause).__name__}: {cause}") from error

    def _write_metrics(self) -> None:
        path = self.config[self.subcommand].get("metrics_file")
        if not path or self.trainer.global_rank != 0:
            return
        metrics = {}
        for name, value in self.trainer.callback_metrics.items():
            number = float(value)
            metrics[name] = number if math.isfinite(number) else None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(metrics, f, indent=2, sort_keys=True)
        os.replace(tmp, path)

    def after_fit(self) -> None:
        self._write_metrics()

    def after_validate(self) -> None:
        self._write_metrics()

    def after_test(self) -> None:
        self._write_metrics()

    def after_predict(self) -> None:
        self._write_metrics()


_DETAIL_MARKERS = (
    "Expected a",
    "has no attribute",
    "No module named",
    "does not correspond to a subclass",
    "does not exist",
    "unrecognized arguments",
    "is not accepted",
)


def _one_line(error: BaseException) -> str:
    """Condense a (possibly nested, multi-line) jsonargparse error to one line naming the culprit.

    jsonargparse explains a failed nested value as a tree: ``Parser key "model": Does not validate
    against any of the Union subtypes ... - Problem with given class_path '...': Parser key
    "optimizer": ... has no attribute 'Adamz'``. The result joins the nested keys into a dotted
    path and keeps the innermost explanation: ``model.optimizer: module 'torch.optim' has no
    attribute 'Adamz'``.
    """
    lines = [line.strip().lstrip("- ").strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line and line != "Expected a <class 'NoneType'>"]
    if not lines:
        return type(error).__name__
    detail_index = next(
        (i for i, line in enumerate(lines) if any(m in line for m in _DETAIL_MARKERS)), None
    )
    if detail_index is None:
        return " ".join(lines) if len(lines) <= 2 else f"{lines[0]} {lines[-1]}"
    detail = lines[detail_index].split(". Got value: Namespace(")[0]
    detail = re.sub(r'^Parser key "[^"]+": ', "", detail)
    detail = detail.split("expects a function or a callable class: ")[-1]
    previous = lines[detail_index - 1] if detail_index else ""
    if previous.startswith("Problem with given class_path"):
        detail = f"{previous} {detail}"
    keys = re.findall(r'Parser key "([^"]+)"', "\n".join(lines[: detail_index + 1]))
    return f"{'.'.join(keys)}: {detail}" if keys else detail


def main(args: ArgsType = None) -> None:
    """Entry point of the ``ada`` console script.

    Args:
        args: Command-line arguments without the program name (``sys.argv[1:]`` when ``None``).

    Raises:
        SystemExit: With code 2 and one line on stderr for a user error (unknown class path, wrong
            type, missing config file, bad argument value); with the sweep's non-zero return code
            when a ``sweep`` fails. A successful subcommand returns normally.
    """
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv and argv[0] == "sweep":
        from ada_modules.sweep import sweep_main

        code = sweep_main(argv[1:])
        if code:
            sys.exit(code)
        return

    import importlib

    for package in _REGISTERED_PACKAGES:
        importlib.import_module(package)

    try:
        AdaCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"version": ada_modules.__version__, "exit_on_error": False},
            args=args,
        )
    except ArgumentError as error:
        print(f"ada: error: {_one_line(error)}", file=sys.stderr)
        sys.exit(2)
    except _InstantiationError as error:
        print(f"ada: error: {_one_line(error)}", file=sys.stderr)
        sys.exit(2)
