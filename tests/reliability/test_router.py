"""The kNN cost-aware router: embedder, estimates against brute force, λ sweep, matched-quality cost."""

import math

import numpy as np
import pytest
import torch

from ada_modules.errors import InputError
from ada_modules.reliability.router import (
    FixedOption,
    FrontierPoint,
    HashedNgramEmbedder,
    KNNRouter,
    cost_at_matched_quality,
    fixed_options,
)

TEXTS = ("What is 17 plus 25?", "Prove that there are infinitely many primes.", "héllo wörld")
LAMS = [0.0] + torch.logspace(-4, 1, 26).tolist()


def test_embedder_is_deterministic_across_processes():
    # Recorded once in another process; Python's own str hash would change with every process.
    counts = torch.tensor([0.0, 1, 0, 0, 1, 0, 0, 2, 0, 0, 0, 1, 0, 1, 1, 0])
    embed = HashedNgramEmbedder(dim=16, ngram_range=(2, 3))
    assert torch.equal(embed(["Hello"]), (counts / counts.norm()).unsqueeze(0))
    assert torch.equal(embed(TEXTS), embed(list(TEXTS)))


def test_embedder_rows_are_unit_norm_and_similar_texts_are_closer():
    embed = HashedNgramEmbedder(dim=512)
    vectors = embed(["what is 17 plus 25?", "What is 18 plus 26?", "write a poem about rivers", ""])
    assert vectors.shape == (4, 512) and vectors.dtype == torch.float32
    torch.testing.assert_close(vectors[:3].norm(dim=1), torch.ones(3))
    assert torch.equal(vectors[3], torch.zeros(512))  # too short for any n-gram
    assert vectors[0] @ vectors[1] > 0.6 > 0.2 > vectors[0] @ vectors[2]
    lowercase_off = HashedNgramEmbedder(dim=512, lowercase=False)(["ABC", "abc"])
    assert (
        lowercase_off[0] @ lowercase_off[1]
        < 1 - 1e-6
        < vectors[0] @ embed(["WHAT IS 17 PLUS 25?"])[0]
    )


def test_fit_idf_weighs_shared_ngrams_down():
    texts = ["the answer is apple", "the answer is river", "the answer is stone"]
    embed = HashedNgramEmbedder(dim=4096, ngram_range=(3, 3))
    raw = embed(texts)
    assert embed.fit(texts) is embed
    shared, rare = [
        embed._counts([gram]).argmax().item() for gram in ("ans", "app")
    ]  # bucket of an n-gram in every text, and of one in a single text
    assert embed.idf[shared].item() == pytest.approx(1.0)
    assert embed.idf[rare].item() == pytest.approx(torch.log(torch.tensor(2.0)).item() + 1.0)
    weighted = embed(texts)
    assert weighted[0] @ weighted[1] < raw[0] @ raw[1]


def _brute_force(keys, labels, queries, k, metric, exclude_self):
    """Mean labels over the k nearest keys, by explicit per-pair similarities and sorting."""
    rows = []
    for i, query in enumerate(queries):
        ranked = []
        for j, key in enumerate(keys):
            if exclude_self and i == j:
                continue
            if metric == "cosine":
                near = -float(query @ key / (query.norm() * key.norm()))
            else:
                near = float((query - key).norm())
            ranked.append((near, j))
        chosen = [j for _, j in sorted(ranked)[:k]]
        rows.append(labels[chosen].mean(dim=0))
    return torch.stack(rows)


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("exclude_self", [False, True])
def test_estimates_equal_brute_force(metric, exclude_self):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(30, 5, generator=g, dtype=torch.float64)
    keys[7] = keys[3]  # equally near items: the lower index comes first
    keys[20] = keys[3]
    quality = torch.rand(30, 4, generator=g, dtype=torch.float64)
    cost = 5 * torch.rand(30, 4, generator=g, dtype=torch.float64)
    queries = keys if exclude_self else torch.cat([keys[:5], torch.randn(6, 5, generator=g)])
    router = KNNRouter(k=2, metric=metric).fit(keys, quality, cost)
    q_hat, c_hat = router.estimate(queries, exclude_self=exclude_self)
    for estimate, labels in ((q_hat, quality), (c_hat, cost)):
        expected = _brute_force(keys, labels, queries, 2, metric, exclude_self)
        torch.testing.assert_close(estimate, expected)
    neighbours = router.neighbours(queries, exclude_self=exclude_self)
    assert neighbours[3].tolist() == ([7, 20] if exclude_self else [3, 7])


