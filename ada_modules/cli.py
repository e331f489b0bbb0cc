"""The ``ada`` command: Lightning's CLI for every model, datamodule, callback and optimizer here.

``ada fit|validate|test|predict -c CONFIG.yaml`` are LightningCLI's subcommands (run by
:class:`~ada_modules.ada_cli.AdaCLI`), with the model and the data chosen by class path in YAML
(subclass mode), so a user's own LightningModule works as well as ours. ``ada sweep SPEC.yaml``
runs a YAML config sweep (see :mod:`ada_modules.sweep`).

Optimizers are injected, never auto-configured: a LightningModule of this library takes
``optimizer: OptimizerCallable`` (and ``lr_scheduler: LRSchedulerCallable | None``) as init args and
builds them in ``configure_optimizers``, which runs after ``configure_model`` (so FSDP2 sharding
sees the real parameters). In YAML they sit under ``model.init_args``.

This module imports neither torch nor Lightning: ``ada --help`` and ``ada --version`` answer
at once, and Lightning is imported only when a subcommand runs.

A user error (an unknown class path, a wrong type, a bad value found while building or trying
the components, a YAML syntax error, an :class:`~ada_modules.errors.InputError` raised later in the
run) is reported as one line on stderr, exit code 2. Anything else is a bug and keeps its traceback.

Example:
    From a shell::

        ada fit -c cli_configs/quickstart.yaml
        ada test -c cli_configs/quickstart.yaml --ckpt_path runs/quickstart/checkpoints/last.ckpt

    From Python (the same code path, in-process)::

        from ada_modules.cli import main
        main(["fit", "-c", "cli_configs/quickstart.yaml", "--trainer.max_steps=10"])
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import ada_modules
from ada_modules.errors import InputError

__all__ = ["SUBCOMMANDS", "main", "top_level_help"]

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

# The subcommands of `ada` and their one-line help; tests/test_cli.py checks that they are the
# ones the full LightningCLI parser registers.
SUBCOMMANDS = {
    "fit": "Train a model (Trainer.fit).",
    "validate": "Run one evaluation epoch over the validation set.",
    "test": "Run one evaluation epoch over the test set.",
    "predict": "Run inference on the predict set.",
    "sweep": "Run a YAML sweep of configs (variants x seeds); tabulate and plot the metrics.",
}


def top_level_help() -> str:
    """The text of ``ada --help`` (built without importing Lightning)."""
    names = ",".join(SUBCOMMANDS)
    rows = "\n".join(f"    {name:<10}{text}" for name, text in SUBCOMMANDS.items())
    return (
        f"usage: ada [-h] [--version] {{{names}}} ...\n\n"
        "Lightning components for seventeen adaptive techniques: train, evaluate and sweep from "
        "YAML.\n\n"
        "options:\n"
        "  -h, --help    Show this help message and exit.\n"
        "  --version     Print version and exit.\n\n"
        "subcommands (`ada SUBCOMMAND --help` lists a subcommand's options):\n"
        f"{rows}\n\n"
        "example:\n"
        "    ada fit  -c cli_configs/quickstart.yaml\n"
        "    ada test -c cli_configs/quickstart.yaml --ckpt_path last\n"
    )


_DETAIL_MARKERS = (
    "Expected a",
    "has no attribute",
    "No module named",
    "does not correspond to a subclass",
    "does not exist",
    "unrecognized arguments",
    "is not accepted",
)


_DOTTED_PATH = re.compile(r"Expected a path but \w[\w.]*\.\w+ either not accessible")


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
    details = [i for i, line in enumerate(lines) if any(m in line for m in _DETAIL_MARKERS)]
    # "Expected a path but VALUE ..." is jsonargparse trying the value as a file; when the value
    # is not a dotted class path and a more specific reason follows, that reason is the cause
    guessed_file = [
        i
        for i in details
        if lines[i].startswith("Expected a path but") and not _DOTTED_PATH.match(lines[i])
    ]
    specific = [i for i in details if i not in guessed_file]
    detail_index = (specific or details or [None])[0]
    if detail_index is None:
        return " ".join(lines) if len(lines) <= 2 else f"{lines[0]} {lines[-1]}"
    detail = lines[detail_index].split(". Got value: Namespace(")[0]
    detail = re.sub(r'^Parser key "[^"]+": ', "", detail)
    detail = detail.split("expects a function or a callable class: ")[-1]
    given = next((line for line in lines[detail_index:] if line.startswith("Given value: ")), "")
    if detail.startswith("Expected a <class") and given:
        detail += f", got {given.removeprefix('Given value: ').split('. Got value:')[0]}"
    previous = lines[detail_index - 1] if detail_index else ""
    if previous.startswith("Problem with given class_path"):
        detail = f"{previous} {detail}"
    keys = re.findall(r'Parser key "([^"]+)"', "\n".join(lines[: detail_index + 1]))
    return f"{'.'.join(keys)}: {detail}" if keys else detail


def _did_you_mean(message: str) -> str:
    """Append ``did you mean 'X'?`` to a message about a class path that does not resolve."""
    found = re.search(r"module '([\w.]+)' has no attribute '(\w+)'", message)
    path = re.search(r"Expected a path but (\w[\w.]*)\.(\w+) either not accessible", message)
    if not (found or path):
        return message
    module_name, attribute = (found or path).groups()
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return message
    candidates = getattr(module, "__all__", None) or [n for n in dir(module) if n[:1].isupper()]
    close = difflib.get_close_matches(attribute, candidates, n=1, cutoff=0.6)
    return f"{message}; did you mean '{module_name}.{close[0]}'?" if close else message


def _yaml_error(error: BaseException, argv: Sequence[str]) -> str | None:
    """One line for a YAML syntax error: the file, the line and column, and the parser's reason."""
    import yaml

    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, yaml.YAMLError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-c", "--config")]
    files += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    where = files[-1] if len(files) == 1 else " or ".join(files) or "the config"
    mark = getattr(cause, "problem_mark", None)
    position = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    reason = getattr(cause, "problem", None) or str(cause).splitlines()[0]
    context = getattr(cause, "context", None)
    reason = f"{reason} ({context})" if context else reason
    return f"invalid YAML in {where}{position}: {reason}"


