"""`shard_map` for torch functions: per-device code with explicit collectives.

Example::

    mesh = t2j.parallel.make_mesh({"data": 8})

    def local_mean(x):                    # x: this device's shard
        s = x.sum(0, keepdim=True)
        dist.all_reduce(s)                # over every mesh axis
        return s / (x.shape[0] * dist.get_world_size())

    f = t2j.parallel.shard_map(local_mean, mesh, in_specs=("data",), out_specs=())
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from ..interop import call_jax_64, jax_view
from .collectives import collectives


def _spec(s):
    if s is None or isinstance(s, PartitionSpec):
        return s if s is not None else PartitionSpec()
    if isinstance(s, str):
        return PartitionSpec(s)
    return PartitionSpec(*s)


def _specs(specs):
    if isinstance(specs, dict):  # one spec per output of a dict of outputs
        return {k: _spec(v) for k, v in specs.items()}
    if isinstance(specs, list):
        return [_spec(s) for s in specs]
    if isinstance(specs, tuple) and all(isinstance(s, (tuple, list, PartitionSpec, type(None))) or isinstance(s, str)
                                        for s in specs) and any(not isinstance(s, str) for s in specs):
        return tuple(_spec(s) for s in specs)
    return _spec(specs)


def shard_map(torch_fn, mesh, in_specs, out_specs, check_vma: bool = False):
    """Run ``torch_fn`` once per device on its shards (``jax.shard_map`` for torch).

    ``in_specs`` has one partition spec per positional argument (a tuple of mesh axis
    names / None per dimension; ``()`` replicates), ``out_specs`` one per output (a tuple
    or list of them, or a dict of them for a dict of outputs).
    Inside, torch.distributed collectives act over the mesh axes of their process
    group (`new_group`; ``group=None`` is every axis). Differentiable (a torch
    autograd node whose backward is JAX's), and usable inside `t2j.jit`.

    >>> f = t2j.parallel.shard_map(lambda x: x * 2, mesh, in_specs=(("data",),), out_specs=("data",))
    """
    in_specs = tuple(_spec(s) for s in in_specs)
    out = _specs(out_specs)

    def body(*arrays):
        with collectives(mesh):
            return jax_view(torch_fn)(*arrays)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out, check_vma=check_vma)

    def call(*tensors):
        return call_jax_64(mapped, *tensors)

    return call
