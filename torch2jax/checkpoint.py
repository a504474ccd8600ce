"""Checkpoints of models and optimizers with orbax: sharded, multi-process.

`save` writes every tensor of a state (modules' state dicts, optimizers' state and
any tensors or arrays) with orbax — each process writes the shards it holds — and
the rest (optimizer hyperparameters, step counters, Python values) beside it.
`load` restores into live modules and optimizers, placing every array with the
sharding of the tensor it replaces, so a sharded run resumes sharded.

`load_safetensors` reads safetensors files (Hugging Face's format, sharded or not)
straight into jax arrays, one tensor at a time.

Example::

    t2j.save({"model": model, "optimizer": opt, "step": 100}, "ckpt/100")
    ...
    t2j.load("ckpt/100", {"model": model, "optimizer": opt})   # in place

    t2j.load_safetensors("hf_model_dir", model=model)         # model.safetensors(.index.json)
"""

from __future__ import annotations

import json
import os
import pickle
import struct

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import torch

from . import dtypes as _dt
from .tensor import Tensor, jax_array, new_tensor, torch_cpu

_SKELETON = "torch2jax_structure.pkl"


class _Array:
    """Placeholder in the saved structure for the array stored under ``key``; ``kind`` says
    what it was and comes back as: a jax-device tensor ("jax"), a CPU tensor ("cpu", e.g.
    ``torch.get_rng_state()``) or a jax.Array ("array")."""

    def __init__(self, key, dtype, kind="jax", empty=None):
        self.key, self.dtype, self.kind = key, dtype, kind
        self.empty = empty  # (shape, NumPy dtype) of an array without elements, which is not in orbax's part


def _split(obj, arrays, prefix):
    """The structure of ``obj`` with every tensor replaced by an `_Array` placeholder."""
    if isinstance(obj, torch.nn.Module):
        return {"__module__": _split(obj.state_dict(keep_vars=True), arrays, prefix + "module/")}
    if isinstance(obj, torch.optim.Optimizer):
        return {"__optimizer__": _split(obj.state_dict(), arrays, prefix + "optimizer/")}
    if isinstance(obj, torch.Tensor) or isinstance(obj, jax.Array):
        key = base = prefix.rstrip("/").replace(".", "_") or "value"
        n = 1
        while key in arrays:  # ("fc.1" and "fc_1", or {"a/b": x} and {"a": {"b": y}}: one name each)
            n += 1
            key = f"{base}~{n}"
        array = obj._value() if isinstance(obj, Tensor) else obj if isinstance(obj, jax.Array) else jax_array(obj)
        kind = "jax" if isinstance(obj, Tensor) else "array" if isinstance(obj, jax.Array) else "cpu"
        if array.size == 0:  # (orbax refuses arrays without elements: the structure holds them)
            return _Array(key, obj.dtype, kind, empty=(tuple(array.shape), np.dtype(array.dtype)))
        arrays[key] = array
        return _Array(key, obj.dtype, kind)
    if isinstance(obj, dict):
        return {k: _split(v, arrays, f"{prefix}{k}/") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return _same_sequence(obj, [_split(v, arrays, f"{prefix}{i}/") for i, v in enumerate(obj)])
    if obj is not None and not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(obj)):
        # a JAX pytree node (flax nnx's State, an equinox module, a registered dataclass): its arrays go to
        # orbax as any other's (sharded, each process its shards), not into the pickled structure
        leaves, treedef = jax.tree_util.tree_flatten(obj)
        return _Tree(jax.tree_util.tree_unflatten(treedef, [_split(v, arrays, f"{prefix}{i}/")
                                                            for i, v in enumerate(leaves)]))
    return obj


class _Tree:
    """Placeholder in the saved structure for a JAX pytree node: the node with `_Array` placeholders as leaves."""

    def __init__(self, tree):
        self.tree = tree

    def leaves(self) -> list:
        return jax.tree_util.tree_leaves(self.tree, is_leaf=lambda x: isinstance(x, _Array))


