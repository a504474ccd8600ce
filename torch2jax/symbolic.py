"""Python numbers whose value is traced: what ``t.item()`` returns under jit.

Inside `t2j.jit` (or any jax trace) a tensor's value is a JAX tracer, so
``t.item()`` cannot give a Python float. It gives a ``torch.SymFloat`` (or
``SymInt`` / ``SymBool``) backed by a `TracedScalar` node instead: arithmetic on
it stays traced, and when torch passes it back into an op as a Scalar argument
(``param.add_(grad, alpha=-lr)`` with a tensor ``lr`` in torch.optim) the
dispatcher unwraps it to the traced value. What cannot work is Python control
flow on it (``if t.item() > 0``, ``float(t)``): that raises an error saying so.

Example::

    @t2j.jit
    def step(x, lr):
        return x * lr.item()      # traced scalar, not a constant baked in
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import functools
import logging
import math
import operator
import sys
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax._src.lax import lax as lax_internal

from . import hints as _hints

# While `t2j.jit` traces, the guards taken on numbers with a hint (see `hinted_number`):
# a list of (replay, outcome), or None when no trace records them.
GUARDS: list | None = None


# Library functions whose ``if <tensor>: raise`` only validates their input, keyed by (module,
# function): under a trace the branch is taken as not raising, and the check runs with the program,
# raising (error type, message from the function's local variables) at run time instead of
# stopping the trace.
_VALIDATIONS = {
    ("torch.nn.functional", "gaussian_nll_loss"): (ValueError, lambda local: "var has negative entry/entries"),
    ("torch.nn.utils.clip_grad", "_get_total_norm"): (RuntimeError, lambda local: (
        f"The total norm of order {local.get('norm_type')} for gradients from `parameters` is non-finite, so it "
        "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
        "`error_if_nonfinite=False`")),
}


def _validation_site():
    """The (error type, message) of the validation in `_VALIDATIONS` that asked for ``bool()``, if any."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    if frame is None:
        return None
    site = _VALIDATIONS.get((frame.f_globals.get("__name__"), frame.f_code.co_name))
    return None if site is None else (site[0], site[1](frame.f_locals))


# How many validations traces have moved into their programs; `t2j.jit` does not donate the
# state of a program that has one.
RUNTIME_CHECKS = 0

# The error of the last validation that failed at run time: the program's caller raises it in place of
# the runtime error XLA wraps it in (see `failed_check`).
_FAILED: list = []


def _raise_if(failed, *, error, message):
    if failed:
        err = error(f"{message} (checked at run time by torch2jax)")
        _FAILED[:] = [err]
        raise err


def check_when_run(failed, error, value) -> None:
    """Make the program being traced raise ``error(value)`` when it runs with ``failed`` true.

    ``failed`` is a traced bool and ``value`` a traced scalar naming the offending element
    (an index, a class value); `t2j.jit` raises the error to its caller and keeps the state
    it would have written, as torch's raise does.
    """
    global RUNTIME_CHECKS
    RUNTIME_CHECKS += 1
    jax.debug.callback(functools.partial(_raise_error, error=error), failed, value)


def _raise_error(failed, value, *, error):
    if failed:
        err = error(value.item() if value.ndim == 0 else value.tolist())
        _FAILED[:] = [err]
        raise err


def failed_check() -> Exception | None:
    """The error of a validation moved into a program (see `_VALIDATIONS`) that failed when it ran, once."""
    return _FAILED.pop() if _FAILED else None


class _QuietFailedChecks(logging.Filter):
    """JAX logs a callback's exception with its traceback; ours is raised to the caller instead."""

    def filter(self, record):
        return not (record.exc_info and _FAILED and record.exc_info[1] is _FAILED[0])


logging.getLogger("jax._src.debugging").addFilter(_QuietFailedChecks())


def _kind(value):
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return int
    if isinstance(value, float):
        return float
    dtype = jnp.result_type(value)
    if dtype == jnp.bool_:
        return bool
    return int if jnp.issubdtype(dtype, jnp.integer) else float


def _as_float(v):
    return v.astype(jnp.result_type(float)) if hasattr(v, "astype") else float(v)


def _floor_int(v):
    return jnp.floor(v).astype(jnp.int64) if hasattr(v, "astype") else math.floor(v)


def _ceil_int(v):
    return jnp.ceil(v).astype(jnp.int64) if hasattr(v, "astype") else math.ceil(v)


