"""`t2j.jit`: a torch function compiled into one XLA program, state included.

DESIGN.md, decision 4. Tensor arguments are traced; every other argument is
static and part of the cache key (a Python number until it changes, see below).
The state the function touches without receiving it — parameters, buffers and ``.grad`` of the modules it can reach,
optimizer state and learning rates, tensors it closes over, the RNG key — is
found, passed into the compiled program as inputs and written back after each
call. So a whole training step compiles into a single program::

    @t2j.jit
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

How state is found and carried:

* *Roots*: modules, optimizers and tensors reachable from the function's
  closure, the globals it names, ``self`` of a bound method and the arguments.
  Their tensors are listed as *slots* (``model.fc.weight``, its ``.grad``,
  ``opt.state[p]["exp_avg"]``...). The shapes, dtypes and presence of all slots
  are part of the cache key, so a changed Python-level structure retraces.
* While tracing, each slot's storage holds a tracer. After the trace, a storage
  whose array changed was written (its new value is an output of the program,
  and its input buffer is donated); storages created during the trace that are
  still alive (a new ``.grad``, fresh optimizer state) are outputs too, and the
  slots that point to them are re-pointed on every call.
* A tensor read during the trace that was not found as a slot is added to the
  function's inputs and the function is traced again, so nothing the program
  reads is silently frozen into it.
* A tensor the trace stores by plain assignment (``self.cache = self.cache + x``,
  ``holder.last = y``, a dict item, a closure cell, a global: `_Places`) is an output,
  stored in the same place after every call (`_Entry.stores`).
* Python values the trace takes as constants are guarded, as torch.compile guards
  them: numbers, strings and flags in the closure cells and globals the function
  names, named attributes of the objects it reaches, items of dicts and lists it reaches,
  its modules' plain attributes and hooks, CPU tensors (by version). A new value
  retraces. A number the trace itself changes (``self.step += 1``) becomes a program
  input whose new value is an output, stored back after every call (`_LiftNumbers`);
  another value it changes is not guarded, with a warning.
  A Python number (among the arguments too) that changes between calls becomes a
  program input instead, as optimizer hyperparameters do (below), unless the trace
  needs its exact value (a size, ``range(n)``).
* Optimizers are switched to their ``capturable`` form, Adam and AdamW to their
  fused one (step counters live on the device), and each param group's ``lr`` is an input of the program, so an LR
  scheduler stepping outside the function never causes a retrace. Any other float
  hyperparameter (``momentum``, ``betas``, ``weight_decay``...) becomes an input
  once it changes between calls (OneCycleLR and CyclicLR cycle the momentum): the
  trace sees it as a traced number, and Python control flow on it
  (``if momentum != 0``) is guarded, retracing only when its outcome changes.

A function that does not run its own backward pass (a jitted forward) returns
outputs that carry an autograd graph, as after ``torch.compile``: the call is one
node whose backward is the JAX VJP of the program with respect to the tensors
that require grad among its state and arguments (recomputing the forward with
the same inputs and RNG key), so ``loss.backward()`` and ``opt.step()`` may run
outside it. A function that sets ``.grad`` or updates parameters returns plain
values.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import functools
import gc
import hashlib
import inspect
import itertools
import logging
import math
import operator
import os
import sys
import sysconfig
import threading
import time
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import NamedTuple

import jax
import numpy as np
import torch
from torch.optim import optimizer as _optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
import torch.utils._pytree as torch_pytree
from torch import _prims_common
from jax._src import core as _jax_core
from jax.extend.core import jaxpr_as_fun

from . import complex32 as _complex32
from . import device as _device
from . import dtypes as _dt
from .env import HOST_RNGS as _HOST_RNGS
from .env import config as _config
from .env import default_rng as _rng
from .env import KEY_WORDS as _KEY_WORDS
from .env import drawn_key_data as _drawn_key_data
from .env import generator_draws as _generator_draws
from .env import set_generator_state as _set_generator_state
from .env import _trace_state_clean
from . import debug as _debug
from . import gradcut as _gradcut
from . import hints as _hints
from . import pytree as _pytree
from . import symbolic as _sym
from . import tensor as _tensor
from .ops import registry as _placement
from .dispatch import DeviceMismatchError, OpError
from .interop import differentiable_vjp as _differentiable_vjp
from .interop import torch_pullback as _torch_pullback
from .tensor import Storage, Tensor, jax_array, new_tensor

log = logging.getLogger("torch2jax.jit")

_RECOMPILES: list = []


class JitError(RuntimeError):
    """A function cannot be compiled by `t2j.jit`; the message says why and what to do."""


# ---------------------------------------------------------------------------
# finding state: roots and slots
# ---------------------------------------------------------------------------


def _guardable(v) -> bool:
    """A Python value a trace takes as a constant and a cache key can hold: a number, string,
    flag, None or enum member, or a short tuple of them."""
    if v is None or type(v) in (bool, int, float, str) or isinstance(v, enum.Enum):
        return True
    return type(v) is tuple and len(v) <= 16 and all(_guardable(x) for x in v)


def _constant_array(v) -> bool:
    """A jax.Array (not a tracer): JAX code the trace reaches (`call_jax`) bakes it into the
    program, so the cache key holds it by identity (`_Same`)."""
    return isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer)


def _watched(v) -> bool:
    """A closure cell's or global's value a cache key holds (`_Roots.python_values`): functions by
    identity (``act = torch.tanh`` after a trace with ``torch.relu``)."""
    return _guardable(v) or _constant_array(v) or isinstance(v, _CALLABLES)


_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


class _Roots:
    """Modules, optimizers and bare tensors a function can reach."""

    def __init__(self):
        self.modules, self.optimizers, self.tensors = [], [], []
        self.schedulers = []  # LR schedulers (`_scheduler_steps_after_the_program`)
        self.cpu_tensors = []  # read at trace time: guarded by `_guard`, not carried
        # torch.Generators, and Python's and NumPy's generator objects: a trace must not draw from them on
        # the host (`GeneratorDraws`)
        self.generators = []
        self.objects = []  # other objects whose attributes were searched (see _python_state)
        self.values = []  # (where, cell or globals dict, name): Python values the functions read (`python_values`)
        self.cells = []  # the closure cells of the functions (`_Places`)
        self.globals = []  # (globals dict, the names a function's code uses) (`_Places`)
        self.names = set()  # the global and attribute names the functions' code uses
        self.unguarded = frozenset()  # values the function itself changes when traced: not guarded
        self.owners = ()  # the identities of the objects its program is for (`_owners`)
        self.direct = []  # the values the jitted function's code names: its closure cells, globals, ``self``
        self.own_lists = {}  # lists of plain values (by id) every call changes (`_Entry.own_lists`): items not guarded
        self.held = set()  # ids of the objects modules hold (`_module_extras`): all their plain attributes guarded
        self.lifts: _Hyperparameters | None = None  # which numbers among the values are program inputs
        self.grads = True  # whether the parameters' (and arguments') ``.grad`` are state (`JitFunction._sees_grads`)
        # (module id, name) of the lists modules hold as attributes that a trace read (`_unread_lists_hidden`;
        # None: all), and (module, name) of those none did yet: neither carried nor guarded
        self.lists_read, self.lists_unread = None, []
        self._seen = set()
        self._sites, self._labels = set(), {}  # (`add_value`)

    def add_gradient_hooks(self, t, depth=0):
        """What the functions hooked on tensor ``t``'s gradient close over (``calls[0] += 1``)."""
        if t._backward_hooks or t._post_accumulate_grad_hooks:
            for hook in _gradient_hooks(t):
                self.add(hook, depth)

    def add(self, obj, depth=0, summarized=False):
        """``summarized``: ``obj`` is inside an object whose attributes `_python_state` summarizes."""
        if id(obj) in self._seen or depth > 3:
            return
        if isinstance(obj, torch.nn.Module):
            self._seen.add(id(obj))
            if not _on_jax(obj):  # (its Python attributes are read as any object's: ``m.calls += 1``)
                self.objects.append(obj)
            else:
                self.modules.append(obj)
                # an optimizer stepped by a parameter's hook ("optimizer step in backward")
                for hook in _parameter_hooks(obj):
                    self.add(hook, depth)
                for t in _tensor_attributes(obj):
                    self.add(t, depth)
                # what its hooks close over (``feats.append(out)``) and the lists it keeps
                # (``self.maps.append(x)``): places a trace may store into, as the function's own
                extras, held, read, lists, containers = _module_extras(obj)
                for extra in extras:
                    self.add(extra, depth + 1)
                # (the dicts and lists its forward reads as globals: ``STATS["calls"] += 1``)
                for g, name in containers:
                    self.add(g.get(name), depth + 1)
                for sub, name, items in lists:
                    if self.lists_read is None or (id(sub), name) in self.lists_read:
                        self.add(items, depth + 1)
                    else:
                        self.lists_unread.append((sub, name))
                # (a config its forward reads: ``self.config.final_logit_softcapping``)
                for o in held:  # (those `add` files elsewhere, an optimizer or a generator, stay unguarded)
                    self.held.add(id(o))
                    self.add(o, depth + 1)
                for value in read:
                    self.add_value(*value)
        elif isinstance(obj, torch.optim.Optimizer):
            self._seen.add(id(obj))
            if _optimizer_on_jax(obj) and not _stepping(obj):
                self.optimizers.append(obj)
                for hook in _step_hooks(obj):  # (what they close over: ``steps[0] += 1``)
                    self.add(hook, depth + 1)
                step = _own_method(type(obj), "step")
                if step is not None:  # (an optimizer class of the user's: its ``self.boost``, ``self.steps += 1``)
                    self.objects.append(obj)
                    self.add_function(inspect.unwrap(step), depth + 1)
        elif isinstance(obj, Tensor):
            self._seen.add(id(obj))
            self.tensors.append(obj)
            self.add_gradient_hooks(obj, depth)
        elif isinstance(obj, torch.Tensor) and obj.layout == torch.sparse_coo and obj.device == _tensor.DEVICE:
            self._seen.add(id(obj))
            for part in (obj._indices(), obj._values()):  # (jax tensors, carried as any other: no constants)
                self.add(part, depth)
        elif isinstance(obj, torch.Tensor):
            self._seen.add(id(obj))
            self.cpu_tensors.append(obj)
        elif isinstance(obj, (torch._C.Generator, *_HOST_RNGS)):
            self._seen.add(id(obj))
            self.generators.append(obj)
        elif isinstance(obj, types.BuiltinMethodType) and isinstance(obj.__self__, _HOST_RNGS):
            self.add(obj.__self__, depth)  # (``draw = rng.random`` held: a method of a C type)
        elif isinstance(obj, (list, tuple)):
            self._seen.add(id(obj))
            if isinstance(obj, list) and not summarized:
                self.objects.append(obj)
            for o in obj[:256]:
                self.add(o, depth + 1, summarized)
        elif isinstance(obj, dict):
            self._seen.add(id(obj))
            if not summarized:
                self.objects.append(obj)
            for o in list(obj.values())[:256]:
                self.add(o, depth + 1, summarized)
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            self._seen.add(id(obj))
            self.schedulers.append(obj)
            self.objects.append(obj)  # (the attributes its code names, ``sched.last_epoch``: guarded or lifted)
            self.add(obj.optimizer, depth + 1)
        elif isinstance(obj, weakref.ref):  # an LR scheduler's wrapper of opt.step holds the optimizer so
            self.add(obj(), depth)
        elif isinstance(obj, JitFunction):  # (its function, not its cache: the last call's arguments are there)
            self._seen.add(id(obj))
            self.add(obj.fn, depth + 1)
        elif isinstance(obj, jax.sharding.Mesh):  # (its attributes are JAX's caches, which a trace fills)
            self._seen.add(id(obj))
        elif getattr(type(obj), "_t2j_runs", None) is not None:  # (torch2jax's callables: what they run, not caches)
            self._seen.add(id(obj))
            self.add(obj._t2j_runs, depth + 1)
        elif isinstance(obj, functools.partial):
            self._seen.add(id(obj))
            self.add(obj.func, depth + 1)  # a Python function, a builtin (F.gelu) or another callable
            self.add(obj.args, depth + 1)
            self.add(obj.keywords, depth + 1)
        elif isinstance(obj, types.MethodType):
            self._seen.add(id(obj))
            self.add_function(obj.__func__, depth + 1)
            self.add(obj.__self__, depth + 1)
        elif isinstance(obj, types.FunctionType):
            self.add_function(obj, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType)) and depth < 3:
            self._seen.add(id(obj))
            self.objects.append(obj)
            for o in list(vars(obj).values())[:256]:
                self.add(o, depth + 1, summarized=True)

    def add_function(self, fn, depth=0):
        if id(fn) in self._seen:
            return
        self._seen.add(id(fn))
        if fn.__closure__:
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if _watched(value):
                    self.add_value(f"{fn.__qualname__}: {name}", cell, None)
                elif isinstance(value, types.ModuleType):
                    for entry in _module_values(value, _global_names(fn.__code__)):
                        self.add_value(*entry)
                if depth == 0:
                    self.direct.append(value)
                self.cells.append(cell)
                self.add(value, depth)
                self._add_methods(value, _global_names(fn.__code__), depth)
        self.add(fn.__defaults__, depth)
        self.add(fn.__kwdefaults__, depth)
        g = fn.__globals__
        names = _global_names(fn.__code__)
        self.names.update(names)
        self.globals.append((g, names))
        for name in names:
            if name in g:
                value = g[name]
                if _watched(value) and not name.startswith("__"):
                    self.add_value(f"global {name}", g, name)
                elif isinstance(value, type):  # (a namespace of settings: ``class Cfg: scale = 1.0``)
                    for entry in _class_values(value, names):
                        self.add_value(*entry)
                    for method in _function_methods(value):  # (``GradReverse.apply(x)``: what its backward reads)
                        self.add_function(method, depth + 1)
                elif isinstance(value, types.ModuleType):  # (a ``config.py`` of settings: ``cfg.SCALE``)
                    for entry in _module_values(value, names):
                        self.add_value(*entry)
                if depth == 0 and not name.startswith("__"):
                    self.direct.append(value)
                self.add(value, depth)
                self._add_methods(value, names, depth)

    def _add_methods(self, obj, names, depth):
        """The methods of plain object ``obj`` (a global or closed-over helper, not a module: those are
        `_module_extras`') that ``names`` name, as functions the function calls (``helper.go(x)`` reading
        a global stayed frozen in the program at its first value)."""
        if (depth >= 3 or isinstance(obj, (type, types.ModuleType, torch.nn.Module, torch.Tensor))
                or not hasattr(obj, "__dict__")):
            return
        cls = type(obj)
        for name in names:
            method = _own_method(cls, name)
            if method is not None:
                self.add_function(method, depth + 1)

    def add_value(self, where, source, name):
        """Add a Python value the functions read (`values`), once per place; ``where`` names it, numbered
        from the second place of that name (the cells of two closures of one function, the globals
        of two modules): guards and lifted numbers are told apart by it."""
        if (id(source), name) in self._sites:
            return
        self._sites.add((id(source), name))
        n = self._labels[where] = self._labels.get(where, 0) + 1
        self.values.append((where if n == 1 else f"{where} #{n}", source, name))

    def python_values(self, lift=None, raw: bool = False, held: bool = True) -> tuple:
        """The Python numbers, strings and flags (and jax.Arrays, by identity: `_Same`) the
        functions read as constants: closure cells and globals their code names, attributes of
        the objects they reach that their code names (``cfg.scale``) and the first 32 items of
        the dicts and lists they reach (``CONFIG["scale"]``, ``scale[0]``; not those of a list every
        call changes, `own_lists`, nor of those an object's attribute holds: a counter dict such as
        a `JitFunction`'s ``stats`` changes on every call).
        Each new value traces again, as torch.compile guards on them, but a number that
        changes from call to call becomes a program input (`lifts`): `_LiftedNumber` stands
        in the result for it, and ``lift(site, id)`` is called with its `_ValueSite`. ``raw``:
        the values themselves, none lifted; ``held=False``: without the attributes of the objects
        modules hold (`_Unchanged` checks those by identity)."""
        out = []
        lifts = None if raw else self.lifts
        for where, v, source, name in self._read_values(held):
            if _constant_array(v) and where not in self.unguarded:
                out.append((where, _Same(v)))
                continue
            if isinstance(v, _CALLABLES) and where not in self.unguarded:
                out.append((where, v))  # (by identity: the key holds it, so its id is not reused)
                continue
            if where in self.unguarded or not _guardable(v):
                continue
            if lifts is not None and _lifted_number(v) and lifts.lifts(("value", where), v):
                out.append((where, _LiftedNumber(type(v))))
                if lift is not None:
                    lift(_ValueSite(source, name, where), ("value", where))
            else:
                out.append((where, _python_value(v)))
        return tuple(out)


    def object_names(self) -> dict:
        """id -> the name the attributes of each object in ``objects`` are read under: its class's
        name, numbered from the second object of a class on (``CanineConfig#2``), in the order
        the walk found them. Two objects of one class (a model's config and a sub-module's
        copy with other numbers) under one name looked like one value changing within every
        call: a retrace each call, or a number lifted that torch needs exact."""
        names, counts = {}, {}
        for obj in self.objects:
            kind = type(obj).__name__
            counts[kind] = n = counts.get(kind, 0) + 1
            names[id(obj)] = kind if n == 1 else f"{kind}#{n}"
        return names

    def _read_values(self, held: bool = True) -> list:
        """(where, value, source, name) of each value `python_values` considers."""
        values = [(where, source.cell_contents if name is None else source.get(name) if isinstance(source, dict)
                   else getattr(source, name, None), source, name)
                  for where, source, name in self.values]
        lifted = self.lifts.lifted if self.lifts is not None else ()
        kinds = self.object_names()
        for obj in self.objects:
            if isinstance(obj, dict):
                if len(obj) <= 32:
                    values += [(f"dict item {k!r}", v, obj, k) for k, v in obj.items()]
            elif isinstance(obj, list):  # its plain items (``scale[0]``), and the numbers a trace advanced
                own = id(obj) in self.own_lists
                values += [(where, v, obj, i) for i, v in enumerate(obj[:32])
                           if ("value", where := _list_item(obj, i)) in lifted or (not own and _watched(v))]
            else:
                attrs, kind = vars(obj), kinds[id(obj)]
                if id(obj) in self.held:
                    if held:
                        values += [(f"{kind}.{k}", v, obj, k) for k, v in attrs.items()]
                    continue
                # the attributes its code names, and numbers its methods advance (`number_sites`)
                values += [(f"{kind}.{k}", attrs[k], obj, k) for k in attrs
                           if k in self.names or ("value", f"{kind}.{k}") in lifted]
                # and the class's defaults of those the instance does not hold yet (``n = 0`` in the
                # class body, then ``self.n += 1``)
                values += [(f"{kind}.{k}", v, obj, k) for k in self.names if k not in attrs
                           and type(v := getattr(type(obj), k, None)) in (int, float, bool, str)]
        return values

    def number_sites(self) -> list:
        """(lifted id, `_ValueSite`, value) of each Python number (int or float) the function
        reads that it may also change (``self.step += 1``): the values of `python_values` and
        its modules' plain attributes."""
        out = [(("value", where), _ValueSite(source, name, where), v)
               for where, v, source, name in self._read_values() if type(v) in (int, float)]
        named = {id(site.source) for _, site, _ in out}
        kinds = self.object_names()
        for obj in self.objects:  # (attributes a method of the object changes: ``meter.update(k)``)
            if isinstance(obj, list):  # (``counts[0] += 1``)
                out += [(("value", where), _ValueSite(obj, i, where), v) for i, v in enumerate(obj[:32])
                        if type(v) in (int, float) and ("value", where := _list_item(obj, i)) not in
                        {w for w, _, _ in out}]
            elif not isinstance(obj, dict):
                where = kinds[id(obj)]
                out += [(("value", f"{where}.{k}"), _ValueSite(obj, k, f"{where}.{k}"), v)
                        for k, v in vars(obj).items()
                        if type(v) in (int, float) and (id(obj) not in named or k not in self.names)]
        for k, m in enumerate(self.modules):
            for si, sub in enumerate(_submodules(m)):
                out += [(("module attribute", k, si, name), _ValueSite(sub, name, f"{type(sub).__name__}.{name}"), v)
                        for name, v in sub.__dict__.items() if type(v) in (int, float) and name[0] != "_"]
        for k, opt in enumerate(self.optimizers):  # (as `_Walk.optimizer` numbers them)
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    st = opt.state.get(p) or {}
                    out += [(where, _ValueSite(st, sk, _lifted_name(where)), v) for sk, v in st.items()
                            if type(v) in (int, float) and (where := ("optimizer state", k, gi, pi, sk))]
        return out


_HOOKS_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (registrations, its hooks)


def _parameter_hooks(module) -> list:
    """The functions hooked on ``module``'s parameters, read again only after a hook was
    registered somewhere (reading every parameter's hooks on each call would cost more than
    the rest of finding the roots)."""
    seen = _HOOKS_SEEN.get(module)
    if seen is None or seen[0] != _HOOK_CHANGES[0]:
        hooks = [h for p in module.parameters() for h in _gradient_hooks(p)]
        seen = _HOOKS_SEEN[module] = (_HOOK_CHANGES[0], hooks)
    return seen[1]


def _step_hooks(opt) -> list:
    """The functions hooked on optimizer ``opt``'s steps: its own step pre- and post-hooks and the global ones."""
    dicts = (opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks,
             _optimizer._global_optimizer_pre_hooks, _optimizer._global_optimizer_post_hooks)
    return [hook for d in dicts for hook in d.values()]


def _gradient_hooks(t) -> list:
    """The functions hooked on tensor ``t``'s gradient (``register_hook``, a post-accumulate-grad hook)."""
    return [getattr(h, "__wrapped__", h) for d in (t._backward_hooks, t._post_accumulate_grad_hooks)
            for h in (d or {}).values()]


_EXTRAS_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (counters, its extras)


def _module_extras(module) -> tuple:
    """(the functions hooked on ``module`` and its submodules and the functions they hold as public
    attributes, the other objects they hold as public attributes (an HF model's ``config``, whose
    plain attributes its code reads all over: each is guarded as a module's own), the Python
    values their ``forward`` functions (and the functions those name) read from globals and from their
    classes (`_globals_read`, `_class_values`): `_Roots.values` entries, guarded as the
    jitted function's own, (submodule, name, list) of the lists they hold as public attributes, and (globals
    dict, name) of the global dicts and lists their ``forward`` functions read),
    read again only after a module attribute was set or a hook registered or removed somewhere (reading
    every submodule's attributes on each call would cost more than the rest of finding the roots)."""
    now = (_ATTRIBUTE_WRITES[0], _HOOK_CHANGES[0])
    seen = _EXTRAS_SEEN.get(module)
    if seen is None or seen[0] != now:
        subs = _submodules(module)
        extras = [hook for sub in subs for name in _MODULE_HOOK_DICTS for hook in getattr(sub, name).values()]
        # (the global module hooks run for its modules too: ``register_module_forward_hook(count)``)
        extras += [hook for name in _GLOBAL_HOOK_DICTS for hook in getattr(torch.nn.modules.module, name).values()]
        # (and the functions they hold, whose closures and globals hold values too: ``self.fn = lambda o: o * k[0]``)
        extras += [v for sub in subs for name, v in sub.__dict__.items()
                   if isinstance(v, _CALLABLES) and name[0] != "_"]
        lists = [(sub, name, v) for sub in subs for name, v in sub.__dict__.items()
                 if type(v) is list and name[0] != "_"]
        held = list({id(v): v for sub in subs for name, v in sub.__dict__.items()
                     if name[0] != "_" and _gradcut.plain_object(v)}.values())
        read, seen_fns, containers = {}, set(), {}
        for cls in {type(sub) for sub in subs}:
            _globals_read(cls.forward, read, seen_fns, cls=cls, containers=containers)
            # (its forward, and the class attributes it names: ``shift = 0.0`` in the class body)
            code = getattr(cls.forward, "__code__", None)
            names = ("forward", *(_global_names(code) if code is not None else ()))
            read.update({(id(base), name): (where, base, name) for where, base, name in _class_values(cls, names)})
        # (and the methods of the objects they hold that their forwards name: ``self.scaler.apply(x)``)
        named = {name for cls in {type(sub) for sub in subs}
                 for name in _global_names(getattr(cls.forward, "__code__", None) or _EMPTY_CODE)}
        for cls in {type(obj) for obj in held}:
            for name in named:
                method = _own_method(cls, name)
                if method is not None:
                    _globals_read(method, read, seen_fns, 1, cls, containers)
        seen = _EXTRAS_SEEN[module] = (now, (extras, held, list(read.values()), lists, list(containers.values())))
    return seen[1]


_EMPTY_CODE = (lambda: None).__code__


def _globals_read(fn, read: dict, seen: set, depth: int = 0, cls=None, containers: dict | None = None):
    """Add to ``read`` the `_Roots.values` entries of the Python values ``fn`` reads from its globals, and
    those the functions it names read (``def helper(x): return x / TEMP``, called by a forward), three calls
    deep; torch's own functions are left out. ``cls``: the class whose method ``fn`` is; the methods of it
    that ``fn`` names (``self.helper(x)``, a static method, an inherited ``self.core(x)``) are followed as
    the functions it names are (a global they read, changed between calls, was left baked into the program).
    ``containers``: gets (globals dict, name) of the dicts and lists they read as globals (``STATS["n"] += 1``),
    which the roots walk as the jitted function's own globals."""
    code = getattr(fn, "__code__", None)
    if code is None or (getattr(fn, "__module__", None) or "").startswith("torch") or id(fn) in seen:
        return
    seen.add(id(fn))
    g = fn.__globals__
    names = _global_names(code)
    # (a settings module imported in the enclosing function, ``import cfg``, is a closure cell)
    modules = [v for v in map(_cell_value, fn.__closure__ or ()) if isinstance(v, types.ModuleType)]
    modules += [g[name] for name in names if isinstance(g.get(name), types.ModuleType)]
    for module in modules:
        for where, source, attribute in _module_values(module, names):
            read.setdefault((id(source), attribute), (where, source, attribute))
    for name in names:
        if name.startswith("__"):
            continue
        if cls is not None and depth < 3:
            method = _own_method(cls, name)
            if method is not None:
                _globals_read(method, read, seen, depth + 1, cls, containers)
        if name not in g:
            continue
        value = g[name]
        if _watched(value):
            read.setdefault((id(g), name), (f"global {name}", g, name))
        elif isinstance(value, type) and depth < 3:
            for method in _function_methods(value):
                _globals_read(method, read, seen, depth + 1, containers=containers)
                method_names = _global_names(method.__code__)
                read.update({(id(base), attr): (where, base, attr)
                             for where, base, attr in _class_values(value, method_names)})
        elif type(value) in (dict, list) and containers is not None:
            containers[id(g), name] = (g, name)  # (read again from ``g``: the global may be bound anew)
        if isinstance(value, types.FunctionType) and depth < 3:
            _globals_read(value, read, seen, depth + 1, containers=containers)


def _own_method(cls, name):
    """The function behind attribute ``name`` of ``cls`` (a method, static or class method, a property's
    getter) where a class of the user's, not torch's or Python's, defines it; else None."""
    for base in cls.__mro__:
        if base.__module__.startswith(("torch", "builtins")):
            return None
        attr = vars(base).get(name)
        if attr is None:
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        elif isinstance(attr, property):
            attr = attr.fget
        return attr if isinstance(attr, types.FunctionType) else None
    return None


def _function_methods(cls) -> list:
    """The methods of ``cls`` where it is a custom ``torch.autograd.Function`` of the user's (forward,
    backward, setup_context, jvp, vmap): a function applying it runs them, and what they read (a global
    ``LAMBDA`` a gradient reversal's backward scales by, a class counter) is the function's too."""
    if not (issubclass(cls, torch.autograd.Function) and not cls.__module__.startswith("torch")):
        return []
    methods = (_own_method(cls, name) for name in ("forward", "backward", "setup_context", "jvp", "vmap"))
    return [m for m in methods if m is not None]


def _class_values(cls, names):
    """The `_Roots.values` entries of the attributes ``names`` that ``cls`` and its bases define, up to
    torch's or Python's own classes (a value set on the class later is another program)."""
    for base in cls.__mro__:
        if base.__module__.startswith(("torch", "builtins")):
            return
        for name in names:
            if not name.startswith("__") and name in vars(base) and _watched(vars(base)[name]):
                yield f"{base.__qualname__}.{name}", base, name


# where Python's and the installed packages' modules live: a module elsewhere is the user's own
_LIBRARY_DIRS = tuple(sorted({os.path.abspath(sysconfig.get_paths()[k]) + os.sep
                              for k in ("stdlib", "platstdlib", "purelib", "platlib")}))


@functools.lru_cache(maxsize=1024)
def _users_module(module) -> bool:
    # (asked on every call of a jitted function naming a module: the path test runs once per module)
    path = getattr(module, "__file__", None)
    return not (path is None or os.path.abspath(path).startswith(_LIBRARY_DIRS)
                or module.__name__.split(".")[0] in ("torch", "torch2jax", "jax", "jaxlib", "numpy"))


def _module_values(module, names):
    """The `_Roots.values` entries of the attributes ``names`` of a module of the user's own (a
    ``config.py`` of settings the function reads as ``cfg.SCALE``; a value set on it later is another
    program). Library modules (Python's, installed packages', torch's, JAX's) are left out."""
    if not _users_module(module):
        return
    attrs = vars(module)
    for name in names:
        if not name.startswith("__") and name in attrs and _watched(attrs[name]):
            yield f"{module.__name__}.{name}", module, name


def _on_jax(module) -> bool:
    """Whether ``module``'s state is on the jax device, judged by its first tensor. One
    elsewhere is not the function's state: a template on the meta device
    (torch.func.functional_call's base), a CPU copy kept for reference. Used in the
    trace after all, its ops refuse the CPU tensors."""
    t = next(itertools.chain(module.parameters(), module.buffers()), None)
    return t is None or isinstance(t, Tensor)


def _optimizer_on_jax(opt) -> bool:
    """Whether ``opt`` steps jax-device parameters, judged by its first one (as `_on_jax`:
    one stepping CPU parameters, e.g. a reference run's, is not the function's state)."""
    p = next((p for g in opt.param_groups for p in g["params"]), None)
    return p is None or isinstance(p, Tensor)


