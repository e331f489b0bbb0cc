"""geometry_param_groups: which layer gets which norm, on a tiny transformer and a tiny CNN;
check_param_coverage: optimizers that miss a parameter or hold one twice."""

import pytest
import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.optim.accelegrad_sharp import AcceleGradSharp
from ada_modules.optim.chain import OptimizerChain
from ada_modules.optim.param_groups import (
    check_param_coverage,
    geometry_param_groups,
    split_param_groups,
    weight_decay_param_groups,
)
from ada_modules.optim.scion import Scion


class TinyLM(nn.Module):
    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 8)
        self.block = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 30, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.block(self.embed(tokens))))


def _cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Linear(16, 10),
    )


def _norm_of(groups: list[dict]) -> dict[str, object]:
    return {n: g["norm"] for g in groups for n in g["param_names"]}


def test_transformer_roles() -> None:
    model = TinyLM()
    groups = geometry_param_groups(model, radii={"head": 50.0, "hidden": 3.0}, lr=0.01)
    norms = _norm_of(groups)
    assert norms["embed.weight"] == "colnorm"
    by_role = {g["role"]: g for g in groups}
    assert by_role["embedding"]["norm_kwargs"] == {"transpose": True}
    assert norms["lm_head.weight"] == "sign"
    for name in ("block.self_attn.in_proj_weight", "block.self_attn.out_proj.weight"):
        assert norms[name] == "spectral"
    for name in ("block.linear1.weight", "block.linear2.weight"):
        assert norms[name] == "spectral"
    for name in ("block.linear1.bias", "block.norm1.weight", "norm.weight", "norm.bias"):
        assert norms[name] == "rms"
    by_role = {g["role"]: g for g in groups}
    assert by_role["head"]["radius"] == 50.0 and by_role["hidden"]["radius"] == 3.0
    assert "radius" not in by_role["vector"] and all(g["lr"] == 0.01 for g in groups)
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_groups_drive_accelegrad_sharp() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    opt = AcceleGradSharp(geometry_param_groups(model), lr=0.02)
    tokens = torch.randint(0, 30, (8, 6))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 30), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_tied_weights_counted_once_as_embedding() -> None:
    groups = geometry_param_groups(TinyLM(tie=True))
    names = [n for g in groups for n in g["param_names"]]
    assert "embed.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))


def test_cnn_roles_and_last_linear_head() -> None:
    norms = _norm_of(geometry_param_groups(_cnn()))
    assert norms["0.weight"] == "spectral_conv" and norms["3.weight"] == "spectral_conv"
    assert norms["6.weight"] == "spectral"
    assert norms["8.weight"] == "sign"  # no head by name: the last Linear
    assert norms["1.weight"] == "rms" and norms["8.bias"] == "rms"


def test_explicit_head_and_norm_override() -> None:
    groups = geometry_param_groups(
        _cnn(), head="6", norms={"hidden": "euclidean", "head": "rownorm"}
    )
    norms = _norm_of(groups)
    assert norms["6.weight"] == "rownorm" and norms["8.weight"] == "euclidean"


