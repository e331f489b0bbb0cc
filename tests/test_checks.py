"""The shared number predicates, and components that use them taking NumPy numbers."""

import math

import numpy as np
import pytest
import torch

from ada_modules.checks import check_finite_real, is_finite_real, is_int, is_real
from ada_modules.errors import InputError
from ada_modules.fl.aggregators import max_tolerated
from ada_modules.offline_rl.losses import expectile_loss


@pytest.mark.parametrize("value", [0, -3, np.int64(5), np.uint8(2)])
def test_integers_count(value):
    assert is_int(value) and is_real(value) and is_finite_real(value)


@pytest.mark.parametrize("value", [True, np.bool_(False), 2.0, "2", None, torch.tensor(2)])
def test_bools_floats_strings_and_tensors_are_not_integers(value):
    assert not is_int(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan")])
def test_non_finite_reals_are_real_but_not_finite(value):
    assert is_real(value) and not is_finite_real(value)


@pytest.mark.parametrize("value", [True, "0.5", None, torch.tensor(0.5), 1j])
def test_check_finite_real_names_non_numbers(value):
    with pytest.raises(InputError, match=r"^lr must be a real number, got "):
        check_finite_real("lr", value)


def test_check_finite_real_returns_a_float():
    value = check_finite_real("lr", np.float32(0.25))
    assert type(value) is float and value == 0.25


def test_numpy_numbers_reach_the_components():
    """NumPy numbers (from a sweep grid or a pandas row) are numbers in every component."""
    diff = torch.tensor([2.0, -1.0])
    assert expectile_loss(diff, np.float32(0.75)) == expectile_loss(diff, 0.75)
    assert max_tolerated("krum", np.int64(9)) == max_tolerated("krum", 9)
