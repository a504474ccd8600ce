"""Host offload over JAX memory kinds: tensors and saved activations in host memory.

* `to_host(t)` / `to_device(t)` place a tensor (or jax.Array) in the device's
  ``pinned_host`` / ``device`` memory; `memory_kind(t)` says where it is and
  `memory_kinds()` what the device offers. Both are differentiable for torch
  autograd (the gradient comes back to the source memory).
* `offload_policy(...)` is a JAX checkpoint (remat) policy that moves the
  activations saved for the backward pass to host memory instead of keeping
  them on the device or recomputing them. Pass it wherever torch2jax takes a
  remat policy: ``t2j.checkpoint(fn, policy=...)``, ``t2j.scan_layers(...,
  remat=...)``, ``t2j.use_scan_layers(model, remat=...)`` and
  ``t2j.train.make_train_step(..., remat=...)``. `name(t, "attn_out")` labels a
  tensor so that a name-based policy can pick it.
* `offloaded_bytes(fn, *args)` counts what a JAX function moves to host memory.

Example::

    policy = t2j.offload.offload_policy()                 # every matmul output not in a batch
    h = t2j.scan_layers(model.blocks, h, remat=policy)    # saved activations wait on the host
"""

from __future__ import annotations

import math

import jax
import torch
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jex_core

from .interop import call_jax_64
from .tensor import Tensor

HOST = "pinned_host"
DEVICE = "device"


def memory_kinds(device: jax.Device | None = None) -> tuple[str, ...]:
    """The memory kinds ``device`` (default: the first JAX device) can hold arrays in.

    >>> t2j.offload.memory_kinds()
    ('device', 'pinned_host', 'unpinned_host')
    """
    device = device or jax.devices()[0]
    return tuple(m.kind for m in device.addressable_memories())


def _array(fn_name: str, x):
    if isinstance(x, Tensor):
        return x._value()
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return x
    got = f"a tensor on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
    raise TypeError(f"t2j.offload.{fn_name}: expected a tensor on the jax device or a jax.Array, got {got}")


def memory_kind(x) -> str | None:
    """The memory kind of a tensor on the jax device or a jax.Array (``None`` while traced).

    >>> t2j.offload.memory_kind(t2j.offload.to_host(torch.ones(2, device="jax")))
    'pinned_host'
    """
    a = _array("memory_kind", x)
    return None if isinstance(a, jax.core.Tracer) else a.sharding.memory_kind


def _put(a, kind: str):
    if isinstance(a, jax.core.Tracer):
        return jax.device_put(a, jax.memory.Space.Device if kind == DEVICE else jax.memory.Space.Host)
    return jax.device_put(a, a.sharding.with_memory_kind(kind))


def _place(fn_name: str, x, kind: str):
    a = _array(fn_name, x)
    if not isinstance(a, jax.core.Tracer):
        devices = a.sharding.device_set
        available = memory_kinds(next(iter(devices)))
        if kind not in available:
            raise ValueError(f"t2j.offload.{fn_name}: memory kind {kind!r} is not one of the device's memory kinds "
                             f"{available}")
    if isinstance(x, Tensor):
        return call_jax_64(lambda v: _put(v, kind), x)
    return _put(a, kind)


def to_host(x, kind: str = HOST):
    """``x`` (a tensor on the jax device or a jax.Array) placed in host memory, with its
    sharding otherwise unchanged. Works under `t2j.jit` and JAX transforms; torch
    autograd flows through it.

    >>> h = t2j.offload.to_host(torch.randn(1024, 1024, device="jax"))
    >>> t2j.offload.memory_kind(h)
    'pinned_host'
    """
    if kind == DEVICE:
        raise ValueError("t2j.offload.to_host: kind='device' is not host memory; use t2j.offload.to_device")
    return _place("to_host", x, kind)


def to_device(x):
    """``x`` placed back in the device's own memory (kind ``'device'``).

    >>> d = t2j.offload.to_device(h)
    >>> t2j.offload.memory_kind(d)
    'device'
    """
    return _place("to_device", x, DEVICE)


def name(x: torch.Tensor, label: str) -> torch.Tensor:
    """``x`` labelled ``label`` for a name-based remat policy (``jax.ad_checkpoint.checkpoint_name``
    for torch tensors); the value and its gradient are unchanged.

    >>> h = t2j.offload.name(self.fc(x), "fc_out")   # offload_policy(["fc_out"]) offloads it
    """
    if not isinstance(label, str):
        raise TypeError(f"t2j.offload.name: label must be a str, got {type(label).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"t2j.offload.name: expected a tensor on the jax device, got "
                        f"{x.device if isinstance(x, torch.Tensor) else type(x).__name__}")
    return call_jax_64(lambda v: checkpoint_name(v, label), x)


def offload_policy(names=None, *, save=(), src: str = DEVICE, dst: str = HOST):
    """A JAX remat policy that offloads saved activations to host memory.

    With no ``names``: every matmul whose operands have no batch dimension (the
    linear layers' outputs, ``jax.checkpoint_policies.offload_dot_with_no_batch_dims``)
    is saved in ``dst`` memory; everything else is recomputed. With ``names`` (labels
    given by `name`): those activations are offloaded, those in ``save`` are kept
    on the device, everything else is recomputed
    (``jax.checkpoint_policies.save_and_offload_only_these_names``).

    >>> step = t2j.train.make_train_step(model, loss_fn, optax.adamw(1e-3), remat=t2j.offload.offload_policy())
    >>> h = t2j.scan_layers(blocks, h, remat=t2j.offload.offload_policy(["fc_out"]))
    """
    names, save = _names("names", names), _names("save", save)
    if names is None:
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims(src, dst)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(save), names_which_can_be_offloaded=list(names), offload_src=src,
        offload_dst=dst)


def _names(arg: str, names):
    if names is None or isinstance(names, str):
        return names if names is None else [names]
    names = list(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"t2j.offload.offload_policy: {arg} must be activation labels (str), got {names!r}")
    return names


def _host_bytes(jaxpr, repeat: int = 1) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for v in eqn.outvars:
                if v.aval.memory_space == jax.memory.Space.Host:
                    total += repeat * math.prod(v.aval.shape) * v.aval.dtype.itemsize
        times = repeat * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else repeat
        for sub in _sub_jaxprs(eqn):
            total += _host_bytes(sub, times)
    return total


def _sub_jaxprs(eqn):
    for p in eqn.params.values():
        for v in p if isinstance(p, (tuple, list)) else (p,):
            if isinstance(v, jex_core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex_core.Jaxpr):
                yield v


def offloaded_bytes(fn, *args, **kwargs) -> int:
    """Bytes the JAX function ``fn`` moves to host memory in one call on these
    arguments (scan iterations counted), read from its jaxpr: how much an offload
    policy takes off the device, whatever the backend does with it.

    >>> grad = jax.grad(lambda s, x: fn(s, x).sum())
    >>> t2j.offload.offloaded_bytes(grad, state, x)
    """
    return _host_bytes(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)


__all__ = ["DEVICE", "HOST", "memory_kind", "memory_kinds", "name", "offload_policy", "offloaded_bytes", "to_device",
           "to_host"]
