"""``torch.optim.Optimizer`` subclasses, their reference baselines, param-group helpers and
learning-rate schedules usable from YAML by class path.

- :class:`AcceleGradSharp` (AcceleGrad#) and :class:`AcceleGrad` (Levy et al., 2018),
- :class:`Scion` (norm-constrained LMO steps, constrained and unconstrained),
- :mod:`ada_modules.optim.lmo` (norms with their dual norms, LMOs and sharp operators) and
  :func:`newton_schulz`,
- :func:`geometry_param_groups` (which layer gets which norm), :func:`split_param_groups`,
  :func:`weight_decay_param_groups` (decay on matrices only) and :func:`check_param_coverage`,
- :class:`OptimizerChain` (e.g. Muon on hidden matrices and AdamW on the rest, as one optimizer),
- :class:`Muon`: ``torch.optim.Muon`` that orthogonalizes sharded (FSDP2 ``DTensor``) parameters
  on their full matrix,
- :class:`WarmupCosineLR`.

The optimizers take parameters sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``,
``DTensor`` parameters and states) and then step as on the unsharded model.
"""

from ada_modules.optim import lmo
from ada_modules.optim.accelegrad import AcceleGrad
from ada_modules.optim.accelegrad_sharp import AcceleGradSharp
from ada_modules.optim.chain import OptimizerChain
from ada_modules.optim.lr_schedulers import WarmupCosineLR
from ada_modules.optim.muon import Muon
from ada_modules.optim.newton_schulz import newton_schulz
from ada_modules.optim.param_groups import (
    check_param_coverage,
    geometry_param_groups,
    split_param_groups,
    weight_decay_param_groups,
)
from ada_modules.optim.scion import Scion

__all__ = [
    "AcceleGrad",
    "AcceleGradSharp",
    "Muon",
    "OptimizerChain",
    "Scion",
    "WarmupCosineLR",
    "check_param_coverage",
    "geometry_param_groups",
    "split_param_groups",
    "weight_decay_param_groups",
    "lmo",
    "newton_schulz",
]
