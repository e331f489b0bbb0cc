"""The alpha-beta cost model behind AdERA's ``mode="auto"``: compress a group only if it pays.

Examples:
    >>> model = CostModel(latency_s=10e-6, bandwidth_Bps=25e9, encode_Bps=400e9, decode_Bps=400e9)
    >>> model.raw_time(shard_nbytes=2**20, world_size=2) > model.raw_time(2**10, 2)
    True
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ada_modules.errors import InputError
from ada_modules.kernels import delta_codec
from ada_modules.kernels import exponent_codec as codec
from ada_modules.kernels._dispatch import Impl

__all__ = ["CostModel"]

# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single (same arguments).
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _check_positive(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InputError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta model of a ring all-gather, with and without the codec.

    For ``P`` ranks and a shard of ``b`` bytes, the raw all-gather takes
    ``(P - 1) * (latency_s + b / bandwidth_Bps)``; the compressed one takes the same with the payload
    size, plus encoding the shard (``codec_latency_s + b / encode_Bps``) and decoding all ``P``
    shards (``P * codec_latency_s + P * b / decode_Bps``). A group is compressed when that is at most
    ``1 - margin`` of the raw time. Every rank must use the same constants (see :meth:`calibrate`),
    since the decision changes the size of what is sent.

    Args:
        latency_s: Per-step latency of the ring (alpha), seconds.
        bandwidth_Bps: Per-rank bandwidth (beta), bytes per second.
        encode_Bps: Encoder throughput in bytes of input shard per second.
        decode_Bps: Decoder throughput in bytes of output shard per second.
        codec_latency_s: Fixed cost of one encode or decode call, seconds.
        margin: Required relative saving, in [0, 1).

    Examples:
        >>> nvlink = CostModel(latency_s=10e-6, bandwidth_Bps=150e9, encode_Bps=1e12, decode_Bps=1e12)
        >>> nvlink.should_compress(shard_numel=2**24, dtype=torch.bfloat16, world_size=8, payload_nbytes=2**24 + 2**21)
        True
        >>> nvlink.should_compress(shard_numel=2**10, dtype=torch.bfloat16, world_size=8, payload_nbytes=1400)
        False
    """

    latency_s: float = 20e-6
    bandwidth_Bps: float = 25e9
    encode_Bps: float = 400e9
    decode_Bps: float = 400e9
    codec_latency_s: float = 10e-6
    margin: float = 0.05

    def __post_init__(self) -> None:
        for name in ("latency_s", "bandwidth_Bps", "encode_Bps", "decode_Bps", "codec_latency_s"):
            _check_positive(getattr(self, name), name)
        if isinstance(self.margin, bool) or not 0 <= self.margin < 1:
            raise InputError(f"margin must be in [0, 1), got {self.margin!r}")

    def raw_time(self, shard_nbytes: int, world_size: int) -> float:
        """Seconds of the default ring all-gather of ``shard_nbytes`` per rank."""
        return (world_size - 1) * (self.latency_s + shard_nbytes / self.bandwidth_Bps)

    def compressed_time(self, shard_nbytes: int, payload_nbytes: int, world_size: int) -> float:
        """Seconds of encode + all-gather of ``payload_nbytes`` per rank + decode of every shard."""
        encode = self.codec_latency_s + shard_nbytes / self.encode_Bps
        decode = world_size * (self.codec_latency_s + shard_nbytes / self.decode_Bps)
        return encode + self.raw_time(payload_nbytes, world_size) + decode

    def should_compress(
        self, shard_numel: int, dtype: torch.dtype, world_size: int, payload_nbytes: int
    ) -> bool:
        """Whether the compressed all-gather is predicted to save at least ``margin``."""
        shard_nbytes = codec.raw_nbytes(shard_numel, dtype)
        return self.compressed_time(shard_nbytes, payload_nbytes, world_size) <= (
            1 - self.margin
        ) * self.raw_time(shard_nbytes, world_size)

    @classmethod
    def calibrate(
        cls,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        *,
        margin: float = 0.05,
        numel: int = 1 << 20,
        repeats: int = 3,
        impl: Impl = "auto",
        reuse: Literal["exponent", "value"] = "exponent",
    ) -> "CostModel":
        """Measure alpha, beta and the codec's speed here; every rank of ``group`` gets the same model.

        Collective: all ranks of ``group`` must call it. Each timing is the median of ``repeats``;
        the slowest rank's timings are used (an ``all_reduce`` of MAX), so the model is identical
        on every rank.

        Args:
            group: Process group (default: the world).
            device: Where to time (the device the parameters live on).
            margin: Passed to the model.
            numel: bf16 elements per shard for the bandwidth and codec timings.
            repeats: Timings per quantity.
            impl: Codec implementation to time.
            reuse: Which codec to time: the exponent codec (a cache in which a few percent of
                the exponents differ) or the value codec (:mod:`ada_modules.kernels.delta_codec`,
                a cache in which every element sits a few units in the last place away).
        """
        if reuse not in ("exponent", "value"):
            raise InputError(f"reuse must be 'exponent' or 'value', got {reuse!r}")
        device = torch.device(device)
        world = dist.get_world_size(group)

        def timed(fn: Callable[[], object]) -> float:
            samples = []
            for _ in range(repeats + 1):  # the first call warms up
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                samples.append(time.perf_counter() - start)
            return sorted(samples[1:])[len(samples[1:]) // 2]

        small = torch.zeros(64, dtype=torch.uint8, device=device)
        small_out = torch.empty(64 * world, dtype=torch.uint8, device=device)
        big = torch.zeros(2 * numel, dtype=torch.uint8, device=device)
        big_out = torch.empty(2 * numel * world, dtype=torch.uint8, device=device)
        x = torch.randn(numel, device=device).bfloat16()
        if reuse == "value":
            used, capacity = delta_codec, numel
            moves = torch.randint(-3, 4, (numel,), device=device, dtype=torch.int16)
            cache = (x.view(torch.int16) + moves).view(torch.bfloat16)
        else:
            used, capacity = codec, numel // 4
            cache = codec.extract_exponents(x * 1.01)  # a few percent of exponents change
        buffer, spill = used.encode_into(x, cache, capacity, impl=impl)
        t = torch.tensor(
            [
                timed(lambda: _all_gather(small_out, small, group=group)),
                timed(lambda: _all_gather(big_out, big, group=group)),
                timed(lambda: used.encode_into(x, cache, capacity, impl=impl)),
                timed(
                    lambda: used.decode_from(buffer, cache, numel, x.dtype, spill=spill, impl=impl)
                ),
            ],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        t_small, t_big, t_enc, t_dec = t.tolist()
        hops = max(world - 1, 1)
        latency = max(t_small / hops, 1e-9)
        bandwidth = 2 * numel / max(t_big / hops - latency, 1e-12)
        # The codec's fixed cost is folded into its throughput (measured at `numel` elements).
        return cls(
            latency_s=latency,
            bandwidth_Bps=bandwidth,
            encode_Bps=2 * numel / t_enc,
            decode_Bps=2 * numel / t_dec,
            codec_latency_s=1e-9,
            margin=margin,
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
