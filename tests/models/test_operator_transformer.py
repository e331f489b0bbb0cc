"""The operator transformer (AOT-POT's backbone): spectral mixing, residual types, the task module."""

import itertools

import pytest
import torch
import yaml
from lightning.pytorch import Trainer

from ada_modules.data.pde import PDE_FAMILIES, PDEDataModule
from ada_modules.models import OperatorTransformerModule
from ada_modules.models.operator_transformer import relative_l2
from ada_modules.nn.operator_transformer import OperatorTransformer
from ada_modules.nn.spectral_mixing import SpectralMixing

SMALL = dict(grid=32, history=3, patch_size=4, width=16, depth=2, modes=4, spectral_blocks=2)


def _spectral_reference(mixing: SpectralMixing, x: torch.Tensor) -> torch.Tensor:
    """1-D spectral mixing written out mode by mode with a dense block-diagonal matrix."""
    coeffs = torch.fft.rfft(x.double(), norm="ortho")
    out = torch.zeros_like(coeffs)
    w = torch.view_as_complex(mixing.weight.detach().double().contiguous())  # (modes, nb, bs, bs)
    for k in range(mixing.modes):
        dense = torch.block_diag(*w[k])  # (dim, dim), input index first
        out[:, :, k] = coeffs[:, :, k] @ dense
    return torch.fft.irfft(out, n=x.shape[-1], norm="ortho").float()


def _spectral_reference_2d(mixing: SpectralMixing, x: torch.Tensor) -> torch.Tensor:
    """2-D spectral mixing mode by mode: kx in 0..m-1 and -m..-1, ky in 0..m-1."""
    m = mixing.modes
    coeffs = torch.fft.rfft2(x.double(), norm="ortho")
    out = torch.zeros_like(coeffs)
    w = torch.view_as_complex(mixing.weight.detach().double().contiguous())  # (2m, m, nb, bs, bs)
    rows = list(range(m)) + list(range(x.shape[-2] - m, x.shape[-2]))
    for i, kx in enumerate(rows):
        for ky in range(m):
            out[:, :, kx, ky] = coeffs[:, :, kx, ky] @ torch.block_diag(*w[i, ky])
    return torch.fft.irfft2(out, s=x.shape[-2:], norm="ortho").float()


def test_spectral_mixing_2d_matches_its_mode_by_mode_definition() -> None:
    torch.manual_seed(0)
    mixing = SpectralMixing(dim=4, modes=3, spatial_dims=2, num_blocks=2)
    x = torch.randn(2, 4, 16, 12)
    torch.testing.assert_close(mixing(x), _spectral_reference_2d(mixing, x), rtol=1e-4, atol=1e-5)


