"""Per-layer KV-cache bit widths from an AAD profile under an average-bit budget (AdaKVQ, static).

Cost. A slot (the keys or the values of one layer) quantized to ``b`` bits in groups of ``G``
elements, each group storing a scale and a zero point (``metadata_bits``, default 2 x fp16 = 32),
costs::

    bits_per_element(b) = b + metadata_bits / G                              # residual excluded
    bits_per_element(b) = ((T - R) (b + metadata_bits / G) + R * fp_bits) / T  # residual included

The budget is the mean of this cost over all slots. By default the full-precision residual window
of ``R`` tokens is left out: it is the same for every allocation and vanishes as the cache grows.
Give ``residual_length`` and ``seq_len`` to budget a cache of exactly ``seq_len`` tokens instead.

Distortion (our reconstruction of "bits guided by long-range retrieval demand"). Uniform
quantization of a value range ``r`` with ``b`` bits has mean squared error ``r^2 2^(-2b) / 12``, so
slot ``i`` of layer ``l`` gets::

    D_i(b) = w_l * c_i * 2^(-2b),   w_l = (AAD_l + std_weight * sigma_l)^gamma / sum_l (...)

with ``c_i`` = ``key_weight`` or ``value_weight``. The allocator minimises ``sum_i D_i(b_i)``
subject to ``mean_i cost(b_i) <= budget`` (a multiple-choice knapsack): ``"dp"`` solves it exactly
by dynamic programming over integer cost units, ``"greedy"`` upgrades the slot with the best
distortion drop per extra bit while the budget allows. ``"reverse"`` and ``"random"`` are the
baselines: they take the exact allocation's bit widths and give them to the layers in inverted
importance order, or in a random order (same multiset of widths, hence exactly the same average
bits). Any per-slot distortion table (e.g. a measured attention-output MSE) can be solved directly
with :func:`solve_allocation`.
"""

import itertools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any, Literal

from ada_modules.errors import InputError
from ada_modules.kernels.kv_quant import packed_words
from ada_modules.kv.aad import AADProfile

__all__ = [
    "ALLOCATION_METHODS",
    "SUPPORTED_BITS",
    "BitAllocation",
    "allocate_bits",
    "bits_per_element",
    "solve_allocation",
]

SUPPORTED_BITS: tuple[int, ...] = (2, 3, 4, 8)
"""Bit widths the KV quantization kernels implement."""
ALLOCATION_METHODS: tuple[str, ...] = ("dp", "greedy", "reverse", "random")
"""Methods of :func:`allocate_bits`."""
_MAX_COST_SCALE = 4096


def _check_bits(bit_widths: Sequence[int], name: str = "bit_widths") -> None:
    if (
        isinstance(bit_widths, str | bytes)
        or not isinstance(bit_widths, Sequence)
        or not bit_widths
        or any(
            isinstance(b, bool) or not isinstance(b, int) or b not in SUPPORTED_BITS
            for b in bit_widths
        )
    ):
        shown = list(bit_widths) if isinstance(bit_widths, list | tuple) else bit_widths
        raise InputError(
            f"{name} must be taken from {SUPPORTED_BITS} (a non-empty list of ints), got {shown!r}"
        )