def _trunc_int(v):
    return jnp.trunc(v).astype(jnp.int64) if hasattr(v, "astype") else int(v)


# method name (torch's SymNode protocol) -> (function of the values, result kind or None = promote)
_BINARY = {
    "add": (operator.add, None),
    "sub": (operator.sub, None),
    "mul": (operator.mul, None),
    "mod": (jnp.remainder, None),
    "float_pow": (jnp.power, float),
    "pow_by_natural": (jnp.power, int),
    "pow": (jnp.power, None),
    "float_truediv": (jnp.true_divide, float),
    "int_truediv": (jnp.true_divide, float),
    "truediv": (jnp.true_divide, float),
    "int_floordiv": (jnp.floor_divide, int),
    "floordiv": (jnp.floor_divide, None),
    "sym_min": (jnp.minimum, None),
    "sym_max": (jnp.maximum, None),
    "eq": (jnp.equal, bool),
    "ne": (jnp.not_equal, bool),
    "gt": (jnp.greater, bool),
    "lt": (jnp.less, bool),
    "le": (jnp.less_equal, bool),
    "ge": (jnp.greater_equal, bool),
    "sym_and": (jnp.logical_and, bool),
    "sym_or": (jnp.logical_or, bool),
    "and": (jnp.logical_and, bool),
    "or": (jnp.logical_or, bool),
}
_UNARY = {
    "neg": (operator.neg, None),
    "pos": (operator.pos, None),
    "abs": (jnp.abs, None),
    "sym_not": (jnp.logical_not, bool),
    "sym_float": (_as_float, float),
    "sym_int": (_trunc_int, int),
    "floor": (_floor_int, int),
    "ceil": (_ceil_int, int),
    "trunc": (_trunc_int, int),
    "sym_sqrt": (jnp.sqrt, float),
    "sqrt": (jnp.sqrt, float),
    "exp": (jnp.exp, float),
    "log": (jnp.log, float),
}


def _on_hints(fn):
    """``fn`` computed on concrete numbers: NumPy's function of the same name for a
    jax.numpy one (no JAX dispatch while guards are checked on every call)."""
    if getattr(fn, "__module__", "").startswith("jax"):
        return getattr(np, fn.__name__)
    return fn


