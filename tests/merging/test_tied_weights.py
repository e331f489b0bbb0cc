"""Tied weights (one tensor under several keys, e.g. a language model's embedding and output head)
in every merge: merged once under the first key, shared by every key of the tie, the same whether
the method is called directly or through a recipe, and models tied differently refused."""

import pytest
import torch
from torch import nn

from ada_modules.errors import InputError
from ada_modules.merging import (
    amaris,
    collect_activation_stats,
    collect_fisher,
    dare,
    fisher_merge,
    regmean,
    task_arithmetic,
    ties,
)
from ada_modules.merging.recipe import MergeRecipe, merge

TIE = {"head.weight": "embed.weight"}


class _TiedLM(nn.Module):
    """A token embedding, one hidden layer and an output head that is the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def _log_likelihood(model, ids):
    """Each token predicts the next one."""
    logits = model(ids[:, :-1]).log_softmax(-1)
    return logits.gather(-1, ids[:, 1:, None]).sum((1, 2))


@pytest.fixture(scope="module")
def models():
    """A tied base, a tuned copy (the tied tensor changed once) and their statistics."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    base_model, tuned_model = _TiedLM().double(), _TiedLM().double()
    tuned_model.load_state_dict(base_model.state_dict())
    with torch.no_grad():
        for p in tuned_model.parameters():  # the tied tensor once
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    core, domain = (
        torch.randint(0, 12, (128,), generator=g),
        torch.randint(6, 12, (128,), generator=g),
    )
    return {
        "base": base_model.state_dict(),
        "tuned": tuned_model.state_dict(),
        "activations": (
            collect_activation_stats(base_model, [core]),
            collect_activation_stats(tuned_model, [domain]),
        ),
        "fisher": (
            collect_fisher(base_model, [core.view(8, 16)], _log_likelihood),
            collect_fisher(tuned_model, [domain.view(8, 16)], _log_likelihood),
        ),
    }


def _direct(method, base, tuned, stats, generator):
    """The method called on the state dicts themselves, as the recipe would call it."""
    if method == "task_arithmetic":
        return task_arithmetic(base, [tuned])
    if method == "ties":
        return ties(base, [tuned], density=0.5)
    if method == "dare_linear":
        return dare(base, [tuned], density=0.5, generator=generator)
    if method == "regmean":
        return regmean(base, [base, tuned], list(stats), alpha=0.5)
    return fisher_merge([base, tuned], list(stats), eps=1e-8)


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare_linear", "regmean", "fisher"])
def test_a_tie_is_merged_once_directly_as_through_the_recipe(models, method):
    base, tuned = models["base"], models["tuned"]
    recipe = MergeRecipe.build(method, [{"model": "s", "domain": "d"}])
    statistics = models.get(recipe.statistics, (None, None))
    merged = _direct(method, base, tuned, statistics, torch.Generator().manual_seed(1))
    expected, report = merge(
        recipe, base, [tuned], *statistics[:1], [statistics[1]], torch.Generator().manual_seed(1)
    )
    assert report["tied"] == TIE
    assert merged["head.weight"] is merged["embed.weight"]
    for name in base:
        assert torch.equal(merged[name], expected[name]), name
    assert not torch.equal(merged["embed.weight"], base["embed.weight"])


@pytest.mark.parametrize("other", ["base", "task_arithmetic"])
def test_amaris_merges_tied_weights_once_as_the_recipe_does(models, other):
    base, tuned = models["base"], models["tuned"]
    base_stats, tuned_stats = models["activations"]
    assert set(base_stats) == {"hidden", "head"}
    merged, report = amaris(base, [tuned], [tuned_stats], base_stats, budget=0.05, other=other)
    recipe = MergeRecipe.build("amaris", [{"model": "s", "domain": "d"}], {"other": other})
    expected, recipe_report = merge(recipe, base, [tuned], base_stats, [tuned_stats])
    assert report["tied"] == recipe_report["tied"] == TIE
    assert list(report["layers"]) == list(recipe_report["layers"]) == ["hidden"]
    assert merged["head.weight"] is merged["embed.weight"]
    for name in base:
        assert torch.equal(merged[name], expected[name]), name
    if other == "base":
        assert torch.equal(merged["embed.weight"], base["embed.weight"])


