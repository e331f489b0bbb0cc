"""Steering vectors: ``mean_diff`` is the difference of the class means, ``pca_diff`` finds the
shared direction of paired differences and signs it towards the positives, ``normalized`` gives
unit directions, plus the validation of directions and activations."""

import io
import math

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.steering import SteeringVector


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_mean_diff_is_the_difference_of_means_per_layer() -> None:
    positive = {0: _randn(5, 8, seed=0), 3: _randn(5, 8, seed=1)}
    negative = {0: _randn(7, 8, seed=2), 3: _randn(7, 8, seed=3)}
    vector = SteeringVector.from_activations(positive, negative)
    assert vector.layers == [0, 3]
    assert vector.hidden_size == 8
    for layer in (0, 3):
        expected = positive[layer].mean(0) - negative[layer].mean(0)
        torch.testing.assert_close(vector.directions[layer], expected)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_pca_diff_is_parallel_to_the_shared_difference_and_points_to_positives(
    sign: float,
) -> None:
    """Paired differences ``3 u + noise`` give a direction parallel to ``u``, whichever sign."""
    axis = _randn(16, seed=4)
    axis = sign * axis / axis.norm()
    negative = _randn(40, 16, seed=5)
    positive = negative + 3.0 * axis + 0.05 * _randn(40, 16, seed=6)
    direction = SteeringVector.from_activations(
        {2: positive}, {2: negative}, method="pca_diff"
    ).directions[2]

    cosine = torch.nn.functional.cosine_similarity(direction, axis, dim=0)
    assert cosine.item() > 0.999  # parallel and pointing the same way as the differences
    assert (positive @ direction).mean() > (negative @ direction).mean()
    # scaled to the mean difference's length along it
    mean_diff = positive.mean(0) - negative.mean(0)
    assert direction.norm().item() == pytest.approx(
        (mean_diff @ direction / direction.norm()).item(), rel=1e-5
    )
    assert direction.norm().item() == pytest.approx(3.0, abs=0.05)


def test_pca_diff_ignores_the_common_offset_of_the_classes() -> None:
    """Differences along one axis, classes spread along another: the direction is the first."""
    negative = torch.zeros(30, 4)
    negative[:, 1] = torch.linspace(-10, 10, 30)  # large spread, shared by both classes
    positive = negative.clone()
    positive[:, 0] += 2.0
    direction = SteeringVector.from_activations({0: positive}, {0: negative}, "pca_diff")
    torch.testing.assert_close(direction.directions[0], torch.tensor([2.0, 0.0, 0.0, 0.0]))


def test_normalized_has_unit_norms_and_keeps_directions() -> None:
    vector = SteeringVector({0: torch.tensor([3.0, 4.0]), 1: torch.tensor([0.0, -0.5])})
    unit = vector.normalized()
    for layer in (0, 1):
        assert unit.directions[layer].norm().item() == pytest.approx(1.0)
        cosine = torch.nn.functional.cosine_similarity(
            unit.directions[layer], vector.directions[layer], dim=0
        )
        assert cosine.item() == pytest.approx(1.0)
    torch.testing.assert_close(vector.directions[0], torch.tensor([3.0, 4.0]))  # not in place


def test_the_vector_keeps_a_copy_of_the_callers_tensors() -> None:
    direction = torch.ones(3, requires_grad=True)
    directions = {0: direction}
    vector = SteeringVector(directions)
    with torch.no_grad():
        direction.fill_(math.nan)
    directions[1] = torch.ones(3)
    assert torch.equal(vector.directions[0], torch.ones(3)) and vector.layers == [0]
    assert not vector.directions[0].requires_grad


def test_saving_the_directions_round_trips_with_weights_only_loading() -> None:
    """The documented save path: ``torch.save(vector.directions)``, ``SteeringVector(load(...))``."""
    vector = SteeringVector({0: _randn(4, seed=0), 2: _randn(4, seed=1)})
    buffer = io.BytesIO()
    torch.save(vector.directions, buffer)
    buffer.seek(0)
    loaded = SteeringVector(torch.load(buffer, weights_only=True))
    assert loaded.layers == [0, 2]
    assert all(torch.equal(loaded.directions[k], vector.directions[k]) for k in (0, 2))


# ------------------------------------------------------------------ bad input


def test_empty_directions_raise() -> None:
    with pytest.raises(InputError, match="at least one layer"):
        SteeringVector({})


def test_nan_direction_raises() -> None:
    with pytest.raises(InputError, match=r"directions\[1\] holds NaN"):
        SteeringVector({0: torch.ones(3), 1: torch.tensor([1.0, math.nan, 0.0])})


def test_directions_of_different_widths_raise() -> None:
    with pytest.raises(InputError, match=r"one width, got widths \[3, 4\]"):
        SteeringVector({0: torch.ones(3), 1: torch.ones(4)})


@pytest.mark.parametrize("layer", [-1, "0", True])
def test_bad_layer_keys_raise(layer: object) -> None:
    with pytest.raises(InputError, match="layer indices >= 0"):
        SteeringVector({layer: torch.ones(3)})


def test_two_dimensional_direction_raises() -> None:
    with pytest.raises(InputError, match=r"directions\[0\] must be a 1-D tensor"):
        SteeringVector({0: torch.ones(2, 3)})


def test_mismatched_layers_raise() -> None:
    with pytest.raises(InputError, match=r"same layers, got \[0, 1\] and \[0\]"):
        SteeringVector.from_activations(
            {0: torch.ones(2, 3), 1: torch.ones(2, 3)}, {0: torch.ones(2, 3)}
        )


def test_one_dimensional_activations_raise() -> None:
    with pytest.raises(InputError, match=r"positive\[0\] must be \(n, hidden\).*\(3,\)"):
        SteeringVector.from_activations({0: torch.ones(3)}, {0: torch.ones(2, 3)})


def test_activations_that_are_not_tensors_raise() -> None:
    with pytest.raises(InputError, match=r"positive\[0\] must be a tensor, got list"):
        SteeringVector.from_activations({0: [[1.0, 2.0]]}, {0: torch.ones(1, 2)})


def test_empty_activations_raise() -> None:
    with pytest.raises(InputError, match=r"negative\[0\] must be \(n, hidden\) with n >= 1"):
        SteeringVector.from_activations({0: torch.ones(2, 3)}, {0: torch.ones(0, 3)})


def test_activations_of_different_widths_raise() -> None:
    with pytest.raises(InputError, match="widths differ: 3 vs 4"):
        SteeringVector.from_activations({0: torch.ones(2, 3)}, {0: torch.ones(2, 4)})


def test_pca_diff_with_unpaired_counts_raises() -> None:
    with pytest.raises(InputError, match="got 3 and 2 rows at layer 0"):
        SteeringVector.from_activations(
            {0: _randn(3, 4, seed=0)}, {0: _randn(2, 4, seed=1)}, method="pca_diff"
        )


def test_unknown_method_raises() -> None:
    with pytest.raises(InputError, match="method must be one of mean_diff, pca_diff, got 'median'"):
        SteeringVector.from_activations({0: torch.ones(2, 3)}, {0: torch.ones(2, 3)}, "median")