def _stepping(opt) -> bool:
    """Whether ``opt.step`` is running: the function is its closure (LBFGS's, called up to ``max_iter``
    times a step), which cannot step it again. Its state is then not the function's: carrying it
    would retrace the closure on every call, as LBFGS's history grows between them."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "step" and frame.f_locals.get("self") is opt:
            return True
        frame = frame.f_back
    return False


_MODULE_GETATTR = torch.nn.Module.__getattr__
_HIDDEN: dict = {}  # id(module) -> (its lists hidden by `_unread_lists_hidden`: name -> list, the reads' set)
_HIDING = [0]  # the traces hiding lists now


def _hidden_list_getattr(module, name):
    """``torch.nn.Module.__getattr__`` while a trace hides lists: a hidden list read is put back and noted."""
    hidden = _HIDDEN.get(id(module))
    if hidden is not None and name in hidden[0]:
        value = module.__dict__[name] = hidden[0].pop(name)
        hidden[1].add((id(module), name))
        return value
    return _MODULE_GETATTR(module, name)


@contextlib.contextmanager
def _unread_lists_hidden(places):
    """Take the lists modules hold that no trace of the function read (REINFORCE's ``saved_log_probs``, which
    the training loop appends to after every call of the jitted policy: carried and guarded, each new length
    would be a new program) out of their modules' ``__dict__`` while the function runs, so that reading one
    goes through ``Module.__getattr__``. Yields the set of (module id, name) of those it read or assigned:
    the trace is then run again with them carried and guarded, so they are put back as they were (a list
    the function appends to holds a tracer)."""
    reads, hidden, before = set(), {}, {}
    for sub, name in places:
        d = sub.__dict__
        if type(d.get(name)) is list and type(sub).__getattr__ in (_MODULE_GETATTR, _hidden_list_getattr):
            items = hidden.setdefault(id(sub), (sub, {}))[1][name] = d.pop(name)
            before[id(sub), name] = (items, list(items))
    for k, (sub, lists) in hidden.items():
        _HIDDEN[k] = (dict(lists), reads)
    if hidden and not _HIDING[0]:
        torch.nn.Module.__getattr__ = _hidden_list_getattr
    _HIDING[0] += bool(hidden)
    try:
        yield reads
    finally:
        _HIDING[0] -= bool(hidden)
        if hidden and not _HIDING[0]:
            torch.nn.Module.__getattr__ = _MODULE_GETATTR
        for k, (sub, lists) in hidden.items():
            still = _HIDDEN.pop(k)[0]
            for name in lists:
                if name in still and name in sub.__dict__:
                    reads.add((k, name))  # (assigned by the function)
                items, contents = before[k, name]
                items[:] = contents
                sub.__dict__[name] = items


class _ReadsLists(Exception):
    """A trace read lists modules hold that it did not carry (`_unread_lists_hidden`): trace again with them."""

    def __init__(self, found):
        self.found = found


class _Same:
    """A jax.Array the function reads as a constant (``cfg.mask``), in a cache key: it matches
    the same array object only (comparing values would wait for the device), and holds it so
    that its id is not reused."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is _Same and other.value is self.value

    def __hash__(self):
        return id(self.value)

    def __repr__(self):
        return f"<jax.Array {self.value.dtype}{list(self.value.shape)} at {id(self.value):#x}>"


def _python_value(v, depth=0):
    """A comparable summary of the Python part of ``v`` (tensors and other objects
    stand for themselves by identity)."""
    if isinstance(v, (torch.Tensor, jax.Array)) or _sym.is_traced_number(v):  # (stored by every call: `_Places`)
        return _TENSOR
    if v is None or isinstance(v, (bool, int, str, enum.Enum)):
        return v
    if isinstance(v, float):
        return "nan" if math.isnan(v) else v
    if depth < 3 and isinstance(v, dict):
        return tuple((_python_value(k, depth + 1), _python_value(x, depth + 1)) for k, x in v.items())
    if depth < 3 and isinstance(v, (list, tuple)):
        return tuple(_python_value(x, depth + 1) for x in v)
    return ("object", id(v))


def _python_state(objects):
    # a list or dict the function reaches (a closure's ``log``, a global table) by its items
    return [
        {"items": _python_value(o)} if isinstance(o, (list, dict)) else {k: _python_value(v) for k, v in vars(o).items()}
        for o in objects
    ]


def _layout(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.storage_offset())


def _binding(t):
    """A new tensor bound as ``t`` is now (storage, view chain, layout): what puts ``t`` back
    (`Tensor._rebind`) after a failed trace bound it to another storage or changed its layout."""
    if t._t2j_view:
        return _tensor.lazy_view(t._t2j_storage, t._t2j_view, t.shape, t.stride(), t.storage_offset(), t.dtype)
    return Tensor(t._t2j_storage)


def _refuse_deleted_inputs(fn, slots, storages, inputs, error):
    """A clear error, naming the tensor, where a program's input holds a deleted jax.Array (XLA's
    "Buffer has been deleted or donated"): one passed from JAX (`torch_view`) or shared with a
    functionalized state that a JAX program was given with ``donate_argnums``."""
    gone = [i for i, a in enumerate(inputs) if isinstance(a, jax.Array) and a.is_deleted()]
    if not gone:
        return
    k = next((k for k, t in enumerate(slots.tensors) if t is not None and t._t2j_storage is storages[gone[0]]), None)
    if k is None:
        name = "a tensor it reads"
    elif slots.names:
        name = slots.names[k]
    else:
        name = f"{'argument' if k >= slots.first_argument else 'state'} tensor {k}"
    a = inputs[gone[0]]
    raise OpError(f"t2j.jit({getattr(fn, '__name__', type(fn).__name__)}): {name} ({a.dtype}{list(a.shape)}) holds "
                  "a jax.Array that was deleted, most likely donated to a JAX program (jax.jit(..., donate_argnums="
                  "...) of an array given to t2j.torch_view, or of t2j.functionalize's state, which shares the "
                  "module's arrays). Pass the array the program returned (fn.write_back(state) for a module's "
                  "state), or do not donate it") from error


def _check_layouts(slots, before, storages, arguments):
    """Stop the trace (a graph break: the call runs eagerly) where the function changed the
    shape or strides of a tensor it was given (``resize_``, ``t_``, ``.data =``), or of one it
    reaches over its own storage (``unsqueeze_``), or bound an argument to another storage: a
    compiled call writes values back, not layouts, so later calls would leave the tensor as it
    was. State it reaches that is bound to a new storage (``p.data = v[6:9]`` of a new ``v``, as
    ``vector_to_parameters``, or a growing ``resize_``) stays bound to it, and the program writes
    that storage on every call."""
    for k, (t, old, st) in enumerate(zip(slots.tensors, before, storages)):
        if old is not None and (t._t2j_storage is st or id(t) in arguments) and _layout(t) != old:
            name = slots.names[k] if slots.names else f"state tensor {k}"
            raise OpError(f"t2j.jit: the function changes the shape or strides of {name} in place "
                          f"({list(old[0])} -> {list(t.shape)}), which a compiled program cannot repeat")
        if old is not None and id(t) in arguments and t._t2j_storage is not st:
            # (the next call's argument is another tensor: the program would write a storage it does not hold)
            name = slots.names[k] if slots.names else f"argument tensor {k}"
            raise OpError(f"t2j.jit: the function binds the tensor it was given ({name}) to another tensor's "
                          "values (.data =, set_), which a compiled program cannot repeat for the next call's "
                          "argument; write its values instead (x.copy_(v))")


def _check_python_state(fn, objects, before, names=frozenset()):
    """Refuse a trace that changed the Python attributes of an object the function
    reaches: a cached call replays only the tensor program, never those changes. A flag
    its code names that it turns (``if not self.ready: ...; self.ready = True``) is guarded
    by the value it had, so that the next call, finding the new one, traces again."""
    for obj, old, new in zip(objects, before, _python_state(objects)):
        if not isinstance(obj, (list, dict)):  # (an instance's attribute equal to its class's default is no change)
            old = {**{k: _python_value(getattr(type(obj), k)) for k in new.keys() - old.keys()
                      if type(getattr(type(obj), k, None)) in (int, float, bool, str)}, **old}
        # tensors a trace creates are outputs of the program (written back on every call)
        changed = sorted(
            k for k in old.keys() | new.keys()
            if old.get(k, _MISSING) != new.get(k, _MISSING) and _TENSOR not in (old.get(k), new.get(k))
            and not (k in names and _is_flag_change(old.get(k), new.get(k)))
        )
        if not changed:
            continue
        name = getattr(fn, "__qualname__", fn)
        if isinstance(obj, dict) and len(obj) <= 32 and _only_flags_turned(old["items"], new["items"]):
            continue  # (its items are guarded values: `_Roots._read_values`)
        if isinstance(obj, (list, dict)) and _only_tensors_stored(obj, old["items"], new["items"]):
            continue  # (every call stores them again: `_Places`)
        if isinstance(obj, (list, dict)):
            kind = type(obj).__name__
            if _count_tensors(new["items"]) > _count_tensors(old["items"]):
                effect = "the tensors it adds are new state, so every call traces and compiles again"
            else:
                effect = "cached calls run only the compiled tensor program and will not change it again"
            warnings.warn(
                f"t2j.jit: tracing {name} changed the items of a {kind} it reaches; {effect}. Return the values "
                f"instead and update the {kind} outside the jitted function.",
                stacklevel=4,
            )
            continue
        what = f"{type(obj).__name__}.{', '.join(changed)}"
        if isinstance(obj, torch.amp.GradScaler):
            raise JitError(
                f"t2j.jit: tracing {name} changed the GradScaler's Python state ({what}), which a cached call "
                "would not repeat, so a later scaler.step would unscale twice. Inside the jitted function "
                "use only scaler.scale(loss).backward(); call scaler.unscale_, scaler.step and scaler.update "
                "outside it."
            )
        warnings.warn(
            f"t2j.jit: tracing {name} changed Python attributes ({what}); cached calls run only the "
            "compiled tensor program and will not change them again. Keep such bookkeeping outside the "
            "jitted function or hold it in tensors.",
            stacklevel=4,
        )


class _Marker:
    """A sentinel of cache keys and Python state summaries, named in `explain_recompiles`."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


_MISSING, _TENSOR = _Marker("absent"), _Marker("<tensor>")


def _brief(v) -> str:
    """``repr(v)`` with runs of equal items of a tuple written once (LBFGS's history: ``(<tensor> x 6,
    None x 94)``), cut short past 400 characters."""
    if type(v) is tuple and len(v) > 3:
        runs = [[item, len(list(group))] for item, group in itertools.groupby(v)]
        text = "(" + ", ".join(_brief(item) + (f" x {n}" if n > 1 else "") for item, n in runs) + ")"
    else:
        text = repr(v)
    return text if len(text) <= 400 else text[:400] + " ..."


def _is_flag_change(old, new) -> bool:
    """Whether a Python value went from one bool to the other (a flag the trace turned)."""
    return type(old) is bool and type(new) is bool


def _only_flags_turned(old_items, new_items) -> bool:
    """Whether a dict's summarized items (`_python_value`) differ only by flags turned."""
    return len(old_items) == len(new_items) and all(
        a[0] == b[0] and (a[1] == b[1] or _is_flag_change(a[1], b[1])) for a, b in zip(old_items, new_items))


def _only_tensors_stored(obj, old_items, new_items) -> bool:
    """Whether the items of a list or dict (summarized by `_python_value`) changed only where
    tensors were stored (``state["h"] = (h, c)`` in place of None) or taken out, which every
    call does again, not by an item added to a list or a Python value changed."""
    if isinstance(obj, dict):
        old, new = dict(old_items), dict(new_items)
        return all(_stored_tensors(old.get(k, _MISSING), new.get(k, _MISSING)) for k in old.keys() | new.keys()
                   if old.get(k, _MISSING) != new.get(k, _MISSING))
    return isinstance(obj, list) and len(old_items) == len(new_items) and all(
        a == b or _stored_tensors(a, b) for a, b in zip(old_items, new_items))


def _stored_tensors(old, new) -> bool:
    """Whether an item went from ``old`` to ``new`` (summaries, or _MISSING) by tensors stored or taken out."""
    if _tensors_only(new):
        return old is None or old is _MISSING or _tensors_only(old)
    return new is _MISSING and _tensors_only(old)


def _tensors_only(summary) -> bool:
    """Whether a `_python_value` summary stands for a tensor, or a non-empty tuple of only tensors."""
    if summary is _TENSOR:
        return True
    return type(summary) is tuple and len(summary) > 0 and all(_tensors_only(v) for v in summary)


def _count_tensors(summary) -> int:
    if summary is _TENSOR:
        return 1
    return sum(_count_tensors(v) for v in summary) if isinstance(summary, tuple) else 0


def _size_from_values(e: Exception) -> Exception:
    """``e``, or the graph break it stands for: torch's C++ refusing a traced number where a list
    of sizes must hold concrete integers (``F.interpolate(x, size=(h, w))`` of 0-d tensors)."""
    if type(e) is RuntimeError and "expected to contain only concrete integers" in str(e):
        return OpError("torch2jax: a size computed from a tensor's values (a traced number: a 0-d tensor or "
                       "t.item() as a size) reached an op whose result shape depends on it; pass the sizes as "
                       "Python ints to keep the function one program")
    return e


def _same_tree(a, b) -> bool:
    """Whether ``a`` and ``b`` have one pytree structure and the very same leaves."""
    a_leaves, a_spec = torch_pytree.tree_flatten(a, _is_size)
    b_leaves, b_spec = torch_pytree.tree_flatten(b, _is_size)
    return a_spec == b_spec and all(map(operator.is_, a_leaves, b_leaves))


# the pytree nodes of a call's arguments that the function can change in place (and the dict-like
# classes `_pytree.register_argument_nodes` made nodes: a ``BatchEncoding``; and its dataclasses)
_MUTABLE_NODES = (list, dict, collections.OrderedDict, collections.defaultdict)


def _keyed(container) -> bool:
    """Whether ``container`` holds its items by key: a mapping, or a dataclass argument (by attribute name)."""
    return isinstance(container, Mapping) or _pytree.is_registered_record(container)


def _keyed_items(container):
    """A mapping's items; a dataclass argument's attributes."""
    return _pytree.record_items(container).items() if _pytree.is_registered_record(container) else container.items()


def _argument_containers(tree, path=()) -> list:
    """(path, container, its (key, item) pairs then) per list and dict of a call's ``(args, kwargs)``,
    the outermost first: the places whose changes each compiled call makes again (`_argument_changes`)."""
    if type(tree) in _MUTABLE_NODES or _pytree.is_registered_mapping(tree) or _pytree.is_registered_record(tree):
        items = list(_keyed_items(tree)) if _keyed(tree) else list(enumerate(tree))
        found = [(path, tree, items)]
    elif type(tree) is tuple or _is_namedtuple(tree):
        items, found = list(enumerate(tree)), []
    else:
        return []
    for k, v in items:
        found += _argument_containers(v, (*path, k))
    return found


def _argument_changes(containers, traced_args, leaves, spec) -> list | None:
    """(path, layout, new items) per list or dict among the arguments that the trace changed
    (``labels = batch.pop("labels")``, ``log.append(loss)``, ``metrics["acc"] = acc``), innermost first:
    a call rebuilds the caller's container (`_change_container`) from its own items and the new ones
    (program outputs, `_Outputs.stored`). ``containers``: `_argument_containers` of the ``(args, kwargs)``
    the trace ran on, rebuilt from ``leaves`` and ``spec`` (the caller's never see its changes). None
    where the changes are not such a rebuild: a container moved into another, a nested one replaced."""
    moved = {id(c) for _, c, _ in containers}
    changes = []
    for path, container, before in containers:
        if _keyed(container):
            now = list(_keyed_items(container))
            if len(now) == len(before) and all(k == j and v is w for (k, v), (j, w) in zip(now, before)):
                continue
            old = dict(before)
            layout = tuple((k, k in old and old[k] is v) for k, v in now)
            new = [v for (_, v), (_, kept) in zip(now, layout) if not kept]
        else:
            old = [v for _, v in before]
            if len(container) == len(old) and all(map(operator.is_, container, old)):
                continue
            layout, new = _list_rewrite(old, container)
        if any(id(node) in moved for v in new for node in _nodes(v)):
            return None
        changes.append((path, layout, new))
    changes.reverse()
    fresh = torch_pytree.tree_unflatten(leaves, spec)
    for path, layout, new in changes:
        _change_container(_at(fresh, path), layout, new)
    return changes if _same_tree(fresh, traced_args) else None


def _nodes(value):
    """``value`` and the tuples, lists and dicts within it."""
    yield value
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _nodes(v)
    elif _keyed(value):
        for _, v in _keyed_items(value):
            yield from _nodes(v)


def _at(tree, path):
    for key in path:
        tree = getattr(tree, key) if _pytree.is_registered_record(tree) else tree[key]
    return tree


def _change_container(container, layout, values):
    """Make ``container`` what a trace left it (`_argument_changes`): ``layout`` gives each item
    as its index (a list's) or ``(key, kept)`` (a dict's) before the call, or None (unkept) for the
    next of ``values``."""
    if _pytree.is_registered_record(container):  # (a frozen dataclass's too: its trace changed it the same way)
        values, before = iter(values), _pytree.record_items(container)
        _pytree.set_record_items(container, [(k, before[k] if kept else next(values)) for k, kept in layout])
    elif isinstance(container, Mapping):
        values = iter(values)
        items = [(k, container[k] if kept else next(values)) for k, kept in layout]
        container.clear()
        container.update(items)
    else:
        _rewrite(container, layout, values)


def _returned_containers(out, containers, path=()):
    """(output path, argument path) per list or dict of the arguments (``containers``: id -> path) that
    ``out`` holds, the outermost ones."""
    if id(out) in containers:
        yield path, containers[id(out)]
    elif isinstance(out, (tuple, list)):
        for k, v in enumerate(out):
            yield from _returned_containers(v, containers, (*path, k))
    elif isinstance(out, Mapping):
        for k, v in out.items():
            yield from _returned_containers(v, containers, (*path, k))


def _with_node(tree, path, node):
    """``tree`` with ``node`` at ``path`` (its tuples made anew)."""
    if not path:
        return node
    k = path[0]
    child = _with_node(tree[k], path[1:], node)
    if isinstance(tree, tuple):
        items = [*tree[:k], child, *tree[k + 1:]]
        return type(tree)(*items) if _is_namedtuple(tree) else type(tree)(items)
    tree[k] = child
    return tree


def _find_roots(fn, args, kwargs, lists_read=None) -> _Roots:
    roots = _Roots()
    roots.lists_read = lists_read
    # what the function itself closes over or names as a global is searched as deep as its arguments
    # (a KV cache held outside a decoding step: cache -> its layers -> each layer's key tensors)
    if isinstance(fn, types.FunctionType):
        roots.add_function(fn)
    elif isinstance(fn, types.MethodType):
        roots.add_function(fn.__func__)
        roots.add(fn.__self__)
        roots.direct.append(fn.__self__)
    else:
        roots.add(fn)
        roots.direct.append(fn)
    roots.owners = _owners(roots)
    for leaf in torch_pytree.tree_leaves((args, kwargs)):
        # (an object among the arguments holds state as a closed-over one does: ``f(x, cache)``)
        if not isinstance(leaf, torch.Tensor) and (isinstance(leaf, (torch.nn.Module, torch.optim.Optimizer))
                                                   or hasattr(leaf, "__dict__")):
            roots.add(leaf)
        elif isinstance(leaf, Tensor):
            roots.add_gradient_hooks(leaf)
    return roots


def _owners(roots) -> tuple:
    """The identities of the objects a program is traced for: the modules and optimizers ``fn``
    reaches, and the plain objects its code names (`_Roots.direct`). A program
    stores its results into the objects it was traced with (a ``.grad``, an optimizer's state, a KV
    cache's tensors), so a model, optimizer or cache made anew, however alike, is another program
    (`JitFunction._lookup`). Numbers, flags and functions are guarded as values (`_watched`),
    tensors are the program's inputs, and lists and dicts (a ``batch`` dict made for every call)
    are guarded by their items."""
    held = [id(v) for v in roots.direct if hasattr(v, "__dict__") and not isinstance(
        v, (type, types.ModuleType, torch.Tensor, Mapping, collections.abc.Sequence, *_CALLABLES))]
    return (*map(id, roots.modules), *map(id, roots.optimizers), *held)


@dataclasses.dataclass
class _Slots:
    """The state of one call: tensors (by slot), storages and a structural key."""

    tensors: list  # Tensor | None per slot
    setters: list  # how to point each slot at another tensor (only when collected in full)
    names: list  # a readable name per slot, for explain_recompiles (only when collected in full)
    storages: list  # the distinct storages of all slot tensors
    key: tuple
    static: list  # (name, value) of the Python values the trace depends on
    lifted: list  # `_GroupSite`, `_ValueSite`, `_ArgSite`: the numbers that are program inputs
    first_argument: int  # the index of the first slot of an argument tensor (theirs come last)


def _set_param(mod, name, t):
    mod._parameters[name] = t


def _set_buffer(mod, name, t):
    mod._buffers[name] = t


def _set_grad(p, t):
    p.grad = t


def _set_opt_state(opt, p, key, t):
    opt.state[p][key] = t


@contextlib.contextmanager
def _capturable(optimizers, lifted=()):
    """While tracing, the optimizers' ``capturable`` form: step counters are device
    tensors that the program increments, with no host sync. Some groups take another of
    torch's paths (`_path_flags`; ``lifted`` are the hyperparameters that are program
    inputs). The flags are put back after the trace, so they never reach
    ``state_dict()`` (a checkpoint saved from a jitted run loads into an optimizer on
    the CPU)."""
    flipped = [g for opt in optimizers for g in opt.param_groups if g.get("capturable") is False]
    traced = {id(h.group) for h in lifted if isinstance(h, _GroupSite) and h.hk != "lr"}
    switched = [(g, key, value, g.get(key)) for opt in optimizers
                for g in opt.param_groups for key, value in _path_flags(opt, g, id(g) in traced).items()]
    for g in flipped:
        g["capturable"] = True
    for g, key, value, _ in switched:
        g[key] = value
    _FUSED_FOR_THE_TRACE.update(id(g) for g, key, value, _ in switched if key == "fused" and value)
    try:
        yield
    finally:
        _FUSED_FOR_THE_TRACE.clear()
        for g in flipped:
            g["capturable"] = False
        for g, key, _, was in switched:
            g[key] = was


# the param groups `_capturable` put on the fused path for a trace (whose counters torch makes float32)
_FUSED_FOR_THE_TRACE: set = set()


def _loaded_state_placement(process):
    """``Optimizer._process_value_according_to_param_policy``, loading a step counter that a
    jitted step kept on the jax device (its capturable form, `_capturable`) onto the CPU for
    a parameter off the jax device whose group keeps it there, as torch keeps a CUDA run's: a
    checkpoint of a jitted run then loads into an optimizer on the CPU (its foreach step groups
    the counters with the parameters by device). A state tensor shaped as its parameter (Adam's
    moments) loads laid out as that parameter, sharded where it is: ``.to(param.device)`` alone
    would put a sharded model's whole optimizer state on one device, and the next jitted step
    would compile once more for it."""

    def run(param, value, param_id, param_groups, key=None):
        out = process(param, value, param_id, param_groups, key)
        if key == "step" and isinstance(out, Tensor) and not isinstance(param, Tensor):
            return out.cpu()
        if isinstance(out, Tensor) and isinstance(param, Tensor) and out.shape == param.shape:
            array = out._value()
            placed = _placement.placed_as(param._value(), array)
            if placed is not array:
                return new_tensor(placed)
        return out

    return staticmethod(functools.wraps(process)(run))


torch.optim.Optimizer._process_value_according_to_param_policy = _loaded_state_placement(
    torch.optim.Optimizer._process_value_according_to_param_policy)


# optimizers whose fused step (aten._fused_adam_, ...) torch2jax lowers (torch2jax/ops/foreach.py)
_LOWERED_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _path_flags(opt, group, traced_floats: bool) -> dict:
    """The flags that put a param group on another of torch's paths while it is traced
    (empty: none). A fused group goes the foreach way where the fused op has no lowering
    (Adagrad) or where floats other than ``lr`` are program inputs (OneCycleLR's cycling
    betas or momentum), which the fused op takes as Python floats: each new value would
    trace again. Adam / AdamW groups on torch's single-tensor path, whose capturable form
    divides by the learning rate (NaN wherever a second moment is zero at ``lr=0``, a
    warmup schedule's first step), go the ``fused`` way (torch's eager arithmetic), or the
    ``foreach`` way for complex parameters and traced floats; groups listing a parameter twice stay."""
    if group.get("fused"):
        if traced_floats or not isinstance(opt, _LOWERED_FUSED):
            return {"fused": False, "foreach": True}
        return {}
    if not isinstance(opt, torch.optim.Adam) or group.get("foreach") or group.get("differentiable"):
        return {}
    if len(set(map(id, group["params"]))) < len(group["params"]):
        return {}  # a parameter listed twice (tied weights) is stepped twice, one whole step after the other
    if traced_floats or not all(p.is_floating_point() for p in group["params"]):
        return {"foreach": True}
    return {"fused": True}


def _wide_step_dtype(is_fused=None):
    """``torch.optim.optimizer._get_scalar_dtype`` while traced (see `_wide_step_counters`)."""
    return torch.float32 if is_fused else torch.float64


@contextlib.contextmanager
def _wide_step_counters(optimizers):
    """While traced, the scalar state of optimizers that are not fused (step counters,
    NAdam's mu_product, ASGD's eta and mu) is float64. On their capturable path torch
    computes with those tensors (``1 - beta1 ** step``, RAdam's rectification, ``1 - lambd
    * eta``) in their dtype, where the eager path computes in Python floats: float32
    scalars would cost float64 parameters most of their digits. The program writes them
    back as float32 (as ``state_dict()`` shows them, and as torch rounds them between steps)."""
    if torch.get_default_dtype() == torch.float64:  # torch's scalars are float64 already
        yield
        # but for the groups the trace put on the fused path: their first step made float32 counters
        fused = {id(p) for opt in optimizers for g in opt.param_groups if id(g) in _FUSED_FOR_THE_TRACE
                 for p in g["params"]}
        for p, st, k, v in _scalar_state(optimizers):
            if id(p) in fused and v.dtype == torch.float32:
                st[k] = v.to(torch.float64)
        return
    groups = {id(p): g for opt in optimizers for g in opt.param_groups for p in g["params"]}
    swapped, wide = [], set()
    for p, st, k, v in _scalar_state(optimizers):
        group = groups.get(id(p))
        if v.dtype == torch.float64:  # (a float64 run's: stays so)
            wide.add((id(st), k))
        elif v.dtype == torch.float32 and group is not None and not group.get("fused"):
            st[k] = v.to(torch.float64)
            swapped.append((st, k, v))
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("torch.optim") and getattr(m, "_get_scalar_dtype", None) is not None]
    before = [(m, m._get_scalar_dtype) for m in modules]
    for m in modules:  # (each optimizer's module imported it by name)
        m._get_scalar_dtype = _wide_step_dtype
    try:
        yield
    finally:
        for m, fn in before:
            m._get_scalar_dtype = fn
    with torch.no_grad():
        for st, k, v in swapped:
            now = st.get(k)
            if isinstance(now, Tensor) and now.dtype == torch.float64 and not now.dim():
                v.copy_(now)
                st[k] = v
        # and the scalars the trace created (also on the CPU, as Adafactor keeps its step)
        for _, st, k, v in _scalar_state(optimizers, torch.Tensor):
            if v.dtype == torch.float64 and (id(st), k) not in wide:
                st[k] = v.to(torch.float32)


def _scalar_state(optimizers, kind=Tensor):
    """(parameter, its state dict, key, value) per 0-d tensor of type ``kind`` in the optimizers' state."""
    for opt in optimizers:
        for p, st in opt.state.items():
            for k, v in list(st.items()):
                if isinstance(v, kind) and not v.dim():
                    yield p, st, k, v


@contextlib.contextmanager
def _checks_when_run():
    """While tracing, checks of a tensor's values that a trace cannot decide become checks the
    program makes when it runs, as index checks do (`symbolic.check_when_run`):

    - ``torch._check_tensor_all(cond, message)`` (transformers' check that a vision-language
      model's image tokens match its image features), with its error type and message;
    - torch.distributions' argument validation (``if not valid.all(): raise``), for
      distributions built with ``validate_args=True``, and for all of them under
      ``check_indices="always"``. Otherwise torch's default validation is off in a trace:
      each would cost every step a host sync."""
    from torch.distributions import Distribution

    before, all_true, check_all = Distribution._validate_args, torch._is_all_true, torch._check_tensor_all_with
    if _config().check_indices != "always":
        Distribution.set_default_validate_args(False)
    torch._is_all_true = functools.partial(_all_true_when_run, all_true)
    torch._check_tensor_all_with = functools.partial(_check_all_when_run, check_all)
    try:
        yield
    finally:
        torch._is_all_true = all_true
        torch._check_tensor_all_with = check_all
        Distribution.set_default_validate_args(before)


def _all_true_when_run(all_true, valid):
    value = valid._value() if isinstance(valid, Tensor) else None
    if not isinstance(value, jax.core.Tracer):
        return all_true(valid)
    _sym.check_when_run(~jax.numpy.all(value), lambda _: ValueError(
        "torch.distributions: a parameter or value of a distribution does not satisfy its constraint (the "
        "program's argument validation failed)"), jax.numpy.zeros((), np.int32))
    return torch.tensor(True)


def _check_all_when_run(check_all, error_type, cond, message=None):
    value = cond._value() if isinstance(cond, Tensor) else None
    if not isinstance(value, jax.core.Tracer) or cond.dtype != torch.bool:
        return check_all(error_type, cond, message)
    # the message, made now: it may format traced numbers, which print as stand-ins but stop no trace
    noted = len(_sym.VALUE_ERRORS) if _sym.VALUE_ERRORS is not None else None
    try:
        text = "Expected cond to be True, but got False." if message is None else str(message())
    except Exception as e:
        text = f"torch._check_tensor_all failed (its message could not be made while tracing: {type(e).__name__})"
    if noted is not None:
        del _sym.VALUE_ERRORS[noted:]
    _sym.check_when_run(~jax.numpy.all(value), lambda _: error_type(f"{text} (checked at run time by torch2jax)"),
                        jax.numpy.zeros((), np.int32))


@contextlib.contextmanager
def _scaler_steps_in_program():
    """While tracing, ``GradScaler.step`` keeps its decision on the device. torch skips
    ``optimizer.step()`` on the host when the unscaled gradients hold an inf or NaN
    (``if not sum(found_inf.item() ...)``), which a trace cannot decide; here the step
    always runs in the program and every parameter and optimizer-state tensor it writes
    is put back where ``found_inf`` is set, so a skipped step leaves them as they were. Yields
    the list of (optimizer, its state entries the step created, the skip flag) per step that made
    optimizer state: a call whose step was skipped removes them after the program
    (`_drop_skipped_state`), as torch never makes them."""
    from torch.amp import GradScaler

    original = GradScaler._maybe_opt_step
    created: list = []

    def maybe_opt_step(scaler, optimizer, optimizer_state, *args, **kwargs):
        found = list(optimizer_state["found_inf_per_device"].values())
        if not any(isinstance(f, Tensor) for f in found):
            return original(scaler, optimizer, optimizer_state, *args, **kwargs)
        return _step_unless_found_inf(optimizer, found, args, kwargs, created)

    GradScaler._maybe_opt_step = maybe_opt_step
    try:
        yield created
    finally:
        GradScaler._maybe_opt_step = original


def _scheduler_classes() -> list:
    """torch's LR scheduler classes that define ``step`` (the base class and its overriders), and users' subclasses."""
    todo, found = [torch.optim.lr_scheduler.LRScheduler], []
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "step" in vars(cls):
            found.append(cls)
    return found


