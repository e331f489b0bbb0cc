"""Multi-stream residuals: Hyper-Connections and manifold-constrained Hyper-Connections (mHC).

The hidden state ``x`` (batch, ..., dim) becomes ``n`` parallel streams ``X`` (batch, n, ...,
dim). Around every sub-layer ``F`` (attention, MLP, spectral mixing) a :class:`MultiStreamResidual`

- aggregates the streams into the sub-layer's input with weights ``a`` (``h = sum_s a_s X_s``),
- redistributes the output with weights ``b`` and mixes the streams with a matrix ``M``:
  ``X'_i = sum_j M_ij X_j + b_i F(h)``.

``kind="hyper"`` is Hyper-Connections (Zhu et al., ICLR 2025): ``a``, ``b`` and ``M`` free,
initialised to ``e_(l mod n)``, ``1`` and ``I`` (``l`` the sub-layer's index). ``kind="mhc"`` is
the manifold-constrained form (Xie et al., arXiv 2512.24880) that AOT-POT (arXiv 2605.15793) puts
into an operator transformer: ``a = sigmoid(.)`` and ``b = 2 sigmoid(.)`` are non-negative and
``M`` is doubly stochastic, obtained from logits by Sinkhorn normalisation in fp32
(``mixing="sinkhorn"``, or ``"sinkhorn_log"`` in the log domain) or as a convex combination of
the ``n!`` permutation matrices (``"permutation"``, exact, for ``n <= 5``).

With ``dynamic="token"`` (per position) or ``"pooled"`` (per sample, from the mean over
positions) the weights depend on the input: logits = static + ``alpha * (features @ W)`` with
``W`` zero at init. ``dynamic_input="stream"`` projects each RMS-normalised stream alone
(``dim * (n + 2)`` parameters per sub-layer, as in dynamic Hyper-Connections);
``"flat"`` projects the concatenation of all streams (``n * dim * (n^2 + 2n)``, as in mHC).

At init every stream is a copy of ``x`` and the weights keep them equal, so the stack computes the
plain residual network up to rounding; the mean over streams is the output. ``disable=True`` is
exactly (bitwise) the plain residual ``x + F(x)``, with one stream.

Example:
    >>> import torch
    >>> from torch import nn
    >>> blocks = [nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(4)]
    >>> stack = MultiStreamStack(blocks, dim=8, n_streams=4, kind="mhc")
    >>> stack(torch.randn(2, 5, 8)).shape
    torch.Size([2, 5, 8])
    >>> m = stack.layers[0].mixing_matrix()
    >>> bool(torch.allclose(m.sum(-1), torch.ones(4))), bool(torch.allclose(m.sum(-2), torch.ones(4)))
    (True, True)
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from ada_modules.errors import InputError

__all__ = [
    "MultiStreamResidual",
    "MultiStreamStack",
    "expand_streams",
    "permutation_matrices",
    "reduce_streams",
    "sinkhorn",
]

Kind = Literal["hyper", "mhc"]
Mixing = Literal["sinkhorn", "sinkhorn_log", "permutation"]
Dynamic = Literal["none", "token", "pooled"]
DynamicInput = Literal["stream", "flat"]

_MAX_PERMUTATION_STREAMS = 5  # 5! = 120 matrices; 6! = 720 is past any sensible use
_PRE_INIT = 0.9  # mHC: share of the aggregation on stream l mod n at init (the rest spread evenly)


def sinkhorn(logits: torch.Tensor, iters: int = 20, log_domain: bool = False) -> torch.Tensor:
    """Doubly stochastic matrices from ``logits`` (..., n, n) by Sinkhorn-Knopp, in fp32.

    Alternates column and row normalisation of ``exp(logits)``, ``iters`` times each, ending with
    the rows: rows sum to 1 to rounding, columns to within the iteration's residual (about 1e-3
    after 20 iterations for logits of scale 1). ``log_domain=True`` normalises with
    ``logsumexp`` instead, which stays finite for any logit scale.

    Examples:
        >>> m = sinkhorn(torch.randn(3, 4, 4), iters=50)
        >>> bool(torch.allclose(m.sum(-1), torch.ones(3, 4), atol=1e-6))
        True
        >>> bool(torch.allclose(m.sum(-2), torch.ones(3, 4), atol=1e-4))
        True
    """
    _check_int("iters", iters, 1)
    x = logits.float()
    if log_domain:
        for _ in range(iters):
            x = x - torch.logsumexp(x, dim=-2, keepdim=True)
            x = x - torch.logsumexp(x, dim=-1, keepdim=True)
        return x.exp()
    # the result is invariant to scaling rows and columns: subtracting each row's and then each
    # column's maximum leaves a 1 in every row and column, so none underflows to 0 (0 / 0 = NaN)
    x = x - x.amax(dim=-1, keepdim=True)
    m = (x - x.amax(dim=-2, keepdim=True)).exp()
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)
        m = m / m.sum(dim=-1, keepdim=True)
    return m


def permutation_matrices(n: int) -> torch.Tensor:
    """All ``n!`` permutation matrices of size ``n``, shape ``(n!, n, n)``; the identity first.

    Examples:
        >>> permutation_matrices(3).shape
        torch.Size([6, 3, 3])
    """
    _check_int("n", n, 1)
    eye = torch.eye(n)
    return torch.stack([eye[list(p)] for p in itertools.permutations(range(n))])


def expand_streams(x: torch.Tensor, n_streams: int) -> torch.Tensor:
    """``x`` (batch, ...) copied into ``n_streams`` streams: (batch, n_streams, ...).

    Examples:
        >>> expand_streams(torch.zeros(2, 3), 4).shape
        torch.Size([2, 4, 3])
    """
    _check_int("n_streams", n_streams, 1)
    return x.unsqueeze(1).expand(x.shape[0], n_streams, *x.shape[1:])


def reduce_streams(streams: torch.Tensor) -> torch.Tensor:
    """The mean of the streams (batch, n, ...) -> (batch, ...); one stream is returned as is.

    Examples:
        >>> reduce_streams(torch.ones(2, 4, 3)).shape
        torch.Size([2, 3])
    """
    if streams.shape[1] == 1:
        return streams.squeeze(1)
    return streams.mean(dim=1)


class MultiStreamResidual(nn.Module):
    """One sub-layer ``branch`` with a multi-stream (hyper-connection) residual around it.

    Takes and returns streams ``(batch, n_streams, *branch_input_shape_without_batch)``; the
    branch sees ``(batch, ...)`` as usual, with the channel axis last (``channel_first=False``,
    e.g. ``(batch, tokens, dim)``) or second (``channel_first=True``, e.g. ``(batch, dim, H, W)``
    for convolutional or FNO blocks). The streams' mixing weights are computed in fp32.

    Args:
        branch: The sub-layer ``F``; its output has the shape of its input. Extra forward
            arguments are passed to it.
        dim: Channels of the hidden state.
        n_streams: Number of streams ``n`` (at least 1).
        kind: ``"hyper"`` (free weights) or ``"mhc"`` (non-negative aggregation and
            redistribution, doubly stochastic mixing).
        mixing: How ``"mhc"`` makes the mixing matrix doubly stochastic: ``"sinkhorn"``,
            ``"sinkhorn_log"`` or ``"permutation"`` (needs ``n_streams <= 5``).
        dynamic: ``"none"`` (static weights), ``"token"`` (per position) or ``"pooled"`` (per
            sample).
        dynamic_input: ``"stream"`` (each stream projected alone) or ``"flat"`` (all streams
            concatenated), see the module docstring.
        dynamic_scale: Initial value of the learnable scales ``alpha`` of the dynamic terms.
        sinkhorn_iters: Sinkhorn iterations (at least 1).
        layer_index: Index ``l`` of this sub-layer in the stack: the stream it reads at init.
        channel_first: Channels on axis 1 of the branch's input instead of the last axis.
        disable: The plain residual ``x + F(x)`` instead (one stream, no parameters).

    Raises:
        ValueError: If an argument is out of range, naming it.

    Examples:
        >>> layer = MultiStreamResidual(nn.Linear(8, 8), dim=8, n_streams=2)
        >>> layer(torch.randn(3, 2, 5, 8)).shape
        torch.Size([3, 2, 5, 8])
        >>> sorted(layer.no_weight_decay())
        ['dynamic_alpha', 'post_static', 'pre_static', 'res_static']
    """

    geometry_role = "routing"  # optim.param_groups: never spectrally normed nor given to Muon

    def __init__(
        self,
        branch: nn.Module,
        dim: int,
        n_streams: int = 4,
        *,
        kind: Kind = "mhc",
        mixing: Mixing = "sinkhorn",
        dynamic: Dynamic = "token",
        dynamic_input: DynamicInput = "stream",
        dynamic_scale: float = 1e-2,
        sinkhorn_iters: int = 20,
        layer_index: int = 0,
        channel_first: bool = False,
        disable: bool = False,
    ) -> None:
        super().__init__()
        _check_int("dim", dim, 1)
        _check_int("n_streams", n_streams, 1)
        _check_int("sinkhorn_iters", sinkhorn_iters, 1)
        _check_int("layer_index", layer_index, 0)
        _check_choice("kind", kind, ("hyper", "mhc"))
        _check_choice("mixing", mixing, ("sinkhorn", "sinkhorn_log", "permutation"))
        _check_choice("dynamic", dynamic, ("none", "token", "pooled"))
        _check_choice("dynamic_input", dynamic_input, ("stream", "flat"))
        if disable and n_streams != 1:
            raise InputError(
                f"disable=True is the plain residual: n_streams must be 1, got {n_streams}"
            )
        if kind == "mhc" and mixing == "permutation" and n_streams > _MAX_PERMUTATION_STREAMS:
            raise InputError(
                f"mixing='permutation' needs n_streams <= {_MAX_PERMUTATION_STREAMS} "
                f"({n_streams}! matrices), got n_streams={n_streams}"
            )
        if (
            isinstance(dynamic_scale, bool)
            or not isinstance(dynamic_scale, numbers.Real)
            or not math.isfinite(dynamic_scale)
        ):
            raise InputError(f"dynamic_scale must be a finite number, got {dynamic_scale!r}")
        self.branch = branch
        self.dim, self.n_streams, self.kind, self.mixing = dim, n_streams, kind, mixing
        self.dynamic, self.dynamic_input = dynamic, dynamic_input
        self.sinkhorn_iters, self.layer_index = sinkhorn_iters, layer_index
        self.channel_first, self.disable = channel_first, disable
        if disable:
            return
        n = n_streams
        self.permutation = kind == "mhc" and mixing == "permutation"
        num_mix = math.factorial(n) if self.permutation else n * n
        pre, post, res = _static_init(kind, n, layer_index, self.permutation)
        self.pre_static = nn.Parameter(pre)
        self.post_static = nn.Parameter(post)
        self.res_static = nn.Parameter(res)
        if self.permutation:
            self.register_buffer("permutations", permutation_matrices(n), persistent=False)
        if dynamic == "none":
            return
        if dynamic_input == "stream":
            mix_out = num_mix if self.permutation else n  # a row of M per stream
            shape = (2 + mix_out, dim)
        else:
            shape = (2 * n + num_mix, n * dim)
        self.dynamic_weight = nn.Parameter(torch.zeros(shape))
        self.dynamic_alpha = nn.Parameter(torch.full((3,), float(dynamic_scale)))

    def no_weight_decay(self) -> set[str]:
        """Names of the connection weights that must not be decayed (static weights, scales)."""
        if self.disable:
            return set()
        names = {"pre_static", "post_static", "res_static"}
        return names | ({"dynamic_alpha"} if self.dynamic != "none" else set())

    def extra_repr(self) -> str:
        if self.disable:
            return "disable=True"
        return (
            f"dim={self.dim}, n_streams={self.n_streams}, kind={self.kind!r}, "
            f"mixing={self.mixing!r}, dynamic={self.dynamic!r}, layer_index={self.layer_index}"
        )

    def _logits(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre, post and mixing logits for streams ``z`` (batch, *positions, n, dim), in fp32."""
        n = self.n_streams
        pre, post, res = self.pre_static.float(), self.post_static.float(), self.res_static.float()
        if self.dynamic == "none":
            return pre, post, res
        feats = z.float()
        if self.dynamic_input == "flat":
            feats = feats.flatten(-2)
        feats = feats * torch.rsqrt(feats.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.dynamic == "pooled":
            positions = tuple(range(1, feats.dim() - (2 if self.dynamic_input == "stream" else 1)))
            if positions:
                feats = feats.mean(dim=positions, keepdim=True)
        out = feats @ self.dynamic_weight.float().t()
        alpha = self.dynamic_alpha.float()
        if self.dynamic_input == "stream":  # out (..., n, 2 + mix)
            dyn_pre, dyn_post, dyn_res = out[..., 0], out[..., 1], out[..., 2:]
            if self.permutation:
                dyn_res = dyn_res.mean(-2)
        else:  # out (..., 2n + mix)
            dyn_pre, dyn_post, dyn_res = out[..., :n], out[..., n : 2 * n], out[..., 2 * n :]
            if not self.permutation:
                dyn_res = dyn_res.unflatten(-1, (n, n))
        if self.kind == "hyper":
            dyn_pre, dyn_post, dyn_res = dyn_pre.tanh(), dyn_post.tanh(), dyn_res.tanh()
        return pre + alpha[0] * dyn_pre, post + alpha[1] * dyn_post, res + alpha[2] * dyn_res

    def weights(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Aggregation ``a`` (..., n), redistribution ``b`` (..., n), mixing ``M`` (..., n, n).

        ``z`` holds the streams as (batch, *positions, n, dim); the leading dimensions of the
        weights broadcast against (batch, *positions): none for ``dynamic="none"``.
        """
        pre, post, res = self._logits(z)
        if self.kind == "hyper":
            return pre, post, res
        pre, post = pre.sigmoid(), 2 * post.sigmoid()
        if self.permutation:
            mix = torch.einsum("...k,kij->...ij", res.softmax(-1), self.permutations.float())
        else:
            mix = sinkhorn(res, self.sinkhorn_iters, log_domain=self.mixing == "sinkhorn_log")
        return pre, post, mix

    @torch.no_grad()
    def mixing_matrix(self) -> torch.Tensor:
        """The static part's mixing matrix ``M`` (n, n) (the whole of it for ``dynamic="none"``)."""
        if self.disable:
            return torch.ones(1, 1)
        saved, self.dynamic = self.dynamic, "none"
        try:
            return self.weights(torch.zeros(1, self.n_streams, self.dim))[2]
        finally:
            self.dynamic = saved

    def forward(self, streams: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if streams.dim() < 3 or streams.shape[1] != self.n_streams:
            raise InputError(
                f"expected streams (batch, {self.n_streams}, ...), got shape {tuple(streams.shape)}"
            )
        channels = streams.shape[2] if self.channel_first else streams.shape[-1]
        if channels != self.dim:
            axis = "axis 2 (channel_first)" if self.channel_first else "the last axis"
            raise InputError(
                f"expected dim={self.dim} channels on {axis} of the streams, got shape "
                f"{tuple(streams.shape)}"
            )
        if self.disable:
            return streams + self.branch(streams.squeeze(1), *args, **kwargs).unsqueeze(1)
        # z: (batch, *positions, n, dim)
        z = streams.movedim(2, -1) if self.channel_first else streams
        z = z.movedim(1, -2)
        # in fp32, also under autocast: weights rounded to bf16 no longer sum to 1, and the
        # streams would drift where the plain residual's fp32 addition does not
        with torch.autocast(z.device.type, enabled=False):
            pre, post, mix = self.weights(z)
            h = (pre.unsqueeze(-1) * z.float()).sum(-2).to(z.dtype)
        y = self.branch(h.movedim(-1, 1) if self.channel_first else h, *args, **kwargs)
        if self.channel_first:
            y = y.movedim(1, -1)
        with torch.autocast(z.device.type, enabled=False):
            out = mix @ z.float() + post.unsqueeze(-1) * y.float().unsqueeze(-2)
        out = out.to(z.dtype).movedim(-2, 1)
        return out.movedim(-1, 2) if self.channel_first else out


class MultiStreamStack(nn.Module):
    """A stack of sub-layers with multi-stream residuals: expand, the layers, the stream mean.

    Each entry of ``blocks`` is one sub-layer ``F`` (without its own residual); this is the
    trunk-level wrapper (streams must persist across all layers, not be reduced after each).

    Args:
        blocks: The sub-layers, in order.
        dim: Channels of the hidden state.
        n_streams: Number of streams (set to 1 by ``disable=True``).
        **kwargs: Arguments of :class:`MultiStreamResidual` (``kind``, ``mixing``, ``dynamic``,
            ``dynamic_input``, ``dynamic_scale``, ``sinkhorn_iters``, ``channel_first``,
            ``disable``); ``layer_index`` is each block's position.

    Examples:
        >>> blocks = [nn.Linear(4, 4) for _ in range(3)]
        >>> plain = MultiStreamStack(blocks, dim=4, disable=True)
        >>> x = torch.randn(2, 4)
        >>> y = x
        >>> for block in blocks:
        ...     y = y + block(y)
        >>> bool(torch.equal(plain(x), y))
        True
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        dim: int,
        n_streams: int = 4,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if "layer_index" in kwargs:
            raise InputError("layer_index is set per block by MultiStreamStack; do not pass it")
        if not blocks:
            raise InputError("blocks must not be empty")
        n = 1 if kwargs.get("disable") else n_streams
        self.n_streams = n
        self.layers = nn.ModuleList(
            MultiStreamResidual(block, dim, n, layer_index=i, **kwargs)
            for i, block in enumerate(blocks)
        )

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        streams = expand_streams(x, self.n_streams)
        for layer in self.layers:
            streams = layer(streams, *args, **kwargs)
        return reduce_streams(streams)

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this module) of the static connection weights."""
        return {
            f"layers.{i}.{name}"
            for i, layer in enumerate(self.layers)
            for name in layer.no_weight_decay()
        }

    @torch.no_grad()
    def composite_gain(self) -> float:
        """Largest absolute row sum of the product of the static mixing matrices (1 for mHC)."""
        product = torch.eye(self.n_streams)
        for layer in self.layers:
            product = layer.mixing_matrix() @ product
        return float(product.abs().sum(-1).max())


def _static_init(
    kind: str, n: int, layer_index: int, permutation: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Initial static pre, post and mixing parameters; every choice keeps equal streams equal."""
    reads = layer_index % n
    if kind == "hyper":
        return torch.eye(n)[reads], torch.ones(n), torch.eye(n)
    # mHC: sigmoid(pre) puts _PRE_INIT on stream l mod n and the rest evenly (sum 1), so h = x at
    # init; 2 sigmoid(0) = 1; mixing logits: the identity's (eye, or the identity permutation) 1.
    if n == 1:
        pre = torch.full((1,), 20.0)  # sigmoid(20) = 1 - 2e-9: one stream reads itself
    else:
        rest = (1 - _PRE_INIT) / (n - 1)
        pre = torch.full((n,), math.log(rest / (1 - rest)))
        pre[reads] = math.log(_PRE_INIT / (1 - _PRE_INIT))
    res = torch.zeros(math.factorial(n)) if permutation else torch.eye(n)
    if permutation:
        res[0] = 1.0
    return pre, torch.zeros(n), res


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InputError(f"{name} must be one of {allowed}, got {value!r}")
