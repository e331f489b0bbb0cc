"""Shared pytest set-up: the Triton interpreter on CPU machines, markers and a seed fixture."""

import os
import pathlib
from collections.abc import Callable

import torch

# Triton reads TRITON_INTERPRET when it is first imported, so set it before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (``make test`` runs one worker per core) each worker gets one thread, and so
# do the processes it starts (CLI and sweep runs), so that workers do not fight over the cores.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import pytest  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402

from ada_modules.kernels import triton_available  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# Models of the sweep fixtures import each other from their folder, which the sweep puts on
# PYTHONPATH; they are not test modules and have no doctests.
collect_ignore_glob = ["sweep_fixtures/*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_triton = pytest.mark.skip(reason="triton is not installed (e.g. macOS)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "triton" in item.keywords and not triton_available():
            item.add_marker(skip_triton)


@pytest.fixture
def seed() -> int:
    """Seed python, numpy and torch (all devices) with a fixed value and return it."""
    seed_everything(1234, workers=True, verbose=False)
    return 1234


@pytest.fixture
def cpu_trainer(tmp_path: pathlib.Path) -> Callable[..., Trainer]:
    """Build a quiet CPU ``Trainer`` writing under ``tmp_path``; keyword arguments override."""

    def build(**kwargs: object) -> Trainer:
        defaults = {
            "accelerator": "cpu",
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": tmp_path,
        }
        return Trainer(**{**defaults, **kwargs})

    return build
