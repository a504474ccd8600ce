"""torch.distributed inside `shard_map`: process groups are mesh axes.

Inside a `t2j.parallel.shard_map` body the torch function sees one shard per
device. `torch.distributed`'s collectives (``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``, ``all_gather``, ``reduce``,
the list forms ``all_to_all`` / ``reduce_scatter`` / ``scatter`` / ``gather``, ``all_gather_object``,
point to point (``send`` / ``recv`` / ``isend`` / ``irecv`` / ``batch_isend_irecv``, paired in call
order), ``barrier`` (``async_op=True`` gives a completed work object), and the functional
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
from jax._src.lax.parallel import all_gather_invariant  # (not exported by jax.lax yet)
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


def varying_axes(x) -> frozenset:
    """The mesh axes over which JAX types ``x`` as differing between devices (its varying manual
    axes); none where the shard_map does not check them (``check_vma=False``)."""
    return frozenset(jax.typeof(x).mat.varying)


def _vary(x, axes):
    """``x`` typed as varying over every axis of ``axes``, as JAX's collectives take their inputs.
    A torch collective of a value equal on the group's members still acts on each member's copy
    (``all_reduce`` sums n of them), so the value becomes per member first."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _gathered(x, axes, axis=0, tiled=False):
    """Every member's ``x`` gathered: the same on every member of the group, so typed invariant
    over ``axes`` where the shard_map checks types (unchecked, ``lax.all_gather``, whose transpose
    agrees with unchecked outputs)."""
    x = _vary(x, axes)
    if varying_axes(x):
        return all_gather_invariant(x, axes, axis=axis, tiled=tiled)
    return jax.lax.all_gather(x, axes, axis=axis, tiled=tiled)


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
    value = _vary(value, axes)
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
        return _GATHERED_REDUCTIONS[op](_gathered(value, axes)).astype(value.dtype)
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
    return int(_rank_within(np.unravel_index(src, [mesh.shape[a] for a in mesh.axis_names]), axes))


def _rank_within(coords, axes):
    """The rank within the group over mesh ``axes`` of the device at mesh ``coords`` (one per axis,
    in the mesh's order; numbers or traced)."""
    mesh = _mesh()
    at = dict(zip(mesh.axis_names, coords))
    rank = 0
    for a in axes:
        rank = rank * mesh.shape[a] + at[a]
    return rank


# -- functional collectives (torch.ops._c10d_functional) --------------------------

_c10d = torch.ops._c10d_functional


@register(_c10d.all_reduce.default)
def all_reduce(x, reduce_op, group_name):
    return _reduce(x, reduce_op, _axes(group_name))


@register(_c10d.all_gather_into_tensor.default)
def all_gather_into_tensor(x, group_size, group_name):
    return _gathered(x, _axes(group_name), tiled=True)


@register(_c10d.reduce_scatter_tensor.default)
def reduce_scatter_tensor(x, reduce_op, group_size, group_name):
    axes = _axes(group_name)
    op = _op_key(reduce_op)
    if op in ("sum", "avg", "mean"):
        out = jax.lax.psum_scatter(_vary(x, axes), axes, scatter_dimension=0, tiled=True)
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
    return jax.lax.all_to_all(_vary(x, axes), axes, split_axis=0, concat_axis=0, tiled=True) if n > 1 else x


@register(_c10d.broadcast.default)
def broadcast(x, src, group_name):
    """``src``: the source's rank within the group."""
    axes = _axes(group_name)
    mine = jax.lax.axis_index(axes) == src
    return jax.lax.psum(jax.numpy.where(mine, x, jax.numpy.zeros_like(x)), axes)  # (varies over axes, as mine does)


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
    _in_place(output, _gathered(input._value(), _axes(group), tiled=True), "all_gather_into_tensor")
    return _done(async_op, output)


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    axes = _axes(group)
    if len(tensor_list) != _size(axes):
        raise ValueError(f"torch2jax: all_gather: tensor_list has {len(tensor_list)} tensors, the group has "
                         f"{_size(axes)} members")
    gathered = _gathered(tensor._value(), axes)
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