def _checked_by_pow() -> bool:
    """Whether the ``torch._check`` asking is the one ``SymFloat.__pow__`` makes of its base
    (``base >= 0``, so that a power stays real): a traced base is taken as such, as Python
    code computing ``step ** 0.5`` of a step counter means it."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name.startswith(("_check", "expect_true")):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == "torch" \
        and frame.f_code.co_name in ("__pow__", "__rpow__")


class TracedScalar:
    """A torch SymNode whose value is a traced JAX scalar (or a Python constant).

    A node may carry a *replay*: a function from the values of the jitted program's
    hyperparameter inputs to this node's concrete value. Python control flow on such
    a node (``if momentum != 0``, ``float(beta)``) takes the value the trace was
    made with and records a guard, which `t2j.jit` checks on later calls.
    """

    def __init__(self, value, kind=None, replay=None, hint=None, inputs=frozenset()):
        self.value = value
        self.kind = kind or _kind(value)
        self.replay = replay
        self.hint = hint
        self.inputs = inputs  # the indices of the program inputs its replay reads

    # -- what torch asks of a node ------------------------------------------

    def is_int(self):
        return self.kind is int

    def is_float(self):
        return self.kind is float

    def is_bool(self):
        return self.kind is bool

    def is_nested_int(self):
        return False

    def is_symbolic(self):
        return True

    def is_constant(self):
        return False

    def has_hint(self):
        return False

    def nested_int(self):
        return None

    def constant_int(self):
        return None

    def maybe_as_int(self):
        return None

    def maybe_as_bool(self):
        return None

    def wrap_int(self, num):
        return _constant(num, int)

    def wrap_float(self, num):
        return _constant(num, float)

    def wrap_bool(self, num):
        return _constant(num, bool)

    def str(self):
        aval = getattr(self.value, "aval", None)
        return f"traced {self.kind.__name__} ({aval if aval is not None else self.value})"

    __repr__ = str

    def _graph_repr(self):
        return self.str()

    def __getattr__(self, name):
        if name in _BINARY:
            fn, kind = _BINARY[name]
            return lambda other: self._binary(fn, kind, other)
        if name in _UNARY:
            fn, kind = _UNARY[name]
            return lambda: self._unary(fn, kind or self.kind)
        raise AttributeError(name)

    def _unary(self, fn, kind):
        replay = hint = None
        if self.replay is not None:
            on_hint, inner = _on_hints(fn), self.replay
            replay, hint = (lambda vals: on_hint(inner(vals))), on_hint(self.hint)
        return TracedScalar(fn(self.value), kind, replay, hint, self.inputs)

    def _binary(self, fn, kind, other):
        if kind is None:
            kind = float if float in (self.kind, other.kind) else int
        replay = hint = None
        if self.replay is not None and other.replay is not None:
            on_hint, a, b = _on_hints(fn), self.replay, other.replay
            replay, hint = (lambda vals: on_hint(a(vals), b(vals))), on_hint(self.hint, other.hint)
        x, y = (_python_float(self.value), _python_float(other.value)) if kind is float else (self.value, other.value)
        return TracedScalar(fn(x, y), kind, replay, hint, self.inputs | other.inputs)

    # -- what cannot be done with a traced value -----------------------------

    def _concrete(self, what, as_type):
        site = _validation_site() if as_type is bool else None
        if site is not None:
            global RUNTIME_CHECKS
            RUNTIME_CHECKS += 1
            error, message = site
            jax.debug.callback(functools.partial(_raise_if, error=error, message=message),
                               jnp.asarray(self.value).astype(bool))
            return False
        if self.replay is not None and GUARDS is not None:
            outcome = as_type(self.hint)
            GUARDS.append(Guard(self.replay, as_type, outcome, self.inputs))
            return outcome
        # computed from counters and flags the program carries (`hints`): a branch on it is guarded
        state = _hints.HINTS.slice(self.value) if _hints.HINTS is not None else None
        if state is not None and not state.indices:
            # computed from constants alone (``Binomial(4, probs).enumerate_support()``'s ``int(total_count.max())``,
            # a tensor made of 4 in the trace): the same on every call
            return as_type(state.hint)
        if state is not None and as_type is bool and GUARDS is not None:
            outcome = bool(state.hint)
            GUARDS.append(_hints.StateGuard(state, outcome))
            return outcome
        from .dispatch import ValueNeeded

        if state is not None:
            raise _noted(ValueNeeded(
                f"torch2jax: {what} of a traced value computed from a one-element integer tensor (an argument, or a "
                "counter the jitted program carries): each of its values would be a program of its own, so t2j.jit "
                "does not take it as a constant (it does for a branch, bool()). Compute with the tensor itself "
                "(tensor arithmetic, torch.where; x[i] with a 0-d integer tensor i is a view the program places) "
                "instead of a Python number."
            ))
        raise _noted(ValueNeeded(
            f"torch2jax: {what} of a traced value: inside t2j.jit / jax.jit a tensor's value is not known "
            "while the program is traced, so Python control flow on it (if t.item() > 0, float(t), int(t), "
            "bool(t)) cannot be compiled. Compute with tensors instead (torch.where), or move the check "
            "outside the jitted function."
        ))

    def guard_int(self, file=None, line=None):
        return self._concrete("int()", int)

    def guard_float(self, file=None, line=None):
        return self._concrete("float()", float)

    def guard_bool(self, file=None, line=None):
        return self._concrete("bool()", bool)

    def guard_size_oblivious(self, file=None, line=None):
        return self._concrete("bool()", bool)

    def guard_or_false(self, file=None, line=None):
        return self._concrete("bool()", bool)

    def guard_or_true(self, file=None, line=None):
        return self._concrete("bool()", bool)

    def statically_known_true(self, file=None, line=None):
        # torch's fast paths ask (``x[a:b] = v`` whether the slice is all of x): only a constant is known
        return type(self.value) is bool and self.value

    def expect_true(self, file=None, line=None):
        if _checked_by_pow():
            return True
        return self._concrete("a check", bool)

    def expect_size(self, file=None, line=None):
        return self._concrete("a size", bool)

    def int_(self):
        return self._concrete("int()", int)

    def bool_(self):
        return self._concrete("bool()", bool)


def _python_float(value):
    """``value`` as a Python float computes: in double precision (``total += loss.item()``
    adds a float32 loss to a float64 total), where the trace has 64-bit types."""
    if hasattr(value, "dtype") and jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
        return value.astype(jax.dtypes.canonicalize_dtype(np.float64))
    return value


def _constant(num, kind):
    return TracedScalar(num, kind, replay=lambda vals: num, hint=num)


_SYM_TYPES = {int: torch.SymInt, float: torch.SymFloat, bool: torch.SymBool}


def traced_number(value):
    """A torch.SymInt / SymFloat / SymBool standing for the traced 0-d array ``value``."""
    node = TracedScalar(value)
    return _SYM_TYPES[node.kind](node)


def hinted_number(value, index: int, hint: float | int) -> torch.SymFloat | torch.SymInt:
    """A torch.SymFloat (a SymInt for an int ``hint``) for the traced number ``value``, the
    ``index``-th number input of a jitted program (a hyperparameter, a Python number it
    reads), whose value at trace time is ``hint``. Arithmetic on it stays traced; Python
    control flow on it is guarded (see `TracedScalar`)."""
    kind = int if type(hint) is int else float
    return _SYM_TYPES[kind](TracedScalar(value, kind, replay=lambda vals: vals[index], hint=hint,
                                         inputs=frozenset((index,))))


class Guard(NamedTuple):
    """What a trace assumed of its number inputs: ``as_type(replay(values)) == outcome``."""

    replay: Callable
    as_type: type  # bool for a branch; int or float where the trace needed the exact value
    outcome: object
    inputs: frozenset  # the indices of the number inputs it reads

    def holds(self, values, storages=()) -> bool:
        return self.as_type(self.replay(values)) == self.outcome


def guards_hold(guards, values, storages=()) -> bool:
    """Whether every guard a trace took still has its outcome for these input values (and, for a
    `hints.StateGuard`, the host values of these state storages)."""
    return all(g.holds(values, storages) for g in guards)


def is_traced_number(x) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) and isinstance(x.node, TracedScalar)


def value_of(x):
    """The JAX value behind a traced number (see `traced_number`)."""
    return x.node.value


def _traced_in(values) -> bool:
    return any(is_traced_number(v) or (type(v) in (list, tuple) and _traced_in(v)) for v in values)


def _host_tensors(out) -> bool:
    """Whether ``out`` is or holds a tensor that torch computed itself (not a torch2jax one)."""
    if isinstance(out, torch.Tensor):
        from .tensor import Tensor

        return not isinstance(out, Tensor) and out.device.type != "meta"
    return type(out) in (list, tuple) and any(map(_host_tensors, out))


def _basic_index(x, index):
    """``x[index]`` as torch's basic indexing takes it, where ``index`` (ints, slices, None,
    Ellipsis) holds traced ints: one `select` per int and one `narrow` per slice with a traced
    bound, which for a traced position are views the program places (`dispatch._traced_select`,
    `dispatch._traced_slice`). None for an index this does not cover (tensors, bools, a slice
    with a traced bound and an open end or a step): torch then takes it as usual, needing the
    numbers' exact values."""
    parts = index if type(index) is tuple else (index,)
    consumed = 0
    for p in parts:
        if type(p) is slice:
            if type(p.step) not in (int, type(None)) or any(
                    b is not None and type(b) is not int and not is_traced_number(b) for b in (p.start, p.stop)):
                return None
            consumed += 1
        elif type(p) is int or (isinstance(p, torch.SymInt) and is_traced_number(p)):
            consumed += 1
        elif p is not None and p is not Ellipsis:
            return None
    if sum(p is Ellipsis for p in parts) > 1 or consumed > x.dim():
        return None
    out, dim = x, 0
    for p in parts:
        if p is Ellipsis:
            dim += x.dim() - consumed
        elif p is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif type(p) is slice and (is_traced_number(p.start) or is_traced_number(p.stop)):
            # a traced bound: narrow's slice, one view for every value with this length (`dispatch._traced_slice`)
            if p.start is None or p.stop is None or p.step not in (None, 1):
                return None
            length = (p.stop.node.hint if is_traced_number(p.stop) else p.stop) - \
                (p.start.node.hint if is_traced_number(p.start) else p.start)
            out, dim = out.narrow(dim, p.start, length), dim + 1
        elif type(p) is slice:
            out, dim = out[(slice(None),) * dim + (p,)], dim + 1
        else:
            n = out.shape[dim]
            if type(p) is not int and p.node.hint is not None and not -n <= p.node.hint < n:
                raise IndexError(f"index {p.node.hint} is out of bounds for dimension {dim} with size {n}")
            out = out.select(dim, p)
    return out


