"""`shard_map` for torch functions: per-device code with explicit collectives.

Example::

    mesh = t2j.parallel.make_mesh({"data": 8})

    def local_mean(x):                    # x: this device's shard
        s = x.sum(0, keepdim=True)
        dist.all_reduce(s)                # over every mesh axis
        return s / (x.shape[0] * dist.get_world_size())

    f = t2j.parallel.shard_map(local_mean, mesh, in_specs=("data",), out_specs=())

The function may also use parameters it does not receive (a closed-over module's):
they are passed in replicated, and their gradients flow. An argument it writes in place
(``dist.all_reduce(x)``) is written back to the caller's tensor, as torch does.
"""

from __future__ import annotations

import contextlib

import jax
import torch
from jax.sharding import PartitionSpec

from .. import gradcut as _gradcut
from ..env import _trace_state_clean
from ..interop import call_jax_64
from ..jit import _find_roots
from ..tensor import Tensor, new_tensor
from .collectives import collectives, varying_axes
from .sharding import ShardingError, named_sharding


def _spec(s):
    if s is None or isinstance(s, PartitionSpec):
        return s if s is not None else PartitionSpec()
    if isinstance(s, str):
        return PartitionSpec(s)
    return PartitionSpec(*s)


def _is_entry(s) -> bool:
    """One dimension's entry of a partition spec: a mesh axis name, None or a tuple of names."""
    return s is None or isinstance(s, str) or (isinstance(s, tuple) and all(isinstance(a, str) for a in s))


def _out_specs(specs, out):
    """``out_specs`` as a pytree of PartitionSpecs for output ``out`` (one traced call's).

    A tuple is per output where the function returns a tuple of as many values, and one
    output's spec where it returns a single tensor: ``(None, "model")`` is both two
    outputs' specs and one 2-D output's. Specs nest as the outputs do (a tuple of dicts)."""
    if isinstance(specs, dict):  # one spec per output of a dict of outputs
        return {k: _out_specs(v, out.get(k) if isinstance(out, dict) else None) for k, v in specs.items()}
    if isinstance(specs, list):
        outs = out if isinstance(out, (tuple, list)) and len(out) == len(specs) else [None] * len(specs)
        return [_out_specs(s, o) for s, o in zip(specs, outs)]
    if isinstance(specs, tuple) and specs:
        if isinstance(out, (tuple, list)) and len(out) == len(specs):
            per_output = [_out_specs(s, o) for s, o in zip(specs, out)]  # (nested: a tuple of dicts of outputs)
            return out._make(per_output) if hasattr(out, "_make") else type(out)(per_output)
        if all(_is_entry(s) for s in specs):
            return _spec(specs)
        return tuple(_spec(s) for s in specs)
    return _spec(specs)


def _check_arguments(tensors, in_specs, mesh):
    if len(tensors) != len(in_specs):
        raise ShardingError(f"shard_map: {len(in_specs)} in_specs for {len(tensors)} arguments: give one partition "
                            "spec per positional argument (() for a replicated one)")
    for i, (t, spec) in enumerate(zip(tensors, in_specs)):
        if not isinstance(t, torch.Tensor):
            raise ShardingError(f"shard_map: argument {i} is a {type(t).__name__}, not a tensor: close over "
                                "values that are not tensors (functools.partial)")
        named_sharding(tuple(t.shape), mesh, spec, f"shard_map: argument {i}")


def _unchanged(found) -> list:
    """The tensors of ``found`` ((tensor, its value before the probe) pairs), each put back to that
    value: a write into one inside the body would be lost (the program's inputs are values)."""
    wrote = []
    for t, before in found:
        if t._t2j_storage.array is not before:
            t._t2j_storage.array, t._t2j_storage.version = before, t._t2j_storage.version + 1
            wrote.append(tuple(t.shape))
    if wrote:
        raise ShardingError(f"shard_map: the function writes in place into tensors of shapes {wrote} that it "
                            "closes over (a buffer such as BatchNorm's running statistics): pass them as "
                            "arguments, which are written back, or return the new values")
    return [_whole(t) for t, _ in found]


def _whole(t: Tensor) -> Tensor:
    """A tensor over all of ``t``'s storage, which the program then takes as an input: ``t``'s base
    where the body read it through a view (``w[0, 0]``)."""
    if not t._t2j_view:
        return t
    base = t._base
    if isinstance(base, Tensor) and base._t2j_storage is t._t2j_storage and not base._t2j_view:
        return base
    raise ShardingError(f"shard_map: the function reads a view of shape {tuple(t.shape)} of a tensor it closes "
                        "over whose base is unknown; pass the tensor as an argument")