def test_lambda_zero_takes_best_quality_and_huge_lambda_the_cheapest():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(50, 8, generator=g)
    quality = torch.rand(50, 5, generator=g)
    cost = torch.rand(50, 5, generator=g) * torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
    router = KNNRouter(k=5).fit(keys, quality, cost)
    queries = torch.randn(40, 8, generator=g)
    q_hat, c_hat = router.estimate(queries)
    assert torch.equal(router.route(queries, lam=0.0), q_hat.argmax(dim=1))
    assert torch.equal(router.route(queries, lam=1e9), c_hat.argmin(dim=1))
    assert router.route(queries, lam=0).dtype == torch.long


def test_ties_go_to_the_cheaper_option_then_the_lower_index():
    quality = torch.tensor([[0.5, 0.9, 0.9, 0.9]])
    cost = torch.tensor([[0.0, 3.0, 2.0, 2.0]])
    router = KNNRouter(k=1).fit(torch.ones(1, 2), quality, cost)
    assert router.route(torch.ones(1, 2), lam=0.0).tolist() == [2]
    assert router.route(torch.ones(1, 2), lam=0.2).tolist() == [0]  # 0.5 - 0 > 0.9 - 0.4


def test_growing_lambda_never_raises_the_estimated_quality_or_cost_of_the_choice():
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(80, 6, generator=g)
    router = KNNRouter(k=7).fit(
        keys, torch.rand(80, 6, generator=g), torch.rand(80, 6, generator=g)
    )
    queries = torch.randn(60, 6, generator=g)
    q_hat, c_hat = router.estimate(queries)
    chosen = torch.stack([router.route(queries, lam) for lam in LAMS], dim=1)  # (queries, lams)
    for estimate in (q_hat, c_hat):
        along = estimate.gather(1, chosen)
        assert (along[:, 1:] <= along[:, :-1]).all()
    assert len(set(chosen.flatten().tolist())) > 2  # the sweep really moves between options


WORDS = "apple river stone cloud table garden window silver matrix circle engine forest".split()
EASY = ["what is {} plus {}?", "add {} to {}", "compute {} times {}", "is {} bigger than {}?"]
HARD = [
    "prove that every {} {} admits a unique decomposition",
    "derive a closed form for the {} {} recursion",
    "show the {} {} conjecture fails in dimension four",
]
OPTION_COST = torch.tensor([1.0, 4.0, 10.0])  # cheap, medium, expensive


def _two_clusters(n, g):
    """Items whose text reveals easy (1/3 hard) vs hard; option t solves an item iff u < p_t.

    One latent u per item makes the solved sets nested (a costlier option solves whatever a
    cheaper one does): easy items are solved alike by every option, hard ones mostly only by the
    expensive one. Costs vary per item by a common factor, so options keep their cost order.
    """
    hard = torch.rand(n, generator=g) < 1 / 3
    texts = []
    for is_hard in hard.tolist():
        templates = HARD if is_hard else EASY
        template = templates[torch.randint(len(templates), (1,), generator=g).item()]
        if is_hard:
            fillers = [WORDS[i] for i in torch.randint(len(WORDS), (2,), generator=g).tolist()]
        else:
            fillers = torch.randint(1000, (2,), generator=g).tolist()
        texts.append(template.format(*fillers))
    solve = torch.where(hard[:, None], torch.tensor([0.05, 0.45, 0.9]), torch.tensor([0.97] * 3))
    quality = (torch.rand(n, 1, generator=g) < solve).double()
    cost = OPTION_COST * (0.8 + 0.4 * torch.rand(n, 1, generator=g))
    return texts, quality, cost.double()


