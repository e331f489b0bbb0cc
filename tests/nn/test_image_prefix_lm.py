"""The image-prefix LM: output shape, absent images ignore their patches, cached greedy
``generate`` equals a no-cache greedy loop over ``forward`` (and pads after ``<eos>``), steering
hooks reach the wrapped LM, and bad input."""

import pytest
import torch

from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError
from ada_modules.models.causal_lm import build_causal_lm
from ada_modules.nn.image_prefix_lm import ImagePrefixLM
from ada_modules.steering import SteeringVector, decoder_layers, steer

TOKENIZER = CharTokenizer()


def _model() -> ImagePrefixLM:
    torch.manual_seed(0)
    lm = build_causal_lm(
        TOKENIZER, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64
    )
    return ImagePrefixLM(lm, patch_dim=16, num_patches=4).eval()


def _inputs(batch: int = 3, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    patches = torch.rand(batch, 4, 16, generator=generator)
    ids = torch.randint(3, TOKENIZER.vocab_size, (batch, 9), generator=generator)
    return patches, ids


def test_forward_shape_covers_bos_image_and_text() -> None:
    model = _model()
    patches, ids = _inputs()
    logits = model(patches, torch.tensor([True, False, True]), ids)
    assert model.prefix_length == 5
    assert logits.shape == (3, 1 + 4 + 9, TOKENIZER.vocab_size)


@torch.no_grad()
def test_absent_image_rows_ignore_their_patches() -> None:
    model = _model()
    patches, ids = _inputs()
    present = torch.tensor([True, False, True])
    other = patches.clone()
    other[1] = torch.rand(4, 16) * 5  # the absent row's patches change
    torch.testing.assert_close(model(patches, present, ids)[1], model(other, present, ids)[1])
    other[0] = torch.rand(4, 16) * 5  # a present row's patches change its logits
    assert not torch.allclose(model(patches, present, ids)[0], model(other, present, ids)[0])


@torch.no_grad()
def test_each_row_is_independent_of_the_others() -> None:
    model = _model()
    patches, ids = _inputs()
    present = torch.tensor([True, False, True])
    together = model(patches, present, ids)
    alone = model(patches[2:], present[2:], ids[2:])
    torch.testing.assert_close(together[2:], alone, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def _greedy_without_cache(model, patches, present, ids, steps: int) -> torch.Tensor:
    eos, pad = TOKENIZER.eos_id, TOKENIZER.pad_id
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    tokens = []
    for _ in range(steps):
        token = model(patches, present, ids)[:, -1].argmax(-1)
        token = torch.where(done, torch.full_like(token, pad), token)
        done |= token == eos
        tokens.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1)
    return torch.stack(tokens, dim=1)


def test_generate_matches_a_greedy_loop_without_cache() -> None:
    model = _model()
    patches, ids = _inputs(batch=4, seed=2)
    present = torch.tensor([True, False, True, True])
    generated = model.generate(patches, present, ids, max_new_tokens=6)
    assert generated.shape == (4, 6)
    assert torch.equal(generated, _greedy_without_cache(model, patches, present, ids, 6))


def test_generate_pads_rows_after_eos() -> None:
    model = _model()
    patches, ids = _inputs(batch=2)
    # push <eos> to the top of every next-token distribution
    bump = torch.zeros(TOKENIZER.vocab_size)
    bump[TOKENIZER.eos_id] = 1e4
    handle = model.lm.lm_head.register_forward_hook(lambda _m, _a, out: out + bump)
    try:
        generated = model.generate(patches, torch.tensor([True, True]), ids, max_new_tokens=3)
    finally:
        handle.remove()
    expected = [TOKENIZER.eos_id, TOKENIZER.pad_id, TOKENIZER.pad_id]
    assert generated.tolist() == [expected, expected]


@torch.no_grad()
def test_steering_hooks_reach_the_wrapped_lm() -> None:
    model = _model()
    patches, ids = _inputs()
    present = torch.tensor([True, True, False])
    assert decoder_layers(model) is model.lm.model.layers
    plain = model(patches, present, ids)
    with steer(model, SteeringVector({1: torch.ones(32)}), strength=3.0, token_scope="last"):
        steered = model(patches, present, ids)
    assert torch.equal(steered[:, :-1], plain[:, :-1])
    assert not torch.allclose(steered[:, -1], plain[:, -1])
    with pytest.raises(InputError, match="width 8 differs from layer 0's output width 32"):
        with steer(model, SteeringVector({0: torch.ones(8)})):
            model(patches, present, ids)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("shape", [(3, 4, 15), (3, 5, 16), (3, 64)])
def test_bad_patches_shape_raises(shape: tuple[int, ...]) -> None:
    _, ids = _inputs()
    with pytest.raises(InputError, match=rf"patches must be \(batch, 4, 16\), got \({shape[0]}, "):
        _model()(torch.zeros(shape), torch.ones(3, dtype=torch.bool), ids)


@pytest.mark.parametrize(("name", "value"), [("patch_dim", 0), ("num_patches", 2.0)])
def test_bad_constructor_arguments_raise(name: str, value: object) -> None:
    lm = build_causal_lm(
        TOKENIZER, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=16
    )
    with pytest.raises(InputError, match=f"{name} must be an int >= 1, got {value!r}"):
        ImagePrefixLM(lm, **{name: value})
