"""The layer of :class:`~ada_modules.kv.AdaKVQCache`: a packed KIVI layer whose flushed blocks
may get their own bit widths from the long-range demand, within a running bit budget (the dynamic
part of AdaKVQ, described in :mod:`ada_modules.kv.adakvq`)."""

import math
from collections.abc import Sequence
from numbers import Real
from typing import Any, Literal

import torch

from ada_modules.errors import InputError
from ada_modules.kernels.kv_quant import SUPPORTED_BITS, dequantize, packed_words
from ada_modules.kv.quantized_layer import QuantizedKVLayer, check_bits

__all__ = [
    "DEMAND_NORMALIZATIONS",
    "DEMAND_SOURCES",
    "AdaKVQLayer",
    "block_bits_per_element",
    "check_dynamic_options",
]

DEMAND_SOURCES: tuple[str, ...] = ("auto", "key_proxy")
"""How dynamic layers measure a block's long-range demand (see :mod:`ada_modules.kv.adakvq`)."""
DEMAND_NORMALIZATIONS: tuple[str, ...] = ("uniform", "none")
"""How the far mass is normalised (see :mod:`ada_modules.kv.adakvq`)."""
_EPS = 1e-9


def block_bits_per_element(
    key_bits: int,
    value_bits: int,
    head_dim: int,
    key_group_size: int,
    value_group_size: int,
    dtype: torch.dtype,
) -> float:
    """Exact stored bits per cached element of a packed block (codes + scale + zero point).

    The mean over the block's keys and values, as :meth:`QuantizedKVLayer.nbytes` counts them:
    ``packed_words(head_dim, bits)`` int32 words per token and head, and one scale and one zero
    point of ``dtype`` per group.

    Examples:
        >>> block_bits_per_element(2, 2, 128, 32, 32, torch.float16)  # 2 + 32 / 32
        3.0
        >>> block_bits_per_element(3, 4, 16, 16, 16, torch.float32)  # 3 bits use 2 words at d=16
        8.0
    """
    meta = 2 * torch.empty((), dtype=dtype).element_size() * 8
    key = packed_words(head_dim, key_bits) * 32 / head_dim + meta / key_group_size
    value = packed_words(head_dim, value_bits) * 32 / head_dim + meta / value_group_size
    return (key + value) / 2


def check_dynamic_options(
    dynamic_bits: Any,
    demand: Any,
    thresholds: Any,
    threshold_mode: Any,
    ema_decay: Any,
    normalization: Any,
) -> tuple[tuple[int, ...], tuple[float, float], float]:
    """Validate the dynamic options; return the ladder, ``(low, high)`` and the decay."""
    if isinstance(dynamic_bits, str | bytes) or not isinstance(dynamic_bits, Sequence):
        raise InputError(
            f"dynamic_bits must be a non-empty list of widths from {SUPPORTED_BITS}, got "
            f"{dynamic_bits!r} ({type(dynamic_bits).__name__})"
        )
    if not dynamic_bits:
        raise InputError(f"dynamic_bits must not be empty, got {dynamic_bits!r}")
    for b in dynamic_bits:
        check_bits("dynamic_bits", b)
    ladder = tuple(sorted({int(b) for b in dynamic_bits}))
    if demand not in DEMAND_SOURCES:
        raise InputError(f"demand must be one of {DEMAND_SOURCES}, got {demand!r}")
    if threshold_mode not in ("relative", "absolute"):
        raise InputError(f"threshold_mode must be 'relative' or 'absolute', got {threshold_mode!r}")
    if (
        isinstance(thresholds, str | bytes)
        or not isinstance(thresholds, Sequence)
        or len(thresholds) != 2
        or any(isinstance(t, bool) or not isinstance(t, Real) for t in thresholds)
        or not all(math.isfinite(t) for t in thresholds)
        or not 0 <= thresholds[0] <= thresholds[1]
    ):
        raise InputError(
            f"thresholds must be (low, high), two finite numbers with 0 <= low <= high, got "
            f"{thresholds!r}"
        )
    if isinstance(ema_decay, bool) or not isinstance(ema_decay, Real) or not 0 <= ema_decay < 1:
        raise InputError(f"ema_decay must be a number in [0, 1), got {ema_decay!r}")
    if normalization not in DEMAND_NORMALIZATIONS:
        raise InputError(
            f"normalization must be one of {DEMAND_NORMALIZATIONS}, got {normalization!r}"
        )
    return ladder, (float(thresholds[0]), float(thresholds[1])), float(ema_decay)


