"""Row-wise absmax int8 quantization: the example every kernel in this package follows.

A row is the last dimension. Each row gets one fp32 scale, ``scale = absmax(row) / 127``, and codes
``q = round(x * (127 / absmax(row)))`` in ``[-127, 127]``, rounded half to even (as
:func:`torch.round`). A row of zeros gets ``scale = 0`` and codes ``0``, so it dequantizes to zeros
without NaN. Non-finite inputs give unspecified codes.

The file holds, for each operation, the three parts of the pattern:

* ``_<name>_kernel``: the Triton kernel (``@triton.jit``), defined only where triton imports;
* ``<name>_reference``: plain torch, the specification; it never calls the kernel;
* ``<name>(..., impl="auto")``: validates its arguments and dispatches with
  :func:`~ada_modules.kernels.resolve_impl`.

The kernel and the reference compute the same fp32 operations in the same order (IEEE division via
``tl.math.div_rn``, no fused multiply-add), so their codes and scales agree bit for bit.
"""

# Triton reads argument annotations as types and specialisations, so kernel arguments stay bare.
# ruff: noqa: ANN001

import math

import torch

from ada_modules.errors import InputError
from ada_modules.kernels._dispatch import Impl, resolve_impl, triton_available

__all__ = [
    "dequantize_int8_absmax",
    "dequantize_int8_absmax_reference",
    "quantize_int8_absmax",
    "quantize_int8_absmax_reference",
]