def _closed_over(fn, tensors) -> list:
    """The tensors requiring grad that ``fn`` reaches without receiving them: its modules'
    parameters and the tensors it closes over (as `t2j.jit` finds its state)."""
    roots = _find_roots(fn, (), {})
    given = {id(t) for t in tensors}
    out, seen = [], set()
    for t in [*(p for m in roots.modules for p in m.parameters()), *roots.tensors]:
        if isinstance(t, Tensor) and t.requires_grad and t.is_leaf and id(t) not in given and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _spec_axes(spec) -> set:
    """The mesh axes a partition spec shards over."""
    return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def _check_replication(torch_fn, specs, out, written):
    """Raise where an output differs between devices over mesh axes its spec replicates it over:
    unchecked, the caller would silently get one device's value."""
    def check(where, spec, value):
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            varying = sorted(varying_axes(leaf) - _spec_axes(spec))
            if varying:
                name = getattr(torch_fn, "__name__", type(torch_fn).__name__)
                raise ShardingError(
                    f"shard_map({name}): {where}{jax.tree_util.keystr(path)} differs between the devices along mesh "
                    f"axes {varying}, but its spec {spec} declares it replicated over them. Name the axes in its "
                    f"spec (to concatenate the shards), reduce it over them with a collective (dist.all_reduce), "
                    f"or pass check_vma=False to skip the check (the caller then gets one device's value)")

    is_spec = lambda s: isinstance(s, PartitionSpec)  # noqa: E731
    jax.tree_util.tree_map_with_path(lambda p, spec, v: check("output" + jax.tree_util.keystr(p), spec, v),
                                     specs[0], out, is_leaf=is_spec)
    for spec, (i, v) in zip(specs[1], written):
        check(f"argument {i} (written in place)", spec, v)


# The programs whose torch function is running (being traced) now.
_INSIDE: list = []


class _Program:
    """``torch_fn`` per device for one set of argument shapes: the JAX shard_map (``mapped``, and
    ``jitted`` for eager calls: compiled once), and which arguments it writes in place. ``grad``:
    whether grad mode was on at the call, so that the body runs as the caller's code
    (`gradcut.as_caller`): JAX differentiating it (a ``backward()`` inside `t2j.jit`) follows it,
    where a Function's forward with grad mode off would be cut."""

    def __init__(self, torch_fn, mesh, in_specs, out_specs, check_vma, tensors, lifted, grad):
        self.torch_fn, self.mesh, self.lifted, self.grad, self.check_vma = torch_fn, mesh, lifted, grad, check_vma
        self.n, self.constants = len(tensors), []
        specs = (*in_specs, *(PartitionSpec() for _ in lifted))
        found = {}
        probe = jax.shard_map(lambda *a: self._body(a, found)[0], mesh=mesh, in_specs=specs,
                              out_specs=PartitionSpec(), check_vma=False)
        # the tensors the body closes over that are not lifted parameters (buffers, constants) are inputs
        # of the program, so that a compiled program kept for later calls reads their values then
        known = (id(t._t2j_storage) for t in lifted)
        with jax.enable_x64(True), _gradcut.Reads(known) as reads:  # (x64: as call_jax_64 runs it)
            jax.eval_shape(probe, *(jax.ShapeDtypeStruct(t.shape, t._value().dtype) for t in (*tensors, *lifted)))
        self.constants = _unchanged(reads.found.values())
        self.written = found["written"]
        self.out_specs = out = (_out_specs(out_specs, found["out"]), [in_specs[i] for i in self.written])
        specs += tuple(PartitionSpec() for _ in self.constants)
        self.mapped = jax.shard_map(self._run, mesh=mesh, in_specs=specs, out_specs=out, check_vma=check_vma)
        self.jitted = jax.jit(self.mapped)

    @property
    def bound(self) -> list:
        """The tensors the body reaches without receiving them, which the program takes after its arguments."""
        return [*self.lifted, *self.constants]

    def _body(self, arrays, found):
        """Run the torch function on this device's arrays: (outputs, arguments it wrote)."""
        tensors = [new_tensor(a) for a in arrays[:self.n]]
        bound = [(t._t2j_storage, t._t2j_storage.array) for t in self.bound]
        _INSIDE.append(self)
        try:
            for (st, _), a in zip(bound, arrays[self.n:]):
                st.array, st.version = a, st.version + 1  # (views of it recompute their cached values)
            with collectives(self.mesh), _gradcut.as_caller() if self.grad else contextlib.nullcontext():
                out = self.torch_fn(*tensors)
        finally:
            _INSIDE.remove(self)
            for st, a in bound:
                st.array, st.version = a, st.version + 1
        found["out"] = out
        found["written"] = [i for i, (t, a) in enumerate(zip(tensors, arrays)) if t._value() is not a]
        return jax.tree.map(lambda t: t._value() if isinstance(t, Tensor) else t, out,
                            is_leaf=lambda t: isinstance(t, torch.Tensor)), [tensors[i] for i in found["written"]]

    def _run(self, *arrays):
        found = {}
        out, written = self._body(arrays, found)
        written = [t._value() for t in written]
        if self.check_vma:
            _check_replication(self.torch_fn, self.out_specs, out, list(zip(self.written, written)))
        return out, written


