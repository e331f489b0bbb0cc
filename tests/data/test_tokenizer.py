import pytest

from ada_modules.data import CharTokenizer


def test_round_trip_every_character():
    tok = CharTokenizer()
    text = CharTokenizer.characters
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(set(ids[1:-1])) == len(text)
    assert tok.decode(ids) == text


def test_special_ids_are_distinct_and_in_range():
    tok = CharTokenizer()
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert tok.vocab_size == len(tok) == 3 + len(CharTokenizer.characters)
    assert max(tok.encode(CharTokenizer.characters)) == tok.vocab_size - 1


def test_decode_drops_specials_and_stops_at_eos():
    tok = CharTokenizer()
    ids = [tok.pad_id, tok.bos_id, *tok.encode("ab"), tok.eos_id, *tok.encode("cd")]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, stop_at_eos=False) == "abcd"


def test_unknown_character_raises():
    with pytest.raises(ValueError, match="'€'"):
        CharTokenizer().encode("a€")