def _stacked(what, tensors, like, n):
    """The values of ``tensors`` (one per group member, each shaped and typed as ``like``) stacked."""
    if len(tensors) != n:
        raise ValueError(f"torch2jax: {what}: the list has {len(tensors)} tensors, the group has {n} members")
    for t in tensors:
        _same_dtype(what, t, like)
        if tuple(t.shape) != tuple(like.shape):
            raise ValueError(f"torch2jax: {what}: every tensor of the list must have shape {list(like.shape)} "
                             f"inside shard_map, got {list(t.shape)}")
    return jax.numpy.stack([t._value() for t in tensors])


def _all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    axes = _axes(group)
    n = _size(axes)
    if not input_tensor_list:
        raise ValueError("torch2jax: all_to_all: input_tensor_list is empty")
    sent = _stacked("all_to_all", input_tensor_list, input_tensor_list[0], n)
    _stacked("all_to_all", output_tensor_list, input_tensor_list[0], n)  # (checks the outputs alike)
    received = jax.lax.all_to_all(_vary(sent, axes), axes, split_axis=0, concat_axis=0) if n > 1 else sent
    for i, t in enumerate(output_tensor_list):
        _in_place(t, received[i], "all_to_all")
    return _done(async_op, *output_tensor_list)


def _reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
    axes = _axes(group)
    stacked = _stacked("reduce_scatter", input_list, output, _size(axes))
    flat = stacked.reshape((-1,) + stacked.shape[2:]) if stacked.ndim > 1 else stacked
    scattered = reduce_scatter_tensor(flat, _op_name(op), None, _group_of(group))
    _in_place(output, scattered.reshape(output.shape), "reduce_scatter")
    return _done(async_op, output)


def _scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """Every member gets its block of the source's ``scatter_list``. In SPMD every member runs the
    same call, so every member passes a list (only the source's is read)."""
    axes = _axes(group)
    if (src is None) == (group_src is None):
        raise ValueError("torch2jax: scatter takes exactly one of src (a global rank) and group_src")
    if scatter_list is None:
        raise ValueError("torch2jax: scatter inside shard_map: every member runs the same code, so every member "
                         "passes scatter_list (only the source's values are sent)")
    rank = group_src if group_src is not None else _group_rank_of(src, axes, "scatter: src")
    stacked = broadcast(_stacked("scatter", scatter_list, tensor, _size(axes)), rank, _group_of(group))
    _in_place(tensor, stacked[jax.lax.axis_index(axes)], "scatter")
    return _done(async_op, tensor)


def _gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """The destination's ``gather_list`` gets every member's tensor; in SPMD every member runs the
    same call, and every member that passes a list gets the gathered values."""
    axes = _axes(group)
    if (dst is None) == (group_dst is None):
        raise ValueError("torch2jax: gather takes exactly one of dst (a global rank) and group_dst")
    if group_dst is None:
        _group_rank_of(dst, axes, "gather: dst")
    if gather_list is not None:
        _stacked("gather", gather_list, tensor, _size(axes))
        gathered = _gathered(tensor._value(), axes)
        for i, t in enumerate(gather_list):
            _in_place(t, gathered[i], "gather")
    return _done(async_op, *(gather_list or ()))


def _all_gather_object(object_list, obj, group=None):
    # every member runs the same Python, so every member's object is this one
    n = _size(_axes(group))
    if len(object_list) != n:
        raise ValueError(f"torch2jax: all_gather_object: object_list has {len(object_list)} places, the group has "
                         f"{n} members")
    object_list[:] = [obj] * n


def _broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    _axes(group)  # (every member runs the same Python: its objects are the source's already)


# -- point to point: a send is matched with a later receive from its sender, in call order ----------


def _peer(peer, group_peer, axes, what: str):
    """The group rank (a number, traced where it depends on `get_rank`) of a global rank
    ``peer`` or a group rank ``group_peer``."""
    if (peer is None) == (group_peer is None):
        raise ValueError(f"torch2jax: {what} takes exactly one of a global rank and a group rank (group_dst / "
                         f"group_src / group_peer)")
    given = group_peer if group_peer is not None else peer
    value = _sym.value_of(given) if _sym.is_traced_number(given) else given
    if group_peer is not None:
        return value
    if isinstance(value, int):
        return _group_rank_of(value, axes, what)
    mesh = _mesh()
    return _rank_within(jax.numpy.unravel_index(value, [mesh.shape[a] for a in mesh.axis_names]), axes)


