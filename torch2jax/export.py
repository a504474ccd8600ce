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

With ``dynamic_shapes`` (torch.export's format: `torch.export.Dim` per dimension)
the module goes through ``torch.export.export`` and ``run_decompositions``, and
its ATen graph is traced by `torch2jax.fx.run` under `jax.export` with symbolic
dimensions (`jax.export.symbolic_shape`) constrained to the Dims' ranges: one
program for every size in range::

    batch, seq = Dim("batch", max=64), Dim("seq", max=512)
    exp = t2j.export(model, ids, dynamic_shapes={"input_ids": {0: batch, 1: seq}}, use_cache=False)
    exp.call(state, key, ids_2x7)  ;  exp.call(state, key, ids_5x30)
"""

from __future__ import annotations

from collections.abc import Mapping

import copy
import inspect

import jax
import sympy
import torch
import torch.utils._pytree as torch_pytree
from jax import export as jax_export
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind

from . import dtypes as _dt
from . import fx
from .env import default_rng
from .interop import Functional, functionalize
from .pytree import ensure_jax_pytree
from .tensor import Tensor, jax_array, torch_cpu


def _arg_specs(args):
    """ShapeDtypeStructs of the example arguments."""
    return [jax.ShapeDtypeStruct(a.shape, a._value().dtype) if isinstance(a, Tensor)
            else jax.ShapeDtypeStruct(tuple(a.shape), _default_dtype(a.dtype)) for a in args]


def _default_dtype(dtype):
    """The dtype JAX gives an array of torch ``dtype`` made where the exported program is
    called: int64 / float64 only under x64."""
    return jax.dtypes.canonicalize_dtype(_dt.to_jax(dtype))


def export(module, *args, dynamic_shapes=None, platforms=None, **kwargs) -> jax_export.Exported:
    """Export ``module`` called on ``args`` (example tensors) to a `jax.export.Exported`;
    ``kwargs`` are non-tensor arguments of the forward, fixed in the export
    (``use_cache=False``).

    ``dynamic_shapes`` makes dimensions symbolic, in torch.export's format: a
    `torch.export.Dim` (or ``Dim.AUTO`` / ``Dim.DYNAMIC`` / ``Dim.STATIC`` / None)
    per dimension, given per argument as a tuple or as a dict keyed by the
    forward's argument names; the program then runs at any size in the Dims'
    ranges. The exported function takes
    ``(state, rng_key, *args)`` and returns ``(outputs, new_buffers, new_rng_key)``;
    ``state`` is the second value of `t2j.functionalize(module)`. A
    ``torch.export.ExportedProgram`` is accepted too (its module is exported).

    >>> exp = t2j.export(model, x)
    >>> fn, state = t2j.functionalize(model)
    >>> out, buffers, key = exp.call(state, jax.random.key(0), x.jax())
    """
    if isinstance(module, torch.export.ExportedProgram):
        module = module.module()
    if dynamic_shapes is not None:
        return _export_symbolic(module, args, kwargs, dynamic_shapes, platforms)
    _, state = functionalize(module)
    fn = Functional(module, x64=True)

    def run(state, key, *arrays):
        # random ops draw from `key`; the advanced key is an output
        with default_rng.traced_key(key) as r:
            out, new_state = fn.apply(state, *arrays, **kwargs)
        return out, new_state["buffers"], r.key

    return _export_jitted(run, state, _arg_specs(args), platforms)


def _export_jitted(run, state, arg_specs, platforms):
    """`jax.export` of ``run(state, key, *args)``. The state's specs are its arrays' own
    dtypes (int64 buffers of a module on the jax device stay int64); the arguments'
    follow JAX's defaults where they were made (int64 ids are int32 without x64)."""
    def plain_run(state, key, *args):
        out, buffers, key = run(state, key, *args)
        return _plain(out), buffers, key

    with jax.enable_x64(True):
        state_specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        return jax_export.export(jax.jit(plain_run), platforms=platforms)(state_specs, _key_spec(), *arg_specs)


def _plain(tree):
    """``tree`` with its containers made plain dicts, tuples and lists: an HF ``ModelOutput``
    (a dict of its fields that are set) or a named tuple would otherwise need its class
    registered wherever the serialized program is loaded, which may have no torch."""
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return tuple(_plain(v) for v in tree)
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    return tree


def _key_spec():
    return jax.ShapeDtypeStruct((), jax.random.key(0).dtype)


# ---------------------------------------------------------------------------
# symbolic dimensions: torch.export's graph traced by torch2jax.fx under jax.export
# ---------------------------------------------------------------------------


class _Bound(torch.nn.Module):
    """``module`` with its non-tensor keyword arguments fixed: the exported signature
    is the tensors alone."""

    def __init__(self, module, kwargs):
        super().__init__()
        self.module = module
        self.kwargs = kwargs

    def forward(self, *args):
        return self.module(*args, **self.kwargs)


_PREFIX = "module."


def _is_dim_spec(leaf):
    return leaf is None or isinstance(leaf, (Dim, torch.export.dynamic_shapes._DimHint, int))


def _check_spec(spec, where):
    """Refuse anything but torch.export's per-dimension specs, naming where it is."""
    if isinstance(spec, dict):
        for k, v in spec.items():
            _check_spec(v, f"{where}[{k!r}]")
    elif isinstance(spec, (list, tuple)):
        for i, v in enumerate(spec):
            _check_spec(v, f"{where}[{i}]")
    elif not _is_dim_spec(spec):
        raise TypeError(
            f"t2j.export: {where} is {spec!r}; expected a torch.export.Dim (Dim('batch', min=1, max=64)), "
            f"Dim.AUTO / Dim.DYNAMIC / Dim.STATIC, an int or None for each dimension"
        )


def _positional_spec(module, args, dynamic_shapes):
    """``dynamic_shapes`` as one entry per positional argument (a dict is keyed by the
    names of the forward's arguments)."""
    if not isinstance(dynamic_shapes, dict):
        if len(dynamic_shapes) != len(args):
            raise ValueError(
                f"t2j.export: dynamic_shapes has {len(dynamic_shapes)} entries for {len(args)} tensor arguments"
            )
        return tuple(dynamic_shapes)
    names = list(inspect.signature(module.forward).bind_partial(*args).arguments)
    unknown = sorted(set(dynamic_shapes) - set(names))
    if unknown:
        raise ValueError(
            f"t2j.export: dynamic_shapes names {unknown}, which are not tensor arguments of "
            f"{type(module).__name__}.forward given here (expected some of {names})"
        )
    return tuple(dynamic_shapes.get(name) for name in names)


def _cpu_module(module):
    """torch.export traces CPU tensors: a module on the jax device is copied to the CPU."""
    tensors = [*module.parameters(), *module.buffers()]
    return copy.deepcopy(module).cpu() if any(isinstance(t, Tensor) for t in tensors) else module


def _cpu(t):
    return torch_cpu(t._value()) if isinstance(t, Tensor) else t


def _dim_text(size):
    """A torch size (int or SymInt) as jax.export's dimension syntax."""
    if isinstance(size, int):
        return str(size)
    expr = size.node.expr
    if not expr.is_polynomial() or any(isinstance(a, sympy.Function) for a in sympy.preorder_traversal(expr)):
        raise NotImplementedError(f"t2j.export: the input dimension {expr} has no jax.export equivalent")
    return str(expr)


def _constraints(range_constraints):
    """jax.export constraints from torch.export's ranges (JAX dims are already >= 1)."""
    out = []
    for symbol, vr in range_constraints.items():
        if not isinstance(symbol, sympy.Symbol):
            continue
        if int(vr.lower) > 1:
            out.append(f"{symbol} >= {int(vr.lower)}")
        if isinstance(vr.upper, sympy.Integer):  # not int_oo
            out.append(f"{symbol} <= {int(vr.upper)}")
    return out


def _symbolic_specs(ep):
    """ShapeDtypeStructs of the user inputs of ``ep``, with symbolic dimensions."""
    scope = jax_export.SymbolicScope(_constraints(ep.range_constraints))
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    specs = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        val = placeholders[spec.arg.name].meta["val"]
        text = ", ".join(_dim_text(d) for d in val.shape)
        shape = jax_export.symbolic_shape(text, scope=scope) if text else ()
        specs.append(jax.ShapeDtypeStruct(shape, _default_dtype(val.dtype)))
    return specs


def _canonical_names(module):
    """Each parameter and buffer name -> the name `functionalize`'s state keeps for that
    tensor (tied weights appear there once, under their first name)."""
    first, names = {}, {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names[name] = first.setdefault(id(t), name)
    return names


def _graph_inputs(ep, names, state, arrays):
    """The flat inputs of ``ep``'s graph: parameters, buffers, constants and user inputs."""
    user = iter(arrays)
    flat = []
    for spec in ep.graph_signature.input_specs:
        name = names.get(spec.target[len(_PREFIX):]) if spec.target else None
        if spec.kind == InputKind.PARAMETER:
            flat.append(state["params"][name])
        elif spec.kind == InputKind.BUFFER:
            flat.append(state["buffers"][name])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            flat.append(jax_array(ep.constants[spec.target]))
        elif spec.kind == InputKind.USER_INPUT:
            flat.append(next(user))
        else:
            raise NotImplementedError(f"t2j.export: a graph input of kind {spec.kind.name} is not supported")
    return flat


def _graph_outputs(ep, names, outs, buffers):
    """(user outputs in the module's structure, buffers with the graph's mutations)."""
    buffers = dict(buffers)
    user = []
    for spec, value in zip(ep.graph_signature.output_specs, outs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            buffers[names[spec.target[len(_PREFIX):]]] = value
        elif spec.kind == OutputKind.USER_OUTPUT:
            user.append(value)
        else:
            raise NotImplementedError(f"t2j.export: a graph output of kind {spec.kind.name} is not supported")
    out = torch_pytree.tree_unflatten(user, ep.call_spec.out_spec)
    ensure_jax_pytree(out)
    return out, buffers


def _export_symbolic(module, args, kwargs, dynamic_shapes, platforms):
    _check_spec(dynamic_shapes, "dynamic_shapes")
    spec = _positional_spec(module, args, dynamic_shapes)
    _, state = functionalize(module)  # the caller's state: its dtypes are the signature's
    names = _canonical_names(module)
    cpu_args = tuple(_cpu(a) for a in args)
    # _Bound.forward takes *args: torch.export sees one argument, the tuple of tensors
    ep = torch.export.export(_Bound(_cpu_module(module), kwargs), cpu_args, dynamic_shapes=(spec,), strict=False)
    ep = ep.run_decompositions(fx.decompositions())

    def run(state, key, *arrays):
        with default_rng.traced_key(key) as r:
            outs = fx.run(ep.graph_module, *_graph_inputs(ep, names, state, arrays))
        out, buffers = _graph_outputs(ep, names, outs, state["buffers"])
        return out, buffers, r.key

    return _export_jitted(run, state, _symbolic_specs(ep), platforms)