@pytest.mark.parametrize(
    "method", ["task_arithmetic", "ties", "dare_linear", "regmean", "fisher", "amaris"]
)
def test_a_member_tied_differently_is_refused_by_name(models, method):
    base = models["base"]
    untied = {**models["tuned"], "head.weight": models["tuned"]["head.weight"] + 1.0}
    stats = models["activations"] if method in ("regmean", "amaris") else models["fisher"]
    with pytest.raises(InputError, match=r"'head.weight' and 'embed.weight' hold different"):
        if method == "amaris":
            amaris(base, [untied], [stats[1]], stats[0])
        else:
            _direct(method, base, untied, stats, None)


def test_fisher_values_under_the_later_key_of_a_tie_count_as_under_the_first(models):
    base, tuned = models["base"], models["tuned"]
    by_later = [
        {("head.weight" if k == "embed.weight" else k): v for k, v in f.items()}
        for f in models["fisher"]
    ]
    expected = fisher_merge([base, tuned], list(models["fisher"]))
    merged = fisher_merge([base, tuned], by_later)
    for name in base:
        assert torch.equal(merged[name], expected[name]), name


def test_equal_copies_of_a_tie_are_accepted_nan_included(models):
    base = models["base"]
    embed = base["embed.weight"].clone()  # not the fixture's tensor: later tests use it
    copies = {**base, "embed.weight": embed, "head.weight": embed.clone()}
    copies["head.weight"][0, 0] = copies["embed.weight"][0, 0] = float("nan")
    merged = task_arithmetic(base, [copies])
    assert merged["head.weight"] is merged["embed.weight"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_recipe_names_specialists_that_are_not_state_dicts(models, tied):
    base = models["base"] if tied else {k: v.clone() for k, v in models["base"].items()}
    recipe = MergeRecipe.build("task_arithmetic", [{"model": "s", "domain": "d"}])
    with pytest.raises(InputError, match="specialist 0 must be a state dict, got list"):
        merge(recipe, base, [[1, 2]])
    with pytest.raises(InputError, match="specialists must be a list of state dicts, got dict"):
        merge(recipe, base, {"s": models["tuned"]})


@pytest.mark.parametrize(
    "method", ["task_arithmetic", "ties", "dare_linear", "regmean", "fisher", "amaris"]
)
def test_a_member_storing_a_tie_once_merges_as_with_both_keys(models, method):
    """``save_pretrained`` writes a tied tensor once, under its first key."""
    base, tuned = models["base"], models["tuned"]
    saved_once = {k: v for k, v in tuned.items() if k != "head.weight"}
    stats = models["activations"] if method in ("regmean", "amaris") else models["fisher"]
    if method == "amaris":
        expected, _ = amaris(base, [tuned], [stats[1]], stats[0])
        merged, _ = amaris(base, [saved_once], [stats[1]], stats[0])
    else:
        expected = _direct(method, base, tuned, stats, torch.Generator().manual_seed(1))
        merged = _direct(method, base, saved_once, stats, torch.Generator().manual_seed(1))
    assert merged["head.weight"] is merged["embed.weight"]
    assert merged.keys() == expected.keys()
    for name in base:
        assert torch.equal(merged[name], expected[name]), name


@pytest.mark.parametrize(
    ("models", "parameters", "message"),
    [
        (
            [{"model": "s", "domain": "d"}],
            {"normalize": "false"},
            "normalize must be true or false",
        ),
        ([{"model": "s", "domain": "d"}], ["weight", 0.5], "parameters must be a mapping"),
        (
            [{"model": "s", "domain": "d", "parameters": [0.5]}],
            None,
            r"models\[0\].parameters must be a mapping",
        ),
        ([{"model": "s", "domain": "d"}], {"weight": float("nan")}, "weight must be a finite"),
    ],
)
def test_recipe_parameters_of_the_wrong_kind_are_named(models, parameters, message):
    """'false' was read as true (normalize, rescale, include_base) from the Python API."""
    with pytest.raises(InputError, match=message):
        MergeRecipe.build("task_arithmetic", models, parameters)
