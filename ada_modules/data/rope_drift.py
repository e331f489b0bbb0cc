"""Synthetic KV caches whose outlier key channels drift along the sequence (data for ADKV).

Keys in trained LLMs have a few *outlier channels* with large magnitude, concentrated in the
low-frequency RoPE dimensions. Before RoPE an outlier channel sits near a large, slowly wandering
mean; RoPE then rotates each channel pair ``(i, i + D/2)`` by the angle ``t * base**(-2i/D)``, so
the post-RoPE channel follows a slow sinusoid of large amplitude. A static per-channel quantizer
must cover the whole swing, while one that quantizes groups of tokens (or tracks the drift) sees
only the local range: :func:`drift_statistics` measures that ratio.

:func:`rope_drift_kv` generates one such sequence (keys, values and decode-time queries) and
:class:`RopeDriftDataModule` serves independent sequences in calibration (train) and held-out
(val/test) splits. :func:`apply_rope` is the Hugging Face Llama rotary embedding (and its inverse).
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ada_modules.data.split_datamodule import SplitDataModule
from ada_modules.errors import InputError

__all__ = [
    "RopeDriftDataModule",
    "RopeDriftSample",
    "apply_rope",
    "drift_statistics",
    "rope_drift_kv",
]

_SPLITS = ("train", "val", "test")
# Pre-RoPE offset, in units of the N(0, 1) noise, that an aligned query puts on each outlier
# channel (with the sign of the channel's mean), before the scores are normalised.
_ALIGNED_QUERY_GAIN = 4.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0, inverse: bool = False
) -> torch.Tensor:
    """Rotary position embedding with the Hugging Face Llama convention (``rotate_half``).

    Channel ``i`` pairs with channel ``i + D/2`` and the pair turns by ``positions * base**(-2i/D)``
    radians (angles computed in float32, as transformers does). ``inverse=True`` turns by the
    negative angle, which undoes the embedding.

    Args:
        x: ``(..., T, D)`` with ``D`` even.
        positions: ``(T,)`` integer or float positions.
        base: RoPE base (``rope_theta``).
        inverse: Rotate by ``-angle`` instead.

    Returns:
        A tensor like ``x``.

    Example:
        >>> x = torch.randn(2, 5, 8)
        >>> y = apply_rope(x, torch.arange(5))
        >>> torch.allclose(apply_rope(y, torch.arange(5), inverse=True), x, atol=1e-5)
        True
    """
    if x.ndim < 2 or x.shape[-1] % 2:
        raise InputError(f"x must have shape (..., T, D) with D even, got {tuple(x.shape)}")
    if positions.ndim != 1 or positions.shape[0] != x.shape[-2]:
        raise InputError(
            f"positions must have shape (T,) = ({x.shape[-2]},), got {tuple(positions.shape)}"
        )
    if not base > 0:
        raise InputError(f"base must be > 0, got {base!r}")
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=x.device) / dim))
    angles = positions.to(device=x.device, dtype=torch.float)[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if inverse:
        sin = -sin
    return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True)
class RopeDriftSample:
    """One generated sequence of :func:`rope_drift_kv` for ``H`` heads and ``T`` tokens.

    Attributes:
        keys: ``(H, T, D)`` keys after RoPE at positions ``0..T-1``.
        keys_pre_rope: ``(H, T, D)`` the same keys before RoPE.
        values: ``(H, T, D)``.
        queries: ``(H, Nq, D)`` decode queries after RoPE at position ``T``.
        outlier_channels: ``(H, 2 * outlier_pairs)`` long, the drifting channels of each head
            (pair indices ``i`` first, then their partners ``i + D/2``).
    """

    keys: torch.Tensor
    keys_pre_rope: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    outlier_channels: torch.Tensor


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_interval(name: str, value: Any) -> None:
    if (
        not isinstance(value, tuple | list)
        or len(value) != 2
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        or not 0 < value[0] <= value[1]
    ):
        raise InputError(f"{name} must be a pair (low, high) with 0 < low <= high, got {value!r}")


def _check_args(
    num_tokens: int,
    *,
    num_heads: int,
    head_dim: int,
    outlier_pairs: int,
    outlier_mean: tuple[float, float],
    walk_std: float,
    value_scale: tuple[float, float],
    num_queries: int,
    aligned_fraction: float,
    score_std: float,
    low_frequency_outliers: bool,
    base: float,
) -> None:
    _check_int("num_tokens", num_tokens, 1)
    _check_int("num_heads", num_heads, 1)
    _check_int("head_dim", head_dim, 2)
    if head_dim % 2:
        raise InputError(f"head_dim must be even (RoPE pairs channels), got {head_dim!r}")
    _check_int("outlier_pairs", outlier_pairs, 0)
    available = head_dim // 4 if low_frequency_outliers else head_dim // 2
    if outlier_pairs > available:
        band = "low-frequency pairs (head_dim // 4)" if low_frequency_outliers else "pairs"
        raise InputError(
            f"outlier_pairs={outlier_pairs} exceeds the {available} {band} of head_dim={head_dim}"
        )
    _check_interval("outlier_mean", outlier_mean)
    _check_interval("value_scale", value_scale)
    if not isinstance(walk_std, int | float) or not walk_std >= 0:
        raise InputError(f"walk_std must be a number >= 0, got {walk_std!r}")
    _check_int("num_queries", num_queries, 1)
    if not isinstance(aligned_fraction, int | float) or not 0 <= aligned_fraction <= 1:
        raise InputError(f"aligned_fraction must be in [0, 1], got {aligned_fraction!r}")
    if not isinstance(score_std, int | float) or not score_std > 0:
        raise InputError(f"score_std must be a number > 0, got {score_std!r}")
    if not isinstance(base, int | float) or not base > 1:
        raise InputError(f"base must be a number > 1, got {base!r}")


def _uniform(
    shape: tuple[int, ...], low: float, high: float, gen: torch.Generator | None
) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=gen)


def rope_drift_kv(
    num_tokens: int,
    *,
    num_heads: int = 2,
    head_dim: int = 64,
    outlier_pairs: int = 4,
    outlier_mean: tuple[float, float] = (8.0, 20.0),
    walk_std: float = 0.02,
    value_scale: tuple[float, float] = (0.5, 2.0),
    num_queries: int = 64,
    aligned_fraction: float = 0.5,
    score_std: float = 2.5,
    low_frequency_outliers: bool = True,
    base: float = 10000.0,
    generator: torch.Generator | None = None,
    layout_generator: torch.Generator | None = None,
) -> RopeDriftSample:
    """Generate one sequence of keys with drifting RoPE outlier channels, values and queries.

    - **Keys** before RoPE are N(0, 1), except on ``outlier_pairs`` channel pairs
      ``(i, i + D/2)`` per head: each of their channels adds a mean of magnitude uniform in
      ``outlier_mean`` (random sign) and a slow Gaussian random walk (cumulative sum of
      N(0, ``walk_std``) steps). RoPE at positions ``0..T-1`` then turns each outlier pair into a
      sinusoid of period ``2 pi base**(2i/D)`` tokens. With ``low_frequency_outliers`` (default)
      the pairs are drawn from the ``D // 4`` lowest-frequency pairs (largest ``i``), where trained
      LLMs have their key outliers, so the drift is slow next to a group of tokens (periods of
      630 to 47,000 tokens for ``D = 64``); otherwise from all ``D / 2`` pairs.
    - **Values** are N(0, 1) times a per-channel scale, log-uniform in ``value_scale``.
    - **Queries** before RoPE are N(0, 1); the first ``round(aligned_fraction * Nq)`` of them add
      ``4 * sign(mean)`` on every outlier channel, so they attend along the drifting channels.
      They are rotated to the decode position ``T``, then each query is scaled so that its scores
      ``q k^T / sqrt(D)`` over the ``T`` keys have standard deviation ``score_std``: with the
      default 2.5 and 1024 keys the largest softmax weight of a query is about 5% on average (from
      under 1% to about 60%): peaked, but neither uniform nor one-hot.

    Args:
        num_tokens: Sequence length ``T``.
        num_heads: Heads ``H``.
        head_dim: Channels per head ``D`` (even).
        outlier_pairs: Drifting channel pairs per head.
        outlier_mean: Range ``(low, high)`` of the outlier means' magnitude.
        walk_std: Step standard deviation of the outliers' random walk.
        value_scale: Range ``(low, high)`` of the per-channel value scales.
        num_queries: Queries ``Nq`` per head.
        aligned_fraction: Fraction of the queries aligned with the outlier channels.
        score_std: Standard deviation of each query's attention scores over the keys.
        low_frequency_outliers: Draw outlier pairs from the low-frequency quarter of channels.
        base: RoPE base.
        generator: Source of randomness (the global torch RNG if ``None``).
        layout_generator: Source of the *layout*: which channels are outliers, their means and
            signs, and the value scales. Pass generators seeded alike to give several sequences
            one layout, as the sequences of one layer of a model share theirs (default:
            ``generator``, a new layout per sequence).

    Returns:
        A :class:`RopeDriftSample` of float32 tensors.

    Example:
        >>> sample = rope_drift_kv(256, generator=torch.Generator().manual_seed(0))
        >>> sample.keys.shape, sample.queries.shape, sample.outlier_channels.shape
        (torch.Size([2, 256, 64]), torch.Size([2, 64, 64]), torch.Size([2, 8]))
    """
    _check_args(
        num_tokens,
        num_heads=num_heads,
        head_dim=head_dim,
        outlier_pairs=outlier_pairs,
        outlier_mean=outlier_mean,
        walk_std=walk_std,
        value_scale=value_scale,
        num_queries=num_queries,
        aligned_fraction=aligned_fraction,
        score_std=score_std,
        low_frequency_outliers=low_frequency_outliers,
        base=base,
    )
    heads, tokens, dim, half = num_heads, num_tokens, head_dim, head_dim // 2
    layout = generator if layout_generator is None else layout_generator
    first = half - head_dim // 4 if low_frequency_outliers else 0
    pairs = torch.stack(
        [
            first + torch.randperm(half - first, generator=layout)[:outlier_pairs]
            for _ in range(heads)
        ]
    )
    channels = torch.cat((pairs, pairs + half), dim=1)  # (H, 2P)

    magnitude = _uniform((heads, 2 * outlier_pairs), *outlier_mean, layout)
    sign = torch.randint(0, 2, (heads, 2 * outlier_pairs), generator=layout) * 2.0 - 1.0
    steps = walk_std * torch.randn(heads, tokens, 2 * outlier_pairs, generator=generator)
    drift = (magnitude * sign)[:, None, :] + steps.cumsum(dim=1)  # (H, T, 2P)
    keys_pre = torch.randn(heads, tokens, dim, generator=generator)
    keys_pre.scatter_add_(2, channels[:, None, :].expand(-1, tokens, -1), drift)
    keys = apply_rope(keys_pre, torch.arange(tokens), base)

    log_low, log_high = np.log(value_scale[0]), np.log(value_scale[1])
    scale = _uniform((heads, 1, dim), log_low, log_high, layout).exp()
    values = torch.randn(heads, tokens, dim, generator=generator) * scale

    queries = torch.randn(heads, num_queries, dim, generator=generator)
    aligned = round(aligned_fraction * num_queries)
    gain = (_ALIGNED_QUERY_GAIN * sign)[:, None, :].expand(-1, aligned, -1)
    queries[:, :aligned].scatter_add_(2, channels[:, None, :].expand(-1, aligned, -1), gain)
    queries = apply_rope(queries, torch.full((num_queries,), tokens), base)
    score_spread = (queries @ keys.transpose(1, 2) / dim**0.5).std(dim=-1, correction=0)
    queries = queries * torch.where(score_spread > 0, score_std / score_spread, 1.0)[..., None]
    return RopeDriftSample(keys, keys_pre, values, queries, channels)


def drift_statistics(
    keys: torch.Tensor, group_size: int = 32, top_k: int = 8
) -> dict[str, torch.Tensor | float]:
    """How much more range a static per-channel quantizer sees than a group-wise one.

    For every channel, the ratio of its range (max - min) over the whole sequence to its mean
    range over consecutive groups of ``group_size`` tokens (the trailing ``T % group_size`` tokens
    form no group but count in the whole range). A channel that only carries noise has a ratio
    near 1.6 for ``T = 1024`` and groups of 32; a drifting channel has a much larger one. A
    constant channel gets 1.

    Args:
        keys: ``(..., T, D)``, e.g. ``(H, T, D)``.
        group_size: Tokens per group, ``2 <= group_size <= T``.
        top_k: Channels per head (leading index) counted as outliers: those of largest mean
            absolute value, the ones a static quantizer has to scale for.

    Returns:
        ``{"range_ratio": (..., D) tensor, "outlier_ratio_mean": mean ratio over the top_k
        channels of each head, "median_ratio": median ratio over all channels}``.

    Example:
        >>> sample = rope_drift_kv(1024, generator=torch.Generator().manual_seed(0))
        >>> stats = drift_statistics(sample.keys)
        >>> stats["outlier_ratio_mean"] > 2 * stats["median_ratio"]
        True
    """
    if keys.ndim < 2:
        raise InputError(f"keys must have shape (..., T, D), got {tuple(keys.shape)}")
    tokens, dim = keys.shape[-2:]
    _check_int("group_size", group_size, 2)
    if group_size > tokens:
        raise InputError(f"group_size={group_size} exceeds the sequence length T={tokens}")
    _check_int("top_k", top_k, 1)
    if top_k > dim:
        raise InputError(f"top_k={top_k} exceeds the channels per head D={dim}")
    keys = keys.float()
    whole = keys.amax(dim=-2) - keys.amin(dim=-2)
    groups = keys[..., : tokens - tokens % group_size, :].unflatten(-2, (-1, group_size))
    grouped = (groups.amax(dim=-2) - groups.amin(dim=-2)).mean(dim=-2)
    ratio = torch.where(grouped > 0, whole / grouped, torch.ones_like(whole))
    top = keys.abs().mean(dim=-2).topk(top_k, dim=-1).indices
    return {
        "range_ratio": ratio,
        "outlier_ratio_mean": ratio.gather(-1, top).mean().item(),
        "median_ratio": ratio.median().item(),
    }


class RopeDriftDataModule(SplitDataModule):
    """Independent :func:`rope_drift_kv` sequences in calibration and held-out splits.

    Every sequence has its own seed; the seeds of a split are drawn from
    ``numpy.random.SeedSequence([seed, split_index])``, so the train (calibration) sequences and
    the val/test (held-out) sequences never share a seed, and changing ``num_train`` leaves the
    val/test data alone. ``split_seeds`` lists them. Batches are dicts of float32 tensors
    ``keys``, ``values``, ``keys_pre_rope`` ``(B, H, T, D)`` and ``queries`` ``(B, H, Nq, D)``.

    Args:
        num_tokens: Sequence length ``T``.
        num_heads: Heads ``H``.
        head_dim: Channels per head ``D`` (even).
        outlier_pairs: Drifting channel pairs per head.
        outlier_mean: Range of the outlier means' magnitude.
        walk_std: Step standard deviation of the outliers' random walk.
        value_scale: Range of the per-channel value scales.
        num_queries: Queries ``Nq`` per head.
        aligned_fraction: Fraction of the queries aligned with the outlier channels.
        score_std: Standard deviation of each query's attention scores over the keys.
        low_frequency_outliers: Draw outlier pairs from the low-frequency quarter of channels.
        base: RoPE base.
        fixed_layout: Give every sequence of every split the same layout (outlier channels, their
            means, value scales), drawn from ``seed``, as the sequences of one model layer share
            theirs; per-channel parameters calibrated on the train split then apply to the
            held-out ones. ``False``: a new layout per sequence.
        num_train: Calibration sequences.
        num_val: Validation sequences.
        num_test: Test (and predict) sequences.
        seed: Seed of the sequence seeds. ``None`` takes the seed of ``seed_everything``.
        batch_size: Batch size of the training loader.
        eval_batch_size: Batch size of the evaluation loaders (defaults to ``batch_size``).
        num_workers: Worker processes per loader.

    Raises:
        InputError: If an argument is out of range, naming the argument.

    Example:
        >>> dm = RopeDriftDataModule(num_tokens=128, num_train=2, num_val=1, num_test=1)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch["keys"].shape, batch["queries"].shape
        (torch.Size([1, 2, 128, 64]), torch.Size([1, 2, 64, 64]))
    """

    def __init__(
        self,
        num_tokens: int = 1024,
        num_heads: int = 2,
        head_dim: int = 64,
        outlier_pairs: int = 4,
        outlier_mean: tuple[float, float] = (8.0, 20.0),
        walk_std: float = 0.02,
        value_scale: tuple[float, float] = (0.5, 2.0),
        num_queries: int = 64,
        aligned_fraction: float = 0.5,
        score_std: float = 2.5,
        low_frequency_outliers: bool = True,
        base: float = 10000.0,
        fixed_layout: bool = False,
        num_train: int = 8,
        num_val: int = 2,
        num_test: int = 4,
        seed: int | None = 0,
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
        self.sample_kwargs: dict[str, Any] = {
            "num_heads": num_heads,
            "head_dim": head_dim,
            "outlier_pairs": outlier_pairs,
            "outlier_mean": tuple(outlier_mean),
            "walk_std": walk_std,
            "value_scale": tuple(value_scale),
            "num_queries": num_queries,
            "aligned_fraction": aligned_fraction,
            "score_std": score_std,
            "low_frequency_outliers": low_frequency_outliers,
            "base": base,
        }
        _check_args(num_tokens, **self.sample_kwargs)
        for name, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            _check_int(name, value, 1)
        self.num_tokens = num_tokens
        self.fixed_layout = bool(fixed_layout)
        counts = {"train": num_train, "val": num_val, "test": num_test}
        self.split_seeds: dict[str, list[int]] = {
            split: [
                int(s)
                for s in np.random.SeedSequence([self.seed, index]).generate_state(
                    counts[split], np.uint64
                )
            ]
            for index, split in enumerate(_SPLITS)
        }

    def _sequence(self, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        layout = torch.Generator().manual_seed(self.seed) if self.fixed_layout else None
        sample = rope_drift_kv(
            self.num_tokens, generator=generator, layout_generator=layout, **self.sample_kwargs
        )
        return {
            "keys": sample.keys,
            "values": sample.values,
            "queries": sample.queries,
            "keys_pre_rope": sample.keys_pre_rope,
        }

    def setup(self, stage: str | None = None) -> None:
        for split, seeds in self.split_seeds.items():
            if split not in self.datasets:
                self.datasets[split] = [self._sequence(seed) for seed in seeds]
