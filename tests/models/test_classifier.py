from functools import partial

import pytest
import torch

from ada_modules.data.digits import DigitsDataModule
from ada_modules.models.classifier import ImageClassifierModule
from ada_modules.optim.accelegrad import AcceleGrad
from ada_modules.optim.accelegrad_sharp import AcceleGradSharp
from ada_modules.optim.scion import Scion


def _fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    dm = DigitsDataModule(seed=0, flatten=False)
    dm.setup("fit")
    return dm.datasets["train"].tensors[0][:64], dm.datasets["train"].tensors[1][:64]


def _steps(module: ImageClassifierModule, steps: int) -> tuple[float, float]:
    """Loss on a fixed batch before and after ``steps`` optimizer steps on it."""
    images, labels = _fixed_batch()
    optimizer = module.configure_optimizers()["optimizer"]
    first = torch.nn.functional.cross_entropy(module(images), labels).item()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(module(images), labels).backward()
        optimizer.step()
    return first, torch.nn.functional.cross_entropy(module(images), labels).item()


@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_loss_decreases_on_a_fixed_batch(architecture, seed):
    module = ImageClassifierModule(
        architecture=architecture,
        hidden_sizes=[32],
        channels=[4, 8],
        optimizer=partial(torch.optim.AdamW, lr=1e-2),
    )
    first, last = _steps(module, 40)
    assert last < 0.5 * first


def test_cnn_layers_and_input_shapes(seed):
    module = ImageClassifierModule(architecture="cnn", hidden_sizes=[], channels=[4])
    assert [type(m).__name__ for m in module.features] == ["Conv2d", "ReLU", "MaxPool2d", "Flatten"]
    assert module.head.in_features == 4 * 4 * 4
    images = torch.rand(3, 1, 8, 8)
    assert torch.equal(module(images), module(images.reshape(3, 64)))


def test_fit_and_test_log_the_metrics(tmp_path, seed, cpu_trainer):
    module = ImageClassifierModule(hidden_sizes=[16])
    trainer = cpu_trainer(max_steps=3, val_check_interval=3, check_val_every_n_epoch=None)
    datamodule = DigitsDataModule(seed=0, batch_size=32)
    trainer.fit(module, datamodule)
    assert {"train/loss", "val/loss", "val/accuracy"} <= set(trainer.callback_metrics)
    result = trainer.test(module, datamodule, verbose=False)[0]
    assert set(result) == {"test/loss", "test/accuracy"} and 0 <= result["test/accuracy"] <= 1


def test_geometry_param_groups_give_per_layer_norms(seed):
    module = ImageClassifierModule(
        hidden_sizes=[16, 16],
        param_groups="geometry",
        radii={"head": 10.0},
        optimizer=partial(AcceleGradSharp, lr=0.1),
    )
    optimizer = module.configure_optimizers()["optimizer"]
    by_role = {group["role"]: group for group in optimizer.param_groups}
    assert {role: group["norm"] for role, group in by_role.items()} == {
        "hidden": "spectral",
        "vector": "rms",
        "head": "sign",
    }
    assert by_role["head"]["params"] == [module.head.weight] and by_role["head"]["radius"] == 10.0
    assert len(by_role["hidden"]["params"]) == 2  # the input layer is a hidden matrix too
    scion = ImageClassifierModule(
        hidden_sizes=[16], param_groups="geometry", optimizer=partial(Scion, lr=0.01)
    )
    first, last = _steps(scion, 5)
    assert last < first


def test_aux_optimizer_gets_everything_but_hidden_matrices_and_both_step(seed):
    module = ImageClassifierModule(
        hidden_sizes=[16, 16],
        optimizer=partial(torch.optim.Muon, lr=0.02),
        aux_optimizer=partial(torch.optim.AdamW, lr=1e-3),
        lr_scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
    )
    config = module.configure_optimizers()
    chain = config["optimizer"]
    muon, adamw = chain.optimizers
    hidden = [p for name, p in module.named_parameters() if name.endswith("weight")][:-1]
    assert [p for g in muon.param_groups for p in g["params"]] == hidden
    assert len([p for g in adamw.param_groups for p in g["params"]]) == 4  # 3 biases + head
    before = [p.detach().clone() for p in module.parameters()]
    images, labels = _fixed_batch()
    chain.zero_grad()
    torch.nn.functional.cross_entropy(module(images), labels).backward()
    chain.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, module.parameters(), strict=True))
    assert {p: s for opt in (muon, adamw) for p, s in opt.state.items()} == dict(chain.state)
    assert len(muon.state) == 2 and len(adamw.state) == 4 and len(chain.state) == 6
    config["lr_scheduler"]["scheduler"].step()
    assert muon.param_groups[0]["lr"] == 0.01 and adamw.param_groups[0]["lr"] == 5e-4
    state = chain.state_dict()
    chain.load_state_dict(state)
    assert chain.param_groups[0] is muon.param_groups[0] and len(chain.state) == 6


