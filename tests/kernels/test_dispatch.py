"""resolve_impl: which implementation a kernel function runs, and the errors when it cannot."""

import pytest
import torch

from ada_modules.kernels import _dispatch
from ada_modules.kernels._dispatch import interpreter_enabled, resolve_impl


def test_torch_is_always_the_reference():
    assert resolve_impl("torch", torch.zeros(2)) == "torch"


def test_auto_picks_torch_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter does not make "auto" use Triton
    assert resolve_impl("auto", torch.zeros(2), torch.zeros(3)) == "torch"


@pytest.mark.triton
def test_triton_on_cpu_with_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton", torch.zeros(2)) == "triton"


@pytest.mark.triton
def test_triton_on_cpu_without_the_interpreter_names_device_and_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"on cpu; .*set TRITON_INTERPRET=1"):
        resolve_impl("triton", torch.zeros(2))


def test_triton_without_triton_installed(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)
    assert resolve_impl("auto", torch.zeros(2)) == "torch"
    with pytest.raises(RuntimeError, match="triton package"):
        resolve_impl("triton", torch.zeros(2))


def test_unknown_impl_is_named():
    with pytest.raises(ValueError, match=r"'fast'"):
        resolve_impl("fast", torch.zeros(2))


def test_tensors_on_different_devices():
    with pytest.raises(ValueError, match=r"one device, got cpu, meta"):
        resolve_impl("auto", torch.zeros(2), torch.zeros(2, device="meta"))


def test_no_tensors():
    with pytest.raises(TypeError, match="at least one tensor"):
        resolve_impl("auto")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False), ("", False)],
)
def test_interpreter_flag_parsing(monkeypatch, value, expected):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_enabled() is expected


def test_interpreter_flag_unset(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert interpreter_enabled() is False


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_cuda_tensors_pick_triton(impl):
    assert resolve_impl(impl, torch.zeros(2, device="cuda")) == "triton"
