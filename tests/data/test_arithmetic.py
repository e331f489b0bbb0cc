import random
import re

import pytest

from ada_modules.data import ArithmeticDataModule, CharTokenizer, addition_scratchpad

_STEP = re.compile(r"(\d)\+(\d)\+([01])=(\d+)")


def _check_scratchpad(a: int, b: int, completion: str) -> None:
    steps, final = completion.split(">")
    digits_a, digits_b = str(a)[::-1], str(b)[::-1]
    carry, written = 0, []
    for i, step in enumerate(steps.split(",")):
        x, y, c, total = (int(g) for g in _STEP.fullmatch(step).groups())
        assert x == (int(digits_a[i]) if i < len(digits_a) else 0)
        assert y == (int(digits_b[i]) if i < len(digits_b) else 0)
        assert c == carry and total == x + y + c
        carry = total // 10
        written.append(total)
    assert i + 1 == max(len(digits_a), len(digits_b))
    # The final answer is read off the steps: the last sum, then the other units digits.
    assert final == str(written[-1]) + "".join(str(t % 10) for t in reversed(written[:-1]))
    assert int(final) == a + b


def test_scratchpad_is_correct_for_random_operands():
    rng = random.Random(0)
    for _ in range(500):
        a, b = rng.randrange(10 ** rng.randint(1, 12)), rng.randrange(10 ** rng.randint(1, 12))
        _check_scratchpad(a, b, addition_scratchpad(a, b))
    assert addition_scratchpad(999, 1) == "9+1+0=10,9+0+1=10,9+0+1=10>1000"


def test_batches_hold_consistent_problems():
    dm = ArithmeticDataModule(min_digits=2, max_digits=5, num_train=64, num_val=8, num_test=64)
    dm.setup("test")
    tok = CharTokenizer()
    lengths = set()
    for batch in dm.test_dataloader():
        for row, target in enumerate(batch["targets"]):
            a, b = (int(x) for x in tok.decode(batch["prompt_ids"][row]).rstrip("=").split("+"))
            assert 10 <= a < 100_000 and 10 <= b < 100_000
            _check_scratchpad(a, b, target)
            assert batch["answers"][row] == str(a + b) == dm.extract_answer(target)
            assert batch["digits"][row].item() == max(len(str(a)), len(str(b)))
            labelled = batch["labels"][row][batch["labels"][row] != -100].tolist()
            assert labelled == tok.encode(target, add_eos=True)
            lengths.add(len(target))
    assert len(lengths) > 3, "completions should vary in length"


def test_numerals_rewrite_only_the_prompt_of_the_same_problems():
    plain = ArithmeticDataModule(num_train=32, num_val=8, num_test=32, seed=3)
    letters = ArithmeticDataModule(
        numerals="jihgfedcba", num_train=32, num_val=8, num_test=32, seed=3
    )
    plain.setup("test"), letters.setup("test")
    tok = CharTokenizer()
    reads = str.maketrans("jihgfedcba", "0123456789")
    plain_batch, letter_batch = (
        next(iter(plain.test_dataloader())),
        next(iter(letters.test_dataloader())),
    )
    for row, target in enumerate(letter_batch["targets"]):
        prompt = tok.decode(letter_batch["prompt_ids"][row])
        assert not any(ch.isdigit() for ch in prompt)
        assert prompt.translate(reads) == tok.decode(plain_batch["prompt_ids"][row])
        assert target == plain_batch["targets"][row]
        assert letter_batch["answers"][row] == plain_batch["answers"][row]


def test_reward_checks_only_the_final_answer():
    dm = ArithmeticDataModule()
    assert dm.reward("1+1+0=2>2", "2") == 1.0
    assert dm.reward("garbled steps>2", "2") == 1.0
    assert dm.reward("1+1+0=2>3", "2") == 0.0
    assert dm.reward("1+1+0=2", "2") == 0.0


def test_determinism_and_disjoint_splits_in_a_small_prompt_space():
    # One-digit addition has only 100 prompts, so without rejection the splits would collide.
    make = lambda: ArithmeticDataModule(  # noqa: E731
        min_digits=1, max_digits=1, num_train=400, num_val=20, num_test=20, seed=5
    )
    dm, again = make(), make()
    dm.setup("fit")
    again.setup("fit")
    prompts = {
        split: [tuple(ex["prompt_ids"]) for ex in dm.datasets[split]]
        for split in ("train", "val", "test")
    }
    assert prompts["train"] == [tuple(ex["prompt_ids"]) for ex in again.datasets["train"]]
    train, val, test = (set(p) for p in prompts.values())
    assert len(val) == 20 and len(test) == 20
    assert not train & val and not train & test and not val & test
    assert len(train) == 60


def test_too_few_distinct_prompts_raises():
    dm = ArithmeticDataModule(min_digits=1, max_digits=1, num_val=60, num_test=60)
    with pytest.raises(ValueError, match="num_val"):
        dm.setup("validate")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_digits": 0}, "min_digits"),
        ({"min_digits": 3, "max_digits": 2}, "max_digits"),
        ({"num_train": 0}, "num_train"),
        ({"num_workers": -1}, "num_workers"),
        ({"seed": 1.5}, "seed"),
        ({"numerals": "abcdefghi"}, "numerals"),
        ({"numerals": "aacdefghij"}, "numerals"),
        ({"numerals": "abcdefgh+j"}, "numerals"),
        ({"numerals": "abcdefghi\u00e9"}, "numerals"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ArithmeticDataModule(**kwargs)
