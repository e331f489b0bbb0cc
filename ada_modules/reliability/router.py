"""A cost-aware semantic nearest-neighbour router over reliability options.

An *option* is one way to answer a query: a (channel, operator, budget) choice such as "small model,
single sample" or "large model, self-consistency with 9 votes". Here it is just an index with a
name. The router has a labelled set: for each labelled query, the observed quality of every option
(correctness in ``[0, 1]``) and its cost (tokens, money, seconds; any unit ``>= 0``). To route a
new query ``x`` it embeds ``x``, finds its ``k`` nearest labelled queries and estimates, for every
option ``t``,

- the quality ``q̂_t(x)``: the mean quality of option ``t`` on those neighbours, and
- the cost ``ĉ_t(x)``: the mean cost of option ``t`` on those neighbours,

then takes ``argmax_t q̂_t(x) − λ·ĉ_t(x)``. :class:`HashedNgramEmbedder` embeds texts without any
model download (hashed character n-grams with optional TF-IDF weights); any other embedding of
shape ``(items, dim)`` works as well.

The single knob ``λ >= 0`` has a Lagrangian reading. The problem "maximise the expected quality
subject to an expected cost of at most ``B``" has the Lagrangian
``E[q̂_π(x)] − λ·(E[ĉ_π(x)] − B)`` over routing policies ``π``, and for a fixed ``λ`` it is
maximised query by query by the rule above. So each ``λ`` picks a point of the lower convex hull of
the achievable (cost, −quality) pairs: no routing has more estimated quality for the same estimated
cost, and ``λ`` is the quality paid for one unit of cost at that point. ``λ = 0`` takes the best
estimated option everywhere, a large ``λ`` the cheapest, and sweeping ``λ`` traces the
quality–cost frontier without refitting (:meth:`KNNRouter.frontier`). Budgets between two hull
points are met by mixing the two neighbouring ``λ``'s.

Examples:
    >>> import torch
    >>> texts = ["add 2 and 3", "add 4 and 5", "prove the riemann hypothesis", "prove fermat"]
    >>> quality = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    >>> cost = torch.tensor([[1.0, 10.0]]).repeat(4, 1)  # columns: a small and a large model
    >>> embed = HashedNgramEmbedder(dim=256).fit(texts)
    >>> router = KNNRouter(k=2).fit(embed(texts), quality, cost, option_names=["small", "large"])
    >>> held_out = embed(["add 7 and 8", "prove the four colour theorem"])
    >>> router.route(held_out, lam=0.05)
    tensor([0, 1])
    >>> held_quality = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    >>> held_cost = torch.tensor([[1.0, 10.0], [1.0, 10.0]])
    >>> points = router.frontier(held_out, held_quality, held_cost, lams=[0.0, 1.0])
    >>> [(point.lam, point.quality, point.cost) for point in points]
    [(0.0, 1.0, 5.5), (1.0, 0.5, 1.0)]
    >>> [(option.name, option.quality, option.cost) for option in fixed_options(
    ...     held_quality, held_cost, router.option_names)]
    [('small', 0.5, 1.0), ('large', 1.0, 10.0)]
    >>> cost_at_matched_quality(points, target_quality=1.0)  # the large model alone costs 10.0
    5.5
"""

from __future__ import annotations

import math
import numbers
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ada_modules.checks import is_int
from ada_modules.errors import InputError

__all__ = [
    "FixedOption",
    "FrontierPoint",
    "HashedNgramEmbedder",
    "KNNRouter",
    "cost_at_matched_quality",
    "fixed_options",
    "pareto_front",
    "realised_point",
]

_METRICS = ("cosine", "euclidean")


@dataclass(frozen=True)
class FrontierPoint:
    """The realised outcome of routing every query with one ``λ``.

    Attributes:
        lam: The cost weight ``λ``.
        quality: Mean observed quality of the routed options over the queries.
        cost: Mean observed cost of the routed options over the queries.
        shares: Fraction of the queries routed to each option, in option order.
    """

    lam: float
    quality: float
    cost: float
    shares: tuple[float, ...]


@dataclass(frozen=True)
class FixedOption:
    """The outcome of answering every query with one option.

    Attributes:
        name: The option's name.
        index: The option's column in the quality and cost matrices.
        quality: Mean observed quality of the option over the queries.
        cost: Mean observed cost of the option over the queries.
    """

    name: str
    index: int
    quality: float
    cost: float


