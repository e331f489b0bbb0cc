"""Steering and capture hooks on a tiny Llama: the model is bitwise unchanged after a block (also
when the block raises), token scopes (``all``, ``last``, ``k``) and per-row strengths change
exactly the positions and rows they name, ``generate`` with a KV cache is steered, the steered
hidden state is the plain one plus ``strength * direction``, and bad input is named."""

import math
import warnings

import numpy as np
import pytest
import torch
import transformers
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from ada_modules.errors import InputError
from ada_modules.steering import SteeringVector, capture_hidden_states, decoder_layers, steer

HIDDEN = 16
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def _direction(seed: int = 1) -> torch.Tensor:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


def _vector(layers: tuple[int, ...] = (0,)) -> SteeringVector:
    return SteeringVector({layer: _direction(layer + 1) for layer in layers})


def _no_hooks(model: nn.Module) -> bool:
    return all(len(layer._forward_hooks) == 0 for layer in decoder_layers(model))


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    return model(ids).logits


# ------------------------------------------------------------------ apply and remove


def test_steer_then_remove_leaves_the_model_bitwise_unchanged() -> None:
    model = _model()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    plain = _logits(model)
    with steer(model, _vector((0, 1)), strength=4.0):
        assert not _no_hooks(model)
        steered = _logits(model)
    assert not torch.allclose(steered, plain)
    assert _no_hooks(model)
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[name], state[name]) for name in state)
    assert torch.equal(_logits(model), plain)


def test_hooks_are_removed_when_the_block_raises() -> None:
    model = _model()
    plain = _logits(model)
    with pytest.raises(RuntimeError, match="boom"), steer(model, _vector((0, 1)), strength=4.0):
        _logits(model)
        raise RuntimeError("boom")
    assert _no_hooks(model)
    assert torch.equal(_logits(model), plain)


def test_capture_hooks_are_removed_when_the_block_raises() -> None:
    model = _model()
    with pytest.raises(RuntimeError, match="boom"), capture_hidden_states(model, [0, 1]):
        raise RuntimeError("boom")
    assert _no_hooks(model)


def test_strength_zero_gives_identical_outputs() -> None:
    model = _model()
    with steer(model, _vector((0, 1)), strength=0.0):
        steered = _logits(model)
    assert torch.equal(steered, _logits(model))


# ------------------------------------------------------------------ scopes and strengths


def test_last_scope_changes_only_the_last_position() -> None:
    model = _model()
    plain = _logits(model)
    with steer(model, _vector(), strength=4.0, token_scope="last"):
        steered = _logits(model)
    assert torch.equal(steered[:, :-1], plain[:, :-1])
    for row in range(IDS.shape[0]):
        assert not torch.allclose(steered[row, -1], plain[row, -1])


def test_int_scope_steers_positions_from_k_on() -> None:
    model = _model()
    plain = _logits(model)
    with steer(model, _vector(), strength=4.0, token_scope=3):
        steered = _logits(model)
    assert torch.equal(steered[:, :3], plain[:, :3])
    for position in range(3, IDS.shape[1]):
        assert not torch.allclose(steered[:, position], plain[:, position])


def test_int_scope_zero_equals_all() -> None:
    model = _model()
    with steer(model, _vector(), strength=4.0, token_scope=0):
        from_zero = _logits(model)
    with steer(model, _vector(), strength=4.0, token_scope="all"):
        every = _logits(model)
    torch.testing.assert_close(from_zero, every)


def test_per_row_strength_steers_only_rows_with_nonzero_strength() -> None:
    model = _model()
    plain = _logits(model)
    with steer(model, _vector(), strength=torch.tensor([0.0, 6.0])):
        steered = _logits(model)
    assert torch.allclose(steered[0], plain[0], atol=1e-6)
    assert not torch.allclose(steered[1], plain[1], atol=1e-3)


def test_steered_hidden_state_is_plain_plus_strength_times_direction() -> None:
    model = _model()
    vector = _vector((0,))
    with capture_hidden_states(model, [0]) as plain:
        _logits(model)
    with steer(model, vector, strength=2.5), capture_hidden_states(model, [0]) as steered:
        _logits(model)
    torch.testing.assert_close(
        steered[0][0] - plain[0][0], (2.5 * vector.directions[0]).expand(2, 6, HIDDEN)
    )


def test_per_row_strength_adds_each_rows_multiple() -> None:
    model = _model()
    vector = _vector((1,))
    strength = torch.tensor([-1.5, 3.0])
    with capture_hidden_states(model, [1]) as plain:
        _logits(model)
    with steer(model, vector, strength), capture_hidden_states(model, [1]) as steered:
        _logits(model)
    expected = strength.view(2, 1, 1) * vector.directions[1]
    torch.testing.assert_close(steered[1][0] - plain[1][0], expected.expand(2, 6, HIDDEN))


# ------------------------------------------------------------------ generate with a KV cache


