"""Model merging methods and their baselines (AMARIS).

Parameter-space merges (:func:`task_arithmetic`, :func:`ties`, :func:`dare`) need only state
dicts; :func:`regmean` and :func:`amaris` also need activation statistics of the linear layers'
inputs (:func:`collect_activation_stats`), and :func:`fisher_merge` a diagonal Fisher
(:func:`collect_fisher`). All take and return ``Mapping[str, Tensor]`` state dicts and never modify
their inputs. Tied weights (one tensor under several keys, e.g. an embedding and the output head)
are merged once, under their first key, and every key of the tie gets the one merged tensor.

Examples:
    >>> import torch
    >>> from ada_modules.merging import task_arithmetic
    >>> task_arithmetic({"w": torch.zeros(2)}, [{"w": torch.ones(2)}], weights=[0.5])["w"].tolist()
    [0.5, 0.5]
"""

from ada_modules.merging.amaris import (
    LayerReport,
    amaris,
    amaris_layer,
    generalized_eigh,
    output_deviation,
    select_directions,
)
from ada_modules.merging.fisher import fisher_merge
from ada_modules.merging.parameter_space import dare, task_arithmetic, ties
from ada_modules.merging.regmean import regmean
from ada_modules.merging.state_dicts import check_compatible, linear_layers, task_vectors
from ada_modules.merging.stats import (
    ActivationCollector,
    ActivationStats,
    check_stats,
    collect_activation_stats,
    collect_fisher,
    load_stats,
    save_stats,
)

__all__ = [
    "ActivationCollector",
    "ActivationStats",
    "LayerReport",
    "amaris",
    "amaris_layer",
    "check_compatible",
    "check_stats",
    "collect_activation_stats",
    "collect_fisher",
    "dare",
    "fisher_merge",
    "generalized_eigh",
    "linear_layers",
    "load_stats",
    "output_deviation",
    "regmean",
    "save_stats",
    "select_directions",
    "task_arithmetic",
    "task_vectors",
    "ties",
]