def test_frozen_parameters_left_out() -> None:
    model = _cnn()
    model[0].weight.requires_grad_(False)
    assert "0.weight" not in _norm_of(geometry_param_groups(model))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head": "nope"}, "nope"),
        ({"norms": {"hidden": "nuclear"}}, "nuclear"),
        ({"norms": {"body": "sign"}}, "body"),
        ({"radii": {"body": 1.0}}, "body"),
        ({"norm": "sign"}, "norm"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        geometry_param_groups(_cnn(), **kwargs)


@pytest.mark.parametrize("optimizer", [AcceleGradSharp, Scion])
def test_state_dict_of_geometry_groups_loads_with_weights_only(optimizer, tmp_path) -> None:
    # Lightning checkpoints are loaded with weights_only=True: the groups must be plain data.
    model = TinyLM()
    opt = optimizer(geometry_param_groups(model), lr=0.01)
    model(torch.randint(0, 30, (2, 5))).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    state = torch.load(tmp_path / "opt.pt", weights_only=True)
    embedding = next(g for g in state["param_groups"] if g["role"] == "embedding")
    assert (embedding["norm"], embedding["norm_kwargs"]) == ("colnorm", {"transpose": True})
    fresh = optimizer(geometry_param_groups(model), lr=0.01)
    fresh.load_state_dict(state)


def _muon_adamw(model: nn.Module) -> OptimizerChain:
    groups = geometry_param_groups(model)
    hidden = [p for g in groups if g["role"] == "hidden" for p in g["params"]]
    inside, outside = split_param_groups(groups, hidden)
    return OptimizerChain([torch.optim.Muon(inside, lr=0.02), torch.optim.AdamW(outside)])


@pytest.mark.parametrize("tie", [False, True])
def test_coverage_of_complete_optimizers_passes(tie: bool) -> None:
    model = TinyLM(tie=tie)
    check_param_coverage(model, AcceleGradSharp(geometry_param_groups(model), lr=0.01))
    check_param_coverage(model, _muon_adamw(model))
    for module in (model.embed, model.norm, model.lm_head):  # frozen: need not be held
        module.requires_grad_(False)
    check_param_coverage(model, torch.optim.SGD(model.block.parameters(), lr=0.1))


def test_coverage_names_up_to_five_missing_parameters_and_counts_them() -> None:
    model = TinyLM()
    total = len(list(model.parameters()))
    opt = torch.optim.SGD(model.lm_head.parameters(), lr=0.1)
    with pytest.raises(InputError) as info:
        check_param_coverage(model, opt)
    message = str(info.value)
    assert f"misses {total - 1} of the {total} trainable parameters" in message
    assert "'embed.weight'" in message and f"and {total - 6} more" in message
    assert message.count("'") == 2 * 5  # five names, quoted
    assert isinstance(info.value, ValueError)


def test_coverage_of_a_chain_missing_one_parameter() -> None:
    model = TinyLM()
    groups = geometry_param_groups(model)
    groups[-1]["params"] = []  # the head group loses its weight
    groups[-1]["param_names"] = []
    chain = OptimizerChain(
        [AcceleGradSharp(groups[:2], lr=0.01), torch.optim.AdamW(groups[2:], lr=1e-3)]
    )
    with pytest.raises(
        InputError, match=r"misses 1 of the \d+ trainable parameters.*'lm_head.weight'$"
    ):
        check_param_coverage(model, chain)


def test_coverage_names_a_parameter_held_twice_in_one_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.warns(UserWarning, match="duplicate"):  # torch only warns
        opt = torch.optim.SGD([*model.parameters(), model[1].weight], lr=0.1)
    with pytest.raises(InputError, match=r"hold 1 parameter more than once: '1.weight'$"):
        check_param_coverage(model, opt)


def test_coverage_names_a_parameter_held_by_two_chained_optimizers() -> None:
    model = TinyLM()
    groups = geometry_param_groups(model)
    hidden = [p for g in groups if g["role"] == "hidden" for p in g["params"]]
    _, outside = split_param_groups(groups, hidden)
    rest = [p for g in outside for p in g["params"]]
    with pytest.raises(InputError, match=r"optimizers\[1\] holds a parameter of shape"):
        OptimizerChain([torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW([*rest, hidden[0]])])
    chain = OptimizerChain([torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest)])
    chain.optimizers[1].param_groups[0]["params"].append(hidden[0])  # edited after the checks
    with pytest.raises(
        InputError, match=r"hold 1 parameter more than once: 'block.self_attn.in_proj_weight'$"
    ):
        check_param_coverage(model, chain)
    stranger = nn.Parameter(torch.zeros(3, 2))
    with pytest.warns(UserWarning, match="duplicate"):
        opt = torch.optim.SGD([*model.parameters(), stranger, stranger], lr=0.1)
    with pytest.raises(InputError, match=r"a parameter of shape \(3, 2\) \(not the module's\)"):
        check_param_coverage(model, opt)


def test_ancre_routing_coefficients_get_a_group_of_their_own():
    from ada_modules.nn import ANCReStack

    stack = ANCReStack([nn.Linear(8, 8) for _ in range(3)], mode="source", residual_in_block=False)
    groups = {g["role"]: g for g in geometry_param_groups(stack, radii={"routing": 2.0})}
    routing = groups["routing"]
    assert routing["norm"] == "rms" and routing["radius"] == 2.0
    assert {id(p) for p in routing["params"]} == {id(p) for p in stack.router.parameters()}
    assert all(
        not n.startswith("router.")
        for g in groups.values()
        if g is not routing
        for n in g["param_names"]
    )


def test_weight_decay_groups_keep_what_no_weight_decay_names():
    """The stream-mixing matrix of a StreamsWrapper is 2-D but must not be decayed."""
    from ada_modules.models import CausalLMModule
    from ada_modules.nn import StreamsWrapper

    module = CausalLMModule(
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=32,
        model_wrapper=StreamsWrapper(n_streams=4, kind="hyper"),
    )
    decay, no_decay = weight_decay_param_groups(module)
    decayed = {id(p) for p in decay["params"]}
    kept = dict(module.model.named_parameters())
    names = module.model.no_weight_decay()
    assert any(kept[name].ndim == 2 for name in names)  # res_static
    assert all(id(kept[name]) not in decayed for name in names)
    assert {id(p) for p in no_decay["params"]} >= {id(kept[name]) for name in names}
    assert decayed  # the attention and MLP matrices still are


def test_a_chain_refuses_children_it_cannot_step():
    model = nn.Linear(2, 2)
    with pytest.raises(InputError, match=r"optimizers\[1\] holds a parameter of shape \(2, 2\)"):
        OptimizerChain([torch.optim.AdamW(model.parameters()), torch.optim.SGD([model.weight])])
    with pytest.raises(InputError, match=r"optimizers\[0\] must be .* \(not LBFGS\), got LBFGS"):
        OptimizerChain([torch.optim.LBFGS(model.parameters())])  # it needs its own closure
    with pytest.raises(InputError, match=r"optimizers\[0\] must be .*, got Linear"):
        OptimizerChain([model])
