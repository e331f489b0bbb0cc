"""``torch.optim.Optimizer`` subclasses, their reference baselines, param-group helpers and
learning-rate schedules usable from YAML by class path.

- :class:`AcceleGradSharp` (AcceleGrad#) and :class:`AcceleGrad` (Levy et al., 2018),
- :class:`Scion` (norm-constrained LMO steps, constrained and unconstrained),
- :mod:`ada_modules.optim.lmo` (norms with their dual norms, LMOs and sharp operators) and
  :func:`newton_schulz`,
- :func:`geometry_param_groups` (which layer gets which norm), :func:`split_param_groups` and
  :func:`weight_decay_param_groups` (decay on matrices only),
- :class:`OptimizerChain` (e.g. Muon on hidden matrices and AdamW on the rest, as one optimizer),
- :class:`WarmupCosineLR`.
"""

from ada_modules.optim import lmo
from ada_modules.optim.accelegrad import AcceleGrad
from ada_modules.optim.accelegrad_sharp import AcceleGradSharp
from ada_modules.optim.chain import OptimizerChain
from ada_modules.optim.lr_schedulers import WarmupCosineLR
from ada_modules.optim.newton_schulz import newton_schulz
from ada_modules.optim.param_groups import (
    geometry_param_groups,
    split_param_groups,
    weight_decay_param_groups,
)
from ada_modules.optim.scion import Scion

__all__ = [
    "AcceleGrad",
    "AcceleGradSharp",
    "OptimizerChain",
    "Scion",
    "WarmupCosineLR",
    "geometry_param_groups",
    "split_param_groups",
    "weight_decay_param_groups",
    "lmo",
    "newton_schulz",
]