def _generate(model: LlamaForCausalLM, **kwargs: object):
    return model.generate(
        IDS,
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=None,
        cache=DynamicCache(config=model.config),
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )


def test_generate_with_a_cache_is_steered_and_hooks_are_removed() -> None:
    model = _model()
    plain = _generate(model)
    with steer(model, _vector(), strength=8.0):
        steered = _generate(model)
    assert steered.sequences.shape == plain.sequences.shape == (2, 11)
    assert not torch.equal(steered.sequences[:, 6:], plain.sequences[:, 6:])
    assert _no_hooks(model)
    assert torch.equal(_generate(model).sequences, plain.sequences)


def test_generate_with_strength_zero_equals_plain_generate() -> None:
    model = _model()
    plain = _generate(model)
    with steer(model, _vector((0, 1)), strength=0.0):
        steered = _generate(model)
    assert torch.equal(steered.sequences, plain.sequences)
    for a, b in zip(steered.scores, plain.scores, strict=True):
        assert torch.equal(a, b)


def test_int_scope_in_generate_reads_positions_from_the_cache() -> None:
    """Scope = prompt length: the prompt's logits are untouched, every decoded token is steered."""
    model = _model()
    plain = _generate(model)
    with steer(model, _vector(), strength=8.0, token_scope=IDS.shape[1]):
        steered = _generate(model)
    assert torch.equal(steered.scores[0], plain.scores[0])
    assert torch.equal(steered.sequences[:, 6], plain.sequences[:, 6])
    assert not torch.allclose(steered.scores[1], plain.scores[1])


def test_per_row_strength_follows_each_prompt_into_its_beams_and_returned_sequences() -> None:
    """generate repeats each prompt ``k`` times in a row: strength row ``i`` covers them all."""
    model = _model()
    beams = {"num_beams": 2, "num_return_sequences": 2, "max_new_tokens": 3, "do_sample": False}
    plain = model.generate(IDS, **beams)
    with steer(model, _vector(), strength=8.0, token_scope="last"):
        uniform = model.generate(IDS, **beams)
    with steer(model, _vector(), strength=torch.tensor([8.0, 8.0]), token_scope="last"):
        per_row = model.generate(IDS, **beams)
    with steer(model, _vector(), strength=torch.tensor([0.0, 8.0]), token_scope="last"):
        first_unsteered = model.generate(IDS, **beams)
    assert torch.equal(per_row, uniform) and not torch.equal(uniform, plain)
    assert torch.equal(first_unsteered[:2], plain[:2])  # prompt 0's two returned sequences
    assert torch.equal(first_unsteered[2:], uniform[2:])


def test_last_scope_without_a_cache_warns_once() -> None:
    """Without a KV cache every step recomputes the earlier generated positions unsteered."""
    model = _model()
    with pytest.warns(UserWarning, match="use_cache=False") as record:
        with steer(model, _vector(), strength=8.0, token_scope="last"):
            model.generate(IDS, max_new_tokens=3, do_sample=False, use_cache=False)
    assert len([w for w in record if "use_cache=False" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with steer(model, _vector(), strength=8.0, token_scope="last"):
            model.generate(IDS, max_new_tokens=3, do_sample=False)
            _logits(model)
            _logits(model)


# ------------------------------------------------------------------ left padding


def test_int_scope_counts_padding_in_a_plain_forward_unless_position_ids_are_passed() -> None:
    """Pins the documented limit: a plain ``model(...)`` call does not derive ``position_ids``
    from the attention mask (``generate`` does), so ``k`` counts the left padding unless the
    caller passes them."""
    model = _model()
    tokens = IDS[:1, :4]
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), tokens], dim=1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad(), steer(model, _vector(), strength=8.0, token_scope=2):
        alone = model(tokens).logits
        counted = model(padded, attention_mask=mask).logits[:, 2:]
        aligned = model(padded, attention_mask=mask, position_ids=positions).logits[:, 2:]
    torch.testing.assert_close(aligned, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(counted, alone, atol=1e-3)


# ------------------------------------------------------------------ architectures


def _tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    size = {"vocab_size": 32, "n_embd": HIDDEN, "n_layer": 2, "n_head": 2}
    configs = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**size)),
        "gptj": lambda: transformers.GPTJForCausalLM(transformers.GPTJConfig(**size, rotary_dim=4)),
        "bloom": lambda: transformers.BloomForCausalLM(
            transformers.BloomConfig(vocab_size=32, hidden_size=HIDDEN, n_layer=2, n_head=2)
        ),
        "falcon": lambda: transformers.FalconForCausalLM(
            transformers.FalconConfig(
                vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2
            )
        ),
    }
    return configs[name]().eval()


@pytest.mark.parametrize("name", ["gpt2", "gptj", "bloom", "falcon"])
def test_decoders_that_keep_their_blocks_in_transformer_h_are_steered(name: str) -> None:
    model = _tiny(name)
    assert decoder_layers(model) is model.transformer.h
    plain = _logits(model)
    with steer(model, _vector((1,)), strength=8.0, token_scope="last"):
        steered = _logits(model)
    assert torch.equal(steered[:, :-1], plain[:, :-1])
    assert not torch.allclose(steered[:, -1], plain[:, -1])
    assert _no_hooks(model) and torch.equal(_logits(model), plain)