def _same_sequence(like, items):
    """A list or tuple of ``like``'s type holding ``items``: a named tuple's class (an optax state such as
    ``ScaleByAdamState``) takes them as positional arguments, not as one iterable."""
    return type(like)(*items) if hasattr(type(like), "_fields") else type(like)(items)


def save(state, path: str) -> None:
    """Write ``state`` (modules, optimizers, tensors, arrays and Python values, nested
    in dicts and lists) to the directory ``path`` (created; must not exist).

    >>> t2j.save({"model": model, "optimizer": opt, "step": step}, "ckpt/step_100")
    """
    path = os.path.abspath(path)
    arrays: dict = {}
    with jax.enable_x64(True):  # int64 / float64 tensors are saved as such
        skeleton = _split(state, arrays, "")
        if arrays:  # (orbax refuses an empty tree: a state of Python values, an optimizer before its first step)
            ckpt = ocp.StandardCheckpointer()
            ckpt.save(os.path.join(path, "arrays"), arrays)
            ckpt.wait_until_finished()
        elif jax.process_index() == 0:
            os.makedirs(path)
    if jax.process_index() == 0:
        with open(os.path.join(path, _SKELETON), "wb") as f:
            pickle.dump(skeleton, f)


def _targets(skeleton, target, out):
    """For each saved array, the live tensor (or jax.Array) it goes back into (when ``target`` has one)."""
    if isinstance(skeleton, _Array):
        if isinstance(target, (Tensor, jax.Array)):  # (a JAX-side state's arrays: placed as they are too)
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
    elif isinstance(skeleton, _Tree) and target is not None:
        saved, live = skeleton.leaves(), jax.tree_util.tree_leaves(target)
        if len(saved) == len(live):
            for s, t in zip(saved, live):
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
        if isinstance(target, (Tensor, jax.Array)):
            value = target._value() if isinstance(target, Tensor) else target
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
        kind = getattr(skeleton, "kind", "jax")  # (checkpoints written before kinds were saved)
        empty = getattr(skeleton, "empty", None)
        array = arrays[skeleton.key] if empty is None else jax.numpy.zeros(*empty)
        if kind == "array":
            return array
        out = torch_cpu(array) if kind == "cpu" else new_tensor(array)
        # (complex32, saved as the complex64 array that holds it)
        return out if out.dtype == skeleton.dtype else out.to(skeleton.dtype)
    if isinstance(skeleton, dict):
        return {k: _join(v, arrays) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return _same_sequence(skeleton, [_join(v, arrays) for v in skeleton])
    if isinstance(skeleton, _Tree):
        return jax.tree_util.tree_map(lambda v: _join(v, arrays), skeleton.tree,
                                      is_leaf=lambda x: isinstance(x, _Array))
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
        return _same_sequence(restored, [_apply(v, t) for v, t in zip(restored, ts)])
    return restored


def load(path: str, target=None):
    """Read a checkpoint written by `save`. Modules and optimizers in ``target`` (the
    same nesting as when saved) are loaded in place, each array placed with the
    sharding of the live tensor it replaces; everything is also returned (tensors where
    they were saved from: the jax device or the CPU, as ``torch.set_rng_state`` needs; jax
    arrays as jax arrays; modules and optimizers as the target objects or as state dicts).

    >>> state = t2j.load("ckpt/step_100", {"model": model, "optimizer": opt})
    >>> state["step"]
    100
    """
    path = os.path.abspath(path)
    with open(os.path.join(path, _SKELETON), "rb") as f:
        skeleton = pickle.load(f)
    with jax.enable_x64(True):
        arrays = {}
        if os.path.exists(os.path.join(path, "arrays")):
            ckpt = ocp.StandardCheckpointer()
            meta = ckpt.metadata(os.path.join(path, "arrays"))
            meta = getattr(meta, "item_metadata", meta)
            targets: dict = {}
            _targets(skeleton, target, targets)
            arrays = ckpt.restore(os.path.join(path, "arrays"), _abstract(dict(meta), targets))
        return _apply(_join(skeleton, arrays), target)


# -- safetensors -----------------------------------------------------------------

# The format: an 8-byte little-endian header length, a JSON header
# {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
# then the tensors' bytes (little-endian, C order), offsets relative to the data start.
_SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_INDEX_NAMES = ("model.safetensors.index.json", "model.safetensors")


class _Entry:
    """Where one tensor of a safetensors file lies."""

    __slots__ = ("path", "key", "dtype", "shape", "start", "nbytes")

    def __init__(self, path, key, dtype, shape, start, nbytes):
        self.path, self.key, self.dtype, self.shape, self.start, self.nbytes = path, key, dtype, shape, start, nbytes


def _read_header(path):
    """The `_Entry` of every tensor in safetensors file ``path``, in file order."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"t2j.load_safetensors: {path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError, MemoryError, OverflowError) as e:
            raise ValueError(f"t2j.load_safetensors: {path} is not a safetensors file (bad header: {e})") from None
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(
                f"t2j.load_safetensors: {path}: tensor {key!r} has dtype {info['dtype']}; "
                f"supported: {sorted(_SAFETENSORS_DTYPES)}"
            )
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(
                f"t2j.load_safetensors: {path}: tensor {key!r} holds {end - begin} bytes, "
                f"not what shape {list(shape)} of {info['dtype']} needs"
            )
        entries.append(_Entry(path, key, dtype, shape, 8 + n + begin, end - begin))
    return entries


def _files(path_or_paths):
    """The safetensors files named by a file, a directory, an index json or a list of files."""
    if isinstance(path_or_paths, (list, tuple)):
        out = []
        for p in path_or_paths:
            out += _files(p)
        return out
    if not isinstance(path_or_paths, (str, os.PathLike)):
        raise TypeError(
            f"t2j.load_safetensors: expected a path (file, directory or index json) or a list of paths, "
            f"got {type(path_or_paths).__name__}"
        )
    path = os.fspath(path_or_paths)
    if os.path.isdir(path):
        for name in _INDEX_NAMES:
            if os.path.exists(os.path.join(path, name)):
                return _files(os.path.join(path, name))
        raise FileNotFoundError(f"t2j.load_safetensors: no {' or '.join(_INDEX_NAMES)} in directory {path}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"t2j.load_safetensors: no such file {path}")
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"t2j.load_safetensors: index {path} has no 'weight_map'")
        folder = os.path.dirname(path)
        return [os.path.join(folder, name) for name in dict.fromkeys(weight_map.values())]
    return [path]


def _entries(path_or_paths):
    """``{key: _Entry}`` over all files; a key in two files is an error."""
    out: dict = {}
    for path in _files(path_or_paths):
        for e in _read_header(path):
            if e.key in out:
                raise ValueError(f"t2j.load_safetensors: tensor {e.key!r} is in both {out[e.key].path} and {path}")
            out[e.key] = e
    return out


def _read(entry, handles, placement):
    """One tensor as a jax array placed by ``placement``; only it passes through host memory."""
    f = handles.get(entry.path)
    if f is None:
        f = handles[entry.path] = open(entry.path, "rb")
    buf = np.empty(entry.nbytes, np.uint8)
    f.seek(entry.start)
    if f.readinto(buf) != entry.nbytes:
        raise ValueError(f"t2j.load_safetensors: {entry.path} is truncated (tensor {entry.key!r})")
    with jax.enable_x64(True):  # int64 / float64 stay 64-bit
        return jax.device_put(buf.view(entry.dtype).reshape(entry.shape), placement)


def _placement(device):
    if isinstance(device, (jax.Device, jax.sharding.Sharding)):
        return device
    if device == "jax" or (isinstance(device, torch.device) and device.type == "jax"):
        return jax.devices()[0]
    raise ValueError(
        f"t2j.load_safetensors: device must be 'jax', a jax.Device or a jax.sharding.Sharding, got {device!r}"
    )


def _slots(model):
    """The model's state-dict tensors grouped by identity (tied weights form one group):
    a list of (tensor, [(module, kind, name, key), ...])."""
    groups: dict = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, t in module._parameters.items():
            if t is not None:
                groups.setdefault(id(t), (t, []))[1].append((module, "_parameters", name, dot + name))
        for name, t in module._buffers.items():
            if t is not None and name not in module._non_persistent_buffers_set:
                groups.setdefault(id(t), (t, []))[1].append((module, "_buffers", name, dot + name))
    return list(groups.values())


def _check_keys(groups, entries, strict):
    keys = {key for _, slots in groups for *_, key in slots}
    missing = [[key for *_, key in slots] for _, slots in groups if not any(key in entries for *_, key in slots)]
    unexpected = [k for k in entries if k not in keys]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append("missing keys " + ", ".join(" = ".join(group) for group in missing))
        if unexpected:
            parts.append("unexpected keys " + ", ".join(unexpected))
        raise RuntimeError(f"t2j.load_safetensors: the checkpoint does not match the model: {'; '.join(parts)}")


def _load_into(model, entries, handles, placement, strict):
    groups = _slots(model)
    _check_keys(groups, entries, strict)
    for tensor, slots in groups:
        entry = next((entries[key] for *_, key in slots if key in entries), None)
        if entry is None:
            continue
        if tuple(entry.shape) != tuple(tensor.shape):
            raise ValueError(
                f"t2j.load_safetensors: {entry.key!r} has shape {list(entry.shape)} in the checkpoint "
                f"but {list(tensor.shape)} in the model"
            )
        live = isinstance(tensor, Tensor)
        array = _read(entry, handles, tensor._value().sharding if live else placement)
        dtype = _dt.to_jax(tensor.dtype)
        if array.dtype != dtype:
            array = array.astype(dtype)
        if live:
            tensor._assign(array)
            continue
        new = new_tensor(array)
        if isinstance(tensor, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
        for module, kind, name, _ in slots:
            getattr(module, kind)[name] = new
    return model


def load_safetensors(path_or_paths, model: torch.nn.Module | None = None, device="jax", *, strict: bool = True):
    """Load safetensors weights straight into jax arrays, one tensor at a time (no
    full copy in torch CPU memory; bfloat16, float8, int64 kept).

    ``path_or_paths``: a ``.safetensors`` file, a list of them, a sharded
    checkpoint's index json (``model.safetensors.index.json``), or a directory
    holding either (what ``save_pretrained`` writes). Without ``model``, returns
    ``{name: t2j.Tensor}`` placed on ``device`` ("jax": the default jax device, or a
    ``jax.Device`` / ``jax.sharding.Sharding``). With ``model``, loads into its
    parameters and persistent buffers and returns the model: tensors already on
    the jax device are overwritten in place (keeping their sharding, and tied
    weights stay one tensor), others (CPU, meta) are replaced by jax tensors;
    values are cast to the model's dtypes. With ``strict`` (default) the keys must
    match the model's state dict exactly (a tied weight saved under one name is
    enough); a shape mismatch is always an error.

    >>> model = transformers.AutoModelForCausalLM.from_config(config).to("jax")
    >>> t2j.load_safetensors("gpt2-dir", model=model)        # model.safetensors(.index.json)
    >>> state = t2j.load_safetensors("model.safetensors")    # {name: t2j.Tensor}
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"t2j.load_safetensors: model must be a torch.nn.Module, got {type(model).__name__}")
    placement = _placement(device)
    entries = _entries(path_or_paths)
    handles: dict = {}
    try:
        if model is not None:
            return _load_into(model, entries, handles, placement, strict)
        return {key: new_tensor(_read(e, handles, placement)) for key, e in entries.items()}
    finally:
        for f in handles.values():
            f.close()


__all__ = ["save", "load", "load_safetensors"]
