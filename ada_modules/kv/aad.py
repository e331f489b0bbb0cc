"""Average Attention Distance (AAD): how far back, in tokens, a causal attention head looks.

For layer ``l``, head ``h`` and query position ``t`` with causal attention weights ``A[t, j]``
(``j <= t``)::

    AAD(t)  = sum_j A[t, j] * (t - j)                      # tokens
    nAAD(t) = AAD(t) / t                                   # normalize="position", in [0, 1]
    nAAD(t) = AAD(t) / (t - sink_tokens)                   # normalize="max": largest distance
                                                           #   that the counted keys allow
    AAD_l   = mean_h mean_t nAAD(t)                        # per-layer profile
    sigma_l = std_t (mean_h nAAD(t))                       # fluctuation over positions

Positions are *real* token positions: with an ``attention_mask`` (left or right padding), the
position of a token is the number of real tokens before it, padding keys are ignored and padding
queries are undefined (``NaN``). The first ``sink_tokens`` real tokens (attention sinks) can be left
out of the sum; ``renormalize=True`` then divides the remaining weights by their mass (AAD becomes
the mean distance *given* that the head does not look at a sink), ``renormalize=False`` just drops
the sink mass (a head that only looks at sinks has AAD 0). Without sink exclusion the two
normalisations coincide.

AAD is borrowed from ViT's mean attention distance; its use for per-layer KV bit widths is the
AdaKVQ abstract's, and the exact normalisation and aggregation above are our reconstruction.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from ada_modules.errors import InputError

__all__ = ["NORMALIZATIONS", "AADAccumulator", "AADProfile", "average_attention_distance"]

NORMALIZATIONS: tuple[str, ...] = ("none", "position", "max")
"""Accepted values of ``normalize``: raw tokens, divided by ``t``, divided by ``t - sink_tokens``."""


def _check_options(normalize: str, sink_tokens: int) -> None:
    if normalize not in NORMALIZATIONS:
        raise InputError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise InputError(f"sink_tokens must be an integer >= 0, got {sink_tokens!r}")


def _real_positions(attention_mask: Tensor | None, batch: int, length: int, device: Any) -> Tensor:
    """Position of each token among the real tokens of its row, -1 for padding; (batch, T)."""
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    if attention_mask.shape != (batch, length):
        raise InputError(
            f"attention_mask must have shape (batch, T) = {(batch, length)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    real = attention_mask.to(device=device, dtype=torch.bool)
    return torch.where(
        real, real.long().cumsum(-1) - 1, torch.full_like(real, -1, dtype=torch.long)
    )


def average_attention_distance(
    attn: Tensor,
    attention_mask: Tensor | None = None,
    *,
    normalize: Literal["none", "position", "max"] = "none",
    sink_tokens: int = 0,
    renormalize: bool = True,
) -> Tensor:
    """AAD of every head and query position of one layer's causal attention weights.

    Entries above the diagonal (``j > t``) and on padding keys are ignored. A query gets ``NaN``
    when it is padding, when no counted key is left (``t < sink_tokens``), when the counted weights
    sum to zero under ``renormalize=True``, or when the normaliser is zero (``t == 0`` for
    ``"position"``, ``t == sink_tokens`` for ``"max"``).

    Args:
        attn: Attention probabilities, shape ``(batch, heads, T, T)`` (query, key), rows summing
            to 1 over the keys, e.g. ``output_attentions`` of a Hugging Face model in eager mode.
        attention_mask: ``(batch, T)``, 1 for real tokens and 0 for padding (either side).
        normalize: ``"none"`` (tokens), ``"position"`` (divide by the real position ``t``) or
            ``"max"`` (divide by ``t - sink_tokens``, the largest distance of a counted key).
        sink_tokens: Leave out keys at the first ``sink_tokens`` real positions.
        renormalize: With ``sink_tokens > 0``, rescale the remaining weights of each query to sum
            to 1 (``True``) or leave the sink mass out without rescaling (``False``).

    Returns:
        Float tensor ``(batch, heads, T)``: the AAD of each query position.

    Raises:
        ValueError: If ``attn`` is not ``(batch, heads, T, T)``, the mask has another shape, or
            an option is invalid.

    Examples:
        >>> T = 4
        >>> uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
        >>> average_attention_distance(uniform[None, None])
        tensor([[[0.0000, 0.5000, 1.0000, 1.5000]]])
        >>> average_attention_distance(uniform[None, None], normalize="position")
        tensor([[[   nan, 0.5000, 0.5000, 0.5000]]])
    """
    _check_options(normalize, sink_tokens)
    if attn.ndim != 4 or attn.shape[-1] != attn.shape[-2]:
        raise InputError(f"attn must have shape (batch, heads, T, T), got {tuple(attn.shape)}")
    batch, _, length, _ = attn.shape
    weights = attn.float()
    pos = _real_positions(attention_mask, batch, length, attn.device)  # (B, T)
    query_pos = pos[:, :, None]  # (B, Tq, 1)
    key_pos = pos[:, None, :]  # (B, 1, Tk)
    index = torch.arange(length, device=attn.device)
    counted = (
        (index[None, :] <= index[:, None])  # causal
        & (key_pos >= sink_tokens)  # real key (padding is -1) past the sinks
        & (query_pos >= 0)
    )  # (B, Tq, Tk)
    weights = weights * counted[:, None]
    distance = (query_pos - key_pos).clamp(min=0).float()[:, None]  # (B, 1, Tq, Tk)
    aad = (weights * distance).sum(-1)  # (B, H, Tq)
    undefined = (pos < sink_tokens) | (pos < 0)  # no counted key, or a padding query
    undefined = undefined[:, None, :].expand_as(aad)
    if renormalize and sink_tokens > 0:
        mass = weights.sum(-1)
        undefined = undefined | (mass <= 0)
        aad = aad / mass.clamp(min=torch.finfo(aad.dtype).tiny)
    if normalize != "none":
        offset = sink_tokens if normalize == "max" else 0
        scale = (pos - offset).float()[:, None, :].expand_as(aad)
        undefined = undefined | (scale <= 0)
        aad = aad / scale.clamp(min=1.0)
    return aad.masked_fill(undefined, math.nan)


def _sum_by_position(values: Tensor, pos: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Sum (over the batch) and count of the defined ``values`` at each real position.

    Args:
        values: ``(batch, heads, T)``, ``NaN`` where undefined.
        pos: ``(batch, T)`` real positions, -1 for padding.
        length: Number of position slots.

    Returns:
        Two ``(heads, length)`` tensors, so that left-padded rows line up by real position.
    """
    heads = values.shape[1]
    defined = ~values.isnan()
    index = pos.clamp(min=0)[:, None, :].expand_as(values).transpose(0, 1).reshape(heads, -1)
    total = values.new_zeros(heads, length).scatter_add_(
        -1, index, values.nan_to_num(0.0).transpose(0, 1).reshape(heads, -1)
    )
    count = values.new_zeros(heads, length).scatter_add_(
        -1, index, defined.to(values.dtype).transpose(0, 1).reshape(heads, -1)
    )
    return total, count