_QMAX = 127.0  # the kernels spell it as a literal: Triton only reads constexpr globals
_MAX_BLOCK_N = 4096  # quantize: the largest column chunk one program holds at a time
_DEQUANT_BLOCK_N = 1024  # dequantize: columns per program
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _round_half_to_even(y):
        # floor-based so that it runs in the interpreter too (no libdevice there); exact in fp32
        # for |y| < 2**23, and the codes here satisfy |y| <= 127.
        f = tl.floor(y)
        frac = y - f
        f_is_odd = f - 2.0 * tl.floor(f * 0.5)
        return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + f_is_odd))

    @triton.jit
    def _quantize_int8_absmax_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        n_cols,
        stride_x_row,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x_row
        q_row = q_ptr + row * n_cols
        cols = tl.arange(0, BLOCK_N)

        running_max = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            running_max = tl.maximum(running_max, tl.abs(x))
        absmax = tl.max(running_max, axis=0)
        scale = tl.math.div_rn(absmax, 127.0)
        nonzero = absmax > 0.0
        inv_scale = tl.where(nonzero, tl.math.div_rn(127.0, tl.where(nonzero, absmax, 1.0)), 0.0)

        for start in range(0, n_cols, BLOCK_N):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            q = _round_half_to_even(x * inv_scale)
            tl.store(q_row + start + cols, q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _dequantize_int8_absmax_kernel(
        q_ptr,
        scale_ptr,
        out_ptr,
        n_cols,
        stride_q_row,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        scale = tl.load(scale_ptr + row)
        q = tl.load(q_ptr + row * stride_q_row + cols, mask=mask, other=0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, q * scale, mask=mask)


def _num_warps(block_n: int) -> int:
    return max(1, min(8, block_n // 256))


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as ``[rows, cols]`` with unit column stride, copying only when needed."""
    rows = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_float_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise InputError(f"x must have dtype in {_INPUT_DTYPES}, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise InputError(
            f"x must have at least one dimension and a non-empty last dimension (the row), "
            f"got shape {tuple(x.shape)}"
        )


def _check_codes(q: torch.Tensor, scale: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise InputError(
            f"q and scale must be torch.Tensors, got {type(q).__name__} and {type(scale).__name__}"
        )
    if q.dtype != torch.int8:
        raise InputError(f"q must have dtype torch.int8, got {q.dtype}")
    if scale.dtype != torch.float32:
        raise InputError(f"scale must have dtype torch.float32, got {scale.dtype}")
    if q.dim() == 0:
        raise InputError("q must have at least one dimension (the row), got a 0-d tensor")
    if scale.shape != q.shape[:-1]:
        raise InputError(
            f"scale must have shape q.shape[:-1] = {tuple(q.shape[:-1])}, got {tuple(scale.shape)}"
        )


def quantize_int8_absmax_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` to int8 with its absmax scale, in plain torch (the specification).

    Args:
        x: Floating-point tensor with at least one dimension; rows are the last dimension.

    Returns:
        ``(q, scale)``: int8 codes shaped like ``x`` and fp32 scales shaped ``x.shape[:-1]``.

    Examples:
        >>> q, scale = quantize_int8_absmax_reference(torch.tensor([[1.0, -2.0], [0.0, 0.0]]))
        >>> q.tolist(), scale.tolist()
        ([[64, -127], [0, 0]], [0.015748031437397003, 0.0])
    """
    x = x.float()
    absmax = x.abs().amax(dim=-1)
    # Tensor by tensor, so both are IEEE divisions: torch computes `127.0 / t` as
    # `t.reciprocal() * 127.0`, and CUDA computes `t / 127.0` as a product with 1 / 127.
    qmax = torch.full_like(absmax, _QMAX)
    scale = absmax / qmax
    inv_scale = torch.where(absmax > 0, qmax / absmax, 0.0)
    q = torch.round(x * inv_scale.unsqueeze(-1)).to(torch.int8)
    return q, scale


def _quantize_int8_absmax_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x_rows = _as_rows(x)
    n_rows, n_cols = x_rows.shape
    q = torch.empty((n_rows, n_cols), dtype=torch.int8, device=x.device)
    scale = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        block_n = min(triton.next_power_of_2(n_cols), _MAX_BLOCK_N)
        _quantize_int8_absmax_kernel[(n_rows,)](
            x_rows,
            q,
            scale,
            n_cols,
            x_rows.stride(0),
            BLOCK_N=block_n,
            num_warps=_num_warps(block_n),
            enable_fp_fusion=False,  # keep x * inv_scale rounded before rounding to an integer
        )
    return q.view(x.shape), scale.view(x.shape[:-1])


def quantize_int8_absmax(x: torch.Tensor, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (last dimension) of ``x`` to int8 codes and one fp32 absmax scale.

    ``scale = absmax / 127`` and ``q = round(x * 127 / absmax)``, rounded half to even; all-zero rows
    get ``scale = 0`` and ``q = 0``. ``dequantize_int8_absmax(q, scale)`` is then within
    ``scale / 2`` of ``x`` element by element.

    Args:
        x: fp32, fp16 or bf16 tensor with at least one dimension; any strides.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        ``(q, scale)``: int8 codes shaped like ``x`` and fp32 scales shaped ``x.shape[:-1]``.

    Raises:
        TypeError: If ``x`` is not a tensor of an allowed dtype.
        ValueError: If ``x`` is 0-d or its last dimension is empty, or ``impl`` cannot run (see
            :func:`~ada_modules.kernels.resolve_impl`).

    Examples:
        >>> x = torch.randn(4, 64)
        >>> q, scale = quantize_int8_absmax(x)
        >>> q.dtype, tuple(q.shape), tuple(scale.shape)
        (torch.int8, (4, 64), (4,))
    """
    _check_float_input(x)
    if resolve_impl(impl, x) == "torch":
        return quantize_int8_absmax_reference(x)
    return _quantize_int8_absmax_triton(x)


def dequantize_int8_absmax_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Map int8 codes back to fp32 with their row scales, in plain torch (the specification).

    Args:
        q: int8 codes with at least one dimension; rows are the last dimension.
        scale: fp32 scales shaped ``q.shape[:-1]``.

    Returns:
        fp32 tensor shaped like ``q``: ``q * scale[..., None]``.

    Examples:
        >>> dequantize_int8_absmax_reference(
        ...     torch.tensor([[64, -127]], dtype=torch.int8), torch.tensor([0.5])
        ... ).tolist()
        [[32.0, -63.5]]
    """
    return q.float() * scale.unsqueeze(-1)


def _dequantize_int8_absmax_triton(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q_rows = _as_rows(q)
    n_rows, n_cols = q_rows.shape
    out = torch.empty((n_rows, n_cols), dtype=torch.float32, device=q.device)
    if n_rows > 0 and n_cols > 0:
        block_n = min(triton.next_power_of_2(n_cols), _DEQUANT_BLOCK_N)
        grid = (n_rows, triton.cdiv(n_cols, block_n))
        _dequantize_int8_absmax_kernel[grid](
            q_rows,
            scale.reshape(-1).contiguous(),
            out,
            n_cols,
            q_rows.stride(0),
            BLOCK_N=block_n,
            num_warps=_num_warps(block_n),
        )
    return out.view(q.shape)


def dequantize_int8_absmax(
    q: torch.Tensor, scale: torch.Tensor, impl: Impl = "auto"
) -> torch.Tensor:
    """Map int8 codes from :func:`quantize_int8_absmax` back to fp32: ``q * scale[..., None]``.

    Args:
        q: int8 codes with at least one dimension; any strides.
        scale: fp32 scales shaped ``q.shape[:-1]``, on the same device as ``q``.
        impl: ``"auto"`` (Triton on CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        fp32 tensor shaped like ``q``.

    Raises:
        TypeError: If ``q`` is not int8 or ``scale`` is not fp32.
        ValueError: If ``q`` is 0-d, ``scale`` has the wrong shape, or ``impl`` cannot run (see
            :func:`~ada_modules.kernels.resolve_impl`).

    Examples:
        >>> x = torch.randn(4, 64)
        >>> x_hat = dequantize_int8_absmax(*quantize_int8_absmax(x))
        >>> bool(((x - x_hat).abs() <= x.abs().amax(-1, keepdim=True) / 254 + 1e-6).all())
        True
    """
    _check_codes(q, scale)
    if resolve_impl(impl, q, scale) == "torch":
        return dequantize_int8_absmax_reference(q, scale)
    return _dequantize_int8_absmax_triton(q, scale)
