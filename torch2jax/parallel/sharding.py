"""SPMD sharding of torch tensors and modules through JAX's sharding engine.

A tensor on the jax device holds a `jax.Array`; sharding it means placing that
array with a `NamedSharding` over a `jax.sharding.Mesh`. `t2j.jit` then compiles
an SPMD program from the shardings of its inputs (parameters, optimizer state,
batch), and keeps each written state tensor's sharding. Inside a jitted function
`mark_sharding` becomes a sharding constraint.

Example::

    mesh = t2j.parallel.make_mesh({"data": 4, "model": 2})
    t2j.parallel.shard_model(model, mesh, t2j.parallel.fsdp("data"))
    x = t2j.parallel.shard_batch(x, mesh, "data")
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..layer_scan import stacked_parameter_names
from ..tensor import Tensor, from_torch_cpu, new_tensor


class ShardingError(ValueError):
    """A partition spec does not fit the tensor or the mesh; the message says how."""


def make_mesh(axes: dict, devices=None) -> Mesh:
    """A device mesh with named axes, e.g. ``{"data": 4, "model": 2}``; ``-1`` takes the
    devices that are left. Devices default to all of ``jax.devices()``.

    >>> mesh = t2j.parallel.make_mesh({"data": -1})
    """
    if not isinstance(axes, Mapping):
        raise ShardingError(f"make_mesh: axes is a dict of axis name -> size, e.g. {{'data': 4, 'model': 2}}, got a "
                            f"{type(axes).__name__}")
    for name, size in axes.items():
        if not isinstance(size, int) or (size < 1 and size != -1):
            raise ShardingError(f"make_mesh: axis {name!r} has size {size!r}: a size is a positive integer, or -1 "
                                "for the devices that are left")
    devices = list(jax.devices() if devices is None else devices)
    names, sizes = list(axes), list(axes.values())
    if sizes.count(-1) > 1:
        raise ShardingError("make_mesh: at most one axis may have size -1")
    known = math.prod(s for s in sizes if s != -1)
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        raise ShardingError(f"make_mesh: axes {dict(zip(names, sizes))} need {math.prod(sizes)} devices, "
                            f"there are {len(devices)}")
    return Mesh(np.array(devices).reshape(sizes), tuple(names))


def _spec(spec) -> PartitionSpec:
    """``spec`` as a PartitionSpec; a bare string is one mesh axis name, for the first dimension
    (as `shard_map` takes it), not a sequence of one-letter names."""
    if isinstance(spec, PartitionSpec):
        return spec
    return PartitionSpec(spec) if isinstance(spec, str) else PartitionSpec(*spec)


def _entries(spec) -> tuple:
    """A rule's ``spec`` (None: replicated) as a tuple of per-dimension entries."""
    return () if spec is None else tuple(_spec(spec))


def named_sharding(shape, mesh: Mesh, spec, what: str = "tensor") -> NamedSharding:
    """A `NamedSharding` for an array of ``shape``, checked against the mesh."""
    spec = _spec(spec)
    if len(spec) > len(shape):
        raise ShardingError(f"{what}: partition spec {tuple(spec)} has {len(spec)} entries but the tensor has "
                            f"{len(shape)} dimensions {tuple(shape)}")
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        size = 1
        for name in names:
            if name not in mesh.shape:
                raise ShardingError(f"{what}: mesh axis {name!r} (in spec {tuple(spec)}) is not one of the mesh's "
                                    f"axes {tuple(mesh.axis_names)}")
            size *= mesh.shape[name]
        if shape[dim] % size:  # (JAX's shardings split evenly)
            raise ShardingError(f"{what}: dimension {dim} of size {shape[dim]} is not divisible by {size}, the size "
                                f"of mesh axes {names}: pad it to a multiple of {size} (a batch: or drop its last "
                                f"{shape[dim] % size} rows), or leave the dimension unsplit (None in the spec)")
    return NamedSharding(mesh, spec)