def _check_config_files(argv: Sequence[str]) -> None:
    """Name a ``-c`` file that is a folder, empty, or not a mapping of keys (jsonargparse says
    only "Unexpected config"). Syntax errors are left to the parser (see :func:`_yaml_error`)."""
    import yaml

    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-c", "--config")]
    files += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for name in files:
        path = Path(name)
        if path.is_dir():
            _fail(f"config {name} is a folder, not a YAML file")
        if not path.is_file():
            continue  # a missing file (or an inline YAML string): the parser says which
        try:
            content = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        if not isinstance(content, dict):
            kind = "nothing" if content is None else f"a {type(content).__name__}"
            _fail(
                f"config {name}: expected a mapping of keys (trainer:, model:, data:, ...), "
                f"got {kind}"
            )


def _fail(message: str) -> None:
    print(f"ada: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``ada`` console script.

    Args:
        args: Command-line arguments without the program name (``sys.argv[1:]`` when ``None``).

    Raises:
        SystemExit: With code 2 and one line on stderr for a user error (see the module
            docstring); with the sweep's non-zero return code when a ``sweep`` fails. A
            successful subcommand returns normally.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv in ([], ["-h"], ["--help"]):
        print(top_level_help(), end="")
        if not argv:
            _fail("expected a subcommand: " + ", ".join(SUBCOMMANDS))
        return
    if argv == ["--version"]:
        print(ada_modules.__version__)
        return
    if argv[0] == "sweep":
        from ada_modules.sweep import sweep_main

        code = sweep_main(argv[1:])
        if code:
            sys.exit(code)
        return

    from ada_modules.quiet import silence_third_party_noise

    silence_third_party_noise()
    from jsonargparse import ArgumentError

    from ada_modules.ada_cli import AdaCLI, InstantiationError

    _check_config_files(argv)
    for package in _REGISTERED_PACKAGES:
        importlib.import_module(package)
    try:
        AdaCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"version": ada_modules.__version__, "exit_on_error": False},
            args=None if args is None else argv,
        )
    except ArgumentError as error:
        _fail(_yaml_error(error, argv) or _did_you_mean(_one_line(error)))
    except InstantiationError as error:
        reason = _did_you_mean(_one_line(Exception(error.reason)))
        _fail(f"{error.key}: {reason}" if error.key else reason)
    except InputError as error:
        _fail(str(error))


def __getattr__(name: str) -> object:
    # `from ada_modules.cli import AdaCLI` keeps working without making `ada --help` import it.
    if name == "AdaCLI":
        from ada_modules.ada_cli import AdaCLI

        return AdaCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