def _index_holds_traced(index) -> bool:
    return any((isinstance(p, torch.SymInt) and is_traced_number(p))
               or (type(p) is slice and (is_traced_number(p.start) or is_traced_number(p.stop)))
               for p in (index if type(index) is tuple else (index,)))


def _set_item(x, index, value) -> bool:
    """``x[index] = value`` through `_basic_index`'s view; False where that does not cover ``index``."""
    view = _basic_index(x, index)
    if view is None:
        return False
    if isinstance(value, torch.Tensor):
        # torch drops the value's leading size-1 dimensions beyond the view's
        while value.dim() > view.dim() and value.shape[0] == 1:
            value = value[0]
        view.copy_(value)
    else:
        view.fill_(value)
    return True


def _number_torch_function(cls, func, types, args=(), kwargs=None):
    """``__torch_function__`` of torch.SymInt / SymFloat / SymBool while a trace runs (see
    `traced_builtins`). torch calls it for a function given a symbolic number where it takes a
    tensor (``table + n``, ``torch.where(m, x, n)``) or an index (``alphas[t]``).

    Indexes holding traced numbers (``alphas[t]``, ``cache[:, pos] = k``) become views at positions
    the program computes (`_basic_index`), where torch's indexing would need the numbers' exact
    values. A function that gave a tensor torch computed itself (a CPU one) from a traced number
    raises: torch's argument parser puts a placeholder (7777777) where the number's value goes,
    so the result would be silently wrong."""
    kwargs = kwargs or {}
    if func is torch.Tensor.__getitem__ and _index_holds_traced(args[1]):
        out = _basic_index(_on_device_if_host(args[0]), args[1])
        if out is not None:
            return out
    elif func is torch.Tensor.__setitem__ and _index_holds_traced(args[1]) and _set_item(*args):
        return None
    elif func in _FUSED_STEPS and is_traced_number(kwargs.get("lr")):
        kwargs = {**kwargs, "lr": _lr_tensor(kwargs["lr"], args[0])}
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if _host_tensors(out) and (_traced_in(args) or _traced_in(kwargs.values())):
        from .dispatch import OpError

        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise OpError(
            f"torch2jax: {name} computed a CPU tensor from a traced number (a number that is an input of "
            "the jitted program, or t.item()): its value is only known when the program runs. Move the CPU "
            "tensor to the jax device."
        )
    return out