class _ShardMapped:
    """What `shard_map` returns: ``torch_fn`` per device, its programs kept per argument shapes."""

    def __init__(self, torch_fn, mesh, in_specs, out_specs, check_vma):
        self.torch_fn, self.mesh, self.out_specs, self.check_vma = torch_fn, mesh, out_specs, check_vma
        self.in_specs = tuple(_spec(s) for s in in_specs)
        self.programs: dict = {}

    @property
    def _t2j_runs(self):
        """What `t2j.jit` searches for the state a call reaches: the torch function, not the
        programs kept here (tensors bound to a trace's values while it runs)."""
        return self.torch_fn

    def __call__(self, *given):
        if _INSIDE:
            raise ShardingError(
                "shard_map: called inside the function of another shard_map, which already runs per device on "
                "its shards: nesting is not supported. Call the inner function directly there, with "
                "torch.distributed collectives over the mesh axes it needs (group=dist.new_group(...))")
        _check_arguments(given, self.in_specs, self.mesh)
        tensors = [t if isinstance(t, Tensor) else t.to("jax") for t in given]
        lifted = _closed_over(self.torch_fn, tensors)
        grad = torch.is_grad_enabled()
        key = (tuple((tuple(t.shape), t.dtype) for t in tensors), tuple(map(id, lifted)), grad)
        program = self.programs.get(key)
        if program is None:
            program = self.programs[key] = _Program(self.torch_fn, self.mesh, self.in_specs, self.out_specs,
                                                    self.check_vma, tensors, lifted, grad)
        # (eagerly the program compiled once; inside a JAX trace the shard_map itself, part of that program)
        mapped = program.jitted if _trace_state_clean() else program.mapped
        out, written = call_jax_64(mapped, *tensors, *program.bound)
        for i, value in zip(program.written, written):
            given[i].copy_(value)
        return out


def shard_map(torch_fn, mesh, in_specs, out_specs, check_vma: bool = True):
    """Run ``torch_fn`` once per device on its shards (``jax.shard_map`` for torch).

    ``in_specs`` has one partition spec per positional argument (a tuple of mesh axis
    names / None per dimension; ``()`` replicates), ``out_specs`` one per output (a tuple
    or list of them, or a dict of them for a dict of outputs; a single output's spec where
    the function returns one tensor).
    Inside, torch.distributed collectives act over the mesh axes of their process
    group (`new_group`; ``group=None`` is every axis). Differentiable (a torch
    autograd node whose backward is JAX's), also for the parameters the function reaches
    without receiving them, and usable inside `t2j.jit`, with ``backward()`` there too.
    Arguments it writes in place are written back.

    ``check_vma`` (as ``jax.shard_map``'s): an output whose spec leaves out a mesh axis is
    replicated over it, so its value must be the same on the devices along it (reduced by a
    collective, or computed from replicated values); one that may differ raises a
    `ShardingError` naming it. ``check_vma=False`` skips the check: the caller then gets one
    device's value of such an output.

    >>> f = t2j.parallel.shard_map(lambda x: x * 2, mesh, in_specs=(("data",),), out_specs=("data",))
    """
    return _ShardMapped(torch_fn, mesh, in_specs, out_specs, check_vma)
