"""Multi-host start-up: the same training script as N processes, through jax.distributed.

Each process calls `initialize` first (before any other JAX use); afterwards
``jax.devices()`` lists the devices of all processes, a mesh over them spans the
hosts, and `t2j.jit` programs run SPMD across processes with JAX's own runtime.
On CPU, cross-process collectives use gloo.

Example (run the same script as process 0 and 1)::

    t2j.parallel.initialize("127.0.0.1:12345", num_processes=2, process_id=int(sys.argv[1]))
    mesh = t2j.parallel.make_mesh({"data": -1})
"""

from __future__ import annotations

import jax


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None, **kwargs) -> None:
    """Join a multi-process JAX job (`jax.distributed.initialize`); on CPU, turn on
    gloo collectives so that programs can communicate across processes.

    Arguments default to what the cluster environment provides (SLURM, TPU pods, or the
    ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` variables).
    """
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids, **kwargs)


def process_index() -> int:
    """This process's index in the job (0 on a single host)."""
    return jax.process_index()


def process_count() -> int:
    """The number of processes in the job."""
    return jax.process_count()
