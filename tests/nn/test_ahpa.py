"""AHPA's alignment head and timestep router (hooks, pooling, losses, router, bad input)."""

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DiTTransformer2DModel

from ada_modules.errors import InputError
from ada_modules.nn.ahpa import HierarchicalPriorAligner
from ada_modules.nn.ahpa_router import TimestepRouter, coarse_to_fine_prior

LEVELS = ["encoder.down_blocks.0", "encoder.down_blocks.1", "encoder.mid_block"]


def _vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(8, 16, 16), norm_num_groups=4, sample_size=16, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
    ).requires_grad_(False)  # fmt: skip


def _dit(patch_size: int = 1) -> DiTTransformer2DModel:
    torch.manual_seed(1)
    return DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=3,
        sample_size=4, patch_size=patch_size, norm_num_groups=4, num_embeds_ada_norm=10,
    )  # fmt: skip


def _step(vae: AutoencoderKL, dit: DiTTransformer2DModel, batch: int = 3) -> torch.Tensor:
    images = torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        latent = vae.encode(images).latent_dist.mean
    t = torch.rand(batch, generator=torch.Generator().manual_seed(3))
    dit(latent, timestep=1000 * t, class_labels=torch.arange(batch))  # the hooks catch
    return latent


def test_hooks_catch_each_level_pooled_to_the_token_grid():
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(vae, dit, LEVELS, block_index=1)
    assert aligner.token_grid == (4, 4)
    assert [p[-1].out_features for p in aligner.projectors] == [8, 16, 16]
    _step(vae, dit)
    raw = {name: aligner._targets[name].shape for name in LEVELS}
    assert raw == {LEVELS[0]: (3, 8, 8, 8), LEVELS[1]: (3, 16, 4, 4), LEVELS[2]: (3, 16, 4, 4)}
    pooled = aligner._pooled(LEVELS[0], aligner._targets[LEVELS[0]])
    assert pooled.shape == (3, 16, 8)
    expected = F.avg_pool2d(aligner._targets[LEVELS[0]], 2).flatten(2).transpose(1, 2)
    torch.testing.assert_close(pooled, expected)
    assert aligner._tokens.shape == (3, 16, 16)
    assert aligner.level_losses().shape == (3, 3)


def test_router_weights_lie_on_the_simplex_and_depend_on_t():
    router = TimestepRouter(3, temperature=0.5)
    torch.nn.init.normal_(router.mlp[-1].weight)
    w = router(torch.linspace(0, 1, 11))
    assert (w >= 0).all() and torch.allclose(w.sum(-1), torch.ones(11))
    assert (w[0] - w[-1]).abs().max() > 1e-3
    assert torch.allclose(TimestepRouter(4)(torch.rand(5)), torch.full((5, 4), 0.25))


def test_the_prior_moves_from_coarse_to_fine_as_noise_decreases():
    w = coarse_to_fine_prior(torch.linspace(1, 0, 5), 3)  # t = 1, 0.75, 0.5, 0.25, 0
    assert w.argmax(-1).tolist() == [2, 1, 1, 0, 0]  # at t = 0.75, levels 1 and 2 tie
    assert torch.all(w[:-1, 2] >= w[1:, 2])


def test_the_denoiser_is_unchanged_by_the_head():
    vae, dit = _vae(), _dit().eval()  # eval: no random label dropout; the head still catches
    keys = sorted(dit.state_dict())
    x, t, y = torch.randn(2, 4, 4, 4), torch.tensor([10.0, 900.0]), torch.tensor([1, 2])
    before = dit(x, timestep=t, class_labels=y).sample
    aligner = HierarchicalPriorAligner.for_diffusers(vae, dit, LEVELS, block_index=2)
    assert sorted(dit.state_dict()) == keys
    with_head = dit(x, timestep=t, class_labels=y).sample
    assert aligner._tokens is not None
    aligner.remove()
    after = dit(x, timestep=t, class_labels=y).sample
    assert torch.equal(before, with_head) and torch.equal(before, after)
    assert aligner._tokens is None and not dit.transformer_blocks[2]._forward_hooks


def test_one_level_without_router_is_the_repa_loss():
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(
        vae, dit, [LEVELS[2]], block_index=0, router="none", normalize="none"
    )
    _step(vae, dit)
    tokens, target = aligner._tokens, aligner._pooled(LEVELS[2], aligner._targets[LEVELS[2]])
    z_hat = F.normalize(aligner.projectors[0](tokens), dim=-1)
    repa = -(z_hat * F.normalize(target, dim=-1)).sum(-1).mean()  # REPA's proj_loss
    loss, _ = aligner.loss(torch.rand(3))
    torch.testing.assert_close(loss, 1 + repa)