@dataclass
class AADProfile:
    """AAD of a model averaged over a calibration set, per layer, head and real position.

    Attributes:
        aad: ``(layers, heads, positions)`` mean AAD in tokens (``NaN`` where never defined).
        naad: Same shape, the normalised AAD (``normalize`` of the accumulator).
        counts: ``(positions,)`` number of sequences that had each position.
        normalize: Normalisation of ``naad`` (``"position"`` or ``"max"``).
        sink_tokens: Sink keys left out.
        renormalize: Whether the remaining weights were rescaled.
        metadata: Free-form facts (e.g. step, number of batches, model name).

    Examples:
        >>> naad = torch.tensor([[[0.2, 0.4]], [[0.5, 0.5]]])  # 2 layers, 1 head, 2 positions
        >>> profile = AADProfile(aad=naad * 10, naad=naad, counts=torch.tensor([4, 4]))
        >>> profile.layer_mean().tolist(), profile.layer_std().tolist()
        ([0.30000001192092896, 0.5], [0.10000000149011612, 0.0])
        >>> AADProfile.from_dict(profile.to_dict()).layer_mean().tolist()
        [0.30000001192092896, 0.5]
    """

    aad: Tensor
    naad: Tensor
    counts: Tensor
    normalize: str = "position"
    sink_tokens: int = 0
    renormalize: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        """Number of layers profiled."""
        return self.aad.shape[0]

    def position_curve(self, normalized: bool = True) -> Tensor:
        """Head-mean AAD per layer and position, ``(layers, positions)``."""
        values = self.naad if normalized else self.aad
        return values.nanmean(dim=1)

    def layer_mean(self, normalized: bool = True) -> Tensor:
        """``AAD_l``: mean over heads, then over the positions where it is defined; ``(layers,)``."""
        return self.position_curve(normalized).nanmean(dim=-1)

    def layer_std(self, normalized: bool = True) -> Tensor:
        """``sigma_l``: std over positions of the head-mean AAD (population std); ``(layers,)``."""
        curve = self.position_curve(normalized)
        mean = curve.nanmean(dim=-1, keepdim=True)
        return (curve - mean).pow(2).nanmean(dim=-1).sqrt()

    def head_mean(self, normalized: bool = True) -> Tensor:
        """Mean over positions per layer and head, ``(layers, heads)``."""
        return (self.naad if normalized else self.aad).nanmean(dim=-1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the summaries first, then the full per-position arrays."""

        def listify(t: Tensor) -> Any:
            return (
                [None if math.isnan(v) else v for v in t.tolist()]
                if t.ndim == 1
                else [listify(row) for row in t]
            )

        return {
            "num_layers": self.num_layers,
            "normalize": self.normalize,
            "sink_tokens": self.sink_tokens,
            "renormalize": self.renormalize,
            "layer_mean": listify(self.layer_mean()),
            "layer_std": listify(self.layer_std()),
            "layer_mean_tokens": listify(self.layer_mean(normalized=False)),
            "layer_std_tokens": listify(self.layer_std(normalized=False)),
            "head_mean": listify(self.head_mean()),
            "metadata": dict(self.metadata),
            "counts": self.counts.tolist(),
            "aad": listify(self.aad),
            "naad": listify(self.naad),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> "AADProfile":
        """Inverse of :meth:`to_dict`, validated field by field.

        ``aad`` and ``naad`` must be ``(layers, heads, positions)`` nested lists of finite
        numbers >= 0 or ``null`` (undefined), ``counts`` one integer >= 0 per position. The
        summaries (``num_layers``, ``layer_mean``, ``layer_std``, ``layer_mean_tokens``,
        ``layer_std_tokens``, ``head_mean``) are recomputed from the arrays, not read; when
        present they must hold finite numbers (``null`` where the recomputed value is undefined)
        that agree with the arrays, so that an edited summary is reported, not ignored.

        Args:
            data: The dict of :meth:`to_dict` (e.g. parsed JSON).
            source: Where ``data`` came from (a file path), named in every error.

        Raises:
            InputError: Naming ``source``, the field (with its index) and the value.
        """
        where = f"AAD profile {source}" if source else "AAD profile"

        def fail(field_name: str, message: str) -> InputError:
            return InputError(f"{where}: field {field_name!r} {message}")

        if not isinstance(data, dict):
            raise InputError(f"{where} must be a JSON object (dict), got {type(data).__name__}")
        for name in ("aad", "naad", "counts", "normalize", "sink_tokens", "renormalize"):
            if name not in data:
                raise fail(name, "is missing")
        aad = _read_positions(data["aad"], "aad", fail)
        naad = _read_positions(data["naad"], "naad", fail)
        if naad.shape != aad.shape:
            raise fail(
                "naad",
                f"must have the shape of 'aad' {tuple(aad.shape)}, got {tuple(naad.shape)}",
            )
        counts = data["counts"]
        if (
            not isinstance(counts, list)
            or len(counts) != aad.shape[-1]
            or any(
                isinstance(c, bool)
                or not isinstance(c, int | float)
                or not math.isfinite(c)
                or c < 0
                or c != int(c)
                for c in counts
            )
        ):
            raise fail(
                "counts",
                f"must be a list of {aad.shape[-1]} whole numbers >= 0 (one per position), got "
                f"{_short(counts)}",
            )
        normalize = data["normalize"]
        if normalize not in ("position", "max"):
            raise fail("normalize", f"must be 'position' or 'max', got {normalize!r}")
        sink_tokens = data["sink_tokens"]
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise fail("sink_tokens", f"must be an integer >= 0, got {sink_tokens!r}")
        renormalize = data["renormalize"]
        if not isinstance(renormalize, bool):
            raise fail("renormalize", f"must be true or false, got {renormalize!r}")
        metadata = data.get("metadata", {})
        if not isinstance(metadata, dict):
            raise fail("metadata", f"must be an object (dict), got {_short(metadata)}")
        profile = cls(
            aad=aad,
            naad=naad,
            counts=torch.tensor([int(c) for c in counts], dtype=torch.long),
            normalize=normalize,
            sink_tokens=sink_tokens,
            renormalize=renormalize,
            metadata=dict(metadata),
        )
        profile._check_summaries(data, fail)
        return profile

    def _check_summaries(self, data: dict[str, Any], fail: Any) -> None:
        """Check the summary fields of ``data`` (when present) against the recomputed ones."""
        if "num_layers" in data and (
            isinstance(data["num_layers"], bool) or data["num_layers"] != self.num_layers
        ):
            raise fail(
                "num_layers",
                f"is {data['num_layers']!r} but 'aad' has {self.num_layers} layers",
            )
        expected = {
            "layer_mean": self.layer_mean(),
            "layer_std": self.layer_std(),
            "layer_mean_tokens": self.layer_mean(normalized=False),
            "layer_std_tokens": self.layer_std(normalized=False),
            "head_mean": self.head_mean(),
        }
        for name, want in expected.items():
            if name not in data:
                continue
            got = data[name]
            flat_want = want.flatten().tolist()
            rows = got if want.ndim == 1 else None
            if want.ndim == 2 and isinstance(got, list) and len(got) == want.shape[0]:
                if all(isinstance(r, list) and len(r) == want.shape[1] for r in got):
                    rows = [v for r in got for v in r]
            if not isinstance(rows, list) or len(rows) != len(flat_want):
                raise fail(
                    name,
                    f"must be a list of shape {tuple(want.shape)} (as recomputed from 'aad'/"
                    f"'naad'), got {_short(got)}",
                )
            for k, (value, target) in enumerate(zip(rows, flat_want, strict=True)):
                index = (
                    f"[{k}]" if want.ndim == 1 else f"[{k // want.shape[1]}][{k % want.shape[1]}]"
                )
                if value is None:
                    if math.isnan(target):
                        continue
                    raise fail(
                        f"{name}{index}",
                        f"is null but the per-position arrays give {target:.6g}",
                    )
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise fail(f"{name}{index}", f"must be a number or null, got {value!r}")
                if not math.isfinite(value):
                    raise fail(
                        f"{name}{index}",
                        f"must be a finite number (null where undefined), got {value!r}",
                    )
                if math.isnan(target) or not math.isclose(
                    value, target, rel_tol=1e-4, abs_tol=1e-6
                ):
                    raise fail(
                        f"{name}{index}",
                        f"is {value!r} but the per-position arrays give {target:.6g}: the "
                        "summaries are recomputed from 'aad'/'naad', edit those",
                    )

    def to_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as JSON (``NaN`` as ``null``)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> "AADProfile":
        """Read a profile written by :meth:`to_json`.

        Raises:
            FileNotFoundError: If ``path`` does not exist.
            InputError: If the file is not JSON or a field is invalid (see :meth:`from_dict`),
                naming the file and the field.
        """
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise InputError(f"AAD profile {path} is not valid JSON: {error}") from error
        return cls.from_dict(data, source=str(path))


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_positions(values: Any, name: str, fail: Any) -> Tensor:
    """A ``(layers, heads, positions)`` float tensor from nested lists, ``null`` -> ``NaN``."""
    shape: list[int | None] = [None, None, None]

    def walk(node: Any, depth: int, index: str) -> Any:
        if depth < 3:
            if not isinstance(node, list) or not node:
                raise fail(
                    f"{name}{index}",
                    f"must be a non-empty list (the array is (layers, heads, positions)), got "
                    f"{_short(node)}",
                )
            if shape[depth] is None:
                shape[depth] = len(node)
            elif len(node) != shape[depth]:
                raise fail(
                    f"{name}{index}",
                    f"has {len(node)} entries but the others at this level have {shape[depth]}",
                )
            return [walk(child, depth + 1, f"{index}[{i}]") for i, child in enumerate(node)]
        if node is None:
            return math.nan
        if isinstance(node, bool) or not isinstance(node, int | float):
            raise fail(f"{name}{index}", f"must be a number or null, got {_short(node)}")
        if not math.isfinite(node) or node < 0:
            raise fail(
                f"{name}{index}",
                f"must be a finite number >= 0 or null (undefined), got {node!r}",
            )
        return node

    return torch.tensor(walk(values, 0, ""), dtype=torch.float32)


class AADAccumulator:
    """Sums AAD over batches per layer, head and real position, and turns them into a profile.

    Args:
        normalize: Normalisation of the profile's ``naad``: ``"position"`` or ``"max"``.
        sink_tokens: Sink keys to leave out (see :func:`average_attention_distance`).
        renormalize: Rescale the weights left after removing sinks.

    Raises:
        ValueError: If an option is invalid.

    Examples:
        >>> acc = AADAccumulator()
        >>> uniform = torch.tril(torch.ones(3, 3)) / torch.arange(1, 4)[:, None]
        >>> acc.update([uniform[None, None], torch.eye(3)[None, None]])
        >>> acc.compute().layer_mean().tolist()
        [0.5, 0.0]
    """

    def __init__(
        self,
        normalize: Literal["position", "max"] = "position",
        sink_tokens: int = 0,
        renormalize: bool = True,
    ) -> None:
        _check_options(normalize, sink_tokens)
        if normalize == "none":
            raise InputError("normalize must be 'position' or 'max' for a profile, got 'none'")
        self.normalize = normalize
        self.sink_tokens = sink_tokens
        self.renormalize = renormalize
        self.reset()

    def reset(self) -> None:
        """Forget everything accumulated."""
        self.sums: dict[str, Tensor] = {}
        self.num_batches = 0

    def _add(self, name: str, values: Tensor) -> None:
        """Add a ``(layers, heads, positions)`` tensor, growing the position axis as needed."""
        current = self.sums.get(name)
        if current is None:
            self.sums[name] = values.clone()
            return
        if current.shape[:2] != values.shape[:2]:
            raise InputError(
                f"attentions have (layers, heads) = {tuple(values.shape[:2])}, but earlier batches "
                f"had {tuple(current.shape[:2])}"
            )
        length = max(current.shape[-1], values.shape[-1])
        grown = current.new_zeros(*current.shape[:2], length)
        grown[..., : current.shape[-1]] += current
        grown[..., : values.shape[-1]] += values
        self.sums[name] = grown

    @torch.no_grad()
    def update(self, attentions: Sequence[Tensor], attention_mask: Tensor | None = None) -> None:
        """Add one batch: one ``(batch, heads, T, T)`` tensor per layer, and its mask."""
        if not attentions:
            raise InputError("attentions is empty: run the model with output_attentions=True")
        first = attentions[0]
        batch, length = first.shape[0], first.shape[-1]
        pos = _real_positions(attention_mask, batch, length, first.device)
        options = {"sink_tokens": self.sink_tokens, "renormalize": self.renormalize}
        per_layer: dict[str, list[Tensor]] = {"aad": [], "aad_n": [], "naad": [], "naad_n": []}
        for attn in attentions:
            for name, normalize in (("aad", "none"), ("naad", self.normalize)):
                values = average_attention_distance(
                    attn, attention_mask, normalize=normalize, **options
                )
                total, count = _sum_by_position(values, pos, length)
                per_layer[name].append(total)
                per_layer[f"{name}_n"].append(count)
        for name, tensors in per_layer.items():
            self._add(name, torch.stack(tensors).cpu().double())
        real = pos[pos >= 0].cpu()
        sequences = torch.zeros(length, dtype=torch.float64).index_add_(
            0, real, torch.ones(real.numel(), dtype=torch.float64)
        )
        self._add("sequences", sequences[None, None])
        self.num_batches += 1

    def compute(self, metadata: dict[str, Any] | None = None) -> AADProfile:
        """The profile of everything seen since the last :meth:`reset`.

        Raises:
            RuntimeError: If no batch was added.
        """
        if not self.sums:
            raise RuntimeError("AADAccumulator.compute() called before any update()")

        def mean(total: Tensor, count: Tensor) -> Tensor:
            return (total / count).where(count > 0, math.nan).float()

        info = {"num_batches": self.num_batches, **(metadata or {})}
        return AADProfile(
            aad=mean(self.sums["aad"], self.sums["aad_n"]),
            naad=mean(self.sums["naad"], self.sums["naad_n"]),
            counts=self.sums["sequences"][0, 0].long(),
            normalize=self.normalize,
            sink_tokens=self.sink_tokens,
            renormalize=self.renormalize,
            metadata=info,
        )

    def state_dict(self) -> dict[str, Any]:
        """The running sums and settings, for checkpoints."""
        return {
            "sums": {k: v.clone() for k, v in self.sums.items()},
            "num_batches": self.num_batches,
            "normalize": self.normalize,
            "sink_tokens": self.sink_tokens,
            "renormalize": self.renormalize,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.__init__(state["normalize"], state["sink_tokens"], state["renormalize"])
        self.sums = {k: v.clone() for k, v in state["sums"].items()}
        self.num_batches = int(state["num_batches"])
