"""AdaKVQ: a packed KV cache with per-layer bits from an AAD allocation and demand-driven block bits.

AdaKVQ (reconstructed from its abstract; no paper text or code is public) gives each decoder
layer key and value bit widths according to how far the layer attends (its Average Attention
Distance, :mod:`ada_modules.kv.aad`), chosen under an average-bit budget by
:func:`~ada_modules.kv.allocate_bits` (the *static* part), and lets the bits of deep layers move
over positions with their long-range retrieval demand (the *dynamic* part).
:class:`AdaKVQCache` is a :class:`~ada_modules.kv.KIVICache` (packed KIVI storage, full-precision
residual window of ``R`` tokens, history quantized once per block of ``R`` tokens) whose layers are
:class:`AdaKVQLayer`.

**Static part.** Layer ``l`` stores its keys at ``allocation.key_bits[l]`` and its values at
``allocation.value_bits[l]`` bits. The allocation comes from a :class:`~ada_modules.kv.BitAllocation`
(an object, a dict, or the JSON file written by ``BitAllocation.to_json``), from inline per-layer
lists, or from an AAD profile with :meth:`AdaKVQCache.from_profile`.

**Dynamic part (reconstruction; every choice below is an argument).** In the *dynamic layers*
(``dynamic_layers``: explicit indices, or the top fraction of layers by the allocation's importance
weights ``w_l``, i.e. the layers the AAD profile marks as long-range; the deepest layers when the
allocation has no weights) each block of ``R`` tokens leaving the residual window gets its own
widths:

1. *Demand* ``d`` of the block = the far attention mass of the queries in the window, where
   "far" means the packed history (everything before the window):

   * ``"auto"`` (default): when the attention function is ``"quantized_kv"``, every decode step
     hands the layer its per-segment log-sum-exps (``observe_decode_lse``); the far mass of a step
     is ``1 - softmax(lse)[window]`` (real queries, padding masked), averaged over batch, heads and
     the decode steps since the last flush. Blocks flushed without any recorded step (the prefill,
     or another attention function) use the key proxy below.
   * ``"key_proxy"``: the block's own keys stand in for its queries (the queries are not visible
     to a cache): softmax of ``k_i . k_j / sqrt(d)`` over the history (packed, dequantized) and the
     block (causal), far mass = the part on the history, averaged over batch, heads and the
     block's tokens. Pad keys of left-padded rows take part in it (the cache does not see the
     mask). This is a proxy, not the model's attention.

   A block with no history before it has no demand (``None``) and keeps the layer's widths.
   With ``normalization="uniform"`` (default) the far mass ``rho`` of each query is divided by
   what uniform attention would put on the history, ``n_history / n_visible`` (the "lift";
   ``1`` = no preference, ``< 1`` local, ``> 1`` retrieving). Without it, the far mass of any
   head grows with the context length alone, so a relative threshold would read every new block
   as high demand. Left padding is not subtracted from ``n_history`` (the layer does not see the
   mask). ``normalization="none"`` uses the raw far mass.
2. *Decision.* ``threshold_mode="relative"`` (default) compares ``d`` with an exponential moving
   average ``m`` of the layer's earlier demands from the same source (decay ``ema_decay``): high if
   ``d > thresholds[1] * m``, low if ``d < thresholds[0] * m``. ``"absolute"`` compares ``d``
   with the thresholds themselves. A low-demand block steps keys and values one width down the
   ladder ``dynamic_bits``; a high-demand block steps them one width up if the budget allows (both,
   else keys only, else values only, else neither); otherwise the block keeps the layer's widths.
3. *Running budget (leaky bucket).* Each layer banks, in stored bits per element (codes plus fp
   scale and zero point of the block's dtype, exactly as :meth:`QuantizedKVLayer.nbytes` counts
   them), what its blocks saved against the layer's static widths, and spends only what is banked.
   Hence, at every flush, the packed history of each dynamic layer costs at most what the static
   allocation would cost for the same blocks, so the cache's average stored bits never exceed the
   static allocation's (:meth:`AdaKVQLayer.static_nbytes`), which is within the allocation's
   budget when its ``metadata_bits`` matches the cache dtype (32 for fp16/bf16 scale + zero).

Examples:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from ada_modules.kv import BitAllocation
    >>> config = LlamaConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2,
    ...                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    >>> model = LlamaForCausalLM(config).eval()
    >>> allocation = BitAllocation([2, 4], [2, 3], group_size=16, importance=[0.2, 0.8])
    >>> cache = AdaKVQCache(config, allocation, residual_length=16)
    >>> out = model.generate(torch.randint(1, 32, (2, 40)), max_new_tokens=3, do_sample=False,
    ...                      cache=cache, pad_token_id=0)
    >>> cache.dynamic_layers, [(layer.key_bits, layer.value_bits) for layer in cache.layers]
    ([1], [(2, 2), (4, 3)])
    >>> cache.nbytes() < cache.fp_nbytes(), cache.packed_nbytes() <= cache.static_nbytes()
    (True, True)
"""

