import pytest
import torch

from ada_modules.data import CharTokenizer, RecallDataModule

SMALL = {"num_train": 64, "num_val": 32, "num_test": 32, "batch_size": 16}


def _parse(prompt: str) -> tuple[dict[str, str], str, int]:
    """Links, query key and hop count of a recall prompt, read the way a person would."""
    context, query = prompt.split("|")
    links = {}
    for segment in context.split(";"):
        if not segment.startswith("["):
            key, value = segment.split(":")
            assert key not in links, "a key appears twice in the context"
            links[key] = value
    key, hops = query.rstrip("=").split("*")
    return links, key, int(hops)


def _prompts(dm: RecallDataModule, split: str) -> list[str]:
    tok = CharTokenizer()
    return [tok.decode(ex["prompt_ids"]) for ex in dm.datasets[split]]


@pytest.mark.parametrize("max_hops", [1, 3])
def test_answer_follows_the_queried_number_of_links(max_hops):
    dm = RecallDataModule(num_pairs=9, max_hops=max_hops, filler_segments=2, **SMALL)
    dm.setup("fit")
    seen_hops = set()
    for batch in dm.train_dataloader():
        for row, prompt in enumerate(CharTokenizer().decode(p) for p in batch["prompt_ids"]):
            links, node, hops = _parse(prompt)
            assert len(links) == 9
            assert hops == batch["hops"][row].item()
            for _ in range(hops):
                node = links[node]
            assert batch["targets"][row] == batch["answers"][row] == node
            seen_hops.add(hops)
    assert seen_hops == set(range(1, max_hops + 1))


def test_extra_queries_are_answered_never_share_the_final_answer_and_carry_the_loss():
    dm = RecallDataModule(
        num_pairs=8, max_hops=2, key_length=2, filler_segments=1, extra_queries=6, **SMALL
    )
    dm.setup("test")
    tok = CharTokenizer()
    for example in dm.datasets["test"]:
        prompt = tok.decode(example["prompt_ids"])
        context, *extras, final = prompt.split("|")
        assert len(example["prompt_ids"]) == dm.prompt_length and len(extras) == 6
        assert len(set(extras)) == 6
        links, node, hops = _parse(f"{context}|{final}")
        for _ in range(hops):
            node = links[node]
        assert example["answer"] == node
        for extra in extras:
            query, answer = extra.split("=")
            key, extra_hops = query.split("*")
            target = key
            for _ in range(int(extra_hops)):
                target = links[target]
            assert answer == target != node
        # LM loss on each extra answer (the prompt has <bos> at token 0).
        spans = [prompt[start - 1 : end - 1] for start, end in example["loss_spans"]]
        assert spans == [extra.split("=")[1] for extra in extras]


def test_scratchpad_completions_walk_the_path_and_no_answered_path_holds_the_answer():
    dm = RecallDataModule(
        num_pairs=8, max_hops=2, key_length=2, extra_queries=8, scratchpad=True, **SMALL
    )
    dm.setup("test")
    tok = CharTokenizer()
    assert max(len(ex["prompt_ids"]) for ex in dm.datasets["test"]) <= dm.prompt_length
    for example in dm.datasets["test"]:
        context, *extras, final = tok.decode(example["prompt_ids"]).split("|")
        links, node, hops = _parse(f"{context}|{final}")
        path = []
        for _ in range(hops):
            node = links[node]
            path.append(node)
        assert tok.decode(example["completion_ids"][:-1]) == "".join(path)
        assert example["answer"] == node == dm.extract_answer("".join(path))
        for extra in extras:
            query, walked = extra.split("=")
            key, extra_hops = query.split("*")
            expected = []
            for _ in range(int(extra_hops)):
                key = links[key]
                expected.append(key)
            assert walked == "".join(expected) and node not in expected


def test_induction_layout_ends_the_prompt_on_the_key_and_writes_links_as_bigrams():
    dm = RecallDataModule(
        num_pairs=6,
        max_hops=2,
        key_length=1,
        link_separator="",
        query_template="|{hops}*{key}",
        scratchpad=True,
        extra_queries=4,
        **SMALL,
    )
    dm.setup("test")
    tok = CharTokenizer()
    for example in dm.datasets["test"]:
        context, *extras, final = tok.decode(example["prompt_ids"]).split("|")
        links = dict(link for link in context.split(";") if not link.startswith("["))
        assert len(links) == 6 and all(len(k) == 1 for k in links)
        hops, node = final.split("*")
        path = []
        for _ in range(int(hops)):
            node = links[node]
            path.append(node)
        assert example["completion"] == "".join(path) and example["answer"] == node
        for extra in extras:
            hops, walk = extra.split("*")
            assert len(walk) == int(hops) + 1
            assert all(links[a] == b for a, b in zip(walk, walk[1:], strict=False))


def test_hop_weights_select_hop_counts():
    dm = RecallDataModule(num_pairs=6, max_hops=3, hop_weights=[0.0, 1.0, 0.0], **SMALL)
    dm.setup("test")
    assert {ex["metadata"]["hops"] for ex in dm.datasets["test"]} == {2}


