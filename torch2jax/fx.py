"""Run an ATen-level `torch.fx.GraphModule` on jax.Arrays with torch2jax's lowerings.

The graphs AOTAutograd hands a Dynamo backend and the graphs of
``torch.export.export(...).run_decompositions()`` are functional ATen programs.
`run` walks one node by node: each op runs its lowering from `torch2jax.ops`
(view ops their forward function: the graph is functional, so nothing is
written back through them), and an op without one goes through the dispatcher
(`torch2jax.dispatch`: decomposition, composite kernel, host fallback) on
`torch2jax.Tensor` wrappers of the arrays. Size nodes (``aten.sym_size``) and the
integer arithmetic on them run on the arrays' shapes, which under
`jax.export` are symbolic dimensions (`jax.export.symbolic_shape`): the same
interpreter serves `t2j.export` with dynamic shapes.

Example::

    gm = torch.export.export(model, (x,)).run_decompositions(t2j.fx.decompositions()).module()
    out = jax.jit(lambda *a: t2j.fx.run(gm, *a))(*params_and_inputs)
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src import core as _jax_core

from . import dtypes as _dt
from . import symbolic as _sym
from .dispatch import DECOMPOSITION_DENYLIST, OpError
from .ops import nn as _nn
from .ops import registry as _reg
from .tensor import DEVICE, Tensor, jax_array, new_tensor

aten = torch.ops.aten


def decompositions() -> dict:
    """torch's decompositions without the ops torch2jax lowers directly: what AOTAutograd
    / `run_decompositions` should apply before `run`. It holds torch's decomposition
    table and the CompositeImplicitAutograd ops torch.export decomposes by default.

    >>> ep = torch.export.export(model, (x,)).run_decompositions(t2j.fx.decompositions())
    """
    from torch._decomp import decomposition_table

    lowered = set(_reg.LOWERINGS) | set(_reg.VIEWS) | set(_CPU_KERNELS) | DECOMPOSITION_DENYLIST
    table = dict(torch.export.default_decompositions().items())
    table.update(decomposition_table)
    return {op: fn for op, fn in table.items() if isinstance(op, torch._ops.OpOverload) and op not in lowered}


# ---------------------------------------------------------------------------
# integer (size) arithmetic: Python ints or jax symbolic dimensions
# ---------------------------------------------------------------------------


def _sym_max(a, b):
    return _jax_core.max_dim(a, b) if _is_symbolic(a, b) else max(a, b)


def _sym_min(a, b):
    return _jax_core.min_dim(a, b) if _is_symbolic(a, b) else min(a, b)


def _is_symbolic(*values):
    return any(_jax_core.is_symbolic_dim(v) for v in values)


def _sym_float(a):
    if _is_symbolic(a):
        raise OpError(f"torch2jax.fx: torch.sym_float of the symbolic dimension {a} has no JAX equivalent")
    return float(a)


def _sym_ite(condition, then, otherwise):
    """``torch.sym_ite``: Dynamo's int of a captured bool ``t.item()`` is ``sym_ite(b, 1, 0)``; on a
    traced ``b`` both branches are values of the program, one picked by `jnp.where`."""
    if not _sym.is_traced_number(condition):
        return then if condition else otherwise
    values = [_sym.value_of(v) if _sym.is_traced_number(v) else v for v in (condition, then, otherwise)]
    return _sym.traced_number(jnp.where(*values))


# Shape checks torch.export records as nodes; jax.export's symbolic constraints
# (the Dim ranges) already hold them.
_ASSERTS = {
    aten._assert_scalar.default,
    aten.sym_constrain_range.default,
    aten.sym_constrain_range_for_size.default,
    aten._assert_tensor_metadata.default,
}

_PYTHON_FUNCTIONS = {
    torch.sym_max: _sym_max,
    torch.sym_min: _sym_min,
    torch.sym_float: _sym_float,
    torch.sym_int: int,
    torch.sym_not: operator.not_,
    torch.sym_ite: _sym_ite,
}


def _sym_size(x, dim):
    return x.shape[dim]


def _sym_numel(x):
    return math.prod(x.shape)


_SIZE_OPS = {
    aten.sym_size.int: _sym_size,
    aten.sym_numel.default: _sym_numel,
}


# ---------------------------------------------------------------------------
# ops whose sizes may be symbolic: the registered lowerings ask for ints
# ---------------------------------------------------------------------------


def _dtype_or(dtype, default):
    return _dt.to_jax(dtype) if dtype is not None else default


def _scalar_dtype(value):
    """torch's dtype for a tensor filled with Python number ``value``."""
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    return _dt.to_jax(torch.get_default_dtype())


