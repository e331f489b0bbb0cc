"""ADKV calibration: SGD through the quantizer unrolled as an RNN (issue 15).

The ADKV codec (:mod:`ada_modules.kv.adkv`) is integer and fixed-point, so it has no gradient.
:class:`ADKVCalibrationModule` trains a float relaxation of the same recursion
(:func:`_relaxed_code`) on the attention-output error by truncated backpropagation through time,
with the codec's rounding of the parameters in the forward pass (straight-through), and hands out
the codec's parameters (:meth:`ADKVCalibrationModule.to_params`). Validation and test run the
real codec.

Reconstruction choices (the paper's code is not public), each tried against the alternative on
RoPE-drift data and on a synthetic stream with fast per-channel drift:

- The step rule is calibrated within the EMA family of :meth:`ADKVParams.ema
  <ada_modules.kv.adkv.ADKVParams.ema>` (per channel: the log-step rate ``beta`` and the gain
  ``kappa``; the table is ``beta * log2(kappa * |v|)`` in octaves), not as a free table per code
  magnitude: with free entries, Adam moved the rarely used outer entries as fast as the inner ones
  and within 15 steps a table made the step grow without bound (the loss reached 1e35).
- The step increment has a soft surrogate gradient (see :func:`_relaxed_code`); with the plain
  straight-through gradient, calibration raised the held-out error.
- The parameters are rounded to the codec's grid in the forward pass: the float optimum of the
  relaxation has table entries finer than eighth-octaves, which round to a different rule.

The calibrated parameters are written with :func:`~ada_modules.kv.adkv.save_adkv_params` (read
them with :func:`~ada_modules.kv.adkv.load_adkv_params`): a ``torch.save`` of::

    {"bits": [2, 4], "keyframe_period": 512,
     "params": {2: {"keys": [ADKVParams.state_dict() per layer], "values": [...]}, 4: {...}}}
"""

import math
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import MeanMetric

from ada_modules.errors import InputError
from ada_modules.kernels.adkv_decode import (
    EXPONENT_LIMIT,
    STEP_RESOLUTION,
    adkv_dequantize_reference,
)
from ada_modules.kernels.kv_quant import SUPPORTED_BITS
from ada_modules.kv.adkv import (
    DEFAULT_BETA,
    ADKVParams,
    _mean_log2_level,
    adkv_encode,
    check_keyframe_period,
    save_adkv_params,
)
from ada_modules.kv.kv_study import (
    attention_output,
    attention_relative_mse,
    groupwise_keys,
    groupwise_values,
    pre_rope_per_channel_keys,
    static_per_channel,
)

__all__ = ["EVAL_ARMS", "ADKVCalibrationModule"]

EVAL_ARMS = ("fp", "kivi", "static", "pre_rope", "adkv_uncalibrated", "adkv")
"""Quantizers ``test`` can evaluate (``eval_arm``); see :class:`ADKVCalibrationModule`."""

_KINDS = ("keys", "values")
_MULTIPLIER_LIMIT = 127  # int8
_LOG2_STEP_LIMIT = EXPONENT_LIMIT / STEP_RESOLUTION  # the codec's bound on the step, in octaves
_SOFT_BIN_WIDTH = 0.5
"""Width, in steps, of the sigmoid edges of the soft step increment in :func:`_relaxed_code`."""


def _straight_through(x: torch.Tensor, forward: torch.Tensor) -> torch.Tensor:
    """``forward``'s values with the gradient of ``x`` (the straight-through estimator)."""
    return x + (forward - x).detach()


def _ema_table(beta_logit: torch.Tensor, log2_kappa: torch.Tensor, bits: int) -> torch.Tensor:
    """The EMA step rule's table ``beta * log2(kappa * |v|)`` in octaves, ``(..., 2**(bits-1))``
    for the code magnitudes ``|v| = 1/2, 3/2, ...`` (``beta = sigmoid(beta_logit)``)."""
    magnitudes = torch.arange(2 ** (bits - 1), device=beta_logit.device) + 0.5
    beta = torch.sigmoid(beta_logit).unsqueeze(-1)
    return beta * (magnitudes.log2() + log2_kappa.unsqueeze(-1))


