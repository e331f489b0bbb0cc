"""``torch.optim.Muon`` for sharded parameters (FSDP2's ``fully_shard``, ``DTensor``s).

``torch.optim.Muon`` runs its Newton–Schulz iteration on whatever tensor it gets. On a ``DTensor``
sharded on dimension 0 the matrix products then go through ``DTensor``'s sharding propagation:
it works, but with a dozen implicit all-gathers and all-reduces per matrix and step, and for tall
matrices (``d_out > d_in``, transposed inside the iteration) the Gram matrix is summed in bfloat16
as per-rank partial sums, so the update differs from the unsharded one by bfloat16 rounding (about
``1e-3`` of the update after a few steps). :class:`Muon` is the same optimizer with the
orthogonalization run on the gathered full matrix (one all-gather per matrix and step); each rank
keeps its shard of the result. Momentum, weight decay and the update itself stay on the local
shards.
"""

from typing import Any

import torch
from torch import Tensor
from torch.optim import _muon
from torch.optim.optimizer import _to_scalar

from ada_modules.optim._dtensor import is_dtensor, shard_like

__all__ = ["Muon"]


class Muon(_muon.Muon):
    """``torch.optim.Muon`` whose orthogonalization sees the full matrix of sharded parameters.

    Same arguments, defaults, state (``momentum_buffer``, a ``DTensor`` for a ``DTensor``
    parameter, as distributed checkpoints expect) and, on ordinary tensors, the same arithmetic as
    ``torch.optim.Muon`` (the same bfloat16 Newton–Schulz function), so it is a drop-in
    replacement. For a ``DTensor`` parameter the momentum update runs on the local shards, the
    Newton–Schulz iteration on ``full_tensor()`` of the update (computed identically on every
    rank), and each rank keeps its part: the step equals ``torch.optim.Muon``'s on the unsharded
    model bit for bit, given the same gradients.

    In YAML, e.g. with ``CausalLMModule``'s ``optimizer``/``aux_optimizer`` pair::

        optimizer:
          class_path: ada_modules.optim.Muon
          init_args: {lr: 0.02}
        aux_optimizer:
          class_path: torch.optim.AdamW
          init_args: {lr: 3.0e-4}

    Examples:
        >>> net = torch.nn.Linear(8, 4, bias=False)
        >>> twin = torch.nn.Linear(8, 4, bias=False)
        >>> _ = twin.load_state_dict(net.state_dict())
        >>> opts = Muon(net.parameters(), lr=0.02), torch.optim.Muon(twin.parameters(), lr=0.02)
        >>> for model, opt in zip((net, twin), opts):
        ...     model(torch.ones(3, 8)).square().sum().backward()
        ...     _ = opt.step()
        >>> torch.equal(net.weight, twin.weight)
        True
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Take one step (``torch.optim.Muon``'s), orthogonalizing sharded updates in full."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr = _to_scalar(group["lr"])
            momentum, decay = group["momentum"], group["weight_decay"]
            for param, grad, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                ortho = _muon._zeropower_via_newtonschulz(
                    update.full_tensor() if is_dtensor(update) else update,
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                )
                adjusted_lr = _muon._adjust_lr(lr, group["adjust_lr_fn"], param.shape)
                param.mul_(1 - lr * decay)
                param.add_(shard_like(ortho, update), alpha=-adjusted_lr)
        return loss
