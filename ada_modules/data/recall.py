"""Multi-hop associative recall: follow key -> value links through a shuffled context."""

import random
import string
from typing import Literal

from ada_modules.data.sequence_task import SequenceExample, SequenceTaskDataModule
from ada_modules.data.tokenizer import CharTokenizer
from ada_modules.errors import InputError

__all__ = ["RecallDataModule"]

# Characters with a fixed role in the prompt; keys and filler motifs may not use them.
_RESERVED = ":;|?*=[]"


class RecallDataModule(SequenceTaskDataModule):
    """Multi-hop associative recall with optional local filler, generated from a seed.

    The context lists ``num_pairs`` links ``key:value`` in random order, separated by ``;``. The
    links form chains of up to ``max_hops`` links in which each value is the key of the next link,
    so that a query ``|key*h=`` asks for the node ``h`` links after ``key``. The completion is that
    node. Between links, ``filler_segments`` segments ``[...]`` of length ``filler_length`` repeat a
    random motif of ``motif_length`` characters; they need only nearby tokens to predict and, with
    ``filler_loss=True``, their repeats carry the LM loss so that some layers learn local attention.

    A prompt with ``key_length=2``, two chains of two links and one filler segment::

        xq:ab;[KPKPKPKP];cd:ef;ab:mn;ef:tu|cd*2=

    The answer is ``tu`` (``cd -> ef -> tu``). Each batch has a ``hops`` tensor. The same links
    with ``link_separator=""``, ``query_template="|{hops}*{key}"`` and ``scratchpad=True``, where
    each node to generate is the token that followed the previous one in the context::

        xqab;[KPKPKPKP];cdef;abmn;eftu|2*cd      -> completion ``eftu``

    Args:
        num_pairs: Number of ``key:value`` links in the context.
        max_hops: Longest chain; queries need 1 to ``max_hops`` links.
        hop_weights: Relative frequency of hop counts ``1..max_hops`` (uniform if ``None``).
        key_length: Characters per key.
        key_alphabet: Characters that keys are drawn from.
        filler_segments: Number of filler segments inserted between links.
        filler_length: Characters per filler segment, brackets excluded.
        motif_length: Length of the repeated motif of a filler segment.
        filler_alphabet: Characters that motifs are drawn from.
        filler_loss: Put LM loss on the predictable part of the filler (after its first motif).
        link_separator: Written between the key and the value of a link: ``":"`` (``ab:mn``) or
            ``""`` (``abmn``, so that the value follows its key as in a copied sequence).
        query_template: How a query is written, with ``{key}`` and ``{hops}`` and otherwise only
            the characters ``|*=``, starting with ``|``; ``"|{hops}*{key}"`` ends the prompt on the
            queried key, so that its successor is the next token to predict.
        scratchpad: Make the completion the path, every node from the first link on to the
            answer (``|cd*2=`` -> ``eftu``), so that each generated node is one lookup from the
            node before it; the answered queries carry their paths too, and none of them passes
            through the final answer. Off, the completion is the answer alone.
        extra_queries: Answered queries ``|key*h=answer`` between the context and the final
            query, each with LM loss on its answer: several supervised retrievals per sequence
            (as in multi-query associative recall), which a tiny model needs to learn the task
            in a few thousand steps. They are distinct queries (any hop count) about any chain,
            but never the final query nor one with the same answer, so that the final answer is neither written
            in the prompt nor assembled from answered queries alone (a 2-hop answer still needs
            at least one link of the context).
        seed: Seed of the three example streams; equal seeds give equal data. ``None`` takes
            the seed of ``seed_everything`` (``PL_GLOBAL_SEED``; 0 when unset), so a sweep's
            seeds vary the data too.
        num_train: Number of training examples.
        num_val: Number of validation examples.
        num_test: Number of test (and predict) examples.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        ValueError: If an argument is out of range, naming the argument.

    Examples:
        >>> dm = RecallDataModule(num_pairs=8, max_hops=2, num_train=64, num_val=8, num_test=8)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> sorted(k for k in batch if k in ("hops", "labels", "prompt_ids"))
        ['hops', 'labels', 'prompt_ids']
    """

    def __init__(
        self,
        num_pairs: int = 8,
        max_hops: int = 1,
        hop_weights: list[float] | None = None,
        key_length: int = 2,
        key_alphabet: str = string.ascii_lowercase,
        filler_segments: int = 0,
        filler_length: int = 16,
        motif_length: int = 3,
        filler_alphabet: str = string.ascii_uppercase,
        filler_loss: bool = False,
        link_separator: Literal[":", ""] = ":",
        query_template: str = "|{key}*{hops}=",
        scratchpad: bool = False,
        extra_queries: int = 0,
        seed: int | None = None,
        num_train: int = 10_000,
        num_val: int = 256,
        num_test: int = 256,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed,
            num_train=num_train,
            num_val=num_val,
            num_test=num_test,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        for name, value, low in (
            ("num_pairs", num_pairs, 1),
            ("max_hops", max_hops, 1),
            ("key_length", key_length, 1),
            ("filler_segments", filler_segments, 0),
            ("filler_length", filler_length, 1),
            ("motif_length", motif_length, 1),
            ("extra_queries", extra_queries, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
        if max_hops > num_pairs:
            raise InputError(
                f"max_hops={max_hops} needs at least as many links, num_pairs={num_pairs}"
            )
        if hop_weights is None:
            hop_weights = [1.0] * max_hops
        if (
            len(hop_weights) != max_hops
            or any(w < 0 for w in hop_weights)
            or not sum(hop_weights) > 0
        ):
            raise InputError(
                f"hop_weights must be {max_hops} non-negative numbers (one per hop count "
                f"1..max_hops) with a positive sum, got {hop_weights!r}"
            )
        vocabulary = set(CharTokenizer.characters) - set(_RESERVED)
        for name, alphabet in (
            ("key_alphabet", key_alphabet),
            ("filler_alphabet", filler_alphabet),
        ):
            if len(set(alphabet)) != len(alphabet) or not alphabet or set(alphabet) - vocabulary:
                raise InputError(
                    f"{name} must be distinct tokenizer characters other than {_RESERVED!r}, "
                    f"got {alphabet!r}"
                )
        num_chains = -(-num_pairs // max_hops)
        if len(key_alphabet) ** key_length < num_pairs + num_chains:
            raise InputError(
                f"key_alphabet^key_length = {len(key_alphabet)}^{key_length} distinct keys cannot "
                f"hold the {num_pairs + num_chains} nodes of num_pairs={num_pairs} links"
            )
        if motif_length > filler_length:
            raise InputError(
                f"motif_length={motif_length} must not exceed filler_length={filler_length}"
            )
        self.num_pairs = num_pairs
        self.max_hops = max_hops
        self.hop_weights = list(hop_weights)
        self.key_length = key_length
        self.key_alphabet = key_alphabet
        self.filler_segments = filler_segments
        self.filler_length = filler_length
        self.motif_length = motif_length
        self.filler_alphabet = filler_alphabet
        if link_separator not in (":", ""):
            raise InputError(f"link_separator must be ':' or '', got {link_separator!r}")
        rest = (
            query_template.replace("{key}", "", 1).replace("{hops}", "", 1)
            if isinstance(query_template, str)
            else None
        )
        if (
            rest is None
            or not query_template.startswith("|")
            or len(rest) != len(query_template) - len("{key}{hops}")
            or set(rest) - set("|*=")
            or rest.count("|") != 1
        ):
            raise InputError(
                "query_template must start with '|', hold {key} and {hops} once each and "
                f"otherwise only '*' and '=', got {query_template!r}"
            )
        if not isinstance(scratchpad, bool):
            raise InputError(f"scratchpad must be a bool, got {scratchpad!r}")
        self.filler_loss = filler_loss
        self.link_separator = link_separator
        self.query_template = query_template
        self.scratchpad = scratchpad
        self.extra_queries = extra_queries
        # The fewest extra queries any final query allows: all queries, minus those whose
        # completion holds the final answer (the final query among them). A query from node i to
        # node j of a chain ends at node m for i < m = j, or passes through it for i < m <= j.
        shapes = self._chain_shapes()
        queries = sum(len(c) * (len(c) - 1) // 2 for c in shapes)
        excluded = max(
            m * (len(c) - m) if scratchpad else m for c in shapes for m in range(1, len(c))
        )
        if extra_queries > queries - excluded:
            raise InputError(
                f"extra_queries={extra_queries} exceeds the {queries - excluded} distinct "
                f"queries that num_pairs={num_pairs}, max_hops={max_hops} allow besides the "
                "final query and those whose completion holds its answer"
            )
        self.save_hyperparameters()

    def _chain_shapes(self) -> list[list[int]]:
        """Chains of node indices with the lengths ``make_example`` draws (the same every time)."""
        num_chains = -(-self.num_pairs // self.max_hops)
        chains, position = [], 0
        for c in range(num_chains):
            links = min(self.max_hops, self.num_pairs - c * self.max_hops)
            chains.append(list(range(position, position + links + 1)))
            position += links + 1
        return chains

    @property
    def prompt_length(self) -> int:
        """Prompt length in tokens, ``<bos>`` included.

        The same for every example; with ``scratchpad``, an upper bound (the answered paths
        vary in length).
        """
        link = 2 * self.key_length + len(self.link_separator)
        links = self.num_pairs * link + self.num_pairs - 1
        filler = self.filler_segments * (self.filler_length + 3)
        query = len(self.query_template) - len("{key}{hops}") + self.key_length
        query += len(str(self.max_hops))
        return (
            1
            + links
            + filler
            + (self.extra_queries + 1) * query
            + self.extra_queries * self.key_length * (self.max_hops if self.scratchpad else 1)
        )

    def extract_answer(self, completion: str) -> str:
        """The answer: the completion, or with ``scratchpad`` its last node."""
        return completion[-self.key_length :] if self.scratchpad else completion

    def make_example(self, rng: random.Random) -> SequenceExample:
        """Draw chains of keys, shuffle their links, add filler and ask a ``h``-hop query."""
        num_chains = -(-self.num_pairs // self.max_hops)
        nodes: set[str] = set()
        while len(nodes) < self.num_pairs + num_chains:
            nodes.add("".join(rng.choices(self.key_alphabet, k=self.key_length)))
        node_list = sorted(nodes)
        rng.shuffle(node_list)
        chains = [[node_list[i] for i in shape] for shape in self._chain_shapes()]
        hops = rng.choices(range(1, self.max_hops + 1), weights=self.hop_weights)[0]
        chain = rng.choice([ch for ch in chains if len(ch) > hops])
        start = rng.randrange(len(chain) - hops)
        query, answer = chain[start], chain[start + hops]
        completion = "".join(chain[start + 1 : start + hops + 1]) if self.scratchpad else answer

        sep = self.link_separator
        segments = [f"{ch[i]}{sep}{ch[i + 1]}" for ch in chains for i in range(len(ch) - 1)]
        rng.shuffle(segments)
        for _ in range(self.filler_segments):
            motif = "".join(rng.choices(self.filler_alphabet, k=self.motif_length))
            repeats = -(-self.filler_length // self.motif_length)
            segments.insert(
                rng.randrange(len(segments) + 1), f"[{(motif * repeats)[: self.filler_length]}]"
            )

        prompt, loss_spans = "", []
        for i, segment in enumerate(segments):
            if i:
                prompt += ";"
            if self.filler_loss and segment.startswith("["):
                # Everything after the first motif is a copy of the character motif_length back.
                first = len(prompt) + 1 + self.motif_length
                loss_spans.append((first, len(prompt) + len(segment)))
            prompt += segment
        allowed = [
            (other[i], j - i, "".join(other[i + 1 : j + 1]) if self.scratchpad else other[j])
            for other in chains
            for i in range(len(other))
            for j in range(i + 1, len(other))
            if answer not in (other[i + 1 : j + 1] if self.scratchpad else other[j : j + 1])
        ]
        for node, extra_hops, target in rng.sample(allowed, self.extra_queries):
            prompt += self.query_template.format(key=node, hops=extra_hops)
            loss_spans.append((len(prompt), len(prompt) + len(target)))
            prompt += target
        prompt += self.query_template.format(key=query, hops=hops)
        return SequenceExample(
            prompt=prompt,
            completion=completion,
            answer=answer,
            loss_spans=tuple(loss_spans),
            metadata={"hops": hops},
        )
