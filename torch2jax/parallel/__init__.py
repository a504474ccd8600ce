"""Scale-out: device meshes, sharding of tensors and modules (FSDP, tensor parallel).

See `torch2jax.parallel.sharding`. Everything runs through JAX's own sharding
engine: a sharded tensor is a jax.Array with a NamedSharding, and `t2j.jit`
compiles an SPMD program from the shardings of what it is given.
"""

from .collectives import Group, new_group
from .multihost import initialize, process_count, process_index
from .shard_map import shard_map
from .sharding import (
    ShardingError,
    fsdp,
    make_mesh,
    mark_sharding,
    named_sharding,
    shard_batch,
    shard_model,
    sharding_of,
    tensor_parallel,
)

__all__ = [
    "Group",
    "ShardingError",
    "fsdp",
    "initialize",
    "make_mesh",
    "mark_sharding",
    "named_sharding",
    "new_group",
    "process_count",
    "process_index",
    "shard_batch",
    "shard_map",
    "shard_model",
    "sharding_of",
    "tensor_parallel",
]