class HashedNgramEmbedder:
    """Character n-gram counts hashed into ``dim`` buckets, optionally TF-IDF weighted.

    Each text (lower-cased if ``lowercase``) contributes one count per character n-gram for every
    ``n`` in ``ngram_range`` (inclusive) to bucket ``crc32(utf-8 n-gram) mod dim``. CRC-32 is a
    fixed function, so embeddings are identical across processes and machines (Python's built-in
    ``hash`` of strings is salted per process). Rows are L2-normalised; a text shorter than the
    smallest ``n`` gets a zero row.

    Without :meth:`fit` the rows are normalised raw counts. :meth:`fit` learns inverse document
    frequencies from the labelled texts, ``idf = log((1 + N) / (1 + df)) + 1`` with ``N`` texts and
    ``df`` the number of them with a count in the bucket (the smoothed form of scikit-learn's
    ``TfidfVectorizer``), and later calls multiply the counts by ``idf`` before normalising, so that
    n-grams every text shares (``"the "``) weigh less than the ones that tell texts apart.

    Args:
        dim: Number of hash buckets (the embedding width).
        ngram_range: Smallest and largest n-gram length, ``1 <= low <= high``.
        lowercase: Lower-case texts before extracting n-grams.

    Examples:
        >>> embed = HashedNgramEmbedder(dim=64)
        >>> vectors = embed(["solve x + 1 = 2", "solve x + 2 = 3", "write a haiku"])
        >>> vectors.shape
        torch.Size([3, 64])
        >>> bool(vectors[0] @ vectors[1] > vectors[0] @ vectors[2])
        True
    """

    def __init__(
        self, dim: int = 1024, ngram_range: tuple[int, int] = (2, 4), lowercase: bool = True
    ) -> None:
        if not is_int(dim) or dim < 1:
            raise InputError(f"dim must be an int >= 1, got {dim!r}")
        if (
            not isinstance(ngram_range, Sequence)
            or len(ngram_range) != 2
            or not all(is_int(n) for n in ngram_range)
            or not 1 <= ngram_range[0] <= ngram_range[1]
        ):
            raise InputError(
                f"ngram_range must be a pair of ints (low, high) with 1 <= low <= high, "
                f"got {ngram_range!r}"
            )
        self.dim = int(dim)
        self.ngram_range = (int(ngram_range[0]), int(ngram_range[1]))
        self.lowercase = lowercase
        self.idf: Tensor | None = None
        """Inverse document frequency per bucket, shape ``(dim,)``; ``None`` before :meth:`fit`."""

    def fit(self, texts: Sequence[str]) -> HashedNgramEmbedder:
        """Learn the inverse document frequencies of the buckets from ``texts``; returns ``self``."""
        presence = self._counts(texts) > 0
        if presence.shape[0] == 0:
            raise InputError("texts must hold at least one text to fit the idf, got 0")
        documents = presence.shape[0]
        frequency = presence.sum(dim=0).to(torch.float32)
        self.idf = torch.log((1.0 + documents) / (1.0 + frequency)) + 1.0
        return self

    def __call__(self, texts: Sequence[str]) -> Tensor:
        """Embed ``texts`` as a float32 tensor of shape ``(len(texts), dim)`` with unit-norm rows."""
        weights = self._counts(texts)
        if self.idf is not None:
            weights = weights * self.idf
        return torch.nn.functional.normalize(weights, dim=1)

    def _counts(self, texts: Sequence[str]) -> Tensor:
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise InputError(
                f"texts must be a sequence of strings (a list, not one string), got "
                f"{type(texts).__name__}"
            )
        flat: list[int] = []
        low, high = self.ngram_range
        for row, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"texts[{row}] must be a str, got {type(text).__name__}")
            if self.lowercase:
                text = text.lower()
            for n in range(low, high + 1):
                for start in range(len(text) - n + 1):
                    bucket = zlib.crc32(text[start : start + n].encode("utf-8")) % self.dim
                    flat.append(row * self.dim + bucket)
        counts = torch.bincount(
            torch.tensor(flat, dtype=torch.long), minlength=len(texts) * self.dim
        )
        return counts.view(len(texts), self.dim).to(torch.float32)