def _full(size, fill_value, *, dtype=None, **_):
    return jnp.full(tuple(size), fill_value, _dtype_or(dtype, _scalar_dtype(fill_value)))


def _filled(value):
    def make(size, *, dtype=None, **_):
        return jnp.full(tuple(size), value, _dtype_or(dtype, _dt.to_jax(torch.get_default_dtype())))

    return make


def _new_filled(value):
    def make(x, size, *, dtype=None, **_):
        return jnp.full(tuple(size), value, _dtype_or(dtype, x.dtype))

    return make


def _new_full(x, size, fill_value, *, dtype=None, **_):
    return jnp.full(tuple(size), fill_value, _dtype_or(dtype, x.dtype))


def _arange(*args, dtype=None, **_):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args + (1,))[:3]
    if any(isinstance(a, float) for a in (start, end, step)):
        raise OpError(f"torch2jax.fx: aten.arange with a symbolic bound takes integer bounds, got {args}")
    dt = _dtype_or(dtype, np.dtype(np.int64))
    n = (end - start + step - 1) // step if step > 0 else (start - end - step - 1) // -step
    return (start + step * jax.lax.iota(dt, n)).astype(dt)


def _reshape(x, size):
    return jnp.reshape(x, tuple(size))


def _expand(x, size, *, implicit=False):
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


_SYMBOLIC_SIZE_OPS = {
    aten.view.default: _reshape,
    aten._unsafe_view.default: _reshape,
    aten.reshape.default: _reshape,
    aten.expand.default: _expand,
    aten.full.default: _full,
    aten.zeros.default: _filled(0),
    aten.ones.default: _filled(1),
    aten.empty.memory_format: _filled(0),
    aten.new_zeros.default: _new_filled(0),
    aten.new_ones.default: _new_filled(1),
    aten.new_empty.default: _new_filled(0),
    aten.new_full.default: _new_full,
    aten.arange.default: _arange,
    aten.arange.start: _arange,
    aten.arange.start_step: _arange,
}


# ---------------------------------------------------------------------------
# ops that only graphs traced on CPU tensors hold
# ---------------------------------------------------------------------------


def _check_no_dropout(op, dropout_p):
    if dropout_p:
        raise OpError(f"torch2jax.fx: {op} with dropout_p={dropout_p} is not supported (its mask is not replayable)")


def _flash_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _check_no_dropout(aten._scaled_dot_product_flash_attention_for_cpu, dropout_p)
    return _nn._attention(q, k, v, attn_mask, 0.0, is_causal, scale, None)


def _flash_cpu_backward(grad, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    _check_no_dropout(aten._scaled_dot_product_flash_attention_for_cpu_backward, dropout_p)

    def attention(q, k, v):
        return _nn._attention(q, k, v, attn_mask, 0.0, is_causal, scale, None)[0]

    return _nn._vjp(attention, (q, k, v), grad)


# torch picks its CPU flash-attention kernel for F.scaled_dot_product_attention
# (without dropout) while AOTAutograd traces CPU tensors; its backward has no
# decomposition.
_CPU_KERNELS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_cpu_backward,
}


def _has_symbolic(value):
    if isinstance(value, (list, tuple)):
        return any(_has_symbolic(v) for v in value)
    return _is_symbolic(value)