def test_the_latent_level_takes_the_latent_passed_to_loss():
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(
        vae, dit, ["latent"], block_index=0, router="none", normalize="none"
    )
    assert aligner.projectors[0][-1].out_features == 4
    latent = _step(vae, dit)
    with pytest.raises(InputError, match="pass latent="):
        aligner.level_losses()
    assert aligner.loss(torch.rand(3), latent=latent)[0].item() > 0


def test_ema_normalisation_makes_each_level_weigh_one_at_the_first_step():
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(vae, dit, LEVELS, block_index=1)
    _step(vae, dit)
    loss, stats = aligner.loss(torch.rand(3))
    torch.testing.assert_close(loss, torch.tensor(1.0))
    means = torch.stack([stats[f"align/loss_{name}"] for name in LEVELS])
    torch.testing.assert_close(aligner.loss_ema, means)


def test_the_alignment_loss_goes_down_when_the_projectors_train():
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(
        vae, dit, LEVELS, block_index=1, router="uniform", normalize="none"
    )
    optimizer = torch.optim.Adam([*aligner.parameters(), *dit.parameters()], lr=3e-3)
    losses = []
    for _ in range(30):
        _step(vae, dit)
        loss, _ = aligner.loss(torch.rand(3))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_the_router_regularisers_enter_the_loss():
    vae, dit = _vae(), _dit()
    plain = HierarchicalPriorAligner.for_diffusers(
        vae, dit, LEVELS, block_index=1, normalize="none"
    )
    _step(vae, dit)
    t = torch.tensor([0.1, 0.5, 0.9])
    base, stats = plain.loss(t)
    plain.entropy_weight = 0.5
    _step(vae, dit)
    bonus, _ = plain.loss(t)
    torch.testing.assert_close(bonus, base - 0.5 * stats["align/router_entropy"])


def test_bad_input_names_the_value():
    vae, dit = _vae(), _dit()
    with pytest.raises(InputError, match="'encoder.down_blocks.7' is not a submodule"):
        HierarchicalPriorAligner.for_diffusers(vae, dit, ["encoder.down_blocks.7"], block_index=0)
    with pytest.raises(InputError, match="block_index 3 is out of range for 3"):
        HierarchicalPriorAligner.for_diffusers(vae, dit, LEVELS, block_index=3)
    with pytest.raises(InputError, match="router='none' needs exactly one level"):
        HierarchicalPriorAligner.for_diffusers(vae, dit, LEVELS, block_index=0, router="none")
    with pytest.raises(InputError, match="router must be"):
        HierarchicalPriorAligner.for_diffusers(vae, dit, LEVELS, block_index=0, router="soft")
    assert not dit.transformer_blocks[0]._forward_hooks  # nothing half-attached
    aligner = HierarchicalPriorAligner(
        vae, dit.transformer_blocks, [LEVELS[2]], [16], block_index=0, hidden_size=16,
        token_grid=(2, 2),
    )  # fmt: skip
    _step(vae, dit)
    with pytest.raises(InputError, match=r"token_grid \(2, 2\) needs 4 tokens"):
        aligner.loss(torch.rand(3))


@pytest.mark.parametrize("router", ["learned", "prior", "uniform"])
def test_t_must_be_one_noise_level_in_0_1_per_sample(router):
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(vae, dit, LEVELS, block_index=1, router=router)
    _step(vae, dit)
    t = torch.tensor([0.1, 0.5, 0.9])
    bad = {
        r"t must be a 1-D tensor of 3 noise levels.*shape \(3, 1\)": t.view(-1, 1),
        r"shape \(3, 1, 1, 1\)": t.view(-1, 1, 1, 1),
        r"shape \(1,\)": t[:1],
        r"shape \(2,\)": t[:2],
        r"shape \(\)": t[0],
        "got float": 0.5,
        "got list": [0.1, 0.5, 0.9],
        r"t must be in \[0, 1\].*got 1000": torch.tensor([1000.0, 999.0, 0.5]),
        r"t must be in \[0, 1\].*got -0.5": torch.tensor([-0.5, 0.5, 0.9]),
        r"t must be in \[0, 1\].*got nan": torch.tensor([float("nan"), 0.5, 0.9]),
        "t must be a floating or integer tensor, got torch.bool": torch.tensor([True] * 3),
    }
    for match, value in bad.items():
        with pytest.raises(InputError, match=match):
            aligner.loss(value)
    with pytest.raises(InputError, match=r"shape \(3, 1\)"):
        aligner.weights(t.view(-1, 1))
    assert int(aligner.ema_steps) == 0  # refused before anything changed: the step still counts
    loss, _ = aligner.loss(torch.tensor([0, 1, 1]))  # integer noise levels are fine
    assert torch.isfinite(loss) and int(aligner.ema_steps) == 1