def test_aux_optimizer_fits_with_lightning_and_counts_batches(tmp_path, seed, cpu_trainer):
    module = ImageClassifierModule(
        hidden_sizes=[16],
        optimizer=partial(torch.optim.Muon, lr=0.02),
        aux_optimizer=partial(torch.optim.AdamW, lr=1e-3),
    )
    trainer = cpu_trainer(max_steps=4, limit_val_batches=0)
    trainer.fit(module, DigitsDataModule(seed=0, batch_size=32))
    assert trainer.global_step == 4


def test_aux_optimizer_needs_hidden_matrices():
    module = ImageClassifierModule(
        hidden_sizes=[], optimizer=torch.optim.AdamW, aux_optimizer=torch.optim.AdamW
    )
    with pytest.raises(ValueError, match="aux_optimizer"):
        module.configure_optimizers()


@pytest.mark.parametrize(
    "optimizer", [partial(AcceleGrad, lr=1.0), partial(AcceleGradSharp, lr=0.1)], ids=["ag", "ags"]
)
def test_evaluation_uses_the_output_iterate_and_restores_training_weights(
    optimizer, tmp_path, seed, cpu_trainer
):
    module = ImageClassifierModule(hidden_sizes=[16], optimizer=optimizer)
    trainer = cpu_trainer(max_steps=5, limit_val_batches=1)
    datamodule = DigitsDataModule(seed=0, batch_size=32)
    trainer.fit(module, datamodule)
    coupling = [p.detach().clone() for p in module.parameters()]
    with trainer.optimizers[0].swap_output():
        output = [p.detach().clone() for p in module.parameters()]
    assert any(not torch.equal(c, o) for c, o in zip(coupling, output, strict=True))
    seen = []

    def validation_step(batch, batch_idx):
        seen.append([p.detach().clone() for p in module.parameters()])

    module.validation_step = validation_step
    trainer.validate(module, datamodule, verbose=False)
    assert all(torch.equal(s, o) for s, o in zip(seen[0], output, strict=True))
    assert all(torch.equal(c, p) for c, p in zip(coupling, module.parameters(), strict=True))
    # The checkpoint holds the output iterate as weights and the coupling point for resuming.
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    reloaded = ImageClassifierModule.load_from_checkpoint(path, weights_only=False)
    assert all(torch.equal(o, p) for o, p in zip(output, reloaded.parameters(), strict=True))
    resumed = ImageClassifierModule(hidden_sizes=[16], optimizer=optimizer)
    resume = cpu_trainer(max_steps=5, limit_val_batches=0)
    resume.fit(resumed, datamodule, ckpt_path=path)  # already at max_steps: restores, no step
    assert all(torch.equal(c, p) for c, p in zip(coupling, resumed.parameters(), strict=True))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"architecture": "rnn"}, "architecture"),
        ({"hidden_sizes": [0]}, "hidden_sizes"),
        ({"architecture": "cnn", "channels": []}, "channels"),
        ({"num_classes": 1}, "num_classes"),
        ({"image_size": 0}, "image_size"),
        ({"param_groups": "layers"}, "param_groups"),
        ({"radii": {"head": 1.0}}, "radii needs"),
        ({"param_groups": "geometry", "radii": {"body": 1.0}}, "unknown role"),
        ({"param_groups": "geometry", "radii": {"head": -1.0}}, "radii"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageClassifierModule(**kwargs)


def test_trunk_is_built_with_the_last_hidden_width_and_runs_before_the_head(seed):
    from functools import partial

    from ada_modules.nn import MLPResNet

    plain = ImageClassifierModule(hidden_sizes=[16])
    module = ImageClassifierModule(
        hidden_sizes=[16], trunk=partial(MLPResNet, depth=3, mode="source")
    )
    trunk = module.features[-1]
    assert isinstance(trunk, MLPResNet) and trunk.layers[0].block[1].in_features == 16
    assert module(torch.rand(5, 64)).shape == (5, 10)
    assert "trunk" not in module.hparams
    assert len(module.features) == len(plain.features) + 1
