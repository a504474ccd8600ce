"""torch.distributed inside `shard_map`: process groups are mesh axes.

Inside a `t2j.parallel.shard_map` body the torch function sees one shard per
device. `torch.distributed`'s collectives (``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, and the functional
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


def _reduce(value, op, axes):
    op = str(op).lower().rsplit(".", 1)[-1]
    if op in ("sum",):
        return jax.lax.psum(value, axes)
    if op in ("avg", "mean"):
        return jax.lax.pmean(value, axes)
    if op == "max":
        return jax.lax.pmax(value, axes)
    if op == "min":
        return jax.lax.pmin(value, axes)
    raise RuntimeError(f"torch2jax: reduce op {op!r} is not supported in collectives (sum, avg, max, min)")


def _op_name(op):
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    return str(op)


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
    out = jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
    return out / _size(axes) if str(reduce_op).lower() in ("avg", "mean") else out


@register(_c10d.all_to_all_single.default)
def all_to_all_single(x, output_split_sizes, input_split_sizes, group_name):
    axes = _axes(group_name)
    n = _size(axes)
    if len(set(output_split_sizes)) > 1 or len(set(input_split_sizes)) > 1:
        raise RuntimeError("torch2jax: all_to_all_single supports equal splits only")
    return jax.lax.all_to_all(x, axes, split_axis=0, concat_axis=0, tiled=True) if n > 1 else x


@register(_c10d.broadcast.default)
def broadcast(x, src, group_name):
    axes = _axes(group_name)
    mine = jax.lax.axis_index(axes) == src
    return jax.lax.psum(jax.numpy.where(mine, x, jax.numpy.zeros_like(x)), axes)


@register(_c10d.wait_tensor.default, _c10d._wrap_tensor_autograd.default)
def wait_tensor(x):
    return x


# -- torch.distributed's in-place API, while a shard_map body runs ------------------


def _in_place(t: torch.Tensor, value):
    if not isinstance(t, Tensor):
        raise RuntimeError("torch2jax: collectives inside shard_map take tensors on the jax device")
    t._assign(value.astype(t._value().dtype))


def _all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    _in_place(tensor, _reduce(tensor._value(), _op_name(op), _axes(group)))


def _all_gather_into_tensor(output, input, group=None, async_op=False):
    _in_place(output, jax.lax.all_gather(input._value(), _axes(group), axis=0, tiled=True))


def _reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    _in_place(output, reduce_scatter_tensor(input._value(), _op_name(op), None, _group_of(group)))


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    sizes = output_split_sizes or []
    _in_place(output, all_to_all_single(input._value(), sizes, input_split_sizes or [], _group_of(group)))


def _broadcast(tensor, src, group=None, async_op=False):
    _in_place(tensor, broadcast(tensor._value(), src, _group_of(group)))


def _group_of(group):
    return group if isinstance(group, (Group, str)) or group is None else None


def _get_rank(group=None):
    return _sym.traced_number(jax.lax.axis_index(_axes(group)))


def _get_world_size(group=None):
    return _size(_axes(group))


_PATCHES = {
    "all_reduce": _all_reduce,
    "all_gather_into_tensor": _all_gather_into_tensor,
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