def test_a_non_finite_batch_does_not_enter_the_ema():
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(vae, dit, LEVELS, block_index=1)
    _step(vae, dit)
    aligner.loss(torch.rand(3))
    ema = aligner.loss_ema.clone()
    _step(vae, dit)
    aligner._targets[LEVELS[0]][0, 0, 0, 0] = float("nan")  # one bad image
    loss, _ = aligner.loss(torch.rand(3))
    assert loss.isnan() and torch.equal(aligner.loss_ema, ema) and int(aligner.ema_steps) == 1
    _step(vae, dit)
    assert torch.isfinite(aligner.loss(torch.rand(3))[0]) and aligner.loss_ema.isfinite().all()


def test_the_latent_target_is_frozen():
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(vae, dit, ["latent"], block_index=0)
    latent = _step(vae, dit).requires_grad_()
    aligner.loss(torch.rand(3), latent=latent)[0].backward()
    assert latent.grad is None
    _step(vae, dit)
    with pytest.raises(InputError, match="level 'latent' has 2 channels; expected 4"):
        aligner.loss(torch.rand(3), latent=latent[:, :2])


def test_dual_stream_blocks_are_refused_by_name():
    from diffusers import SD3Transformer2DModel

    vae = _vae()
    sd3 = SD3Transformer2DModel(
        sample_size=4, patch_size=1, in_channels=4, out_channels=4, num_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        caption_projection_dim=16, pooled_projection_dim=8, pos_embed_max_size=8,
    )  # fmt: skip
    with pytest.raises(InputError, match="JointTransformerBlock"):
        HierarchicalPriorAligner.for_diffusers(vae, sd3, [LEVELS[2]], block_index=0)
    assert not sd3.transformer_blocks[0]._forward_hooks
    assert not any(m._forward_hooks for m in vae.modules())


def test_tokens_wider_than_hidden_size_are_refused_unless_packed_streams():
    vae, dit = _vae(), _dit()
    aligner = HierarchicalPriorAligner(
        vae, dit.transformer_blocks, [LEVELS[2]], [16], block_index=1, hidden_size=8,
        token_grid=(4, 4),
    )  # fmt: skip
    _step(vae, dit)
    with pytest.raises(InputError, match="tokens of width 16; hidden_size is 8"):
        aligner.loss(torch.rand(3))


def test_half_precision_vae_and_levels_run_by_encode():
    vae, dit = _vae().to(torch.bfloat16), _dit()
    aligner = HierarchicalPriorAligner.for_diffusers(
        vae, dit, [LEVELS[0], "quant_conv"], block_index=1
    )
    assert [p[-1].out_features for p in aligner.projectors] == [8, 8]
    aligner.remove()
    with pytest.raises(InputError, match="'decoder.mid_block' is not run by vae.encode"):
        HierarchicalPriorAligner.for_diffusers(vae, dit, ["decoder.mid_block"], block_index=1)
    assert not any(m._forward_hooks for m in vae.modules())


def test_the_learned_router_runs_in_its_own_dtype():
    router = TimestepRouter(3).to(torch.bfloat16)
    assert router(torch.tensor([0.1, 0.9])).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"projector_dim": 0}, "projector_dim must be an int >= 1, got 0"),
        ({"prior_sigma": 0.0}, "prior_sigma must be finite and > 0, got 0.0"),
        (
            {"prior_sigma": -1.0, "prior_kl_weight": 0.1},
            "prior_sigma must be finite and > 0, got -1.0",
        ),
        (
            {"entropy_weight": float("nan")},
            "entropy_weight and prior_kl_weight must be finite and >= 0",
        ),
        ({"block_index": 1.0}, "block_index must be an int, got 1.0"),
        ({"hidden_size": 0}, "hidden_size must be an int >= 1, got 0"),
        ({"level_channels": [16, 0]}, r"level_channels must be ints >= 1, got \[16, 0\]"),
    ],
)
def test_bad_settings_are_refused_before_any_hook(setting, match):
    vae, dit = _vae(), _dit()
    kwargs = {"level_channels": [8, 16], "block_index": 1, "hidden_size": 16, **setting}
    with pytest.raises(InputError, match=match):
        HierarchicalPriorAligner(
            vae, dit.transformer_blocks, LEVELS[:2], token_grid=(4, 4), **kwargs
        )
    assert not any(m._forward_hooks for m in [*vae.modules(), *dit.modules()])
