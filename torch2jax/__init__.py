"""torch2jax: run PyTorch programs on JAX.

>>> import torch, torch2jax as t2j
>>> with t2j.env():
...     x = torch.randn(4, 8, device="jax")
...     y = (x @ x.T).relu().sum()
>>> y.item()
"""

from . import device as _device
from . import ops as _ops
from . import pytree as _pytree  # noqa: F401
from . import parallel, train
from .dispatch import DeviceMismatchError, OpError, coverage, path_of
from .env import Config, config, disable, enable, env, manual_seed, rng_key
from .checkpoint import load, load_safetensors, save
from .compile import CompiledModule, compile
from . import control_flow
from . import flex_attention as _flex_attention
from .control_flow import checkpoint, cond, fori_loop, scan, while_loop
from .layer_scan import scan_layers, use_scan_layers
from .export import export
from .interop import call_jax, call_torch, functionalize, jax_view, torch_view
from .jit import JitError, JitFunction, explain_recompiles, jit
from .tensor import Tensor

_device.register_factories(_ops.registry.LOWERINGS)
control_flow.install_torch_higher_order_ops()
_flex_attention.install_flex_attention()

# Integrations that pull in optional machinery are imported on first use:
# ``t2j.amp``, ``t2j.quantize``, ``t2j.offload``, ``t2j.debug``, ``t2j.modules``,
# ``t2j.dynamo`` (which torch.compile(backend="torch2jax") imports through the
# package's entry point), ``t2j.fx``.
_LAZY_SUBMODULES = ("amp", "quantize", "offload", "debug", "modules", "dynamo", "fx")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CompiledModule",
    "Config",
    "DeviceMismatchError",
    "JitError",
    "JitFunction",
    "OpError",
    "Tensor",
    "call_jax",
    "call_torch",
    "checkpoint",
    "compile",
    "cond",
    "fori_loop",
    "config",
    "coverage",
    "disable",
    "enable",
    "env",
    "explain_recompiles",
    "export",
    "functionalize",
    "jax_view",
    "jit",
    "load",
    "load_safetensors",
    "parallel",
    "manual_seed",
    "path_of",
    "rng_key",
    "save",
    "scan",
    "scan_layers",
    "torch_view",
    "train",
    "use_scan_layers",
    "while_loop",
]
__version__ = "0.1.0"