class _Sent:
    """One send inside a shard_map body: each member's tensor and destination, gathered by every
    member at the first receive that looks at it, and which senders' tensors this member took."""

    def __init__(self, axes, tag, value, dst):
        self.axes, self.tag, self.value, self.dst = axes, tag, value, dst
        self.gathered = None
        self.taken = jax.numpy.zeros(_size(axes), bool)

    def values_and_destinations(self):
        if self.gathered is None:
            dst = jax.numpy.asarray(self.dst, jax.numpy.int32)
            self.gathered = (_gathered(self.value, self.axes), _gathered(dst, self.axes))
        return self.gathered


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    axes = _axes(group)
    _local.sends[-1].append(_Sent(axes, tag, tensor._value(), _peer(dst, group_dst, axes, "send: dst")))


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    """The tensor member ``src`` sent to this member in its earliest send of the same group and
    tag that this member has not received yet. Every member runs the same program, so each
    send is gathered by all and each receiver picks its own; a send comes before its receive."""
    axes = _axes(group)
    source = _peer(src, group_src, axes, "recv: src")
    me = jax.lax.axis_index(axes)
    value = tensor._value()
    sends = [s for s in _local.sends[-1] if s.axes == axes and s.tag == tag]
    if not sends:
        raise RuntimeError("torch2jax: recv inside shard_map: no send of the same group and tag came before it. "
                           "Every member runs the same program, so send (or isend, or batch_isend_irecv's isend "
                           "ops) first, then receive")
    found = jax.numpy.zeros((), bool)
    for sent in sends:
        if sent.value.shape != value.shape:
            raise ValueError(f"torch2jax: recv: the buffer has shape {list(value.shape)}, the matching send's "
                             f"tensor {list(sent.value.shape)}")
        values, dsts = sent.values_and_destinations()
        mine = ~found & ~sent.taken[source] & (dsts[source] == me)
        value = jax.numpy.where(mine, values[source].astype(value.dtype), value)
        sent.taken = sent.taken.at[source].set(sent.taken[source] | mine)
        found = found | mine
    _in_place(tensor, value, "recv")
    return src if src is not None else group_src


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    _send(tensor, dst, group, tag, group_dst)
    return _Work([tensor])


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    _recv(tensor, src, group, tag, group_src)
    return _Work([tensor])


class _P2POp:
    """``torch.distributed.P2POp`` inside shard_map: ``op`` is ``isend`` or ``irecv``."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        name = getattr(op, "__name__", "")
        if name not in ("isend", "irecv", "_isend", "_irecv"):
            raise ValueError(f"torch2jax: P2POp: op must be torch.distributed.isend or irecv, got {op!r}")
        self.op, self.tensor, self.peer, self.group, self.tag, self.group_peer = \
            op, tensor, peer, group, tag, group_peer


def _batch_isend_irecv(p2p_op_list):
    # the sends first: in a batch, every send may feed any receive
    sends = [p for p in p2p_op_list if "send" in p.op.__name__]
    for p in sends + [p for p in p2p_op_list if p not in sends]:
        run = _isend if p in sends else _irecv
        run(p.tensor, p.peer, p.group, p.tag, p.group_peer)
    return [_Work([p.tensor]) for p in p2p_op_list]


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
    "all_to_all": _all_to_all,
    "reduce_scatter": _reduce_scatter,
    "scatter": _scatter,
    "gather": _gather,
    "all_gather_object": _all_gather_object,
    "broadcast_object_list": _broadcast_object_list,
    "send": _send,
    "recv": _recv,
    "isend": _isend,
    "irecv": _irecv,
    "P2POp": _P2POp,
    "batch_isend_irecv": _batch_isend_irecv,
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
    if not hasattr(_local, "sends"):
        _local.sends = []
    _local.sends.append([])
    saved = {name: getattr(dist, name) for name in _PATCHES}
    saved_size = c10d._get_group_size_by_name
    for name, fn in _PATCHES.items():
        setattr(dist, name, fn if isinstance(fn, type) else functools.wraps(saved[name])(fn))
    c10d._get_group_size_by_name = _group_size_by_name(saved_size)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        c10d._get_group_size_by_name = saved_size
        stack.pop()
        _local.sends.pop()