@contextlib.contextmanager
def _scheduler_steps_after_the_program(schedulers=()):
    """While tracing, an LR scheduler's ``step()`` is recorded, not run: it changes Python state
    (its epoch counter, the groups' ``lr``) that a program cannot, so each call runs it on the host
    after the program (`_Entry.stores`), with the program's values of its arguments (the metric of
    ReduceLROnPlateau), and the next call reads the new ``lr`` (a program input). Yields the list of
    (scheduler, (args, kwargs)) recorded (`_SchedulerSteps`). A scheduler step an optimizer step of
    the same call follows would change that step's ``lr``: the call runs eagerly. ``schedulers``:
    those whose ``get_last_lr()`` is their groups' ``lr`` when the trace starts: it reads the
    groups' ``lr`` (program inputs), not numbers frozen into the program."""
    steps, tracing = _SchedulerSteps(), threading.get_ident()
    classes = [(cls, vars(cls)["step"]) for cls in _scheduler_classes()]

    def deferring(original):
        @functools.wraps(original)
        def step(scheduler, *args, **kwargs):
            if threading.get_ident() != tracing or getattr(scheduler, "_is_initial", False):
                return original(scheduler, *args, **kwargs)  # (another thread's, or its constructor's first)
            steps.append((scheduler, (args, kwargs)))
            steps.stand_in_for_stepped(scheduler)
            return None

        return step

    def refuse_after_a_scheduler_step(optimizer, args, kwargs):
        if steps and threading.get_ident() == tracing:
            raise OpError(
                "t2j.jit: the function steps an LR scheduler before an optimizer step of the same call; a "
                "scheduler runs on the host after each call's program, so call scheduler.step() after the last "
                "optimizer.step() (torch's order) or outside the jitted function")

    handle = register_optimizer_step_pre_hook(refuse_after_a_scheduler_step)
    for cls, original in classes:
        cls.step = deferring(original)
    for scheduler in schedulers:
        steps.last_lr_read_from_groups(scheduler)
    try:
        yield steps
    finally:
        handle.remove()
        for cls, original in classes:
            cls.step = original
        steps.restore()


