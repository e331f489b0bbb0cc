"""The payload header and the buffer/spill checks that AdERA's two codecs share.

Both :mod:`ada_modules.kernels.exponent_codec` and :mod:`ada_modules.kernels.delta_codec` write
a 32-byte header: a magic byte (one per codec), the format version, a dtype code (1 = bf16,
2 = fp32), ``log2(chunk_size)``, then little-endian ``int64`` ``numel``, the stream bytes ``E`` and
the capacity of the buffer's stream area. Bytes of the stream beyond the capacity travel in a
separate *spill*.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ada_modules.errors import InputError

HEADER_NBYTES = 32
"""Bytes of the payload header."""
VERSION = 1
DTYPE_CODES = {torch.bfloat16: 1, torch.float32: 2}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class PayloadHeader(NamedTuple):
    """The fields of a payload header (see each codec's ``read_header``)."""

    numel: int
    dtype: torch.dtype
    chunk_size: int
    stream_nbytes: int
    capacity_bytes: int


def header_bytes(
    magic: int,
    numel: int,
    dtype: torch.dtype,
    chunk_size: int,
    stream: torch.Tensor | int,
    capacity: int,
) -> torch.Tensor:
    """The 32 header bytes; ``stream`` may be a 0-d device tensor (no host sync needed)."""
    fields = torch.zeros(4, dtype=torch.int64)
    fields[0] = magic | VERSION << 8 | DTYPE_CODES[dtype] << 16 | int(math.log2(chunk_size)) << 24
    fields[1] = numel
    fields[3] = capacity
    header = fields.view(torch.uint8)
    if isinstance(stream, torch.Tensor):
        header = header.to(stream.device)
        header[16:24] = stream.reshape(1).to(torch.int64).view(torch.uint8)
    else:
        header[16:24] = torch.tensor([stream], dtype=torch.int64).view(torch.uint8)
    return header


def parse_header(buffer: torch.Tensor, magic: int, codec: str) -> PayloadHeader:
    """Parse the header of a ``codec`` payload (one small device-to-host copy)."""
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise InputError("buffer must be a 1-D torch.uint8 tensor")
    if buffer.numel() < HEADER_NBYTES:
        raise InputError(
            f"buffer has {buffer.numel()} bytes, fewer than the {HEADER_NBYTES}-byte header"
        )
    head = buffer[:HEADER_NBYTES].to("cpu", copy=True)
    found, version, code, log_chunk = head[:4].tolist()
    if found != magic or version != VERSION or code not in _CODE_DTYPES:
        raise InputError(
            f"buffer does not start with {codec} header (magic {found:#x}, version "
            f"{version}, dtype code {code})"
        )
    numel, stream, capacity = head[8:].view(torch.int64).tolist()
    return PayloadHeader(numel, _CODE_DTYPES[code], 1 << log_chunk, stream, capacity)


def check_buffer(
    buffer: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    header: PayloadHeader,
    payload_nbytes: Callable[[int, torch.dtype, int, int], int],
) -> None:
    """The header matches ``numel``/``dtype`` and the buffer has the size it implies."""
    if header.numel != numel or header.dtype != dtype:
        raise InputError(
            f"buffer holds {header.numel} elements of {header.dtype}, expected {numel} of {dtype}"
        )
    expected = payload_nbytes(numel, dtype, header.capacity_bytes, header.chunk_size)
    if buffer.numel() != expected:
        raise InputError(f"buffer has {buffer.numel()} bytes, its header implies {expected}")


def check_spill(
    spill: torch.Tensor | None, header: PayloadHeader, device: torch.device, what: str
) -> None:
    """``spill`` holds exactly the ``what`` bytes that did not fit the buffer."""
    need = max(header.stream_nbytes - header.capacity_bytes, 0)
    have = 0 if spill is None else spill.numel()
    if have != need:
        raise InputError(
            f"spill must hold the {need} {what} bytes that did not fit the buffer, got {have}"
        )
    if spill is not None and (spill.dtype != torch.uint8 or spill.device != device):
        raise InputError(
            f"spill must be torch.uint8 on {device}, got {spill.dtype} on {spill.device}"
        )
