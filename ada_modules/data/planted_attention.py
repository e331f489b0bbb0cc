"""Attention inputs with planted head patterns, for studying sparse prefill (data for AdaCal).

:func:`planted_attention` draws the queries, keys and values of one attention layer
(``(H, L, D)`` each) in which every head has a known *kind*, the patterns that block-sparse
prefill methods are built around (MInference, FlexPrefill):

- ``sink_local``: the first tokens (attention sink) and a recent window (A-shape).
- ``slash``: keys at one to three fixed offsets ``i - d`` from the query (diagonals).
- ``periodic``: keys every ``P`` tokens back (a table's column), plus a recent window.
- ``hub``: a few global key positions that every later query attends (verticals).
- ``needle``: a sink and a recent window for most queries; a few query spans late in the
  sequence retrieve *needles*, short key spans at random mid-context positions, as in
  needle-in-a-haystack or key-value retrieval. The last span (a question at the end, as in NIAH)
  reads only half of the needles; the other half is read only by earlier spans (multi-query or
  mid-context questions) that end before the last ``64`` rows, so a probe of the last query
  block (FlexPrefill, MInference, AdaCal) sees the first half and never the second
  (:attr:`PlantedAttention.needle_target` says which row reads which needle).
- ``diffuse``: a near-uniform spread.

How a pattern is planted: the logit ``q_i . k_j / sqrt(D)`` is a sum of a *positional* part, a
function of ``i - j`` made of rotary-style channel pairs (query pair ``(cos w i, sin w i)``, key
pair ``(cos(w j + phi), sin(w j + phi))``, whose product is ``cos(w (i - j) - phi)``, as RoPE
gives), and a *content* part, orthogonal directions shared by chosen queries and keys (sink, hubs,
needles). Frequencies are drawn from the spectrum of the target kernel (a Gaussian bump around
each planted offset), so a finite number of pairs gives the bump plus a smooth random background,
as in a trained model. Finally a random rotation per head mixes the channels; values are N(0, 1).

Two input *regimes*: ``structure`` (sink/local, slash, periodic, hub and diffuse heads, no
needle) and ``retrieval`` (``needle_heads`` needle heads, the other heads as in ``structure``).
:class:`PlantedAttentionDataModule` serves independent instances in fit and test splits.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ada_modules.attention.dispatch import REGIMES
from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError

__all__ = [
    "HEAD_KINDS",
    "PlantedAttention",
    "PlantedAttentionDataModule",
    "planted_attention",
]

HEAD_KINDS = ("sink_local", "slash", "periodic", "hub", "needle", "diffuse")
"""Head kinds, in the order of their integer codes (``PlantedAttention.head_kind``)."""

# REGIMES (from ada_modules.attention.dispatch): the input regimes, in the order of their integer
# codes (``PlantedAttention.regime``), the labels of AdaCal's task dispatcher.
_DATA_REGIMES = (*REGIMES, "mixed")

# Relative frequency of the non-needle head kinds (sink_local, slash, periodic, hub, diffuse).
_STRUCTURE_MIX = {"sink_local": 0.35, "slash": 0.25, "periodic": 0.2, "hub": 0.1, "diffuse": 0.1}
_SINK_TOKENS = 4
_CONTENT_FRACTION = 4  # a quarter of the channels (at least num_needles + 6) carry content
_NOISE_DIMS = 4  # at least this many content channels carry random (content-like) logit noise
_PERIODS = (32, 64, 128, 256)
_QUERY_SPAN = 64  # rows of one needle query span (the last one: one probe block at block 64)


@dataclass(frozen=True)
class PlantedAttention:
    """One generated layer of :func:`planted_attention`: ``H`` heads, ``L`` tokens.

    Attributes:
        query: ``(H, L, D)``; the logit of query ``i`` and key ``j`` is ``q_i . k_j / sqrt(D)``.
        key: ``(H, L, D)``.
        value: ``(H, L, D)``.
        head_kind: ``(H,)`` long, indices into :data:`HEAD_KINDS`.
        regime: 0-d long, index into :data:`~ada_modules.attention.dispatch.REGIMES`.
        needle_positions: ``(H, num_needles)`` long, the first key of each needle span of the
            needle heads (``-1`` for other heads).
        needle_target: ``(H, L)`` long, per query row the first key of the needle it retrieves
            (``-1`` for rows that retrieve none).
        needle_span: 0-d long, keys per needle.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    head_kind: torch.Tensor
    regime: torch.Tensor
    needle_positions: torch.Tensor
    needle_target: torch.Tensor
    needle_span: torch.Tensor


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _check_args(
    seq_len: int,
    num_heads: int,
    head_dim: int,
    regime: str,
    needle_heads: int,
    num_needles: int,
    needle_span: int,
    needle_query_spans: int,
) -> None:
    _check_int("seq_len", seq_len, 256)
    _check_int("num_heads", num_heads, 1)
    _check_int("num_needles", num_needles, 1)
    _check_int("head_dim", head_dim, 16)
    if head_dim % 2:
        raise InputError(f"head_dim must be even (rotary channel pairs), got {head_dim!r}")
    if _content_dims(head_dim, num_needles) > head_dim - 8:  # keep 4 rotary pairs
        least = _content_dims(0, num_needles) + 8
        raise InputError(f"num_needles={num_needles} needs head_dim >= {least}, got {head_dim}")
    if regime not in _DATA_REGIMES:
        raise InputError(f"regime must be one of {_DATA_REGIMES}, got {regime!r}")
    _check_int("needle_heads", needle_heads, 1)
    if regime != "structure" and needle_heads > num_heads:
        raise InputError(f"needle_heads={needle_heads} exceeds num_heads={num_heads}")
    _check_int("needle_span", needle_span, 1)
    _check_int("needle_query_spans", needle_query_spans, 0)
    if needle_span * num_needles > seq_len // 4:
        raise InputError(
            f"num_needles * needle_span = {num_needles * needle_span} must fit in a quarter of "
            f"seq_len={seq_len}"
        )