def _step(width: int, ladder: Sequence[int], up: bool) -> int:
    """The next width of ``ladder`` above (``up``) or below ``width``; ``width`` at the end."""
    if up:
        return min((b for b in ladder if b > width), default=width)
    return max((b for b in ladder if b < width), default=width)


class AdaKVQLayer(QuantizedKVLayer):
    """A :class:`QuantizedKVLayer` whose flushed blocks may get demand-driven bit widths.

    Built by :class:`AdaKVQCache` with the :class:`QuantizedKVLayer` arguments; it behaves like
    its parent (static widths) until :meth:`enable_dynamic` is called.

    Attributes:
        dynamic: Whether block widths follow the demand.
        block_demand: Measured demand of each flushed block (``None``: not measured), oldest
            first; only filled when ``dynamic``.
        credit: Banked stored bits per element (sum over flushed blocks of static minus actual
            cost); never negative.

    Examples:
        >>> layer = AdaKVQLayer(key_bits=3, value_bits=3, key_group_size=16,
        ...                     value_group_size=16, residual_length=16)
        >>> layer.enable_dynamic(dynamic_bits=(2, 3, 4), demand="key_proxy")
        >>> _ = layer.update(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16))
        >>> len(layer.block_demand), layer.block_demand[0] is None, layer.credit >= 0
        (4, True, True)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dynamic = False
        self.records_decode_lse = False
        self.dynamic_bits: tuple[int, ...] = SUPPORTED_BITS
        self.demand: str = "auto"
        self.normalization: str = "uniform"
        self.threshold_mode: str = "relative"
        self.thresholds: tuple[float, float] = (0.8, 1.25)
        self.ema_decay = 0.9
        self._clear_dynamic_state()

    def _clear_dynamic_state(self) -> None:
        self.block_demand: list[float | None] = []
        self.credit = 0.0
        self._ema: dict[str, float] = {}
        self._lse_sum: torch.Tensor | float = 0.0
        self._lse_steps = 0
        self._flush_keys: torch.Tensor | None = None
        self._packed_history: torch.Tensor | None = None
        self._flush_first = 0
        self._attended_history = 0

    def enable_dynamic(
        self,
        dynamic_bits: Sequence[int] = SUPPORTED_BITS,
        demand: Literal["auto", "key_proxy"] = "auto",
        thresholds: tuple[float, float] = (0.8, 1.25),
        threshold_mode: Literal["relative", "absolute"] = "relative",
        ema_decay: float = 0.9,
        normalization: Literal["uniform", "none"] = "uniform",
    ) -> None:
        """Let this layer's block widths follow the demand (see :mod:`ada_modules.kv.adakvq`).

        Args:
            dynamic_bits: The ladder of widths blocks step along.
            demand: ``"auto"`` or ``"key_proxy"``.
            thresholds: ``(low, high)``: below ``low`` the block steps down, above ``high`` up.
            threshold_mode: ``"relative"`` (to the moving average of earlier demands) or
                ``"absolute"`` (far-mass fractions).
            ema_decay: Decay of the moving average, in ``[0, 1)``.
            normalization: ``"uniform"`` (far mass over that of uniform attention) or ``"none"``.

        Raises:
            ValueError: If an argument is out of range, naming it.
        """
        ladder, (low, high), ema_decay = check_dynamic_options(
            dynamic_bits, demand, thresholds, threshold_mode, ema_decay, normalization
        )
        self.normalization = normalization
        self.dynamic = True
        self.dynamic_bits = ladder
        self.demand = demand
        self.records_decode_lse = demand == "auto"
        self.thresholds = (low, high)
        self.threshold_mode = threshold_mode
        self.ema_decay = ema_decay

    # ------------------------------------------------------------------------------------------
    # Demand
    # ------------------------------------------------------------------------------------------

    def observe_decode_lse(self, lse: torch.Tensor) -> None:
        """Record one decode step's far attention mass (the mass outside the residual window).

        Args:
            lse: ``(batch, heads, segments + 1)`` per-segment log-sum-exps, the window last.
        """
        if lse.shape[-1] < 2 or not self._attended_history:
            return  # no packed history yet: nothing far to measure
        near = (lse[..., -1] - lse.logsumexp(-1)).exp()
        far = (1 - near).float().mean()  # stays on the device: no sync per decode step
        if self.normalization == "uniform":
            far = far * (self.cumulative_length / self._attended_history)
        self._lse_sum = self._lse_sum + far
        self._lse_steps += 1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`QuantizedKVLayer.update`; also notes the packed tokens attention sees."""
        self._attended_history = len(self.block_bits) * self.residual_length
        return super().update(key_states, value_states, *args, **kwargs)

    def _key_proxy_demand(self, block_index: int, keys: torch.Tensor) -> float | None:
        """Far mass of the block's keys used as queries over the history and the block."""
        if self._packed_history is None:  # dequantized once per flush, shared by its blocks
            parts = [dequantize(s.keys, impl=self.impl) for s in self.segments]
            self._packed_history = torch.cat(parts, dim=-2) if parts else keys[..., :0, :]
        history = self._packed_history
        if self._flush_keys is not None:
            offset = (block_index - self._flush_first) * self.residual_length
            history = torch.cat([history, self._flush_keys[..., :offset, :]], dim=-2)
        if history.shape[-2] == 0:
            return None
        q = keys.float()
        scale = keys.shape[-1] ** -0.5
        far = q @ history.float().transpose(-1, -2) * scale
        near = q @ q.transpose(-1, -2) * scale
        causal = torch.ones(near.shape[-2:], dtype=torch.bool, device=near.device).tril()
        near = near.masked_fill(~causal, float("-inf"))
        far_lse, near_lse = far.logsumexp(-1), near.logsumexp(-1)
        mass = (far_lse - torch.logaddexp(far_lse, near_lse)).exp()
        if self.normalization == "uniform":
            n = history.shape[-2]
            visible = n + torch.arange(1, keys.shape[-2] + 1, device=mass.device)
            mass = mass * visible / n
        return float(mass.mean())

    def _measure(self, block_index: int, keys: torch.Tensor) -> tuple[str, float | None]:
        if self.demand == "auto" and self._lse_steps:
            demand = float(self._lse_sum) / self._lse_steps
            self._lse_sum, self._lse_steps = 0.0, 0
            return "decode_lse", demand
        return "key_proxy", self._key_proxy_demand(block_index, keys)

    # ------------------------------------------------------------------------------------------
    # Bits
    # ------------------------------------------------------------------------------------------

    def _cost(self, bits: tuple[int, int], head_dim: int, dtype: torch.dtype) -> float:
        return block_bits_per_element(
            bits[0], bits[1], head_dim, self.key_group_size, self.value_group_size, dtype
        )

    def choose_block_bits(
        self, block_index: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[int, int]:
        """The layer's widths, or one step down/up the ladder by demand (when ``dynamic``)."""
        base = (self.key_bits, self.value_bits)
        if not self.dynamic:
            return base
        source, demand = self._measure(block_index, keys)
        self.block_demand.append(demand)
        if demand is None:
            return base
        low, high = self.thresholds
        if self.threshold_mode == "relative":
            ref = self._ema.get(source)
            self._ema[source] = (
                demand if ref is None else self.ema_decay * ref + (1 - self.ema_decay) * demand
            )
            if ref is None:
                return base
            low, high = low * ref, high * ref
        head_dim, dtype = keys.shape[-1], keys.dtype
        static = self._cost(base, head_dim, dtype)
        ladder = self.dynamic_bits
        if demand < low:
            choice = (_step(base[0], ladder, False), _step(base[1], ladder, False))
        elif demand > high:
            up_k, up_v = _step(base[0], ladder, True), _step(base[1], ladder, True)
            choice = base
            for candidate in ((up_k, up_v), (up_k, base[1]), (base[0], up_v)):
                if self._cost(candidate, head_dim, dtype) - static <= self.credit + _EPS:
                    choice = candidate
                    break
        else:
            choice = base
        self.credit += static - self._cost(choice, head_dim, dtype)
        return choice

    def _flush(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        # Keep the blocks of this flush visible to the key proxy of the later ones.
        self._flush_keys, self._flush_first = keys, len(self.block_bits)
        try:
            super()._flush(keys, values)
        finally:
            self._flush_keys = self._packed_history = None

    # ------------------------------------------------------------------------------------------
    # Accounting
    # ------------------------------------------------------------------------------------------

    def packed_nbytes(self) -> int:
        """Exact bytes of the packed history (codes + scales + zero points, no residual)."""
        return sum(s.nbytes() for s in self.segments)

    def static_nbytes(self) -> int:
        """Bytes the packed history would take at the layer's static widths (same blocks)."""
        if not self.segments:
            return 0
        batch, kv_heads, _, head_dim = self.keys.shape
        elements = 2 * batch * kv_heads * len(self.block_bits) * self.residual_length * head_dim
        bits = self._cost((self.key_bits, self.value_bits), head_dim, self.keys.dtype)
        return round(bits * elements / 8)

    def reset(self) -> None:
        """Drop every token and the demand/budget state; the next update starts afresh."""
        super().reset()
        self._clear_dynamic_state()
