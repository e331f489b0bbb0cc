"""``AdaCLI``: the LightningCLI behind the ``ada`` command.

It adds ``--metrics_file``, lists ``sweep`` in ``ada --help``, tries the configured optimizer,
scheduler and cache factory once on a dummy when the config is read (so a bad value is reported
before training, naming its key), gives every run a progress bar that counts towards the real
budget, and after ``ada fit`` draws the training curves and prints a short summary.
The ``ada`` console script itself (:func:`ada_modules.cli.main`) imports this module only when a
subcommand runs, so that ``ada --help`` stays fast.

Example::

    from ada_modules.ada_cli import AdaCLI

    AdaCLI(subclass_mode_model=True, subclass_mode_data=True, auto_configure_optimizers=False,
           args=["fit", "-c", "cli_configs/quickstart.yaml", "--trainer.max_steps=10"])
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ada_modules.callbacks import BudgetProgressBar, TrainingCurves, fit_summary
from ada_modules.errors import InputError

__all__ = ["AdaCLI", "InstantiationError"]

# Model init args holding factories that can be tried on a dummy before anything runs.
_OPTIMIZER_ARGS = ("optimizer", "aux_optimizer")
_SCHEDULER_ARGS = ("lr_scheduler",)
_CACHE_ARGS = ("cache_factory",)


_LIGHTNING_CKPT_NAMES = ("best", "last", "hpc", "registry")


def _checkpoint_folders(trainer_config: Any) -> list[str]:
    """The ``dirpath`` of each ``ModelCheckpoint`` in a trainer config, as strings."""
    callbacks = getattr(trainer_config, "get", lambda key: None)("callbacks") or []
    folders = []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        class_path = getattr(callback, "class_path", "") or ""
        init_args = getattr(callback, "init_args", None)
        dirpath = init_args.get("dirpath") if hasattr(init_args, "get") else None
        if class_path.endswith("ModelCheckpoint") and dirpath:
            folders.append(str(dirpath))
    return folders


def _warn_if_schedule_outlasts_fit(config: Any, max_steps: int) -> None:
    """Warn when a ``WarmupCosineLR`` decays over more steps than the fit runs (``--trainer.max_steps
    200`` on a config whose schedule has ``total_steps: 2000`` never lowers the rate)."""
    scheduler = getattr(getattr(config.get("model"), "init_args", None), "get", lambda _: None)(
        "lr_scheduler"
    )
    if not str(getattr(scheduler, "class_path", "")).endswith("WarmupCosineLR"):
        return
    total = scheduler.init_args.get("total_steps")
    if isinstance(total, int) and 0 < max_steps < total:
        rank_zero_warn(
            f"lr_scheduler WarmupCosineLR decays over total_steps={total}, but the fit stops at "
            f"trainer.max_steps={max_steps}: the rate follows only the first "
            f"{max_steps / total:.0%} of its schedule. Pass "
            f"--model.init_args.lr_scheduler.init_args.total_steps={max_steps} as well"
        )


class InstantiationError(Exception):
    """A component rejected its configured value while the CLI built or tried it.

    ``key`` is the config key (``model.optimizer``), ``reason`` the component's own message.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key = key
        self.reason = reason


def _innermost(error: BaseException) -> BaseException:
    """The deepest ValueError/TypeError in ``error``'s cause chain (jsonargparse wraps them)."""
    while isinstance(error.__cause__ or error.__context__, (ValueError, TypeError)):
        error = error.__cause__ or error.__context__
    return error


def _reason(error: BaseException) -> str:
    """The message of one of our InputErrors as is; any other error prefixed with its type."""
    return str(error) if isinstance(error, InputError) else f"{type(error).__name__}: {error}"