import math
import os
from collections.abc import Sequence
from numbers import Real
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import Impl
from ada_modules.kernels.kv_quant import SUPPORTED_BITS, dequantize, packed_words
from ada_modules.kv.aad import AADProfile
from ada_modules.kv.bit_allocation import BitAllocation, allocate_bits
from ada_modules.kv.kivi import KIVICache, bits_argument, per_layer_bits
from ada_modules.kv.quantized_layer import QuantizedKVLayer, check_bits, check_group_size

__all__ = [
    "DEMAND_NORMALIZATIONS",
    "DEMAND_SOURCES",
    "AdaKVQCache",
    "AdaKVQLayer",
    "block_bits_per_element",
]

DEMAND_SOURCES: tuple[str, ...] = ("auto", "key_proxy")
"""How dynamic layers measure a block's long-range demand (see the module docstring)."""
DEMAND_NORMALIZATIONS: tuple[str, ...] = ("uniform", "none")
"""How the far mass is normalised (see the module docstring)."""
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


def _check_dynamic_options(
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
        """Let this layer's block widths follow the demand (see the module docstring).

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
        ladder, (low, high), ema_decay = _check_dynamic_options(
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


class AdaKVQCache(KIVICache):
    """AdaKVQ's packed KV cache: per-layer bits from an allocation, demand-driven deep layers.

    Args:
        config: The model config (decoder layers, head dim); every layer must be full
            attention. When ``None``, the allocation gives the number of layers.
        allocation: The per-layer widths: a :class:`~ada_modules.kv.BitAllocation`, its dict
            (``to_dict``), or the path of its JSON file (read when the cache is built, so a YAML
            config may name a file that does not exist yet). ``None`` to give ``key_bits`` and
            ``value_bits`` inline instead.
        profile: Instead of ``allocation``: an AAD profile (an
            :class:`~ada_modules.kv.AADProfile`, its JSON path, read when the cache is built,
            or one AAD per layer) to allocate from under ``budget`` with
            :func:`~ada_modules.kv.allocate_bits` at the model's head dim.
        budget: Mean stored bits per element, metadata included, for ``profile``.
        allocation_method: ``allocate_bits``'s method for ``profile``: ``"dp"`` (AdaKVQ),
            ``"greedy"``, or the same-widths baselines ``"reverse"`` and ``"random"``.
        bit_widths: Static widths ``profile`` may allocate.
        allocation_seed: Seed of ``"random"``; ``None`` takes ``seed_everything``'s
            (``PL_GLOBAL_SEED``, 0 when unset), so that a sweep's seeds draw different layouts.
        key_bits: Inline key widths (one for all layers or one per layer), without
            ``allocation``.
        value_bits: Inline value widths, likewise.
        key_group_size: Tokens per key group; ``None`` takes the allocation's ``group_size``.
            With an allocation it must equal the allocation's, whose costs assume it; with
            inline widths it is also the recorded allocation's ``group_size`` (default 32).
        value_group_size: Channels per value group; ``None`` takes the allocation's
            ``group_size`` (with inline widths: ``key_group_size``). Must divide the head dim.
        residual_length: Full-precision window ``R`` and block size, a multiple of
            ``key_group_size``.
        num_layers: Number of layers when there is no ``config`` (checked against the
            allocation).
        dynamic_layers: Layers with demand-driven block widths: a list of indices, or a fraction
            in ``[0, 1]`` of the layers, taken by decreasing allocation importance (the deepest
            first when the allocation has none, e.g. inline widths). ``0`` or ``[]``: static.
        dynamic_bits: The ladder of widths dynamic blocks step along.
        demand: How a block's demand is measured, ``"auto"`` or ``"key_proxy"`` (module
            docstring).
        thresholds: ``(low, high)`` demand thresholds of a step down / up.
        threshold_mode: ``"relative"`` (to the layer's moving-average demand) or ``"absolute"``.
        ema_decay: Decay of the moving-average demand.
        normalization: ``"uniform"`` (far mass relative to uniform attention's) or ``"none"``.
        impl: Kernel implementation (``"auto"``: Triton on CUDA tensors, torch otherwise).

    Attributes:
        allocation: The :class:`~ada_modules.kv.BitAllocation` in use.
        dynamic_layers: Sorted indices of the dynamic layers.
        layers: One :class:`AdaKVQLayer` per decoder layer; ``layers[i].block_bits`` and
            ``layers[i].block_demand`` record each flushed block's widths and demand.

    Memory: :meth:`nbytes` (exact bytes held: codes, scales, zero points and residual windows)
    and :meth:`fp_nbytes` come from :class:`~ada_modules.kv.KIVICache`; :meth:`packed_nbytes`,
    :meth:`static_nbytes` and :meth:`average_bits` report the packed history against the static
    allocation.

    Raises:
        ValueError: If the allocation's layer count differs from the model's, a width is
            unsupported, the group sizes disagree with the allocation, or another argument is
            out of range (naming the value).

    Examples:
        >>> cache = AdaKVQCache(key_bits=[2, 2, 4, 4], value_bits=[2, 3, 3, 4],
        ...                     dynamic_layers=0.5, dynamic_bits=(2, 3, 4))
        >>> cache.dynamic_layers, [layer.dynamic for layer in cache.layers]
        ([2, 3], [False, False, True, True])
        >>> cache.allocation.average_bits()  # bits per element, fp16 metadata per group of 32
        4.0
    """

    layer_class = AdaKVQLayer
    layers: list[AdaKVQLayer]

    def __init__(
        self,
        config: PreTrainedConfig | None = None,
        allocation: BitAllocation | str | Path | dict[str, Any] | None = None,
        profile: AADProfile | str | Path | list[float] | None = None,
        budget: float | None = None,
        allocation_method: Literal["dp", "greedy", "reverse", "random"] = "dp",
        bit_widths: Sequence[int] = (2, 3, 4),
        allocation_seed: int | None = None,
        key_bits: int | list[int] | None = None,
        value_bits: int | list[int] | None = None,
        key_group_size: int | None = None,
        value_group_size: int | None = None,
        residual_length: int = 32,
        num_layers: int | None = None,
        dynamic_layers: float | list[int] = 0.5,
        dynamic_bits: Sequence[int] = SUPPORTED_BITS,
        demand: Literal["auto", "key_proxy"] = "auto",
        thresholds: tuple[float, float] = (0.8, 1.25),
        threshold_mode: Literal["relative", "absolute"] = "relative",
        ema_decay: float = 0.9,
        normalization: Literal["uniform", "none"] = "uniform",
        impl: Impl = "auto",
    ) -> None:
        if key_bits is not None:
            key_bits = bits_argument("key_bits", key_bits)
        if value_bits is not None:
            value_bits = bits_argument("value_bits", value_bits)
        for name, size in (
            ("key_group_size", key_group_size),
            ("value_group_size", value_group_size),
        ):
            if size is not None:
                check_group_size(name, size)
        if num_layers is not None and (
            isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1
        ):
            raise InputError(f"num_layers must be a positive integer or None, got {num_layers!r}")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, Real) or not math.isfinite(budget)
        ):
            raise InputError(
                f"budget must be a finite number (mean stored bits per element), got {budget!r}"
            )
        if allocation_seed is not None and (
            isinstance(allocation_seed, bool) or not isinstance(allocation_seed, int)
        ):
            raise InputError(f"allocation_seed must be an integer or None, got {allocation_seed!r}")
        _check_dynamic_options(
            dynamic_bits, demand, thresholds, threshold_mode, ema_decay, normalization
        )
        if config is not None:
            layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
            model_layers = len(layer_types)
            if num_layers is not None and num_layers != model_layers:
                raise InputError(
                    f"num_layers={num_layers} disagrees with the config's {model_layers} layers"
                )
            num_layers = model_layers
        if profile is not None:
            if allocation is not None or key_bits is not None or value_bits is not None:
                raise InputError("give profile or allocation or key_bits/value_bits, not several")
            if budget is None:
                raise InputError("profile needs a budget (mean stored bits per element)")
            allocation = _allocate_from_profile(
                config,
                profile,
                budget,
                allocation_method,
                bit_widths,
                key_group_size or 32,
                num_layers,
                allocation_seed,
            )
        elif budget is not None:
            raise InputError(f"budget={budget} is only used with a profile")
        alloc = _resolve_allocation(
            allocation, key_bits, value_bits, num_layers, key_group_size or 32
        )
        alloc.check_num_layers(alloc.num_layers if num_layers is None else num_layers)
        for name, value in (
            ("key_group_size", key_group_size),
            ("value_group_size", value_group_size),
        ):
            if value is not None and value != alloc.group_size and allocation is not None:
                raise InputError(
                    f"{name}={value} differs from the allocation's group_size={alloc.group_size}, "
                    "which its bit costs assume"
                )
        self.allocation = alloc
        super().__init__(
            config,
            key_bits=alloc.key_bits,
            value_bits=alloc.value_bits,
            key_group_size=alloc.group_size if key_group_size is None else key_group_size,
            value_group_size=alloc.group_size if value_group_size is None else value_group_size,
            residual_length=residual_length,
            num_layers=None if config is not None else alloc.num_layers,
            impl=impl,
        )
        self.dynamic_layers = _pick_dynamic_layers(dynamic_layers, alloc)
        for index in self.dynamic_layers:
            self.layers[index].enable_dynamic(
                dynamic_bits, demand, thresholds, threshold_mode, ema_decay, normalization
            )

    def dynamic_block_changes(self) -> tuple[int, int]:
        """Flushed blocks of the dynamic layers stored at other widths than the static ones.

        Returns:
            ``(changed, blocks)``: how many flushed blocks of the dynamic layers got widths other
            than their layer's static ``(key_bits, value_bits)``, and how many they flushed.

        Examples:
            >>> cache = AdaKVQCache(None, key_bits=[3], value_bits=[3], key_group_size=16,
            ...                     residual_length=16, dynamic_layers=[0])
            >>> cache.dynamic_block_changes()
            (0, 0)
        """
        changed = blocks = 0
        for index in self.dynamic_layers:
            layer = self.layers[index]
            static = (layer.key_bits, layer.value_bits)
            blocks += len(layer.block_bits)
            changed += sum(bits != static for bits in layer.block_bits)
        return changed, blocks

    @classmethod
    def from_profile(
        cls,
        config: PreTrainedConfig | None,
        profile: AADProfile | Sequence[float] | str | Path,
        budget: float,
        method: Literal["dp", "greedy", "reverse", "random"] = "dp",
        bit_widths: Sequence[int] = (2, 3, 4),
        group_size: int = 32,
        num_layers: int | None = None,
        **kwargs: Any,
    ) -> "AdaKVQCache":
        """Allocate widths from an AAD profile under ``budget`` and build the cache.

        Args:
            config: The model config (or ``None`` with ``num_layers``).
            profile: An :class:`~ada_modules.kv.AADProfile`, its JSON path, or one AAD per layer.
            budget: Mean stored bits per element, metadata included (fp16 scale + zero).
            method: Allocation method of :func:`~ada_modules.kv.allocate_bits`.
            bit_widths: Allowed static widths.
            group_size: Quantization group size of keys and values.
            num_layers: Number of layers when there is no ``config``.
            **kwargs: Further :class:`AdaKVQCache` arguments (``residual_length``, dynamic
                options, ``impl``).

        Raises:
            ValueError: From :func:`~ada_modules.kv.allocate_bits`: a profile whose layer count
                differs from the model's, an unknown width, a budget below the cheapest width.

        Examples:
            >>> cache = AdaKVQCache.from_profile(None, [0.1, 0.1, 0.5, 0.6], budget=3.5,
            ...                                  num_layers=4, dynamic_layers=[])
            >>> [layer.key_bits for layer in cache.layers]
            [2, 2, 3, 3]
        """
        return cls(
            config,
            profile=profile,
            budget=budget,
            allocation_method=method,
            bit_widths=bit_widths,
            key_group_size=group_size,
            num_layers=num_layers,
            **kwargs,
        )

    def packed_nbytes(self) -> int:
        """Exact bytes of all layers' packed histories (residual windows left out)."""
        return sum(layer.packed_nbytes() for layer in self.layers)

    def static_nbytes(self) -> int:
        """Bytes the packed histories would take at the static allocation's widths."""
        return sum(layer.static_nbytes() for layer in self.layers)

    def average_bits(self) -> float:
        """Stored bits per element of the packed histories (codes + metadata), ``0`` if empty."""
        elements = sum(
            2
            * layer.keys.shape[0]
            * layer.keys.shape[1]
            * layer.keys.shape[-1]
            * len(layer.block_bits)
            * layer.residual_length
            for layer in self.layers
            if layer.segments
        )
        return 8 * self.packed_nbytes() / elements if elements else 0.0


def _allocate_from_profile(
    config: PreTrainedConfig | None,
    profile: AADProfile | str | Path | Sequence[float],
    budget: float,
    method: Literal["dp", "greedy", "reverse", "random"],
    bit_widths: Sequence[int],
    group_size: int,
    num_layers: int | None,
    seed: int | None,
) -> BitAllocation:
    """``allocate_bits`` on a profile at the model's layer count and head dim."""
    if isinstance(profile, str | Path):
        profile = AADProfile.from_json(profile)
    head_dim = None
    if config is not None:
        text_config = config.get_text_config(decoder=True)
        num_layers = len(get_layer_types_and_kwargs(text_config)[0])
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return allocate_bits(
        profile,
        budget,
        method=method,
        bit_widths=bit_widths,
        num_layers=num_layers,
        group_size=group_size,
        head_dim=head_dim,
        seed=seed,
    )


def _resolve_allocation(
    allocation: BitAllocation | str | Path | dict[str, Any] | None,
    key_bits: int | list[int] | None,
    value_bits: int | list[int] | None,
    num_layers: int | None,
    group_size: int,
) -> BitAllocation:
    if allocation is not None:
        if key_bits is not None or value_bits is not None:
            raise InputError("give either allocation or inline key_bits/value_bits, not both")
        if isinstance(allocation, BitAllocation):
            return allocation
        if isinstance(allocation, dict):
            return BitAllocation.from_dict(allocation)
        if isinstance(allocation, str | Path):
            return BitAllocation.from_json(allocation)
        raise InputError(
            "allocation must be a BitAllocation, a dict or a JSON path, got "
            f"{type(allocation).__name__}"
        )
    if key_bits is None or value_bits is None:
        raise InputError("AdaKVQCache needs an allocation or both key_bits and value_bits")
    if num_layers is None:
        lists = [b for b in (key_bits, value_bits) if not isinstance(b, int)]
        if not lists:
            raise InputError(
                "AdaKVQCache needs a config, num_layers, or per-layer lists of bits to know the "
                "number of layers"
            )
        num_layers = len(lists[0])
    return BitAllocation(
        per_layer_bits("key_bits", key_bits, num_layers),
        per_layer_bits("value_bits", value_bits, num_layers),
        group_size=group_size,
        method="inline",
    )


def _pick_dynamic_layers(dynamic_layers: float | list[int], allocation: BitAllocation) -> list[int]:
    n = allocation.num_layers
    if isinstance(dynamic_layers, bool):
        raise InputError(
            f"dynamic_layers must be a fraction or a list of layers, got {dynamic_layers!r}"
        )
    if isinstance(dynamic_layers, int | float):
        if not 0 <= dynamic_layers <= 1:
            raise InputError(
                f"dynamic_layers as a fraction must be in [0, 1], got {dynamic_layers!r}"
            )
        count = math.floor(dynamic_layers * n + 0.5)
        if len(allocation.importance) == n:
            order = sorted(range(n), key=lambda i: (-allocation.importance[i], -i))
        else:
            order = list(range(n - 1, -1, -1))
        return sorted(order[:count])
    indices = sorted(set(dynamic_layers))
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise InputError(f"dynamic_layers must hold layer indices in [0, {n}), got {i!r}")
    return indices
