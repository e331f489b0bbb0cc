"""Norm library: LMO, dual norm, sharp operator and primal norm agree with their definitions."""

import math

import pytest
import torch

from ada_modules.optim.lmo import NORM_NAMES, Norm, auto_norm, get_norm
from ada_modules.optim.newton_schulz import newton_schulz

# (name, options, shape) for every norm; exact norms first.
EXACT = [
    ("euclidean", {}, (5, 7)),
    ("euclidean", {}, (6,)),
    ("rms", {}, (9,)),
    ("rms", {}, ()),
    ("colnorm", {}, (6, 4)),
    ("colnorm", {"normalized": True, "transpose": True}, (10, 3)),
    ("rownorm", {}, (4, 6)),
    ("rownorm", {"normalized": False, "transpose": True}, (4, 6)),
    ("sign", {}, (3, 5)),
    ("sign", {"normalized": False}, (7,)),
]
SPECTRAL = [
    ("spectral", {}, (12, 8)),
    ("spectral", {}, (6, 16)),
    ("spectral", {}, (3, 8, 5)),
    ("spectral_conv", {}, (8, 3, 3, 3)),
    ("spectral_conv", {}, (6, 4, 5)),
]
ALL = EXACT + SPECTRAL


def _ids(cases: list) -> list[str]:
    return [f"{name}-{'-'.join(map(str, shape)) or 'scalar'}-{opts}" for name, opts, shape in cases]