def test_same_seed_same_data_other_seed_other_data():
    make = lambda seed: RecallDataModule(num_pairs=5, seed=seed, **SMALL)  # noqa: E731
    first, second, other = make(3), make(3), make(4)
    for dm in (first, second, other):
        dm.setup("fit")
    for split in ("train", "val", "test"):
        assert _prompts(first, split) == _prompts(second, split)
        assert _prompts(first, split) != _prompts(other, split)


def test_splits_are_disjoint_and_from_different_streams():
    # 720 distinct prompts: collisions between streams are likely and must be rejected.
    dm = RecallDataModule(
        num_pairs=2, key_length=1, key_alphabet="abcdef", num_train=400, num_val=32, num_test=32
    )
    dm.setup("fit")
    train, val, test = (set(_prompts(dm, s)) for s in ("train", "val", "test"))
    assert not train & val and not train & test and not val & test
    assert len(val) == 32 and len(test) == 32


def test_labels_cover_only_the_completion_and_eos():
    dm = RecallDataModule(num_pairs=4, filler_segments=2, **SMALL)
    dm.setup("test")
    batch = next(iter(dm.test_dataloader()))
    tok = CharTokenizer()
    for row in range(len(batch["targets"])):
        labelled = batch["labels"][row] != -100
        expected = tok.encode(batch["targets"][row], add_eos=True)
        assert batch["labels"][row][labelled].tolist() == expected
        # The labelled tokens are the last real tokens of the right-padded training sequence.
        length = int(batch["attention_mask"][row].sum())
        assert labelled.nonzero().flatten().tolist() == list(range(length - len(expected), length))
        assert batch["input_ids"][row, length - len(expected) : length].tolist() == expected


def test_filler_loss_labels_only_locally_predictable_tokens():
    dm = RecallDataModule(
        num_pairs=4, filler_segments=3, filler_length=10, motif_length=3, filler_loss=True, **SMALL
    )
    dm.setup("test")
    batch = next(iter(dm.test_dataloader()))
    ids, labels = batch["input_ids"], batch["labels"]
    tok = CharTokenizer()
    answer_len = torch.tensor([len(t) + 1 for t in batch["targets"]])
    filler_labels = (labels != -100).sum(1) - answer_len
    # Per segment: 10 filler characters minus the first motif, plus the closing bracket.
    assert filler_labels.tolist() == [3 * (10 - 3 + 1)] * len(batch["targets"])
    for row in range(ids.shape[0]):
        prompt_end = int(batch["attention_mask"][row].sum()) - int(answer_len[row])
        for pos in (labels[row, :prompt_end] != -100).nonzero().flatten().tolist():
            char = tok.decode([ids[row, pos]])
            assert char == "]" or char == tok.decode([ids[row, pos - 3]])


def test_prompt_batch_is_left_padded_and_prompt_length_is_exact():
    dm = RecallDataModule(num_pairs=7, key_length=3, filler_segments=2, max_hops=2, **SMALL)
    dm.setup("test")
    batch = next(iter(dm.test_dataloader()))
    assert batch["prompt_ids"].shape[1] == dm.prompt_length
    assert batch["prompt_mask"].all()
    assert (batch["prompt_ids"][:, 0] == CharTokenizer.bos_id).all()
    full = batch["input_ids"][:, : dm.prompt_length]
    assert torch.equal(full, batch["prompt_ids"])


def test_long_context():
    dm = RecallDataModule(
        num_pairs=256, key_length=3, filler_segments=16, num_train=1, num_val=1, num_test=2
    )
    dm.setup("test")
    assert dm.prompt_length > 2000
    assert len(dm.datasets["test"][0]["prompt_ids"]) == dm.prompt_length


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_pairs": 0}, "num_pairs"),
        ({"num_pairs": 2, "max_hops": 3}, "max_hops"),
        ({"max_hops": 2, "hop_weights": [1.0]}, "hop_weights"),
        ({"hop_weights": [-1.0]}, "hop_weights"),
        ({"key_alphabet": "ab:"}, "key_alphabet"),
        ({"key_alphabet": "aa"}, "key_alphabet"),
        ({"filler_alphabet": "€"}, "filler_alphabet"),
        ({"num_pairs": 10, "key_length": 1, "key_alphabet": "abc"}, "key_alphabet"),
        ({"motif_length": 20, "filler_length": 10}, "motif_length"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_val": -1}, "num_val"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
        ({"extra_queries": -1}, "extra_queries"),
        ({"num_pairs": 6, "max_hops": 2, "extra_queries": 8}, "extra_queries"),
        ({"num_pairs": 6, "max_hops": 3, "extra_queries": 9, "scratchpad": True}, "extra_queries"),
        ({"scratchpad": 1}, "scratchpad"),
        ({"link_separator": "-"}, "link_separator"),
        ({"query_template": "|{key}*"}, "query_template"),
        ({"query_template": "{key}*{hops}="}, "query_template"),
        ({"query_template": "|{key}#{hops}"}, "query_template"),
        ({"query_template": "|{key}|{hops}"}, "query_template"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RecallDataModule(**kwargs)
