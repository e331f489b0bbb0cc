from functools import partial

import numpy as np
import pytest
import scipy.linalg
import torch

from ada_modules.data.shapes import ShapesDataModule, generate_shapes
from ada_modules.errors import InputError
from ada_modules.models.autoencoder import AutoencoderKLModule
from ada_modules.models.frechet import frechet_distance
from ada_modules.models.shapes_judge import (
    DEFAULT_JUDGE_PATH,
    ShapesJudge,
    ShapesJudgeModule,
    load_shapes_judge,
)


def test_shipped_judge_classifies_fresh_images():
    assert DEFAULT_JUDGE_PATH.is_file()
    judge = load_shapes_judge()
    assert not judge.training and not any(p.requires_grad for p in judge.parameters())
    images, labels = generate_shapes(500, seed=555_557)  # not a training seed (3 * seed)
    with torch.no_grad():
        accuracy = (judge(images).argmax(1) == labels).float().mean().item()
        features = judge.features(images)
    assert accuracy >= 0.9
    assert features.shape == (500, judge.feature_dim) and 64 <= judge.feature_dim <= 128


def test_shipped_judge_features_separate_real_from_degraded_images():
    judge = load_shapes_judge()
    first, _ = generate_shapes(400, seed=11)
    second, _ = generate_shapes(400, seed=13)
    blurred = torch.nn.functional.avg_pool2d(second, 3, stride=1, padding=1)
    with torch.no_grad():
        real, other, blurry = (judge.features(x) for x in (first, second, blurred))
    assert frechet_distance(real, other) < 0.5 * frechet_distance(real, blurry)


def _reference_fd(a: np.ndarray, b: np.ndarray) -> float:
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = scipy.linalg.sqrtm(cov_a @ cov_b).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * root))


def test_frechet_distance_matches_scipy_sqrtm():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(300, 16)) @ rng.normal(size=(16, 16))
    b = rng.normal(size=(400, 16)) @ rng.normal(size=(16, 16)) * 0.5 + 0.3
    expected = _reference_fd(a, b)
    assert frechet_distance(torch.from_numpy(a), torch.from_numpy(b)) == pytest.approx(
        expected, rel=1e-6
    )
    assert frechet_distance(torch.from_numpy(b), torch.from_numpy(a)) == pytest.approx(
        expected, rel=1e-6
    )
    # float32 features are computed in float64 too (same values as their float64 copies)
    a32, b32 = torch.from_numpy(a).float(), torch.from_numpy(b).float()
    assert frechet_distance(a32, b32) == pytest.approx(
        _reference_fd(a32.double().numpy(), b32.double().numpy()), rel=1e-6
    )


def test_frechet_distance_of_a_set_to_itself_is_zero_even_when_rank_deficient():
    x = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    assert abs(frechet_distance(x, x)) < 1e-9
    low_rank = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))  # n < F
    assert abs(frechet_distance(low_rank, low_rank)) < 1e-9
    assert frechet_distance(x[:, :1], x[:, :1] + 1.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("a", "b", "match"),
    [
        (torch.zeros(1, 3), torch.zeros(5, 3), "a needs at least 2 samples"),
        (torch.zeros(5, 3), torch.zeros(1, 3), "b needs at least 2 samples"),
        (torch.zeros(5, 3), torch.zeros(5, 4), "same feature dimension"),
        (torch.zeros(5), torch.zeros(5, 1), "a must be a 2-D tensor"),
        (torch.zeros(5, 3), [[0.0] * 3] * 5, "b must be a 2-D tensor"),
        (torch.full((5, 3), float("nan")), torch.zeros(5, 3), "non-finite"),
    ],
)
def test_frechet_distance_errors(a, b, match):
    with pytest.raises(InputError, match=match):
        frechet_distance(a, b)


def test_export_load_round_trip_and_fit_export(cpu_trainer, tmp_path, seed):
    module = ShapesJudgeModule(
        channels=[8, 16],
        export_path=str(tmp_path / "judge.pt"),
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
    )
    data = ShapesDataModule(train_size=16, val_size=8, test_size=8, batch_size=8)
    cpu_trainer(max_steps=2, limit_val_batches=1).fit(module, data)
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".pt"] == ["judge.pt"]
    judge = load_shapes_judge(tmp_path / "judge.pt")
    assert judge.channels == [8, 16] and judge.feature_dim == 16
    for name, weight in module.judge.state_dict().items():
        assert torch.equal(judge.state_dict()[name], weight), name
    module.eval()
    images, _ = generate_shapes(4, seed=0)
    with torch.no_grad():
        assert torch.equal(judge(images), module(images))


def test_missing_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(InputError, match="shapes judge asset not found"):
        load_shapes_judge(tmp_path / "nope.pt")
    vae_file = AutoencoderKLModule().export(tmp_path / "vae.pt", torch.zeros(2, 3, 32, 32))
    with pytest.raises(InputError, match="not a valid shapes judge asset"):
        load_shapes_judge(vae_file)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ShapesJudge(channels=[]), "channels"),
        (lambda: ShapesJudge(channels=[8, 0]), "channels"),
        (lambda: ShapesJudge(num_classes=1), "num_classes"),
        (lambda: ShapesJudgeModule(export_path=""), "export_path"),
        (lambda: ShapesJudge().features(torch.zeros(2, 1, 32, 32)), "images"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(InputError, match=match):
        call()