# ---------------------------------------------------------------------------
# the interpreter
# ---------------------------------------------------------------------------


def _to_tensor(value):
    if isinstance(value, (jax.Array, jax.core.Tracer, np.ndarray)):
        return new_tensor(jnp.asarray(value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_tensor(v) for v in value)
    return value


def _to_array(value):
    if isinstance(value, Tensor):
        return value._value()
    if isinstance(value, torch.Tensor):
        return jax_array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_array(v) for v in value)
    return value


def _via_dispatch(op, args, kwargs):
    """``op`` through the dispatcher on torch2jax tensors wrapping the arrays."""
    if _has_symbolic((args, list(kwargs.values()))) or any(
        isinstance(a, (jax.Array, jax.core.Tracer)) and _has_symbolic(a.shape) for a in jax.tree.leaves((args, kwargs))
    ):
        raise OpError(
            f"torch2jax.fx: {op} has no JAX lowering, and its decomposition needs concrete sizes; it cannot run "
            f"with symbolic dimensions"
        )
    if "device" in kwargs:
        kwargs = {**kwargs, "device": DEVICE}
    return _to_array(op(*_to_tensor(args), **{k: _to_tensor(v) for k, v in kwargs.items()}))


def call_op(op, args, kwargs):
    """Run ATen op ``op`` (an `OpOverload`) on arrays and Python values; returns arrays."""
    if op in _SIZE_OPS:
        return _SIZE_OPS[op](*args, **kwargs)
    if op in _ASSERTS:
        return None
    if op in _SYMBOLIC_SIZE_OPS and _has_symbolic((args, list(kwargs.values()))):
        return _SYMBOLIC_SIZE_OPS[op](*args, **kwargs)
    args, kwargs = _scalar_values(args), {k: _scalar_values(v) for k, v in kwargs.items()}
    if op in _CPU_KERNELS:
        return _CPU_KERNELS[op](*args, **kwargs)
    if op in _reg.VIEWS:
        return _reg.VIEWS[op][0](*args, **kwargs)
    if op in _reg.LOWERINGS:
        return _lowered(op, args, kwargs)
    if op._schema.is_mutable:
        raise OpError(
            f"torch2jax.fx: {op} mutates its input; the graph must be functional (export it with "
            f"torch.export / AOTAutograd, which functionalize it)"
        )
    return _via_dispatch(op, args, kwargs)


def _scalar_values(a):
    """``a`` with each traced number (a ``t.item()`` of the graph, under Dynamo's
    ``capture_scalar_outputs``) as the value a lowering takes for a Scalar: a weakly typed
    0-d array, as the dispatcher hands it (`symbolic.scalar_value_of`)."""
    if _sym.is_traced_number(a):
        return _sym.scalar_value_of(a)
    if type(a) in (list, tuple):
        return type(a)(map(_scalar_values, a))
    return a


def _lowered(op, args, kwargs):
    try:
        return _reg.LOWERINGS[op](*args, **kwargs)
    except (jax.errors.ConcretizationTypeError, jax.errors.InconclusiveDimensionOperation) as e:
        sizes = [a.shape for a in jax.tree.leaves((args, kwargs)) if isinstance(a, (jax.Array, jax.core.Tracer))]
        if not (_has_symbolic((args, list(kwargs.values()))) or any(_has_symbolic(s) for s in sizes)):
            raise
        raise OpError(
            f"torch2jax.fx: {op} needs concrete sizes to compute where its windows or blocks lie, and its "
            f"operands' sizes are symbolic ({type(e).__name__}); export with those dimensions static "
            "(Dim.STATIC, or leave them out of dynamic_shapes)") from e


def _call_function(target, args, kwargs):
    if isinstance(target, torch._ops.OpOverload):
        return call_op(target, args, kwargs)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _via_dispatch(target, args, kwargs)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _higher_order(target, args, kwargs)
    return _PYTHON_FUNCTIONS.get(target, target)(*args, **kwargs)