def try_factories(model: object, class_paths: dict[str, str] | None = None) -> None:
    """Build the model's optimizer, scheduler and cache factories once on a dummy.

    A factory that rejects its configured values (torch's ``AdamW(lr=-1)``, a KV cache whose
    group size does not divide the head dimension) raises :class:`InstantiationError` naming the
    init arg, before any data is loaded or step taken. Factories that are not set are skipped.
    ``class_paths`` (init arg -> configured class path) only makes the message more precise.
    """
    class_paths = class_paths or {}
    dummy = torch.nn.Parameter(torch.zeros(8, 8))
    optimizer = None
    for name in _OPTIMIZER_ARGS:
        factory = getattr(model, name, None)
        if callable(factory):
            built = _call(name, class_paths.get(name), factory, [dummy])
            optimizer = optimizer or built
    for name in _SCHEDULER_ARGS:
        factory = getattr(model, name, None)
        if callable(factory) and optimizer is not None:
            _call(name, class_paths.get(name), factory, optimizer)
    config = getattr(getattr(model, "model", None), "config", None)
    for name in _CACHE_ARGS:
        factory = getattr(model, name, None)
        if callable(factory) and config is not None:
            _call(name, class_paths.get(name), factory, config=config)


def _call(
    name: str, class_path: str | None, factory: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    try:
        return factory(*args, **kwargs)
    except (ValueError, TypeError) as error:
        cause = _innermost(error)
        what = f"{class_path} rejected its arguments: " if class_path else ""
        raise InstantiationError(f"model.{name}", f"{what}{_reason(cause)}") from error


def _explicit_model_keys(command_line: Sequence[str]) -> list[str]:
    """The dotted ``model.*`` keys set by ``--model.KEY[=VALUE]`` arguments, in order.

    Examples:
        >>> _explicit_model_keys(["test", "-c", "a.yaml", "--model.init_args.steps=4",
        ...                       "--model.eval_steps", "8", "--trainer.max_steps=2"])
        ['model.init_args.steps', 'model.eval_steps']
    """
    keys = []
    for token in command_line:
        if token.startswith("--model."):
            keys.append(token[2:].split("=", 1)[0])
    return keys


class AdaCLI(LightningCLI):
    """LightningCLI with ``--metrics_file``, ``sweep`` in its help, early checks and a summary.

    - ``--metrics_file PATH`` writes the run's final ``trainer.callback_metrics`` as JSON (numbers,
      ``null`` for NaN or infinity) after ``fit``/``validate``/``test``/``predict``; the sweep
      runner collects results with it.
    - The model's ``optimizer``, ``lr_scheduler`` and ``cache_factory`` are tried once on a dummy
      after instantiation (see :func:`try_factories`).
    - Unless the config sets its own, the Trainer gets a
      :class:`~ada_modules.callbacks.BudgetProgressBar` and, for ``fit``, a
      :class:`~ada_modules.callbacks.TrainingCurves` callback; after ``fit`` rank zero prints
      :func:`~ada_modules.callbacks.fit_summary`.
    """

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self._command_line = list(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """Lightning's, except that model arguments given on the command line win.

        With ``--ckpt_path`` naming a file, Lightning replaces the model's config by the
        checkpoint's hyperparameters, also over explicit ``--model.*`` arguments (Lightning issue
        #20801), so e.g. ``ada test --ckpt_path run.ckpt --model.init_args.eval_steps=76`` would
        silently test with the training value. The checkpoint still wins over config files.
        """
        if not self.config.get("subcommand"):
            return
        self._check_ckpt_path()
        before = self.config.clone()
        super()._parse_ckpt_path()
        subcommand = self.config.subcommand
        for key in _explicit_model_keys(self._command_line):
            for candidate in (key, key.replace("model.", "model.init_args.", 1)):
                full = f"{subcommand}.{candidate}"
                if full in before:
                    self.config[full] = before[full]
                    break

    def _check_ckpt_path(self) -> None:
        """Name a ``--ckpt_path`` that is not there, before anything is built.

        ``last`` stays Lightning's: the model is built from the config (unlike a file path, whose
        saved hyperparameters win over config files, so that a test-time config such as a cache
        applies); but outside ``fit`` (which starts afresh without one) a config whose
        ``ModelCheckpoint`` folders hold no ``last*.ckpt`` is an error rather than an evaluation of
        the untrained model.
        """
        subcommand = self.config.subcommand
        config = self.config[subcommand]
        ckpt_path = config.get("ckpt_path")
        if not isinstance(ckpt_path, str | os.PathLike):
            return
        ckpt_path = str(ckpt_path)
        if ckpt_path == "last" and subcommand != "fit":
            folders = _checkpoint_folders(config.get("trainer"))
            if folders and not any(any(Path(f).glob("last*.ckpt")) for f in folders):
                raise InputError(
                    f"ckpt_path: no last checkpoint in {', '.join(folders)} (run `ada fit` with "
                    "this config first, or give a checkpoint's path)"
                )
        elif ckpt_path not in _LIGHTNING_CKPT_NAMES and "://" not in ckpt_path:
            if not ckpt_path.startswith("registry") and not Path(ckpt_path).exists():
                raise InputError(f"ckpt_path: checkpoint not found: {ckpt_path}")

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
        # parser here makes the full help list it beside Lightning's four subcommands.
        from ada_modules.sweep import build_parser

        sweep_parser = build_parser()
        parser._subcommands_action.add_subcommand(
            "sweep", sweep_parser, help=sweep_parser.description
        )

    def _set_seed(self) -> None:
        """Lightning's, with its "Seed set to N" line held back until the classes are built, so
        that a bad value found while building them is the only line on stderr."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        seed = config.get("seed_everything")
        if seed is False:
            return
        config["seed_everything"] = seed_everything(None if seed is True else seed, True, False)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            # Our components validate their arguments in __init__; a bad value is a user error.
            # jsonargparse wraps the component's own error: report the innermost one.
            raise InstantiationError("", _reason(_innermost(error))) from error
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("seed_everything") is not False:
            rank_zero_info(f"Seed set to {config.get('seed_everything')}")

    def _factory_class_paths(self) -> dict[str, str]:
        model_config = self._get(self.config, "model", default=None)
        init_args = getattr(model_config, "init_args", None) or {}
        paths = {}
        for name in (*_OPTIMIZER_ARGS, *_SCHEDULER_ARGS, *_CACHE_ARGS):
            value = init_args.get(name) if hasattr(init_args, "get") else None
            class_path = getattr(value, "class_path", None) or (
                value.get("class_path") if isinstance(value, dict) else None
            )
            if class_path:
                paths[name] = class_path
        return paths

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        # Runs after the model is built and before the Trainer is: try its factories first.
        try_factories(self.model, self._factory_class_paths())
        config = self._get(self.config_init, "trainer", default={})
        given = config.get("callbacks") or []
        given = list(given) if isinstance(given, list) else [given]
        extra = []
        wants_bar = config.get("enable_progress_bar") is not False
        if wants_bar and not any(isinstance(c, ProgressBar) for c in given):
            extra.append(BudgetProgressBar())
        if self.subcommand == "fit" and not any(isinstance(c, TrainingCurves) for c in given):
            extra.append(TrainingCurves())
        try:
            return super().instantiate_trainer(**{"callbacks": given + extra, **kwargs})
        except MisconfigurationException as error:  # options the Trainer cannot use together
            raise InstantiationError("trainer", str(error).splitlines()[0]) from error

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

    def before_fit(self) -> None:
        _warn_if_schedule_outlasts_fit(self.config.fit, self.trainer.max_steps)

    def after_fit(self) -> None:
        self._write_metrics()
        if self.trainer.is_global_zero:
            print(fit_summary(self.trainer), flush=True)

    def after_validate(self) -> None:
        self._write_metrics()

    def after_test(self) -> None:
        self._write_metrics()

    def after_predict(self) -> None:
        self._write_metrics()