def index_with_numbers(func, args):
    """``Tensor.__getitem__`` / ``__setitem__`` (``func``) of ``args`` whose index holds traced numbers
    (`torch2jax.tensor.TracedIndex` made them from 0-d tensors), as `_number_torch_function` takes them."""
    return _number_torch_function(None, func, (), args)


# torch.optim's fused steps, whose Python-float ``lr`` has a tensor overload: a traced lr (a group's
# lr set inside the step from a number the program takes) is passed as a tensor, not guarded by value
_FUSED_STEPS = frozenset({torch._fused_adam_, torch._fused_adamw_, torch._fused_sgd_})


def _lr_tensor(lr, params):
    """``lr`` as the 0-d tensor torch.optim's tensor-lr paths take: float64 for float64 parameters."""
    from .tensor import new_tensor

    wide = any(p.dtype == torch.float64 for p in params)
    return new_tensor(jnp.asarray(value_of(lr), jnp.float64 if wide else jnp.float32))


def _on_device_if_host(x):
    """``x``, a CPU tensor moved to the jax device: a table on the CPU indexed at a traced position
    (diffusers' ``self.sigmas[self.step_index]``) becomes a constant of the program indexed where the
    program computes, so the position stays an input (the element is a jax tensor, where torch's is a
    0-d CPU tensor: either computes with jax tensors alike). A trace that reads a CPU tensor is keyed
    by its values (`t2j.jit`'s guards), so the constant is the tensor's current value."""
    from .tensor import DEVICE, HOST_COPIES, Tensor

    if isinstance(x, Tensor) or x.device.type != "cpu":
        return x
    copy = x.to(DEVICE)
    HOST_COPIES.add(copy._t2j_storage)
    return copy


def _traced_tensor_value(x) -> bool:
    """Whether ``x`` is a jax-device tensor whose value is traced."""
    from .tensor import Tensor

    return isinstance(x, Tensor) and isinstance(x._value(), jax.core.Tracer)