class _SchedulerSteps(list):
    """The scheduler steps a trace recorded (`_scheduler_steps_after_the_program`), and the stand-ins
    for the ``lr`` values they will set. The function may read a stepped scheduler's groups' ``lr``
    or ``get_last_lr()`` after its ``step()`` (``return loss, sched.get_last_lr()[0]``): those reads
    see a stand-in tensor of their own, and an output that is one is the group's ``lr`` read after
    the call's scheduler steps ran (``"lifted_after"``), not the value the program was given."""

    def __init__(self):
        super().__init__()
        self.after = {}  # id of a stand-in -> (stand-in, the group's lifted lr tensor it stands after)
        self._undo = []

    def last_lr_read_from_groups(self, scheduler):
        """Make ``scheduler.get_last_lr()`` its groups' traced ``lr`` until `restore`."""
        lrs = [group.get("lr") for group in scheduler.optimizer.param_groups]
        if all(isinstance(lr, Tensor) for lr in lrs):
            self._undo.append(functools.partial(setattr, scheduler, "_last_lr", scheduler._last_lr))
            scheduler._last_lr = lrs

    def stand_in_for_stepped(self, scheduler):
        """Put stand-ins for the stepped ``lr`` in the groups of ``scheduler``'s optimizer and its ``_last_lr``."""
        groups = scheduler.optimizer.param_groups
        stand_ins = []
        for group in groups:
            lr = group.get("lr")
            if isinstance(lr, Tensor) and id(lr) not in self.after:
                stand_in = _SteppedLr.standing_in_for(lr)
                self.after[id(stand_in)] = (stand_in, lr)
                self._undo.append(functools.partial(self._put_back, group, stand_in, lr))
                group["lr"] = lr = stand_in
            stand_ins.append(lr)
        if all(id(lr) in self.after for lr in stand_ins):
            self._undo.append(functools.partial(setattr, scheduler, "_last_lr", getattr(scheduler, "_last_lr", None)))
            scheduler._last_lr = stand_ins
        if getattr(scheduler, "cycle_momentum", False):
            self._stand_in_for_cycled_momentum(groups, "betas" if getattr(scheduler, "use_beta1", False) else "momentum")

    def _stand_in_for_cycled_momentum(self, groups, key):
        """Put stand-ins for the momentum (or beta1) that OneCycleLR's and CyclicLR's step sets in ``groups``:
        the function reading it after the step would otherwise see the value before it. A read of a
        stand-in's value stops the trace, and the call runs eagerly, with the stepped value."""
        for group in groups:
            value = group.get(key)
            momentum = value[0] if key == "betas" and isinstance(value, (tuple, list)) else value
            if momentum is None:
                continue
            like = momentum if isinstance(momentum, Tensor) else torch.tensor(0.0, device=_tensor.DEVICE)
            stand_in = _SteppedLr.standing_in_for(like)
            new = (stand_in, *value[1:]) if key == "betas" else stand_in
            self._undo.append(functools.partial(self._put_back, group, new, value, key))
            group[key] = new

    @staticmethod
    def _put_back(group, stand_in, value, key="lr"):
        if group.get(key) is stand_in:
            group[key] = value

    def restore(self):
        """Put the traced ``lr`` values and the schedulers' ``_last_lr`` back, latest first."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


class _SteppedLr(Tensor):
    """A group's ``lr`` as the function sees it after a ``scheduler.step()`` the trace recorded
    (`_SchedulerSteps`). Its value exists only once the step runs on the host after the program:
    returned as it is (``return sched.get_last_lr()[0]``), it is the stepped value; an op on it
    (``lr * 2``, ``float(lr)``, an optimizer step's arithmetic) stops the trace, and the call runs
    eagerly, where the step happens in the function's own order."""

    @staticmethod
    def standing_in_for(lr):
        r = torch.Tensor._make_wrapper_subclass(_SteppedLr, lr.shape, dtype=lr.dtype, device=lr.device)
        r._t2j_storage = Storage(lr._value())
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise cls._unknown(func)

    def _value(self):
        # (read without an op too: ``torch.tensor(lr)`` / ``torch.as_tensor(sched.get_last_lr())`` of traced
        # numbers take the arrays of the tensors among their data; the storage holds the lr before the step)
        raise self._unknown("reading the value")

    @staticmethod
    def _unknown(what):
        return OpError(
            f"t2j.jit: {what} of a param group's lr read after scheduler.step() inside the function: in a "
            "compiled call an LR scheduler steps on the host after the program, so the program cannot compute "
            "with the stepped lr. Use the lr before scheduler.step(), return it as it is (a returned lr or "
            "get_last_lr() is the stepped value), or step the scheduler outside the jitted function (the same holds "
            "for the momentum or beta1 that OneCycleLR and CyclicLR cycle)")


def _last_lr_is_groups_lr(scheduler) -> bool:
    """Whether ``scheduler.get_last_lr()`` is the Python numbers its optimizer's groups' ``lr`` are now."""
    last = getattr(scheduler, "_last_lr", None)
    lrs = [group.get("lr") for group in scheduler.optimizer.param_groups]
    return isinstance(last, list) and all(isinstance(lr, float) for lr in lrs) and last == lrs


def _step_scheduler(scheduler, given):
    args, kwargs = given
    scheduler.step(*args, **kwargs)


def _step_unless_found_inf(optimizer, found, args, kwargs, created):
    """``optimizer.step(*args, **kwargs)`` whose writes count only where no ``found`` tensor is set.

    A state tensor the step creates (its first step) falls back to its initial value,
    read right after the optimizer's ``_init_group`` made it, and the entries it created are
    appended to ``created`` with the skip flag (`_scaler_steps_in_program`).
    """
    with torch.no_grad():
        skip = functools.reduce(torch.add, [f.to(found[0].device) for f in found]).reshape(()) > 0
        had = {(id(p), key) for p, st in optimizer.state.items() for key in st}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        initial = {(id(p), k): v.detach().clone() for p, st in optimizer.state.items()
                   for k, v in st.items() if isinstance(v, torch.Tensor)}
    init_group = getattr(optimizer, "_init_group", None)
    own = optimizer.__dict__.get("_init_group", _MISSING)

    def record_new_state(*a, **k):
        out = init_group(*a, **k)
        for p, st in optimizer.state.items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and (id(p), key) not in initial:
                    initial[id(p), key] = v.detach().clone()
        return out

    if init_group is not None:
        optimizer._init_group = record_new_state
    try:
        out = optimizer.step(*args, **kwargs)
    finally:
        if init_group is not None:
            if own is _MISSING:
                del optimizer._init_group
            else:
                optimizer._init_group = own
    with torch.no_grad():
        for p, old in zip(params, before):
            p.copy_(torch.where(skip, old, p))
        for p, st in optimizer.state.items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    old = initial.get((id(p), key))
                    v.copy_(torch.where(skip, old if old is not None else torch.zeros_like(v), v))
    new = [(p, key) for p, st in optimizer.state.items() for key in st if (id(p), key) not in had]
    if new:
        created.append((optimizer, new, skip))
    return out


def _drop_skipped_state(optimizer, entries, skipped):
    """After a call whose GradScaler step was skipped, remove the optimizer state ``entries``
    ((param, key) pairs) that its step made: torch makes a parameter's state at its first step
    that is not skipped (from that step's gradient: SGD's momentum buffer)."""
    if not skipped.item():
        return
    for p, key in entries:
        state = optimizer.state.get(p)
        if state is not None:
            state.pop(key, None)
            if not state:
                del optimizer.state[p]


class _Lifted:
    """Stands in the cache key for a hyperparameter whose value is a program input."""

    def __repr__(self):
        return "<program input>"


_LIFTED = _Lifted()


class _LiftedNumber(NamedTuple):
    """Stands in the cache key for a Python number that is a program input (`_Hyperparameters.lifts`)."""

    type: type

    def __repr__(self):
        return f"<program input ({self.type.__name__}): new values need no new trace>"


class _ArrayArgument(NamedTuple):
    """Stands in the cache key for a jax.Array argument, a program input: its type, not its values."""

    shape: tuple
    dtype: object
    weak_type: bool

    def __repr__(self):
        return f"<jax.Array argument {self.dtype}{list(self.shape)}>"


class _Hyperparameters:
    """Which numbers a jitted function reads are program inputs: float hyperparameters
    of its optimizers, and the Python numbers among its arguments and the values it
    reads (`_Roots.python_values`). ``lr`` always is; another one is from the first call
    that sees its value change (until then it is static, so code that branches on it
    traces as plain Python). One that cannot be traced (torch needs a real number for
    it, or the trace used its exact value) is *blocked*: static again, retracing when it
    changes."""

    def __init__(self):
        self.lifted, self.blocked, self.proven = set(), set(), set()
        # (optimizer index, group index, key), ("arg", position) or ("value", where) -> the last value
        self.seen = {}

    def lifts(self, where, value) -> bool:
        """Whether the Python number ``value`` read at ``where`` is a program input."""
        last = self.seen.get(where, value)
        self.seen[where] = value
        if last != value and where not in self.blocked and type(last) is type(value):
            self.lifted.add(where)
        return where in self.lifted

    def block(self, ids):
        self.lifted.difference_update(ids)
        self.blocked.update(ids)

    def lifted_parts(self, k, gi, hk, hv) -> list:
        """The positions of ``param_groups[gi][hk]`` that are inputs: [None] for a
        float, the indices of float elements for a tuple (``betas``)."""
        if type(hv) is float:
            floats = [None]
        elif type(hv) is tuple and any(type(v) is float for v in hv):
            floats = [i for i, v in enumerate(hv) if type(v) is float]
        else:
            return []
        where = (k, gi, hk)
        last = self.seen.get(where, hv)
        self.seen[where] = hv
        if last != hv:
            for ti in floats:
                old = last if ti is None else (last[ti] if type(last) is tuple and len(last) == len(hv) else None)
                if old != (hv if ti is None else hv[ti]) and where + (ti,) not in self.blocked:
                    self.lifted.add(where + (ti,))
        return [ti for ti in floats if where + (ti,) in self.lifted]


# A number a program takes as an input (see `_Hyperparameters`), by where it is read: ``read()``
# gives its value on this call, ``write(v)`` puts the trace's stand-in there, ``saved()`` says how
# to put the value back after the trace.
class _GroupSite(NamedTuple):
    """An optimizer hyperparameter, ``group[hk]`` (``group[hk][ti]`` of a tuple such as betas)."""

    group: dict
    hk: str
    ti: int | None

    def read(self):
        v = self.group[self.hk]
        return float(v if self.ti is None else v[self.ti])

    def current(self):
        """The value there now, as it is (a traced number the function stored)."""
        v = self.group[self.hk]
        return v if self.ti is None else v[self.ti]

    def saved(self):
        """(what it is, how to put its value back): a tuple's elements share one entry."""
        group, hk, value = self.group, self.hk, self.group[self.hk]
        return (id(group), hk), lambda: group.__setitem__(hk, value)

    def write(self, value):
        _set_hyper(self.group, self.hk, self.ti, value)

    def changed(self, value) -> bool:
        now = self.group[self.hk]
        return (now if self.ti is None else now[self.ti]) is not value

    def what(self) -> str:
        return f"the optimizer hyperparameter {self.hk!r}"


class _ValueSite(NamedTuple):
    """A Python number the function reads: a closure cell (``name`` None), a dict's item
    (globals included) or an object's attribute."""

    source: object
    name: object
    where: str

    def read(self):
        if self.name is None:
            return self.source.cell_contents
        if isinstance(self.source, dict):
            return self.source[self.name]
        if isinstance(self.source, list):
            return self.source[self.name] if self.name < len(self.source) else _MISSING
        return getattr(self.source, self.name)

    def saved(self):
        value = self.read()
        return (id(self.source), self.name), lambda: self.write(value)

    def write(self, value):
        if self.name is None:
            self.source.cell_contents = value
        elif isinstance(self.source, (dict, list)):
            self.source[self.name] = value
        else:
            setattr(self.source, self.name, value)

    def changed(self, value) -> bool:
        return self.read() is not value

    def what(self) -> str:
        return f"the Python number {self.where}"


class _ArgSite(NamedTuple):
    """A Python number or a jax.Array among the arguments: the ``index``-th leaf, ``value`` on this call."""

    index: int
    value: int | float | jax.Array

    def read(self):
        return self.value

    def saved(self):
        return (self.index,), lambda: None

    def changed(self, value) -> bool:
        return False


def _lifted_number(v) -> bool:
    """Whether ``v`` may become a program input: a float, or an int within int64."""
    return type(v) is float or (type(v) is int and -(2 ** 63) <= v < 2 ** 63)


def _list_item(container, i) -> str:
    """The name of a list's item among the values a function reads (lists have no names: by identity)."""
    return f"list #{id(container):x} item {i}"


def _is_number(v) -> bool:
    """A Python number or a traced one (what a lifted number becomes by arithmetic in a trace)."""
    return _lifted_number(v) or _sym.is_traced_number(v)


def _is_cpu_scalar(v) -> bool:
    """A 0-d floating-point CPU tensor: a learning rate as torch.compile users give it."""
    return isinstance(v, torch.Tensor) and not isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point()


class _CPUTensor(tuple):
    """A CPU tensor in the cache key: the trace reads its value, so it is keyed by identity,
    shape, dtype and version (an in-place change, a ``fill_`` of a scheduler, retraces)."""

    def __repr__(self):
        return f"<CPU tensor, version {self[-1]}>"


def _cpu_version(t: torch.Tensor):
    """The version of CPU tensor ``t`` that a cache key holds: its version counter, or for an
    inference tensor (made under ``torch.inference_mode``), which has none (reading ``_version``
    raises), a digest of its bytes: such a tensor can still change in place inside another
    ``inference_mode`` block, and the trace bakes its value into the program."""
    if not t.is_inference():
        return t._version
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    return "bytes", hashlib.blake2b(flat.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()


def _guard(v):
    """``v`` (a hyperparameter, optimizer state that is not a tensor, a captured CPU tensor)
    as the cache key holds it: hashable (a list, as LBFGS keeps, by its `_python_value`)."""
    if isinstance(v, torch.Tensor) and not isinstance(v, Tensor):
        return _CPUTensor((id(v), tuple(v.shape), v.dtype, _cpu_version(v)))
    if type(v) is tuple and any(isinstance(x, torch.Tensor) for x in v):
        return tuple(map(_guard, v))
    if isinstance(v, (list, dict, set)):
        return _python_value(v)
    return v


def _new_grad_slot(p, seen: set) -> bool:
    """Whether ``p.grad`` is a slot not listed yet (then it is marked as seen). A non-leaf's
    ``.grad`` stays None (and reading it warns) unless it retains grad. A frozen leaf's is a
    slot while it holds a gradient (from before ``requires_grad_(False)``): ``zero_grad()``
    clears it."""
    # the set lookup first: a tensor's flags cost more to read, and most parameters were seen
    if id(p) in seen:
        return False
    if (p.requires_grad and (p.is_leaf or p.retains_grad)) or (p.is_leaf and p.grad is not None):
        seen.add(id(p))
        return True
    return False


# Bumped by every assignment of a plain attribute to a module (``m.k = 2``): the cache's fast
# check compares its modules' attributes again only after one.
_ATTRIBUTE_WRITES = [0]
_SIMPLE = (bool, int, float, str, type(None), enum.Enum)


def _attributes(subs, lifts: _Hyperparameters | None = None, k=None, lift=None) -> tuple:
    """The plain Python attributes (numbers, strings, flags, tuples of them) of modules
    ``subs``, which a forward reads as constants (``self.k`` in ``topk(x, self.k)``): each
    new value traces again, as torch.compile guards on them. So does a function set on an
    instance (``m.forward = wrapped``, as accelerate and peft wrap a forward), by identity.
    With ``lifts``, a number that changes from call to call (an annealed ``self.temperature``)
    is a program input instead (`_Hyperparameters.lifts`): `_LiftedNumber` stands for it and
    ``lift(site, id)`` is called with its `_ValueSite` (``k``: the root module's index, in the id)."""
    out = []
    for si, sub in enumerate(subs):
        values = []
        for name, v in sub.__dict__.items():
            if name[0] == "_" or name == "training" or not (isinstance(v, (*_SIMPLE, *_CALLABLES)) or (
                    type(v) is tuple and all(isinstance(x, _SIMPLE) for x in v))):
                continue
            where = ("module attribute", k, si, name)
            if lifts is not None and _lifted_number(v) and lifts.lifts(where, v):
                values.append((name, _LiftedNumber(type(v))))
                lift(_ValueSite(sub, name, f"{type(sub).__name__}.{name}"), where)
            else:
                values.append((name, v if isinstance(v, _CALLABLES) else _python_value(v)))
        out.append(tuple(values))
    return tuple(out)


def _counting_attribute_writes(method):
    """``Module.__setattr__`` / ``__delattr__`` counting in `_ATTRIBUTE_WRITES`."""

    @functools.wraps(method)
    def run(self, *args):
        _ATTRIBUTE_WRITES[0] += 1
        method(self, *args)

    return run


torch.nn.Module.__setattr__ = _counting_attribute_writes(torch.nn.Module.__setattr__)
torch.nn.Module.__delattr__ = _counting_attribute_writes(torch.nn.Module.__delattr__)

# Bumped by every hook registered or removed (module, global and tensor hooks all return a
# RemovableHandle): the cache's fast check compares its modules' hooks again only after one.
_HOOK_CHANGES = [0]


def _counting_hook_changes(method):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        _HOOK_CHANGES[0] += 1
        return method(self, *args, **kwargs)

    return run


torch.utils.hooks.RemovableHandle.__init__ = _counting_hook_changes(torch.utils.hooks.RemovableHandle.__init__)
torch.utils.hooks.RemovableHandle.remove = _counting_hook_changes(torch.utils.hooks.RemovableHandle.remove)

_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                      "_global_backward_hooks")


def _tensor_hooks(tensors) -> tuple:
    """(slot, handle ids) per tensor among ``tensors`` with a gradient hook (`JitFunction._hooks_key`)."""
    return tuple((k, tuple(t._backward_hooks or ()), tuple(t._post_accumulate_grad_hooks or ()))
                 for k, t in enumerate(tensors)
                 if t is not None and t.requires_grad and (t._backward_hooks or t._post_accumulate_grad_hooks))


def _module_hooks(subs) -> tuple:
    """The handles of the forward and backward hooks on modules ``subs`` and of the global
    module hooks: a hook added or removed changes the program (handle ids are never reused)."""
    g = torch.nn.modules.module
    return (tuple(tuple(getattr(g, name)) for name in _GLOBAL_HOOK_DICTS),
            tuple(tuple(tuple(getattr(sub, name)) for name in _MODULE_HOOK_DICTS) for sub in subs))


def _submodules(m) -> list:
    """``list(m.modules())``: ``m`` and every module under it, once each, in the same order,
    without the names that ``named_modules`` builds."""
    out, seen, todo = [], set(), [m]
    while todo:
        sub = todo.pop()
        if sub is None or id(sub) in seen:
            continue
        seen.add(id(sub))
        out.append(sub)
        todo.extend(reversed(sub._modules.values()))
    return out


_KEY_ORDER: dict = {}  # a state dict's keys in insertion order -> the same keys sorted


def _sorted_keys(st: dict) -> tuple:
    """The keys of an optimizer state dict in sorted order (the slot order), remembered per
    key sequence: every parameter of an optimizer has the same few."""
    keys = tuple(st)
    order = _KEY_ORDER.get(keys)
    if order is None:
        order = _KEY_ORDER[keys] = tuple(sorted(keys))
    return order


_TENSOR_ATTRIBUTES_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (writes, tensors)


def _container_leaves(value) -> list:
    """The leaves of a tuple, list, dict or namedtuple ``value``; none for other values."""
    if type(value) not in (tuple, list, dict) and not _is_namedtuple(value):
        return []
    return torch_pytree.tree_leaves(value)


def _tensors_in(value) -> list:
    """The tensors among the leaves of a tuple, list or dict ``value`` (none for other values)."""
    return [t for t in _container_leaves(value) if isinstance(t, torch.Tensor)]


# a module's own dicts of parameters, buffers and submodules: their tensors are slots already
_SLOT_DICTS = frozenset({"_parameters", "_buffers", "_modules"})


def _tensor_attributes(module) -> list:
    """The tensors that ``module`` and its submodules hold as plain attributes, neither
    parameters nor buffers (``self.cache = x``, ``self.scale = torch.tensor(2.0)``): state like
    any other. One on the jax device is a slot (its replacement, ``self.cache = self.cache + x``,
    is written back on every call: `_Places`); one on the CPU, which ``module.to("jax")``
    leaves there, is read at trace time and guarded as closed-over CPU tensors are (an in-place
    ``fill_`` retraces). Tensors in a tuple, list or dict attribute count too (an RNN's
    ``self.hidden = (h, c)``). Read again only after an attribute write (`_ATTRIBUTE_WRITES`)."""
    seen = _TENSOR_ATTRIBUTES_SEEN.get(module)
    if seen is None or seen[0] != _ATTRIBUTE_WRITES[0]:
        tensors = [t for sub in _submodules(module) for k, v in sub.__dict__.items() if k not in _SLOT_DICTS
                   for t in ((v,) if isinstance(v, torch.Tensor) else _tensors_in(v))]
        seen = _TENSOR_ATTRIBUTES_SEEN[module] = (_ATTRIBUTE_WRITES[0], tensors)
    return seen[1]


_PYTHON_VALUES = ("python", 0, "values")  # the static entry of a key holding `_Roots.python_values`


class _Walk:
    """The tensors a call's state consists of, in slot order, found by one walk over
    the roots (or the arguments). Where each came from (its *origin*, from which a
    slot's name and setter are made) is recorded only when ``full``: a walk runs on
    every call and must stay cheap."""

    def __init__(self, full: bool, grads_seen=(), hypers: _Hyperparameters | None = None, grads: bool = True):
        self.full = full
        self.grads = grads  # whether ``.grad`` slots are walked
        self.tensors, self.origins, self.static, self.lifted, self.lifted_ids = [], [], [], [], []
        self.grads_seen = set(grads_seen)
        self.hypers = hypers
        self.groups_lifted = set()

    def add(self, t, origin):
        self.tensors.append(t)
        if self.full:
            self.origins.append(origin)

    def add_grad(self, p, origin):
        if self.grads and _new_grad_slot(p, self.grads_seen):
            self.add(p.grad, ("grad", p, origin) if self.full else None)

    def roots(self, roots: _Roots):
        self.grads = roots.grads
        for i, t in enumerate(roots.tensors):
            self.add(t, ("captured", i))
            self.add_grad(t, ("captured", i))  # a closed-over leaf's .grad accumulates across calls
        for i, t in enumerate(roots.cpu_tensors):
            self.static.append((("cpu", i, "tensor"), _guard(t)))
        self.static.append((_PYTHON_VALUES, roots.python_values(self.lift_number)))
        # the loops below run on every call, over every parameter: origins are built only when full
        full, tensors, grads_seen, grads = self.full, self.tensors, self.grads_seen, self.grads
        for k, m in enumerate(roots.modules):
            subs = _submodules(m)
            self.static.append((("module", k, "training"), tuple([sub.training for sub in subs])))
            self.static.append((("module", k, "attributes"), _attributes(subs, self.hypers, k, self.lift_number)))
            self.static.append((("module", k, "hooks"), _module_hooks(subs)))
            for sub in subs:
                for name, p in sub._parameters.items():
                    if full:
                        self.add(p, ("param", m, sub, name))
                        if p is not None:
                            self.add_grad(p, ("param", m, sub, name))
                        continue
                    tensors.append(p)
                    if grads and p is not None and _new_grad_slot(p, grads_seen):
                        tensors.append(p.grad)
                if full:
                    for name, b in sub._buffers.items():
                        self.add(b, ("buffer", m, sub, name))
                else:
                    tensors.extend(sub._buffers.values())
        for k, opt in enumerate(roots.optimizers):
            self.optimizer(k, opt)
        return self

    def optimizer(self, k, opt):
        full, tensors, grads_seen, static = self.full, self.tensors, self.grads_seen, self.static
        for gi, group in enumerate(opt.param_groups):
            hyper = []
            for hk, hv in sorted(group.items()):
                if hk == "params":
                    continue
                if hk == "lr" and (type(hv) is float or _is_cpu_scalar(hv)):
                    self.lift(group, k, gi, hk, None)
                elif isinstance(hv, Tensor):
                    self.add(hv, ("hyper", opt, k, gi, hk))
                elif parts := (self.hypers.lifted_parts(k, gi, hk, hv) if self.hypers else None):
                    for ti in parts:
                        self.lift(group, k, gi, hk, ti)
                    hyper.append((hk, _LIFTED if parts == [None] else
                                  tuple(_LIFTED if i in parts else v for i, v in enumerate(hv))))
                else:
                    hyper.append((hk, _guard(hv)))
            static.append((("optimizer", k, "param_groups", gi), tuple(hyper)))
            state = opt.state
            # per parameter: the names of its state in sorted order, the tensors' names alone
            layouts = []
            for pi, p in enumerate(group["params"]):
                if id(p) not in grads_seen:  # a parameter no module showed (t2j.jit(opt.step)) is state too
                    self.add(p, ("opt_param", opt, k, gi, pi))
                if full:
                    self.add_grad(p, ("opt_param", opt, k, gi, pi))
                elif _new_grad_slot(p, grads_seen):
                    tensors.append(p.grad)
                st = state.get(p)
                if st is None:
                    layouts.append(None)
                    continue
                values = []
                for sk in _sorted_keys(st):
                    sv = st[sk]
                    if not isinstance(sv, Tensor):  # (the cheaper test first: torch.Tensor's is slow)
                        if not isinstance(sv, torch.Tensor):
                            values.append((sk, self.state_number(st, ("optimizer state", k, gi, pi, sk), sv)))
                            continue
                        # capturable: a step counter on the CPU would count traces, not calls (one
                        # a trace created holds a value known then: a constant, not a tracer)
                        with jax.ensure_compile_time_eval():
                            sv = st[sk] = sv.to(_tensor.DEVICE)
                    if full:
                        self.add(sv, ("opt_state", opt, k, pi, p, sk))
                    else:
                        tensors.append(sv)
                    values.append(sk)
                layouts.append(tuple(values))
            static.append((("optimizer", k, "state", gi), tuple(layouts)))

    def state_number(self, st, where, v):
        """A Python value in an optimizer's state (``state["step"] += 1`` of transformers' Adafactor):
        guarded, or once it changes from call to call, a program input (`lifted`)."""
        if self.hypers is not None and _lifted_number(v) and self.hypers.lifts(where, v):
            self.lift_number(_ValueSite(st, where[-1], _lifted_name(where)), where)
            return _LiftedNumber(type(v))
        return _guard(v)

    def lift(self, group, k, gi, hk, ti):
        # (a group two optimizers share, as a wrapper optimizer holds its base's: one input)
        if (id(group), hk, ti) not in self.groups_lifted:
            self.groups_lifted.add((id(group), hk, ti))
            self.lift_number(_GroupSite(group, hk, ti), (k, gi, hk, ti))

    def lift_number(self, site, where):
        """Make the number read at ``site`` (identified by ``where``) a program input."""
        self.lifted.append(site)
        self.lifted_ids.append(where)

    def args(self, leaves):
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                self.add(leaf, ("arg", i))
                self.add_grad(leaf, ("arg", i))
        return self


def _slot_name(origin, prefixes) -> str:
    kind = origin[0]
    if kind == "arg":
        return f"argument {origin[1]}"
    if kind == "captured":
        return f"captured tensor {origin[1]}"
    if kind == "grad":
        return _slot_name(origin[2], prefixes) + ".grad"
    if kind in ("param", "buffer"):
        _, m, sub, name = origin
        return _module_slot_name(m, prefixes[id(m)][id(sub)], name)
    oname = f"{type(origin[1]).__name__}#{origin[2]}"
    if kind == "hyper":
        return f"{oname}.param_groups[{origin[3]}][{origin[4]!r}]"
    if kind == "opt_param":
        return f"{oname}.param_groups[{origin[3]}].params[{origin[4]}]"
    return f"{oname}.state[{origin[3]}][{origin[5]!r}]"


def _slot_setter(origin):
    kind = origin[0]
    if kind == "grad":
        return functools.partial(_set_grad, origin[1])
    if kind == "param":
        return functools.partial(_set_param, origin[2], origin[3])
    if kind == "buffer":
        return functools.partial(_set_buffer, origin[2], origin[3])
    if kind == "opt_state":
        return functools.partial(_set_opt_state, origin[1], origin[4], origin[5])
    return None


def _off_device(walk: _Walk) -> int | None:
    """The first slot whose tensor is not on the jax device, if any."""
    for i, t in enumerate(walk.tensors):
        if t is not None and not isinstance(t, Tensor):
            return i
    return None


def _moved_scalar_buffer(origin, t, prefixes) -> bool:
    """Move a 0-d CPU buffer of a jax module to the jax device, warning once, and say so.

    torch mixes 0-d CPU tensors into other devices' ops, so modules keep counters there
    (``AveragedModel(model)`` registers ``n_averaged`` on the CPU); a program can update it
    only on the device."""
    if origin[0] != "buffer" or t.dim() != 0 or t.device.type != "cpu":
        return False
    _, _, sub, name = origin
    sub._buffers[name] = t.to(_device.NAME)
    warnings.warn(f"t2j.jit: moved {_slot_name(origin, prefixes)}, a 0-d buffer on the CPU, to the jax device so "
                  "that the program can update it; register it on the jax device to avoid this")
    return True


def _cpu_modules(roots: _Roots) -> str:
    """The modules ``roots`` reached whose own tensors are on the CPU, named for an error; '' if none."""
    found = [o for o in roots.objects if isinstance(o, torch.nn.Module)
             and any(t.device.type == "cpu" for t in itertools.chain(o.parameters(), o.buffers()))]
    return ", ".join(f"a {type(m).__name__}" for m in found[:3])


def _refuse_off_device(walk: _Walk, i: int, prefixes):
    raise JitError(
        f"t2j.jit: {_slot_name(walk.origins[i], prefixes)} is a tensor on {walk.tensors[i].device}, not on the "
        "jax device; move it first (module.to('jax'), tensor.to('jax'))"
    )


def _same(a, b) -> bool:
    """Whether sequences ``a`` and ``b`` hold the same objects (identity, not ``==``)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


_grad_of = operator.attrgetter("grad")
_dict_values = operator.methodcaller("values")
_array_of = operator.attrgetter("array")
_storage_of = operator.attrgetter("_t2j_storage")
_requires_grad = operator.attrgetter("requires_grad")


class _Unchanged:
    """What a walk over the roots found, checked on later calls without walking again:
    the same roots, the same objects in every container the walk read (modules'
    parameter, buffer and submodule dicts, ``.grad``, optimizer groups and state), the
    same module modes, CPU tensor versions and optimizer hyperparameters (``lr`` aside:
    it is a program input). Where any of it differs, the call walks as before.
    Optimizers whose other hyperparameters are program inputs are always walked."""

    def __init__(self, roots: _Roots, hypers: _Hyperparameters | None):
        self.roots = (*roots.modules, *roots.optimizers, *roots.tensors, *roots.cpu_tensors)
        self.cpu = [_guard(t) for t in roots.cpu_tensors]
        self.python = roots.python_values(held=False)
        # (an object modules hold has dozens of attributes: the same objects in them, compared by
        # identity, are the same plain values)
        self.held_attributes = [(d, list(d.values())) for d in (vars(o) for o in roots.objects if id(o) in roots.held)]
        self.hypers = hypers
        self.hyper_sets = self._hyper_sets()
        self.subs = [sub for m in roots.modules for sub in _submodules(m)]
        self.training = [sub.training for sub in self.subs]
        self.writes, self.attributes = _ATTRIBUTE_WRITES[0], _attributes(self.subs)
        self.hook_changes, self.hooks = _HOOK_CHANGES[0], _module_hooks(self.subs)
        # the containers themselves, which may be replaced whole (Optimizer.load_state_dict replaces
        # state and param_groups)
        self.holders = [*((sub.__dict__, ("_modules", "_parameters", "_buffers")) for sub in self.subs),
                        *((opt.__dict__, ("state", "param_groups")) for opt in roots.optimizers)]
        self.held = [d[k] for d, keys in self.holders for k in keys]
        # (container, its values then): identity of the values says nothing was replaced or added;
        # most modules have no buffers or submodules: those dicts need only stay empty
        containers = [d for sub in self.subs for d in (sub._modules, sub._parameters, sub._buffers)]
        params = [p for sub in self.subs for p in sub._parameters.values() if p is not None]
        params += [t for t in roots.tensors if t.is_leaf or t.retains_grad]  # a closed-over leaf's .grad too
        self.groups, self.usable = [], True
        for opt in roots.optimizers:
            containers += [opt.state, *opt.state.values(), opt.param_groups]
            # state that is not a tensor (LBFGS's lists) can change in place: the walk summarizes it
            self.usable &= all(isinstance(v, Tensor) for st in opt.state.values() for v in st.values())
            for group in opt.param_groups:
                params.extend(group["params"])
                hyper = tuple((k, _LIFTED if _is_input_lr(k, v) else v) for k, v in group.items() if k != "params")
                # so can a tensor or container hyperparameter: the walk guards its version or contents
                self.usable &= not any(isinstance(v, (torch.Tensor, list, dict, set)) for _, v in hyper)
                self.groups.append((group, group["params"], tuple(group["params"]), len(group), hyper))
        self.empty = [c for c in containers if not c]
        self.dicts = [c for c in containers if c and isinstance(c, dict)]
        self.lists = [c for c in containers if c and not isinstance(c, dict)]
        self.lens = list(map(len, self.dicts + self.lists))
        self.values = self._values()
        self.params = params if roots.grads else []  # (gradients that are no slots need not stay the same)
        self.grads = list(map(_grad_of, self.params))

    def _values(self) -> list:
        return [*itertools.chain.from_iterable(map(_dict_values, self.dicts)), *itertools.chain(*self.lists)]

    def _hyper_sets(self):
        h = self.hypers
        return None if h is None else (len(h.lifted), len(h.blocked))

    def hold(self, roots: _Roots) -> bool:
        if not self.usable or not _same((*roots.modules, *roots.optimizers, *roots.tensors, *roots.cpu_tensors),
                                        self.roots):
            return False
        if self._hyper_sets() != self.hyper_sets or [_guard(t) for t in roots.cpu_tensors] != self.cpu:
            return False
        if roots.python_values(held=False) != self.python:
            return False
        if not all(_same(list(d.values()), values) for d, values in self.held_attributes):
            return False
        if not _same([d.get(k) for d, keys in self.holders for k in keys], self.held):
            return False
        if any(map(len, self.empty)) or list(map(len, self.dicts + self.lists)) != self.lens:
            return False
        if not _same(self._values(), self.values):
            return False
        if [sub.training for sub in self.subs] != self.training or not _same(list(map(_grad_of, self.params)), self.grads):
            return False
        if _ATTRIBUTE_WRITES[0] != self.writes:
            if _attributes(self.subs) != self.attributes:
                return False
            self.writes = _ATTRIBUTE_WRITES[0]
        if _HOOK_CHANGES[0] != self.hook_changes:
            if _module_hooks(self.subs) != self.hooks:
                return False
            self.hook_changes = _HOOK_CHANGES[0]
        for group, plist, params, n, hyper in self.groups:
            if group["params"] is not plist or len(group) != n or not _same(plist, params):
                return False
            for k, v in hyper:
                now = group.get(k, hyper)  # (hyper: a value no group holds)
                if v is _LIFTED:
                    if not _is_input_lr(k, now):
                        return False
                elif now is not v and (type(now) is not type(v) or now != v):
                    return False
        return True


def _is_input_lr(k, v) -> bool:
    """Whether param group entry ``k`` is the learning rate that every trace takes as a program input."""
    return k == "lr" and (type(v) is float or _is_cpu_scalar(v))


class _RootState:
    """The roots' part of the slots, kept from call to call: when the same tensors
    with the same storages, shapes and flags come back, the signature is reused
    instead of being rebuilt (the per-call cost of a step with many parameters)."""

    def __init__(self, walk: _Walk, roots: _Roots | None = None):
        self.tensors = walk.tensors
        self.static = walk.static
        self.lifted = walk.lifted
        self.lifted_ids = walk.lifted_ids
        self.grads_seen = walk.grads_seen
        self.grads = walk.grads
        self.storages, self.index, self.sig = [], {}, []
        for t in walk.tensors:
            self.sig.append(_signature(t, self.storages, self.index))
        self.present = [t for t in walk.tensors if t is not None]
        self.storage_of = list(map(_storage_of, self.present))
        self.flags = list(map(_requires_grad, self.present))
        self.avals = _avals(self.storages)
        self.remember_arrays()
        self.key = _Key((tuple(self.sig), tuple(self.avals), tuple(walk.static), tuple(walk.lifted_ids)))
        self.unchanged = self.unchanged_for(walk, roots)

    @staticmethod
    def unchanged_for(walk: _Walk, roots: _Roots | None) -> _Unchanged | None:
        # other hyperparameters as program inputs change the walk's own bookkeeping: walk those calls
        plain = all(not isinstance(h, _GroupSite) or (h.hk == "lr" and h.ti is None) for h in walk.lifted)
        return _Unchanged(roots, walk.hypers) if roots is not None and plain and not walk.full else None

    def matches(self, walk: _Walk) -> bool:
        ts = walk.tensors
        if walk.grads != self.grads or not _same(ts, self.tensors):
            return False
        if walk.static != self.static or walk.lifted_ids != self.lifted_ids:
            return False
        return self.same_contents()

    def holds_for(self, roots: _Roots) -> bool:
        """Whether a walk over ``roots`` would find this state again (`_Unchanged`), checked without walking."""
        return (roots.grads == self.grads and self.unchanged is not None and self.unchanged.hold(roots)
                and self.same_contents())

    def same_contents(self) -> bool:
        """The slot tensors, known to be the same objects, still have the same storages and flags."""
        present = self.present
        if not _same(list(map(_storage_of, present)), self.storage_of):
            return False
        if list(map(_requires_grad, present)) != self.flags:
            return False
        # an array this state has seen has the shape and dtype it had then
        arrays = list(map(_array_of, self.storages))
        if not all(map(operator.is_, arrays, self.arrays)):
            if _avals(self.storages) != self.avals:
                return False
            self.arrays = arrays
        return True

    def remember_arrays(self):
        """Record the storages' arrays as known to have the recorded shapes and dtypes."""
        self.arrays = list(map(_array_of, self.storages))


def _same_aval(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


class _Key(tuple):
    """A cache key part that is built once and looked up on every call: its hash is kept."""

    def __hash__(self):
        h = self.__dict__.get("hash")
        if h is None:
            h = self.__dict__["hash"] = tuple.__hash__(self)
        return h


def _flags(tensors):
    return [t is not None and t.requires_grad for t in tensors]


def _avals(storages):
    return [(st.array.shape, st.array.dtype) for st in storages]


def _signature(t, storages, index):
    """What the trace of a slot depends on; registers the tensor's storage."""
    if t is None:
        return None
    st = t._t2j_storage
    i = index.get(id(st))
    if i is None:
        i = index[id(st)] = len(storages)
        storages.append(st)
    view = (t.stride(), t.storage_offset()) if t._t2j_view else None
    return (tuple(t.shape), t.dtype, t.requires_grad, i, view)


def _collect(args_leaves, roots: _Roots, full: bool = False, memo: list | None = None,
             hypers: _Hyperparameters | None = None) -> _Slots:
    """The slots of a call: the roots' state first, then the tensor arguments.

    ``full`` (when tracing) adds each slot's name and setter. ``memo`` is a
    one-element list holding the last call's `_RootState`, reused when it still
    matches and replaced when not. ``hypers`` says which optimizer hyperparameters
    besides ``lr`` are program inputs.
    """
    prefixes = {id(m): {id(sub): prefix for prefix, sub in m.named_modules()} for m in roots.modules} if full else {}
    state = memo[0] if memo else None
    if full or state is None or not state.holds_for(roots):
        walk = _Walk(full, hypers=hypers).roots(roots)
        if state is None or not state.matches(walk):  # (the remembered state was checked)
            if (i := _off_device(walk)) is not None:
                if not full:  # the full walk names the slot
                    return _collect(args_leaves, roots, full=True, hypers=hypers)
                if _moved_scalar_buffer(walk.origins[i], walk.tensors[i], prefixes):
                    return _collect(args_leaves, roots, full=True, memo=memo, hypers=hypers)
                _refuse_off_device(walk, i, prefixes)
            state = _RootState(walk, roots)
            if memo is not None:
                memo[:] = [state]
        elif not full and state.unchanged is not None and state.unchanged.usable:
            # the same state in other containers (a lowering put copies of the optimizer's state dicts
            # back): take a new snapshot, or every later call would walk again
            state.unchanged = _RootState.unchanged_for(walk, roots)
    args = _Walk(full, state.grads_seen, grads=state.grads).args(args_leaves)
    if (i := _off_device(args)) is not None:
        if not full:
            return _collect(args_leaves, roots, full=True, hypers=hypers)
        _refuse_off_device(args, i, prefixes)
    storages, index = list(state.storages), dict(state.index)
    sig = tuple(_signature(t, storages, index) for t in args.tensors)
    avals = tuple((st.array.shape, st.array.dtype) for st in storages[len(state.storages):])
    key = (state.key, sig, avals)
    tensors = state.tensors + args.tensors
    setters, names = [], []
    if full:
        origins = walk.origins + args.origins
        setters = [_slot_setter(o) for o in origins]
        names = [_slot_name(o, prefixes) for o in origins]
        return _Slots(walk.tensors + args.tensors, setters, names, storages, key, walk.static, walk.lifted,
                      len(walk.tensors))
    return _Slots(tensors, setters, names, storages, key, state.static, state.lifted, len(state.tensors))


def _module_slot_name(module, prefix, name):
    return ".".join(p for p in (type(module).__name__, prefix, name) if p)


# ---------------------------------------------------------------------------
# tracing
# ---------------------------------------------------------------------------


def _view_of_slot(t, tensors, storages):
    """(slot, size, stride, offset, requires_grad) where output ``t`` is a view of an input's
    storage that the slot's tensor can give again with ``as_strided`` (as torch returns a
    view of the input, writes through it reaching the input); None otherwise."""
    # (a view with no steps is an alias of the whole storage: ``detach()`` of an integer tensor)
    if not any(t._t2j_storage is st for st in storages):
        return None
    if not _tensor.strided_steps(t._t2j_view):
        # a view that changes values (conj, dtype views), or one at a traced position: as_strided
        # cannot give it again, its ops called again can
        return _replayed_view_of_slot(t, tensors)
    for k, s in enumerate(tensors):
        if s is not None and s._t2j_storage is t._t2j_storage and s.dtype == t.dtype:
            return k, tuple(t.shape), tuple(t.stride()), t.storage_offset(), _grad_mode_of(t)
    return None


def _replayed_view_of_slot(t, tensors):
    """("replay", (slot, calls, grad mode)) where view output ``t`` is a slot tensor seen through view
    ops with static arguments (``x.imag``, ``torch.view_as_real(x)``, ``x.conj()``, ``x.view(torch.int32)``):
    each call makes it again by calling those ops on the slot's tensor; None otherwise."""
    chain = t._t2j_view
    for k, s in enumerate(tensors):
        if s is None or s._t2j_storage is not t._t2j_storage or len(s._t2j_view) >= len(chain) \
                or any(a is not b for a, b in zip(s._t2j_view, chain)):
            continue
        calls = [step.call for step in chain[len(s._t2j_view):]]
        if all(c is not None and not any(isinstance(a, jax.Array) for a in jax.tree.leaves(c[1:3])) for c in calls):
            return "replay", (k, calls, _grad_mode_of(t))
    return None


def _replayed(base, calls, grad_mode):
    """``base`` through the view ops ``calls`` (`_replayed_view_of_slot`), related to autograd as
    `_view_of` relates its views."""
    if grad_mode is False and base.requires_grad:
        base = base.detach()
    with torch.set_grad_enabled(grad_mode is not None):
        for func, rest, kwargs, i in calls:
            base = func(base, *rest, **kwargs)
            base = base if i is None else base[i]
    return base


_MULTI_OUTPUT_VIEW = torch._C._autograd.CreationMeta.MULTI_OUTPUT_NODE


def _grad_mode_of(t):
    """How view output ``t`` relates to autograd, for `_view_of`: True (a view with a history),
    ``_MULTI_OUTPUT_VIEW`` (one of ``unbind`` / ``split`` / ``chunk``'s views, which torch refuses
    to write in place), None (made under no_grad from a tensor that requires grad), False (detached)."""
    if not t.requires_grad:
        return False
    if t.grad_fn is None:
        return None
    return _MULTI_OUTPUT_VIEW if t._is_view() and torch._C._autograd._get_creation_meta(t) == _MULTI_OUTPUT_VIEW \
        else True


def _dense_order(t) -> tuple | None:
    """The dimensions of ``t`` from outermost to innermost in memory, where its strides
    are a permutation of a dense layout other than the contiguous one (channels_last)."""
    if t.is_contiguous() or t.dim() < 2:
        return None
    return _tensor.dense_order(tuple(t.shape), t.stride())


def _offset_within(t, other) -> int | None:
    """The storage offset of view ``t`` counted from ``other``'s first element, where every
    element of ``t`` is one of ``other``'s and ``other`` is dense: the call's output for
    ``other`` has its layout (`_Outputs._kind`), so ``t`` is that view of it. (A base tensor
    the program returns as it is, or a ``.grad`` that backward made as a transposed view.)"""
    if not other._t2j_view:
        return t.storage_offset()
    shape, strides = tuple(other.shape), other.stride()
    if not other.is_contiguous() and (other.dim() < 2 or _tensor.dense_order(shape, strides) is None):
        return None
    start = other.storage_offset()
    end = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    if t.numel() == 0 or t.storage_offset() < start or end >= start + other.numel():
        return None
    return t.storage_offset() - start


def _laid_out_as(t, order):
    """``t``'s values with the strides the traced output had: a view of a copy stored in
    ``order`` (differentiable, where ``t`` is)."""
    return t.permute(order).contiguous().permute(*np.argsort(order).tolist())


def _is_size(x) -> bool:
    """A torch.Size is one static value of a call's arguments and outputs (torch's pytree would give
    its numbers back as a tuple)."""
    return type(x) is torch.Size


class _Outputs:
    """What a traced call gives back, and how each call makes it again (`_output`): the
    arrays a program returns, and per output a kind (see `_Entry.out_leaves`)."""

    def __init__(self, slots, storages, pre_index, arg_index, lifted_index, after=None):
        self.slots, self.storages, self.pre_index, self.arg_index = slots, storages, pre_index, arg_index
        self.lifted_index = lifted_index  # id of a tensor standing for a lifted number (a group's lr) -> its index
        self.after = after or {}  # id of a stand-in for an lr a scheduler step sets -> (it, the lifted lr's tensor)
        self.arrays, self.grad_outs = [], []
        self.histories = []  # of those, the outputs an op made (with a grad_fn), not leaves made inside
        self.saved_results = []  # of those, the outputs their op saved for its backward (sigmoid's, exp's)
        self.nodes = []  # their grad_fns (`_saves_tensors`)
        self.made_leaves = []  # (index, whether an nn.Parameter) of the leaves made inside that require grad
        self.grads_of_made_leaves = []  # (index, .grad) of those of them a backward inside gave a gradient
        self.inference = []  # the outputs made under torch.inference_mode()
        self.leaves = {}  # id of an output tensor -> its position among the output leaves
        self.kept = {}  # id -> the output tensor (alive while the trace's outputs are classified)
        self.bases = {}  # id -> (kind, tensor) of a base of returned views the trace made (`_view_of_made`)

    def kind(self, leaf, position: int) -> tuple:
        """The kind of output leaf ``leaf`` at ``position``, adding its value to the program's outputs
        where it has one. A tensor returned twice is the same tensor twice; a view of an output
        classified before it (`_classification_order`), a view of it."""
        if isinstance(leaf, Tensor) and id(leaf) not in self.after:  # (a stand-in is a number: no identity)
            if id(leaf) in self.leaves:
                return "leaf", self.leaves[id(leaf)]
            view = self._view_of_output(leaf)
            self.leaves[id(leaf)] = position
            self.kept[id(leaf)] = leaf
            if view is not None:
                return view
        return self._kind(leaf)

    def _view_of_output(self, leaf):
        if not _tensor.strided_steps(leaf._t2j_view):
            return None
        for k, other in self.kept.items():
            if other._t2j_storage is leaf._t2j_storage and other.dtype == leaf.dtype \
                    and (offset := _offset_within(leaf, other)) is not None:
                # (``detach()`` of one, which torch does not count a view: no ``_base``)
                return "view_of_leaf", (self.leaves[k], tuple(leaf.shape), tuple(leaf.stride()), offset,
                                        _grad_mode_of(leaf), leaf._base is None and not leaf.requires_grad)
        return None

    def release(self):
        """Hold the outputs weakly from now on: those no slot keeps die with the trace."""
        self.kept = {k: weakref.ref(t) for k, t in self.kept.items()}
        self.bases.clear()

    def repointed(self, kinds, post) -> dict:
        """Outputs that a slot points to after the call (a new ``.grad``, new optimizer state
        returned by the function) are that tensor, not a copy of it.

        A slot's new tensor that requires grad (the ``.grad`` a ``backward(create_graph=True)`` set) has
        a history of this call's: it is an output of the program (returned or not), and each call puts
        its own output tensor in the slot. Returns {index into ``post``: its `stored` kind} for those."""
        from_outputs = {}
        for p, (_, target, _, _) in enumerate(post):
            if isinstance(target, Tensor) and target.requires_grad:
                from_outputs[p] = self.stored(target)
                continue
            ref = self.kept.get(id(target)) if isinstance(target, Tensor) else None
            if ref is not None and ref() is target:
                kinds[self.leaves[id(target)]] = ("const", target)
        return from_outputs

    def stored(self, value) -> tuple:
        """The kind of a value the trace stored in a place: an output leaf it also returned is stored
        as the same tensor (``("leaf", position)``); a tuple, list or dict holding tensors (an RNN's
        ``self.hidden = (h, c)``) is made again around the kinds of its leaves (``("tree", ...)``)."""
        if isinstance(value, Tensor) and id(value) in self.leaves:
            return "leaf", self.leaves[id(value)]
        if _holds_traced(value):
            leaves, spec = torch_pytree.tree_flatten(value, _is_size)
            return "tree", (spec, [self.stored(leaf) for leaf in leaves])
        return self._kind(value)

    def _view_of_made(self, leaf) -> tuple | None:
        """``("view_of_made", (storage kind, stages, grad mode))`` for a tensor on a storage the trace made,
        laid out otherwise than a fresh array: a view of a tensor it made (``(a @ b)[:, 1:3]``,
        ``x.sum(0).expand(3, 4)``, ``(a * 2).view(torch.int16)[:, 1]``) or a tensor of its own re-laid in place
        (``q.t_()``, ``q.as_strided_(...)``). The program returns the storage's tensor once, and each call makes
        the leaf again from it, through its ``_base`` where it has one (`_made_stage`), with torch's strides,
        offset, dtype and ``_base``."""
        st, base = leaf._t2j_storage, leaf._base
        if not leaf._t2j_view or leaf.dtype is torch.complex32 or any(st is s for s in self.storages):
            return None
        if base is None or type(base) is not Tensor or base._t2j_storage is not st:
            if leaf.requires_grad or base is not None:  # (a tensor of its own with a history: an array)
                return None
            stages = [self._made_stage(None, leaf, detach=True)]
        elif not base._t2j_view:
            stages = [self._made_stage(None, leaf)]
        elif base.requires_grad or base._t2j_view != leaf._t2j_view[:len(base._t2j_view)]:
            return None
        else:  # (a view of a dtype view or of a re-laid tensor: that tensor first, then the view of it)
            stages = [self._made_stage(None, base, detach=True), self._made_stage(base, leaf)]
        if None in stages:
            return None
        if id(st) not in self.bases:  # (views of one storage share it: one output for it, maybe one returned)
            returned = [k for k, o in self.kept.items() if o._t2j_storage is st and not o._t2j_view]
            root = base if base is not None and not base._t2j_view else Tensor(st)
            self.bases[id(st)] = (("output", self.leaves[returned[0]]) if returned else self._kind(root), root)
        return "view_of_made", (self.bases[id(st)][0], stages, _grad_mode_of(leaf))

    @staticmethod
    def _made_stage(start, t, detach=False) -> tuple | None:
        """How `_output` makes ``t`` from ``start`` (None: the storage's tensor, `_view_of_made`):
        ``("strided", size, stride, offset, detach)`` where ``as_strided`` of the storage gives it,
        ``("replay", calls, detach)`` where its view ops, called again, do; None where neither does.
        ``detach``: ``t`` is not a view in autograd's sense (no ``_base``)."""
        steps = t._t2j_view[len(start._t2j_view):] if start is not None else t._t2j_view
        dtype = start.dtype if start is not None else _dt.to_torch(t._t2j_storage.array.dtype)
        if start is None and dtype == t.dtype and _tensor.strided_steps(steps):
            return "strided", tuple(t.shape), tuple(t.stride()), t.storage_offset(), detach
        calls = [step.call for step in steps]
        if all(c is not None and not any(isinstance(a, jax.Array) for a in jax.tree.leaves(c[1:3])) for c in calls):
            return "replay", calls, detach
        return None

    def _view_at_traced_position(self, leaf) -> tuple | None:
        """``("view_at", (slot, size, stride, offset output, grad mode))`` for a view of a slot's storage at
        a position the program takes (``cache[:, pos]``, ``cache[pos:pos + 2]``, ``pos`` a lifted number):
        the program also returns where the view starts (its first element's index in the storage, found
        by taking the view of the storage's indices), and each call takes the view of the slot's tensor
        there, so writes through it reach the state as in torch. Its strides do not depend on the position."""
        chain = leaf._t2j_view
        if not chain or not all(map(_tensor.moves_elements, chain)) or not any(s.traced_offset for s in chain) \
                or leaf.numel() == 0 or leaf.dtype is torch.complex32:
            return None
        st = leaf._t2j_storage
        slot = next((k for k, s in enumerate(self.slots.tensors)
                     if s is not None and s._t2j_storage is st and s.dtype == leaf.dtype), None)
        if slot is None:
            return None
        index = jax.numpy.arange(st.array.size, dtype=np.int32).reshape(st.array.shape)
        for step in chain:
            index = step.forward(index)
        self.arrays.append(index.reshape(-1)[0])
        return "view_at", (slot, tuple(leaf.shape), tuple(leaf.stride()), len(self.arrays) - 1, _grad_mode_of(leaf))

    def _kind(self, leaf) -> tuple:
        outs = self.arrays
        if not isinstance(leaf, Tensor):
            if _sym.is_traced_number(leaf):
                outs.append(jax.numpy.asarray(_sym.value_of(leaf)))
                return "number", len(outs) - 1
            if isinstance(leaf, jax.core.Tracer):  # a JAX value it computed (jnp of a jax.Array argument): one per call
                outs.append(leaf)
                return "jax", len(outs) - 1
            return "const", leaf
        if id(leaf) in self.arg_index:
            return "arg", self.arg_index[id(leaf)]
        if id(leaf) in self.lifted_index:  # (``return opt.param_groups[0]["lr"]``: the Python number it is)
            return "lifted", self.lifted_index[id(leaf)]
        if id(leaf) in self.after and id(lr := self.after[id(leaf)][1]) in self.lifted_index:
            return "lifted_after", self.lifted_index[id(lr)]  # (read after ``sched.step()``: after the stores)
        if id(leaf) in self.pre_index:
            return "pre", self.pre_index[id(leaf)]
        if (view := _view_of_slot(leaf, self.slots.tensors, self.storages)) is not None:
            return "view", view
        if (view := self._view_of_made(leaf)) is not None:
            return view
        if (view := self._view_at_traced_position(leaf)) is not None:
            return view
        if leaf.requires_grad and (leaf.is_floating_point() or leaf.is_complex()):
            self.grad_outs.append(len(outs))
            if leaf.grad_fn is not None:
                self.histories.append(len(outs))
                self.nodes.append(leaf.grad_fn)
                # (on the node's class: reading a freed node's saved result raises, after a backward inside)
                if hasattr(type(leaf.grad_fn), "_saved_result"):
                    self.saved_results.append(len(outs))
            else:
                self.made_leaves.append((len(outs), isinstance(leaf, torch.nn.Parameter)))
                if leaf.grad is not None:
                    self.grads_of_made_leaves.append((len(outs), leaf.grad))
        order = _dense_order(leaf)
        outs.append(leaf._value())
        k = len(outs) - 1
        if leaf.is_inference():
            self.inference.append(k)
        return ("array32", k) if leaf.dtype is torch.complex32 else ("array", k) if order is None \
            else ("laid_out", (k, order))


class _MadeObject:
    """An object the traced function made and returns that holds tensors (a dataclass of outputs,
    ``Result(loss, logits)``), as a node of the outputs' tree: its attributes are its children, so each
    call returns a new object holding that call's values, as the eager function does, not the one the
    trace made (`_made_objects_as_nodes`). ``index`` numbers the objects of one output tree: an object
    returned in several places (``return r, r``) is one object again after each call."""

    def __init__(self, obj, attrs: dict, index: int):
        self.obj, self.attrs, self.index = obj, attrs, index


# the objects made again so far while one call's outputs are unflattened, by index (`_rebuilt_outputs`)
_REBUILT = threading.local()


def _flatten_made_object(node):
    names = tuple(node.attrs)
    # the object without the values, copied again for every call (tensors of the trace are not kept)
    template = copy.copy(node.obj)
    template.__dict__.update(dict.fromkeys(names))
    return [node.attrs[n] for n in names], (template, names, node.index)


def _unflatten_made_object(values, context):
    template, names, index = context
    rebuilt = getattr(_REBUILT, "objects", None)
    if rebuilt is not None and index in rebuilt:
        return rebuilt[index]
    obj = copy.copy(template)
    obj.__dict__.update(zip(names, values))  # (also a frozen dataclass's fields: no __setattr__)
    if rebuilt is not None:
        rebuilt[index] = obj
    return obj


torch_pytree.register_pytree_node(_MadeObject, _flatten_made_object, _unflatten_made_object)


def _rebuilt_outputs(leaves, spec):
    """``tree_unflatten(leaves, spec)`` with each object the function returned in several places
    made once (`_MadeObject`)."""
    _REBUILT.objects = {}
    try:
        return torch_pytree.tree_unflatten(leaves, spec)
    finally:
        _REBUILT.objects = None


def _made_objects_as_nodes(out, known: set):
    """``out`` with each plain object in it that holds tensors or traced numbers, that the function made
    (its id not in ``known``: the arguments and the objects the state walk reached), a `_MadeObject`."""
    def holds_traced(value, within):
        return any(isinstance(x, torch.Tensor) or _sym.is_traced_number(x) or made(x, within)
                   for x in torch_pytree.tree_leaves(value, _is_size))

    def made(x, within=frozenset()):
        if id(x) in known or id(x) in within or isinstance(x, (torch.Tensor, torch.nn.Module, type)):
            return False  # (``within``: the objects it is looked for in, as objects can hold each other)
        return (not callable(x) and not isinstance(x, types.ModuleType) and type(getattr(x, "__dict__", None)) is dict
                and holds_traced(vars(x), within | {id(x)}))

    def nodes(value, within):
        return torch_pytree.tree_map(functools.partial(node, within=within), value, is_leaf=_is_size)

    seen = {}

    def node(x, within):
        if id(x) in seen:
            return seen[id(x)]
        if not made(x):
            return x
        if id(x) in within:  # (a graph break: its eager run returns the objects themselves)
            raise OpError(f"t2j.jit: the function returns {type(x).__name__} objects that hold each other; one "
                          "program returns a tree of values")
        seen[id(x)] = _MadeObject(x, {k: nodes(v, within | {id(x)}) for k, v in vars(x).items()}, len(seen))
        return seen[id(x)]

    return nodes(out, frozenset())


def _classification_order(out_leaves) -> tuple:
    """The output positions with the tensors that are not views first: a view returned before
    its base (``return t[:, :2], t``, ``return t.view(torch.int32)[1:], t``) is then found to be a
    view of that output, as when it comes after it."""
    def is_view(leaf):
        return isinstance(leaf, Tensor) and bool(leaf._t2j_view)

    return tuple(sorted(range(len(out_leaves)), key=lambda k: is_view(out_leaves[k])))


def _view_of(base, size, stride, offset, grad_mode):
    """The view of ``base`` an output is (`_view_of_slot`, ``"view_of_leaf"``), related to autograd
    as the traced output was (`_grad_mode_of`): with a history, made under no_grad, or detached."""
    if grad_mode is False and base.requires_grad:
        if (tuple(base.shape), base.stride(), base.storage_offset()) == (tuple(size), tuple(stride), offset):
            return base.detach()  # (``x.detach()``, ``x.data``: not a view in autograd's sense, no ``_base``)
        base = base.detach()
    with torch.set_grad_enabled(bool(grad_mode)):
        view = base.as_strided(size, stride, offset)
    if grad_mode is _MULTI_OUTPUT_VIEW:
        torch._C._autograd._set_creation_meta(view, _MULTI_OUTPUT_VIEW)
    return view


def _made_again(t, stages, grad_mode):
    """A ``"view_of_made"`` output (`_Outputs._view_of_made`) made from its storage's tensor ``t``."""
    for k, (how, *rest, detach) in enumerate(stages):
        mode = grad_mode if k == len(stages) - 1 else False
        if how == "strided":
            size, stride, offset = rest
            t = _view_of(t, size, stride, t.storage_offset() + offset, mode)
        else:
            t = _replayed(t, rest[0], mode)
        t = t.detach() if detach else t
    return t


def _stored_value(stored, result, arrays, slots, leaves):
    """The value a call stores in a place, of kind ``stored`` (`_Outputs.stored`)."""
    kind, v = stored
    if kind == "leaf":
        return result[v]
    if kind == "view_of_made" and v[0][0] == "output":  # (a view of a returned tensor)
        return _made_again(result[v[0][1]], *v[1:])
    if kind == "tree":
        spec, kinds = v
        return torch_pytree.tree_unflatten([_stored_value(k, result, arrays, slots, leaves) for k in kinds], spec)
    return _output(kind, v, arrays, slots, leaves)


def _holds_traced(value) -> bool:
    """Whether ``value`` is a tuple, list or dict with a tensor or a traced number among its leaves."""
    return any(isinstance(x, torch.Tensor) or _sym.is_traced_number(x) for x in _container_leaves(value))


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _program_output(a):
    """A program's output array as a tensor, but a typed PRNG key (returned by JAX code the function calls),
    which no torch dtype holds."""
    return a if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended) else new_tensor(a)


def _output(kind, v, arrays, slots, leaves):
    """One output of a call, of kind ``kind`` (`_Outputs`), from the program's ``arrays``."""
    if kind == "array":
        return arrays[v]
    if kind == "number":  # a traced Python number (``x.sum().item()``) comes back as one
        return arrays[v].item()
    if kind == "jax":  # (a typed PRNG key is no tensor: `_program_output`)
        return arrays[v]._value() if isinstance(arrays[v], Tensor) else arrays[v]
    if kind == "array32":  # held as complex64 (torch2jax/complex32.py)
        return _complex32.retag(arrays[v])
    if kind == "laid_out":
        return _laid_out_as(arrays[v[0]], v[1])
    if kind == "view":
        if v[0] == "replay":
            return _replayed(slots.tensors[v[1][0]], *v[1][1:])
        return _view_of(slots.tensors[v[0]], *v[1:])
    if kind == "view_at":
        slot, size, stride, where, grad_mode = v
        return _view_of(slots.tensors[slot], size, stride, int(arrays[where].item()), grad_mode)
    if kind == "pre":
        return slots.tensors[v]
    if kind == "arg":
        return leaves[v]
    if kind in ("lifted", "lifted_after"):
        return slots.lifted[v].current()
    if kind == "view_of_made":  # (a base output as an array is one tensor per call: its views share it)
        (base_kind, base_v), stages, grad_mode = v
        return _made_again(_output(base_kind, base_v, arrays, slots, leaves), stages, grad_mode)
    return v


class _Capture:
    """Watches a trace: storages created, and tensors read that are not inputs."""

    def __init__(self, inputs):
        self.inputs = {id(st) for st in inputs}
        self.new = weakref.WeakSet()
        self.first = {}  # id of a storage created -> its first array
        self.unknown = {}
        # (storage, array) of each unknown storage as it was before the trace: an in-place write
        # to one stores a tracer in it, which `restore` takes out again
        self.originals = {}

    def created(self, storage):
        self.new.add(storage)
        self.first[id(storage)] = storage.array

    def read(self, t):
        st = t._t2j_storage
        if id(st) in self.inputs or isinstance(st.array, jax.core.Tracer) or st in self.new:
            return
        self.unknown[id(st)] = t
        self.originals.setdefault(id(st), (st, st.array))

    def restore(self):
        for st, a in self.originals.values():
            if st.array is not a:
                st.array = a
                st.version += 1


class _KeepViews(Exception):
    """A trace wrote an argument `JitFunction._view_copies` had copied, or returned or kept it: trace
    again with the views themselves."""


def _copies_escape(info, copies, storages, slots, leaves) -> bool:
    """Whether a trace wrote one of the ``copies`` (ids of storages) or returned or stored one (or a
    view of one)."""
    if any(id(storages[i]) in copies for i in info["written"]):
        return True

    def escapes(kind, v):
        if kind == "tree":
            return any(escapes(*k) for k in v[1])
        if kind == "arg":
            return id(leaves[v]._t2j_storage) in copies
        return kind == "view" and id(slots.tensors[v[1][0] if v[0] == "replay" else v[0]]._t2j_storage) in copies

    return any(escapes(*k) for k in info["out_leaves"]) or any(escapes(*k) for _, k in info["stores"])


class _Retrace(Exception):
    """A trace read tensors it was not given (``found``); trace again with them as inputs."""

    def __init__(self, found):
        self.found = found


class _MoreRoots(Exception):
    """A trace stepped optimizers the walk from the function did not reach (held deeper in
    objects than `_Roots` looks): trace again with them as roots."""

    def __init__(self, found):
        self.found = found


@contextlib.contextmanager
def _unreached_optimizers(roots):
    """While a trace runs: an ``opt.step()`` of an optimizer on the jax device that is not among
    ``roots`` raises `_MoreRoots` (its state would not be carried: the program would update
    tensors it does not write back). Optimizers the function creates are its own."""
    known = {id(o) for o in roots.optimizers}
    created = weakref.WeakSet()
    init = torch.optim.Optimizer.__init__

    def creating(self, *args, **kwargs):
        created.add(self)
        init(self, *args, **kwargs)

    def check(opt, args, kwargs):
        if id(opt) not in known and opt not in created and _optimizer_on_jax(opt):
            raise _MoreRoots([opt])

    torch.optim.Optimizer.__init__ = creating
    handle = register_optimizer_step_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()
        torch.optim.Optimizer.__init__ = init


class _CheckFailed(Exception):
    """A check the program makes at run time failed (`symbolic._VALIDATIONS`); ``error`` is torch's."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


class _LiftNumbers(Exception):
    """A trace changed Python numbers it read as constants (``self.step += 1``): trace again
    with them as program inputs (`_Hyperparameters`), whose new values are outputs."""

    def __init__(self, ids):
        self.ids = ids


class _MoreDraws(Exception):
    """A trace drew ``count`` times from explicit torch.Generators, not the number of seed
    rows it was given; trace again with that many (`torch2jax.env.GeneratorDraws`)."""

    def __init__(self, count):
        self.count = count


@dataclasses.dataclass
class _Entry:
    """One compiled specialization of a jitted function."""

    jitted: object  # the jitted program
    arguments: object  # (state arrays, learning rates, keys) -> the program's arguments
    written: list  # input storage indices whose new value is an output
    new_storages: list  # storages created by the trace whose value is an output
    # (setter, slot index | tensor | None, slot index | None, argument slot | None): slots to re-point
    # after a call; the last, for an argument's .grad, is the slot of the argument, found again on each call
    post: list
    out_def: object  # torch pytree spec of the outputs
    # per output leaf: ("array" | "array32" | "number", k) | ("laid_out", (k, order)) | ("pre", slot)
    # | ("lifted", i) | ("arg", k) | ("view", `_view_of_slot`) | ("view_of_leaf", ...) | ("view_of_made", ...)
    # | ("const", value)
    out_leaves: list
    # (setter, output kind | ("leaf", position)) per place the trace stored a tensor in (`_Places`),
    # stored again after every call
    stores: list
    uses_rng: bool
    names: list  # slot names, to explain a later cache miss
    trace_s: float
    guards: list  # what the trace assumed of lifted hyperparameters (see symbolic.TracedScalar)
    # (inputs, lrs, keys) -> (outs, written, new, key): the traced function, not jitted; ``keys`` is
    # (the default generator's key, the key data of the draws from explicit generators or None): `_keys`
    program: object
    grad_outs: list  # indices into the program's outputs that require grad
    diff: list  # (storage index, slot index) per storage whose slot tensor requires grad; [] if not differentiable
    # (position in `written`, slot index) per non-leaf slot tensor written with grad mode on: its new value
    # is an output of the call's autograd node, copied into it so that the node is its history (as torch's
    # in-place op rebases it)
    rebased: list = dataclasses.field(default_factory=list)
    compile_s: float = 0.0
    differentiable: object = None  # the `_Differentiable` programs, made on first use
    keeps_avals: bool = False  # every state array it writes has the shape and dtype it had
    # until its first run succeeds, the slots point to the tensors the trace made; a failing
    # first run (a check at run time) puts back what they pointed to (see `_snapshot`)
    undo: object = None
    draws: tuple = ()  # per draw from an explicit torch.Generator: its `torch2jax.env.GeneratorDraws` source
    reseeded: tuple = ()  # (source, state) per generator re-seeded inside the function: its state after a call
    # (storage index, sharding) per sharded state array the program keeps in the sharding it had: a call
    # whose array has another (resharded since) needs a program of its own
    shardings: tuple = ()
    # (storage index, `hints.Slice`) per host-valued state array it writes as a function of such state
    # alone (a counter's ``n += 1``): its new host value is computed after a call without reading it
    mirrors: tuple = ()
    # outputs whose graph the function consumed (it ran backward): they come back requiring grad, with
    # a node that refuses a second backward, as torch's outputs do after backward() (`_SpentGraph`)
    spent: tuple = ()
    # {index into ``post``: `_Outputs.stored` kind} for the slots each call points to one of its outputs
    # (`_Outputs.repointed`): set by `_run` once the outputs are made, not by `_execute`
    post_outputs: dict = dataclasses.field(default_factory=dict)
    inference: frozenset = frozenset()  # outputs (indices among the program's) made under inference_mode
    # (index, whether an nn.Parameter) per output that is a leaf the function made requiring grad
    # (``torch.zeros(n).requires_grad_()``, ``nn.Parameter(...)``): each call returns a new leaf of that kind
    made_leaves: tuple = ()
    # (index, `_Outputs.stored` kind) per such leaf a backward inside gave a .grad: each call's leaf gets its own
    leaf_grads: tuple = ()
    out_order: tuple = ()  # the order in which a call makes its output leaves (`_classification_order`)
    argument_flags: tuple = ()  # (slot, requires_grad) per argument or state tensor whose flag the function sets
    reaches: tuple = ()  # per differentiable output (grad_outs, then rebased): the inputs it depends on, a bit set
    # indices into ``post`` of the tensors the trace made and put in a slot that a call may replace by new
    # ones (`_renewable`), and of those, the ones it returns (always replaced before the next call)
    renewable: tuple = ()
    returned: frozenset = frozenset()
    # (path, layout, `_Outputs.stored` kinds) per list or dict among the arguments the function changes: each
    # call changes the caller's so (`_argument_changes`)
    arg_changes: tuple = ()
    # (output path, argument path) per list or dict among the arguments that the function returns: the
    # caller's own, as in torch (`_returned_containers`)
    returned_args: tuple = ()
    grad_mode: bool | None = None  # the grad mode the function leaves set (``torch.set_grad_enabled(False)``)
    # whether the graph of its one differentiable output saved tensors for its backward (a second backward
    # without retain_graph then raises), and whether its op saved it (an in-place write to it then makes
    # the backward raise), as in torch (`_DifferentiableCall`)
    saves: bool = False
    saved_slots: tuple = ()  # the slots whose tensors torch's graph of the trace saved and it does not write
    saved_results: tuple = ()
    # torch's error for a tensor its graph saved that the function then wrote in place (`_graph_saves`): raised
    # by a backward through the call, as torch's backward raises it
    stale: str | None = None
    lengths: tuple = ()  # lists whose lengths the trace depends on (`JitFunction._lengths`)
    # whether a call leaves state its own walk did not find (a first ``.grad``, an optimizer's first state,
    # `_creates_state`): the next call has another cache key
    creates_state: bool = False
    # whether its first run compiles the program for one run only (`JitFunction._first_entry`)
    once: bool = False
    # lists of plain values whose items each call changes (`_Places.take_rewritten`): their items are not guarded
    own_lists: tuple = ()
    owners: tuple = ()  # the `_owners` of the roots it was traced for
    # (slot index, id) per leaf tensor of the state that requires grad (a parameter): its ``.grad`` and optimizer
    # state are stored into that very tensor (`_owned`)
    owned: tuple = ()
    used: int = 0  # when a call last ran it (`_USES`): the least recently used objects' programs go first

    def owned_by(self, roots, slots) -> bool:
        """Whether this program was traced for the objects of this call (`_owners`, `_owned`)."""
        tensors = slots.tensors
        return self.owners == roots.owners and all(id(tensors[i]) == o for i, o in self.owned)


# What stops a trace but not an eager run: an op whose output shape depends on tensor
# values (nonzero, boolean masks, unique), Python control flow on a tensor's value,
# a tensor copied to the CPU. A function that hits one runs eagerly, as a graph break
# makes torch.compile do (unless fullgraph=True).
_GRAPH_BREAKS = (OpError, jax.errors.JAXTypeError, jax.errors.JAXIndexError)


def _leaked(fn) -> JitError:
    """The error for a trace that used a tracer of an earlier one."""
    return JitError(
        f"t2j.jit: {getattr(fn, '__qualname__', fn)} used a value traced by an earlier trace: something computed "
        "inside a jitted function was kept outside it (in a global, an attribute, a list), often a `t.item()`, "
        "which is a traced number under t2j.jit, as in `total += loss.item()`. Return it from the function and "
        "read it after the call: `loss = step(...); total += loss.item()`"
    )


# Sets of objects (`_Entry.owners`) a function keeps programs for, per signature (`JitFunction._evicted`)
_OWNERS_KEPT = 4
_USES = itertools.count(1)

# Traces caused by new values of the Python numbers a function reads (or calls in a row that each traced
# again, for any reason) before t2j.jit warns of them
_VALUE_RETRACES_BEFORE_WARNING = 8

# Traces in a row that stop at a value-dependent op before a function's new keys run eagerly untraced
_BREAKS_BEFORE_EAGER = 4


@dataclasses.dataclass
class _Eager:
    """A cache key whose calls run the function eagerly, and why."""

    key: object
    reason: str
    # the trace raised an error of the function's own (not a graph break): this call runs eagerly to
    # raise it as torch does, part-way through with the effects of the ops before it
    raised: bool = False


def _target_sharding(target) -> jax.sharding.Sharding:
    if isinstance(target, jax.sharding.Sharding):
        return target
    if isinstance(target, jax.Device):
        return jax.sharding.SingleDeviceSharding(target)
    raise JitError(f"t2j.jit: lower_for expects a jax.Device or jax.sharding.Sharding as its target, got "
                   f"{type(target).__name__}")


def _abstract_on(sharding, x):
    # Python scalars (learning rates) stay values: they are weakly typed and have no device
    if not isinstance(x, jax.Array):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


class JitFunction:
    """A torch function compiled by `jit`. Call it like the function itself."""

    def __init__(self, fn, donate: bool = True, fullgraph: bool = False):
        self.fn = fn
        self.donate = donate
        self.fullgraph = fullgraph
        self._eager: dict = {}  # cache key -> why its calls run eagerly (the trace hit a value-dependent op)
        self._warned = False
        self._cache: dict = {}  # key -> the entries traced for it, which differ only in their guards
        self._extra: list = []  # weakrefs to storages read but not found as slots
        self._found_roots: list = []  # weakrefs to optimizers a trace stepped that the walk missed
        self._roots_memo: list = []  # the last call's _RootState
        # argument views passed to the program as values of their own (`_view_copies`); False once a trace
        # wrote one or returned it
        self._copy_views = True
        self._copies: list = []  # the storages of this call's copies
        self._hypers = _Hyperparameters()
        self._breaks = 0  # traces in a row that stopped at a value-dependent op
        self._draws = 0  # seed rows the last trace took from explicit torch.Generators: the next one's first guess
        self._value_retraces = 0  # traces caused by a new value of a Python number it reads
        self._retraces_in_a_row = 0  # calls in a row that traced again (`_explain`)
        self._unguarded = frozenset()  # Python values its traces change (`_Roots.unguarded`)
        self._lists_read = frozenset()  # the lists held by modules its traces read (`_Roots.lists_read`)
        # positions of the CPU tensor arguments the trace needs the values of (`_value_arguments`), once
        # a trace with them on the device stopped; None until then
        self._by_value = None
        self._from_cpu: list = []  # this call's CPU tensor arguments and their copies (`_device_leaves`)
        # (entry, reference counts) of the tensors the last call put in slots that may have escaped (`_renew_escaped`)
        self._escapes = None
        # the lists whose lengths its traces depended on (``if len(hist) > k: hist.pop(0)``): part of the key
        self._lengths: list = []
        self._own_lists: dict = {}  # id -> a list of plain values its traces change (`_Entry.own_lists`)
        self._hooks_seen = None  # (hook changes, root state, slots, `_hooks_key` of the state) when last read
        # whether its traces read or write ``.grad`` (or run backward): until one does, the gradients are no
        # slots, so that a gradient a backward outside creates or drops keeps the program (`_watching_grads`)
        self._sees_grads = False
        self.stats = {"traces": 0, "compiles": 0, "hits": 0, "calls": 0, "eager_calls": 0}
        functools.update_wrapper(self, fn)

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)

    # -- the call ---------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if not _trace_state_clean():
            # called while a program is traced (by another jitted function, a scan body, a jax.jit):
            # its ops are that program's, as torch.compile inlines a compiled function it reaches
            return self.fn(*args, **kwargs)
        self.stats["calls"] += 1
        _pytree.register_argument_nodes((args, kwargs))
        if self._escapes is not None:
            _renew_escaped(*self._escapes)
            self._escapes = None
        if torch._C._functorch.maybe_current_level() is not None or _dual_arguments(args, kwargs):
            return self._run_under_transform(args, kwargs)
        entry, leaves, slots, storages = self._lookup(args, kwargs)
        from_cpu = self._from_cpu
        if isinstance(entry, _Eager):
            out = self._run_eagerly(entry, leaves, args, kwargs)
        else:
            if entry.grad_mode is not None:  # (its outputs are made in the mode it set)
                torch._C._set_grad_enabled(entry.grad_mode)
            try:
                out = self._run(entry, leaves, slots, storages, (args, kwargs))
            except _CheckFailed as failed:
                if self.fullgraph:  # (the state as it was: nothing of the call took effect)
                    raise failed.error from None
                # torch raises where the check is, after the ops before it (a backward's gradients stay):
                # the call runs eagerly from the state the program left as it was, and raises there
                args, kwargs = torch_pytree.tree_unflatten(leaves, torch_pytree.tree_structure((args, kwargs),
                                                                                               _is_size))
                out = self.fn(*args, **kwargs)
                warnings.warn(f"t2j.jit: a check inside the program failed ({failed.error}), but the eager run of "
                              "the call did not raise", stacklevel=2)
        del leaves, slots, storages  # (they hold the slots' tensors: not counted as references kept)
        if from_cpu:
            _write_back_to_cpu(from_cpu)
        if isinstance(entry, _Entry) and entry.renewable:
            self._escapes = entry, _reference_counts(entry)
        return out

    def _run_under_transform(self, args, kwargs):
        """The function called under a torch.func transform (grad, vmap, jvp) or with forward-mode
        dual tensors: run eagerly, its ops under the transform, whose tensors (the arguments, and
        the parameters functional_call swaps in) one program cannot take; fullgraph=True raises
        instead."""
        if self.fullgraph:
            raise JitError(
                "t2j.jit: a jitted function cannot run as one program under torch.func transforms (grad, vmap, "
                "jvp, jacrev, hessian) or on forward-mode dual tensors: apply the transform inside the jitted "
                "function (t2j.jit(torch.func.grad(f)))"
            )
        self.stats["eager_calls"] += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"t2j.jit: {getattr(self.fn, '__qualname__', self.fn)} runs eagerly, op by op, under a torch.func "
                "transform; apply the transform inside the jitted function (t2j.jit(torch.func.grad(f))) for one "
                "program", stacklevel=3)
        return self.fn(*args, **kwargs)

    def _run_eagerly(self, eager, leaves, args, kwargs):
        """Run the function op by op for a cache key whose trace stopped. Where the trace raised the
        function's own error, the eager run raises it (after the ops before it, as in torch); if
        it does not, the error was the trace's, and the key runs eagerly from now on."""
        self.stats["eager_calls"] += 1
        given, spec = torch_pytree.tree_flatten((args, kwargs), _is_size)
        if any(a is not b for a, b in zip(given, leaves)):  # (CPU tensors moved to the device)
            args, kwargs = torch_pytree.tree_unflatten(leaves, spec)
        out = self.fn(*args, **kwargs)
        if eager.raised:
            # (a trace that fails where torch does not: a torch2jax limitation or bug, worth reporting)
            msg = (f"t2j.jit: {getattr(self.fn, '__qualname__', self.fn)} runs eagerly for these arguments: its "
                   f"trace raised {eager.reason}, which the eager run does not (please report this to torch2jax)")
            _RECOMPILES.append(msg)
            log.info(msg)
            warnings.warn(msg, stacklevel=3)
            self._warned = True
        self._eager[eager.key] = eager.reason
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"t2j.jit: {getattr(self.fn, '__qualname__', self.fn)} runs eagerly, op by op, for these arguments: "
                f"its trace stopped at {eager.reason} (see t2j.explain_recompiles()). Pass fullgraph=True to "
                "t2j.jit to raise instead.", stacklevel=3)
        return out

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The XLA program a call with these arguments runs (traced if needed, not run):
        ``.as_text()`` for its StableHLO, ``.compile().memory_analysis()`` for its memory.

        >>> step.lower(x, y).compile().memory_analysis().temp_size_in_bytes
        """
        return self._lower(None, args, kwargs)

    def _lower(self, target, args, kwargs) -> jax.stages.Lowered:
        _pytree.register_argument_nodes((args, kwargs))
        leaves = [_to_device(x) for x in torch_pytree.tree_leaves((args, kwargs))]
        roots = _find_roots(self.fn, args, kwargs)
        before = _snapshot(_collect(leaves, roots, full=True), roots)
        try:
            entry, _, slots, storages = self._lookup(args, kwargs)
        finally:
            _restore(before)  # nothing runs: state the trace created must not be left behind
        if isinstance(entry, _Eager):
            raise JitError(f"t2j.jit: there is no program to lower: the trace stopped at {entry.reason}")
        arguments = entry.arguments([st.array for st in storages], _hyper_values(slots), _keys(entry, (), draw=False))
        if target is not None:
            arguments = jax.tree.map(functools.partial(_abstract_on, _target_sharding(target)), arguments)
        with jax.enable_x64(True):
            return entry.jitted.lower(*arguments)

    def lower_for(self, target, *args, **kwargs) -> jax.stages.Lowered:
        """As :meth:`lower`, for another device: every array the program takes (state, arguments, RNG key)
        is placed on ``target`` (a ``jax.Device`` or ``jax.sharding.Sharding``) as an abstract value, so
        nothing is copied and the device need not be attached. With ``jax.experimental.topologies``
        this compiles a torch training step for a TPU from a CPU-only machine, e.g. to read its memory:

        >>> from jax.experimental import topologies
        >>> tpu = topologies.get_topology_desc("v5e:2x2", platform="tpu").devices[0]  # needs libtpu
        >>> step.lower_for(tpu, x, y).compile().memory_analysis().temp_size_in_bytes
        """
        return self._lower(target, args, kwargs)

    def _lookup(self, args, kwargs):
        given, spec = torch_pytree.tree_flatten((args, kwargs), _is_size)
        if self._by_value is None and (packed := _packed_batch_sizes(given, args, kwargs)):
            self._by_value = packed  # (torch wants a PackedSequence's batch sizes on the CPU)
        plain = self._device_leaves(given)
        roots = _find_roots(self.fn, args, kwargs, self._lists_read)
        for found in self._found_roots:
            roots.add(found)
        roots.unguarded, roots.own_lists, roots.lifts = self._unguarded, self._own_lists, self._hypers
        roots.grads = self._carries_grads(roots)
        if self._copy_views and not self._roots_memo:
            # the first call: the state `_view_copies` keeps out of its copies, found now, so that the first
            # call's view arguments are copies as every later call's are (one program, not two)
            _collect(plain, roots, memo=self._roots_memo, hypers=self._hypers)
        leaves = self._view_copies(plain)
        retried = ()
        for _ in range(8):
            roots.grads = self._carries_grads(roots)
            slots = _collect(leaves, roots, memo=self._roots_memo, hypers=self._hypers)
            numbers = self._number_arguments(leaves)
            if numbers:  # (a new list: the roots' part may be the last call's, kept)
                slots.lifted = slots.lifted + [site for site, _ in numbers]
            extra = [s for s in (r() for r in self._extra) if s is not None]
            extra = [s for s in extra if not any(s is st for st in slots.storages)]
            storages = slots.storages + extra
            # (which arguments are copies: a copy laid out as its view has the view's signature, but
            # a program traced with the view itself writes through it)
            copied = tuple(i for i, (p, x) in enumerate(zip(plain, leaves)) if p is not x)
            key = (spec, _static_key(leaves, numbers, self._by_value), slots.key, tuple(id(s) for s in extra),
                   tuple((tuple(s.array.shape), s.array.dtype) for s in extra), copied, _config(),
                   torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("jax"),
                   torch.get_autocast_dtype("jax"),
                   torch.get_default_dtype(),
                   self._hooks_key(slots, roots), tuple(map(len, self._lengths)))
            if key in self._eager:
                return _Eager(key, self._eager[key]), plain, slots, storages
            entries = [e for e in self._cache.get(key, ()) if e.owned_by(roots, slots)]
            entry = _guarded(entries, slots, storages)
            if entry is not None:
                entry.used = next(_USES)
                self._retraces_in_a_row = 0
                self.stats["hits"] += 1
                _debug.count("cache_hits")
                return entry, leaves, slots, storages
            lifted_ids = [*_key_parts(key[2])[3], *(where for _, where in numbers)]
            if exact := _exact_guards(entries, slots, lifted_ids):
                # a trace used the exact value of these numbers (float(beta)): as inputs they gain nothing
                self._hypers.block(exact)
                self._log(f"the trace needs the exact value of {sorted(map(str, exact))}: static from now on")
                continue
            if self._breaks >= _BREAKS_BEFORE_EAGER:
                # every new key stopped the trace (LBFGS's growing history): no more attempts
                return _Eager(key, self._last_break), plain, slots, storages
            slots = _collect(leaves, roots, full=True, hypers=self._hypers)
            slots.lifted = slots.lifted + [site for site, _ in numbers]
            if key in self._cache and not entries:
                self._log("the modules, optimizers, parameters or objects it reaches are others than when it was "
                          "traced, however alike: a program stores its results into the ones it was traced for")
            elif not entries:
                self._explain(key, slots)
            elif not all(_shardings_hold(e, storages) for e in entries):
                self._log("state it writes was resharded since it was traced (its program keeps each array's "
                          "sharding)")
            else:
                self._log("a branch it took on a hyperparameter (`if momentum != 0`) or on a counter or flag it "
                          "carries (`if self.n_averaged == 0`) goes the other way with the new values")
            new = [h for h in lifted_ids if not _is_lr_id(h) and h not in self._hypers.proven]
            values = dict(roots.python_values(raw=True))
            try:
                entry = self._trace(leaves, spec, roots, slots, storages)
            except _LiftNumbers as n:
                self._hypers.lifted.update(n.ids)
                self._log(f"it changes the Python number(s) {[_lifted_name(h) for h in n.ids]}: now program inputs, "
                          "their new values outputs stored back after every call")
                continue
            except _MoreRoots as r:
                self._found_roots.extend(weakref.ref(o) for o in r.found)
                for o in r.found:
                    roots.add(o)
                self._log(f"it steps {len(r.found)} optimizer(s) found only while tracing (held deeper in objects "
                          "than the walk from the function looks): now carried too")
                continue
            except _ReadsLists as r:
                self._lists_read = roots.lists_read = self._lists_read | r.found
                for sub, name in [place for place in roots.lists_unread if (id(place[0]), place[1]) in r.found]:
                    roots.lists_unread.remove((sub, name))
                    roots.add(sub.__dict__.get(name), 1)
                self._log(f"it reads {len(r.found)} list(s) its modules hold (as attributes): now carried and guarded")
                continue
            except _SeesGrads:
                self._sees_grads = True
                self._log("it reads or writes a .grad, or runs a backward pass: the gradients are now part of the "
                          "state it carries")
                continue
            except _KeepViews:
                self._copy_views = False
                leaves = plain
                self._log("it writes an argument that is a view, or returns or keeps it: such arguments are the "
                          "views themselves from now on, their storage offsets part of the cache key")
                continue
            except _Retrace as r:
                self._extra.extend(weakref.ref(s) for s in r.found)
                msg = (f"t2j.jit: retracing {getattr(self.fn, '__qualname__', self.fn)}: it read {len(r.found)} "
                       "tensor(s) it does not receive and that belong to no module or optimizer it can see; they are "
                       "now inputs of the program")
                _RECOMPILES.append(msg)
                log.info(msg)
                continue
            except jax.errors.UnexpectedTracerError as e:
                raise _leaked(self.fn) from e
            except Exception as e:
                if isinstance(e, DeviceMismatchError) and (cpu := _cpu_modules(roots)):
                    raise JitError(
                        f"t2j.jit: {getattr(self.fn, '__qualname__', self.fn)} uses {cpu}, whose parameters or "
                        "buffers are on the CPU, with tensors on the jax device (t2j.jit moves CPU arguments there): "
                        "move the module first, module.to('jax')") from e
                if not new:
                    if (stop := _size_from_values(e)) is not e:
                        e = stop
                        if self.fullgraph:
                            raise stop from None
                    if self.fullgraph or isinstance(e, JitError):
                        raise
                    if not isinstance(e, _GRAPH_BREAKS):
                        return _Eager(key, f"{type(e).__name__}: {e}", raised=True), plain, slots, storages
                    if self._by_value is None and (values := _value_arguments(given)):
                        self._by_value = retried = values
                        self._log(f"the trace stopped at {type(e).__name__}: {e}; the integer CPU argument(s) "
                                  f"{sorted(values)} stay on the CPU, their values constants of the program (each "
                                  "new value traces again)")
                        plain = self._device_leaves(given)
                        leaves = self._view_copies(plain)
                        continue
                    if retried:  # their values did not help: on the device, as before, also for the eager run
                        self._by_value = frozenset()
                        plain = self._device_leaves(given)
                    reason = f"{type(e).__name__}: {e}"
                    self._breaks += 1
                    self._last_break = reason
                    msg = (f"t2j.jit: {getattr(self.fn, '__qualname__', self.fn)} runs eagerly for these arguments: "
                           f"the trace stopped at {reason}")
                    if self._breaks == _BREAKS_BEFORE_EAGER:
                        msg += (f"; after {_BREAKS_BEFORE_EAGER} such traces in a row, arguments or state it has "
                                "not compiled for run eagerly without a trace")
                    _RECOMPILES.append(msg)
                    log.info(msg)
                    return _Eager(key, reason), plain, slots, storages
                # torch needed a real number for it (a size, a Scalar-only argument): keep it static
                self._hypers.block(new)
                self._log(f"the number(s) {[_lifted_name(h) for h in new]} cannot be program inputs "
                          f"({type(e).__name__}: {e}); they stay static, and each new value retraces")
                continue
            self._hypers.proven.update(new)
            entry.owners, entry.owned = roots.owners, _owned(slots, entry.post)
            if found := [c for c in entry.lengths if not any(c is k for k in self._lengths)]:
                self._lengths += found  # (the trace left the lists as it found them)
                key = (*key[:-1], tuple(map(len, self._lengths)))
            after = dict(roots.python_values(raw=True))
            changed = {w for w in values.keys() | after.keys() if values.get(w, _MISSING) != after.get(w, _MISSING)
                       and not _is_flag_change(values.get(w), after.get(w))
                       and not _is_number(values.get(w)) and not _is_number(after.get(w))}
            if found := [c for c in entry.own_lists if id(c) not in self._own_lists]:
                self._own_lists.update((id(c), c) for c in found)
                key = _unguarding(key, {w for c in found for i in range(32)
                                        if ("value", w := _list_item(c, i)) not in self._hypers.lifted})
            if changed:  # the trace's own bookkeeping (warned of by _check_python_state): a cached call skips it
                self._unguarded = roots.unguarded = self._unguarded | changed
                key = _unguarding(key, changed)
            if not self._cache:
                self._first_entry(entry)
            entry.used = next(_USES)
            self._cache[key] = self._evicted(self._cache.get(key, [])) + [entry]
            self._breaks = 0
            return entry, leaves, slots, storages
        raise JitError("t2j.jit: the function keeps reading new tensors it does not receive; pass them as arguments")

    def _evicted(self, entries):
        """``entries`` of one cache key, less those of the least recently used objects where they were traced
        for more than `_OWNERS_KEPT` - 1 others: a program holds the parameters and optimizer state it
        stores into, so a sweep making a new model and optimizer for every trial would keep every trial's."""
        groups = {}
        for e in entries:
            groups.setdefault((e.owners, e.owned), []).append(e)
        if len(groups) < _OWNERS_KEPT:
            return entries
        oldest = min(groups, key=lambda g: max(e.used for e in groups[g]))
        log.info(f"t2j.jit: {getattr(self.fn, '__qualname__', self.fn)}: dropped the programs of the objects it was "
                 f"least recently called for (it keeps those of {_OWNERS_KEPT} sets of objects per signature)")
        return [e for e in entries if (e.owners, e.owned) != oldest]

    def _carries_grads(self, roots) -> bool:
        """Whether a call's state holds the ``.grad`` of its parameters and arguments: where a trace read or
        wrote one, or the function steps an optimizer or names gradients in its code (`_watching_grads`)."""
        return self._sees_grads or bool(roots.optimizers) or not _GRAD_NAMES.isdisjoint(roots.names)

    @staticmethod
    def _first_entry(entry):
        """A function's first trace that creates state (a training step's first call: no ``.grad`` and
        no optimizer state yet) is likely run once: its next call finds that state, has another key
        and compiles the program every later call runs. Its program is compiled for that one run, at
        the backend's lowest optimization level: a GPT step's first call 7-25% sooner on the CPU
        (benchmarks/first_calls.py). Running it op by op, or the function eagerly, took longer than
        compiling it."""
        entry.once = entry.creates_state and not entry.diff

    def _hooks_key(self, slots, roots) -> tuple:
        """The hooks on the tensors of the call's slots (``w.register_hook``, a post-accumulate-grad hook) and on
        the optimizers it steps, and the global optimizer hooks, by their handles' ids (never reused): a hook
        added or removed is another program. Those of the state are read again only after a hook was
        registered or removed somewhere, or the state's tensors changed."""
        state = self._roots_memo[0] if self._roots_memo else None
        seen = self._hooks_seen
        if seen is None or seen[0] != _HOOK_CHANGES[0] or seen[1] is not state or seen[2] != len(slots.tensors):
            tensors = slots.tensors[:slots.first_argument]
            hooks = (_tensor_hooks(tensors),
                     tuple((tuple(getattr(o, "_optimizer_step_pre_hooks", ())),
                            tuple(getattr(o, "_optimizer_step_post_hooks", ()))) for o in roots.optimizers),
                     tuple(_optimizer._global_optimizer_pre_hooks), tuple(_optimizer._global_optimizer_post_hooks))
            seen = self._hooks_seen = (_HOOK_CHANGES[0], state, len(slots.tensors), hooks)
        return seen[3], _tensor_hooks(slots.tensors[slots.first_argument:])

    def _device_leaves(self, given) -> list:
        """The argument leaves the trace sees: tensors on the jax device, but for the CPU tensors
        whose values it needs (`_value_arguments`)."""
        by_value = self._by_value or ()
        out = [x if i in by_value else _to_device(x) for i, x in enumerate(given)]
        # (CPU tensor, its copy on the device, the copy's array): a write to the copy is copied back
        self._from_cpu = [(x, y, y._t2j_storage.array) for x, y in zip(given, out) if y is not x]
        return out

    def _view_copies(self, leaves) -> list:
        """``leaves`` with each tensor argument that is a view (``data[:, i:i + k]``, a minibatch
        sliced from a dataset on the device) replaced by a copy of its values (in its memory
        order), where the function only reads it: the program then takes the slice as an array
        of its own, and one program serves every offset, where the view's offset would key a
        trace of its own. A view that requires grad (``step(xs[i])``, ``xs`` a leaf) is cloned
        by torch, so that its gradient reaches ``xs`` through the clone and the view. Not for
        views of a storage that other state or a whole argument holds (the function could write
        it); a trace that writes a copy, returns it or keeps it raises `_KeepViews`, after which
        every call passes the views themselves."""
        self._copies = []
        if not self._copy_views or not self._roots_memo:  # (the first call's state is not known yet)
            return leaves
        state = self._roots_memo[0].index
        whole = {id(x._t2j_storage) for x in leaves if type(x) is Tensor and not x._t2j_view}
        out = None
        for i, x in enumerate(leaves):
            if type(x) is Tensor and x._t2j_view and id(x._t2j_storage) not in state \
                    and id(x._t2j_storage) not in whole:
                if out is None:
                    out = list(leaves)
                if x.requires_grad:
                    out[i] = x.clone(memory_format=torch.preserve_format)
                    self._copies.append(out[i]._t2j_storage)
                    continue
                copy = new_tensor(x._value())
                # a dense view in another order (channels_last, a transpose) keeps its strides: the
                # function may branch on them, and its results have that layout
                order = _dense_order(x) if _prims_common.is_non_overlapping_and_dense_or_false(x) else None
                out[i] = copy if order is None else _laid_out_as(copy, order)
                self._copies.append(out[i]._t2j_storage)
        return leaves if out is None else out

    def _number_arguments(self, leaves) -> list:
        """(`_ArgSite`, id) of the Python numbers among the arguments that are program inputs, and of
        the jax.Arrays (a PRNG key, a mask from JAX code): inputs from the first call, as JAX's jit
        takes them, but for one a trace could not take as a tracer (``np.asarray(a)``: blocked)."""
        lifts = self._hypers
        return [(_ArgSite(i, x), ("arg", i)) for i, x in enumerate(leaves)
                if (_lifted_number(x) and lifts.lifts(("arg", i), x))
                or (_constant_array(x) and ("arg", i) not in lifts.blocked)]

    def _run(self, entry, leaves, slots, storages, given):
        if entry.diff:
            if entry.differentiable is None:
                entry.differentiable = _Differentiable(entry)
            call = _Call(self, entry, slots, storages, _keys(entry, leaves))
            shared = collections.Counter(i for i, _ in entry.diff)
            tensors = [_grad_input(slots.tensors[k], storages[i], slots, k, shared[i] == 1) for i, k in entry.diff]
            call.chains = [_grad_chain(t, storages[i]) for t, (i, _) in zip(tensors, entry.diff)]
            arrays = _DifferentiableCall.apply(call, *tensors)
            for (_, k), value in zip(entry.rebased, arrays[len(arrays) - len(entry.rebased):]):
                t = slots.tensors[k]
                if t._t2j_view:  # (the value is its storage's: a view written in place takes its part)
                    value = value.as_strided(t.shape, t.stride(), t.storage_offset())
                t.copy_(value)  # its history: the call's node, as torch's in-place op makes it
        else:
            outs = self._execute(entry, slots, storages, entry.jitted, _keys(entry, leaves), donated=True)
            arrays = [_program_output(o) for o in outs]
            if entry.spent and torch.is_grad_enabled():
                _SpentGraph.attach(arrays, entry.spent, self.fn)
        if entry.inference:  # (outputs made under torch.inference_mode() are inference tensors)
            with torch.inference_mode():
                arrays = [new_tensor(a._value()) if k in entry.inference else a for k, a in enumerate(arrays)]
        if entry.made_leaves:
            arrays = list(arrays)
            for k, parameter in entry.made_leaves:
                leaf = new_tensor(arrays[k]._value())
                arrays[k] = torch.nn.Parameter(leaf) if parameter else leaf.requires_grad_()
        result = [None] * len(entry.out_leaves)
        for position in entry.out_order:
            kind, v = entry.out_leaves[position]
            if kind == "leaf":
                result[position] = result[v]
            elif kind == "view_of_leaf":
                base = result[v[0]]
                view = _view_of(base, *v[1:3], base.storage_offset() + v[3], v[4])
                result[position] = view.detach() if v[5] else view
            elif kind == "view_of_made" and v[0][0] == "output":
                result[position] = _made_again(result[v[0][1]], *v[1:])
            elif kind == "laid_out" and v[0] in entry.inference:
                with torch.inference_mode():
                    result[position] = _output(kind, v, arrays, slots, leaves)
            elif kind != "lifted_after":  # (made after the stores, which step the schedulers)
                result[position] = _output(kind, v, arrays, slots, leaves)
        for k, grad in entry.leaf_grads:
            arrays[k].grad = _stored_value(grad, result, arrays, slots, leaves)
        for setter, stored in entry.stores:
            setter(_stored_value(stored, result, arrays, slots, leaves))
        for position, (kind, v) in enumerate(entry.out_leaves):
            if kind == "lifted_after":
                result[position] = _output(kind, v, arrays, slots, leaves)
        for p, stored in entry.post_outputs.items():
            setter, _, _, argument = entry.post[p]
            value = _stored_value(stored, result, arrays, slots, leaves)
            if argument is not None:
                _set_grad(slots.tensors[argument], value)
            else:
                setter(value)
        for path, layout, new in entry.arg_changes:
            _change_container(_at(given, path), layout, [_stored_value(v, result, arrays, slots, leaves) for v in new])
        out = _rebuilt_outputs(result, entry.out_def)
        for out_path, arg_path in entry.returned_args:
            out = _with_node(out, out_path, _at(given, arg_path))
        return out

    def _execute(self, entry, slots, storages, jitted, keys, donated):
        """Run one compiled program and write its state back; its outputs as arrays."""
        inputs = list(map(_array_of, storages))
        arguments = entry.arguments if donated else _plain_arguments
        mirrored = [(i, m, m.of(storages)) for i, m in entry.mirrors]
        # JAX warns of unusable donations when it compiles, on the first run
        first = not entry.compile_s
        with jax.enable_x64(True), (warnings.catch_warnings() if first else contextlib.nullcontext()):
            if first:
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            start = time.perf_counter()
            _sym.failed_check()  # one left by a program run outside t2j.jit is not this call's
            try:
                args = arguments(inputs, _hyper_values(slots), keys)
                once = entry.once and jitted is entry.jitted
                if once:  # (the program later calls run is compiled at the first of them)
                    entry.once, jitted = False, _compiled_once(jitted, args)
                written, outs, new, key = jitted(*args)
            except BaseException as e:
                if entry.undo is not None:
                    _restore(entry.undo)
                if isinstance(e, jax.errors.UnexpectedTracerError):
                    raise _leaked(self.fn) from e
                _refuse_deleted_inputs(self.fn, slots, storages, inputs, e)
                failed = _sym.failed_check() if isinstance(e, jax.errors.JaxRuntimeError) else None
                if failed is None:
                    raise
                raise _CheckFailed(failed) from None
            entry.undo = None
            if first:
                if not once:
                    entry.compile_s = time.perf_counter() - start
                self.stats["compiles"] += 1
                _debug.count("compiles")
        for i, a in zip(entry.written, written):
            st = storages[i]
            st.array = a
            st.version += 1
        for i, _, value in mirrored:
            storages[i].host = (storages[i].array, value)
        for st, a in zip(entry.new_storages, new):
            st.array = a
            st.version += 1
        if entry.uses_rng:
            _rng.key = key
        for p, (setter, target, slot, argument) in enumerate(entry.post):
            if p in entry.post_outputs:
                continue
            if isinstance(target, int):
                target = slots.tensors[target]
            if argument is not None:
                # this call's argument, given a gradient of its own (the tensor the trace made holds
                # this call's values, and will hold the next call's)
                made = isinstance(target, Tensor) and any(target._t2j_storage is st for st in entry.new_storages)
                _set_grad(slots.tensors[argument], new_tensor(target._value()) if made else target)
            # from the second call on, a .grad already holds the tensor the trace made: setting it again
            # costs torch's checks for every parameter
            elif slot is None or slots.tensors[slot] is not target:
                setter(target)
        for k, flag in entry.argument_flags:
            slots.tensors[k].requires_grad_(flag)
        if entry.keeps_avals and self._roots_memo:
            # the next call's lookup then finds these arrays unchanged instead of reading every shape
            self._roots_memo[0].remember_arrays()
        return outs

    # -- tracing ----------------------------------------------------------------

    def _trace(self, leaves, spec, roots, slots, storages):
        self.stats["traces"] += 1
        _debug.count("traces")
        start = time.perf_counter()
        info = {}
        hints = _hyper_values(slots)
        pure = functools.partial(self._pure, leaves, spec, roots, slots, storages, info, hints)
        inputs = [st.array for st in storages]
        checks = _sym.RUNTIME_CHECKS
        draws = self._draws
        while True:
            info["own_histories"] = _own_histories(slots.tensors)
            drawn = np.zeros((draws, _KEY_WORDS), np.uint32) if draws else None
            try:
                with _tensor.traced_block(), jax.enable_x64(True), _capturable(roots.optimizers, slots.lifted), \
                        _young_objects_only():
                    closed = jax.make_jaxpr(pure)(inputs, hints, (_rng.key, drawn))
                break
            except _MoreDraws as m:
                draws = self._draws = m.count
            finally:
                _restore_histories(info["own_histories"])
        written = info["written"]
        if self._copies and _copies_escape(info, {id(st) for st in self._copies}, storages, slots, leaves):
            raise _KeepViews()
        n_in = len(inputs)
        # a validation failing at run time must leave the state as it was, as torch's raise does
        donate = tuple(i for i in written if _donated(inputs[i])) if self.donate and _sym.RUNTIME_CHECKS == checks else ()
        flat = jaxpr_as_fun(closed)
        n_out, n_written, n_new = info["n_out"], len(written), len(info["new_storages"])
        uses_rng = info["uses_rng"]

        def program(inputs, lrs, keys):
            res = flat(*inputs, *lrs, *jax.tree.leaves(keys))
            outs = res[:n_out]
            w = res[n_out:n_out + n_written]
            new = res[n_out + n_written:n_out + n_written + n_new]
            # the written state first, in the donated arguments' order: JAX gives each donated buffer to
            # the first output of its shape and dtype, so an output ahead of them (a 0-d loss) would take
            # the first step counter's buffer and shift every later one by one, a copy each
            return w, outs, new, (res[-1] if uses_rng else None)

        # state the program never reads (e.g. the .grad arrays a zero_grad inside drops) is not passed:
        # every argument costs dispatch time on each call
        used = _used_inputs(closed.jaxpr)
        kept = [i for i in sorted(used - set(donate)) if i < n_in]

        def arguments(inputs, lrs, keys):
            # written state first, so that one argument (donated) covers exactly it
            return [inputs[i] for i in donate], [inputs[i] for i in kept], lrs, keys

        def split_program(donated, kept_arrays, lrs, keys):
            both = [None] * n_in
            for i, a in zip(donate, donated):
                both[i] = a
            for i, a in zip(kept, kept_arrays):
                both[i] = a
            return program(both, lrs, keys)

        jitted = jax.jit(split_program, donate_argnums=(0,))
        # as in torch, a tensor no output depends on gets no gradient (None), not zeros
        rebased = info["rebased"] if info["diff"] else []
        # per differentiable output, the inputs it depends on (a bit set): a backward pass reaches those
        # of the outputs it is given gradients for
        reaches = ()
        if info["diff"]:
            deps = _output_dependencies(closed.jaxpr, [1 << i for i in range(len(closed.jaxpr.invars))])
            reaches = tuple(deps[k] for k in info["grad_outs"] + [n_out + p for p, _ in rebased])
        reached = functools.reduce(operator.or_, reaches, 0)
        diff = [(i, k) for i, k in info["diff"] if reached >> i & 1]
        spent = () if diff else tuple(info["histories"])
        out_avals = closed.out_avals[n_out:n_out + n_written]
        keeps = all(_same_aval(closed.in_avals[i], a) for i, a in zip(written, out_avals))
        return _Entry(jitted, arguments, written, info["new_storages"], info["post"], info["out_def"],
                      info["out_leaves"], info["stores"], uses_rng, slots.names, time.perf_counter() - start,
                      info["guards"], program, info["grad_outs"], diff, rebased=rebased, keeps_avals=keeps, undo=info["undo"],
                      shardings=tuple(info["shardings"]), mirrors=tuple(info["mirrors"]), spent=spent,
                      inference=info["inference"], argument_flags=info["argument_flags"], reaches=reaches,
                      made_leaves=info["made_leaves"], leaf_grads=info["leaf_grads"], out_order=info["out_order"],
                      saves=info["saves"], saved_results=info["saved_results"], stale=info["stale"],
                      saved_slots=info["saved_slots"],
                      draws=info["draws"], reseeded=info["reseeded"], grad_mode=info["grad_mode"],
                      lengths=tuple(info["lengths"]), own_lists=tuple(info["own_lists"]),
                      creates_state=info["creates_state"], arg_changes=info["arg_changes"],
                      returned_args=info["returned_args"], post_outputs=info["post_outputs"],
                      **_renewable(info["post"], info["new_storages"], info["out_leaves"]))

    def _pure(self, leaves, spec, roots, slots, storages, info, hints, inputs, hypers, keys):
        saved = [(st, st.array) for st in storages]
        # each slot's storage before the call (``.data =`` inside the function re-points a slot to another)
        index = {id(st): i for i, st in enumerate(storages)}
        slot_storage = [None if t is None else index[id(t._t2j_storage)] for t in slots.tensors]
        saved_slots = _snapshot(slots, roots)
        structure = _module_structure(roots)
        python_places = _python_places(roots)
        modes = [(sub, sub.training) for sub, _, _ in structure]
        layouts = list(map(_layout, slots.tensors))
        layout_storages = [None if t is None else t._t2j_storage for t in slots.tensors]
        flags = _flags(slots.tensors)
        bindings = [(t, _binding(t)) for t in slots.tensors if t is not None]
        saved_numbers = dict(site.saved() for site in slots.lifted)
        numbers = [(where, site, v) for where, site, v in roots.number_sites()
                   if where not in self._hypers.lifted and where not in self._hypers.blocked]
        python_state = _python_state(roots.objects)
        grad_mode = torch.is_grad_enabled()
        capture = _Capture(storages)
        values = [_hyper_input(where, a, i, hint) for i, (where, a, hint) in enumerate(zip(slots.lifted, hypers, hints))]
        arrays = [v._t2j_storage.array if isinstance(v, Tensor) else None for v in values]
        guards = []
        state_hints = _hints.Hints()
        for i, (st, a) in enumerate(zip(storages, inputs)):
            if _hints.carries_host_value(st.array):
                state_hints.add(i, a, st, st.array)
        ok = False
        indices = []
        try:
            for st, a in zip(storages, inputs):
                st.array = a
                st.version += 1
            indices = _as_traced_indices(slots.tensors)
            _placement.traced_shardings({id(a): (a, b.sharding) for (_, b), a in zip(saved, inputs)
                                         if _multi_device(getattr(b, "sharding", None))})
            leaves = list(leaves)
            schedulers = [s for s in roots.schedulers if _last_lr_is_groups_lr(s)]  # (before the lr are traced)
            for site, v in zip(slots.lifted, values):
                if isinstance(site, _ArgSite):
                    leaves[site.index] = v
                else:
                    site.write(v)
            args, kwargs = torch_pytree.tree_unflatten(leaves, spec)
            containers = _argument_containers((args, kwargs))
            _tensor.CAPTURE = capture
            _sym.GUARDS, _hints.HINTS = guards, state_hints
            backward_passes = _device.backward_passes
            key, drawn = keys
            _sym.LEN_READS, _sym.VALUE_ERRORS, _sym.PLACES = {}, [], saved_slots[2]
            with _rng.traced_key(key) as rng, _generator_draws(drawn, leaves, roots.generators) as generators, \
                    torch.autograd.set_multithreading_enabled(False), \
                    _checks_when_run(), _scaler_steps_in_program() as scaler_state, \
                    _wide_step_counters(roots.optimizers), \
                    _sym.traced_builtins(), _unreached_optimizers(roots), _gradient_hooks_counted() as hooks, \
                    _outside_histories_stop(), \
                    _watching_grads(not roots.grads) as grads_seen, _watching_copies(self._copies) as copies_seen, \
                    _scheduler_steps_after_the_program(schedulers) as scheduler_steps:
                try:
                    with _unread_lists_hidden(roots.lists_unread) as lists_read:
                        out = self.fn(*args, **kwargs)
                except Exception as e:
                    if (grads_seen or copies_seen) and not isinstance(e, (_SeesGrads, _KeepViews)):
                        # (re-raised as another error: torch.compile)
                        raise (_SeesGrads() if grads_seen else _KeepViews()) from e
                    if lists_read:
                        raise _ReadsLists(lists_read) from e
                    raise
            if lists_read:
                raise _ReadsLists(lists_read)
            if grads_seen:  # (the function caught `_SeesGrads`)
                raise _SeesGrads()
            if copies_seen:
                raise _KeepViews()
            if (arg_changes := _argument_changes(containers, (args, kwargs), leaves, spec)) is None:
                raise OpError(
                    "torch2jax: the function changed a list or dict it was passed in a way a compiled call cannot "
                    "make again (a container moved into another, or a nested one replaced). Return the values "
                    "instead, or hold the container in a closure or an object's attribute.")
            if _sym.VALUE_ERRORS:  # (one the function caught: it took another branch than torch takes)
                raise _sym.VALUE_ERRORS[0]
            # (a trace is run again after some of its stops: each starts in the call's mode, set again below)
            info["grad_mode"] = torch.is_grad_enabled() if torch.is_grad_enabled() != grad_mode else None
            if generators.drew_on_the_host:
                raise OpError(
                    "torch2jax: a random op on the CPU (torch.randperm(n), torch.randn(4).to(x.device), a CPU "
                    "generator) or Python's random / numpy.random drew on the host inside t2j.jit: its numbers "
                    "would be constants of the program. Draw them with torch on the jax device (device=x.device) to "
                    "keep the function one program"
                )
            if not generators.complete:
                raise _MoreDraws(len(generators.sources))
            backward = _device.backward_passes != backward_passes
            _tensor.CAPTURE = _sym.GUARDS = _hints.HINTS = _sym.PLACES = None
            rewritten = saved_slots[2].take_rewritten()
            len_reads, _sym.LEN_READS = _sym.LEN_READS, None
            if changed := [(where, site, v) for where, site, v in numbers if site.read() is not v]:
                for _, site, v in changed:
                    site.write(v)
                raise _LiftNumbers([where for where, _, _ in changed])
            numbers_stored = []
            for site, v, a in zip(slots.lifted, values, arrays):
                if isinstance(site, _ValueSite) and site.changed(v) and _is_number(new := site.read()):
                    numbers_stored.append((site, new))  # (a counter the function advances)
                elif isinstance(site, _GroupSite) and _is_number(new := _group_number(site, v, a)):
                    numbers_stored.append((site, new))  # (a warm-up setting ``group["lr"]`` itself)
                elif site.changed(v) or (a is not None and v._t2j_storage.array is not a):
                    raise JitError(
                        f"t2j.jit: {site.what()} changed inside the jitted function to a value computed there; "
                        "its Python state would be frozen into the program. Set it from a number the function "
                        "takes (group['lr'] = lr), step an LR scheduler, or change it outside the jitted function."
                    )
            if traced := _traced_hyperparameters(roots.optimizers, slots.lifted):
                raise _LiftNumbers(traced)
            for restore in saved_numbers.values():  # before the check that nothing else changed
                restore()
            _check_python_state(self.fn, roots.objects, python_state, roots.names)
            _check_layouts(slots, layouts, layout_storages, {id(x) for x in leaves if isinstance(x, torch.Tensor)})
            if capture.unknown:
                raise _Retrace([t._t2j_storage for t in capture.unknown.values()])
            info["returned_args"] = tuple(_returned_containers(out, {id(c): path for path, c, _ in containers}))
            known = {id(x) for x in (*leaves, *roots.objects, *roots.modules, *roots.optimizers)}
            out_leaves, out_def = torch_pytree.tree_flatten(_made_objects_as_nodes(out, known), _is_size)
            del out
            pre_index = {id(t): i for i, t in enumerate(slots.tensors) if t is not None}
            arg_index = {id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
            made = _Outputs(slots, storages, pre_index, arg_index, {
                id(v): i for i, (v, a) in enumerate(zip(values, arrays))
                if isinstance(v, Tensor) and v._t2j_storage.array is a}, scheduler_steps.after)
            out_order = _classification_order(out_leaves)
            kinds = [None] * len(out_leaves)
            for position in out_order:
                kinds[position] = made.kind(out_leaves[position], position)
            # tensors it stored in places (`_Places`) are outputs too, given to the same places after each call
            stores = [(functools.partial(_put, kind, container, key), made.stored(t))
                      for kind, container, key, t in saved_slots[2].moved()]
            # a number argument stored as it is (``group["lr"] = lr``) is stored from the call's arguments
            arg_numbers = {id(v): site.index for site, v in zip(slots.lifted, values) if isinstance(site, _ArgSite)}
            stores += [(site.write, ("arg", arg_numbers[id(new)]) if id(new) in arg_numbers else made.stored(new))
                       for site, new in numbers_stored]
            stores += [(functools.partial(_step_scheduler, scheduler), made.stored(given))
                       for scheduler, given in scheduler_steps]
            stores += [(functools.partial(_drop_skipped_state, optimizer, entries), made.stored(skip))
                       for optimizer, entries, skip in scaler_state]
            for container, (how, items) in rewritten:
                if how == "extend":
                    stores.append((functools.partial(_extend, container), made.stored(items)))
                else:
                    layout, new_items = items
                    stores.append((functools.partial(_rewrite, container, layout), made.stored(new_items)))
            info["arg_changes"] = tuple((path, layout, tuple(map(made.stored, new))) for path, layout, new in arg_changes)
            # a list whose length the function read (``if len(hist) > k``) or whose items it moved: each
            # length has a program of its own
            info["lengths"] = saved_slots[2].sized(len_reads)
            info["lengths"] += [container for container, (how, _) in rewritten if how == "rewrite"]
            info["own_lists"] = [container for container, _ in rewritten]
            leaf_grads = tuple((k, made.stored(g)) for k, g in made.grads_of_made_leaves)
            made.grads_of_made_leaves.clear()
            # (one node for all outputs: with several, a backward through one would free the others')
            one_node = len(made.nodes) == 1
            saves = one_node and not backward and _saves_tensors(made.nodes)
            stale, saved_slots_read = (None, ()) if backward else _graph_saves(made.nodes, slots.tensors)
            made.nodes.clear()
            # m.eval() / m.train() inside: each call leaves the modes as the trace left them
            stores += [(functools.partial(_put, "attr", sub, "training"), ("const", sub.training))
                       for sub, mode in modes if sub.training != mode]
            saved_slots[2].restore()  # (the tensors the trace stored hold tracers, and their histories its graph)
            outs, grad_outs, leaf = made.arrays, made.grad_outs, None
            made.release()
            scheduler_steps.after.clear()  # (the stand-ins: not state the function made)
            del out_leaves, leaf
            post_slots = _collect(leaves, roots, full=True)
            info["creates_state"] = _creates_state(slots, post_slots)
            del args, kwargs
            gc.collect()
            input_ids = {id(a) for a in inputs}
            written = [i for i, st in enumerate(storages) if st.array is not inputs[i]]
            info["shardings"] = []
            for i in written:  # state keeps its sharding from step to step
                sharding = getattr(saved[i][1], "sharding", None)
                if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1:
                    storages[i].array = jax.lax.with_sharding_constraint(storages[i].array, sharding)
                    info["shardings"].append((i, sharding))
            # (tensors a nested transform traced and its jaxpr keeps alive, as a custom_vjp's backward keeps the
            # tensors it reruns a Function on, hold tracers of that finished trace: not state the function made)
            own = _jax_core.trace_ctx.trace
            new_storages = [st for st in list(capture.new) if isinstance(st.array, jax.core.Tracer)
                            and st.array._trace is own and id(st.array) not in input_ids]
            for st in new_storages:  # state made like sharded state (Adam's zeros_like(p)) stays sharded as it
                sharding = _placement.placed_sharding(capture.first.get(id(st)))
                if sharding is not None:
                    st.array = jax.lax.with_sharding_constraint(st.array, sharding)
            # branches on state: the new values of such state it computes from such state alone are mirrored
            branches = any(isinstance(g, _hints.StateGuard) for g in guards)
            info["mirrors"] = [(i, m) for i in written if id(inputs[i]) in state_hints.inputs
                               and (m := state_hints.slice(storages[i].array)) is not None] if branches else []
            post = _repointed(slots, post_slots, pre_index)
            info["post_outputs"] = made.repointed(kinds, post)
            rebased = [(written.index(slot_storage[k]), k) for k, _, _, node in info["own_histories"]
                       if slot_storage[k] in written and slots.tensors[k].grad_fn is not node]
            info.update(undo=saved_slots if post else None, rebased=rebased, argument_flags=_argument_flags(slots, flags),
                written=written, new_storages=new_storages, post=post, out_def=out_def, out_leaves=kinds, stores=stores,
                out_order=out_order,
                n_out=len(outs), uses_rng=rng.key is not key, guards=guards, grad_outs=grad_outs,
                histories=made.histories, inference=frozenset(made.inference), made_leaves=tuple(made.made_leaves),
                leaf_grads=leaf_grads, saves=saves, saved_results=tuple(made.saved_results), stale=stale,
                # (as for `saves`: with several nodes, a backward through one would free the others')
                saved_slots=tuple(k for k in saved_slots_read if slot_storage[k] not in written) if one_node else (),
                draws=tuple(generators.sources), reseeded=tuple(generators.reseeded),
                diff=_differentiable_inputs(slots, slot_storage, written, post, backward) if grad_outs or rebased
                else [],
            )
            if info["diff"] and (hooks.count or _backward_hooks_on(roots.modules)):
                # (the call's backward is JAX's of the program, which runs no torch hook: torch's runs them)
                raise OpError(
                    "torch2jax: t2j.jit of a function whose outputs are differentiated outside it, with gradient "
                    "hooks (a tensor's register_hook or retain_grad inside it, a module's full backward hook): "
                    "it runs eagerly so that the hooks run. Run the backward pass inside the jitted function "
                    "(a training step) to compile it with them")
            result = outs + [storages[i].array for i in written] + [st.array for st in new_storages]
            if rng.key is not key:
                result.append(rng.key)
            ok = True
            return result
        finally:
            _tensor.CAPTURE = _sym.GUARDS = _hints.HINTS = _sym.LEN_READS = _sym.VALUE_ERRORS = _sym.PLACES = None
            for t in indices:
                t.__class__ = Tensor
            _placement.traced_shardings({})
            torch._C._set_grad_enabled(grad_mode)
            for st, a in saved:
                st.array = a
                st.version += 1
            capture.restore()
            for restore in saved_numbers.values():
                restore()
            if not ok:
                _restore_structure(structure)
                _restore(saved_slots)
                _restore_python_places(python_places)
                for t, twin in bindings:  # (``.data =`` a new tensor: another storage, maybe another layout)
                    if t._t2j_storage is not twin._t2j_storage or _layout(t) != _layout(twin):
                        t._rebind(twin)

    # -- recompiles ---------------------------------------------------------------

    def _explain(self, key, slots):
        if not self._cache:
            return
        last = next(reversed(self._cache))
        reason = _diff(last, self._cache[last][-1].names, key, slots.names)
        self._log(reason)
        self._retraces_in_a_row += 1
        if _python_values_of(key) != _python_values_of(last):
            self._value_retraces += 1
            if self._value_retraces == _VALUE_RETRACES_BEFORE_WARNING:
                warnings.warn(
                    f"t2j.jit: {getattr(self.fn, '__qualname__', self.fn)} was traced and compiled again "
                    f"{self._value_retraces} times because Python values it reads changed (last: {reason}); "
                    "each new value is a new program. Pass a value that changes from call to call as a tensor "
                    "argument instead.", stacklevel=4)
        elif self._retraces_in_a_row == _VALUE_RETRACES_BEFORE_WARNING:
            warnings.warn(
                f"t2j.jit: {getattr(self.fn, '__qualname__', self.fn)} was traced and compiled again on each of its "
                f"last {self._retraces_in_a_row} calls (last: {reason}): every call compiles a new program. "
                "t2j.explain_recompiles() lists why", stacklevel=4)

    def _log(self, reason):
        msg = f"t2j.jit: retracing {getattr(self.fn, '__qualname__', self.fn)}: {reason}"
        _RECOMPILES.append(msg)
        log.info(msg)


# ---------------------------------------------------------------------------
# differentiable calls: the outputs of a jitted forward carry an autograd graph
# ---------------------------------------------------------------------------


def _multi_device(sharding) -> bool:
    return isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1


def _as_traced_indices(tensors) -> list:
    """Make the 0-d integer tensors among ``tensors`` (arguments and state, whose values the trace takes as
    inputs) `torch2jax.tensor.TracedIndex` until the trace ends, as the trace's own are: ``cache[:, pos]``
    with ``pos`` one of them is then a view at the position the program computes. The ones changed."""
    changed = [t for t in tensors
               if type(t) is Tensor and not t.shape and _dt.to_jax(t.dtype) in _tensor.INDEX_DTYPES]
    for t in changed:
        t.__class__ = _tensor.TracedIndex
    return changed


def _differentiable_inputs(slots, slot_storage, written, post, backward) -> list:
    """(storage index, slot index) for each storage of a slot tensor that requires
    grad: what a call's outputs are differentiated with respect to. ``slot_storage``
    is each slot's storage index as the call found it.

    Empty when the trace ran a ``backward`` pass or set or wrote a ``.grad``: the
    graph its outputs hang on was consumed inside the function (a training step), so
    they come back with a node refusing a second backward (`_SpentGraph`). A write made with grad mode off (weight clipping
    in a forward) keeps the tensor's place in the graph (torch2jax/gradcut.py).
    """
    if backward or any(getattr(setter, "func", None) is _set_grad and target is not None
                       for setter, target, _, _ in post):
        return []
    written = set(written)
    diff, seen = [], set()
    for k, (t, setter, i) in enumerate(zip(slots.tensors, slots.setters, slot_storage)):
        if t is None:
            continue
        if i in written and getattr(setter, "func", None) is _set_grad:
            return []
        if t.requires_grad and i not in seen:
            seen.add(i)
            diff.append((i, k))
    return diff


@contextlib.contextmanager
def _gradient_hooks_counted():
    """While a trace runs: counts the gradient hooks it registers on tensors (``register_hook``,
    ``retain_grad``, ``register_post_accumulate_grad_hook``) in the ``count`` of what it yields."""
    counted = types.SimpleNamespace(count=0)
    names = ("register_hook", "retain_grad", "register_post_accumulate_grad_hook")
    saved = {name: vars(torch.Tensor).get(name, _MISSING) for name in names}  # (retain_grad: a C base's)

    def counting(method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            counted.count += 1
            return method(*args, **kwargs)
        return run

    for name in names:
        setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    try:
        yield counted
    finally:
        for name, method in saved.items():
            if method is _MISSING:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


class _OutsideHistory(OpError):
    """A backward pass inside a trace reached a tensor whose autograd history was made before the call."""


@contextlib.contextmanager
def _outside_histories_stop():
    """While a trace runs: a backward pass (``loss.backward()`` inside) that reaches the autograd history a
    slot tensor had before the call (REINFORCE's log-probs saved during the episode; `_OwnHistory`) stops
    the trace before running it: one program cannot hold that history, and a backward through it would
    free what the eager run of the call needs."""
    global _STOP_AT_OUTSIDE_HISTORY
    saved, _STOP_AT_OUTSIDE_HISTORY = _STOP_AT_OUTSIDE_HISTORY, True
    try:
        yield
    finally:
        _STOP_AT_OUTSIDE_HISTORY = saved


_STOP_AT_OUTSIDE_HISTORY = False


class _SeesGrads(Exception):
    """A trace that carries no gradients as state read or wrote a ``.grad`` or ran a backward pass."""


# Names whose use in a function's code means it likely works with ``.grad``: its first trace
# carries the gradients rather than finding out by stopping (`_watching_grads`)
_GRAD_NAMES = frozenset({"backward", "grad", "zero_grad", "clip_grad_norm_", "clip_grad_value_"})


@contextlib.contextmanager
def _watching_grads(watch: bool):
    """While a trace that carries no gradients as state runs (``watch``): a read or write of a
    tensor's ``.grad``, or a backward pass accumulating into ``.grad``, raises `_SeesGrads`.
    Yields a list that is non-empty once that happened (in case the function caught it)."""
    seen = []
    if not watch:
        yield seen
        return
    tracing = threading.get_ident()
    base = torch._C.TensorBase.grad

    def stop():
        if threading.get_ident() == tracing:  # (another thread reading a gradient meanwhile reads it)
            seen.append(True)
            raise _SeesGrads()

    def get(t):
        stop()
        return base.__get__(t)

    def set_(t, value):
        stop()
        base.__set__(t, value)

    def delete(t):
        stop()
        base.__delete__(t)

    saved = vars(torch.Tensor).get("grad", _MISSING)
    torch.Tensor.grad = property(get, set_, delete)
    _device.accumulating_watchers.append(stop)
    try:
        yield seen
    finally:
        _device.accumulating_watchers.remove(stop)
        if saved is _MISSING:
            del torch.Tensor.grad
        else:
            torch.Tensor.grad = saved


@contextlib.contextmanager
def _watching_copies(copies):
    """While a trace whose view arguments are copies (`JitFunction._view_copies`) runs: an op that
    reads a copy's storage beyond its elements (``as_strided``, ``untyped_storage()``), where the
    copy's layout is not the view's, raises `_KeepViews`. Yields a list that is non-empty once
    that happened (in case the function caught it)."""
    seen = []
    if not copies:
        yield seen
        return
    ids = {id(st) for st in copies}

    def watch(t):
        if id(t._t2j_storage) in ids:
            seen.append(True)
            raise _KeepViews()

    _tensor.storage_watchers.append(watch)
    try:
        yield seen
    finally:
        _tensor.storage_watchers.remove(watch)


# XLA options for a program compiled to run once (`JitFunction._first_entry`): the lowest backend
# (LLVM) optimization level
_ONCE_OPTIONS = {"xla_backend_optimization_level": 0}


def _compiled_once(jitted, args):
    """``jitted`` compiled for ``args`` with `_ONCE_OPTIONS`, or ``jitted`` itself where the backend
    takes no such options."""
    try:
        return jitted.lower(*args).compile(compiler_options=_ONCE_OPTIONS)
    except jax.errors.JaxRuntimeError:
        return jitted


def _creates_state(before, after) -> bool:
    """Whether the slots a walk finds after a call (``after``) hold state the walk before it did
    not find (a ``.grad`` that was None, an optimizer's new state): `_Entry.creates_state`."""
    return len(after.tensors) != len(before.tensors) or any(
        a is None and b is not None for a, b in zip(before.tensors, after.tensors))


def _backward_hooks_on(modules) -> bool:
    """Whether a module among ``modules`` (or every module) has a full backward hook or pre-hook."""
    g = torch.nn.modules.module
    return bool(g._global_backward_hooks or g._global_backward_pre_hooks) or any(
        sub._backward_hooks or sub._backward_pre_hooks for m in modules for sub in _submodules(m))


def _graph_nodes(nodes, limit=10_000):
    """The autograd nodes reached from ``nodes``, each once; None last where there are more than ``limit``."""
    seen, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        if len(seen) >= limit:
            yield None
            return
        seen.add(id(node))
        yield node
        todo.extend(next_node for next_node, _ in node.next_functions)


def _saves_tensors(nodes) -> bool:
    """Whether an autograd node reached from ``nodes`` saved a tensor for its backward (a node of
    ``x + 1`` saves none; torch then allows a second backward)."""
    for node in _graph_nodes(nodes):
        if node is None:  # (a graph this large saved some)
            return True
        try:
            if any(_is_saved_tensor(getattr(node, name)) for name in dir(node) if name.startswith("_saved_")):
                return True
        except RuntimeError:  # (freed by a backward inside: it saved some)
            return True
    return False


def _graph_saves(nodes, tensors) -> tuple:
    """(torch's error for a saved tensor that the graph reached from ``nodes`` would find written in place
    since it was saved (``y = a.exp(); y[1:3].mul_(2)``), or None; the slots among ``tensors`` that the graph
    saved). The trace's graph never runs backward (the call's VJP does), so torch's check runs here:
    unpacking a saved tensor checks its version. Each call saves those slots' tensors as its graph node's,
    so that a write to one after the call (``w.mul_(10)`` under no_grad) fails the backward, as in torch."""
    index = {id(t): k for k, t in enumerate(tensors) if t is not None}
    stale, saved = None, set()
    for node in _graph_nodes(nodes):
        for name in dir(node) if node is not None else ():
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError as e:
                    if "modified by an inplace operation" in str(e) and stale is None:
                        stale = str(e)
                    continue
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor) and id(t) in index:
                        saved.add(index[id(t)])
    return stale, tuple(sorted(saved))


def _is_saved_tensor(value) -> bool:
    """Whether a node's ``_saved_*`` attribute is a tensor (or tensors), not a size or a number."""
    return isinstance(value, torch.Tensor) or isinstance(value, (tuple, list)) and any(
        isinstance(v, torch.Tensor) for v in value)


def _used_inputs(jaxpr) -> set:
    """The indices of the inputs of ``jaxpr`` that an equation or an output reads."""
    read = {v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)}
    read.update(v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal))
    return {i for i, v in enumerate(jaxpr.invars) if v in read}


