"""torch.distributed inside `shard_map`: process groups are mesh axes.

Inside a `t2j.parallel.shard_map` body the torch function sees one shard per
device. `torch.distributed`'s collectives (``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, ``all_gather``, ``reduce``,
``barrier`` (``async_op=True`` gives a completed work object), and the functional
collectives of ``torch.distributed._functional_collectives``) lower to
``lax.psum`` / ``all_gather`` / ``psum_scatter`` / ``all_to_all`` over the mesh
axes of the process group; ``get_rank`` / ``get_world_size`` answer from the mesh.

A process group is one or more mesh axes: `new_group` makes one; ``group=None``
is every axis of the mesh. No axis name is hard-coded.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import jax
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401 - defines _c10d_functional's Python-side ops

from .. import symbolic as _sym
from ..ops.registry import register
from ..tensor import Tensor

_local = threading.local()
_GROUPS: dict = {}


class Group(str):
    """A process group standing for mesh axes (see `new_group`). It is its own group
    name (a string), which is what torch's functional collectives take."""

    def __new__(cls, axes):
        axes = tuple(axes)
        self = super().__new__(cls, "t2j:" + ",".join(axes))
        self.axes = axes
        _GROUPS[str(self)] = self
        return self

    @property
    def group_name(self) -> str:
        return str(self)

    def __repr__(self):
        return f"t2j.parallel.Group(axes={self.axes})"


def new_group(axes) -> Group:
    """A process group over mesh axis ``axes`` (a name or a tuple of names), for the
    ``group=`` argument of torch.distributed calls inside `shard_map`.

    >>> tp = t2j.parallel.new_group("model")
    >>> dist.all_reduce(partial_sum, group=tp)
    """
    return Group((axes,) if isinstance(axes, str) else axes)


def _mesh():
    stack = getattr(_local, "meshes", None)
    if not stack:
        raise RuntimeError(
            "torch2jax: a torch.distributed collective ran on the jax device outside t2j.parallel.shard_map; "
            "collectives need the mesh axes of a shard_map body"
        )
    return stack[-1]