def _check_real(name: str, value: Any, allowed: str, ok: bool = True) -> None:
    """Raise naming ``name`` unless ``value`` is a finite real number (not a bool) and ``ok``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or not ok:
        raise InputError(f"{name} must be {allowed}, got {value!r}")


def bits_per_element(
    bits: int,
    group_size: int = 32,
    metadata_bits: int = 32,
    residual_length: int = 0,
    seq_len: int | None = None,
    fp_bits: int = 16,
    head_dim: int | None = None,
) -> float:
    """Stored bits per cached element at ``bits`` bits, metadata amortised over the group.

    Args:
        bits: Code width, one of :data:`SUPPORTED_BITS`.
        group_size: Elements sharing one scale and zero point (``G``).
        metadata_bits: Bits of metadata per group (scale + zero point; 32 for two fp16 values).
        residual_length: Tokens kept in full precision (``R``); counted only with ``seq_len``.
        seq_len: Cache length ``T`` to budget for; ``None`` leaves the residual window out.
        fp_bits: Bits per element of the residual window.
        head_dim: Channels per head; when given, the code bits are what packing into int32
            words really takes (3-bit codes of 16 channels fill two words, i.e. 4 bits each);
            ``None`` counts exactly ``bits``.

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> bits_per_element(2, group_size=32)
        3.0
        >>> bits_per_element(2, group_size=32, residual_length=32, seq_len=1024)
        3.40625
        >>> bits_per_element(3, group_size=16, head_dim=16)  # 2 words for 16 codes, + 32/16
        6.0
    """
    _check_bits([bits], "bits")
    for name, value, low in (
        ("group_size", group_size, 1),
        ("metadata_bits", metadata_bits, 0),
        ("residual_length", residual_length, 0),
        ("fp_bits", fp_bits, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    code_bits: float = bits
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise InputError(f"head_dim must be an integer >= 1, got {head_dim!r}")
        code_bits = packed_words(head_dim, bits) * 32 / head_dim
    quantized = code_bits + metadata_bits / group_size
    if seq_len is None:
        return quantized
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < residual_length:
        raise InputError(f"seq_len must be an integer >= residual_length, got {seq_len!r}")
    if seq_len == 0:
        raise InputError("seq_len must be positive, got 0")
    return ((seq_len - residual_length) * quantized + residual_length * fp_bits) / seq_len


def _integer_costs(costs: Sequence[float]) -> tuple[list[int], int]:
    """Smallest integer scale that makes every cost an integer (within 1e-9)."""
    for scale in range(1, _MAX_COST_SCALE + 1):
        scaled = [c * scale for c in costs]
        if all(abs(s - round(s)) < 1e-9 for s in scaled):
            return [round(s) for s in scaled], scale
    raise InputError(
        f"costs {list(costs)!r} are not multiples of 1/{_MAX_COST_SCALE}: use method='greedy'"
    )


def solve_allocation(
    distortion: Sequence[Sequence[float]],
    costs: Sequence[float],
    budget: float,
    method: Literal["dp", "greedy", "brute_force"] = "dp",
) -> list[int]:
    """Pick one option per slot minimising total distortion under a mean-cost budget.

    Args:
        distortion: ``distortion[i][k]``: distortion of slot ``i`` with option ``k``.
        costs: ``costs[k]``: cost of option ``k`` (the same for every slot), e.g. bits per element.
        budget: Upper bound on the mean cost over slots.
        method: ``"dp"`` (exact multiple-choice knapsack over integer cost units), ``"greedy"``
            (best distortion drop per unit of extra cost, from the cheapest option up) or
            ``"brute_force"`` (exact by enumeration; for checking, ``<= 8`` slots).

    Returns:
        The chosen option index of each slot. Ties go to the cheaper option, then to the earlier
        slot.

    Raises:
        ValueError: If the budget is below the cheapest option, shapes disagree or the method
            is unknown.

    Examples:
        >>> solve_allocation([[4.0, 1.0], [1.0, 0.5]], costs=[2, 3], budget=2.5)
        [1, 0]
    """
    num_options = len(costs)
    if not distortion or any(len(row) != num_options for row in distortion):
        raise InputError(
            f"distortion must be a non-empty list of rows of {num_options} values (one per cost)"
        )
    if budget < min(costs) - 1e-12:
        raise InputError(f"budget={budget} is below the cheapest option's cost {min(costs)}")
    slots = len(distortion)
    capacity = budget * slots
    if method == "brute_force":
        if slots > 8:
            raise InputError(f"brute_force is for <= 8 slots, got {slots}")
        best: tuple[float, float, tuple[int, ...]] | None = None
        for choice in itertools.product(range(num_options), repeat=slots):
            total_cost = sum(costs[k] for k in choice)
            if total_cost > capacity + 1e-9:
                continue
            key = (sum(distortion[i][k] for i, k in enumerate(choice)), total_cost, choice)
            if best is None or key < best:
                best = key
        assert best is not None  # the all-cheapest choice always fits
        return list(best[2])
    if method == "greedy":
        choice = [min(range(num_options), key=lambda k: (costs[k], row[k])) for row in distortion]
        spent = sum(costs[k] for k in choice)
        while True:
            best_move: tuple[float, int, int] | None = None
            for i, row in enumerate(distortion):
                for k in range(num_options):
                    extra = costs[k] - costs[choice[i]]
                    gain = row[choice[i]] - row[k]
                    if extra <= 0 or gain <= 0 or spent + extra > capacity + 1e-9:
                        continue
                    ratio = gain / extra
                    if best_move is None or ratio > best_move[0]:
                        best_move = (ratio, i, k)
            if best_move is None:
                return choice
            _, i, k = best_move
            spent += costs[k] - costs[choice[i]]
            choice[i] = k
    if method != "dp":
        raise InputError(f"method must be 'dp', 'greedy' or 'brute_force', got {method!r}")
    units, scale = _integer_costs(costs)
    # no choice costs more than every slot at its dearest: a larger budget changes nothing
    cap = min(math.floor(capacity * scale + 1e-9), len(distortion) * max(units))
    # best[c] = (distortion, choices) over the slots so far with total cost units exactly c.
    inf = math.inf
    table: list[float] = [0.0] + [inf] * cap
    back: list[list[int]] = []
    for row in distortion:
        new = [inf] * (cap + 1)
        pick = [-1] * (cap + 1)
        for c in range(cap + 1):
            if table[c] == inf:
                continue
            for k in sorted(range(num_options), key=lambda k: units[k]):
                d = c + units[k]
                if d <= cap and table[c] + row[k] < new[d] - 1e-15:
                    new[d], pick[d] = table[c] + row[k], k
        table = new
        back.append(pick)
    # Lowest distortion; among equal ones, the cheapest.
    end = min(range(cap + 1), key=lambda c: (table[c], c))
    choice = []
    for pick in reversed(back):
        k = pick[end]
        choice.append(k)
        end -= units[k]
    return choice[::-1]


@dataclass
class BitAllocation:
    """Bit widths of the keys and values of each layer, and how they were chosen.

    Attributes:
        key_bits: Code width of each layer's keys.
        value_bits: Code width of each layer's values.
        group_size: Quantization group size ``G`` the costs were computed with.
        metadata_bits: Metadata bits per group.
        budget: Average bits-per-element budget (``None`` for a hand-made allocation).
        method: How the widths were chosen (``"dp"``, ``"greedy"``, ``"reverse"``, ``"random"``,
            ``"uniform"``).
        importance: The per-layer weights ``w_l`` used (empty for ``"uniform"``).
        residual_length: ``R`` counted in the budget (with ``seq_len``).
        seq_len: Cache length the budget was computed for (``None``: residual excluded).
        head_dim: Channels per head the packing cost was computed for (``None``: exact bits).

    Examples:
        >>> alloc = BitAllocation.uniform(num_layers=2, bits=4)
        >>> alloc.average_bits()
        5.0
        >>> BitAllocation.from_dict(alloc.to_dict()) == alloc
        True
    """

    key_bits: list[int]
    value_bits: list[int]
    group_size: int = 32
    metadata_bits: int = 32
    budget: float | None = None
    method: str = "uniform"
    importance: list[float] = field(default_factory=list)
    residual_length: int = 0
    seq_len: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        _check_bits(self.key_bits, "key_bits")
        _check_bits(self.value_bits, "value_bits")
        if len(self.key_bits) != len(self.value_bits):
            raise InputError(
                f"key_bits and value_bits must have one entry per layer, got "
                f"{len(self.key_bits)} and {len(self.value_bits)}"
            )

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.key_bits)

    @classmethod
    def uniform(
        cls, num_layers: int, bits: int, group_size: int = 32, metadata_bits: int = 32
    ) -> "BitAllocation":
        """The same width for every layer's keys and values."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise InputError(f"num_layers must be a positive integer, got {num_layers!r}")
        return cls([bits] * num_layers, [bits] * num_layers, group_size, metadata_bits)

    def average_bits(self) -> float:
        """Mean stored bits per element over all key and value slots, metadata included."""
        per_slot = [
            bits_per_element(
                b,
                self.group_size,
                self.metadata_bits,
                self.residual_length,
                self.seq_len,
                head_dim=self.head_dim,
            )
            for b in self.key_bits + self.value_bits
        ]
        return sum(per_slot) / len(per_slot)

    def check_num_layers(self, num_layers: int) -> None:
        """Raise ``ValueError`` unless the allocation has ``num_layers`` layers (the model's)."""
        if num_layers != self.num_layers:
            raise InputError(
                f"the bit allocation has {self.num_layers} layers but the model has "
                f"num_layers={num_layers}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with ``average_bits`` added for readers."""
        return {**asdict(self), "average_bits": self.average_bits()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BitAllocation":
        """Inverse of :meth:`to_dict` (``average_bits`` is recomputed, not read)."""
        known = {k: v for k, v in data.items() if k != "average_bits"}
        return cls(**known)

    def to_json(self, path: str | Path) -> None:
        """Write :meth:`to_dict` as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> "BitAllocation":
        """Read an allocation written by :meth:`to_json`."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def _layer_values(profile: AADProfile | Sequence[float], std_weight: float) -> list[float]:
    if isinstance(profile, AADProfile):
        mean = profile.layer_mean().tolist()
        std = profile.layer_std().tolist() if std_weight else [0.0] * len(mean)
        values = [m + std_weight * s for m, s in zip(mean, std, strict=True)]
    else:
        if std_weight:
            raise InputError("std_weight needs an AADProfile (per-layer values have no sigma_l)")
        values = [float(v) for v in profile]
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise InputError(f"per-layer AAD values must be finite and >= 0, got {values!r}")
    return values


def allocate_bits(
    profile: AADProfile | Sequence[float],
    budget: float,
    *,
    method: Literal["dp", "greedy", "reverse", "random"] = "dp",
    bit_widths: Sequence[int] = (2, 3, 4),
    num_layers: int | None = None,
    separate_kv: bool = True,
    key_weight: float = 1.0,
    value_weight: float = 1.0,
    gamma: float = 1.0,
    std_weight: float = 0.0,
    group_size: int = 32,
    metadata_bits: int = 32,
    residual_length: int = 0,
    seq_len: int | None = None,
    head_dim: int | None = None,
    seed: int = 0,
) -> BitAllocation:
    """Per-layer key and value bit widths minimising AAD-weighted distortion under a budget.

    Args:
        profile: An :class:`~ada_modules.kv.AADProfile` (its normalised ``layer_mean`` and
            ``layer_std`` are used) or one AAD value per layer.
        budget: Mean bits per element over all key and value slots, metadata included (see
            :func:`bits_per_element`).
        method: ``"dp"`` (exact), ``"greedy"``, or the same-bits baselines ``"reverse"`` (widths
            of the exact solution given in inverted importance order) and ``"random"``.
        bit_widths: Allowed widths, a subset of :data:`SUPPORTED_BITS`.
        num_layers: The model's layer count; checked against the profile when given.
        separate_kv: Allow different widths for a layer's keys and values; otherwise both get the
            same width (their distortions are added).
        key_weight: ``c`` of the key slots (keys feed the softmax, often more sensitive).
        value_weight: ``c`` of the value slots.
        gamma: Exponent of the importance ``w_l ~ (AAD_l + std_weight sigma_l)^gamma``.
        std_weight: Weight of the position fluctuation ``sigma_l`` in the importance.
        group_size: Quantization group size ``G`` (metadata amortisation).
        metadata_bits: Metadata bits per group.
        residual_length: Full-precision tokens ``R``, counted only with ``seq_len``.
        seq_len: Cache length to budget for (``None``: residual excluded).
        head_dim: Channels per head, to cost each width as packed (see
            :func:`bits_per_element`); ``None`` costs exactly ``bits``.
        seed: Seed of the ``"random"`` baseline's permutation.

    Returns:
        The :class:`BitAllocation`.

    Raises:
        ValueError: For an unknown bit width or method, a budget below the cheapest width, a
            profile whose layer count differs from ``num_layers``, or bad weights.

    Examples:
        >>> alloc = allocate_bits([0.1, 0.2, 0.6, 0.5], budget=4.0, group_size=32)
        >>> alloc.key_bits, alloc.value_bits
        ([2, 3, 4, 3], [2, 3, 4, 3])
        >>> alloc.average_bits()
        4.0
        >>> allocate_bits([0.1, 0.2, 0.6, 0.5], budget=4.0, method="reverse").key_bits
        [4, 3, 2, 3]
    """
    _check_bits(bit_widths)
    if method not in ALLOCATION_METHODS:
        raise InputError(f"method must be one of {ALLOCATION_METHODS}, got {method!r}")
    _check_real("budget", budget, "a finite number (mean stored bits per element)")
    for name, value in (("key_weight", key_weight), ("value_weight", value_weight)):
        _check_real(name, value, "a finite number > 0", isinstance(value, Real) and value > 0)
    for name, value in (("gamma", gamma), ("std_weight", std_weight)):
        _check_real(name, value, "a finite number >= 0", isinstance(value, Real) and value >= 0)
    values = _layer_values(profile, std_weight)
    if num_layers is not None and num_layers != len(values):
        raise InputError(
            f"the AAD profile has {len(values)} layers but the model has num_layers={num_layers}"
        )
    widths = sorted(set(bit_widths))
    costs = [
        bits_per_element(b, group_size, metadata_bits, residual_length, seq_len, head_dim=head_dim)
        for b in widths
    ]
    if budget < costs[0] - 1e-12:
        raise InputError(
            f"budget={budget} is below the cheapest width: {widths[0]} bits cost {costs[0]} bits "
            f"per element with group_size={group_size}, metadata_bits={metadata_bits}"
        )
    raw = [v**gamma for v in values]
    total = sum(raw)
    importance = [r / total for r in raw] if total > 0 else [1 / len(raw)] * len(raw)
    mse = [2.0 ** (-2 * b) for b in widths]
    if separate_kv:
        distortion = [
            [w * c * m for m in mse] for w in importance for c in (key_weight, value_weight)
        ]
    else:
        distortion = [[w * (key_weight + value_weight) * m for m in mse] for w in importance]
    solver = "greedy" if method == "greedy" else "dp"
    choice = [widths[k] for k in solve_allocation(distortion, costs, budget, solver)]
    if separate_kv:
        key_bits, value_bits = choice[0::2], choice[1::2]
    else:
        key_bits, value_bits = list(choice), list(choice)
    if method in ("reverse", "random"):
        # Same widths, other layers: reverse maps the i-th most important layer to the
        # widths of the i-th least important one; random uses a seeded permutation.
        by_importance = sorted(range(len(values)), key=lambda i: (-importance[i], i))
        if method == "reverse":
            targets = by_importance[::-1]
        else:
            targets = by_importance[:]
            random.Random(seed).shuffle(targets)
        new_key, new_value = [0] * len(values), [0] * len(values)
        for source, target in zip(by_importance, targets, strict=True):
            new_key[target], new_value[target] = key_bits[source], value_bits[source]
        key_bits, value_bits = new_key, new_value
    return BitAllocation(
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=group_size,
        metadata_bits=metadata_bits,
        budget=budget,
        method=method,
        importance=importance,
        residual_length=residual_length if seq_len is not None else 0,
        seq_len=seq_len,
        head_dim=head_dim,
    )