def _place(t: Tensor, sharding) -> None:
    st = t._t2j_storage
    if t._t2j_view:
        raise ShardingError("mark_sharding: the tensor is a view of another tensor; shard its base, or a copy of it (.clone())")
    st.array = jax.device_put(st.array, sharding)
    st.version += 1


def mark_sharding(tensor: torch.Tensor, mesh: Mesh, spec) -> torch.Tensor:
    """Shard ``tensor`` over ``mesh`` following ``spec`` (one mesh axis name, a tuple of
    them or None per dimension), in place; returns the tensor.

    Eagerly the array is placed with the sharding; inside a traced function (`t2j.jit`,
    a scanned body) it is a sharding constraint on the value, so it also works on
    activations inside a model.

    >>> t2j.parallel.mark_sharding(h, mesh, ("data", None, "model"))
    """
    if not isinstance(tensor, Tensor):
        raise ShardingError(f"mark_sharding: expected a tensor on the jax device, got one on {tensor.device}")
    sharding = named_sharding(tuple(tensor.shape), mesh, spec, "mark_sharding")
    value = tensor._value()
    if isinstance(value, jax.core.Tracer):
        tensor._assign(jax.lax.with_sharding_constraint(value, sharding))
    else:
        _place(tensor, sharding)
    return tensor


def shard_batch(tensor: torch.Tensor, mesh: Mesh, axis="data", process_local: bool = False) -> torch.Tensor:
    """A copy of ``tensor`` (jax or CPU) on the mesh, its first dimension split over ``axis``
    (data parallelism); the other dimensions are replicated.

    With ``process_local=True`` (multi-host), ``tensor`` is this process's part of the batch,
    as each process's own data loader gives it: the result is the global batch made of every
    process's part, each part on the devices of its process (every process calls this, with
    parts of one shape; on a mesh that orders the devices by process, as `make_mesh` does, the
    parts follow in process order).

    >>> x = t2j.parallel.shard_batch(next(loader), mesh, "data", process_local=True)
    """
    t = tensor if isinstance(tensor, Tensor) else from_torch_cpu(tensor)
    spec = (axis,) + (None,) * (t.dim() - 1)
    if process_local:
        if t.dim() == 0:
            raise ShardingError("shard_batch: a process-local batch needs a first (batch) dimension, got a 0-d tensor")
        shape = (t.shape[0] * jax.process_count(),) + tuple(t.shape[1:])
        sharding = named_sharding(shape, mesh, spec, "shard_batch")
        local = np.asarray(jax.device_get(t._value()))
        with jax.enable_x64(True):  # (an int64 batch stays int64)
            return new_tensor(jax.make_array_from_process_local_data(sharding, local, shape))
    sharding = named_sharding(tuple(t.shape), mesh, spec, "shard_batch")
    return new_tensor(jax.device_put(t._value(), sharding))


# -- rules: parameter name pattern -> partition spec ------------------------------


def fsdp(axis: str = "data", min_size: int = 1024):
    """FSDP / ZeRO-3 rule: every parameter with at least ``min_size`` elements is split
    over ``axis`` along its largest dimension that the axis size divides (others are
    replicated). Optimizer state created from a parameter inherits its sharding.

    >>> t2j.parallel.shard_model(model, mesh, t2j.parallel.fsdp("data"))
    """

    def rule(name, shape, mesh):
        if axis not in mesh.shape:
            raise ShardingError(f"fsdp: mesh axis {axis!r} is not one of the mesh's axes {tuple(mesh.axis_names)}")
        size = mesh.shape[axis]
        if math.prod(shape) < min_size:
            return None
        dims = sorted(range(len(shape)), key=lambda d: -shape[d])
        for d in dims:
            if shape[d] % size == 0:
                return tuple(axis if i == d else None for i in range(len(shape)))
        # every device then holds all of it: say so, rather than let memory grow unnoticed
        warnings.warn(f"fsdp: {name} {tuple(shape)} has no dimension divisible by {size}, the size of mesh axis "
                      f"{axis!r}: it stays replicated on every device (pad it, e.g. the vocabulary to a multiple of "
                      f"{size}, or give it a rule of its own)", stacklevel=3)
        return None

    return rule


