"""Plain ``nn.Module`` building blocks usable without Lightning (neural cellular automata, residual
connectivity, multi-stream residuals, operator networks, ...)."""

from ada_modules.nn.ahpa import HierarchicalPriorAligner
from ada_modules.nn.ahpa_router import TimestepRouter, coarse_to_fine_prior
from ada_modules.nn.anca import (
    DeformablePerception,
    NeuralCellularAutomaton,
    deform_conv2d_reference,
)
from ada_modules.nn.ancre import (
    ANCReStack,
    RoutedBlock,
    export_hard,
    find_routers,
    wrap_module_list,
)
from ada_modules.nn.ancre_adapters import (
    ConnectivityWrapper,
    MLPResNet,
    wrap_diffusers_dit,
    wrap_hf_decoder,
    wrap_timm,
)
from ada_modules.nn.ancre_router import ConnectivityRouter
from ada_modules.nn.image_prefix_lm import ImagePrefixLM
from ada_modules.nn.moe import MoELayer, Routing, StackedExperts, load_balancing_loss
from ada_modules.nn.multistream import (
    MultiStreamResidual,
    MultiStreamStack,
    expand_streams,
    permutation_matrices,
    reduce_streams,
    sinkhorn,
)
from ada_modules.nn.multistream_adapters import (
    MLPStreamNet,
    StreamBlock,
    StreamsWrapper,
    stream_no_weight_decay,
    wrap_diffusers_dit_streams,
    wrap_hf_decoder_streams,
    wrap_timm_streams,
)
from ada_modules.nn.operator_transformer import OperatorTransformer
from ada_modules.nn.spectral_mixing import SpectralMixing

__all__ = [
    "HierarchicalPriorAligner",
    "TimestepRouter",
    "coarse_to_fine_prior",
    "ImagePrefixLM",
    "DeformablePerception",
    "NeuralCellularAutomaton",
    "deform_conv2d_reference",
    "ANCReStack",
    "ConnectivityRouter",
    "ConnectivityWrapper",
    "MLPResNet",
    "RoutedBlock",
    "export_hard",
    "find_routers",
    "wrap_diffusers_dit",
    "wrap_hf_decoder",
    "wrap_module_list",
    "wrap_timm",
    "MoELayer",
    "Routing",
    "StackedExperts",
    "load_balancing_loss",
    "MultiStreamResidual",
    "MultiStreamStack",
    "expand_streams",
    "permutation_matrices",
    "reduce_streams",
    "sinkhorn",
    "MLPStreamNet",
    "StreamBlock",
    "StreamsWrapper",
    "stream_no_weight_decay",
    "wrap_diffusers_dit_streams",
    "wrap_hf_decoder_streams",
    "wrap_timm_streams",
    "OperatorTransformer",
    "SpectralMixing",
]