class KNNRouter:
    """Routes each query to ``argmax_t q̂_t(x) − λ·ĉ_t(x)`` with k-nearest-neighbour estimates.

    See the module docstring for the estimates and the meaning of ``λ``. Neighbours are ranked by
    cosine similarity (``metric="cosine"``, for text embeddings) or Euclidean distance
    (``metric="euclidean"``, for numeric item features); equally near items are taken in index
    order, so results do not depend on the sort implementation.

    Args:
        k: Number of neighbours averaged per query.
        metric: ``"cosine"`` or ``"euclidean"``.

    Examples:
        >>> import torch
        >>> features = torch.tensor([[0.0], [0.1], [1.0], [1.1]])
        >>> quality = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
        >>> cost = torch.tensor([[1.0, 10.0]]).repeat(4, 1)
        >>> router = KNNRouter(k=2, metric="euclidean").fit(features, quality, cost)
        >>> router.estimate(torch.tensor([[0.05], [1.05]]))[0]
        tensor([[1., 1.],
                [0., 1.]], dtype=torch.float64)
        >>> router.route(torch.tensor([[0.05], [1.05]]), lam=0.0)  # equal quality: the cheaper
        tensor([0, 1])
    """

    def __init__(self, k: int = 15, *, metric: str = "cosine") -> None:
        if not is_int(k) or k < 1:
            raise InputError(f"k must be an int >= 1, got {k!r}")
        if metric not in _METRICS:
            raise InputError(f"metric must be one of {_METRICS}, got {metric!r}")
        self.k = int(k)
        self.metric = metric
        self.option_names: list[str] = []
        self._keys: Tensor | None = None
        self._quality = torch.empty(0, 0, dtype=torch.float64)
        self._cost = torch.empty(0, 0, dtype=torch.float64)

    def fit(
        self,
        embeddings: Tensor,
        quality: Tensor,
        cost: Tensor,
        option_names: Sequence[str] | None = None,
    ) -> KNNRouter:
        """Store the labelled set; returns ``self``.

        Args:
            embeddings: ``(n, d)`` embeddings (or features) of the labelled queries.
            quality: ``(n, T)`` observed quality of each of the ``T`` options, in ``[0, 1]``.
            cost: ``(n, T)`` observed cost of each option, finite and ``>= 0``.
            option_names: ``T`` names; default ``"option_0"``, ``"option_1"``, ...

        Raises:
            InputError: On a shape mismatch, labels out of range, ``k > n`` or a wrong number of
                names.
        """
        keys = _matrix("embeddings", embeddings)
        if not torch.isfinite(keys).all():
            raise InputError("embeddings must be finite, got a NaN or infinite entry")
        quality, cost = _labels(quality, cost, rows=keys.shape[0], row_name="embedding")
        if self.k > keys.shape[0]:
            raise InputError(f"k must be <= the {keys.shape[0]} labelled items, got {self.k}")
        self.option_names = _option_names(option_names, quality.shape[1])
        self._keys = self._prepare(keys)
        self._quality, self._cost = quality.to(keys.device), cost.to(keys.device)
        return self

    def neighbours(self, queries: Tensor, *, exclude_self: bool = False) -> Tensor:
        """Indices ``(m, k)`` of each query's ``k`` nearest labelled items, nearest first.

        Args:
            queries: ``(m, d)`` embeddings of the queries.
            exclude_self: The queries are the labelled items themselves (row ``i`` is item ``i``)
                and item ``i`` is left out of query ``i``'s neighbours: leave-one-out estimates,
                so that a frontier measured on the labelled set does not use each item's own
                labels. Other items with the same embedding still count.
        """
        keys = self._fitted_keys()
        queries = _matrix("queries", queries).to(keys.device)
        if queries.shape[1] != keys.shape[1]:
            raise InputError(
                f"queries must have {keys.shape[1]} columns like the fitted embeddings, got "
                f"shape {tuple(queries.shape)}"
            )
        if not torch.isfinite(queries).all():
            rows = (~torch.isfinite(queries)).any(1).nonzero().flatten().tolist()
            raise InputError(
                f"queries must be finite, got NaN or infinite entries in rows {rows[:8]}"
            )
        # order_key[i, j]: smaller means item j is nearer to query i.
        if self.metric == "cosine":
            order_key = -(self._prepare(queries) @ keys.T)
        else:
            order_key = torch.cdist(queries, keys)
        if exclude_self:
            if queries.shape[0] != keys.shape[0]:
                raise InputError(
                    f"exclude_self=True needs the {keys.shape[0]} fitted embeddings as queries, "
                    f"got {queries.shape[0]} rows"
                )
            if self.k > keys.shape[0] - 1:
                raise InputError(
                    f"k must be <= the {keys.shape[0] - 1} labelled items left when each query "
                    f"excludes itself, got {self.k}"
                )
            order_key.fill_diagonal_(math.inf)
        # A stable sort keeps equally near items in index order.
        return torch.sort(order_key, dim=1, stable=True).indices[:, : self.k]

    def estimate(self, queries: Tensor, *, exclude_self: bool = False) -> tuple[Tensor, Tensor]:
        """Estimated quality ``q̂`` and cost ``ĉ`` of every option, each ``(m, T)`` float64.

        Each is the mean of the option's labels over the query's :meth:`neighbours` (same
        arguments).
        """
        index = self.neighbours(queries, exclude_self=exclude_self)
        return self._quality[index].mean(dim=1), self._cost[index].mean(dim=1)

    def route(self, queries: Tensor, lam: float, *, exclude_self: bool = False) -> Tensor:
        """The chosen option per query, ``argmax_t q̂_t − λ·ĉ_t``, as a LongTensor ``(m,)``.

        Exact ties go to the option with the lower estimated cost, then to the lower index.

        Args:
            queries: ``(m, d)`` embeddings of the queries.
            lam: Cost weight ``λ``, finite and ``>= 0``.
            exclude_self: See :meth:`neighbours`.
        """
        lam = _check_lam(lam, "lam")
        return _choose(*self.estimate(queries, exclude_self=exclude_self), lam)

    def frontier(
        self,
        queries: Tensor,
        quality: Tensor,
        cost: Tensor,
        lams: Iterable[float],
        *,
        exclude_self: bool = False,
    ) -> list[FrontierPoint]:
        """The realised quality and cost of routing ``queries`` with each ``λ`` in ``lams``.

        The estimates are computed once; each ``λ`` only re-takes the argmax. ``quality`` and
        ``cost`` are the queries' own observed outcomes per option (held-out items, or the labelled
        set with ``exclude_self=True``), so a point is what the routing would really have scored.

        Args:
            queries: ``(m, d)`` embeddings of the queries.
            quality: ``(m, T)`` observed quality of every option on each query, in ``[0, 1]``.
            cost: ``(m, T)`` observed cost of every option on each query, ``>= 0``.
            lams: Cost weights, each finite and ``>= 0``.
            exclude_self: See :meth:`neighbours`.

        Returns:
            One :class:`FrontierPoint` per ``λ``, in the order of ``lams``.
        """
        lams = [_check_lam(lam, f"lams[{i}]") for i, lam in enumerate(lams)]
        q_hat, c_hat = self.estimate(queries, exclude_self=exclude_self)
        quality, cost = _labels(
            quality, cost, rows=q_hat.shape[0], row_name="query", options=q_hat.shape[1]
        )
        quality, cost = quality.to(q_hat.device), cost.to(q_hat.device)
        return [realised_point(lam, _choose(q_hat, c_hat, lam), quality, cost) for lam in lams]

    def _prepare(self, vectors: Tensor) -> Tensor:
        if self.metric == "cosine":
            return torch.nn.functional.normalize(vectors, dim=1)
        return vectors

    def _fitted_keys(self) -> Tensor:
        if self._keys is None:
            raise InputError(
                "the KNNRouter is not fitted: call fit(embeddings, quality, cost) before "
                "neighbours, estimate, route or frontier"
            )
        return self._keys