_COLUMN = r"(q_proj|k_proj|v_proj|gate_proj|up_proj|c_attn|c_fc|qkv|fc|query|key|value|wi|wi_0|wi_1)\.weight$"
_COLUMN_BIAS = r"(q_proj|k_proj|v_proj|gate_proj|up_proj|c_attn|c_fc|qkv|fc|query|key|value)\.bias$"
_ROW = r"(o_proj|down_proj|c_proj|proj|fc_out|dense|wo)\.weight$"


def tensor_parallel(axis: str = "model", fsdp_axis: str | None = None):
    """Tensor-parallel rule for Llama-style blocks (Megatron layout): the attention
    q/k/v and MLP gate/up projections are column-parallel (output features split over
    ``axis``, so attention heads are split), the attention output and MLP down
    projections row-parallel (input features split). With ``fsdp_axis`` the other
    dimension of each of those weights, and every other large parameter, is also
    split over that axis (2-D FSDP x TP).

    >>> t2j.parallel.shard_model(llama, mesh, t2j.parallel.tensor_parallel("model", fsdp_axis="data"))
    """
    rest = fsdp(fsdp_axis) if fsdp_axis else None

    def rule(name, shape, mesh):
        if len(shape) == 2 and re.search(_COLUMN, name):
            return (fsdp_axis, axis) if _is_conv1d(name, shape) else (axis, fsdp_axis)
        if len(shape) == 2 and re.search(_ROW, name):
            return (axis, fsdp_axis) if _is_conv1d(name, shape) else (fsdp_axis, axis)
        if len(shape) == 1 and re.search(_COLUMN_BIAS, name):
            return (axis,)
        return rest(name, shape, mesh) if rest else None

    return rule


def _is_conv1d(name, shape):
    # GPT-2's Conv1D stores weights as (in, out), transposed relative to nn.Linear
    return bool(re.search(r"(c_attn|c_fc|c_proj)\.weight$", name))


def shard_model(module: torch.nn.Module, mesh: Mesh, rules) -> torch.nn.Module:
    """Place every parameter and buffer of ``module`` (already on the jax device) on
    ``mesh``: ``rules`` is a function ``(name, shape, mesh) -> spec or None`` (see `fsdp`,
    `tensor_parallel`) or a list of ``(regex, spec)`` pairs, first match wins; unmatched
    tensors are replicated. Optimizer state created later follows the parameters.

    >>> t2j.parallel.shard_model(model, mesh, [(r"mlp\\..*weight", ("model", None))])
    """
    if isinstance(rules, (list, tuple)):
        pairs = [(re.compile(p), s) for p, s in rules]

        def rule(name, shape, mesh):
            for pattern, spec in pairs:
                if pattern.search(name):
                    return spec
            return None
    else:
        rule = rules
    stacked = stacked_parameter_names(module)
    seen = set()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if not isinstance(t, Tensor):
            raise ShardingError(f"shard_model: {name} is on {t.device}; move the module to the jax device first")
        if name in stacked:  # one layer's rule for each slice of the stack (use_scan_layers(stack_parameters=True))
            spec = (None, *_entries(rule(stacked[name], tuple(t.shape[1:]), mesh)))
        else:
            spec = _entries(rule(name, tuple(t.shape), mesh))
        while spec and spec[-1] is None:
            spec = spec[:-1]
        _place(t, named_sharding(tuple(t.shape), mesh, spec, f"shard_model: {name}"))
    return module


def sharding_of(tensor: torch.Tensor):
    """The `jax.sharding.Sharding` of a jax-device tensor's array."""
    if not isinstance(tensor, Tensor):
        got = f"one on {tensor.device}" if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
        raise ShardingError(f"sharding_of: expected a tensor on the jax device, got {got}")
    return tensor._value().sharding