def _content_dims(head_dim: int, num_needles: int) -> int:
    """Content channels (even: the rest are rotary pairs)."""
    content = max(num_needles + 2 + _NOISE_DIMS, head_dim // _CONTENT_FRACTION)
    return content + content % 2


def _uniform(low: float, high: float, gen: torch.Generator) -> float:
    return low + (high - low) * torch.rand((), generator=gen).item()


class _Kernel:
    """A positional logit kernel ``K(i - j)`` being assembled as Gaussian bumps on rotary pairs."""

    def __init__(self, pairs: int, gen: torch.Generator) -> None:
        self.pairs, self.gen = pairs, gen
        self.freqs: list[torch.Tensor] = []
        self.amps: list[torch.Tensor] = []  # complex: |a| and phase per frequency

    def bumps(self, offsets: list[int], gain: float, width: float, pairs: int) -> None:
        """``gain`` at each offset, falling as a Gaussian of std ``width`` tokens, from ``pairs``
        frequencies drawn from the bump's spectrum (a half-normal of std ``1 / width``)."""
        freqs = (torch.randn(pairs, generator=self.gen).abs() / width).clamp(max=math.pi)
        shift = torch.tensor(offsets, dtype=torch.float)
        phases = torch.polar(torch.ones(len(offsets), pairs), freqs * shift[:, None]).sum(0)
        self.freqs.append(freqs)
        self.amps.append(phases * gain / pairs)

    def harmonics(self, period: int, gain: float, pairs: int) -> None:
        """``gain`` at every multiple of ``period`` (the first ``pairs`` harmonics)."""
        freqs = 2 * math.pi * torch.arange(1, pairs + 1, dtype=torch.float) / period
        self.freqs.append(freqs)
        self.amps.append(torch.full((pairs,), gain / pairs, dtype=torch.cfloat))

    def channels(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Query and key channels ``(L, 2 * pairs)`` whose products sum to the kernel."""
        freqs = torch.cat(self.freqs) if self.freqs else torch.zeros(0)
        amps = torch.cat(self.amps) if self.amps else torch.zeros(0, dtype=torch.cfloat)
        unused = self.pairs - len(freqs)
        freqs = torch.cat((freqs, torch.zeros(unused)))
        amps = torch.cat((amps, torch.zeros(unused, dtype=torch.cfloat)))
        pos = torch.arange(seq_len, dtype=torch.float)[:, None]
        scale = amps.abs().sqrt()
        q_angle = freqs * pos
        k_angle = q_angle + amps.angle()
        query = torch.cat((q_angle.cos(), q_angle.sin()), dim=1) * scale.repeat(2)
        key = torch.cat((k_angle.cos(), k_angle.sin()), dim=1) * scale.repeat(2)
        return query, key


def _local(kernel: _Kernel, gain: float, gen: torch.Generator, pairs: int) -> None:
    kernel.bumps([0], gain, width=_uniform(8.0, 48.0, gen), pairs=pairs)


def _needle_layout(
    seq_len: int,
    num_needles: int,
    needle_span: int,
    needle_query_spans: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Needle starts ``(num_needles,)`` in the mid context ``[L/8, L/2)`` and the target of every
    row ``(L,)``.

    The needles are split at random into *probed* ones (``num_needles // 2``; all of them when
    ``needle_query_spans`` is 0) and *unprobed* ones. Half of the rows of the last span
    (``S = min(64, L/8)`` rows: a question at the end) each read a random probed needle. Half of
    the rows of each of ``needle_query_spans`` earlier spans of ``S`` rows, which start in
    ``[5L/8, L - 2S]`` and so end before the last span, read the unprobed needles, evenly (each
    one is read as long as there are at least as many rows as unprobed needles). A probe of the
    last ``S`` rows therefore sees the probed needles only."""
    low, high = seq_len // 8, seq_len // 2 - needle_span
    slots = torch.randperm((high - low) // needle_span, generator=gen)[:num_needles]
    starts = (low + slots * needle_span).sort().values
    target = torch.full((seq_len,), -1, dtype=torch.long)
    span = min(_QUERY_SPAN, seq_len // 8)
    order = torch.randperm(num_needles, generator=gen)
    probed = num_needles // 2 if needle_query_spans else num_needles
    seen, unseen = starts[order[:probed]], starts[order[probed:]]
    if len(seen):
        rows = seq_len - span + torch.randperm(span, generator=gen)[: span // 2]
        target[rows] = seen[torch.randint(0, len(seen), (len(rows),), generator=gen)]
    if len(unseen):
        first, last = 5 * seq_len // 8, seq_len - 2 * span
        rows = torch.cat(
            [
                first
                + int(torch.randint(0, last - first + 1, (), generator=gen))
                + torch.randperm(span, generator=gen)[: span // 2]
                for _ in range(needle_query_spans)
            ]
        ).unique()  # spans may overlap
        pick = torch.randperm(len(rows), generator=gen) % len(unseen)
        target[rows] = unseen[pick]
    return starts, target


def _head(
    kind: str,
    seq_len: int,
    head_dim: int,
    num_needles: int,
    needle_span: int,
    needle_query_spans: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(query, key)`` ``(L, D)`` before the rotation, needle starts and row targets."""
    content = _content_dims(head_dim, num_needles)
    pairs = (head_dim - content) // 2
    kernel = _Kernel(pairs, gen)
    q_content = torch.zeros(seq_len, content)
    k_content = torch.zeros(seq_len, content)
    starts = torch.full((num_needles,), -1, dtype=torch.long)
    target = torch.full((seq_len,), -1, dtype=torch.long)
    sink = _uniform(2.0, 5.0, gen)
    half = pairs // 2
    if kind == "sink_local":
        sink = _uniform(5.0, 8.0, gen)
        _local(kernel, _uniform(7.0, 10.0, gen), gen, pairs)
    elif kind == "slash":
        offsets = [int(torch.randint(0, 8, (), generator=gen))]
        for _ in range(int(torch.randint(0, 3, (), generator=gen))):
            offsets.append(int(torch.randint(16, seq_len // 4, (), generator=gen)))
        kernel.bumps(offsets, _uniform(9.0, 12.0, gen), width=1.5, pairs=pairs)
    elif kind == "periodic":
        period = _PERIODS[int(torch.randint(0, len(_PERIODS), (), generator=gen))]
        kernel.harmonics(period, _uniform(7.0, 10.0, gen), pairs=pairs - half)
        _local(kernel, 3.0, gen, half)
    elif kind == "hub":
        hubs = torch.randint(
            0, seq_len - 1, (int(torch.randint(2, 7, (), generator=gen)),), generator=gen
        )
        gain = _uniform(7.0, 10.0, gen)
        for hub in hubs.tolist():
            k_content[hub : hub + int(torch.randint(1, 5, (), generator=gen)), 1] = gain
        q_content[:, 1] = 1.0
        _local(kernel, 3.0, gen, pairs)
    elif kind == "needle":
        sink = _uniform(5.0, 8.0, gen)
        _local(kernel, _uniform(7.0, 10.0, gen), gen, pairs)
        starts, target = _needle_layout(seq_len, num_needles, needle_span, needle_query_spans, gen)
        gain = _uniform(11.0, 13.0, gen)
        for n, start in enumerate(starts.tolist()):
            k_content[start : start + needle_span, 2 + n] = gain
            q_content[target == start, 2 + n] = 1.0
    else:  # diffuse
        sink = _uniform(0.5, 1.5, gen)
        _local(kernel, _uniform(1.0, 2.0, gen), gen, pairs)
    k_content[:_SINK_TOKENS, 0] = sink
    q_content[:, 0] = 1.0
    noise_dims = content - 2 - num_needles
    scale = (_uniform(0.5, 1.0, gen) / noise_dims**0.5) ** 0.5  # logit noise std 0.5 to 1
    q_content[:, 2 + num_needles :] = scale * torch.randn(seq_len, noise_dims, generator=gen)
    k_content[:, 2 + num_needles :] = scale * torch.randn(seq_len, noise_dims, generator=gen)
    q_pos, k_pos = kernel.channels(seq_len)
    root = head_dim**0.25  # q . k / sqrt(D) gives the designed logits
    query = torch.cat((q_pos, q_content), dim=1) * root
    key = torch.cat((k_pos, k_content), dim=1) * root
    return query, key, starts, target


def _draw_kinds(regime: str, num_heads: int, needle_heads: int, gen: torch.Generator) -> list[str]:
    names = list(_STRUCTURE_MIX)
    weights = torch.tensor(list(_STRUCTURE_MIX.values()))
    drawn = [names[i] for i in torch.multinomial(weights, num_heads, True, generator=gen)]
    if regime == "retrieval":
        for h in torch.randperm(num_heads, generator=gen)[:needle_heads].tolist():
            drawn[h] = "needle"
    return drawn


def planted_attention(
    seq_len: int,
    *,
    num_heads: int = 8,
    head_dim: int = 64,
    regime: str = "structure",
    needle_heads: int = 3,
    num_needles: int = 4,
    needle_span: int = 8,
    needle_query_spans: int = 3,
    generator: torch.Generator | None = None,
) -> PlantedAttention:
    """Generate one layer of queries, keys and values with planted head patterns.

    Head kinds are drawn independently per head (sink/local 35%, slash 25%, periodic 20%, hub
    10%, diffuse 10%); in the ``retrieval`` regime ``needle_heads`` random heads become needle
    heads. Needle heads plant ``num_needles`` needles of ``needle_span`` keys in ``[L/8, L/2)``.
    Half of the last 64 rows (a question at the end) each retrieve one of ``num_needles // 2``
    *probed* needles; half of the rows of ``needle_query_spans`` earlier spans of 64 rows in
    ``[5L/8, L - 64)`` (other questions) retrieve the other, *unprobed* needles, which no row
    of the last 64 reads (see ``needle_target``). A retrieving row has a logit of 11 to 13
    (nats) on its needle's keys, so that it puts most of its mass on it (about 88% on average
    at L = 4096). Logits of the other kinds: sink 2 to 8 (diffuse heads 0.5 to 1.5),
    recent-window bump 7 to 10 (width 8 to 48 tokens), slash 9 to 12, periodic 7 to 10, hubs 7
    to 10, diffuse 1 to 2; the finite number of channel pairs adds a smooth random background,
    and a few content channels i.i.d. logit noise of standard deviation 0.5 to 1.

    Args:
        seq_len: Tokens ``L`` (at least 256).
        num_heads: Heads ``H``.
        head_dim: Channels ``D`` per head (even, at least 16 and ``num_needles + 15``).
        regime: ``"structure"`` or ``"retrieval"``.
        needle_heads: Needle heads in the retrieval regime.
        num_needles: Needles per needle head.
        needle_span: Keys per needle.
        needle_query_spans: Spans of retrieving rows besides the last one (they read the
            unprobed needles; with 0, the last span reads all needles).
        generator: Source of randomness (the global torch RNG if ``None``).

    Returns:
        A :class:`PlantedAttention` of float32 tensors.

    Raises:
        InputError: If an argument is out of range, naming it.

    Example:
        >>> layer = planted_attention(512, num_heads=4, regime="retrieval", needle_heads=2,
        ...                           generator=torch.Generator().manual_seed(0))
        >>> layer.query.shape, [HEAD_KINDS[k] for k in layer.head_kind].count("needle")
        (torch.Size([4, 512, 64]), 2)
    """
    if regime not in REGIMES:
        raise InputError(f"regime must be one of {REGIMES}, got {regime!r}")
    _check_args(
        seq_len,
        num_heads,
        head_dim,
        regime,
        needle_heads,
        num_needles,
        needle_span,
        needle_query_spans,
    )
    gen = (
        generator
        if generator is not None
        else torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())))
    )
    kinds = _draw_kinds(regime, num_heads, needle_heads, gen)
    queries, keys, starts, targets = [], [], [], []
    for kind in kinds:
        q, k, s, t = _head(
            kind, seq_len, head_dim, num_needles, needle_span, needle_query_spans, gen
        )
        rotation = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen))[0]
        queries.append(q @ rotation)
        keys.append(k @ rotation)
        starts.append(s)
        targets.append(t)
    return PlantedAttention(
        query=torch.stack(queries),
        key=torch.stack(keys),
        value=torch.randn(num_heads, seq_len, head_dim, generator=gen),
        head_kind=torch.tensor([HEAD_KINDS.index(k) for k in kinds]),
        regime=torch.tensor(REGIMES.index(regime)),
        needle_positions=torch.stack(starts),
        needle_target=torch.stack(targets),
        needle_span=torch.tensor(needle_span),
    )


_SPLITS = ("train", "test")


class _PlantedLayers(torch.utils.data.Dataset):
    """Instances generated on access from their seeds (a layer of 4096 tokens and 8 heads is
    24 MB; a split is never held in memory)."""

    def __init__(self, seeds: list[int], regime: str, kwargs: dict[str, Any]) -> None:
        self.seeds, self.regime, self.kwargs = seeds, regime, kwargs

    def __len__(self) -> int:
        return len(self.seeds)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seeds[index])
        regime = self.regime
        if regime == "mixed":
            regime = REGIMES[int(torch.randint(0, len(REGIMES), (), generator=gen))]
        layer = planted_attention(regime=regime, generator=gen, **self.kwargs)
        return {name: getattr(layer, name) for name in PlantedAttention.__dataclass_fields__}


class PlantedAttentionDataModule(SplitDataModule):
    """Independent :func:`planted_attention` layers in fit (``train``) and ``test`` splits.

    Every instance has its own seed; the seeds of a split are drawn from
    ``numpy.random.SeedSequence([seed, split_index])``, so fit and test instances never share a
    seed and changing ``num_fit`` leaves the test data alone. Instances are generated when the
    loader reads them. Batches are dicts: ``query``, ``key``, ``value`` ``(B, H, L, D)``,
    ``head_kind`` ``(B, H)``, ``regime`` ``(B,)``, ``needle_positions`` ``(B, H, num_needles)``
    ``needle_target`` ``(B, H, L)`` and ``needle_span`` ``(B,)`` (see :class:`PlantedAttention`).

    Args:
        seq_len: Tokens ``L``.
        num_heads: Heads ``H``.
        head_dim: Channels per head ``D``.
        regime: ``"structure"``, ``"retrieval"`` or ``"mixed"`` (each instance draws one of the
            two with equal odds: data to calibrate and check a regime classifier on).
        needle_heads: Needle heads of a retrieval instance.
        num_needles: Needles per needle head.
        needle_span: Keys per needle.
        needle_query_spans: Spans of retrieving rows besides the last one (the unprobed needles).
        num_fit: Instances of the fit (``train``) split.
        num_test: Instances of the test (and predict) split.
        seed: Seed of the instance seeds. ``None`` takes the seed of ``seed_everything``, so a
            sweep's seeds vary the data too.
        batch_size: Batch size of the fit loader.
        eval_batch_size: Batch size of the test loader (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        InputError: If an argument is out of range, naming it.

    Example:
        >>> dm = PlantedAttentionDataModule(seq_len=256, num_heads=2, num_fit=2, num_test=1,
        ...                                 regime="retrieval", needle_heads=1)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["query"].shape, batch["regime"].tolist()
        (torch.Size([1, 2, 256, 64]), [1])
    """

    def __init__(
        self,
        seq_len: int = 4096,
        num_heads: int = 8,
        head_dim: int = 64,
        regime: str = "mixed",
        needle_heads: int = 3,
        num_needles: int = 4,
        needle_span: int = 8,
        needle_query_spans: int = 3,
        num_fit: int = 32,
        num_test: int = 8,
        seed: int | None = None,
        batch_size: int = 1,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            seed=seed,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
        )
        self.kwargs: dict[str, Any] = {
            "seq_len": seq_len,
            "num_heads": num_heads,
            "head_dim": head_dim,
            "needle_heads": needle_heads,
            "num_needles": num_needles,
            "needle_span": needle_span,
            "needle_query_spans": needle_query_spans,
        }
        _check_args(regime=regime, **self.kwargs)
        counts = {
            "train": _check_int("num_fit", num_fit, 1),
            "test": _check_int("num_test", num_test, 1),
        }
        self.regime = regime
        self.split_seeds: dict[str, list[int]] = {
            split: [
                int(s)
                for s in np.random.SeedSequence([self.seed, index]).generate_state(
                    counts[split], np.uint64
                )
            ]
            for index, split in enumerate(_SPLITS)
        }

    def setup(self, stage: str | None = None) -> None:
        for split, seeds in self.split_seeds.items():
            self.datasets[split] = _PlantedLayers(seeds, self.regime, self.kwargs)
