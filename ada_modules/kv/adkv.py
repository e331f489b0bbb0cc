"""ADKV quantizer: per-channel backward-adaptive delta coding of a KV stream (encode and replay).

ADKV (adaptive delta quantization of the KV cache) follows each channel of the keys or values
over time with a predicted centre ``mu`` (an EMA of the decoded values) and a step ``s`` (a
multiplicative, Jayant-style rule driven by the code magnitude). Both are updated from decoded
values only, so a decoder replays them from the codes: nothing per group is stored, only
per-channel parameters and a keyframe (``mu`` and the step exponent) every ``keyframe_period``
tokens for random access. The stored format and the prefix-sum decoder are specified in
:mod:`ada_modules.kernels.adkv_decode`; this module holds the parameters, the encoder and the
sequential decoder (token by token, the recursion the encoder runs).

Two step rules share one format. ``ADKVParams.jayant`` uses a table of multipliers directly.
``ADKVParams.ema`` tracks the log step as an EMA of the log of the decoded deviation,
``log s_t = (1 - beta) log s_{t-1} + beta log(kappa |x_t - mu_{t-1}|)``; since
``|x_t - mu_{t-1}| = s_{t-1} |v_t|``, this is exactly the multiplicative rule with the table
``beta * log2(kappa * |v|)`` (rounded to eighth-octaves), so its decode is a prefix sum too.

Reconstruction choices (the paper's code is not public): mid-rise levels; eighth-octave steps;
the centre in 16-bit fixed point relative to the keyframe so that any summation order decodes
bitwise alike; keyframes are snapshots of the decoder state (fp16 centre, int16 exponent); the
first keyframe is set from the first block of tokens (mean, and ``init_gain`` times the spread).

Examples:
    >>> x = torch.randn(2, 4, 100, 32)
    >>> packed = adkv_encode(x, ADKVParams.default(4), keyframe_period=64)
    >>> y = adkv_dequantize_sequential(packed)
    >>> from ada_modules.kernels.adkv_decode import adkv_dequantize_reference
    >>> torch.equal(y, adkv_dequantize_reference(packed))  # replay == prefix sums, bitwise
    True
    >>> float(((y - x) ** 2).mean() / (x**2).mean()) < 0.05
    True
"""

import math
from dataclasses import dataclass, field, replace
from numbers import Integral
from pathlib import Path

import torch

from ada_modules.checks import is_finite_real, is_int
from ada_modules.errors import InputError
from ada_modules.kernels.adkv_decode import (
    CENTRE_FRACTION_BITS,
    EXPONENT_LIMIT,
    MAX_SEGMENT_OCTAVES,
    STEP_RESOLUTION,
    ADKVTensor,
    centre_increment,
    check_adkv_tensor,
    step_from_exponent,
)
from ada_modules.kernels.kv_quant import SUPPORTED_BITS, pack_codes, unpack_codes

__all__ = [
    "DEFAULT_BETA",
    "OPTIMAL_GAUSSIAN_STEP",
    "ADKVEncoder",
    "ADKVParams",
    "adkv_dequantize_sequential",
    "adkv_encode",
    "check_keyframe_period",
    "load_adkv_params",
    "save_adkv_params",
]

OPTIMAL_GAUSSIAN_STEP = {2: 0.9957, 3: 0.5860, 4: 0.3352, 8: 0.0308}
"""Step of the MSE-optimal uniform quantizer of a unit Gaussian per bit width (Max, 1960); the
default first step is this times the spread of the first block."""

DEFAULT_BETA = {2: 0.25, 3: 0.2, 4: 0.1, 8: 0.05}
"""Rate of the log-step EMA of the uncalibrated parameters per bit width (finer codes adapt the
step more slowly: their table entries are already many eighth-octaves apart)."""


# A multiplier moves the step by eighth-octaves; the table is stored as int8 (so at most 127).
_MULTIPLIER_RANGE = (-STEP_RESOLUTION * MAX_SEGMENT_OCTAVES, 127)


def _check_bits(bits: object) -> int:
    if isinstance(bits, bool) or not isinstance(bits, Integral) or bits not in SUPPORTED_BITS:
        raise InputError(f"bits must be one of {SUPPORTED_BITS} (an int), got {bits!r}")
    return int(bits)


