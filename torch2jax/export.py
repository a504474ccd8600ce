"""`t2j.export`: a torch module as a `jax.export.Exported` (StableHLO), runnable without torch.

The exported function is pure: ``exported.call(state, rng_key, *args)`` returns
``(outputs, new_buffers, new_rng_key)``. The module's parameters and buffers
(``state``, see `t2j.functionalize`) and the RNG key are explicit inputs, and buffer
updates (BatchNorm statistics, counters) and the advanced key are explicit
outputs, so nothing is frozen in or dropped.

Example::

    exp = t2j.export(model, torch.randn(2, 16))
    exp.mlir_module()                       # StableHLO text
    blob = exp.serialize()                  # bytes; jax.export.deserialize(blob).call(...)
"""

from __future__ import annotations

import jax
import torch
from jax import export as jax_export

from .env import default_rng
from .interop import functionalize
from .tensor import Tensor, jax_array


def _arg_specs(args, dynamic_shapes):
    """ShapeDtypeStructs of the example arguments."""
    if dynamic_shapes:
        raise NotImplementedError(
            "t2j.export: symbolic dimensions (dynamic_shapes) are not supported yet: a torch2jax tensor's sizes must "
            "be concrete while torch's shape logic runs; export one program per shape for now"
        )
    arrays = [a._value() if isinstance(a, Tensor) else jax_array(a) for a in args]
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def export(module, *args, dynamic_shapes=None, platforms=None, **kwargs) -> jax_export.Exported:
    """Export ``module`` called on ``args`` (example tensors) to a `jax.export.Exported`;
    ``kwargs`` are non-tensor arguments of the forward, fixed in the export
    (``use_cache=False``).

    (``dynamic_shapes``, torch.export's symbolic dimensions, is not supported yet
    and raises.) The exported function takes
    ``(state, rng_key, *args)`` and returns ``(outputs, new_buffers, new_rng_key)``;
    ``state`` is the second value of `t2j.functionalize(module)`. A
    ``torch.export.ExportedProgram`` is accepted too (its module is exported).

    >>> exp = t2j.export(model, x)
    >>> fn, state = t2j.functionalize(model)
    >>> out, buffers, key = exp.call(state, jax.random.key(0), x.jax())
    """
    if isinstance(module, torch.export.ExportedProgram):
        module = module.module()
    fn, state = functionalize(module)

    def run(state, key, *arrays):
        # random ops draw from `key`; the advanced key is an output
        with default_rng.traced_key(key) as r:
            out, new_state = fn.apply(state, *arrays, **kwargs)
        return out, new_state["buffers"], r.key

    specs = _arg_specs(args, dynamic_shapes)
    state_specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    key_spec = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    with jax.enable_x64(True):
        return jax_export.export(jax.jit(run), platforms=platforms)(state_specs, key_spec, *specs)
