"""Task arithmetic, TIES and DARE against hand-computed values."""

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.merging import dare, task_arithmetic, ties


def _models():
    base = {"w": torch.tensor([1.0, 1.0, 1.0]), "count": torch.tensor([5])}
    a = {"w": torch.tensor([2.0, -1.0, 1.5]), "count": torch.tensor([6])}  # τ = [1, -2, 0.5]
    b = {"w": torch.tensor([4.0, 2.0, 0.75]), "count": torch.tensor([7])}  # τ = [3, 1, -0.25]
    return base, a, b


def test_task_arithmetic():
    base, a, b = _models()
    merged = task_arithmetic(base, [a, b], weights=[1.0, 0.5])
    # 1 + [1, -2, 0.5] + 0.5 [3, 1, -0.25]
    assert merged["w"].tolist() == [3.5, -0.5, 1.375]
    assert merged["count"].tolist() == [5]
    normalized = task_arithmetic(base, [a, b], weights=[1.0, 0.5], normalize=True)
    # 1 + (1 [1, -2, 0.5] + 0.5 [3, 1, -0.25]) / (1 + 0.5)
    assert torch.allclose(normalized["w"], 1 + torch.tensor([2.5, -1.5, 0.375]) / 1.5)


def test_ties_trims_elects_and_takes_the_disjoint_mean():
    base, a, b = _models()
    # density 2/3 keeps 2 of 3: τ̂_a = [1, -2, 0], τ̂_b = [3, 1, 0]; weighted sum [1+1.5, -2+0.5, 0]
    # signs [+, -, 0]; agreeing: a at 0 and 1, b at 0; mean (1 + 1.5)/(1 + 0.5), -2/1, 0.
    merged = ties(base, [a, b], weights=[1.0, 0.5], density=2 / 3)
    assert torch.allclose(merged["w"], torch.tensor([1 + 2.5 / 1.5, 1 - 2.0, 1.0]))
    summed = ties(base, [a, b], weights=[1.0, 0.5], density=2 / 3, normalize=False)
    assert torch.allclose(summed["w"], torch.tensor([1 + 2.5, 1 - 2.0, 1.0]))


def test_ties_with_full_density_elects_signs_without_trimming():
    base, a, b = _models()
    # sums [4, -1, 0.25]: signs [+, -, +]; agreeing a: [1, -2, 0.5], b: [3, -, -]
    merged = ties(base, [a, b], density=1.0)
    assert torch.allclose(merged["w"], torch.tensor([1 + 2.0, 1 - 2.0, 1 + 0.5]))


def test_dare_with_density_one_is_task_arithmetic():
    base, a, b = _models()
    expected = task_arithmetic(base, [a, b], weights=[0.3, 0.7])
    merged = dare(base, [a, b], weights=[0.3, 0.7], density=1.0)
    assert torch.allclose(merged["w"], expected["w"])
    with_ties = dare(base, [a, b], density=1.0, consensus="ties", normalize=True)
    assert torch.allclose(with_ties["w"], ties(base, [a, b], density=1.0)["w"])


def test_dare_drops_and_rescales_with_the_generators_mask():
    base = {"w": torch.zeros(1000)}
    tuned = {"w": torch.ones(1000)}
    generator = torch.Generator().manual_seed(3)
    merged = dare(base, [tuned], density=0.25, generator=generator)["w"]
    keep = torch.rand(1000, generator=torch.Generator().manual_seed(3)) < 0.25
    assert torch.equal(merged, torch.where(keep, 4.0, 0.0))
    plain = dare(
        base, [tuned], density=0.25, rescale=False, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(plain["w"], keep.float())


def test_dare_ties_drops_then_elects():
    base = {"w": torch.zeros(2)}
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([-3.0, 4.0])}
    generator = torch.Generator().manual_seed(0)
    merged = dare(base, [a, b], density=0.5, consensus="ties", normalize=True, generator=generator)
    g = torch.Generator().manual_seed(0)
    ka, kb = torch.rand(2, generator=g) < 0.5, torch.rand(2, generator=g) < 0.5
    ta, tb = torch.where(ka, a["w"] * 2, 0.0), torch.where(kb, b["w"] * 2, 0.0)
    sign = torch.sign(ta + tb)
    ma, mb = (torch.sign(ta) == sign) & (sign != 0), (torch.sign(tb) == sign) & (sign != 0)
    count = ma.float() + mb.float()
    expected = torch.where(count > 0, (ta * ma + tb * mb) / count.clamp(min=1), 0.0)
    assert torch.allclose(merged["w"], expected)


def test_dtypes_kept_and_inputs_untouched():
    base = {
        "w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        "d": torch.ones(2, dtype=torch.float64),
    }
    tuned = {
        "w": torch.tensor([3.0, 1.0], dtype=torch.bfloat16),
        "d": torch.zeros(2, dtype=torch.float64),
    }
    copies = [{k: v.clone() for k, v in m.items()} for m in (base, tuned)]
    for merged in (ties(base, [tuned]), dare(base, [tuned]), task_arithmetic(base, [tuned])):
        assert merged["w"].dtype == torch.bfloat16 and merged["d"].dtype == torch.float64
    for original, copy in zip((base, tuned), copies, strict=True):
        assert all(torch.equal(original[k], copy[k]) for k in copy)


@pytest.mark.parametrize("density", [0.0, 1.5, -0.1])
def test_density_outside_the_interval_is_rejected(density):
    base, a, _ = _models()
    with pytest.raises(InputError, match=f"density must be in \\(0, 1\\], got {density}"):
        ties(base, [a], density=density)
    with pytest.raises(InputError, match="density"):
        dare(base, [a], density=density)


def test_weights_length_must_match():
    base, a, b = _models()
    with pytest.raises(InputError, match="weights has 1 entries for 2 specialists"):
        task_arithmetic(base, [a, b], weights=[1.0])
    with pytest.raises(InputError, match="consensus"):
        dare(base, [a], consensus="sum")