def _inputs_reaching(jaxpr, outputs) -> set:
    """The indices of the inputs of ``jaxpr`` that some of its ``outputs`` depend on
    differentiably: not through a gradient cut (``detach()``, ``torch.no_grad()``), which
    leaves an input none of its outputs reach, as torch's graph does."""
    deps = _output_dependencies(jaxpr, [1 << i for i in range(len(jaxpr.invars))])
    d = functools.reduce(operator.or_, (deps[k] for k in outputs), 0)
    return {i for i in range(len(jaxpr.invars)) if d >> i & 1}


def _output_dependencies(jaxpr, in_deps: list) -> list:
    """Per output of ``jaxpr``, the union (a bit set) of ``in_deps`` of the inputs it depends on
    differentiably (`_equation_dependencies`). An integer or boolean value depends on nothing: torch's
    are never differentiable (``x > 0``, ``x.argmax()``, ``x.long()`` cut the graph), so an input reached
    only through one gets no gradient (None), not zeros."""
    deps = dict(zip(jaxpr.invars, in_deps))

    def of(v):
        return 0 if isinstance(v, jax.extend.core.Literal) else deps.get(v, 0)

    for eqn in jaxpr.eqns:
        for v, d in zip(eqn.outvars, _equation_dependencies(eqn, list(map(of, eqn.invars)))):
            deps[v] = d if _inexact_aval(v.aval) else 0
    return list(map(of, jaxpr.outvars))