def _codec_rounding(
    alpha_logit: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The centre rate and step table the codec will use, with straight-through gradients.

    ``alpha = sigmoid(alpha_logit)`` rounds to ``(alpha_code + 1) / 256`` with ``alpha_code =
    clamp(round(256 * alpha) - 1, 0, 255)``; the table (octaves, ``(..., levels)``, increasing) to
    ``multipliers / 8`` with ``multipliers = round(8 * table)`` clamped to ``±127``, the first
    entry at most -1 and the last at least +1 (so the step both shrinks and grows; a table whose
    entries are all >= 0 would only let it grow).

    Returns:
        ``(alpha, table)``: the codec's values, with the gradients of the unrounded ones.
    """
    alpha = torch.sigmoid(alpha_logit)
    alpha_q = (torch.round(alpha * 256) - 1).clamp(0, 255) + 1
    m = (table * STEP_RESOLUTION).round().clamp(-_MULTIPLIER_LIMIT, _MULTIPLIER_LIMIT)
    m = torch.cat((m[..., :1].clamp_max(-1), m[..., 1:-1], m[..., -1:].clamp_min(1)), dim=-1)
    return (
        _straight_through(alpha, alpha_q / 256),
        _straight_through(table, m / STEP_RESOLUTION),
    )


def _relaxed_init(
    first_block: torch.Tensor, log2_init_gain: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial centre and log2 step of :func:`_relaxed_code`, as the encoder's first keyframe.

    The centre is the mean of ``first_block`` (``(..., tokens, D)``, the first ``keyframe_period``
    tokens), the step ``init_gain`` times its spread (std; ``|mean| / 8`` or 1 where it is 0),
    rounded to eighth-octaves with a straight-through gradient, as in
    :class:`~ada_modules.kv.adkv.ADKVEncoder` (which also rounds the centre to fp16).

    Returns:
        ``(centre, log2_step)``, each ``(..., D)``; the step carries the gradient of the gain.
    """
    mean = first_block.mean(-2)
    spread = first_block.std(-2, correction=0)
    spread = torch.where(spread > 0, spread, mean.abs() / 8)
    spread = torch.where(spread > 0, spread, torch.ones_like(spread))
    log2_step = (spread.log2() + log2_init_gain).clamp(-_LOG2_STEP_LIMIT, _LOG2_STEP_LIMIT)
    rounded = torch.round(log2_step * STEP_RESOLUTION) / STEP_RESOLUTION
    return mean, _straight_through(log2_step, rounded)


def _relaxed_code(
    x: torch.Tensor,
    centre: torch.Tensor,
    log2_step: torch.Tensor,
    alpha: torch.Tensor,
    table: torch.Tensor,
    half_levels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the ADKV recursion in float over ``x`` (``(..., tokens, D)``), differentiably.

    Per token, with ``L = 2 * half_levels`` levels and the state ``(mu, log2 s)`` of each channel:
    ``z = (x - mu) / s``; the code ``c = clamp(floor(z + L/2), 0, L - 1)`` and its mid-rise level
    ``v = c - L/2 + 1/2``; ``x_hat = mu + s * v``; then ``mu += alpha * s * v`` and
    ``log2 s += table[j]`` with the magnitude index ``j = |2v| // 2``. These forward values are
    the codec's, except that the codec keeps the centre in fixed point, uses 7-bit step mantissas,
    rounds the centre to fp16 at keyframes (snapshots of the state, otherwise without effect) and
    avoids codes that would move the step more than 16 octaves from its keyframe's.

    Gradients (straight-through: forward values unchanged):

    - ``v`` is seen as ``clamp(z, -L/2, L/2)``: the LSQ gradients (the step gets ``v - z``
      inside the range, the centre only from overloaded tokens). ``alpha`` reaches the loss
      through later centres, the table through later steps, the initial step through everything.
    - The step increment is seen as the soft lookup
      ``table[0] + sum_k sigmoid((|z| - k) / w) * (table[k] - table[k-1])`` with ``w`` =
      :data:`_SOFT_BIN_WIDTH` (the hard lookup is ``w -> 0``). Through ``|z|`` it carries the
      feedback of the step rule (a larger step gives smaller codes, which shrink it again); the
      hard lookup alone sees a change of the table as a drift of all later steps.

    Args:
        x: States ``(..., tokens, D)``.
        centre: ``mu`` before the first token, ``(..., D)``.
        log2_step: ``log2 s`` before the first token, ``(..., D)``.
        alpha: Centre rates, ``(..., D)``.
        table: Log2-step increments (octaves) per code magnitude, ``(..., D, levels)``; entries
            past ``half_levels`` must repeat the last one (they are never used).
        half_levels: ``2**(bits - 1)``, broadcastable to ``(..., D)`` (one per bit width when
            several widths are stacked in the leading dims).

    Returns:
        ``(x_hat, centre, log2_step)``: the reconstruction ``(..., tokens, D)`` and the state after
        the last token (detach it to truncate backpropagation there).
    """
    edges = torch.arange(1, table.shape[-1], dtype=table.dtype, device=table.device)
    rises = table.diff(dim=-1)
    outputs = []
    for t in range(x.shape[-2]):
        step = torch.exp2(log2_step)
        z = (x[..., t, :] - centre) / step
        with torch.no_grad():
            code = torch.minimum(torch.floor(z + half_levels).clamp_min(0), 2 * half_levels - 1)
            level = code - half_levels + 0.5
            magnitude = (level.abs() - 0.5).long().unsqueeze(-1)
        clamped = torch.maximum(torch.minimum(z, half_levels), -half_levels)
        v = _straight_through(clamped, level)
        outputs.append(centre + step * v)
        centre = centre + alpha * step * v
        soft = table[..., 0] + (
            torch.sigmoid((z.abs().unsqueeze(-1) - edges) / _SOFT_BIN_WIDTH) * rises
        ).sum(-1)
        increment = _straight_through(soft, table.gather(-1, magnitude).squeeze(-1))
        log2_step = (log2_step + increment).clamp(-_LOG2_STEP_LIMIT, _LOG2_STEP_LIMIT)
    return torch.stack(outputs, dim=-2), centre, log2_step


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise InputError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_bits_list(bits: object) -> list[int]:
    widths = [bits] if isinstance(bits, Integral) and not isinstance(bits, bool) else bits
    if (
        isinstance(widths, (str, bytes))
        or not isinstance(widths, Sequence)
        or not widths
        or any(isinstance(b, bool) or b not in SUPPORTED_BITS for b in widths)
        or len(set(widths)) != len(widths)
    ):
        raise InputError(
            f"bits must be one of {SUPPORTED_BITS} or a non-empty list of distinct ones, "
            f"got {bits!r}"
        )
    return [int(b) for b in widths]


class ADKVCalibrationModule(LightningModule):
    """Calibrates ADKV parameters by SGD through the quantizer unrolled as an RNN.

    Learnable, per ``(bits, keys|values, layer, head, channel)``, initialised at
    :meth:`ADKVParams.default <ada_modules.kv.adkv.ADKVParams.default>`: the centre rate
    (``alpha = sigmoid(alpha_logit)``), the EMA step rule's rate and gain (``beta =
    sigmoid(beta_logit)``, ``log2_kappa``; table ``beta * log2(kappa * |v|)``) and the log2 initial
    gain. One run calibrates every width in ``bits``.

    **Training** (manual optimization, one Adam step per batch): the keys and values of the batch
    (all widths at once) go through the relaxation of the codec (:func:`_relaxed_code`) in chunks
    of ``bptt_length`` tokens. The loss of a chunk is the relative MSE of the attention output of
    the batch's queries over that chunk's keys and values (reconstructed vs true; grouped-query
    attention when there are more query heads); it is backpropagated at once and the state
    (centre, step) detached before the next chunk (truncated BPTT: memory is bounded by one
    chunk). Gradients of all chunks add up; the loss is the mean over chunks and widths. Logs
    ``train/loss`` and ``train/loss_b{bits}``.

    **Validation** runs the real codec (:func:`~ada_modules.kv.adkv.adkv_encode`, prefix-sum
    decode) with the calibrated parameters (:meth:`to_params`) and with the defaults, and logs
    ``val/rel_mse_b{bits}`` and ``val/rel_mse_uncalibrated_b{bits}``: the attention-output
    relative error (:func:`~ada_modules.kv.kv_study.attention_relative_mse`, queries after the
    whole sequence), over the split as a ratio of sums.

    **Test** evaluates ``eval_arm`` (one of :data:`EVAL_ARMS`) at ``eval_bits``: ``"fp"`` (no
    quantization), ``"kivi"`` (group-wise keys and values, ``kivi_group_size``), ``"static"``
    (per channel over the whole sequence), ``"pre_rope"`` (per-channel pre-RoPE keys from
    ``batch["keys_pre_rope"]``, group-wise values), ``"adkv_uncalibrated"``, ``"adkv"``. Logs
    ``test/rel_mse`` (keys and values quantized), ``test/key_rel_mse`` (keys only) and, per
    element of keys and values, ``test/code_bits``, ``test/metadata_bits`` and ``test/total_bits``,
    all as ratios of sums over the split. ADKV metadata: the keyframes plus the stored
    parameters (``alpha_code``, ``multipliers``), counted once per sequence; ``"fp"`` counts the
    states in their dtype.

    Batches are dicts: ``keys`` and ``values`` ``(B, num_heads, T, head_dim)``, ``queries``
    ``(B, Hq, Nq, head_dim)`` with ``Hq`` a multiple of ``num_heads``, optionally
    ``keys_pre_rope`` (like ``keys``) and ``layer`` (int ``(B,)``: the layer whose parameters a
    sequence uses; 0 when absent), as :class:`~ada_modules.data.rope_drift.RopeDriftDataModule`
    and :class:`~ada_modules.data.kv_capture.CapturedKVDataModule` serve them.

    Args:
        num_heads: Key/value heads per layer.
        head_dim: Channels per head.
        bits: Bit width(s) to calibrate.
        num_layers: Layers, each with its own parameters.
        keyframe_period: Tokens per keyframe segment; the first ``keyframe_period`` tokens set the
            initial state.
        bptt_length: Tokens per truncated-BPTT chunk.
        lr: Adam learning rate.
        params_path: Where ``on_fit_end`` writes the calibrated parameters (see the module
            docstring); ``None``: nowhere.
        eval_arm: Quantizer evaluated by ``test``.
        eval_bits: Bit width of ``test``, one of ``bits`` (default: the first).
        kivi_group_size: Group size of the group-wise parts of the ``"kivi"`` and ``"pre_rope"``
            arms.

    Raises:
        InputError: If an argument is out of range, naming it; at a batch whose shapes do not
            fit the module (e.g. another ``head_dim``), naming both values.

    Examples:
        >>> module = ADKVCalibrationModule(num_heads=2, head_dim=16, bits=[2, 4])
        >>> params = module.to_params(4, "keys")  # at init: the defaults, one per channel
        >>> tuple(params.multipliers.shape), params.multipliers[0, 0].tolist()
        ((2, 16, 8), [-1, 0, 0, 1, 1, 1, 2, 2])
        >>> bool((params.alpha_code == ADKVParams.default(4).alpha_code).all())
        True

        In YAML (``ada fit -c cli_configs/adkv/calibrate.yaml``)::

            model:
              class_path: ada_modules.models.ADKVCalibrationModule
              init_args: {num_heads: 2, head_dim: 64, bits: [2, 4],
                          params_path: runs/adkv_calibration/adkv_params.pt}
    """

    def __init__(
        self,
        num_heads: int = 2,
        head_dim: int = 64,
        bits: int | Sequence[int] = (2, 4),
        num_layers: int = 1,
        keyframe_period: int = 512,
        bptt_length: int = 256,
        lr: float = 0.05,
        params_path: str | None = None,
        eval_arm: str = "adkv",
        eval_bits: int | None = None,
        kivi_group_size: int = 32,
    ) -> None:
        super().__init__()
        self.num_heads = _check_int("num_heads", num_heads, 1)
        self.head_dim = _check_int("head_dim", head_dim, 1)
        self.bits = _check_bits_list(bits)
        self.num_layers = _check_int("num_layers", num_layers, 1)
        self.keyframe_period = check_keyframe_period(keyframe_period)
        self.bptt_length = _check_int("bptt_length", bptt_length, 1)
        self.kivi_group_size = _check_int("kivi_group_size", kivi_group_size, 1)
        if isinstance(lr, bool) or not isinstance(lr, Real) or not math.isfinite(lr) or lr <= 0:
            raise InputError(f"lr must be a finite number > 0, got {lr!r}")
        if params_path is not None and not isinstance(params_path, (str, Path)):
            raise InputError(f"params_path must be a path or None, got {params_path!r}")
        if eval_arm not in EVAL_ARMS:
            raise InputError(f"eval_arm must be one of {EVAL_ARMS}, got {eval_arm!r}")
        if eval_bits is not None and (isinstance(eval_bits, bool) or eval_bits not in self.bits):
            raise InputError(f"eval_bits must be one of bits={self.bits}, got {eval_bits!r}")
        # The test settings are not saved: `ada test --ckpt_path` takes its hyperparameters from
        # the checkpoint, and must still take these from the command line.
        self.save_hyperparameters(
            ignore=["params_path", "eval_arm", "eval_bits", "kivi_group_size"]
        )
        self.lr = float(lr)
        self.params_path = params_path
        self.eval_arm = eval_arm
        self.eval_bits = self.bits[0] if eval_bits is None else int(eval_bits)
        self.automatic_optimization = False

        shape = (self.num_layers, self.num_heads, self.head_dim)
        initial = {}
        for b in self.bits:
            default = ADKVParams.default(b)
            for kind in _KINDS:
                initial[f"b{b}_{kind}_alpha_logit"] = torch.logit(torch.tensor(default.alpha))
                initial[f"b{b}_{kind}_beta_logit"] = torch.logit(torch.tensor(DEFAULT_BETA[b]))
                initial[f"b{b}_{kind}_log2_kappa"] = torch.tensor(-_mean_log2_level(b))
                initial[f"b{b}_{kind}_log2_init_gain"] = default.init_gain.log2()
        self.calibration = nn.ParameterDict(
            {
                name: nn.Parameter(value.float().expand(shape).clone())
                for name, value in initial.items()
            }
        )
        self.val_metrics = nn.ModuleDict(
            {f"rel_mse{arm}_b{b}": MeanMetric() for b in self.bits for arm in ("", "_uncalibrated")}
        )
        self.test_metrics = nn.ModuleDict(
            {
                name: MeanMetric()
                for name in ("rel_mse", "key_rel_mse", "code_bits", "metadata_bits", "total_bits")
            }
        )

    # ------------------------------------------------------------------------------------------
    # Parameters
    # ------------------------------------------------------------------------------------------

    def _check_stream(self, bits: int, kind: str, layer: int) -> None:
        if bits not in self.bits:
            raise InputError(f"bits must be one of the calibrated {self.bits}, got {bits!r}")
        if kind not in _KINDS:
            raise InputError(f"kind must be one of {_KINDS}, got {kind!r}")
        if isinstance(layer, bool) or not isinstance(layer, Integral):
            raise InputError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise InputError(f"layer must lie in [0, {self.num_layers}), got {layer!r}")

    def _rounded(
        self, bits: int, kind: str, layer: torch.Tensor | int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``alpha`` and the table (octaves) of one stream as the codec will use them
        (:func:`_codec_rounding`), for ``layer`` (an index or a tensor of indices)."""
        p = {
            name: self.calibration[f"b{bits}_{kind}_{name}"][layer]
            for name in ("alpha_logit", "beta_logit", "log2_kappa")
        }
        return _codec_rounding(p["alpha_logit"], _ema_table(p["beta_logit"], p["log2_kappa"], bits))

    @torch.no_grad()
    def to_params(self, bits: int, kind: str, layer: int = 0) -> ADKVParams:
        """The calibrated parameters of one stream, as the codec's.

        ``alpha_code = round(256 * alpha) - 1`` clamped to ``[0, 255]``; ``multipliers`` the
        table ``beta * log2(kappa * |v|)`` in eighth-octaves, rounded, clamped to ``±127``, the
        first entry at most -1 and the last at least +1; ``init_gain`` as float32. Shapes
        ``(num_heads, head_dim[, 2**(bits-1)])``.

        Args:
            bits: One of the calibrated widths.
            kind: ``"keys"`` or ``"values"``.
            layer: Layer index.
        """
        self._check_stream(bits, kind, layer)
        alpha, table = self._rounded(bits, kind, layer)
        gain = torch.exp2(self.calibration[f"b{bits}_{kind}_log2_init_gain"][layer])
        return ADKVParams(
            bits=bits,
            alpha_code=(torch.round(alpha * 256) - 1).to(torch.uint8).cpu(),
            multipliers=torch.round(table * STEP_RESOLUTION).to(torch.int8).cpu(),
            init_gain=gain.float().cpu(),
        )

    def save_calibrated_params(self, path: str | Path) -> None:
        """Write :meth:`to_params` of every width, kind and layer to ``path`` with
        :func:`~ada_modules.kv.adkv.save_adkv_params` (creating its folder).

        Examples:
            >>> import tempfile
            >>> from ada_modules.kv.adkv import load_adkv_params
            >>> module = ADKVCalibrationModule(num_heads=2, head_dim=8, num_layers=3)
            >>> path = Path(tempfile.mkdtemp()) / "adkv_params.pt"
            >>> module.save_calibrated_params(path)
            >>> params = load_adkv_params(path, 4)
            >>> len(params["keys"]), tuple(params["values"][2].multipliers.shape)
            (3, (2, 8, 8))
        """
        params = {
            b: {
                kind: [self.to_params(b, kind, i) for i in range(self.num_layers)]
                for kind in _KINDS
            }
            for b in self.bits
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_adkv_params(path, params, keyframe_period=self.keyframe_period)

    def on_fit_end(self) -> None:
        if self.params_path is not None and self.trainer.is_global_zero:
            self.save_calibrated_params(self.params_path)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.calibration.parameters(), lr=self.lr)

    # ------------------------------------------------------------------------------------------
    # Batches
    # ------------------------------------------------------------------------------------------

    def _unpack(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``(queries, keys, values, layer)`` of a checked batch (``layer``: long ``(B,)``)."""
        if not isinstance(batch, Mapping) or not {"keys", "values", "queries"} <= set(batch):
            found = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise InputError(f"a batch must be a dict with keys, values and queries, got {found}")
        keys, values, queries = batch["keys"], batch["values"], batch["queries"]
        for name, t in (("keys", keys), ("values", values), ("queries", queries)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"batch {name} must be a 4-D tensor, got {shape}")
            if t.shape[-1] != self.head_dim:
                raise InputError(
                    f"batch {name} have head_dim {t.shape[-1]}, the module's head_dim is "
                    f"{self.head_dim}"
                )
        if keys.shape[1] != self.num_heads:
            raise InputError(
                f"batch keys have {keys.shape[1]} heads, the module's num_heads is {self.num_heads}"
            )
        if values.shape != keys.shape or keys.shape[-2] == 0:
            raise InputError(
                "batch keys and values must share a shape with at least one token, got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if queries.shape[0] != keys.shape[0] or queries.shape[1] % self.num_heads:
            raise InputError(
                f"batch queries {tuple(queries.shape)} must have the batch size of the keys "
                f"({keys.shape[0]}) and a multiple of num_heads={self.num_heads} heads"
            )
        layer = batch.get("layer")
        if layer is None:
            layer = torch.zeros(keys.shape[0], dtype=torch.long, device=keys.device)
        elif (
            not isinstance(layer, torch.Tensor)
            or layer.shape != (keys.shape[0],)
            or layer.is_floating_point()
            or bool(((layer < 0) | (layer >= self.num_layers)).any())
        ):
            raise InputError(
                f"batch layer must be an int tensor ({keys.shape[0]},) with values in "
                f"[0, {self.num_layers}), got {layer!r}"
            )
        return queries, keys, values, layer.long()

    # ------------------------------------------------------------------------------------------
    # Training: the relaxed coder
    # ------------------------------------------------------------------------------------------

    def _relaxed_params(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_rounded` of every width and kind for each sequence's layer, stacked:
        ``(bits, 2, B, H, D)`` and ``(bits, 2, B, H, D, widest levels)`` (narrower tables
        repeat their last entry)."""
        widest = 2 ** (max(self.bits) - 1)
        alphas, tables = [], []
        for b in self.bits:
            for kind in _KINDS:
                alpha, table = self._rounded(b, kind, layer)
                pad = table[..., -1:].expand(*table.shape[:-1], widest - table.shape[-1])
                alphas.append(alpha)
                tables.append(torch.cat((table, pad), dim=-1))
        shape = (len(self.bits), len(_KINDS))
        return torch.stack(alphas).unflatten(0, shape), torch.stack(tables).unflatten(0, shape)

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        queries, keys, values, layer = self._unpack(batch)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x = torch.stack((keys, values)).float()  # (2, B, H, T, D), broadcast over the widths
        half_levels = torch.tensor([2.0 ** (b - 1) for b in self.bits], device=x.device)
        half_levels = half_levels.view(-1, 1, 1, 1, 1)
        gains = [
            self.calibration[f"b{b}_{k}_log2_init_gain"][layer] for b in self.bits for k in _KINDS
        ]
        centre, log2_step = _relaxed_init(
            x[..., : self.keyframe_period, :],
            torch.stack(gains).unflatten(0, (len(self.bits), len(_KINDS))),
        )
        tokens = x.shape[-2]
        chunks = range(0, tokens, self.bptt_length)
        totals = torch.zeros(len(self.bits), device=x.device)
        for start in chunks:
            end = min(start + self.bptt_length, tokens)
            alpha, table = self._relaxed_params(layer)  # again per chunk: backward frees them
            x_hat, centre, log2_step = _relaxed_code(
                x[..., start:end, :], centre, log2_step, alpha, table, half_levels
            )
            losses = torch.stack(
                [
                    attention_relative_mse(
                        queries, keys[..., start:end, :], values[..., start:end, :], k, v
                    )
                    for k, v in x_hat
                ]
            )
            self.manual_backward(losses.sum() / (len(chunks) * len(self.bits)))
            centre, log2_step = centre.detach(), log2_step.detach()
            totals += losses.detach()
        optimizer.step()
        per_bits = totals / len(chunks)
        batch_size = keys.shape[0]
        self.log("train/loss", per_bits.mean(), prog_bar=True, batch_size=batch_size)
        for b, loss in zip(self.bits, per_bits, strict=True):
            self.log(f"train/loss_b{b}", loss, batch_size=batch_size)
        return per_bits.mean()

    # ------------------------------------------------------------------------------------------
    # Evaluation: the real codec and the baselines
    # ------------------------------------------------------------------------------------------

    def _adkv(
        self, x: torch.Tensor, params: Sequence[ADKVParams], layer: torch.Tensor
    ) -> tuple[torch.Tensor, int, int]:
        """Encode and decode ``x`` with the codec, each sequence with its layer's parameters.

        Returns:
            ``(x_hat, code_bits, metadata_bits)``; metadata: keyframes plus the stored parameters
            once per sequence.
        """
        x_hat = torch.empty_like(x, dtype=torch.float32)
        code_bits = metadata_bits = 0
        for index in layer.unique().tolist():
            rows = (layer == index).nonzero().squeeze(-1)
            packed = adkv_encode(x[rows], params[index], self.keyframe_period)
            x_hat[rows] = adkv_dequantize_reference(packed).to(x_hat)
            code_bits += 8 * packed.code_nbytes()
            metadata_bits += 8 * (packed.keyframe_nbytes() + len(rows) * packed.parameter_nbytes())
        return x_hat, code_bits, metadata_bits

    def _codec_params(self, bits: int, calibrated: bool) -> dict[str, list[ADKVParams]]:
        if calibrated:
            return {
                kind: [self.to_params(bits, kind, i) for i in range(self.num_layers)]
                for kind in _KINDS
            }
        return {kind: [ADKVParams.default(bits)] * self.num_layers for kind in _KINDS}

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        queries, keys, values, layer = self._unpack(batch)
        weight = attention_output(queries, keys, values).square().sum()
        for b in self.bits:
            for arm, calibrated in (("", True), ("_uncalibrated", False)):
                params = self._codec_params(b, calibrated)
                keys_hat = self._adkv(keys, params["keys"], layer)[0]
                values_hat = self._adkv(values, params["values"], layer)[0]
                metric = self.val_metrics[f"rel_mse{arm}_b{b}"]
                metric.update(
                    attention_relative_mse(queries, keys, values, keys_hat, values_hat), weight
                )
                self.log(f"val/rel_mse{arm}_b{b}", metric, on_step=False, on_epoch=True)

    def _quantize_arm(
        self,
        batch: Mapping[str, torch.Tensor],
        keys: torch.Tensor,
        values: torch.Tensor,
        layer: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """``(keys_hat, values_hat, code_bits, metadata_bits)`` of ``eval_arm`` at ``eval_bits``."""
        bits, arm = self.eval_bits, self.eval_arm
        if arm == "fp":  # an fp16 cache: 16 bits per element, no metadata
            return keys, values, 16 * (keys.numel() + values.numel()), 0
        if arm in ("adkv", "adkv_uncalibrated"):
            params = self._codec_params(bits, calibrated=arm == "adkv")
            k = self._adkv(keys, params["keys"], layer)
            v = self._adkv(values, params["values"], layer)
            return k[0], v[0], k[1] + v[1], k[2] + v[2]
        # The group-wise and static baselines quantize fp16 states, as an fp16 cache holds them,
        # so that their scales and zero points are counted at 16 bits each.
        keys, values = keys.half(), values.half()
        if arm == "kivi":
            k = groupwise_keys(keys, bits, self.kivi_group_size)
            v = groupwise_values(values, bits, self.kivi_group_size)
        elif arm == "static":
            k, v = static_per_channel(keys, bits), static_per_channel(values, bits)
        else:
            if "keys_pre_rope" not in batch:
                raise InputError("eval_arm='pre_rope' needs batches with keys_pre_rope")
            k = pre_rope_per_channel_keys(batch["keys_pre_rope"].half(), bits)
            v = groupwise_values(values, bits, self.kivi_group_size)
        return (
            k.values.float(),
            v.values.float(),
            k.code_bits + v.code_bits,
            k.metadata_bits + v.metadata_bits,
        )

    def test_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        queries, keys, values, layer = self._unpack(batch)
        keys_hat, values_hat, code_bits, metadata_bits = self._quantize_arm(
            batch, keys, values, layer
        )
        weight = attention_output(queries, keys, values).square().sum()
        elements = keys.numel() + values.numel()
        updates = {
            "rel_mse": (
                attention_relative_mse(queries, keys, values, keys_hat, values_hat),
                weight,
            ),
            "key_rel_mse": (
                attention_relative_mse(queries, keys, values, keys_hat, values),
                weight,
            ),
            "code_bits": (code_bits / elements, elements),
            "metadata_bits": (metadata_bits / elements, elements),
            "total_bits": ((code_bits + metadata_bits) / elements, elements),
        }
        for name, (value, count) in updates.items():
            metric = self.test_metrics[name]
            metric.update(torch.as_tensor(value, dtype=torch.float32), count)
            self.log(f"test/{name}", metric, on_step=False, on_epoch=True)