def _axes(group):
    mesh = _mesh()
    if group is None or group is dist.group.WORLD:
        return tuple(mesh.axis_names)
    if isinstance(group, str) and not isinstance(group, Group):
        group = _GROUPS.get(group)
    if not isinstance(group, Group):
        raise RuntimeError(f"torch2jax: inside shard_map, use t2j.parallel.new_group(axes) for process groups, "
                           f"got {group!r}")
    for a in group.axes:
        if a not in mesh.shape:
            raise RuntimeError(f"torch2jax: process group axis {a!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    return group.axes


def _size(axes):
    return math.prod(_mesh().shape[a] for a in axes)


# reductions without a lax primitive: every shard gathered, then reduced in order
_GATHERED_REDUCTIONS = {
    "product": lambda g: jax.numpy.prod(g, axis=0),
    "band": lambda g: functools.reduce(jax.numpy.bitwise_and, g),
    "bor": lambda g: functools.reduce(jax.numpy.bitwise_or, g),
    "bxor": lambda g: functools.reduce(jax.numpy.bitwise_xor, g),
}


def _op_key(op) -> str:
    """A reduce op (``"sum"``, ``ReduceOp.SUM``, ``"ReduceOp.SUM"``) as its lowercase name."""
    return str(op).lower().rsplit(".", 1)[-1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _extreme(value, axes, reduce):
    """``reduce(value, axes)`` (``lax.pmax`` / ``pmin``, which JAX cannot differentiate), with the
    derivative of torch's ``amax`` / ``amin``: each element's gradient goes to the members' elements
    equal to it, shared evenly among ties."""
    return reduce(value, axes)


@_extreme.defjvp
def _extreme_jvp(axes, reduce, primals, tangents):
    (value,), (dot,) = primals, tangents
    out = reduce(value, axes)
    chosen = value == out
    ties = jax.lax.psum(chosen.astype(value.dtype), axes)
    return out, jax.lax.psum(jax.numpy.where(chosen, dot, jax.numpy.zeros_like(dot)), axes) / ties


def _reduce(value, op, axes):
    op = _op_key(op)
    if op in ("sum",):
        return jax.lax.psum(value, axes)
    if op in ("avg", "mean"):
        return jax.lax.pmean(value, axes)
    if op in ("max", "min"):
        reduce = jax.lax.pmax if op == "max" else jax.lax.pmin
        return _extreme(value, axes, reduce) if jax.numpy.issubdtype(value.dtype, jax.numpy.floating) \
            else reduce(value, axes)
    if op in _GATHERED_REDUCTIONS:
        if op != "product" and jax.numpy.issubdtype(value.dtype, jax.numpy.inexact):
            raise RuntimeError(f"torch2jax: reduce op {op.upper()} needs an integer or bool tensor, got {value.dtype}")
        return _GATHERED_REDUCTIONS[op](jax.lax.all_gather(value, axes, axis=0)).astype(value.dtype)
    raise RuntimeError(f"torch2jax: reduce op {op!r} is not supported in collectives "
                       "(sum, avg, max, min, product, band, bor, bxor)")


def _op_name(op):
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    return str(op)


def _group_rank_of(src: int, axes, what: str) -> int:
    """The rank within the group over mesh ``axes`` of global rank ``src`` (ranks count
    devices in the mesh's order, as `get_rank` does). In SPMD every group runs the call:
    each takes its member at ``src``'s place in the group as the source (or destination),
    torch's behaviour for the group that holds ``src``."""
    mesh = _mesh()
    world = math.prod(mesh.shape.values())
    if not 0 <= src < world:
        raise ValueError(f"torch2jax: {what}={src} is not a rank of the mesh's {world} devices")
    coords = dict(zip(mesh.axis_names, map(int, np.unravel_index(src, [mesh.shape[a] for a in mesh.axis_names]))))
    rank = 0
    for a in axes:
        rank = rank * mesh.shape[a] + coords[a]
    return rank


# -- functional collectives (torch.ops._c10d_functional) --------------------------

_c10d = torch.ops._c10d_functional


@register(_c10d.all_reduce.default)
def all_reduce(x, reduce_op, group_name):
    return _reduce(x, reduce_op, _axes(group_name))


@register(_c10d.all_gather_into_tensor.default)
def all_gather_into_tensor(x, group_size, group_name):
    return jax.lax.all_gather(x, _axes(group_name), axis=0, tiled=True)


@register(_c10d.reduce_scatter_tensor.default)
def reduce_scatter_tensor(x, reduce_op, group_size, group_name):
    axes = _axes(group_name)
    op = _op_key(reduce_op)
    if op in ("sum", "avg", "mean"):
        out = jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
        return out / _size(axes) if op != "sum" else out
    # the others reduce everything, then each member keeps its block
    n = _size(axes)
    block = x.shape[0] // n
    return jax.lax.dynamic_slice_in_dim(_reduce(x, op, axes), jax.lax.axis_index(axes) * block, block)


@register(_c10d.all_to_all_single.default)
def all_to_all_single(x, output_split_sizes, input_split_sizes, group_name):
    axes = _axes(group_name)
    n = _size(axes)
    if len(set(output_split_sizes)) > 1 or len(set(input_split_sizes)) > 1:
        raise RuntimeError("torch2jax: all_to_all_single supports equal splits only")
    return jax.lax.all_to_all(x, axes, split_axis=0, concat_axis=0, tiled=True) if n > 1 else x


@register(_c10d.broadcast.default)
def broadcast(x, src, group_name):
    """``src``: the source's rank within the group."""
    axes = _axes(group_name)
    mine = jax.lax.axis_index(axes) == src
    return jax.lax.psum(jax.numpy.where(mine, x, jax.numpy.zeros_like(x)), axes)


@register(_c10d.wait_tensor.default, _c10d._wrap_tensor_autograd.default)
def wait_tensor(x):
    return x


# -- torch.distributed's in-place API, while a shard_map body runs ------------------


def _in_place(t: torch.Tensor, value, what: str):
    if not isinstance(t, Tensor):
        raise RuntimeError(f"torch2jax: {what} inside shard_map takes tensors on the jax device")
    if tuple(t.shape) != tuple(value.shape):
        raise ValueError(f"torch2jax: {what}: the output tensor has shape {list(t.shape)}, the result has shape "
                         f"{list(value.shape)}")
    t._assign(value.astype(t._value().dtype))  # (an AVG of integers, as torch writes it into them)


def _same_dtype(what, output, input):
    if output.dtype != input.dtype:
        raise TypeError(f"torch2jax: {what}: output and input tensors must have the same dtype, got {output.dtype} "
                        f"and {input.dtype}")


class _Work:
    """What an ``async_op=True`` collective returns: inside a shard_map body the collective is
    part of the program, so it is complete when the call returns."""

    def __init__(self, result):
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return self._result

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(self._result)
        return future


def _done(async_op, *tensors):
    return _Work(list(tensors)) if async_op else None


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    _in_place(tensor, _reduce(tensor._value(), _op_name(op), _axes(group)), "all_reduce")
    return _done(async_op, tensor)


def _all_gather_into_tensor(output, input, group=None, async_op=False):
    _same_dtype("all_gather_into_tensor", output, input)
    _in_place(output, jax.lax.all_gather(input._value(), _axes(group), axis=0, tiled=True), "all_gather_into_tensor")
    return _done(async_op, output)


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    axes = _axes(group)
    if len(tensor_list) != _size(axes):
        raise ValueError(f"torch2jax: all_gather: tensor_list has {len(tensor_list)} tensors, the group has "
                         f"{_size(axes)} members")
    gathered = jax.lax.all_gather(tensor._value(), axes, axis=0)
    for i, t in enumerate(tensor_list):
        _same_dtype("all_gather", t, tensor)
        _in_place(t, gathered[i], "all_gather")
    return _done(async_op, *tensor_list)


def _reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    _same_dtype("reduce_scatter_tensor", output, input)
    n = _size(_axes(group))
    if input.shape[0] % n:
        raise ValueError(f"torch2jax: reduce_scatter_tensor: the input's first dimension ({input.shape[0]}) is not "
                         f"divisible by the group's {n} members")
    _in_place(output, reduce_scatter_tensor(input._value(), _op_name(op), None, _group_of(group)),
              "reduce_scatter_tensor")
    return _done(async_op, output)


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    _same_dtype("all_to_all_single", output, input)
    sizes = output_split_sizes or []
    _in_place(output, all_to_all_single(input._value(), sizes, input_split_sizes or [], _group_of(group)),
              "all_to_all_single")
    return _done(async_op, output)


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    axes = _axes(group)
    if (src is None) == (group_src is None):
        raise ValueError("torch2jax: broadcast takes exactly one of src (a global rank) and group_src")
    rank = group_src if group_src is not None else _group_rank_of(src, axes, "broadcast: src")
    _in_place(tensor, broadcast(tensor._value(), rank, _group_of(group)), "broadcast")
    return _done(async_op, tensor)


def _reduce_to(tensor, dst=None, op=dist.ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    axes = _axes(group)
    if (dst is None) == (group_dst is None):
        raise ValueError("torch2jax: reduce takes exactly one of dst (a global rank) and group_dst")
    rank = group_dst if group_dst is not None else _group_rank_of(dst, axes, "reduce: dst")
    value = tensor._value()
    reduced = _reduce(value, _op_name(op), axes)
    _in_place(tensor, jax.numpy.where(jax.lax.axis_index(axes) == rank, reduced, value), "reduce")
    return _done(async_op, tensor)


def _barrier(group=None, async_op=False, device_ids=None):
    _axes(group)  # (inside a program the devices run in lockstep: nothing to wait for)
    return _done(async_op)


def _group_of(group):
    return group if isinstance(group, (Group, str)) or group is None else None


def _get_rank(group=None):
    return _sym.traced_number(jax.lax.axis_index(_axes(group)))


def _get_world_size(group=None):
    return _size(_axes(group))


_PATCHES = {
    "all_reduce": _all_reduce,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather": _all_gather,
    "reduce": _reduce_to,
    "barrier": _barrier,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_to_all_single": _all_to_all_single,
    "broadcast": _broadcast,
    "get_rank": _get_rank,
    "get_world_size": _get_world_size,
    "is_initialized": lambda: True,
}


def _group_size_by_name(original):
    def size(group_name):
        if isinstance(group_name, str) and group_name in _GROUPS:
            return _size(_axes(group_name))
        return original(group_name)

    return size


@contextlib.contextmanager
def collectives(mesh):
    """Within the block, torch.distributed's collectives act over ``mesh``'s axes."""
    from torch.distributed import distributed_c10d as c10d

    stack = getattr(_local, "meshes", None)
    if stack is None:
        stack = _local.meshes = []
    stack.append(mesh)
    saved = {name: getattr(dist, name) for name in _PATCHES}
    saved_size = c10d._get_group_size_by_name
    for name, fn in _PATCHES.items():
        setattr(dist, name, functools.wraps(saved[name])(fn))
    c10d._get_group_size_by_name = _group_size_by_name(saved_size)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        c10d._get_group_size_by_name = saved_size
        stack.pop()