def test_router_matches_the_best_fixed_option_for_at_most_60_percent_of_its_cost():
    g = torch.Generator().manual_seed(0)
    train_texts, train_quality, train_cost = _two_clusters(240, g)
    texts, quality, cost = _two_clusters(120, g)  # held out: never seen by the router
    embed = HashedNgramEmbedder().fit(train_texts)
    train, held_out = embed(train_texts), embed(texts)
    names = ["cheap", "medium", "expensive"]
    router = KNNRouter(k=15).fit(train, train_quality, train_cost, option_names=names)
    frontier = router.frontier(held_out, quality, cost, LAMS)

    fixed = fixed_options(quality, cost, names)
    best = max(fixed, key=lambda option: (option.quality, -option.cost))
    assert best.name == "expensive"
    target = best.quality - 0.005  # matched quality: within half a point
    matched = cost_at_matched_quality(frontier, target)
    assert matched is not None and matched <= 0.6 * best.cost

    qualities, costs = [p.quality for p in frontier], [p.cost for p in frontier]
    assert all(a >= b for a, b in zip(qualities, qualities[1:], strict=False))
    assert all(a >= b for a, b in zip(costs, costs[1:], strict=False))
    assert frontier[-1].shares == (1.0, 0.0, 0.0)  # the largest λ sends everything to "cheap"

    # The same router with labels detached from the texts cannot tell easy from hard.
    shuffled = torch.randperm(len(train_texts), generator=g)
    blind = KNNRouter(k=15).fit(train, train_quality[shuffled], train_cost[shuffled])
    blind_cost = cost_at_matched_quality(blind.frontier(held_out, quality, cost, LAMS), target)
    assert blind_cost is None or blind_cost > 0.9 * best.cost


def test_exclude_self_keeps_each_items_own_labels_out():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(40, 6, generator=g)
    quality = torch.rand(40, 3, generator=g, dtype=torch.float64)
    cost = torch.rand(40, 3, generator=g, dtype=torch.float64)
    router = KNNRouter(k=1).fit(keys, quality, cost)
    assert torch.equal(router.estimate(keys)[0], quality)  # each item is its own neighbour
    assert not (router.estimate(keys, exclude_self=True)[0] == quality).all(dim=1).any()
    in_sample = router.frontier(keys, quality, cost, [0.0])[0]
    leave_one_out = router.frontier(keys, quality, cost, [0.0], exclude_self=True)[0]
    assert in_sample.quality == pytest.approx(quality.max(dim=1).values.mean().item())  # oracle
    assert leave_one_out.quality < in_sample.quality - 0.1


def test_fixed_options_and_cost_at_matched_quality():
    quality = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    cost = torch.tensor([[1.0, 9.0], [3.0, 11.0]])
    assert fixed_options(quality, cost) == [
        FixedOption(name="option_0", index=0, quality=0.5, cost=2.0),
        FixedOption(name="option_1", index=1, quality=1.0, cost=10.0),
    ]
    points = [FrontierPoint(0.0, 1.0, 6.0, (0.5, 0.5)), FrontierPoint(1.0, 0.5, 2.0, (1.0, 0.0))]
    assert cost_at_matched_quality(points, 0.5) == 2.0
    assert cost_at_matched_quality(points, 0.9) == 6.0
    assert cost_at_matched_quality(points, 1.1) is None


GOOD_Q, GOOD_C, KEYS = torch.full((10, 3), 0.5), torch.ones(10, 3), torch.ones(10, 4)


def _fitted():
    return KNNRouter(k=3).fit(KEYS, GOOD_Q, GOOD_C)


