"""Host values of a traced program's small integer state: counters and flags it branches on.

torch code branches on small state tensors: ``AveragedModel.update_parameters`` copies the
weights while ``bool(self.n_averaged == 0)``, a module runs its warm-up ``if self.step < 10``.
Under `t2j.jit` such a tensor is a program input, its value a tracer, and Python's ``if``
cannot be compiled (torch.compile breaks the graph there). `t2j.jit` takes the branch the
current value takes and guards on it, as it does for Python numbers:

* A one-element integer or bool tensor the program carries as state has a *host value*:
  read from the device when a trace first branches on it (`host_value`), known without
  reading afterwards when the program computes its next value from such values alone
  (``n += 1``: a *mirror*, `Slice` of the output, run on the CPU after each call).
* ``bool()`` of a traced value computed from host-valued state alone (the ``Slice`` of the
  jaxpr equations that produce it) takes the value it has now and records a `StateGuard`;
  a call whose state gives the other outcome traces the other branch (`t2j.jit` keeps both).

A value that depends on anything else (the data, a parameter) still stops the trace, as
do ``int()`` and ``float()`` of state (each value would be a new program).

Example::

    ema = torch.optim.swa_utils.AveragedModel(model)

    @t2j.jit
    def step(x):
        ...
        ema.update_parameters(model)   # two programs: the first call's copy, then the average
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
from jax._src import core
from jax._src.interpreters import partial_eval as pe

log = logging.getLogger(__name__)

# While `t2j.jit` traces: the tracers of the host-valued state, see `Hints`.
HINTS: "Hints | None" = None


def carries_host_value(array) -> bool:
    """Whether state ``array`` gets a host value: one element of an integer or bool dtype, which
    this process can read (on its devices, or the same on every one of them)."""
    return (array.size == 1 and (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_)
            and not isinstance(array, jax.core.Tracer)
            and (array.is_fully_addressable or array.sharding.is_fully_replicated))


def host_value(storage, array=None) -> np.ndarray:
    """The value of ``storage``'s array (or of ``array``, the one it holds outside a trace) on the
    host: the mirror a program left (see `Slice`), else read from the device (which waits for
    the program that computes it)."""
    array = storage.array if array is None else array
    known = storage.host
    if known is not None and known[0] is array:
        return known[1]
    # (a replicated array of several processes: each holds the whole value)
    value = np.asarray(array if array.is_fully_addressable else array.addressable_data(0))
    storage.host = (array, value)
    return value


class Hints:
    """The tracers of one trace whose values are known on the host: (storage index, tracer,
    storage, the array it holds outside the trace) by ``id`` of the tracer (the input array a
    storage holds while the function is traced). Values are read when a branch needs them."""

    def __init__(self):
        self.inputs: dict[int, tuple] = {}

    def add(self, index: int, tracer, storage, array):
        self.inputs[id(tracer)] = (index, tracer, storage, array)

    def slice(self, value) -> "Slice | None":
        """The `Slice` computing traced ``value`` from host-valued inputs; None where it reads
        anything else (an argument, a parameter, a random key) or is not of this trace."""
        if not isinstance(value, pe.DynamicJaxprTracer):
            return None
        try:
            return _slice(self.inputs, value)
        except _NotHinted:
            return None
        except Exception:  # noqa: BLE001 (JAX's tracer internals changed: no hint, the branch stops the trace)
            log.debug("no host value for %s", value, exc_info=True)
            return None


class _NotHinted(Exception):
    pass


def _slice(inputs, out) -> "Slice":
    """Walk the equations producing ``out`` back to host-valued inputs, literals and constants
    (depth first, without recursion: a value computed from the data has a deep history)."""
    eqns, emitted, seen, used, consts = [], set(), set(), {}, {}
    frame = out._trace.frame
    stack = [(out, False)]
    while stack:
        tracer, inputs_done = stack.pop()
        if inputs_done:  # (its equation's inputs are in `eqns` by now)
            if id(tracer.parent) not in emitted:
                emitted.add(id(tracer.parent))
                eqns.append(tracer.parent)
            continue
        if id(tracer) in seen:
            continue
        seen.add(id(tracer))
        if id(tracer) in inputs:
            used[id(tracer)] = inputs[id(tracer)]
            continue
        val = tracer.val
        if isinstance(val, core.Literal):
            continue
        if val in frame.constvar_to_val:
            consts[val] = np.asarray(frame.constvar_to_val[val])
            continue
        eqn = tracer.parent
        if eqn is None or eqn.effects:
            raise _NotHinted
        stack.append((tracer, True))
        stack.extend((t, False) for t in reversed(eqn.in_tracers))
    order = sorted(used.values(), key=lambda u: u[0])
    jaxpr = core.Jaxpr(
        list(consts), [t.val for _, t, _, _ in order], [out.val],
        [core.new_jaxpr_eqn([t.val for t in e.in_tracers], e.outvars, e.primitive, e.params, e.effects,
                            e.source_info, e.ctx) for e in eqns])
    return Slice(tuple(i for i, _, _, _ in order), jaxpr, list(consts.values()),
                 [host_value(st, a) for _, _, st, a in order])


class Slice:
    """A traced value as a function of host-valued state: ``slice(values)`` computes it on the
    CPU from the host values of the storages at ``indices`` (in that order); ``hint`` is its value
    at trace time."""

    def __init__(self, indices, jaxpr, consts, hint_inputs):
        self.indices = indices
        self._fn = jax.jit(functools.partial(core.eval_jaxpr, jaxpr, consts))
        self.hint = self(hint_inputs)

    def __call__(self, values) -> np.ndarray:
        # on the CPU, outside any trace: a host value must not wait for the device or be staged out
        with jax.ensure_compile_time_eval(), jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
            return np.asarray(self._fn(*values)[0])

    def of(self, storages) -> np.ndarray:
        """The value for the current host values of ``storages`` (a program's state list)."""
        return self([host_value(storages[i]) for i in self.indices])


class StateGuard:
    """What a trace assumed of its host-valued state: ``bool(slice) == outcome``."""

    as_type = bool
    inputs = frozenset()  # (no number inputs: see `symbolic.Guard`)

    def __init__(self, slice_: Slice, outcome: bool):
        self.slice = slice_
        self.outcome = outcome

    def holds(self, values, storages) -> bool:
        return bool(self.slice.of(storages)) == self.outcome

