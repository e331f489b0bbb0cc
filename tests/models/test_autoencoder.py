from functools import partial

import pytest
import torch

from ada_modules.data.shapes import ShapesDataModule, generate_shapes
from ada_modules.errors import InputError
from ada_modules.models.autoencoder import (
    DEFAULT_VAE_PATH,
    ENCODER_LEVEL_SHAPES,
    ENCODER_LEVELS,
    AutoencoderKLModule,
    load_autoencoder,
    tiny_autoencoder_kl,
)

# The shipped VAE: L1 0.037 on these 64 images (val split 0.035, test split 0.035); with margin.
SHIPPED_L1_MAX = 0.05


def test_latent_and_encoder_level_shapes():
    vae = tiny_autoencoder_kl()
    seen = {}
    for name in ENCODER_LEVELS:
        vae.encoder.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: seen.__setitem__(name, tuple(out.shape[1:]))
        )
    with torch.no_grad():
        latents = vae.encode(torch.zeros(2, 3, 32, 32)).latent_dist.mean
        images = vae.decode(latents).sample
    assert latents.shape == (2, 4, 8, 8) and images.shape == (2, 3, 32, 32)
    assert seen == ENCODER_LEVEL_SHAPES
    assert vae.config.norm_num_groups == 16 and tuple(vae.config.block_out_channels) == (32, 64, 64)
    assert tiny_autoencoder_kl(latent_channels=2).config.latent_channels == 2


def test_export_load_round_trip_equals_the_fp16_weights(tmp_path):
    torch.manual_seed(0)
    module = AutoencoderKLModule()
    images, _ = generate_shapes(8, seed=1)
    path = module.export(tmp_path / "vae.pt", [images[:4], (images[4:], torch.zeros(4))])
    assert [p.name for p in tmp_path.iterdir()] == ["vae.pt"]  # no temporary file left
    vae, mean, std = load_autoencoder(path)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    loaded = vae.state_dict()
    for name, weight in module.vae.state_dict().items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], weight.half().float()), name
    expected_mean, expected_std = module.latent_statistics(images)
    torch.testing.assert_close(mean, expected_mean)
    torch.testing.assert_close(std, expected_std)
    with torch.no_grad():
        z = module.vae.encode(images).latent_dist.mean.transpose(0, 1).reshape(4, -1)
    torch.testing.assert_close(mean, z.mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(std, z.std(1), atol=1e-5, rtol=1e-5)


def test_fit_exports_at_the_end(cpu_trainer, tmp_path, seed):
    module = AutoencoderKLModule(
        export_path=str(tmp_path / "out" / "vae.pt"), optimizer=partial(torch.optim.AdamW, lr=1e-3)
    )
    data = ShapesDataModule(train_size=8, val_size=4, test_size=4, batch_size=4)
    cpu_trainer(max_steps=2, limit_val_batches=1).fit(module, data)
    asset = load_autoencoder(tmp_path / "out" / "vae.pt")
    assert asset.latent_mean.shape == (4,) and (asset.latent_std > 0).all()
    assert torch.equal(
        asset.vae.decoder.conv_out.weight, module.vae.decoder.conv_out.weight.half().float()
    )


def test_training_step_and_metrics_are_finite():
    module = AutoencoderKLModule(kl_weight=1e-4, mse_weight=0.0)
    images, labels = generate_shapes(4, seed=0)
    assert torch.isfinite(module.training_step((images, labels), 0))
    assert module(images).shape == images.shape


def test_missing_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(InputError, match="autoencoder asset not found"):
        load_autoencoder(tmp_path / "nope.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(InputError, match="not a valid autoencoder asset"):
        load_autoencoder(tmp_path / "other.pt")
    (tmp_path / "text.pt").write_text("not a torch file")
    with pytest.raises(InputError, match="not a valid autoencoder asset"):
        load_autoencoder(tmp_path / "text.pt")


def test_shipped_asset_reconstructs_generated_images():
    assert DEFAULT_VAE_PATH.is_file() and DEFAULT_VAE_PATH.stat().st_size < 2_000_000
    vae, mean, std = load_autoencoder()
    images, _ = generate_shapes(64, seed=987_654)  # not a training seed (those are 3 * seed)
    with torch.no_grad():
        z = vae.encode(images).latent_dist.mean
        reconstruction = vae.decode(z).sample
    assert (reconstruction - images).abs().mean() < SHIPPED_L1_MAX
    assert mean.shape == std.shape == (4,) and (std > 0).all()
    normalised = (z - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    assert normalised.mean().abs() < 0.3 and 0.7 < normalised.std() < 1.3


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: tiny_autoencoder_kl(0), "latent_channels"),
        (lambda: tiny_autoencoder_kl(2.0), "latent_channels"),
        (lambda: AutoencoderKLModule(kl_weight=-1.0), "kl_weight"),
        (lambda: AutoencoderKLModule(mse_weight="a"), "mse_weight"),
        (lambda: AutoencoderKLModule(export_path=""), "export_path"),
        (lambda: AutoencoderKLModule().export("unused.pt"), "export needs data"),
        (lambda: AutoencoderKLModule().latent_statistics([]), "at least one image"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises(InputError, match=match):
        call()