def _with(matrix, item, option, value):
    """A copy of ``matrix`` with one entry replaced."""
    changed = matrix.clone()
    changed[item, option] = value
    return changed


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: KNNRouter(k=0), r"k must be an int >= 1, got 0"),
        (lambda: KNNRouter(metric="dot"), r"metric must be one of .*, got 'dot'"),
        (
            lambda: KNNRouter(k=200).fit(
                torch.ones(120, 4), torch.ones(120, 2), torch.ones(120, 2)
            ),
            r"k must be <= the 120 labelled items, got 200",
        ),
        (
            lambda: KNNRouter(k=3).fit(torch.ones(10), GOOD_Q, GOOD_C),
            r"embeddings must be a 2-D tensor, got shape \(10,\)",
        ),
        (
            lambda: KNNRouter(k=3).fit(torch.ones(9, 4), GOOD_Q, GOOD_C),
            r"quality must have one row per embedding \(9\), got shape \(10, 3\)",
        ),
        (
            lambda: KNNRouter(k=3).fit(_with(KEYS, 2, 0, float("inf")), GOOD_Q, GOOD_C),
            r"embeddings must be finite, got a NaN or infinite entry",
        ),
        (
            lambda: (
                KNNRouter(k=3)
                .fit(KEYS, GOOD_Q, GOOD_C)
                .route(_with(KEYS, 1, 0, float("nan")), lam=0.0)
            ),
            r"queries must be finite, got NaN or infinite entries in rows \[1\]",
        ),
        (
            lambda: (
                KNNRouter(k=3).fit(KEYS, GOOD_Q, GOOD_C).estimate(torch.full((1, 4), -math.inf))
            ),
            r"queries must be finite, got NaN or infinite entries in rows \[0\]",
        ),
        (
            lambda: KNNRouter(k=3).fit(KEYS, GOOD_Q, torch.ones(10, 2)),
            r"cost must have the shape of quality \(10, 3\), got \(10, 2\)",
        ),
        (
            lambda: KNNRouter(k=3).fit(KEYS, _with(GOOD_Q, 0, 1, 1.5), GOOD_C),
            r"quality must lie in \[0, 1\], got 1\.5 at item 0, option 1",
        ),
        (
            lambda: KNNRouter(k=3).fit(KEYS, _with(GOOD_Q, 0, 2, float("nan")), GOOD_C),
            r"quality must lie in \[0, 1\], got nan at item 0, option 2",
        ),
        (
            lambda: KNNRouter(k=3).fit(KEYS, GOOD_Q, _with(GOOD_C, 3, 1, -1.0)),
            r"cost must be finite and >= 0, got -1\.0 at item 3, option 1",
        ),
        (
            lambda: KNNRouter(k=3).fit(KEYS, GOOD_Q, _with(GOOD_C, 4, 0, float("nan"))),
            r"cost must be finite and >= 0, got nan at item 4, option 0",
        ),
        (
            lambda: KNNRouter(k=3).fit(KEYS, GOOD_Q, GOOD_C, option_names=["a"]),
            r"option_names must name the 3 options, got \['a'\]",
        ),
        (lambda: _fitted().route(torch.ones(2, 4), lam=-0.1), r"lam must be .* >= 0, got -0\.1"),
        (lambda: _fitted().route(torch.ones(2, 4), lam=float("inf")), r"got inf"),
        (
            lambda: _fitted().frontier(torch.ones(2, 4), GOOD_Q[:2], GOOD_C[:2], [0.0, -1.0]),
            r"lams\[1\] must be a finite number >= 0, got -1\.0",
        ),
        (
            lambda: _fitted().frontier(torch.ones(2, 4), GOOD_Q, GOOD_C, [0.0]),
            r"quality must have one row per query \(2\), got shape \(10, 3\)",
        ),
        (
            lambda: _fitted().frontier(torch.ones(2, 4), GOOD_Q[:2, :2], GOOD_C[:2, :2], [0.0]),
            r"quality must have a column for each of the 3 fitted options, got shape \(2, 2\)",
        ),
        (
            lambda: _fitted().route(torch.ones(2, 5), lam=0.0),
            r"queries must have 4 columns like the fitted embeddings, got shape \(2, 5\)",
        ),
        (
            lambda: _fitted().estimate(torch.ones(4, 4), exclude_self=True),
            r"exclude_self=True needs the 10 fitted embeddings as queries, got 4 rows",
        ),
        (
            lambda: (
                KNNRouter(k=3)
                .fit(torch.ones(3, 4), torch.ones(3, 2), torch.ones(3, 2))
                .estimate(torch.ones(3, 4), exclude_self=True)
            ),
            r"k must be <= the 2 labelled items left when each query excludes itself, got 3",
        ),
        (lambda: KNNRouter().route(torch.ones(2, 4), lam=0.0), r"KNNRouter is not fitted"),
        (lambda: fixed_options(torch.ones(0, 3), torch.ones(0, 3)), r"at least one item"),
        (lambda: HashedNgramEmbedder(dim=0), r"dim must be an int >= 1, got 0"),
        (lambda: HashedNgramEmbedder(ngram_range=(3, 2)), r"ngram_range must .*, got \(3, 2\)"),
        (lambda: HashedNgramEmbedder()("one text"), r"texts must be a sequence of strings"),
        (lambda: HashedNgramEmbedder()(["ok", 3]), r"texts\[1\] must be a str, got int"),
        (lambda: HashedNgramEmbedder().fit([]), r"texts must hold at least one text"),
    ],
)
def test_bad_input_raises_input_error(call, match):
    with pytest.raises(InputError, match=match):
        call()


def test_numpy_integers_are_integers():
    router = KNNRouter(k=np.int64(3))
    assert type(router.k) is int and router.k == 3
    assert type(HashedNgramEmbedder(dim=np.int32(8)).dim) is int