def check_keyframe_period(period: object) -> int:
    """Return ``period`` if it is an int ``>= 1``; raise :class:`InputError` naming it otherwise."""
    if isinstance(period, bool) or not isinstance(period, Integral) or period < 1:
        raise InputError(f"keyframe_period must be an int >= 1, got {period!r}")
    return int(period)


def _levels(bits: int) -> torch.Tensor:
    """Magnitudes ``|v|`` of the mid-rise levels, index ``j`` = ``0 .. 2**(bits-1) - 1``."""
    return torch.arange(2 ** (bits - 1), dtype=torch.float64) + 0.5


def _mean_log2_level(bits: int) -> float:
    """``E[log2 |v|]`` for a unit Gaussian coded with the optimal uniform step."""
    step = OPTIMAL_GAUSSIAN_STEP[bits]
    edges = torch.arange(2 ** (bits - 1) + 1, dtype=torch.float64) * step
    edges[-1] = math.inf
    cdf = 0.5 * (1 + torch.erf(edges / math.sqrt(2)))
    probs = 2 * (cdf[1:] - cdf[:-1])
    return float((probs * _levels(bits).log2()).sum())


@dataclass(frozen=True)
class ADKVParams:
    """Per-channel ADKV parameters for one stream (the keys or the values of one layer).

    Tensors broadcast to ``(heads, head_dim)`` (``multipliers``: ``(heads, head_dim, 2**(bits-1))``),
    so one set may serve every channel (the defaults) or each channel its own (calibrated).

    Attributes:
        bits: Bits per code, one of 2, 3, 4, 8.
        alpha_code: uint8; centre EMA rate ``alpha = (alpha_code + 1) / 256``.
        multipliers: int8 step-exponent change per code magnitude, in eighth-octaves; every
            channel's table has an entry ``<= 0`` and one ``>= 0``.
        init_gain: float32; the first step is ``init_gain`` times the spread (std) of the first
            block of tokens (used by the encoder only, not stored with the codes).

    Examples:
        >>> p = ADKVParams.default(2)
        >>> p.multipliers.tolist(), round(p.alpha, 3)
        ([-1, 2], 0.051)
        >>> ADKVParams.jayant(2, multipliers=[-1, 4]).multipliers.tolist()
        [-1, 4]
    """

    bits: int
    alpha_code: torch.Tensor
    multipliers: torch.Tensor
    init_gain: torch.Tensor = field(default_factory=lambda: torch.tensor(1.0))

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        levels = 2 ** (self.bits - 1)
        if self.multipliers.shape[-1:] != (levels,):
            raise InputError(
                f"multipliers must have {levels} entries (2**(bits-1)) in the last dim for "
                f"bits={self.bits}, got shape {tuple(self.multipliers.shape)}"
            )
        if self.multipliers.dtype != torch.int8 or self.alpha_code.dtype != torch.uint8:
            raise InputError(
                "multipliers must be int8 and alpha_code uint8, got "
                f"{self.multipliers.dtype} and {self.alpha_code.dtype}"
            )
        limit = STEP_RESOLUTION * MAX_SEGMENT_OCTAVES
        m = self.multipliers.to(torch.int64)
        if bool((m.min(-1).values > 0).any() or (m.max(-1).values < 0).any()):
            raise InputError(
                "every multiplier table needs an entry <= 0 and one >= 0 (so the step can both "
                f"shrink and grow), got {self._short(m)}"
            )
        if bool((m.abs() > limit).any()):
            raise InputError(f"multipliers must lie in [-{limit}, {limit}], got {self._short(m)}")
        if not bool(torch.isfinite(self.init_gain).all() and (self.init_gain > 0).all()):
            raise InputError(f"init_gain must be finite and > 0, got {self._short(self.init_gain)}")

    @staticmethod
    def _short(t: torch.Tensor) -> str:
        return str(t.tolist()) if t.numel() <= 16 else f"a tensor of shape {tuple(t.shape)}"

    @property
    def alpha(self) -> float | torch.Tensor:
        """The centre EMA rate(s) ``(alpha_code + 1) / 256`` (a float when shared)."""
        alpha = (self.alpha_code.float() + 1) / 256
        return float(alpha) if alpha.numel() == 1 else alpha

    @classmethod
    def jayant(
        cls, bits: int, multipliers: list[int], alpha: float = 0.05, init_gain: float | None = None
    ) -> "ADKVParams":
        """Shared parameters with an explicit multiplier table (eighth-octaves per magnitude)."""
        bits = _check_bits(bits)
        if not (is_finite_real(alpha) and 0 < alpha <= 1):
            raise InputError(f"alpha must lie in (0, 1], got {alpha!r}")
        low, high = _MULTIPLIER_RANGE
        if isinstance(multipliers, str) or not all(is_int(m) for m in multipliers):
            raise InputError(f"multipliers must be a list of integers, got {multipliers!r}")
        if not all(low <= m <= high for m in multipliers):
            raise InputError(f"multipliers must lie in [{low}, {high}], got {multipliers!r}")
        gain = OPTIMAL_GAUSSIAN_STEP[bits] if init_gain is None else init_gain
        return cls(
            bits=bits,
            alpha_code=torch.tensor(min(255, max(0, round(alpha * 256) - 1)), dtype=torch.uint8),
            multipliers=torch.tensor(multipliers, dtype=torch.int8),
            init_gain=torch.tensor(float(gain)),
        )

    @classmethod
    def ema(
        cls,
        bits: int,
        beta: float = 0.25,
        kappa: float | None = None,
        alpha: float = 0.05,
        init_gain: float | None = None,
    ) -> "ADKVParams":
        """Shared parameters of the EMA step rule ``log s <- (1-beta) log s + beta log(kappa |x - mu|)``.

        Args:
            bits: Bits per code.
            beta: Rate of the log-step EMA, in ``(0, 1]``.
            kappa: Gain on the decoded deviation; default: the value whose fixed point is the
                optimal step for Gaussian data (``E[log2(kappa |v|)] = 0``).
            alpha: Centre EMA rate.
            init_gain: First step relative to the first block's spread.
        """
        bits = _check_bits(bits)
        if not (is_finite_real(beta) and 0 < beta <= 1):
            raise InputError(f"beta must lie in (0, 1], got {beta!r}")
        if kappa is None:
            kappa = 2.0 ** -_mean_log2_level(bits)
        if not (is_finite_real(kappa) and kappa > 0):
            raise InputError(f"kappa must be a finite number > 0, got {kappa!r}")
        table = STEP_RESOLUTION * beta * (kappa * _levels(bits)).log2()
        rounded = table.round().to(torch.int64)
        rounded[0] = min(int(rounded[0]), 0)
        rounded[-1] = max(int(rounded[-1]), 0)
        low, high = _MULTIPLIER_RANGE
        if not bool(((low <= rounded) & (rounded <= high)).all()):
            raise InputError(
                f"kappa={kappa!r} with beta={beta!r} gives step multipliers {rounded.tolist()} "
                f"outside [{low}, {high}] eighth-octaves: use a kappa nearer the default "
                f"{2.0 ** -_mean_log2_level(bits):.3g}"
            )
        return cls.jayant(bits, rounded.tolist(), alpha=alpha, init_gain=init_gain)

    @classmethod
    def default(cls, bits: int) -> "ADKVParams":
        """The uncalibrated parameters: the EMA step rule with ``beta =``
        :data:`DEFAULT_BETA` ``[bits]`` and ``alpha = 0.05``."""
        return cls.ema(_check_bits(bits), beta=DEFAULT_BETA[bits])

    def for_shape(self, heads: int, head_dim: int) -> "ADKVParams":
        """The same parameters expanded to one per channel ``(heads, head_dim)`` (contiguous)."""
        levels = 2 ** (self.bits - 1)
        return replace(
            self,
            alpha_code=self.alpha_code.expand(heads, head_dim).clone(),
            multipliers=self.multipliers.expand(heads, head_dim, levels).clone(),
            init_gain=self.init_gain.expand(heads, head_dim).clone(),
        )

    def to(self, device: torch.device | str) -> "ADKVParams":
        """The parameters on ``device``."""
        return replace(
            self,
            alpha_code=self.alpha_code.to(device),
            multipliers=self.multipliers.to(device),
            init_gain=self.init_gain.to(device),
        )

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """A dict for ``torch.save``; :meth:`from_state_dict` restores it."""
        return {
            "bits": self.bits,
            "alpha_code": self.alpha_code,
            "multipliers": self.multipliers,
            "init_gain": self.init_gain,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> "ADKVParams":
        """Parameters from :meth:`state_dict` (e.g. ``torch.load`` of a calibration file)."""
        try:
            return cls(**{k: state[k] for k in ("bits", "alpha_code", "multipliers", "init_gain")})
        except KeyError as err:
            raise InputError(f"ADKV parameter state is missing {err.args[0]!r}") from None

    @classmethod
    def load(cls, path: str | Path, key: str | None = None) -> "ADKVParams":
        """Load parameters saved with ``torch.save(params.state_dict(), path)`` (or, with ``key``,
        one entry of a saved dict of them)."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        return cls.from_state_dict(state[key] if key is not None else state)


def _check_states(x: object, head_dim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"x must be a float tensor (batch, heads, tokens, head_dim), got {shape}")
    if head_dim is not None and x.shape[-1] != head_dim:
        raise InputError(f"x has head_dim {x.shape[-1]}, the stream has {head_dim}")
    if not bool(torch.isfinite(x).all()):
        raise InputError(
            f"x has {int((~torch.isfinite(x)).sum())} NaN/Inf values; ADKV codes only finite values"
        )
    return x


class ADKVEncoder:
    """Streaming ADKV encoder of one ``(batch, heads, tokens, head_dim)`` stream.

    Call :meth:`append` with consecutive blocks of tokens; :attr:`packed` holds the codes and
    keyframes of everything appended so far (decode it with
    :func:`~ada_modules.kernels.adkv_decode.adkv_dequantize_reference` or
    :func:`adkv_dequantize_sequential`). The encoder state (per channel: centre, step exponent,
    keyframe) is carried between calls, so block boundaries after the first do not change the
    codes (the first keyframe is set from the first block: its mean and spread).

    Args:
        params: The per-channel parameters (broadcast to the stream's heads and channels).
        keyframe_period: Tokens between keyframes (an int >= 1).

    Examples:
        >>> enc = ADKVEncoder(ADKVParams.default(2), keyframe_period=32)
        >>> x = torch.randn(1, 2, 48, 16)
        >>> enc.append(x[:, :, :20]); enc.append(x[:, :, 20:])
        >>> enc.packed.num_tokens, tuple(enc.packed.keyframe_centre.shape)
        (48, (1, 2, 2, 16))
        >>> other = ADKVEncoder(ADKVParams.default(2), keyframe_period=32)
        >>> for block in x[:, :, :20], x[:, :, 20:21], x[:, :, 21:]: other.append(block)
        >>> torch.equal(enc.packed.codes, other.packed.codes)  # same first block, same codes
        True
    """

    def __init__(self, params: ADKVParams, keyframe_period: int = 512) -> None:
        if not isinstance(params, ADKVParams):
            raise InputError(f"params must be ADKVParams, got {type(params).__name__}")
        self.params = params
        self.keyframe_period = check_keyframe_period(keyframe_period)
        self.packed: ADKVTensor | None = None
        self._state: dict[str, torch.Tensor] = {}

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far."""
        return 0 if self.packed is None else self.packed.num_tokens

    def map_batch(self, fn: "callable") -> None:
        """Apply ``fn`` (e.g. ``lambda t: t.index_select(0, beam_idx)``) to every per-sequence
        tensor: the codes, the keyframes and the encoder state."""
        if self.packed is not None:
            self.packed = self.packed.map(fn)
        self._state = {k: fn(v) for k, v in self._state.items()}

    def append(self, x: torch.Tensor) -> None:
        """Encode the next ``x.shape[-2]`` tokens of the stream (``x``: batch, heads, tokens, dim).

        Raises:
            InputError: If ``x`` has NaN/Inf, or its batch, heads or head_dim differ from earlier
                blocks; nothing is encoded then.
        """
        head_dim = None if self.packed is None else self.packed.head_dim
        x = _check_states(x, head_dim)
        if self.packed is not None and x.shape[:2] != self.packed.codes.shape[:2]:
            raise InputError(
                f"x has batch and heads {tuple(x.shape[:2])}, the stream has "
                f"{tuple(self.packed.codes.shape[:2])}"
            )
        batch, heads, tokens, dim = x.shape
        if tokens == 0:
            return
        params = self.params.to(x.device)
        levels = 2**params.bits
        table = params.multipliers.to(torch.int64).expand(batch, heads, dim, levels // 2)
        alpha = params.alpha_code.to(torch.int64).expand(heads, dim)
        shrink = table.argmin(-1, keepdim=True)  # magnitudes that never grow the step
        grow = table.argmax(-1, keepdim=True)
        x = x.float()
        s = self._state
        codes, centres, exponents = [], [], []
        start = self.num_tokens
        for i in range(tokens):
            t = start + i
            if t % self.keyframe_period == 0:
                if t == 0:
                    first = x[:, :, : self.keyframe_period]
                    mean = first.mean(-2)
                    spread = first.std(-2, correction=0)
                    spread = torch.where(spread > 0, spread, mean.abs() / 8)
                    spread = torch.where(spread > 0, spread, torch.ones_like(spread))
                    target = params.init_gain.expand(heads, dim) * spread
                    exp = (STEP_RESOLUTION * target.log2()).round()
                    s["exponent"] = exp.clamp(-EXPONENT_LIMIT, EXPONENT_LIMIT).to(torch.int64)
                    centre = mean
                else:
                    centre = s["key_centre"] + s["accumulator"].float() * s["unit"]
                s["key_centre"] = centre.clamp(-65504, 65504).half().float()
                s["key_exponent"] = s["exponent"].clone()
                s["accumulator"] = torch.zeros_like(s["exponent"])
                s["unit"] = torch.ldexp(
                    step_from_exponent(s["key_exponent"]),
                    torch.tensor(-CENTRE_FRACTION_BITS * 1.0, device=x.device),
                )
                centres.append(s["key_centre"].half())
                exponents.append(s["key_exponent"].to(torch.int16))
            centre = s["key_centre"] + s["accumulator"].float() * s["unit"]
            step = step_from_exponent(s["exponent"])
            code = torch.floor((x[:, :, i] - centre) / step + levels / 2).clamp(0, levels - 1)
            code = code.to(torch.int64)
            # Keep the step exponent within the segment's and the global bounds by the choice of
            # code (the decoder never clamps): when the nearest code would leave them, take the
            # same-sign code whose multiplier moves the exponent back.
            low = (s["key_exponent"] - STEP_RESOLUTION * MAX_SEGMENT_OCTAVES).clamp_min(
                -EXPONENT_LIMIT
            )
            high = (s["key_exponent"] + STEP_RESOLUTION * MAX_SEGMENT_OCTAVES).clamp_max(
                EXPONENT_LIMIT
            )
            magnitude = (2 * code - levels + 1).abs() // 2
            new_exp = s["exponent"] + table.gather(-1, magnitude.unsqueeze(-1)).squeeze(-1)
            fix = torch.where(new_exp > high, shrink.squeeze(-1), magnitude)
            fix = torch.where(new_exp < low, grow.squeeze(-1), fix)
            upper = code >= levels // 2
            code = torch.where(upper, levels // 2 + fix, levels // 2 - 1 - fix)
            level2 = 2 * code - levels + 1
            increment = table.gather(-1, (level2.abs() // 2).unsqueeze(-1)).squeeze(-1)
            s["accumulator"] = s["accumulator"] + centre_increment(
                alpha, s["exponent"] - s["key_exponent"], level2
            )
            s["exponent"] = s["exponent"] + increment
            codes.append(code)
        block = ADKVTensor(
            codes=pack_codes(torch.stack(codes, dim=-2), params.bits),
            keyframe_centre=_stack_or_empty(centres, batch, heads, dim, torch.float16, x.device),
            keyframe_exponent=_stack_or_empty(exponents, batch, heads, dim, torch.int16, x.device),
            alpha_code=params.alpha_code,
            multipliers=params.multipliers,
            bits=params.bits,
            head_dim=dim,
            keyframe_period=self.keyframe_period,
        )
        self.packed = block if self.packed is None else _concat(self.packed, block)


def _stack_or_empty(
    parts: list[torch.Tensor],
    batch: int,
    heads: int,
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    if parts:
        return torch.stack(parts, dim=-2)
    return torch.empty(batch, heads, 0, dim, dtype=dtype, device=device)


def _concat(a: ADKVTensor, b: ADKVTensor) -> ADKVTensor:
    return replace(
        a,
        codes=torch.cat([a.codes, b.codes], dim=-2),
        keyframe_centre=torch.cat([a.keyframe_centre, b.keyframe_centre], dim=-2),
        keyframe_exponent=torch.cat([a.keyframe_exponent, b.keyframe_exponent], dim=-2),
    )


def adkv_encode(x: torch.Tensor, params: ADKVParams, keyframe_period: int = 512) -> ADKVTensor:
    """Encode a whole ``(batch, heads, tokens, head_dim)`` stream (see :class:`ADKVEncoder`).

    Examples:
        >>> packed = adkv_encode(torch.randn(1, 1, 10, 16), ADKVParams.default(8), 4)
        >>> packed.codes.shape, packed.keyframe_exponent.shape
        (torch.Size([1, 1, 10, 4]), torch.Size([1, 1, 3, 16]))
    """
    encoder = ADKVEncoder(params, keyframe_period)
    encoder.append(x)
    if encoder.packed is None:
        raise InputError(f"x must hold at least one token, got shape {tuple(x.shape)}")
    return encoder.packed


def adkv_dequantize_sequential(packed: ADKVTensor) -> torch.Tensor:
    """Decode ADKV codes token by token, replaying the encoder's recursion (fp32).

    Bitwise equal to the prefix-sum decoder
    :func:`~ada_modules.kernels.adkv_decode.adkv_dequantize_reference`: the state is integer
    (step exponent, centre accumulator) and every float is computed from it by the same formula.
    """
    check_adkv_tensor(packed)
    batch, heads, tokens, _ = packed.codes.shape
    dim = packed.head_dim
    levels = 2**packed.bits
    codes = unpack_codes(packed.codes, packed.bits, dim).to(torch.int64)
    table = packed.multipliers.to(torch.int64).expand(batch, heads, dim, levels // 2)
    alpha = packed.alpha_code.to(torch.int64).expand(heads, dim)
    out = torch.empty(batch, heads, tokens, dim, dtype=torch.float32, device=codes.device)
    shift = torch.tensor(-CENTRE_FRACTION_BITS * 1.0, device=codes.device)
    for t in range(tokens):
        if t % packed.keyframe_period == 0:
            k = t // packed.keyframe_period
            key_centre = packed.keyframe_centre[:, :, k].float()
            key_exponent = packed.keyframe_exponent[:, :, k].to(torch.int64)
            exponent = key_exponent.clone()
            accumulator = torch.zeros_like(exponent)
            unit = torch.ldexp(step_from_exponent(key_exponent), shift)
        level2 = 2 * codes[:, :, t] - levels + 1
        centre = key_centre + accumulator.float() * unit
        out[:, :, t] = centre + step_from_exponent(exponent) * (level2.float() * 0.5)
        accumulator = accumulator + centre_increment(alpha, exponent - key_exponent, level2)
        exponent = exponent + table.gather(-1, (level2.abs() // 2).unsqueeze(-1)).squeeze(-1)
    return out


def save_adkv_params(
    path: str | Path,
    params: dict[int, dict[str, list[ADKVParams]]],
    keyframe_period: int | None = None,
) -> None:
    """Save calibrated parameters: ``{bits: {"keys": [one per layer], "values": [...]}}``.

    The file is a ``torch.save`` dict ``{"bits": [...], "keyframe_period": P, "params": {bits:
    {"keys": [state_dict, ...], "values": [...]}}}``; :func:`load_adkv_params` and
    :class:`~ada_modules.kv.ADKVCache` (``params=path``) read it.

    Examples:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "adkv.pt")
        >>> save_adkv_params(path, {2: {"keys": [ADKVParams.default(2)],
        ...                             "values": [ADKVParams.default(2)]}})
        >>> load_adkv_params(path, 2)["keys"][0].multipliers.tolist()
        [-1, 2]
    """
    state = {
        "bits": sorted(params),
        "keyframe_period": keyframe_period,
        "params": {
            int(b): {kind: [p.state_dict() for p in per_layer] for kind, per_layer in kinds.items()}
            for b, kinds in params.items()
        },
    }
    torch.save(state, path)


def load_adkv_params(path: str | Path, bits: int) -> dict[str, list[ADKVParams]]:
    """The ``bits``-bit parameters saved by :func:`save_adkv_params`: ``{"keys": [...],
    "values": [...]}`` with one entry per calibrated layer.

    Raises:
        InputError: If the file is missing, is not an ADKV parameter file, or lacks ``bits``.
    """
    if not Path(path).is_file():
        raise InputError(f"ADKV parameter file {str(path)!r} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "params" not in state:
        raise InputError(f"{str(path)!r} is not an ADKV parameter file (no 'params' entry)")
    if bits not in state["params"]:
        raise InputError(
            f"{str(path)!r} holds ADKV parameters for bits {sorted(state['params'])}, not {bits}"
        )
    return {
        kind: [ADKVParams.from_state_dict(s) for s in per_layer]
        for kind, per_layer in state["params"][bits].items()
    }
