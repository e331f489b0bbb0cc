"""check_compatible messages, task vectors, linear layers and augmented weights."""

import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.merging import check_compatible, linear_layers, task_vectors
from ada_modules.merging.state_dicts import augmented_weight, check_weights, set_augmented_weight


def _base():
    return {
        "features.1.weight": torch.zeros(4, 3),
        "features.1.bias": torch.zeros(4),
        "norm.weight": torch.ones(4),
        "head.weight": torch.zeros(2, 4),
        "steps": torch.tensor(3),
    }


def test_compatible_state_dicts_pass():
    check_compatible(_base(), [_base(), _base()], names=["a", "b"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d.update({"features.1.weight": torch.zeros(4, 4)}),
            "specialist 'rot90': key 'features.1.weight' has shape (4, 4), the base has (4, 3)",
        ),
        (
            lambda d: d.update({"head.weight": torch.zeros(2, 4, dtype=torch.float16)}),
            "specialist 'rot90': key 'head.weight' has dtype torch.float16, the base has "
            "torch.float32",
        ),
        (lambda d: d.pop("norm.weight"), "specialist 'rot90': key 'norm.weight' is missing"),
        (
            lambda d: d.update({"extra.bias": torch.zeros(1)}),
            "specialist 'rot90': key 'extra.bias' is not in the base",
        ),
    ],
)
def test_check_compatible_names_the_model_and_key(change, message):
    other = _base()
    change(other)
    with pytest.raises(InputError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_compatible(_base(), [_base(), other], names=["ok", "rot90"])


def test_check_compatible_without_names_uses_the_index():
    other = _base()
    other["head.weight"] = torch.zeros(3, 4)
    with pytest.raises(InputError, match="^specialist 1: key 'head.weight'"):
        check_compatible(_base(), [_base(), other])


def test_task_vectors_skip_integer_tensors():
    base = _base()
    tuned = {**base, "head.weight": torch.full((2, 4), 2.0), "steps": torch.tensor(9)}
    (vector,) = task_vectors(base, [tuned])
    assert "steps" not in vector
    assert torch.equal(vector["head.weight"], torch.full((2, 4), 2.0))
    assert torch.equal(vector["features.1.weight"], torch.zeros(4, 3))


def test_a_tie_stored_once_is_compatible_and_has_its_vector_under_each_key():
    shared = torch.zeros(4, 3)
    base = {"embed.weight": shared, "head.weight": shared, "b": torch.zeros(3)}
    tuned = {"embed.weight": torch.ones(4, 3), "b": torch.zeros(3)}  # as save_pretrained writes
    (vector,) = task_vectors(base, [tuned])
    assert torch.equal(vector["head.weight"], torch.ones(4, 3))
    assert torch.equal(vector["embed.weight"], torch.ones(4, 3))
    with pytest.raises(InputError, match="specialist 0: key 'embed.weight' is missing"):
        check_compatible(base, [{"head.weight": torch.ones(4, 3), "b": torch.zeros(3)}])
    untied = {"embed.weight": torch.zeros(4, 3), "head.weight": torch.zeros(4, 3)}
    with pytest.raises(InputError, match="specialist 0: key 'head.weight' is missing"):
        check_compatible(untied, [tuned])  # no tie in the base: every key is needed


def test_linear_layers():
    base = {**_base(), "odd.weight": torch.zeros(2, 2), "odd.bias": torch.zeros(3)}
    assert linear_layers(base) == ["features.1", "head"]
    assert linear_layers({"weight": torch.zeros(2, 2)}) == [""]


def test_augmented_weight_round_trip_keeps_dtypes():
    base = {"fc.weight": torch.arange(6.0).view(2, 3).half(), "fc.bias": torch.tensor([7.0, 8.0])}
    augmented = augmented_weight(base, "fc")
    assert augmented.dtype == torch.float64
    assert augmented.tolist() == [[0, 1, 2, 7], [3, 4, 5, 8]]
    target = {}
    set_augmented_weight(target, base, "fc", augmented + 1)
    assert target["fc.weight"].dtype == torch.float16 and target["fc.bias"].dtype == torch.float32
    assert target["fc.bias"].tolist() == [8.0, 9.0]


def test_check_weights():
    assert check_weights(None, 3) == [1.0, 1.0, 1.0]
    with pytest.raises(InputError, match="weights has 1 entries for 2 specialists"):
        check_weights([1.0], 2)
    with pytest.raises(InputError, match="weights must be numbers"):
        check_weights([1.0, "a"], 2)