def fixed_options(
    quality: Tensor, cost: Tensor, option_names: Sequence[str] | None = None
) -> list[FixedOption]:
    """Mean observed quality and cost of each option when it answers every query.

    Args:
        quality: ``(m, T)`` observed quality, in ``[0, 1]``.
        cost: ``(m, T)`` observed cost, ``>= 0``.
        option_names: ``T`` names; default ``"option_0"``, ``"option_1"``, ...
    """
    quality, cost = _labels(quality, cost)
    names = _option_names(option_names, quality.shape[1])
    means = zip(names, quality.mean(dim=0).tolist(), cost.mean(dim=0).tolist(), strict=True)
    return [
        FixedOption(name=name, index=t, quality=q, cost=c) for t, (name, q, c) in enumerate(means)
    ]


def realised_point(lam: float, choice: Tensor, quality: Tensor, cost: Tensor) -> FrontierPoint:
    """The frontier point of one ``λ`` whose routing picked option ``choice[i]`` for query ``i``.

    Args:
        lam: The ``λ`` the choices came from (recorded in the point).
        choice: ``(m,)`` option index per query.
        quality: ``(m, T)`` observed quality of every option on each query.
        cost: ``(m, T)`` observed cost of every option on each query.
    """
    picked = choice.unsqueeze(1)
    shares = torch.bincount(choice, minlength=quality.shape[1]) / choice.numel()
    return FrontierPoint(
        lam=lam,
        quality=quality.gather(1, picked).mean().item(),
        cost=cost.gather(1, picked).mean().item(),
        shares=tuple(shares.tolist()),
    )


