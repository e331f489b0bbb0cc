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
    >>> import torch
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

from transformers import PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ada_modules.checks import is_int, is_real
from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import Impl
from ada_modules.kernels.kv_quant import SUPPORTED_BITS
from ada_modules.kv.aad import AADProfile
from ada_modules.kv.adakvq_layer import (
    DEMAND_NORMALIZATIONS,
    DEMAND_SOURCES,
    AdaKVQLayer,
    block_bits_per_element,
    check_dynamic_options,
)
from ada_modules.kv.bit_allocation import BitAllocation, allocate_bits
from ada_modules.kv.kivi import KIVICache, bits_argument, per_layer_bits
from ada_modules.kv.quantized_layer import check_group_size

__all__ = [
    "DEMAND_NORMALIZATIONS",
    "DEMAND_SOURCES",
    "AdaKVQCache",
    "AdaKVQLayer",
    "block_bits_per_element",
]


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
        check_dynamic_options(
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
    if is_real(dynamic_layers):
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
    indices = sorted({int(i) if is_int(i) else i for i in dynamic_layers})
    for i in indices:
        if not is_int(i) or not 0 <= i < n:
            raise InputError(f"dynamic_layers must hold layer indices in [0, {n}), got {i!r}")
    return indices