def _traced_tensor(x) -> bool:
    """Whether ``x`` is a one-element jax-device tensor whose value is traced."""
    return _traced_tensor_value(x) and x.numel() == 1


def _traced_extremum(builtin, sym, beats):
    """``builtin`` (Python's min or max) that keeps traced values traced: ``min(lr, 1 / step ** 0.5)``
    with a traced ``step`` is ``torch.sym_min`` of the two, where Python's would ask ``bool()`` of
    their comparison. With a traced one-element tensor among them the result is a tensor (``b``
    where ``beats(b, a)``, else ``a``, as Python picks). Anything else, keyword arguments
    included, goes to ``builtin``."""

    def pick(a, b):
        if _traced_tensor(a) or _traced_tensor(b):
            return torch.where(beats(b, a), b, a)
        return sym(a, b)

    @functools.wraps(builtin)
    def extremum(*args, **kwargs):
        if kwargs or not args:
            return builtin(*args, **kwargs)
        if len(args) == 1:
            if not isinstance(args[0], (list, tuple)):
                args = (list(args[0]),)  # (an iterator is read once, here)
            items = args[0]
        else:
            items = args
        if len(items) and any(is_traced_number(v) or _traced_tensor(v) for v in items):
            return functools.reduce(pick, items)
        return builtin(*args)

    return extremum


def _traced_math(name, fn):
    """``math.<name>`` that keeps a traced number traced (``math.exp(-self.t)`` of a counter that
    is a program input); any other argument goes to ``fn``, Python's."""

    @functools.wraps(fn)
    def math_fn(x, *rest):
        if not rest and is_traced_number(x):
            return torch.SymFloat(x.node._unary(getattr(jnp, name), float))
        return fn(x, *rest)

    return math_fn


def _traced_pow(fn):
    """``math.pow`` that keeps a traced number traced (``math.pow(state["step"], -0.8)`` of a step
    counter that is a program input); other arguments go to ``fn``, Python's."""

    @functools.wraps(fn)
    def pow_fn(x, y):
        if is_traced_number(x) or is_traced_number(y):
            return torch.sym_float(x) ** torch.sym_float(y)
        return fn(x, y)

    return pow_fn


def _traced_data(data) -> bool:
    """Whether ``data`` (of ``torch.tensor(data)``) is or holds a traced number or a traced tensor (an
    actor-critic's ``torch.tensor([R])`` of an element ``R`` of a tensor)."""
    return is_traced_number(data) or _traced_tensor_value(data) \
        or (type(data) in (list, tuple) and any(map(_traced_data, data)))


def _data_array(data):
    if is_traced_number(data):
        return scalar_value_of(data)
    if isinstance(data, torch.Tensor):
        return data.jax()
    if type(data) in (list, tuple):
        return jnp.stack([jnp.asarray(_data_array(d)) for d in data]) if data else jnp.zeros((0,))
    return data


def _inferred_dtype(data):
    """The dtype ``torch.tensor(data)`` infers: each item's (a tensor's own, int64 for an int, the default
    float dtype for a float, ...), promoted pairwise."""
    if isinstance(data, torch.Tensor):
        return data.dtype
    if type(data) in (list, tuple):
        dtypes = [_inferred_dtype(d) for d in data]
        return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.get_default_dtype()
    kind = data.node.kind if is_traced_number(data) else type(data)
    if kind is bool:
        return torch.bool
    if kind is int:
        return torch.int64
    if kind is complex:
        return torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64
    return torch.get_default_dtype()


def _tensor_of(data, dtype=None, like=None, requires_grad=False):
    """A tensor of the program holding ``data``, traced numbers (or lists holding some): on the jax
    device, where torch would make a CPU tensor of a value it does not know."""
    from . import dtypes as _dt
    from .tensor import new_tensor

    value = jnp.asarray(_data_array(data))
    dtype = dtype or (like.dtype if like is not None else None) or _inferred_dtype(data)
    out = new_tensor(value.astype(_dt.to_jax(dtype)))
    return out.requires_grad_() if requires_grad else out