# ------------------------------------------------------------------ capture


def test_capture_returns_one_detached_state_per_call_and_removes_hooks() -> None:
    model = _model()
    with capture_hidden_states(model, [0, 1]) as states:
        model(IDS)  # with autograd on
        _logits(model, IDS[:1, :4])
    assert _no_hooks(model)
    assert set(states) == {0, 1}
    for layer in (0, 1):
        assert [tuple(s.shape) for s in states[layer]] == [(2, 6, HIDDEN), (1, 4, HIDDEN)]
        assert not any(s.requires_grad for s in states[layer])
    # layer 1's output feeds the final norm: the logits follow from it
    logits = model.lm_head(model.model.norm(states[1][0]))
    torch.testing.assert_close(logits, _logits(model))


# ------------------------------------------------------------------ bad input


def test_layer_out_of_range_raises_naming_layer_and_count() -> None:
    model = _model()
    with pytest.raises(InputError, match=r"layer 5 is out of range: LlamaForCausalLM has 2"):
        with steer(model, SteeringVector({5: torch.ones(HIDDEN)})):
            pass
    with pytest.raises(InputError, match=r"layer 2 is out of range.*has 2 decoder layers"):
        with capture_hidden_states(model, [0, 2]):
            pass
    assert _no_hooks(model)


def test_vector_width_different_from_hidden_size_raises() -> None:
    """The first forward call names both widths; the hooks are gone afterwards."""
    model = _model()
    with pytest.raises(InputError, match="width 8 differs from layer 0's output width 16"):
        with steer(model, SteeringVector({0: torch.ones(8)})):
            model(torch.tensor([[1, 2, 3]]))
    assert all(not layer._forward_hooks for layer in model.model.layers)


@pytest.mark.parametrize(
    ("strength", "match"),
    [
        (math.nan, "strength must be finite, got nan"),
        (torch.tensor([1.0, math.inf]), "strength must be finite"),
        ("1.0", "strength must be a number or a tensor, got str"),
        (True, "strength must be a number or a tensor, got bool"),
        (torch.ones(2, 1), r"strength must be a scalar or \(batch,\), got shape \(2, 1\)"),
        (torch.tensor([1 + 1j, 1]), "strength must be real, got dtype torch.complex64"),
        ([1.0, 2.0], "strength must be a number or a tensor, got list"),
        (torch.ones(0), "strength must hold at least one value, got an empty tensor"),
    ],
)
def test_bad_strength_raises_on_entry(strength: object, match: str) -> None:
    model = _model()
    with pytest.raises(InputError, match=match):
        with steer(model, _vector(), strength=strength):
            pass
    assert _no_hooks(model)


@pytest.mark.parametrize("strength", [np.float32(4.0), np.int64(4), torch.tensor(4)])
def test_real_scalar_strengths_are_accepted(strength: object) -> None:
    model = _model()
    with steer(model, _vector(), strength=4.0):
        expected = _logits(model)
    with steer(model, _vector(), strength=strength):
        assert torch.equal(_logits(model), expected)


def test_strength_of_wrong_batch_length_raises_and_removes_hooks() -> None:
    model = _model()
    with pytest.raises(
        InputError, match="strength has 3 entries but the batch has 2 rows: it needs"
    ):
        with steer(model, _vector(), strength=torch.ones(3)):
            _logits(model)
    assert _no_hooks(model)


@pytest.mark.parametrize("scope", ["first", -1, True, 1.5])
def test_unknown_token_scope_raises(scope: object) -> None:
    with pytest.raises(
        InputError, match=f"token_scope must be 'all', 'last' or an int >= 0, got {scope!r}"
    ):
        with steer(_model(), _vector(), token_scope=scope):
            pass


def test_int_scope_that_selects_no_token_raises_on_exit_and_removes_hooks() -> None:
    model = _model()
    plain = _logits(model)
    with pytest.raises(InputError, match="token_scope=1000 selected no token"):
        with steer(model, _vector(), strength=4.0, token_scope=1000):
            inside = _logits(model)
    assert torch.equal(inside, plain)
    assert _no_hooks(model)


def test_decoder_layers_of_a_model_without_layers_raises() -> None:
    with pytest.raises(InputError, match="Linear has no decoder layers"):
        decoder_layers(nn.Linear(4, 4))
    with pytest.raises(InputError, match="Linear has no decoder layers"):
        with steer(nn.Linear(4, 4), SteeringVector({0: torch.ones(4)})):
            pass


def test_decoder_layers_finds_the_layers_of_a_wrapped_lm() -> None:
    model = _model()
    wrapper = nn.Module()
    wrapper.lm = model
    assert decoder_layers(wrapper) is model.model.layers
    assert decoder_layers(model.model) is model.model.layers