def test_spectral_mixing_matches_its_mode_by_mode_definition() -> None:
    torch.manual_seed(0)
    mixing = SpectralMixing(dim=8, modes=5, spatial_dims=1, num_blocks=2)
    x = torch.randn(3, 8, 32)
    torch.testing.assert_close(mixing(x), _spectral_reference(mixing, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spatial_dims", [1, 2])
def test_spectral_mixing_commutes_with_periodic_shifts(spatial_dims: int) -> None:
    torch.manual_seed(0)
    mixing = SpectralMixing(dim=4, modes=3, spatial_dims=spatial_dims, num_blocks=2)
    x = torch.randn(2, 4, *(16,) * spatial_dims)
    dims = tuple(range(2, 2 + spatial_dims))
    shifted = mixing(torch.roll(x, shifts=(5,) * spatial_dims, dims=dims))
    torch.testing.assert_close(
        shifted, torch.roll(mixing(x), (5,) * spatial_dims, dims), atol=1e-5, rtol=1e-4
    )


def test_spectral_mixing_drops_frequencies_above_modes() -> None:
    mixing = SpectralMixing(dim=2, modes=3)
    grid = torch.arange(32) / 32
    high = torch.sin(2 * torch.pi * 8 * grid).expand(1, 2, 32)
    assert mixing(high).abs().max() < 1e-5


@pytest.mark.parametrize("spatial_dims", [1, 2])
@pytest.mark.parametrize("residual", ["hyper", "mhc"])
def test_stream_networks_equal_the_residual_network_at_init(
    spatial_dims: int, residual: str
) -> None:
    torch.manual_seed(0)
    plain = OperatorTransformer(spatial_dims=spatial_dims, **SMALL)
    streams = OperatorTransformer(spatial_dims=spatial_dims, residual=residual, **SMALL)
    missing, unexpected = streams.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("static" in k or "dynamic" in k for k in missing)
    frames = torch.randn(2, 3, 1, *(32,) * spatial_dims)
    torch.testing.assert_close(streams(frames)[0], plain(frames)[0], rtol=1e-4, atol=1e-5)


def test_repro_config_parameter_overhead_is_at_most_five_percent() -> None:
    with open("cli_configs/aot_pot/pretrain.yaml") as f:
        args = yaml.safe_load(f)["model"]["init_args"]
    keep = ("spatial_dims", "grid", "history", "patch_size", "width", "depth", "mlp_ratio", "modes")
    kwargs = {k: args[k] for k in keep} | {"spectral_blocks": args["spectral_blocks"]}
    plain = OperatorTransformer(**kwargs)
    ours = OperatorTransformer(**kwargs, residual=args["residual"], streams=args["streams"])
    base = sum(p.numel() for p in plain.parameters())
    extra = sum(p.numel() for p in ours.parameters()) - base
    assert extra == sum(p.numel() for p in ours.stream_parameters())
    assert 0 < extra / base <= 0.05


def test_relative_l2() -> None:
    target = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    torch.testing.assert_close(relative_l2(torch.zeros(2, 2), target), torch.ones(2))
    torch.testing.assert_close(relative_l2(target, target), torch.zeros(2))


@pytest.fixture(scope="module")
def pde_data() -> PDEDataModule:
    dm = PDEDataModule(
        families=["advection", "burgers"], grid=32, frames=8, history=3, rollout=4,
        train_trajectories=32, val_trajectories=8, test_trajectories=8, seed=0, batch_size=16,
    )  # fmt: skip
    dm.setup("fit")
    dm.setup("test")
    return dm


def _train(module: OperatorTransformerModule, data: PDEDataModule, steps: int) -> list[float]:
    torch.manual_seed(0)
    optimizer = module.configure_optimizers()
    losses = []
    batches = itertools.chain.from_iterable(itertools.repeat(data.train_dataloader()))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = module.training_step(next(batches), 0)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("residual", ["residual", "mhc"])
def test_training_beats_persistence_on_a_fixed_seed(residual: str, pde_data: PDEDataModule) -> None:
    torch.manual_seed(0)
    module = OperatorTransformerModule(**SMALL, residual=residual)
    module.log = lambda *args, **kwargs: None
    losses = _train(module, pde_data, 80)
    frames, _ = next(iter(pde_data.test_dataloader()))
    with torch.no_grad():
        model = relative_l2(module(frames[:, :3]), frames[:, 3]).mean()
    persistence = relative_l2(frames[:, 2], frames[:, 3]).mean()
    assert losses[-1] < losses[0]
    assert model < 0.6 * persistence


@pytest.mark.parametrize("residual", ["hyper", "mhc"])
def test_ten_times_the_learning_rate_stays_finite(residual: str, pde_data: PDEDataModule) -> None:
    from functools import partial

    torch.manual_seed(0)
    module = OperatorTransformerModule(
        **SMALL, residual=residual, optimizer=partial(torch.optim.AdamW, lr=1e-2)
    )
    module.log = lambda *args, **kwargs: None
    assert all(torch.isfinite(torch.tensor(loss)) for loss in _train(module, pde_data, 15))


def test_optimizer_groups_keep_stream_weights_undecayed() -> None:
    module = OperatorTransformerModule(**SMALL, residual="mhc")
    optimizer = module.configure_optimizers()
    streams = [g for g in optimizer.param_groups if g.get("name") == "streams"]
    assert len(streams) == 1 and streams[0]["weight_decay"] == 0.0
    assert len(streams[0]["params"]) == len(module.net.stream_parameters()) > 0


def test_test_logs_per_family_and_mean_metrics(pde_data: PDEDataModule, tmp_path) -> None:
    module = OperatorTransformerModule(**SMALL, residual="hyper")
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    metrics = trainer.test(module, datamodule=pde_data, verbose=False)[0]
    for kind in ("rel_l2", "rel_l2_rollout", "rel_l2_persistence"):
        per_family = [metrics[f"test/{kind}/{f}"] for f in ("advection", "burgers")]
        assert metrics[f"test/{kind}"] == pytest.approx(sum(per_family) / 2, rel=1e-5)
    others = set(PDE_FAMILIES) - {"advection", "burgers"}
    assert not any(name.endswith(f"/{f}") for f in others for name in metrics)
    assert metrics["test/stream_params"] == sum(p.numel() for p in module.net.stream_parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(grid=30), "grid=30 is not divisible by patch_size=4"),
        (dict(residual="dense"), "residual must be one of"),
        (dict(residual="residual", streams={"n_streams": 2}), "streams is set but residual"),
        (dict(residual="mhc", streams={"n_streams": 0}), "n_streams must be an integer >= 1"),
        (dict(residual="mhc", streams={"sinkhorn_iters": 0}), "sinkhorn_iters must be"),
        (dict(width=12), "width=12 is not divisible by groups=8"),
        (dict(spatial_dims=3), "spatial_dims must be 1 or 2"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OperatorTransformer(**{**SMALL, **kwargs})


def test_bad_frames_and_noise() -> None:
    net = OperatorTransformer(**SMALL)
    with pytest.raises(ValueError, match=r"expected frames \(batch, \(3, 1, 32\)\)"):
        net(torch.randn(2, 4, 1, 32))
    module = OperatorTransformerModule(**SMALL)
    with pytest.raises(ValueError, match="history=3 needs at least history \\+ 1"):
        module.training_step((torch.randn(2, 3, 1, 32), torch.zeros(2, dtype=torch.long)), 0)
    with pytest.raises(ValueError, match="noise_scale must be a finite number >= 0"):
        OperatorTransformerModule(**SMALL, noise_scale=-1.0)


def test_rollout_of_zero_steps_is_empty_and_negative_steps_are_refused() -> None:
    net = OperatorTransformer(**SMALL)
    frames = torch.randn(2, 3, 1, 32)
    assert net.rollout(frames, 0).shape == (2, 0, 1, 32)
    with pytest.raises(ValueError, match="steps must be an integer >= 0, got -1"):
        net.rollout(frames, -1)


@pytest.mark.parametrize(
    ("streams", "match"),
    [
        ({"kind": "hyper"}, "streams kind='hyper' disagrees with residual='mhc'"),
        ({"dim": 8}, "streams sets 'dim', which the operator transformer sets itself"),
        ({"channel_first": False}, "streams sets 'channel_first'"),
    ],
)
def test_streams_cannot_override_what_the_network_sets(streams, match) -> None:
    with pytest.raises(ValueError, match=match):
        OperatorTransformerModule(**SMALL, residual="mhc", streams=streams)


@pytest.mark.parametrize(
    ("setting", "name"), [("aux_weight", "aux_weight"), ("stream_lr_scale", "stream_lr_scale")]
)
def test_infinite_weights_and_scales_are_refused(setting, name) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        OperatorTransformerModule(**SMALL, **{setting: float("inf")})


def test_modes_beyond_the_patch_grid_are_rejected_at_build_time() -> None:
    with pytest.raises(ValueError, match="modes=8 is more Fourier modes than the 8-patch grid"):
        OperatorTransformer(spatial_dims=2, grid=64, patch_size=8, modes=8)


def test_the_gpu_benchmark_network_runs() -> None:
    """bench/gpu/aot_pot.py's default network (only its --quick size runs in the suite)."""
    import sys

    sys.path.insert(0, "bench/gpu")
    try:
        from aot_pot import build, parse_args
    finally:
        sys.path.remove("bench/gpu")
    args = parse_args([])
    net = build("mhc", args)
    with torch.no_grad():
        pred, _ = net(torch.randn(1, 4, 1, args.grid, args.grid))
    assert pred.shape == (1, 1, args.grid, args.grid)


def test_stream_lr_scale_multiplies_the_streams_group_only() -> None:
    from functools import partial

    module = OperatorTransformerModule(
        **SMALL, residual="mhc", stream_lr_scale=10.0, optimizer=partial(torch.optim.AdamW, lr=1e-3)
    )
    lrs = {g.get("name"): g["lr"] for g in module.configure_optimizers().param_groups}
    assert lrs == {None: 1e-3, "streams": pytest.approx(1e-2)}
    with pytest.raises(ValueError, match="stream_lr_scale must be a finite number > 0, got 0"):
        OperatorTransformerModule(**SMALL, stream_lr_scale=0)


def test_a_checkpoint_of_another_residual_type_is_refused() -> None:
    hyper = OperatorTransformerModule(**SMALL, residual="hyper")
    mhc = OperatorTransformerModule(**SMALL, residual="mhc")
    checkpoint = {"state_dict": hyper.state_dict(), "hyper_parameters": dict(hyper.hparams)}
    with pytest.raises(ValueError, match="trained with residual='hyper', this model has"):
        mhc.on_load_checkpoint(checkpoint)
    hyper.on_load_checkpoint(checkpoint)  # the same type loads