def _higher_order(op, args, kwargs):
    if op is torch.ops.higher_order.wrap_with_set_grad_enabled:
        _, body, *rest = args
        return run(body, *rest)
    if op is torch.ops.higher_order.wrap_with_autocast:
        *_, body = args[:5]
        return run(body, *args[5:])
    control_flow = _CONTROL_FLOW.get(op)
    if control_flow is not None:
        return control_flow(*args, **kwargs)
    raise OpError(f"torch2jax.fx: the higher-order op {op} is not supported")


def _outputs(result) -> tuple:
    """A subgraph's outputs as a tuple (a graph returns one value or a sequence of them)."""
    return tuple(result) if isinstance(result, (list, tuple)) else (result,)


def _cond(pred, true_graph, false_graph, operands):
    """``torch.cond`` as `jax.lax.cond`: both branches are traced, one runs."""
    operands = tuple(operands)
    if isinstance(pred, (bool, int)):
        return _outputs(run(true_graph if pred else false_graph, *operands))
    return jax.lax.cond(jnp.reshape(pred, ()).astype(bool), lambda ops: _outputs(run(true_graph, *ops)),
                        lambda ops: _outputs(run(false_graph, *ops)), operands)


def _while_loop(cond_graph, body_graph, carried, additional):
    """``torch._higher_order_ops.while_loop`` as `jax.lax.while_loop`; ``additional`` are the
    inputs the graphs read that the loop does not carry."""
    additional = tuple(additional)

    def keep_going(c):
        (pred,) = _outputs(run(cond_graph, *c, *additional))
        return jnp.reshape(pred, ()).astype(bool)

    return jax.lax.while_loop(keep_going, lambda c: _outputs(run(body_graph, *c, *additional)), tuple(carried))


def _scan(combine_graph, init, xs, additional):
    """``torch._higher_order_ops.scan`` (over dimension 0: torch moved ``dim`` there) as
    `jax.lax.scan`; the result is the final carry followed by the stacked outputs."""
    init, xs, additional = tuple(init), tuple(xs), tuple(additional)

    def step(carry, x):
        out = _outputs(run(combine_graph, *carry, *x, *additional))
        return out[:len(init)], out[len(init):]

    carry, ys = jax.lax.scan(step, init, xs)
    return (*carry, *ys)


_CONTROL_FLOW = {
    torch.ops.higher_order.cond: _cond,
    torch.ops.higher_order.while_loop: _while_loop,
    torch.ops.higher_order.scan: _scan,
}


def _constant(value):
    if isinstance(value, torch.Tensor):
        # (a constant the fake mode traced holds its real value: see tensor._as_fake)
        return _to_array(getattr(value, "constant", None) if _is_fake(value) else value)
    return value


def _is_fake(value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def run(gm: torch.fx.GraphModule, *args):
    """Evaluate the ATen graph of ``gm`` on ``args`` (jax arrays and Python ints for its
    placeholders, in order) and return its output structure with jax arrays.

    >>> gm = make_fx(lambda x: torch.relu(x) * x.shape[0])(torch.randn(3))
    >>> t2j.fx.run(gm, jnp.ones(3))
    Array([3., 3., 3.], dtype=float32)
    """
    env = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), args))
    result = None
    for node in gm.graph.nodes:
        if node.op == "output":
            result = torch.fx.node.map_arg(node.args[0], env.__getitem__)
        elif node.op != "placeholder":
            eval_node(gm, node, env)
    return result


def eval_node(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict) -> None:
    """Evaluate one ``get_attr`` or ``call_function`` node of ``gm`` on the values ``env``
    holds for its inputs, and store its value there (`run`'s step, also for a caller that
    runs a graph in pieces)."""
    if node.op == "get_attr":
        env[node] = _constant(_attribute(gm, node.target))
    elif node.op == "call_function":
        a, kw = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        env[node] = _call_function(node.target, a, kw)
    else:
        raise OpError(f"torch2jax.fx: node {node.name} is a {node.op}; expected an ATen-level graph")


def _attribute(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