def _grad(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_registry_covers_every_norm() -> None:
    assert set(NORM_NAMES) == {name for name, _, _ in ALL}
    for name in NORM_NAMES:
        assert get_norm(name).name == name


@pytest.mark.parametrize(("name", "opts", "shape"), ALL, ids=_ids(ALL))
def test_lmo_attains_minus_dual_norm(name: str, opts: dict, shape: tuple[int, ...]) -> None:
    norm = get_norm(name, **opts)
    g = _grad(shape)
    lmo, dual = norm.lmo_and_dual(g)
    assert lmo.shape == g.shape and lmo.dtype == g.dtype and dual.ndim == 0
    assert torch.allclose((g * lmo).sum(), -dual, rtol=1e-10)
    assert torch.equal(norm.lmo(g), lmo) and torch.equal(norm.dual_norm(g), dual)


@pytest.mark.parametrize(("name", "opts", "shape"), EXACT, ids=_ids(EXACT))
def test_exact_norms_are_a_primal_dual_pair(name: str, opts: dict, shape: tuple[int, ...]) -> None:
    norm = get_norm(name, **opts)
    g = _grad(shape)
    lmo, dual = norm.lmo_and_dual(g)
    assert norm.norm(lmo).item() == pytest.approx(1.0, rel=1e-5)
    # No point of the unit ball does better than the LMO: <g, v> >= -||g||_* for ||v|| <= 1.
    for seed in range(1, 9):
        v = _grad(shape, seed)
        v = v / norm.norm(v)
        assert (g * v).sum() >= -dual * (1 + 1e-9)
    # The sharp direction: <g, g#> = ||g#||^2 = ||g||_*^2.
    sharp = norm.sharp(g)
    assert torch.allclose(sharp, -dual * lmo)
    assert (g * sharp).sum().item() == pytest.approx(dual.item() ** 2, rel=1e-6)
    assert norm.norm(sharp).item() == pytest.approx(dual.item(), rel=1e-6)


@pytest.mark.parametrize(("name", "opts", "shape"), SPECTRAL, ids=_ids(SPECTRAL))
def test_spectral_primal_norm_of_lmo_within_ns_band(
    name: str, opts: dict, shape: tuple[int, ...]
) -> None:
    norm = get_norm(name, **opts)
    g = _grad(shape)
    assert 0.68 <= norm.norm(norm.lmo(g)).item() <= 1.3
    # A unit-norm matrix cannot beat the exact dual norm, which the NS estimate approximates.
    for seed in range(1, 5):
        v = _grad(shape, seed)
        assert (g * v / norm.norm(v)).sum() >= -norm.dual_norm(g) * 1.3


def test_euclidean_sharp_is_the_identity_bit_for_bit() -> None:
    norm = get_norm("euclidean")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        g = torch.randn(7, 3).to(dtype) * 1e-3
        sharp = norm.sharp(g)
        assert torch.equal(sharp, g) and sharp.dtype == dtype
        assert sharp.data_ptr() != g.data_ptr()


def test_spectral_lmo_matches_svd_polar_factor() -> None:
    g = _grad((16, 8))
    scale = math.sqrt(16 / 8)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    norm = get_norm("spectral")
    lmo, dual = norm.lmo_and_dual(g)
    direction = -lmo / scale
    cosine = (direction * polar).sum() / (direction.norm() * polar.norm())
    assert cosine > 0.98
    inner = u.T @ direction @ vh.T  # diagonal: same singular vectors as the polar factor
    assert torch.allclose(inner, torch.diag(torch.diagonal(inner)), atol=1e-5)
    assert torch.equal(lmo, -scale * newton_schulz(g))
    # Nuclear-norm estimate: sum of sigma_i times NS singular values in the band.
    ratio = dual / (scale * s.sum())
    assert 0.68 <= ratio <= 1.14
    assert norm.norm(-scale * polar).item() == pytest.approx(1.0)


def test_spectral_lmo_tightens_with_more_steps_on_ill_conditioned_input() -> None:
    g = torch.diag(torch.logspace(0, -3, 16, dtype=torch.float64))
    assert get_norm("spectral").norm(get_norm("spectral").lmo(g)) > 0.68
    sv5 = torch.linalg.svdvals(get_norm("spectral", steps=5).lmo(g))
    sv10 = torch.linalg.svdvals(get_norm("spectral", steps=10).lmo(g))
    assert sv5.min() < 0.6 <= sv10.min()


def test_spectral_stack_is_per_matrix_and_sums_duals() -> None:
    stack = _grad((4, 6, 10))
    norm = get_norm("spectral")
    lmo, dual = norm.lmo_and_dual(stack)
    per = [norm.lmo_and_dual(m) for m in stack]
    assert torch.allclose(lmo, torch.stack([p[0] for p in per]))
    assert torch.allclose(dual, sum(p[1] for p in per))
    assert torch.allclose(norm.norm(lmo), max(norm.norm(p[0]) for p in per))


def test_spectral_conv_reshapes_and_scales_by_kernel_taps() -> None:
    w = _grad((8, 3, 3, 3))
    scale = math.sqrt(8 / 3) / 9
    lmo, dual = get_norm("spectral_conv").lmo_and_dual(w)
    polar = newton_schulz(w.reshape(8, 27))
    assert torch.allclose(lmo, -scale * polar.reshape(w.shape))
    assert torch.allclose(dual, scale * (w.reshape(8, 27) * polar).sum())


def test_sign_and_rms_by_hand() -> None:
    g = torch.tensor([[1.0, -2.0, 0.0, 4.0], [-0.5, 0.0, 3.0, -1.0]])
    sign = get_norm("sign")  # s = 1/fan_in = 1/4
    assert torch.equal(
        sign.lmo(g), torch.tensor([[-0.25, 0.25, 0.0, -0.25], [0.25, 0.0, -0.25, 0.25]])
    )
    assert sign.dual_norm(g).item() == pytest.approx(11.5 / 4)
    assert sign.norm(torch.full((2, 4), -0.25)).item() == 1.0
    b = torch.tensor([3.0, 0.0, -4.0, 0.0])  # ||b|| = 5, n = 4
    rms = get_norm("rms")
    assert torch.allclose(rms.lmo(b), torch.tensor([-1.2, 0.0, 1.6, 0.0]))
    assert rms.dual_norm(b).item() == pytest.approx(10.0)
    assert rms.norm(rms.lmo(b)).item() == pytest.approx(1.0)


def test_colnorm_and_rownorm_by_hand() -> None:
    w = torch.tensor([[3.0, 0.0, 1.0], [4.0, 0.0, 0.0]])
    assert torch.allclose(
        get_norm("colnorm").lmo(w), torch.tensor([[-0.6, 0.0, -1.0], [-0.8, 0.0, 0.0]])
    )
    assert get_norm("colnorm").dual_norm(w).item() == pytest.approx(6.0)
    # normalized: columns of l2 length sqrt(d_out) = sqrt(2), i.e. RMS one.
    assert torch.allclose(
        get_norm("colnorm", normalized=True).lmo(w)[:, 0].norm(), torch.tensor(2**0.5)
    )
    # transpose: rows of an embedding [vocab, dim] are normalised.
    emb = torch.tensor([[3.0, 4.0], [0.0, 2.0], [0.0, 0.0]])
    assert torch.allclose(
        get_norm("colnorm", transpose=True).lmo(emb),
        torch.tensor([[-0.6, -0.8], [0.0, -1.0], [0.0, 0.0]]),
    )
    # rownorm (normalized by default): rows of l2 length 1/sqrt(d_in).
    lmo = get_norm("rownorm").lmo(emb.T)  # [2, 3], d_in = 3
    expected = torch.tensor([[-1.0, 0.0, 0.0], [-4 / 20**0.5, -2 / 20**0.5, 0.0]]) / 3**0.5
    assert torch.allclose(lmo, expected)
    assert torch.allclose(get_norm("rownorm", transpose=True).lmo(emb), expected.T)


@pytest.mark.parametrize(("name", "opts", "shape"), ALL, ids=_ids(ALL))
def test_zero_gradient_gives_zero_without_nan(
    name: str, opts: dict, shape: tuple[int, ...]
) -> None:
    norm = get_norm(name, **opts)
    g = torch.zeros(shape)
    lmo, dual = norm.lmo_and_dual(g)
    assert torch.equal(lmo.abs(), g) and dual.item() == 0.0
    assert torch.equal(norm.sharp(g).abs(), g)


@pytest.mark.parametrize(("name", "opts", "shape"), ALL, ids=_ids(ALL))
def test_half_precision_inputs(name: str, opts: dict, shape: tuple[int, ...]) -> None:
    norm = get_norm(name, **opts)
    g = _grad(shape)
    lmo, dual = norm.lmo_and_dual(g.to(torch.bfloat16))
    assert lmo.dtype == torch.bfloat16 and dual.dtype == torch.float32
    ref_lmo, ref_dual = norm.lmo_and_dual(g.to(torch.bfloat16).double())
    assert torch.allclose(lmo.double(), ref_lmo, rtol=2e-2, atol=1e-2 * ref_lmo.abs().max().item())
    assert dual.item() == pytest.approx(ref_dual.item(), rel=1e-3)


def test_auto_norm_by_shape() -> None:
    assert auto_norm(torch.zeros(8, 3, 3, 3)) == "spectral_conv"
    assert auto_norm(torch.zeros(8, 3, 5)) == "spectral_conv"
    assert auto_norm(torch.zeros(8, 3)) == "spectral"
    assert auto_norm(torch.zeros(8)) == "rms"
    assert auto_norm(torch.zeros(())) == "rms"


@pytest.mark.parametrize(
    ("name", "shape", "match"),
    [
        ("spectral", (5,), r"'spectral'.*>= 2.*\(5,\).*'rms'"),
        ("spectral_conv", (4, 5), r"'spectral_conv'.*\(4, 5\)"),
        ("colnorm", (2, 3, 4), r"'colnorm'.*exactly 2.*\(2, 3, 4\)"),
        ("rownorm", (3,), r"'rownorm'.*\(3,\)"),
    ],
)
def test_unsupported_shapes_name_norm_and_shape(
    name: str, shape: tuple[int, ...], match: str
) -> None:
    norm = get_norm(name)
    with pytest.raises(ValueError, match=match):
        norm.check(torch.zeros(shape))
    with pytest.raises(ValueError, match=match):
        norm.lmo(torch.zeros(shape))


@pytest.mark.parametrize("name", NORM_NAMES)
def test_non_real_tensors_are_rejected(name: str) -> None:
    norm = get_norm(name)
    for bad in (
        torch.zeros(2, 2, 2, dtype=torch.complex64),
        torch.zeros(2, 2, 2, dtype=torch.int64),
    ):
        with pytest.raises(TypeError, match=str(bad.dtype).split(".")[-1]):
            norm.check(bad)


def test_get_norm_errors() -> None:
    with pytest.raises(ValueError, match=r"'nuclear'.*euclidean, spectral, spectral_conv"):
        get_norm("nuclear")
    with pytest.raises(TypeError):
        get_norm("sign", transpose=True)
    with pytest.raises(ValueError, match="steps"):
        get_norm("spectral", steps=0)


def test_custom_norm_subclass_gets_lmo_dual_sharp() -> None:
    class L1(Norm):
        name = "l1"

        def lmo_and_dual(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            i = g.abs().argmax()
            lmo = torch.zeros_like(g).flatten()
            lmo[i] = -g.flatten()[i].sign()
            return lmo.reshape(g.shape), g.abs().amax()

        def norm(self, v: torch.Tensor) -> torch.Tensor:
            return v.abs().sum()

    g = torch.tensor([1.0, -3.0, 2.0])
    assert torch.equal(L1().sharp(g), torch.tensor([0.0, -3.0, 0.0]))
    assert L1().dual_norm(g).item() == 3.0
