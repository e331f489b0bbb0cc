"""Plain ``nn.Module`` building blocks usable without Lightning (residual connectivity, NCA cells, ...)."""

from ada_modules.nn.ancre import (
    ANCReStack,
    ConnectivityRouter,
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
from ada_modules.nn.moe import MoELayer, Routing, StackedExperts, load_balancing_loss

__all__ = [
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
]