def pareto_front(options: Sequence[FixedOption]) -> list[FixedOption]:
    """The options on the empirical Pareto front: no other is as good for less, or better for as
    much.

    Examples:
        >>> options = [FixedOption("a", 0, 0.5, 1.0), FixedOption("b", 1, 0.5, 2.0),
        ...            FixedOption("c", 2, 0.9, 2.0)]
        >>> [option.name for option in pareto_front(options)]
        ['a', 'c']
    """
    return [
        f
        for f in options
        if not any(g.quality >= f.quality and g.cost < f.cost for g in options)
        and not any(g.quality > f.quality and g.cost <= f.cost for g in options)
    ]


def cost_at_matched_quality(
    frontier: Sequence[FrontierPoint], target_quality: float
) -> float | None:
    """The lowest mean cost among the points with quality ``>= target_quality``, or ``None``.

    With ``target_quality`` the quality of the best fixed option (see :func:`fixed_options`), the
    ratio of this cost to that option's cost is the router's cost at matched quality. Subtract a
    small tolerance from the target to forgive sampling noise.
    """
    costs = [point.cost for point in frontier if point.quality >= target_quality]
    return min(costs) if costs else None


def _option_names(option_names: Sequence[str] | None, options: int) -> list[str]:
    if option_names is None:
        return [f"option_{t}" for t in range(options)]
    if isinstance(option_names, str) or len(option_names) != options:
        raise InputError(f"option_names must name the {options} options, got {option_names!r}")
    return [str(name) for name in option_names]


def _matrix(name: str, value: Any) -> Tensor:
    try:
        tensor = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputError(f"{name} must be a 2-D tensor of numbers, got {value!r}") from error
    if tensor.ndim != 2:
        raise InputError(f"{name} must be a 2-D tensor, got shape {tuple(tensor.shape)}")
    return tensor


def _labels(
    quality: Any,
    cost: Any,
    rows: int | None = None,
    row_name: str = "item",
    options: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Validate a quality and a cost matrix of the same shape, with ``rows``/``options`` if given."""
    quality, cost = _matrix("quality", quality), _matrix("cost", cost)
    if quality.numel() == 0:
        raise InputError(
            f"quality must have at least one item and one option, got shape {tuple(quality.shape)}"
        )
    if rows is not None and quality.shape[0] != rows:
        raise InputError(
            f"quality must have one row per {row_name} ({rows}), got shape {tuple(quality.shape)}"
        )
    if options is not None and quality.shape[1] != options:
        raise InputError(
            f"quality must have a column for each of the {options} fitted options, got shape "
            f"{tuple(quality.shape)}"
        )
    if cost.shape != quality.shape:
        raise InputError(
            f"cost must have the shape of quality {tuple(quality.shape)}, got {tuple(cost.shape)}"
        )
    bad = ~((quality >= 0) & (quality <= 1))  # NaN fails both comparisons
    if bad.any():
        item, option = bad.nonzero()[0].tolist()
        raise InputError(
            f"quality must lie in [0, 1], got {quality[item, option].item()} at item {item}, "
            f"option {option}"
        )
    bad = ~(torch.isfinite(cost) & (cost >= 0))
    if bad.any():
        item, option = bad.nonzero()[0].tolist()
        raise InputError(
            f"cost must be finite and >= 0, got {cost[item, option].item()} at item {item}, "
            f"option {option}"
        )
    return quality, cost


def _check_lam(lam: Any, name: str) -> float:
    if (
        isinstance(lam, bool)
        or not isinstance(lam, numbers.Real)
        or not math.isfinite(lam)
        or lam < 0
    ):
        raise InputError(f"{name} must be a finite number >= 0, got {lam!r}")
    return float(lam)


def _choose(q_hat: Tensor, c_hat: Tensor, lam: float) -> Tensor:
    """Per row, the index maximising ``q̂ − λ·ĉ``; ties to the lower ``ĉ``, then the lower index."""
    score = q_hat - lam * c_hat
    best = score == score.max(dim=1, keepdim=True).values
    tied_cost = c_hat.masked_fill(~best, math.inf)
    cheapest = best & (tied_cost == tied_cost.min(dim=1, keepdim=True).values)
    index = torch.arange(score.shape[1], device=score.device).expand_as(score)
    return index.masked_fill(~cheapest, score.shape[1]).min(dim=1).values