def _inexact_aval(aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def _equation_dependencies(eqn, ins: list) -> list:
    """`_output_dependencies` of one equation, looking into the branches of a ``cond`` and the
    body of a call (remat, a nested jit), where the control-flow functions pass all the state a
    function can reach: a parameter one branch or body does not read reaches no output. Nothing
    reaches through a ``stop_gradient`` (a gradient cut, torch2jax/gradcut.py); a function with
    a gradient rule of its own (a torch.autograd.Function: its forward runs with grad mode off,
    its backward says what its inputs get) may give each input a gradient from each output."""
    name = eqn.primitive.name
    if name == "stop_gradient":
        return [0] * len(eqn.outvars)
    if name == "cond":
        outs = [ins[0]] * len(eqn.outvars)  # every output depends on the branch index
        for branch in eqn.params["branches"]:
            outs = [a | b for a, b in zip(outs, _output_dependencies(branch.jaxpr, ins[1:]))]
        return outs
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    inner = getattr(inner, "jaxpr", inner)
    if isinstance(inner, jax.extend.core.Jaxpr) and len(inner.invars) == len(ins) \
            and len(inner.outvars) == len(eqn.outvars) and not name.startswith("custom_"):
        return _output_dependencies(inner, ins)
    every = functools.reduce(operator.or_, ins, 0)
    return [every] * len(eqn.outvars)


def _dual_arguments(args, kwargs) -> bool:
    """Whether an argument is a forward-mode dual tensor (torch.autograd.forward_ad.make_dual)."""
    if torch.autograd.forward_ad._current_level < 0:
        return False
    unpack = torch.autograd.forward_ad.unpack_dual
    return any(isinstance(x, torch.Tensor) and unpack(x).tangent is not None
               for x in torch_pytree.tree_leaves((args, kwargs)))


def _grad_input(t, storage, slots, k, alone):
    """The tensor whose gradient is the gradient with respect to ``storage``: ``t`` itself
    (where ``alone``, no other differentiable input of the call shares its storage, the
    storage's gradient narrowed by its view chain is its own, see `_Call.chains`), the base it
    is a view of, or ``t`` where it is a permutation of its whole storage (a channels_last
    parameter)."""
    if not t._t2j_view:
        return t
    moves = _tensor.strided_steps(t._t2j_view)
    if alone and moves:
        return t
    base = t._base
    if (isinstance(base, Tensor) and base._t2j_storage is storage and not base._t2j_view
            and base.requires_grad):
        return base
    if (t.storage_offset() == 0 and t.numel() == storage.array.size and moves
            and _tensor.dense_order(tuple(t.shape), t.stride()) is not None):
        return t
    name = slots.names[k] if slots.names else f"state tensor {k}"
    raise JitError(
        f"t2j.jit: {name} requires grad and is a view whose base the function cannot see, so the gradient "
        "of the jitted function's outputs cannot reach it; pass the base tensor (or a .clone() of the view)"
    )


def _grad_chain(t, storage) -> tuple:
    """The view steps taking the gradient with respect to ``storage`` to ``t``'s (`_grad_input`):
    none where ``t`` holds the storage's values as they are (a base, ``x.view_as(x)``)."""
    if not t._t2j_view or (tuple(t.shape) == storage.array.shape and t.is_contiguous() and t.storage_offset() == 0):
        return ()
    return t._t2j_view


# Written state smaller than this is not donated. XLA copies a donated input that is read after
# the program starts overwriting it (a step counter read by the bias corrections after its
# increment), one kernel per array; an undonated one gets a new buffer instead, which for a
# small array costs nothing worth saving (torch's Adam: one copy per parameter, 52 in a GPT).
_DONATE_MIN_BYTES = 4096


def _donated(array) -> bool:
    return array.size * array.dtype.itemsize >= _DONATE_MIN_BYTES


def _plain_arguments(inputs, lrs, keys):
    return inputs, lrs, keys


def _keys(entry: _Entry, leaves, draw: bool = True):
    """A call's randomness inputs: the default generator's key, and a row of key data per draw the
    program takes from an explicit torch.Generator, drawn from it now, as the eager draws would
    advance it (``draw=False``: zero rows of the same shape, to lower the program). A generator
    re-seeded inside the function is left as the eager call would leave it."""
    drawn = None
    if entry.draws:
        drawn = (np.stack([_drawn_key_data(_generator(s, leaves)) for s in entry.draws]) if draw
                 else np.zeros((len(entry.draws), _KEY_WORDS), np.uint32))
    if draw:
        for source, state in entry.reseeded:
            _set_generator_state(_generator(source, leaves), state)
    return _rng.key, drawn


def _generator(source, leaves) -> torch.Generator:
    """The generator of an `torch2jax.env.GeneratorDraws` source: an argument's index, or the generator."""
    return leaves[source] if isinstance(source, int) else source


class _Differentiable:
    """The programs of a differentiable entry: its forward without donation (the
    backward pass recomputes it from the same inputs) and the VJP with respect to
    the storages in ``entry.diff``, which recomputes the forward (no residuals are
    kept between the calls, as in `t2j.compile`)."""

    def __init__(self, entry: _Entry):
        program, diff, grad_outs = entry.program, [i for i, _ in entry.diff], entry.grad_outs
        rebased = [p for p, _ in entry.rebased]
        self.forward = jax.jit(program)

        def pull(inputs, lrs, key, wrt, cotangents):
            def outputs(wrt):
                xs = list(inputs)
                for i, a in zip(diff, wrt):
                    xs[i] = a
                written, outs = program(xs, lrs, key)[:2]
                return [outs[k] for k in grad_outs] + [written[p] for p in rebased]

            return jax.vjp(outputs, wrt)[1](cotangents)[0]

        def vjp(inputs, lrs, key, cotangents):
            return _torch_pullback(lambda wrt, c: pull(inputs, lrs, key, wrt, c), [inputs[i] for i in diff],
                                   cotangents)

        self.pull = pull
        self.vjp = jax.jit(vjp)


@contextlib.contextmanager
def _young_objects_only():
    """While a function is traced, Python's collector sees only the objects the trace makes: those
    that existed before are frozen out of it (gc.freeze) and its automatic runs are off. A trace
    allocates tens of thousands of objects next to the millions torch, JAX and a model hold, and
    collections of all of them took half of a GPT step's trace; the trace's one collection (`_pure`,
    to find the storages it made that are still alive) scans only what it made."""
    enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def _cotangent(grad, out):
    """The JAX cotangent of a call output from torch's gradient for it (zeros for None)."""
    if grad is None:
        return jax.numpy.zeros_like(out)
    return grad._value() if isinstance(grad, Tensor) else jax_array(grad)


class _OwnHistory(torch.autograd.Function):
    """An alias of a tensor (its storage, not a copy) with an autograd history of its own."""

    @staticmethod
    def forward(ctx, t):
        return t.detach()

    @staticmethod
    def backward(ctx, grad):
        if _STOP_AT_OUTSIDE_HISTORY:
            raise _OutsideHistory(
                "t2j.jit: a backward pass inside the function reaches a tensor computed before the call (its "
                "autograd history is outside the program): the call runs eagerly. Compute that tensor inside the "
                "function (from its inputs) for one program")
        return grad


def _own_histories(tensors) -> list:
    """Give every non-leaf slot tensor that requires grad (a view of one too) a history of its own while
    the function is traced (torch.utils.swap_tensors with an alias): an in-place op in the trace rebases
    that one, not the caller's graph, which the call then extends through its own autograd node
    (`_Entry.rebased`). `_restore_histories` swaps them back."""
    swapped = []  # (slot index, tensor, the alias holding its own history, that alias's node)
    for k, t in enumerate(tensors):
        if t is None or t.is_leaf or not t.requires_grad:
            continue
        alias = _OwnHistory.apply(t)
        node = alias.grad_fn
        try:
            torch.utils.swap_tensors(t, alias)
        except RuntimeError:  # (held elsewhere in C++, e.g. saved by an earlier op for its backward)
            continue
        swapped.append((k, t, alias, node))
    return swapped


def _restore_histories(swapped: list):
    for _, t, alias, _ in swapped:
        torch.utils.swap_tensors(t, alias)


class _Call:
    """One differentiable call: what its backward pass needs."""

    def __init__(self, fn: JitFunction, entry: _Entry, slots, storages, keys):
        self.fn, self.entry, self.slots, self.storages, self.key = fn, entry, slots, storages, keys
        # per differentiable input, the view chain taking its storage's gradient to its own
        self.chains: list = []

    def forward(self):
        self.inputs = [st.array for st in self.storages]
        self.lrs = _hyper_values(self.slots)
        self.outs = self.fn._execute(self.entry, self.slots, self.storages, self.entry.differentiable.forward,
                                     self.key, donated=False)
        self.written = [self.storages[i].array for i in self.entry.written]
        return self.outs

    def backward(self, grads, batch: int | None = None):
        """The gradients of the differentiable inputs' storages. ``batch``: each gradient holds that
        many cotangents along a leading dimension (`_batched_grads`), and so does each result."""
        entry = self.entry
        with jax.enable_x64(True):  # a float64 output's zero cotangent stays float64
            outs = [self.outs[k] for k in entry.grad_outs] + [self.written[p] for p, _ in entry.rebased]
            given = [grads[k] for k in entry.grad_outs] + list(grads[len(self.outs):])
            if batch is None:
                return entry.differentiable.vjp(self.inputs, self.lrs, self.key, list(map(_cotangent, given, outs)))
            cotangents = [jax.numpy.zeros((batch, *o.shape), o.dtype) if g is None else _cotangent(g, o)
                          for g, o in zip(given, outs)]
            return jax.vmap(lambda c: entry.differentiable.vjp(self.inputs, self.lrs, self.key, c))(cotangents)


def _batched_grads(grads):
    """``grads`` given by a vmap over a backward pass (torch.func.vmap, or the legacy vmap of
    ``is_grads_batched=True`` and ``jacobian(vectorize=True)``): (their values with the batch
    dimension first, batch size, (legacy?, vmap level)); (grads, None, None) where none is batched."""
    fc = torch._C._functorch
    if any(g is not None and fc.is_legacy_batchedtensor(g) for g in grads):
        legacy, is_batched = True, fc.is_legacy_batchedtensor
        level = torch._C._vmapmode_increment_nesting() - 1  # (the legacy vmap's level: its nesting depth)
        torch._C._vmapmode_decrement_nesting()

        def unwrap(g):
            return torch._remove_batch_dim(g, level, 1, 0)
    else:
        batched = [g for g in grads if g is not None and fc.is_batchedtensor(g)]
        if not batched:
            return grads, None, None
        legacy, is_batched, level = False, fc.is_batchedtensor, fc.maybe_get_level(batched[0])

        def unwrap(g):
            if fc.maybe_get_level(g) != level:
                raise RuntimeError("t2j.jit: the backward pass of a jitted function under nested vmaps is not "
                                   "supported; differentiate the function eagerly, or jit a function that "
                                   "computes the Jacobian inside (torch.func.jacrev)")
            return fc.get_unwrapped(g).movedim(fc.maybe_get_bdim(g), 0)

    flags = [g is not None and is_batched(g) for g in grads]
    out = [unwrap(g) if f else g for g, f in zip(grads, flags)]
    size = next(u.shape[0] for u, f in zip(out, flags) if f)
    # a gradient the vmap does not batch is the same for every cotangent
    return [u if u is None or f else u.expand(size, *u.shape) for u, f in zip(out, flags)], size, (legacy, level)


def _rebatched(grads, level):
    """The gradients a backward computed for every cotangent of `_batched_grads` (batch dimension
    first) as the vmap at ``level`` (its (legacy?, vmap level)) gives them back: batched tensors."""
    add = torch._add_batch_dim if level[0] else torch._C._functorch._add_batch_dim
    return [None if g is None else add(g, 0, level[1]) for g in grads]


class _DifferentiableCall(torch.autograd.Function):
    """A jitted call as one node of torch's autograd graph: its inputs are the tensors
    that require grad among the call's state, its outputs the program's outputs."""

    @staticmethod
    def forward(ctx, call, *tensors):
        ctx.call, ctx.tensors = call, tensors
        ctx.inputs = [t for t in tensors if t.requires_grad]
        ctx.set_materialize_grads(False)  # (an output the loss does not use gets None: see backward)
        outs = [_program_output(o) for o in call.forward()]
        grad_outs = set(call.entry.grad_outs)
        ctx.mark_non_differentiable(*(o for k, o in enumerate(outs) if k not in grad_outs and isinstance(o, Tensor)))
        saved_inputs = [call.slots.tensors[k] for k in call.entry.saved_slots]
        if call.entry.saves or saved_inputs:
            # what torch's graph saved: its errors for a second backward, a result or an input written since
            ctx.save_for_backward(*([outs[k] for k in call.entry.saved_results] or [torch.empty(0)]), *saved_inputs)
        # the new values of the non-leaf inputs the function wrote in place, which `_run` copies into
        # them (torch allows a Function that writes a view in place only one output)
        return (*outs, *(new_tensor(call.written[p]) for p, _ in call.entry.rebased))

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        if call.entry.stale is not None:
            raise RuntimeError(call.entry.stale)
        if call.entry.saves or call.entry.saved_slots:
            ctx.saved_tensors  # noqa: B018 - torch's checks: freed by an earlier backward, or written in place since
        # a view's gradient (its storage's, narrowed by the chain) is not one JAX function of the
        # view: through those, a second backward is refused rather than differentiated
        if _gradcut.creates_graph((*ctx.inputs, *grads)) and not any(call.chains):
            if any(g is not None and (torch._C._functorch.is_batchedtensor(g)
                                      or torch._C._functorch.is_legacy_batchedtensor(g)) for g in grads):
                raise RuntimeError(
                    "t2j.jit: a vmapped backward pass that creates a graph (is_grads_batched=True, or "
                    "torch.func.vmap over autograd.grad, with create_graph=True) through a jitted function is not "
                    "supported: compute the derivatives inside the jitted function (torch.func), or eagerly")
            pull = functools.partial(call.entry.differentiable.pull, call.inputs, call.lrs, call.key)
            rebased = [call.written[p] for p, _ in call.entry.rebased]
            return (None, *_differentiable_vjp(pull, ctx.tensors, [grads[k] for k in call.entry.grad_outs]
                                               + list(grads[len(call.outs):]),
                                               [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
                                                [call.outs[k] for k in call.entry.grad_outs] + rebased]))
        # as in torch, an input reached only from outputs the loss does not use gets no gradient (None)
        given = [grads[k] for k in call.entry.grad_outs] + list(grads[len(call.outs):])
        reached = functools.reduce(operator.or_, (r for r, g in zip(call.entry.reaches, given) if g is not None), 0)
        grads, batch, level = _batched_grads(grads)

        def through(chain, g):
            along = functools.partial(functools.reduce, lambda a, step: step.forward(a), chain)
            return along(g) if batch is None else jax.vmap(along)(g)

        with torch.no_grad():
            out = [new_tensor(through(chain, g)) if reached >> i & 1 else None
                   for g, chain, (i, _) in zip(ctx.call.backward(grads, batch), ctx.call.chains, call.entry.diff)]
            if batch is not None:
                out = _rebatched(out, level)
        return (None, *_gradcut.once_differentiable("t2j.jit", out, (*ctx.inputs, *grads)))


class _SpentGraph(torch.autograd.Function):
    """The history of an output whose autograd graph a jitted call consumed: the function ran
    ``backward()`` inside (a training step), so, as torch's ``loss`` after ``loss.backward()``,
    the output requires grad and a second backward through it is refused."""

    _anchor = None  # a leaf requiring grad, so that the node's outputs require grad

    @staticmethod
    def forward(ctx, anchor, fn, *arrays):
        ctx.fn = fn
        return tuple(new_tensor(a) for a in arrays)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"t2j.jit: trying to backward through the graph of an output of {getattr(ctx.fn, '__qualname__', ctx.fn)} "
            "a second time: the function ran backward() inside its program, which consumed the graph (torch "
            "frees it the same way; with retain_graph or create_graph torch keeps it, t2j.jit does not). Compute "
            "what you need inside the jitted function (higher derivatives too: backward(create_graph=True) or "
            "autograd.grad(..., create_graph=True) there), or jit a function that returns its outputs without "
            "running backward() and call backward() on them after the call."
        )

    @classmethod
    def attach(cls, outs: list, positions, fn):
        """Replace ``outs`` at ``positions`` by the same values carrying this node."""
        if cls._anchor is None:
            cls._anchor = torch.zeros((), requires_grad=True)
        made = cls.apply(cls._anchor, fn, *(outs[k]._value() for k in positions))
        for k, t in zip(positions, made):
            outs[k] = t


