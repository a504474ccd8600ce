"""Checkpoints of models and optimizers with orbax: sharded, multi-process.

`save` writes every tensor of a state (modules' state dicts, optimizers' state and
any tensors or arrays) with orbax — each process writes the shards it holds — and
the rest (optimizer hyperparameters, step counters, Python values) beside it.
`load` restores into live modules and optimizers, placing every array with the
sharding of the tensor it replaces, so a sharded run resumes sharded.

Example::

    t2j.save({"model": model, "optimizer": opt, "step": 100}, "ckpt/100")
    ...
    t2j.load("ckpt/100", {"model": model, "optimizer": opt})   # in place
"""

from __future__ import annotations

import os
import pickle

import jax
import orbax.checkpoint as ocp
import torch

from .tensor import Tensor, jax_array, new_tensor

_SKELETON = "torch2jax_structure.pkl"


class _Array:
    """Placeholder in the saved structure for the array stored under ``key``."""

    def __init__(self, key, dtype):
        self.key, self.dtype = key, dtype


def _split(obj, arrays, prefix):
    """The structure of ``obj`` with every tensor replaced by an `_Array` placeholder."""
    if isinstance(obj, torch.nn.Module):
        return {"__module__": _split(obj.state_dict(keep_vars=True), arrays, prefix + "module/")}
    if isinstance(obj, torch.optim.Optimizer):
        return {"__optimizer__": _split(obj.state_dict(), arrays, prefix + "optimizer/")}
    if isinstance(obj, torch.Tensor) or isinstance(obj, jax.Array):
        key = prefix.rstrip("/").replace(".", "_") or "value"
        array = obj._value() if isinstance(obj, Tensor) else obj if isinstance(obj, jax.Array) else jax_array(obj)
        arrays[key] = array
        return _Array(key, obj.dtype)
    if isinstance(obj, dict):
        return {k: _split(v, arrays, f"{prefix}{k}/") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, arrays, f"{prefix}{i}/") for i, v in enumerate(obj))
    return obj


def save(state, path: str) -> None:
    """Write ``state`` (modules, optimizers, tensors, arrays and Python values, nested
    in dicts and lists) to the directory ``path`` (created; must not exist).

    >>> t2j.save({"model": model, "optimizer": opt, "step": step}, "ckpt/step_100")
    """
    path = os.path.abspath(path)
    arrays: dict = {}
    with jax.enable_x64(True):  # int64 / float64 tensors are saved as such
        skeleton = _split(state, arrays, "")
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(os.path.join(path, "arrays"), arrays)
        ckpt.wait_until_finished()
    if jax.process_index() == 0:
        with open(os.path.join(path, _SKELETON), "wb") as f:
            pickle.dump(skeleton, f)


def _targets(skeleton, target, out):
    """For each saved array, the live tensor it goes back into (when ``target`` has one)."""
    if isinstance(skeleton, _Array):
        if isinstance(target, Tensor):
            out[skeleton.key] = target
        return
    if isinstance(skeleton, dict) and "__module__" in skeleton and isinstance(target, torch.nn.Module):
        _targets(skeleton["__module__"], target.state_dict(keep_vars=True), out)
    elif isinstance(skeleton, dict) and "__optimizer__" in skeleton and isinstance(target, torch.optim.Optimizer):
        _optimizer_targets(skeleton["__optimizer__"], target, out)
    elif isinstance(skeleton, dict) and isinstance(target, dict):
        for k, v in skeleton.items():
            _targets(v, target.get(k), out)
    elif isinstance(skeleton, (list, tuple)) and isinstance(target, (list, tuple)):
        for s, t in zip(skeleton, target):
            _targets(s, t, out)


def _optimizer_targets(saved, opt, out):
    params = [p for g in opt.param_groups for p in g["params"]]
    for index, entries in saved["state"].items():
        p = params[index] if index < len(params) else None
        for k, v in entries.items():
            if isinstance(v, _Array):
                live = opt.state.get(p, {}).get(k) if p is not None else None
                out[v.key] = live if isinstance(live, Tensor) else p


def _abstract(arrays_meta, targets):
    """Shapes and dtypes of the saved arrays, with the shardings to restore them with."""
    out = {}
    for key, meta in arrays_meta.items():
        target = targets.get(key)
        sharding = None
        if isinstance(target, Tensor):
            value = target._value()
            if tuple(value.shape) == tuple(meta.shape):
                sharding = value.sharding
            elif hasattr(value.sharding, "mesh"):
                sharding = jax.sharding.NamedSharding(value.sharding.mesh, jax.sharding.PartitionSpec())
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        out[key] = jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding)
    return out


def _join(skeleton, arrays):
    if isinstance(skeleton, _Array):
        return new_tensor(arrays[skeleton.key])
    if isinstance(skeleton, dict):
        return {k: _join(v, arrays) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_join(v, arrays) for v in skeleton)
    return skeleton


def _apply(restored, target):
    """Load restored values into live modules and optimizers of ``target``; return the rest."""
    if isinstance(restored, dict) and "__module__" in restored:
        if isinstance(target, torch.nn.Module):
            target.load_state_dict(restored["__module__"])
            return target
        return restored["__module__"]
    if isinstance(restored, dict) and "__optimizer__" in restored:
        if isinstance(target, torch.optim.Optimizer):
            target.load_state_dict(restored["__optimizer__"])
            return target
        return restored["__optimizer__"]
    if isinstance(restored, dict):
        return {k: _apply(v, target.get(k) if isinstance(target, dict) else None) for k, v in restored.items()}
    if isinstance(restored, (list, tuple)):
        ts = target if isinstance(target, (list, tuple)) else [None] * len(restored)
        return type(restored)(_apply(v, t) for v, t in zip(restored, ts))
    return restored


def load(path: str, target=None):
    """Read a checkpoint written by `save`. Modules and optimizers in ``target`` (the
    same nesting as when saved) are loaded in place, each array placed with the
    sharding of the live tensor it replaces; everything is also returned (tensors on
    the jax device, modules and optimizers as the target objects or as state dicts).

    >>> state = t2j.load("ckpt/step_100", {"model": model, "optimizer": opt})
    >>> state["step"]
    100
    """
    path = os.path.abspath(path)
    with open(os.path.join(path, _SKELETON), "rb") as f:
        skeleton = pickle.load(f)
    with jax.enable_x64(True):
        ckpt = ocp.StandardCheckpointer()
        meta = ckpt.metadata(os.path.join(path, "arrays"))
        meta = getattr(meta, "item_metadata", meta)
        targets: dict = {}
        _targets(skeleton, target, targets)
        arrays = ckpt.restore(os.path.join(path, "arrays"), _abstract(dict(meta), targets))
        return _apply(_join(skeleton, arrays), target)


__all__ = ["save", "load"]