def _traced_factory(fn, method=False):
    """``torch.tensor`` / ``torch.as_tensor`` (``Tensor.new_tensor`` where ``method``) that makes a
    tensor of the program from traced numbers (`_tensor_of`); anything else goes to ``fn``."""

    @functools.wraps(fn)
    def factory(*args, **kwargs):
        data = args[1] if method and len(args) > 1 else args[0] if args and not method else None
        if data is not None and _traced_data(data):
            return _tensor_of(data, kwargs.get("dtype"), args[0] if method else None,
                              bool(kwargs.get("requires_grad")))
        return fn(*args, **kwargs)

    return factory


def _traced_float(x=0.0):
    """Python's ``float`` for `torch.nn.modules.batchnorm`, whose ``momentum=None`` (a cumulative
    average) takes ``1.0 / float(self.num_batches_tracked)`` of a counter the program carries: of a
    traced one-element tensor or number it is a traced float (`_traced_batch_norm` takes it as the
    momentum), so that every call runs one program instead of one per count. Only that module's
    name is replaced: library code compares types with ``is float``."""
    value = x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x
    return torch.sym_float(value) if is_traced_number(value) else builtins.float(value)


def _traced_batch_norm(fn):
    """``F.batch_norm`` (``fn``) that takes a traced float ``momentum`` (`_traced_float`), where torch
    takes a Python number only: the batch's statistics come from ``fn`` with momentum 1 into fresh
    buffers, and the running statistics are averaged with the traced momentum as torch's kernel
    averages them, ``(1 - momentum) * running + momentum * batch``."""

    @functools.wraps(fn)
    def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                   eps=1e-5):
        if not (is_traced_number(momentum) and training and running_mean is not None and running_var is not None):
            return fn(input, running_mean, running_var, weight, bias, training, momentum, eps)
        batch_mean, batch_var = torch.zeros_like(running_mean), torch.zeros_like(running_var)
        out = fn(input, batch_mean, batch_var, weight, bias, True, 1.0, eps)
        with torch.no_grad():
            running_mean.copy_((1 - momentum) * running_mean + momentum * batch_mean)
            running_var.copy_((1 - momentum) * running_var + momentum * batch_var)
        return out

    return batch_norm


def _stop_for_print():
    from .dispatch import ValueNeeded

    raise _noted(ValueNeeded(
        "torch2jax: str() / print / format of a traced value (print(loss.item()) inside t2j.jit): its value "
        "is not known while the program is traced. Return it and print it after the call"))


def _traced_format(x, spec):
    """``format`` of a torch.SymInt / SymFloat / SymBool: of a traced number (``f"{loss.item():.4f}"`` in a
    jitted step) it stops the trace, so that the call runs eagerly and prints its values, as a graph break
    does under torch.compile. (Not ``str``, which torch's argument parsing calls on the numbers it is given.)"""
    if is_traced_number(x):
        _stop_for_print()
    return format(repr(x), spec)


def _traced_print(*args, **kwargs):
    """``print`` that stops the trace (`_traced_format`) before it writes anything where an argument is a
    traced number or tensor."""
    if any(is_traced_number(a) or _traced_tensor_value(a) for a in args):
        _stop_for_print()
    return _print(*args, **kwargs)


_print = builtins.print


# the math functions `traced_builtins` keeps traced (jax.numpy's of the same name)
_MATH = ("exp", "log", "sqrt", "sin", "cos", "tan", "tanh", "log2", "log10", "log1p", "expm1", "atan", "asin",
         "acos", "sinh", "cosh")


_MISSING = object()


# While t2j.jit traces: the errors raised because Python needed a traced value (`_noted`). One the
# function caught (``try: n = int(t.item()) except RuntimeError: ...``) still stops the trace: the
# branch it took instead is not the one torch takes.
VALUE_ERRORS: list | None = None


def _noted(error):
    if VALUE_ERRORS is not None:
        VALUE_ERRORS.append(error)
    return error


def forget(error):
    """``error`` was handled (the op that needed a value ran on the host instead): it stops no trace."""
    if VALUE_ERRORS is not None and any(e is error for e in VALUE_ERRORS):
        VALUE_ERRORS[:] = [e for e in VALUE_ERRORS if e is not error]


# While t2j.jit traces: its `jit._Places`, the places where the function may store a tensor or a traced
# number; a body traced by a JAX transform inside it (a checkpointed block) must not store there
# (`jit._Places.put_back_since`)
PLACES = None


# While t2j.jit traces: id -> list for each list whose length Python code read (``len(hist) > k``); the
# lists a jitted function watches among them have their lengths guarded (`jit._Places.take_rewritten`)
LEN_READS: dict | None = None
_len = builtins.len