def _guarded(entries, slots, storages):
    """The entry whose guards hold for the current hyperparameter values and whose sharded
    state still has the shardings it was traced with, if any."""
    if len(entries) == 1 and not entries[0].guards and not entries[0].shardings:
        return entries[0]
    values = _hyper_values(slots)
    return next((e for e in entries if _sym.guards_hold(e.guards, values, storages) and _shardings_hold(e, storages)),
                None)


def _shardings_hold(entry, storages) -> bool:
    """Whether the sharded state ``entry`` writes still has the shardings it was traced with
    (a spec with trailing Nones is the one without them)."""
    for i, sharding in entry.shardings:
        array = storages[i].array
        if array.sharding != sharding and not sharding.is_equivalent_to(array.sharding, array.ndim):
            return False
    return True


def _hyper_values(slots):
    """The current values of the numbers that are program inputs, in program input order."""
    return [site.read() for site in slots.lifted]


def _hyper_input(site, value, index, hint):
    """What the trace puts where a number that is a program input is read: a param
    group's ``lr`` as a 0-d tensor (torch.optim's tensor-lr code paths; float32, or
    float64 for a group with float64 parameters), any other as a traced number with guards."""
    if isinstance(site, _ArgSite) and isinstance(site.value, jax.Array):  # (the function gets a jax.Array's tracer)
        return value
    if isinstance(site, _GroupSite) and site.hk == "lr" and site.ti is None:
        # torch multiplies by a Python float: a float64 parameter sees all of its digits
        wide = any(p.dtype == torch.float64 for p in site.group["params"])
        return new_tensor(value.astype(jax.numpy.float64 if wide else jax.numpy.float32))
    return _sym.hinted_number(value, index, hint)


