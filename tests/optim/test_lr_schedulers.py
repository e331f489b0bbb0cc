import math

import pytest
import torch

from ada_modules.optim import WarmupCosineLR


def _rates(steps: int, **kwargs) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = WarmupCosineLR(optimizer, **kwargs)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_linear_warmup_then_cosine_to_the_floor():
    rates = _rates(16, warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    assert rates[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])  # peak at step warmup_steps - 1
    middle = 0.2 + (2.0 - 0.2) * 0.5 * (1 + math.cos(math.pi * 4 / 8))
    assert rates[8] == pytest.approx(middle)
    assert all(a >= b for a, b in zip(rates[3:12], rates[4:13], strict=False))
    assert rates[12:] == pytest.approx([0.2] * 4)  # min_lr_ratio * base lr after total_steps


def test_no_warmup_starts_at_the_base_rate():
    assert _rates(1, warmup_steps=0, total_steps=10)[0] == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"warmup_steps": -1, "total_steps": 10}, "warmup_steps"),
        ({"warmup_steps": 10, "total_steps": 10}, "total_steps"),
        ({"warmup_steps": 1, "total_steps": 10, "min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"warmup_steps": 1, "total_steps": 10, "min_lr_ratio": None}, "min_lr_ratio"),
        ({"warmup_steps": 1, "total_steps": 10, "min_lr_ratio": "0.1"}, "min_lr_ratio"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=name):
        WarmupCosineLR(optimizer, **kwargs)