# the containers whose lengths `_recording_len` notes (a replay memory's deque, a window's list)
_SIZED = (list, collections.deque, dict, set)


def _recording_len(obj, /):
    """``len``, noting the lists, deques, dicts and sets it is asked about (`LEN_READS`)."""
    if type(obj) in _SIZED and LEN_READS is not None:
        LEN_READS[id(obj)] = obj
    return _len(obj)


def _same(t):
    return t


def _traced_save_on_cpu(pin_memory=False, device_type="cuda"):
    """``torch.autograd.graph.save_on_cpu`` while a trace runs: the saved tensors stay values of the one
    program, where XLA keeps them (its copies to the CPU would stop the trace; ``t2j.offload.offload_policy``
    moves saved activations to host memory inside a program)."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _trace_replacements():
    """(owner, attribute name, replacement) for each function `traced_builtins` replaces."""
    out = [(builtins, "min", _traced_extremum(builtins.min, torch.sym_min, operator.lt)),
           (builtins, "max", _traced_extremum(builtins.max, torch.sym_max, operator.gt)),
           (builtins, "len", _recording_len), (builtins, "print", _traced_print)]
    out += [(math, name, _traced_math(name, getattr(math, name))) for name in _MATH]
    out.append((math, "pow", _traced_pow(math.pow)))
    out += [(torch, "tensor", _traced_factory(torch.tensor)), (torch, "as_tensor", _traced_factory(torch.as_tensor)),
            (torch.Tensor, "new_tensor", _traced_factory(torch.Tensor.new_tensor, method=True))]
    out.append((torch.autograd.graph, "save_on_cpu", _traced_save_on_cpu))
    out += [(torch.nn.modules.batchnorm, "float", _traced_float),
            (torch.nn.functional, "batch_norm", _traced_batch_norm(torch.nn.functional.batch_norm))]
    out += [(sym, "__torch_function__", classmethod(_number_torch_function)) for sym in _SYM_TYPES.values()]
    out += [(sym, "__format__", _traced_format) for sym in _SYM_TYPES.values()]
    return out


@contextlib.contextmanager
def traced_builtins():
    """While a trace runs: Python's ``min`` and ``max`` of traced numbers (`_traced_extremum`),
    ``math.exp`` / ``log`` / ``sqrt`` / ``pow`` / ... of one (`_traced_math`) and ``torch.tensor`` /
    ``as_tensor`` / ``new_tensor`` of them (`_traced_factory`) stay in the program, as
    torch.compile traces them. They are replaced in `builtins`, `math`, `torch` and
    ``torch.Tensor``, so for every module (but code that imported ``from math import exp``
    before); calls without a traced number behave as before. Symbolic numbers get a
    ``__torch_function__`` (`_number_torch_function`), which torch calls for a function given one
    where it takes a tensor or an index. (Not ``Tensor.__getitem__``: a Python one on the class
    makes every tensor a sequence for good, which ``torch.tensor([t0, t1])`` of 0-d tensors
    then refuses.)

    These are functions replaced for the trace, not a TorchFunctionMode: a mode makes
    ``has_torch_function`` true for every tensor and so turns off library fast paths (the
    nested-tensor TransformerEncoder's, MultiheadAttention's), whose results differ from the slow
    paths' in padded positions."""
    # torch._dynamo keeps tables of the builtins it knows by identity, filled when it is imported: imported
    # for the first time while ours are in place (a lazy import inside the traced code), it would take
    # them for good, and later compile (torch.cond on CPU tensors) fails on the real ``len``
    import torch._dynamo  # noqa: F401

    replacements = _trace_replacements()
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in replacements]
    for owner, name, new in replacements:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, old in saved:
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


_WEAK = {int: np.dtype(np.int64), float: np.dtype(np.float64), bool: np.dtype(np.bool_)}


def scalar_value_of(x):
    """The value behind a traced number as an op's Scalar argument: a weakly typed 0-d array
    (a bool array for a SymBool), which type promotion takes as a Python number of its kind
    (`dtypes.result_type`), as torch takes a SymFloat."""
    value = x.node.value
    if not hasattr(value, "dtype"):
        return value
    kind = x.node.kind
    dtype = jax.dtypes.canonicalize_dtype(_WEAK[kind])  # (float32 in a JAX trace without x64)
    return lax_internal._convert_element_type(value, dtype, weak_type=kind is not bool)