def _group_number(site, given, array):
    """What the function left at the hyperparameter ``site``, given as a program input (``given``,
    holding ``array``), where it changed: the lr tensor `_hyper_input` gives, multiplied in place
    (``group["lr"] *= 0.9``) or replaced by a 0-d tensor computed from it, as the Python number
    torch's arithmetic on a float lr leaves there; None where it did not change."""
    now = site.current()
    if now is given:
        written = isinstance(given, Tensor) and array is not None and given._t2j_storage.array is not array
        return _sym.traced_number(now._value()) if written else None
    if type(now) is Tensor and isinstance(given, Tensor) and now.dim() == 0 and now.dtype == given.dtype \
            and not now.requires_grad:
        return _sym.traced_number(now._value())
    return now


def _is_lr_id(where) -> bool:
    """Whether lifted id ``where`` is a param group's ``lr``, which is always an input."""
    return len(where) == 4 and where[2] == "lr" and where[3] is None


def _lifted_name(where) -> str:
    if where[0] == "arg":
        return f"argument {where[1]}"
    if where[0] == "value":
        return where[1]
    if where[0] == "module attribute":
        return f"module #{where[1]} attribute {where[3]!r}"
    if where[0] == "optimizer state":
        return f"optimizer #{where[1]} state[{where[3]}][{where[4]!r}] (param_groups[{where[2]}])"
    return f"optimizer #{where[0]} param_groups[{where[1]}][{where[2]!r}]"


def _exact_guards(entries, slots, lifted_ids) -> list:
    """The lifted ids of the numbers whose exact value (``float(x)``, ``int(x)``) a guard of
    ``entries`` took and that now differ: each new value would be one more trace."""
    if not entries:
        return []
    values = _hyper_values(slots)
    inputs = {i for e in entries for g in e.guards if g.as_type is not bool and not g.holds(values)
              for i in g.inputs}
    return [lifted_ids[i] for i in sorted(inputs) if not _is_lr_id(lifted_ids[i])]


def _set_hyper(group, hk, ti, value):
    if ti is None:
        group[hk] = value
    else:
        group[hk] = tuple(value if i == ti else v for i, v in enumerate(group[hk]))


def _write_back_to_cpu(from_cpu):
    """Copy into each CPU tensor argument what the call wrote into its copy on the device
    (``x.add_(1)`` of a CPU ``x``), as torch's in-place op would have written it."""
    for cpu, on_device, array in from_cpu:
        if on_device._t2j_storage.array is not array:
            with torch.no_grad():
                cpu.copy_(on_device.detach().cpu())


def _to_device(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, Tensor):
        if x.layout != torch.strided:
            raise JitError(f"t2j.jit: got a {x.layout} tensor; t2j.jit takes dense (strided) tensors only: pass "
                           "x.to_dense(), or the sparse tensor's index and value tensors")
        if x.device.type != "cpu":
            raise JitError(f"t2j.jit: got a tensor on {x.device}; use tensors on the jax or cpu device")
        if x.requires_grad:  # a differentiable copy: gradients reach the CPU tensor
            return x.to(_tensor.DEVICE)
        with jax.enable_x64(True):  # int64 / float64 arguments stay 64-bit, as torch has them
            return new_tensor(jax_array(x))
    return x


class _GeneratorArgument(NamedTuple):
    device: str


def _packed_batch_sizes(leaves, args, kwargs) -> frozenset:
    """Positions among ``leaves`` of the ``batch_sizes`` of the PackedSequences among the arguments."""
    packed = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.nn.utils.rnn.PackedSequence)]
    return frozenset(i for i, x in enumerate(leaves) if any(x is p.batch_sizes for p in packed))


def _value_arguments(leaves) -> frozenset:
    """Positions of the arguments a trace may need the values of: short 1-D integer CPU
    tensors, which torch itself wants on the CPU (pack_padded_sequence's ``lengths``, split
    sizes). A trace stopped by a value it could not read tries again with these kept on the
    CPU, their values constants of the program and part of the cache key."""
    return frozenset(i for i, x in enumerate(leaves)
                     if isinstance(x, torch.Tensor) and not isinstance(x, Tensor) and x.device.type == "cpu"
                     and x.dim() == 1 and x.numel() <= 1024 and not (x.is_floating_point() or x.is_complex()))


def _static_key(leaves, numbers=(), by_value=None):
    """The arguments that are not tensors, as the cache key holds them; ``numbers`` (from
    `JitFunction._number_arguments`) are program inputs, keyed by their type alone; the CPU
    tensors at positions ``by_value`` by their values."""
    out = []
    lifted = {site.index for site, _ in numbers}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            out.append((x.dtype, tuple(x.tolist())) if by_value and i in by_value else None)
            continue
        if i in lifted:
            out.append(_ArrayArgument(x.shape, x.dtype, getattr(x, "weak_type", False)) if isinstance(x, jax.Array)
                       else _LiftedNumber(type(x)))
            continue
        if isinstance(x, torch._C.Generator):  # drawn from on each call (`_keys`): any generator will do
            out.append(_GeneratorArgument(x.device.type))
            continue
        try:
            hash(x)
            out.append(x)
        except TypeError:
            out.append(("id", id(x)))
    return tuple(out)


def _snapshot(slots, roots):
    """What a failed trace must put back: slot contents, optimizer state dicts, the
    tensors in the places the function can assign to (`_Places`) and the slot tensors'
    hooks (``x.register_hook`` in a trace that stops is registered again by the eager run)."""
    pointed = [(setter, t) for setter, t in zip(slots.setters, slots.tensors) if setter is not None]
    # (each parameter's dict and what it held: LBFGS's step keeps ``state = self.state[p]`` across its closure's calls)
    opt_states = [(opt, {p: (st, dict(st)) for p, st in opt.state.items()}) for opt in roots.optimizers]
    hooks = [(t, set(t._backward_hooks or ()), set(t._post_accumulate_grad_hooks or ()))
             for t in slots.tensors if t is not None]
    return pointed, opt_states, _Places(roots), hooks


def _traced_hyperparameters(optimizers, lifted) -> list:
    """The ids (`_Hyperparameters`) of the float hyperparameters that a trace set to a traced number
    (``group["momentum"] = m`` of a number argument) where they are not program inputs (``lifted``
    sites): the trace runs again with them as inputs, whose new values are stored after each call."""
    inputs = {(id(site.group), site.hk, site.ti) for site in lifted if isinstance(site, _GroupSite)}
    found = []
    for k, opt in enumerate(optimizers):
        for gi, group in enumerate(opt.param_groups):
            for hk, hv in group.items():
                if hk == "params":
                    continue
                parts = enumerate(hv) if type(hv) is tuple else [(None, hv)]
                found += [(k, gi, hk, ti) for ti, v in parts
                          if _sym.is_traced_number(v) and (id(group), hk, ti) not in inputs]
    return found


# CPU tensors up to this many elements that a function reaches are copied before each trace, so that
# a trace that stops puts back what it changed in place (`_python_places`)
_CPU_COPY_LIMIT = 1 << 16


def _python_places(roots):
    """What a trace that stops must put back before the call runs eagerly or is traced again, so that
    the function's Python side effects happen once (``G += 1``, ``o.n += 1``, ``cfg["k"] += 1``,
    ``ema.mul_(0.5)`` of a CPU tensor): the items of the lists and dicts and the attributes of the
    objects it reaches, the globals its code names, its closure cells, and copies of the small CPU
    tensors it reaches (larger ones by their version counters only, `_restore_python_places`)."""
    objects = []
    for obj in [*roots.objects, *(group for opt in roots.optimizers for group in opt.param_groups)]:
        if isinstance(obj, list):
            objects.append((obj, list(obj)))
        elif isinstance(obj, dict):
            objects.append((obj, list(obj.items())))
        else:
            objects.append((obj, dict(vars(obj))))
    names = [(g, name, g.get(name, _MISSING)) for g, used in roots.globals for name in used]
    cells = [(cell, _cell_value(cell)) for cell in roots.cells]
    cpu = [(t, _cpu_version(t), t.detach().clone() if t.numel() <= _CPU_COPY_LIMIT else None)
           for t in roots.cpu_tensors]
    return objects, names, cells, cpu


def _restore_python_places(places):
    objects, names, cells, cpu = places
    for obj, before in objects:
        if isinstance(obj, list):
            if len(obj) != len(before) or any(a is not b for a, b in zip(obj, before)):
                obj[:] = before
        elif isinstance(obj, dict):
            if len(obj) != len(before) or any(k is not j or v is not w for (k, v), (j, w) in zip(obj.items(), before)):
                obj.clear()
                obj.update(before)
        else:
            now = vars(obj)
            for k in [k for k in now if k not in before]:
                del now[k]
            for k, v in before.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
    for g, name, value in names:
        if g.get(name, _MISSING) is not value:
            if value is _MISSING:
                g.pop(name, None)
            else:
                g[name] = value
    for cell, value in cells:
        _put("cell", cell, None, value)
    for t, version, saved in cpu:
        if _cpu_version(t) != version:
            if saved is None:
                warnings.warn(f"t2j.jit: a trace that stopped changed a CPU tensor of shape {list(t.shape)} in "
                              "place; the eager run of the call changes it again", stacklevel=4)
            else:  # (an inference tensor is written only inside inference_mode)
                with torch.inference_mode() if t.is_inference() else torch.no_grad():
                    t.copy_(saved)


def _restore(snapshot):
    pointed, opt_states, places, hooks = snapshot
    for setter, t in pointed:
        setter(t)
    for opt, states in opt_states:
        opt.state.clear()
        for p, (st, items) in states.items():
            st.clear()
            st.update(items)
            opt.state[p] = st
    places.restore(lists=True)
    for t, backward, post_accumulate in hooks:
        for h, keys in ((t._backward_hooks, backward), (t._post_accumulate_grad_hooks, post_accumulate)):
            for k in (h.keys() - keys if h else ()):
                del h[k]


def _put(kind, container, key, value):
    """Store ``value`` at a place (`_Places`): ``_MISSING`` deletes what is there."""
    if kind == "attr":
        now = getattr(container, key, _MISSING)
        if now is value:
            return
        if value is _MISSING:
            delattr(container, key)
        else:
            setattr(container, key, value)
    elif kind == "cell":
        if value is _MISSING:
            del container.cell_contents
        elif _cell_value(container) is not value:
            container.cell_contents = value
    elif isinstance(container, list):  # (an item replaced: a list that grows or shrinks traces again)
        if key < len(container) and value is not _MISSING and container[key] is not value:
            container[key] = value
    elif value is _MISSING:
        container.pop(key, None)
    elif key not in container or container[key] is not value:
        container[key] = value


class _Places:
    """The places where a function can store a tensor (or a traced number) by plain assignment, as they were:
    plain attributes of its modules and of the objects it reaches, items of its lists and
    dicts, its closure cells and the globals its code names. After a trace, `moved` lists
    each place that got another tensor (or lost one): ``self.cache = self.cache + x``, the
    program's output stored in a module. A cached call must repeat that store, or the next
    call would read the tensor the trace left there."""

    def __init__(self, roots: _Roots):
        # (kind, container, its values then, whether only those keys count: a module's globals)
        self.places = [("attr", sub, dict(sub.__dict__), False) for m in roots.modules for sub in _submodules(m)]
        for o in roots.objects:
            if isinstance(o, dict):
                self.places.append(("item", o, dict(o), False))
            elif isinstance(o, list):
                self.places.append(("item", o, dict(enumerate(o)), False))
            else:
                self.places.append(("attr", o, dict(vars(o)), False))
                # and the lists and dicts it holds (a ring buffer's ``self.items[self.ptr] = t``)
                for v in vars(o).values():
                    if type(v) is dict:
                        self.places.append(("item", v, dict(v), False))
                    elif type(v) is list:
                        self.places.append(("item", v, dict(enumerate(v)), False))
        self.places += [("cell", cell, {None: _cell_value(cell)}, True) for cell in roots.cells]
        self.places += [("item", g, {n: g.get(n, _MISSING) for n in names}, True) for g, names in roots.globals]

    def sized(self, read) -> list:
        """The containers among ``read`` (id -> container whose ``len`` the trace read) that these places
        are or hold: lists, a replay memory's deque (``if len(self.memory) < batch_size: return``)."""
        held = {id(c): c for _, c, _, _ in self.places}
        held.update((id(v), v) for _, _, before, _ in self.places for v in before.values())
        return [c for i, c in read.items() if i in held and held[i] is c]

    def _now(self, kind, container, before):
        if kind == "cell":
            return {None: _cell_value(container)}
        if kind == "attr":
            return vars(container)
        if isinstance(container, list):
            # an append changes the list's length, and so the slots: a new trace, not a store
            return dict(enumerate(container)) if len(container) == len(before) else before
        return container

    def moved(self) -> list:
        """(kind, container, key, value) per place whose tensor is another now (``value``:
        ``_MISSING`` where it was deleted)."""
        out = []
        for kind, container, before, fixed in self.places:
            now = self._now(kind, container, before)
            for key in before.keys() if fixed else before.keys() | now.keys():
                old, new = before.get(key, _MISSING), now.get(key, _MISSING)
                if old is not new and (isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor)
                                       or _sym.is_traced_number(new) or _holds_traced(old) or _holds_traced(new)):
                    out.append((kind, container, key, new))
        return out

    def put_back_since(self, before: list) -> list:
        """Put back what was in each place that got another value since ``before`` (what `moved`
        gave then); the (container, key) of those places."""
        then = {(id(c), k): v for _, c, k, v in before}
        start = {id(c): b for _, c, b, _ in self.places}
        changed = [(kind, c, k) for kind, c, k, v in self.moved() if then.get((id(c), k), _MISSING) is not v]
        for kind, c, k in changed:
            _put(kind, c, k, then.get((id(c), k), start[id(c)].get(k, _MISSING)))
        return [(c, k) for _, c, k in changed]

    def take_rewritten(self) -> list:
        """(list, recipe) per list holding no tensors whose items the trace changed
        (numbers appended, ``losses.append(loss.item())``; a window's ``pop(0)``), put back as it was:
        each call makes the same change with its own values (`_extend`, `_rewrite`). The recipe is
        ``("extend", new items)`` where the list only grew, else ``("rewrite", `_list_rewrite`)``."""
        out = []
        for _, container, before, _ in self.places:
            if not isinstance(container, list):
                continue
            old = list(before.values())
            if len(container) == len(old):  # (numbers changed in place are program inputs: `number_sites`)
                continue
            if any(map(_holds_tensor, old)) or any(map(_holds_tensor, container)):
                continue
            new = container[:]
            container[:] = old
            if len(new) >= len(old) and all(map(operator.is_, old, new)):
                out.append((container, ("extend", new[len(old):])))
                continue
            out.append((container, ("rewrite", _list_rewrite(old, new))))
        return out

    def restore(self, lists: bool = False):
        """Put back the tensors that were in these places (a failed or unexecuted trace), and take
        off the lists the traced numbers appended to them. ``lists``: every list that got a tensor
        as it was (a trace that stops: the tensors it added are placeholders that never get values;
        its other changes stay, as any Python side effect of a trace)."""
        then = {id(container): before for _, container, before, _ in self.places}
        for kind, container, key, _ in self.moved():
            _put(kind, container, key, then[id(container)].get(key, _MISSING))
        self.take_rewritten()
        if lists:
            for _, container, before, _ in self.places:
                kept = {id(v) for v in before.values()}
                if isinstance(container, list) and any(
                        id(v) not in kept and (isinstance(v, torch.Tensor) or _holds_traced(v)) for v in container):
                    container[:] = before.values()


def _extend(container, values):
    container.extend(values)


def _list_rewrite(old: list, new: list) -> tuple:
    """(layout, new values) that make list ``old`` into ``new`` (`_rewrite`): per item of ``new``, the
    index of the same object in ``old``, or None for the next of the new values."""
    # (small ints, True, None are one object wherever they are: such an item is taken as a new value)
    where = {id(v): i for i, v in reversed(list(enumerate(old))) if not isinstance(v, (int, str, type(None)))}
    layout = tuple(where.get(id(v)) for v in new)
    return layout, [v for v, i in zip(new, layout) if i is None]


def _rewrite(container, layout, values):
    """Make ``container`` the list a trace left (`_Places.take_rewritten`): ``layout`` gives each item as
    the index of the item it had before the call, or None for the next of ``values``."""
    values = iter(values)
    container[:] = [next(values) if i is None else container[i] for i in layout]


def _holds_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) or any(isinstance(v, torch.Tensor) for v in _container_leaves(value))


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


_MODULE_DICTS = ("_parameters", "_buffers", "_modules", "_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                 "_backward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs")


def _module_structure(roots) -> list:
    """What a failed trace must put back of its modules before the call runs eagerly: their
    attributes, parameters, buffers, submodules and hooks (``prune.l1_unstructured`` inside the
    function swaps a parameter for ``weight_orig``, a mask buffer and a hook)."""
    return [(sub, dict(sub.__dict__), [(d, dict(d)) for d in (sub.__dict__.get(n) for n in _MODULE_DICTS)
                                       if isinstance(d, dict)])
            for m in roots.modules for sub in _submodules(m)]


def _restore_structure(saved):
    for sub, attributes, dicts in saved:
        for d, items in dicts:
            if d.keys() != items.keys() or any(d[k] is not v for k, v in items.items()):
                d.clear()
                d.update(items)
        if sub.__dict__.keys() != attributes.keys() or any(sub.__dict__[k] is not v for k, v in attributes.items()):
            sub.__dict__.clear()
            sub.__dict__.update(attributes)


def _slot_id(setter):
    return (setter.func, *(a if isinstance(a, str) else id(a) for a in setter.args))


def _owned(slots: _Slots, post) -> tuple:
    """`_Entry.owned`: the parameters (leaves of the state requiring grad) a program sets the ``.grad`` and
    optimizer state of, but for the slots each call points to a new tensor (``post``)."""
    repointed = {k for _, _, k, _ in post}
    return tuple((i, id(t)) for i, t in enumerate(slots.tensors[:slots.first_argument])
                 if t is not None and t.requires_grad and t.is_leaf and i not in repointed)


def _repointed(pre: _Slots, post: _Slots, pre_index):
    """(setter, target, slot) for every slot that points to another tensor after the
    trace: target is the index of a slot tensor before the call, a tensor the trace
    created, or None; slot is the index of the same slot before the call (None for a
    slot the trace created, such as new optimizer state). A frozen parameter's ``.grad`` that
    the trace cleared (``zero_grad()``) is no slot after it, and is set to None. The fourth
    element is the slot of the argument tensor whose ``.grad`` the setter sets, if it is one's."""
    before = {_slot_id(s): k for k, s in enumerate(pre.setters) if s is not None}
    out = []
    for setter, t in zip(post.setters, post.tensors):
        k = before.pop(_slot_id(setter), None) if setter is not None else None
        if setter is None or (k is not None and pre.tensors[k] is t):
            continue
        out.append((setter, pre_index.get(id(t), t) if t is not None else None, k, _argument_of(setter, pre, pre_index)))
    for k in before.values():
        setter = pre.setters[k]
        if setter.func is _set_grad and pre.tensors[k] is not None and setter.args[0].grad is None:
            out.append((setter, None, k, _argument_of(setter, pre, pre_index)))
    return out


def _renewable(post, new_storages, out_leaves) -> dict:
    """The `_Entry` fields ``renewable`` and ``returned``: the slots ``post`` points to tensors the trace
    made, each on a storage of its own (a ``.grad`` that ``zero_grad()`` cleared and ``backward()`` set,
    a buffer assigned anew), and those of them the function returns.

    Torch gives such a slot a new tensor on every call, so a reference kept from one call (``g =
    p.grad``, a list of gradients, a returned ``.grad``) keeps that call's values. A program's call
    writes its new arrays into the tensors its trace made instead (renewing them costs every
    parameter's ``.grad`` setter each call); `_renew_escaped` gives a slot a new tensor before a call
    when its last one is referenced from outside.
    """
    made = {id(st) for st in new_storages}
    owners = collections.Counter(id(target._t2j_storage) for _, target, _, _ in post if isinstance(target, Tensor))
    renewable = tuple(k for k, (_, target, _, argument) in enumerate(post)
                      if type(target) is Tensor and argument is None and not target.requires_grad
                      and id(target._t2j_storage) in made and owners[id(target._t2j_storage)] == 1)
    returned = frozenset(k for k in renewable
                         if any(kind[0] == "const" and kind[1] is post[k][1] for kind in out_leaves))
    return {"renewable": renewable, "returned": returned}


def _reference_counts(entry) -> list:
    """The reference counts of the tensors in ``entry``'s renewable slots, measured where a jitted function
    holds nothing of the call's: the same measure before the next call tells whether the program kept one."""
    post = entry.post
    return [sys.getrefcount(post[k][1]) for k in entry.renewable]


def _renew_escaped(entry, counts):
    """Give each renewable slot of ``entry`` whose tensor gained a reference since the last call (or that
    the function returns) a new tensor on a storage of its own, in the program's outputs and in the slot
    (set by the next call): the old tensor keeps the last call's values, as torch's would."""
    for k, before, now in zip(entry.renewable, counts, _reference_counts(entry)):
        if now <= before and k not in entry.returned:
            continue
        setter, old, slot, argument = entry.post[k]
        new = Tensor(Storage(old._t2j_storage.array), old._t2j_view, value=old._value(), size=old.shape,
                     stride=old.stride(), offset=old.storage_offset(), dtype=old.dtype)
        j = next(j for j, st in enumerate(entry.new_storages) if st is old._t2j_storage)
        entry.new_storages[j] = new._t2j_storage
        entry.post[k] = (setter, new, slot, argument)
        entry.out_leaves = [("const", new) if kind[0] == "const" and kind[1] is old else kind
                            for kind in entry.out_leaves]


def _argument_of(setter, slots: _Slots, index) -> int | None:
    """The slot of the argument tensor whose ``.grad`` ``setter`` sets, if it is an argument's."""
    if setter.func is not _set_grad:
        return None
    k = index.get(id(setter.args[0]))
    return k if k is not None and k >= slots.first_argument else None


def _argument_flags(slots: _Slots, flags) -> tuple:
    """(slot, requires_grad) for each argument or state tensor whose flag the trace changed
    (``x.requires_grad_()``, ``layer.requires_grad_(False)``): every call changes it so."""
    return tuple((k, t.requires_grad) for k, (t, flag) in enumerate(zip(slots.tensors, flags))
                 if t is not None and t.requires_grad != flag)


def _unindexed(sig):
    return sig if sig is None else sig[:3] + sig[4:]


def _describe_sig(sig):
    if sig is None:
        return "None"
    shape, dtype, requires_grad, view = sig
    text = f"{dtype} {list(shape)}" + (" requires_grad" if requires_grad else "")
    return text + (f" view{view}" if view else "")


def _static_change(key, old, new) -> str:
    """Says how the Python value a trace depends on under ``key`` changed."""
    kind, k, what, *where = key
    if kind == "module":
        label = f"module #{k} {what} flags"
    elif kind == "python":
        # ((where, value) pairs, in the order the walk found them: two hooks' closures may name a value alike)
        pairs = itertools.zip_longest(() if old is _MISSING else old, () if new is _MISSING else new,
                                      fillvalue=(None, _MISSING))
        (where, old), (other, new) = next((a, b) for a, b in pairs if a != b)
        label = f"the Python value {where or other}"
    elif kind == "cpu":
        label = f"captured CPU tensor #{k} (the trace reads its value)"
    elif what == "state":
        label = f"optimizer #{k} state of param_groups[{where[0]}]"
        if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
            # one entry per parameter: name the first that differs, and the first of its items that does
            pi = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
            label, old, new = f"{label}.params[{pi}]", old[pi], new[pi]
            if isinstance(old, tuple) and isinstance(new, tuple):
                olds, news = dict(map(_state_item, old)), dict(map(_state_item, new))
                name = next(n for n in (*olds, *news) if olds.get(n, _MISSING) != news.get(n, _MISSING))
                label, old, new = f"{label}[{name!r}]", olds.get(name, _MISSING), news.get(name, _MISSING)
    else:
        label = f"optimizer #{k} param_groups[{where[0]}] hyperparameters"
    return f"{label}: {_brief(old)} -> {_brief(new)}"


def _state_item(entry) -> tuple:
    """(name, summary) of an entry of an optimizer state's layout (`_Walk.optimizer`): a tensor's name
    alone, or a Python value's (name, value)."""
    return (entry, _TENSOR) if isinstance(entry, str) else entry


def _python_values_of(key):
    """The Python values (`_Roots.python_values`) cache key ``key`` was made with."""
    return dict(_key_parts(key[2])[2]).get(_PYTHON_VALUES)


def _unguarding(key, where):
    """Cache key ``key`` without the Python values named in ``where`` (see `_Roots.unguarded`)."""
    spec, static_args, (state_key, sig, avals), *rest = key
    ssig, savals, static, lifted = state_key
    static = tuple((name, tuple(v for v in value if v[0] not in where)) if name == _PYTHON_VALUES
                   else (name, value) for name, value in static)
    return (spec, static_args, (_Key((ssig, savals, static, lifted)), sig, avals), *rest)


def _key_parts(slots_key):
    """(signatures, avals, static values, lifted hyperparameters) of all slots, from a `_Slots` key."""
    (sig, avals, static, lifted), args_sig, args_avals = slots_key
    return sig + args_sig, avals + args_avals, static, lifted


def _diff(old, old_names, new, new_names):
    """Why key ``new`` missed the cache, compared with ``old`` (the latest entry)."""
    (ospec, ostatic, oslots, *orest), (nspec, nstatic, nslots, *nrest) = old, new
    if ospec != nspec:
        return f"the structure of the arguments changed: {ospec} -> {nspec}"
    for i, (a, b) in enumerate(zip(ostatic, nstatic)):
        if a != b:
            return f"static argument {i} changed: {a!r} -> {b!r}"
    reasons = []
    oslots, nslots = _key_parts(oslots), _key_parts(nslots)
    # the storage index only says which slots alias each other: compared last
    osig = {n: _unindexed(g) for n, g in zip(old_names, oslots[0])}
    nsig = {n: _unindexed(g) for n, g in zip(new_names, nslots[0])}
    for name in list(dict.fromkeys(list(osig) + list(nsig))):
        a, b = osig.get(name, _MISSING), nsig.get(name, _MISSING)
        if a != b:
            a = "absent" if a is _MISSING else _describe_sig(a)
            b = "absent" if b is _MISSING else _describe_sig(b)
            reasons.append(f"{name}: {a} -> {b}")
    ostat, nstat = dict(oslots[2]), dict(nslots[2])
    for name in list(dict.fromkeys(list(ostat) + list(nstat))):
        if ostat.get(name, _MISSING) != nstat.get(name, _MISSING):
            reasons.append(_static_change(name, ostat.get(name, _MISSING), nstat.get(name, _MISSING)))
    # the key ends with: the arguments passed as copies, torch2jax's settings, grad mode, inference mode,
    # autocast enabled, autocast dtype, the default dtype, the hooks (`JitFunction._hooks_key`), the guarded
    # lists' lengths
    if orest[-9] != nrest[-9]:
        reasons.append(f"the argument views passed as copies of their values (`_view_copies`): {orest[-9]} -> "
                       f"{nrest[-9]}")
    if orest[-8] != nrest[-8]:
        reasons.append(f"settings: {orest[-8]} -> {nrest[-8]}")
    if orest[-7] != nrest[-7]:
        reasons.append(f"grad mode: {orest[-7]} -> {nrest[-7]}")
    if orest[-6] != nrest[-6]:
        reasons.append(f"inference mode: {orest[-6]} -> {nrest[-6]}")
    if orest[-5:-3] != nrest[-5:-3]:
        reasons.append(f"autocast (enabled, dtype): {tuple(orest[-5:-3])} -> {tuple(nrest[-5:-3])}")
    if orest[-3] != nrest[-3]:
        reasons.append(f"torch's default dtype: {orest[-3]} -> {nrest[-3]}")
    if orest[-2] != nrest[-2]:
        reasons.append("a gradient hook on a tensor it reads or an optimizer step hook was added or removed")
    if orest[-1] != nrest[-1]:
        reasons.append(f"the lengths of lists it reads (``len(hist)``): {orest[-1]} -> {nrest[-1]}")
    if not reasons and oslots[1] != nslots[1]:
        reasons.append("the shapes or dtypes of captured storages changed")
    if not reasons and orest != nrest:
        reasons.append("new tensors read by the function were added as inputs")
    if not reasons:
        return "the aliasing between tensors changed"
    more = f" (and {len(reasons) - 3} more)" if len(reasons) > 3 else ""
    return "; ".join(reasons[:3]) + more


def jit(fn=None, *, donate: bool = True, fullgraph: bool = False):
    """Compile a torch function into one XLA program, with the state it touches.

    ``fn`` takes and returns torch tensors (and any other Python values). Tensor
    arguments are traced; other arguments are static and part of the cache key,
    but a Python number that changes between calls becomes a traced input.
    Module parameters, buffers and gradients, optimizer state and the RNG key that
    ``fn`` reads or writes are carried in and out (see this module's docstring),
    so ``fn`` may run a whole training step. With ``donate`` (default) the input
    buffers of state that ``fn`` overwrites are donated to the program.

    A function whose trace stops at something only an eager run can do (an op whose
    output shape depends on tensor values, such as ``nonzero`` or ``x[mask]``; Python
    control flow on a tensor's value; ``.tolist()``) runs eagerly for those
    arguments, with a one-time warning, as torch.compile does at a graph break;
    ``fullgraph=True`` raises the error instead.

    >>> @t2j.jit
    ... def step(x, y):
    ...     opt.zero_grad()
    ...     loss = F.mse_loss(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> loss = step(x, y)            # traced and compiled once, then cached

    A jitted forward is differentiable from outside:

    >>> forward = t2j.jit(model)
    >>> F.mse_loss(forward(x), y).backward()   # fills model's .grad
    """
    if fn is None:
        return functools.partial(jit, donate=donate, fullgraph=fullgraph)
    return JitFunction(fn, donate=donate, fullgraph=fullgraph)


def explain_recompiles() -> list:
    """Why every `t2j.jit` function retraced so far, oldest first (also logged to
    the ``torch2jax.jit`` logger at INFO level)."""
    return list(_RECOMPILES)
