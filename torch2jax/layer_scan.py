"""Stacks of layers run as one ``lax.scan``: `scan_layers` and `use_scan_layers`.

A deep model's layers are traced once for all of them: their parameters are
stacked and a ``lax.scan`` runs one traced body over the stack, so the model
compiles one layer instead of dozens.

What the traced body may assume about the layers it stands for is checked, not
hoped for. Layers are compared by *signature*: their modules' classes, the names,
shapes and dtypes of their parameters and buffers, and the plain Python
attributes of every submodule (``training``, ``sliding_window``, a per-layer
``attention_type``, the hooks registered on it). The layers one body runs must
have equal signatures:

- Layers that alternate (Gemma 2's sliding and full attention, Gemma 3's five
  sliding layers and one full, a hybrid model's repeating pattern) repeat with a
  *period* ``p``: the scan's body runs ``p`` consecutive layers, one of each kind.
- An attribute that differs in every layer (``layer_idx``, which HF layers only
  read with a KV cache) is hidden from the traced body; if the body reads it after
  all, the layers run one by one (`_PerLayerRead`).
- Layers that fit no pattern (DeepSeek-V3's first dense layers before its MoE
  layers) run one by one, and the scan covers the part of the stack that does.
  A run of alike layers that another layer ends (Gemma 3's first five sliding
  layers when the stack is too short for its period to repeat) is a scan of its own.
- A transformers KV cache given to the layers is stood in for: the body's
  ``cache.update(k, v, self.layer_idx)`` updates a copy of each layer's own cache,
  written back after the scan (`_CacheScan`).
- A layer with a hook of its own runs as it is (torch runs the hook once per
  layer), but for a hook that does nothing in this call (`_inert_now`:
  transformers' output-capturing hooks while the call collects no outputs); a
  body that stores a value in its layer (``self.aux_loss = ...``) makes the
  layers run one by one (`_LayerStores`).

`use_scan_layers` also checks the *arguments*: the model's own loop
(``for i, layer in enumerate(self.layers): h = layer(h, mask=masks[types[i]])``)
calls each layer through a `_LayerCall`, and a scan assumes that layer ``k``
gets the arguments layer ``k - p`` got. A call that breaks the assumption (other
arguments, a hidden state other than the previous layer's output, attributes the
loop changed) is run as it is, the scan's results for the layers from there on
discarded (the buffers it wrote put back), never used.
"""

from __future__ import annotations

import enum
import functools
import types
import warnings

import jax
import torch
import torch.utils._pytree as torch_pytree

from .control_flow import (ControlFlowError, _apply, _carried, _check_carry, _flatten, _folding_transposes, _on_host,
                           _run_body, _state_values, _Structure, _with_state, _write_back)
from . import gradcut as _gradcut
from .env import default_rng as _rng
from .tensor import Tensor, new_tensor

# ---------------------------------------------------------------------------
# layer signatures
# ---------------------------------------------------------------------------

_PLAIN = (type(None), bool, int, str, bytes, torch.dtype, torch.device, enum.Enum)
# module internals compared by structure (`_structure`), not as attributes
_CONTAINERS = frozenset({"_parameters", "_buffers", "_modules"})


def _value_key(v, depth=0, memo=None):
    """A hashable stand-in for an attribute value: plain values, containers of them, helper
    objects (a ``functools.partial``, an activation's callable, a shared config) and
    functions (by code and closure) by value; a tensor that is no parameter, a module held
    as a plain attribute and anything past three levels by identity."""
    if isinstance(v, float):
        return ("float", repr(v))  # (repr: NaN equals NaN)
    if isinstance(v, _PLAIN):
        return (type(v).__name__, v)
    memo = {} if memo is None else memo
    if id(v) in memo:
        return memo[id(v)]
    key = ("object", id(v))
    if depth < 3 and not isinstance(v, (torch.Tensor, torch.nn.Module)):
        sub = functools.partial(_value_key, depth=depth + 1, memo=memo)
        if isinstance(v, (tuple, list, set, frozenset)) and len(v) <= 256:
            items = [sub(x) for x in v]
            key = (type(v).__name__, tuple(sorted(items, key=repr) if isinstance(v, (set, frozenset)) else items))
        elif isinstance(v, dict) and len(v) <= 256:
            key = (type(v).__name__, tuple((sub(k), sub(x)) for k, x in v.items()))
        elif isinstance(v, functools.partial):
            key = ("partial", sub(v.func), sub(v.args), sub(v.keywords))
        elif isinstance(v, types.FunctionType):
            cells = tuple(c.cell_contents for c in v.__closure__ or ())
            key = ("function", id(v.__code__), sub(cells), sub(v.__defaults__), sub(v.__kwdefaults__))
        elif isinstance(v, types.MethodType):
            owner = v.__self__
            key = ("method", sub(v.__func__), type(owner) if isinstance(owner, torch.nn.Module) else sub(owner))
        elif hasattr(v, "__dict__") and not isinstance(v, (type, types.ModuleType)) and len(vars(v)) <= 256:
            key = (type(v), sub(vars(v)))
    memo[id(v)] = key
    return key


def _hooks_key(hooks):
    # a hook runs once per layer in torch, with that layer's output (a side effect, such as recording
    # activations): a layer that has one is unlike the others (one in each layer: read, so one by one)
    if hooks and all(map(_inert_now, hooks.values())):
        hooks = None
    return ("hooks", ("object", id(hooks)) if hooks else ())


def _inert_now(hook) -> bool:
    """Whether ``hook`` does nothing in this call, so that the traced body may run it for every layer:
    transformers' output-capturing hooks, which the first call with ``output_hidden_states`` or
    ``output_attentions`` installs on the layers for good, record only while a call collects outputs."""
    if getattr(hook, "__module__", None) != "transformers.utils.output_capturing" or not hook.__closure__:
        return False
    from transformers.utils import output_capturing

    collecting = output_capturing._active_collector.get()  # (the outputs this call collects, by name)
    key = dict(zip(hook.__code__.co_freevars, (c.cell_contents for c in hook.__closure__))).get("key")
    return collecting is None or key is not None and key not in collecting


def _attributes(layer: torch.nn.Module, memo: dict) -> dict:
    """``(submodule path, attribute name) -> value key`` for every plain attribute of ``layer``'s modules."""
    out = {}
    for path, m in layer.named_modules(remove_duplicate=False):
        for name, v in vars(m).items():
            if name in _CONTAINERS or name.startswith("_t2j_"):
                continue
            out[(path, name)] = _hooks_key(v) if name.endswith("hooks") and isinstance(v, dict) \
                else _value_key(v, memo=memo)
    return out


def _structure(layer: torch.nn.Module, stacked: dict) -> tuple:
    """Classes of ``layer``'s modules, and names, shapes and dtypes of its parameters (also
    those stored stacked, in ``stacked``: name -> this layer's slice) and buffers."""
    params = {n: p for n, p in stacked.items()}
    params.update(layer.named_parameters())
    return (tuple((path, type(m)) for path, m in layer.named_modules(remove_duplicate=False)),
            tuple((n, p.dtype, tuple(p.shape)) for n, p in params.items()),
            tuple((n, b.dtype, tuple(b.shape)) for n, b in layer.named_buffers()))


class _Signatures:
    """The layers' signatures (module docstring). ``hidden``: the attributes whose value
    differs in every layer, left out of the signatures and hidden from the traced body;
    ``read``: attributes known to be read, which stay in the signatures however they vary."""

    def __init__(self, layers, stacked, read=frozenset()):
        self.structures = [_structure(m, {n: s[k] for n, s in stacked.items()}) for k, m in enumerate(layers)]
        memo = {}
        attrs = [_attributes(m, memo) for m in layers]
        names = sorted(set().union(*attrs))
        # (distinct among the layers that have it: a hybrid model's conv layers hold ``conv.layer_idx``,
        # its attention layers ``self_attn.layer_idx``)
        self.hidden = {name for name in names if name not in read
                       and len(have := [a[name] for a in attrs if name in a]) > 1 and len(set(have)) == len(have)}
        self.kept = [name for name in names if name not in self.hidden]
        self.stacked = stacked
        self.sigs = [self._signature(s, a) for s, a in zip(self.structures, attrs)]

    def _signature(self, structure, attrs):
        return structure, tuple(attrs.get(name) for name in self.kept)

    def now(self, k, layer) -> tuple:
        """Layer ``k``'s signature as it is now (the loop may set its attributes before calling it)."""
        stacked = {n: s[k] for n, s in self.stacked.items()}
        return self._signature(_structure(layer, stacked), _attributes(layer, {}))

    def repeats(self, start, p):
        """Whether the layers from ``start`` on repeat with period ``p``."""
        return all(self.sigs[j] == self.sigs[j - p] for j in range(start + p, len(self.sigs)))

    def run_length(self, start) -> int:
        """How many layers from ``start`` on are alike (with period 1), the list's end or not."""
        return next((j for j in range(start + 1, len(self.sigs)) if self.sigs[j] != self.sigs[start]),
                    len(self.sigs)) - start

    def period(self, start):
        """The smallest period with which the layers from ``start`` on repeat at least twice, or None."""
        return next((p for p in range(1, (len(self.sigs) - start) // 2 + 1) if self.repeats(start, p)), None)

    def first_difference(self, k) -> str:
        """How layer ``k``'s parameters or modules differ from layer 0's, in words."""
        (mods0, params0, bufs0), (mods, params, bufs) = self.structures[0], self.structures[k]
        for what, a, b in (("parameter", params, params0), ("buffer", bufs, bufs0)):
            for x, y in zip(a, b):
                if x != y:
                    return f"{what} {x[0]} is {x[1]}{list(x[2])} but {y[0]} is {y[1]}{list(y[2])} in layer 0"
            if len(a) != len(b):
                return f"it has {len(a)} {what}s, layer 0 has {len(b)}"
        for x, y in zip(mods, mods0):
            if x != y:
                return f"its module {x[0] or '(the layer)'} is a {x[1].__name__}, in layer 0 a {y[1].__name__}"
        return "its Python attributes differ"


# ---------------------------------------------------------------------------
# attributes hidden from the traced body
# ---------------------------------------------------------------------------


class _PerLayerRead(Exception):
    """The traced body read an attribute whose value differs in every layer (`_Hidden`)."""

    def __init__(self, path, name):
        super().__init__(f"{path}.{name}" if path else name)
        self.key = (path, name)


class _LayerStores(Exception):
    """The traced body stored a value in a layer's attribute (``self.aux_loss = ...``): each layer
    stores its own in torch, the body's would be a placeholder of the trace (`_Stores`)."""

    def __init__(self, path, name):
        super().__init__(f"{path}.{name}" if path else name)


def _plain_attributes(module) -> dict:
    return {k: v for k, v in vars(module).items() if k not in _CONTAINERS and not k.startswith("_t2j_")}


class _Stores:
    """Checks that calling a template changed none of its modules' plain attributes (`_LayerStores`),
    putting back what it did change."""

    def __init__(self, layer):
        self.subs = [(path, sub, _plain_attributes(sub)) for path, sub in layer.named_modules(remove_duplicate=False)]

    def check(self):
        for path, sub, before in self.subs:
            now = _plain_attributes(sub)
            changed = [k for k in before.keys() | now.keys() if before.get(k, self) is not now.get(k, self)]
            if changed:
                for k in changed:
                    sub.__dict__.pop(k, None)
                sub.__dict__.update({k: before[k] for k in changed if k in before})
                raise _LayerStores(path, changed[0])


class _StackedAccess:
    """Mixed into the class of a module whose parameters were moved into a stacked
    Parameter: reading ``module.weight`` gives its layer's slice of the stack (a
    view, so autograd reaches the stack), or inside the scan the slice being run."""

    def __getattr__(self, name):
        refs = self.__dict__.get("_t2j_stacked_refs")
        if refs is not None and name in refs:
            override = self.__dict__.get("_t2j_slices")
            if override is not None and name in override:
                return override[name]
            owner, key, index = refs[name]
            return owner._parameters[key][index]
        return super().__getattr__(name)


@functools.lru_cache(maxsize=None)
def _with_stacked_access(cls):
    return type(cls.__name__, (_StackedAccess, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


class _HiddenAttribute:
    """A data descriptor standing for an attribute hidden from the traced body (`_Hidden`): reading
    it raises `_PerLayerRead`, unless the body set it itself. (A data descriptor, so that neither
    the instance nor a class-level default of the same name answers first.)"""

    def __init__(self, path, name):
        self.path, self.name = path, name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        if self.name in obj.__dict__:
            return obj.__dict__[self.name]
        stand_in = _CacheScan.active
        # (``cache.update(k, v, self.layer_idx)`` while a cache is scanned)
        if stand_in is not None and stand_in.may_index(self.path, self.name):
            return _LayerIndex(self.path, self.name)
        raise _PerLayerRead(self.path, self.name)

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value

    def __delete__(self, obj):
        obj.__dict__.pop(self.name, None)


@functools.lru_cache(maxsize=None)
def _hiding(cls, path, names):
    """``cls`` with the attributes ``names`` (of the submodule at ``path``) hidden (`_HiddenAttribute`)."""
    return type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       **{n: _HiddenAttribute(path, n) for n in names}})


class _Hidden:
    """Within the block, the templates' attributes named in ``hidden`` are not there: reading
    one raises `_PerLayerRead` (the body would bake the template's value into every layer)."""

    def __init__(self, templates, hidden):
        self.templates = templates
        self.by_path = {}
        for path, name in sorted(hidden):
            self.by_path.setdefault(path, []).append(name)

    def __enter__(self):
        self.changed = []
        for layer in self.templates:
            for path, names in self.by_path.items():
                try:
                    sub = layer.get_submodule(path)
                except AttributeError:  # (a module some layers have: a hybrid's attention)
                    continue
                cls = type(sub)
                values = {n: sub.__dict__.pop(n) for n in names if n in sub.__dict__}
                sub.__class__ = _hiding(cls, path, tuple(names))
                self.changed.append((sub, cls, names, values))

    def __exit__(self, *exc):
        for sub, cls, names, values in reversed(self.changed):
            sub.__class__ = cls
            for n in names:  # (what the body set is not kept: the values are put back)
                sub.__dict__.pop(n, None)
            sub.__dict__.update(values)


class _StackedSlices:
    """Within the block, ``layer``'s stacked parameters read as the given tensors."""

    def __init__(self, layer, slices):
        self.layer, self.slices = layer, slices

    def __enter__(self):
        self.set = []
        for name, t in self.slices.items():
            sub, leaf = _owner(self.layer, name)
            sub.__dict__.setdefault("_t2j_slices", {})[leaf] = t
            self.set.append((sub, leaf))

    def __exit__(self, *exc):
        for sub, leaf in self.set:
            sub.__dict__["_t2j_slices"].pop(leaf, None)


def _owner(module, name):
    path, _, leaf = name.rpartition(".")
    return module.get_submodule(path), leaf


# ---------------------------------------------------------------------------
# a KV cache in the scan
# ---------------------------------------------------------------------------


class _CacheUnsupported(Exception):
    """The layers use their KV cache in a way the scan does not stand in for (`_CacheScan`)."""


class _CacheIndex(Exception):
    """The body passed the hidden attribute ``key`` to ``cache.update``: the cache's layer index
    (`_CacheScan`), unknown until the body ran."""

    def __init__(self, key):
        super().__init__(f"{key[0]}.{key[1]}" if key[0] else key[1])
        self.key = key


class _LayerIndex:
    """What a hidden attribute reads as while a cache is scanned (``self.layer_idx``): a value
    the body may only pass to ``cache.update``. Any other use of it (arithmetic, comparisons,
    attributes, ``isinstance``) raises `_PerLayerRead`, as reading it does without a cache."""

    __slots__ = ("key",)

    def __init__(self, path, name):
        self.key = (path, name)

    def _used(self, *args):
        raise _PerLayerRead(*self.key)

    __getattr__ = __index__ = __int__ = __float__ = __bool__ = __hash__ = __eq__ = __ne__ = __lt__ = __le__ = \
        __gt__ = __ge__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __floordiv__ = \
        __neg__ = _used
    __class__ = property(_used)  # (``isinstance(self.layer_idx, int)`` asks for it)

    def __repr__(self):
        return f"<the index of each scanned layer: {'.'.join(k for k in self.key if k)}>"


def _is_layered_cache(x) -> bool:
    """A transformers ``Cache``: a list of per-layer caches, updated with ``update(k, v, layer_idx)``."""
    return type(x).__name__.endswith("Cache") and isinstance(getattr(x, "layers", None), list) \
        and callable(getattr(x, "update", None))


def _cache_value_key(v):
    # (a CPU tensor per layer of the same small value, a sliding layer's window size, is one value)
    if isinstance(v, torch.Tensor) and not isinstance(v, Tensor) and v.numel() <= 64:
        return ("cpu tensor", v.dtype, tuple(v.shape), tuple(v.flatten().tolist()))
    return _value_key(v)


class _CacheScan:
    """A transformers KV cache given to the scanned layers. The body gets a stand-in whose
    ``update(k, v, layer_idx)`` runs the real per-layer cache's ``update`` on a copy of it
    holding the step's slice of the layers' stacked cache tensors; the copies' new tensors
    are outputs of the scan, written back to each layer's cache after it. The layers of one
    template must have caches alike (class, plain attributes, tensor shapes); the cache's
    layer index is the hidden attribute the body passes to ``update`` (`_CacheIndex`).
    Anything else the body asks of the cache runs the layers one by one (`_CacheUnsupported`)."""

    active = None  # the stand-in of the body being traced, if any

    def __init__(self, layers, start, p, m, calls, index):
        found = {id(x): x for c in calls for x in c.leaves if _is_cache(x)}
        if len(found) != 1 or not _is_layered_cache(cache := next(iter(found.values()))):
            raise _CacheUnsupported("the layers are given other caches than one transformers Cache")
        self.cache, self.index = cache, index
        self.objects = [[] for _ in range(p)]  # per template: each step's per-layer cache
        self.names = [[] for _ in range(p)]  # per template: the names of its stacked tensors
        self.xs = []
        self.appended = set()  # (ids of the per-layer caches the scan added to the list: `write_back`)
        if index is None:
            return
        path, name = index
        for t in range(p):
            for i in range(m):
                layer = layers[start + i * p + t]
                try:
                    at = layer.get_submodule(path).__dict__[name]
                except (AttributeError, KeyError):
                    raise _CacheUnsupported(f"layer {start + i * p + t} has no {'.'.join(index)}") from None
                if not isinstance(at, int):
                    raise _CacheUnsupported(f"the cache index {'.'.join(index)} is a {type(at).__name__}")
                replicate = getattr(cache, "layer_class_to_replicate", None)
                while replicate is not None and len(cache.layers) <= at:
                    cache.layers.append(replicate())
                    self.appended.add(id(cache.layers[-1]))
                if at >= len(cache.layers):
                    raise _CacheUnsupported(f"the cache has no layer {at}")
                self.objects[t].append(cache.layers[at])
            objs = self.objects[t]
            if len({type(o) for o in objs}) > 1:
                raise _CacheUnsupported("the caches of layers scanned alike are of different classes")
            names = sorted(k for k, v in vars(objs[0]).items() if isinstance(v, Tensor))

            def signature(o):
                tensors = {k: v for k, v in vars(o).items() if isinstance(v, Tensor)}
                return ({k: _cache_value_key(v) for k, v in vars(o).items() if k not in tensors},
                        {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})

            if any(signature(o) != signature(objs[0]) for o in objs[1:]):
                raise _CacheUnsupported("the caches of layers scanned alike differ (lengths, settings)")
            self.names[t] = names
            self.xs += [torch.stack([o.__dict__[k] for o in objs]) for k in names]

    def stand_in(self, xs):
        """The body's cache, its per-layer caches holding the step's slices ``xs`` of `xs`."""
        return _CacheStandIn(self, xs)

    def write_back(self, after, ys, restore, start):
        """After the scan: each layer's cache gets the plain attributes the body's copy ended with
        (``after[t]``, None where the template did not update) and its slice of ``ys[t]``; ``restore``
        gets, per layer, how to put its cache back."""
        p = len(self.objects)
        for t in range(p):
            if after[t] is None:
                continue
            plain, names = after[t]
            for i, o in enumerate(self.objects[t]):
                undo = restore.setdefault(start + i * p + t, [])
                undo.append(functools.partial(_gradcut.put_attributes, _gradcut.attributes_of([o])))
                if id(o) in self.appended:  # (a layer the loop then does not call leaves none)
                    undo.append(functools.partial(_remove, self.cache.layers, o))
                # (its tensors are slices of the scan's outputs: gradients reach the layers)
                _gradcut.put_attributes([(o, {**plain, **{k: y[i] for k, y in zip(names, ys[t])}})])


def _remove(items, o):
    for i, x in enumerate(items):
        if x is o:
            del items[i]
            return


class _CacheStandIn:
    """The cache a scanned body's layers are given (`_CacheScan`)."""

    def __init__(self, scan, xs):
        self._scan, self._xs, self._copies, self._t = scan, list(xs), {}, 0
        self._handed = []  # the hidden attributes read as a `_LayerIndex` while the index was not known

    def may_index(self, path, name) -> bool:
        """Whether the hidden attribute ``path.name`` reads as a `_LayerIndex`: the cache's index
        attribute, or, while that is not known, any (the first passed to ``update`` is it)."""
        if self._scan.index is not None:
            return (path, name) == self._scan.index
        self._handed.append((path, name))
        return True

    def _check(self):
        """After the step: a body that read a hidden attribute but never updated the cache read it
        for something else (``isinstance(self.state, ...)``), as a layer's own value: one by one."""
        if self._scan.index is None and self._handed:
            raise _PerLayerRead(*self._handed[0])

    def _template(self, t):
        """The body now runs template ``t``."""
        self._t = t

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        scan, t = self._scan, self._t
        if type(layer_idx) is not _LayerIndex:
            raise _CacheUnsupported(f"the layers pass cache.update a layer index {layer_idx!r} of their own")
        if scan.index is None:
            raise _CacheIndex(layer_idx.key)
        if layer_idx.key != scan.index or t in self._copies:
            raise _CacheUnsupported("a layer updates its cache under another index, or twice")
        tpl = scan.objects[t][0]
        copy = object.__new__(type(tpl))
        _gradcut.put_attributes([(copy, vars(tpl))])  # (its lists and dicts copied)
        offset = sum(len(n) for n in scan.names[:t])
        for k, x in zip(scan.names[t], self._xs[offset:offset + len(scan.names[t])]):
            vars(copy)[k] = new_tensor(x)
        self._copies[t] = copy
        return copy.update(key_states, value_states, *args, **kwargs)

    def after(self, t):
        """Template ``t``'s cache after the step: (plain attributes, names of its tensors) and the
        tensors' arrays, or (None, []) when it did not update."""
        copy = self._copies.get(t)
        if copy is None:
            return None, []
        names = sorted(k for k, v in vars(copy).items() if isinstance(v, Tensor))
        plain = {k: v for k, v in vars(copy).items() if k not in names}
        return (plain, names), [vars(copy)[k]._value() for k in names]

    def __getattr__(self, name):
        raise _CacheUnsupported(f"the layers read cache.{name}")


# ---------------------------------------------------------------------------
# the scan
# ---------------------------------------------------------------------------


class _Call:
    """One layer call's arguments, flattened; the hidden state is the first positional argument."""

    def __init__(self, args, kwargs):
        self.args, self.kwargs = args, kwargs
        self.leaves, self.spec, self.positions = _flatten((args, kwargs))
        # (taken now: the loop may change an object it passes every layer, ``ctx.scale = ...``)
        # (a KV cache by identity: the scan itself updates it, `_CacheScan`)
        self.keys = [x._version if isinstance(x, torch.Tensor) else ("cache", id(x)) if _is_cache(x) else _value_key(x)
                     for x in self.leaves]

    @property
    def hidden(self):
        return self.args[0] if self.args and isinstance(self.args[0], torch.Tensor) else None

    def same_as(self, other: "_Call", hidden=None) -> bool:
        """Whether this call passes what ``other`` passed, except for the hidden state, which
        must be ``hidden`` (unchanged since) when given."""
        if self.spec != other.spec or self.hidden is None:
            return False
        if hidden is not None and (self.hidden is not hidden[0] or self.hidden._version != hidden[1]):
            return False
        for i, (a, b) in enumerate(zip(self.leaves, other.leaves)):
            if i == 0:
                continue
            if (isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor)) and a is not b \
                    or self.keys[i] != other.keys[i]:
                return False
        return True


class _Scanned:
    """The outputs of layers ``start .. start + m * p`` computed by one scan, given out
    as the model's loop calls the layers (`take`)."""

    def __init__(self, start, p, calls, outputs, restore):
        self.start, self.p, self.calls = start, p, calls
        self.end = start + len(outputs)
        self.outputs = outputs
        self.restore = restore  # layer -> [callables putting back the buffers and cache the scan wrote]
        self.next = start  # the layer the loop should call next
        self.given = None  # (hidden state given out for the previous layer, its version)
        self.cache_index = None  # (path, name) of the attribute the layers index a KV cache with

    def take(self, k, call: _Call):
        """Layer ``k``'s output for ``call``, or None when the scan assumed other arguments."""
        t = (k - self.start) % self.p
        if k != self.next or (k != self.start and not call.same_as(self.calls[t], self.given)):
            return None
        out = self.outputs[k - self.start]
        h = out if isinstance(out, torch.Tensor) else out[0]
        self.given = (h, h._version)
        self.next += 1
        self.restore.pop(k, None)
        return out

    def discard(self):
        """The model's loop left the scan's assumptions, or stopped: the buffers of the layers it
        was not given (`take`) get back the values they had before the scan."""
        for undo in self.restore.values():
            for put_back in undo:
                put_back()
        self.restore.clear()


def _put_array(st, array):
    st.array = array
    st.version += 1


def _scan(layers, start, p, m, calls, remat, stacked, hidden, cache_index=None) -> _Scanned:
    """Run ``layers[start : start + m * p]`` as ``m`` steps of one ``lax.scan`` whose body runs
    the ``p`` templates ``layers[start : start + p]`` in turn, template ``t`` with the
    arguments of ``calls[t]`` (its hidden state replaced by the previous template's output).
    ``stacked``: parameter name -> the layers' stacked Parameter (`use_scan_layers(...,
    stack_parameters=True)`); ``hidden``: attributes hidden from the body (`_Hidden`);
    ``cache_index``: the attribute that is the layers' index into a KV cache they are given
    (`_CacheScan`), found by a first attempt where not known."""
    try:
        scanned = _scan_once(layers, start, p, m, calls, remat, stacked, hidden, cache_index)
    except _CacheIndex as e:
        if cache_index is not None:
            raise _CacheUnsupported(f"the layers index their cache with {e} and with {'.'.join(cache_index)}") from None
        cache_index = e.key
        scanned = _scan_once(layers, start, p, m, calls, remat, stacked, hidden, cache_index)
    scanned.cache_index = cache_index
    return scanned


def _tensor_at(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """``layer``'s parameter or buffer ``name`` (dotted), by attribute: under torch.func.functional_call
    (`t2j.functionalize`) the parameters are plain tensors, which ``get_parameter`` refuses."""
    return functools.reduce(getattr, name.split("."), layer)


def _scan_once(layers, start, p, m, calls, remat, stacked, hidden, cache_index) -> _Scanned:
    templates = layers[start:start + p]
    run_layers = layers[start:start + m * p]
    on_list = stacked or {}
    # (every name a tied parameter has: functional_call wants each)
    pnames = [list(on_list) + [n for n, _ in tpl.named_parameters(remove_duplicate=False)] for tpl in templates]
    bnames = [[n for n, _ in tpl.named_buffers(remove_duplicate=False)] for tpl in templates]
    # the program's inputs: the arguments' tensors (one input per tensor however many calls pass
    # it); the hidden state of templates after the first is the previous template's output
    inputs, index = [], {}
    where = []
    for t, call in enumerate(calls):
        slots = []
        for i in call.positions:
            if i == 0 and t > 0:
                continue
            x = call.leaves[i]
            if id(x) not in index:
                index[id(x)] = len(inputs)
                inputs.append(x)
            slots.append((i, index[id(x)]))
        where.append(slots)
    whole = []
    for t, tpl in enumerate(templates):
        for n in pnames[t]:
            if n in on_list:
                whole.append(on_list[n][start + t:start + m * p:p])
            else:
                whole.append(torch.stack([_tensor_at(run_layers[i * p + t], n) for i in range(m)]))
        whole += [torch.stack([_tensor_at(run_layers[i * p + t], n) for i in range(m)]) for n in bnames[t]]
    cache = _CacheScan(layers, start, p, m, calls, cache_index) \
        if any(_is_cache(x) for c in calls for x in c.leaves) else None
    n_cache = 0
    if cache is not None:
        whole += cache.xs
        n_cache = len(cache.xs)
    cache_after = [None] * p  # per template: its cache's plain attributes and tensor names after a step
    key = _rng.body_key()
    policy = None if remat is True else remat
    if remat is False:
        remat = None
    structures = [_Structure() for _ in templates]
    sizes = [len(pnames[t]) + len(bnames[t]) for t in range(p)]

    def attempt(state):
        carried = _carried(state)
        n_in, n_w = len(inputs), len(whole)

        def run(arrays):
            args_a = arrays[:n_in]
            weights = arrays[n_in:n_in + n_w]
            state_a = arrays[n_in + n_w:]

            def body(c, xs):
                h, carried_c, k = c
                values = _state_values(state_a, carried, carried_c)

                def call():
                    stand_in = cache.stand_in(xs[len(xs) - n_cache:]) if cache is not None else None
                    _CacheScan.active = stand_in
                    try:
                        result = templates_in_turn(stand_in)
                    finally:
                        _CacheScan.active = None
                    if stand_in is not None:
                        stand_in._check()
                    return result

                def templates_in_turn(stand_in):
                    hid = new_tensor(h)
                    outs, bufs, cached, offset = [], [], [], 0
                    for t, (tpl, c) in enumerate(zip(templates, calls)):
                        filled = list(c.leaves)
                        for i, j in where[t]:
                            filled[i] = new_tensor(args_a[j])
                        filled[0] = hid
                        if stand_in is not None:
                            stand_in._template(t)
                            filled = [stand_in if _is_cache(x) else x for x in filled]
                        a, kw = torch_pytree.tree_unflatten(filled, c.spec)
                        names = pnames[t] + bnames[t]
                        tensors = {n: new_tensor(x) for n, x in zip(names, xs[offset:offset + sizes[t]])}
                        offset += sizes[t]
                        stores = _Stores(tpl)
                        with _StackedSlices(tpl, {n: tensors.pop(n) for n in on_list}):
                            out = torch.func.functional_call(tpl, tensors, a, kw, tie_weights=False, strict=True)
                        stores.check()
                        new_h = out if isinstance(out, torch.Tensor) else out[0]
                        if not isinstance(new_h, torch.Tensor):
                            raise ControlFlowError(
                                f"t2j.scan_layers: layer {start + t} ({type(tpl).__name__}) returned "
                                f"{type(new_h).__name__}; a layer returns the next hidden state, or a tuple whose "
                                "first element it is")
                        outs.append(structures[t].flatten(out, "layer output"))
                        bufs.append([tensors[n]._value() for n in bnames[t]])
                        if stand_in is not None:
                            cache_after[t], arrays = stand_in.after(t)
                            cached.append(arrays)
                        hid = new_h
                    return outs, bufs, cached, hid._value()

                (outs, bufs, cached, new_h), carried_new, k = _run_body(state, values, carried, k, call, loop=True)
                _check_carry("scan_layers", [h], [new_h])
                return (new_h, carried_new, k), (outs, bufs, cached)

            body = _folding_transposes(body)
            if remat is not None:
                body = jax.checkpoint(body, policy=policy, prevent_cse=False)
            h0 = args_a[index[id(calls[0].leaves[0])]]
            (h, s, _), (outs, bufs, cached) = jax.lax.scan(body, (h0, [state_a[i] for i in carried], key), weights)
            return [h, *jax.tree.leaves(outs), *jax.tree.leaves(bufs), *jax.tree.leaves(cached), *s]

        # Stacked in torch, so that torch autograd unstacks the gradients: each layer's
        # .grad is then a view of one stacked gradient, and the program has no
        # per-layer slices of its own (each would be a kernel of its own to compile).
        outs = _apply(run, inputs + whole + state.tensors)
        final, outs = outs[0], outs[1:]
        per_template = []
        for st in structures:
            n = len(st.positions)
            per_template.append(outs[:n])
            outs = outs[n:]
        restore = {}
        for t in range(p):
            for j, name in enumerate(bnames[t]):
                for i in range(m):
                    st = _tensor_at(run_layers[i * p + t], name)._t2j_storage
                    restore.setdefault(start + i * p + t, []).append(functools.partial(_put_array, st, st.array))
                    _put_array(st, outs[j]._value()[i])
            outs = outs[len(bnames[t]):]
        if cache is not None:
            per = []
            for t in range(p):
                n = len(cache_after[t][1]) if cache_after[t] is not None else 0
                per.append(outs[:n])
                outs = outs[n:]
            cache.write_back(cache_after, per, restore, start)
        _write_back(state, carried, outs)
        results = []
        for i in range(m):
            for t, st in enumerate(structures):
                leaves = [y[i] for y in per_template[t]]
                if i == m - 1 and t == p - 1:
                    # (from the carry: the stacked outputs are then dead code to XLA when the loop
                    # only chains the hidden state)
                    leaves[0] = final
                filled = list(st.leaves)
                for pos, x in zip(st.positions, leaves):
                    filled[pos] = x
                results.append(torch_pytree.tree_unflatten(filled, st.spec))
        return _Scanned(start, p, calls, results, restore)

    with _Hidden(templates, hidden):
        return _with_state(templates[0], attempt)


# ---------------------------------------------------------------------------
# scan_layers
# ---------------------------------------------------------------------------

_WARNED = set()


def _warn_once(message):
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)


def _one_by_one(layers, start, hidden, args, kwargs):
    for layer in layers[start:]:
        out = layer(hidden, *args, **kwargs)
        hidden = out if isinstance(out, torch.Tensor) else out[0]
    return hidden


def _one_body_failed(layers, error):
    """The warning for layers one traced body cannot stand for (`_PerLayerRead`, `_LayerStores`,
    `_CacheUnsupported`)."""
    kind = type(layers[0]).__name__
    if isinstance(error, _CacheUnsupported):
        return (f"t2j.scan_layers: the {kind} layers are given a KV cache, but {error}; the scan stands in for "
                "a transformers Cache the layers update with cache.update(k, v, self.layer_idx) only, so they run "
                "one by one")
    if isinstance(error, _LayerStores):
        return (f"t2j.scan_layers: the layers' forward ({kind}) stores a value in ``{error}``, which each layer does "
                "for itself; one traced body cannot, so they run one by one")
    return (f"t2j.scan_layers: the layers' forward ({kind}) reads ``{error}``, which differs from layer to layer; one "
            "traced body cannot stand for them all, so they run one by one")


def scan_layers(layers, hidden, *args, remat=None, **kwargs):
    """Run a stack of modules one after another as a single ``lax.scan``.

    ``layers`` is an ``nn.ModuleList`` (or sequence) of modules with the same
    parameter names, shapes and dtypes; each is called as
    ``layer(hidden, *args, **kwargs)`` and returns the next ``hidden`` (or a tuple
    whose first element it is). Their parameters are stacked and one traced body
    runs them all, so a deep model compiles one layer. Layers whose Python
    attributes differ in a repeating pattern (sliding and full attention in turn)
    are scanned a period at a time; layers that read an attribute that differs in
    each of them run one by one, with a warning. Gradients reach every layer's own
    parameters; buffers the layers update are written back per layer. ``remat``
    rematerializes each step in the backward pass: ``True``, or a JAX checkpoint
    policy (``jax.checkpoint_policies.dots_saveable``).

    >>> h = t2j.scan_layers(model.blocks, h)            # instead of: for b in model.blocks: h = b(h)
    """
    stacked, read = {}, frozenset()
    if isinstance(layers, _ScannedModuleList):  # already converted by use_scan_layers
        stacked, read = layers._stacked_parameters(), layers._t2j_read
        layers = list(layers._modules.values())
    layers = list(layers)
    if not layers:
        return hidden
    if not stacked and _on_host(hidden, args, kwargs, [list(layer.parameters()) for layer in layers]):
        return _one_by_one(layers, 0, hidden, args, kwargs)
    signatures = _Signatures(layers, stacked, read)
    n = len(layers)
    p = 1 if n == 1 else signatures.period(0)
    if p is None:
        different = next(k for k in range(1, n) if signatures.structures[k] != signatures.structures[0]) \
            if len(set(signatures.structures)) > 1 else None
        if different is not None:
            raise ControlFlowError(
                f"t2j.scan_layers: layer {different} ({type(layers[different]).__name__}) does not have the structure "
                f"of layer 0 ({type(layers[0]).__name__}): {signatures.first_difference(different)}; the layers must "
                "have the same shapes, or repeat a pattern of layers")
        _warn_once(f"t2j.scan_layers: the {type(layers[0]).__name__} layers' Python attributes differ with no "
                   "repeating pattern; they run one by one")
        return _one_by_one(layers, 0, hidden, args, kwargs)
    m = n // p
    call = _Call((hidden, *args), kwargs)
    try:
        scanned = _scan(layers, 0, p, m, [call] * p, remat, stacked, signatures.hidden)
    except (_PerLayerRead, _LayerStores, _CacheUnsupported) as e:
        _warn_once(_one_body_failed(layers, e))
        return _one_by_one(layers, 0, hidden, args, kwargs)
    out = scanned.outputs[-1]
    return _one_by_one(layers, m * p, out if isinstance(out, torch.Tensor) else out[0], args, kwargs)


# ---------------------------------------------------------------------------
# the model's own loop over a converted layer list
# ---------------------------------------------------------------------------

# transformers names the layers' cache argument past_key_value(s), layer_past or (from 5.x) cache
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache")


def _is_cache(x):
    return type(x).__name__.endswith("Cache")


class _LayerRun:
    """One pass of the model's loop over a converted layer list: layer by layer, runs the
    layer as it is or scans it and the layers after it (module docstring)."""

    def __init__(self, owner, layers, stacked):
        self.owner, self.layers, self.stacked = owner, layers, stacked or {}
        self.signatures = None
        self.calls = {}  # layer -> `_Call` of each layer run as it is
        self.scanned = None
        self.stopped = False  # the loop left a scan's assumptions: the rest runs as it is

    def __call__(self, k, args, kwargs):
        call = _Call(args, kwargs)
        if self.scanned is not None:
            if k < self.scanned.end:
                # (the loop may have set the layer's attributes since the scan: ``layer.scale = ...``)
                same = self.signatures.now(k, self.layers[k]) == self.signatures.sigs[k]
                out = self.scanned.take(k, call) if same else None
                if out is not None:
                    self.calls[k] = call  # (a later scan with a period may start from this layer's arguments)
                    return out
                self._leave(k)
            self.scanned = None
        if not self.stopped and not self.owner._t2j_one_by_one and self._may_scan(call):
            self.scanned = self._start(k, call)
            if self.scanned is not None:
                self.calls[k] = call
                return self.scanned.take(k, call)
        out = self.layers[k](*args, **kwargs)
        self.calls[k] = call
        return out

    def close(self):
        """The loop is over: layers the scan ran that the loop did not call keep their buffers."""
        if self.scanned is not None:
            self.scanned.discard()
        self.scanned = None

    def _leave(self, k):
        s = self.scanned
        s.discard()  # (from the layer it expected: one the loop skipped too, ``if i == skip: continue``)
        self.stopped = True
        _warn_once(
            f"t2j.use_scan_layers: the loop over the {type(self.layers[0]).__name__} layers called layer {k} with "
            f"other arguments than layer {k - s.p} (or not with layer {k - 1}'s output, or after changing its "
            f"attributes) where the scan of layers {s.start}..{s.end - 1} assumed them; the scan's results from "
            f"layer {s.next} on are discarded and the rest run one by one")

    def _may_scan(self, call):
        if not isinstance(call.hidden, Tensor):
            return False
        caches = [x for x in (*call.args, *call.kwargs.values()) if _is_cache(x)]
        given = [call.kwargs[a] for a in _CACHE_ARGUMENTS if call.kwargs.get(a) is not None]
        if caches or given:
            # (a transformers Cache the scan stands in for, `_CacheScan`; per-layer caches of other
            # kinds, tuples of tensors, are each layer's own: one by one, as generation wants)
            if self.owner._t2j_cache_one_by_one or not all(_is_layered_cache(x) for x in (*caches, *given)):
                if torch.is_grad_enabled():
                    _warn_once(f"t2j.use_scan_layers: the {type(self.layers[0]).__name__} layers are given a KV "
                               "cache the scan cannot stand in for, so they run one by one; pass use_cache=False "
                               "to train with the scan")
                return False
        return True

    def _start(self, k, call):
        """A scan of layers ``k`` on, or None when they fit no pattern (yet)."""
        if self.signatures is None:
            self.signatures = _Signatures(self.layers, self.stacked, self.owner._t2j_read)
        signatures, n = self.signatures, len(self.layers)
        signatures.sigs[k] = signatures.now(k, self.layers[k])  # (as the loop left it for this call)
        for p in range(1, (n - k) // 2 + 1):
            # a period of several layers needs their arguments: it starts once each ran as it is
            first = k if p == 1 else k - p
            if first < 0 or not signatures.repeats(first, p):
                continue
            if p > 1 and (any(j not in self.calls for j in range(first, k)) or not call.same_as(self.calls[first])):
                continue
            return self._scan(k, p, (n - k) // p, [call] + [self.calls[j] for j in range(first + 1, k)])
        # a run of alike layers that some other layer ends (Gemma 3's five sliding-window layers
        # before a full-attention one): scanned, and what follows is looked at when the loop gets there
        m = signatures.run_length(k)
        return self._scan(k, 1, m, [call]) if m >= 2 else None

    def _scan(self, k, p, m, calls):
        try:
            scanned = _scan(self.layers, k, p, m, calls, self.owner._t2j_remat, self.stacked,
                            self.signatures.hidden, self.owner._t2j_cache_index)
        except (_PerLayerRead, _LayerStores, _CacheUnsupported) as e:
            if isinstance(e, _PerLayerRead):
                self.owner._t2j_read = self.owner._t2j_read | {e.key}
            elif isinstance(e, _CacheUnsupported):
                self.owner._t2j_cache_one_by_one = True
            else:
                self.owner._t2j_one_by_one = True
            self.stopped = True
            _warn_once(_one_body_failed(self.layers, e))
            return None
        if scanned.cache_index is not None:
            self.owner._t2j_cache_index = scanned.cache_index
        return scanned


class _LayerCall:
    """What iterating a converted layer list gives for layer ``k``: it reads as the layer
    (attributes, ``isinstance``), and calling it goes through the loop's `_LayerRun`."""

    __slots__ = ("_t2j_run", "_t2j_k")

    def __init__(self, run, k):
        object.__setattr__(self, "_t2j_run", run)
        object.__setattr__(self, "_t2j_k", k)

    @property
    def _t2j_layer(self):
        return self._t2j_run.layers[self._t2j_k]

    @property
    def __class__(self):
        return type(self._t2j_layer)

    def __getattr__(self, name):
        return getattr(self._t2j_layer, name)

    def __setattr__(self, name, value):
        setattr(self._t2j_layer, name, value)

    def __call__(self, *args, **kwargs):
        return self._t2j_run(self._t2j_k, args, kwargs)

    def __iter__(self):
        return iter(self._t2j_layer)

    def __len__(self):
        return len(self._t2j_layer)

    def __getitem__(self, idx):
        return self._t2j_layer[idx]

    def __repr__(self):
        return repr(self._t2j_layer)


class _LayerCalls(list):
    """The `_LayerCall` of each layer, as iterating or slicing a converted list gives them;
    the run ends (`_LayerRun.close`) when a loop over them finishes or leaves."""

    def __init__(self, run):
        super().__init__(_LayerCall(run, k) for k in range(len(run.layers)))
        self._run = run

    def __iter__(self):
        try:
            yield from super().__iter__()
        finally:
            self._run.close()


class _ScannedModuleList(torch.nn.ModuleList):
    """A ModuleList whose layers a loop over it runs as scans (`_LayerRun`)."""

    _t2j_remat = None
    _t2j_stacked = None  # layer parameter name -> name of the stacked Parameter on this list
    _t2j_read = frozenset()  # attributes varying per layer that the layers' forward reads
    _t2j_one_by_one = False  # whether the layers' forward stores values in them (`_LayerStores`)
    _t2j_cache_index = None  # the attribute the layers index a KV cache with (`_CacheScan`), once found
    _t2j_cache_one_by_one = False  # whether they use a KV cache as the scan cannot (`_CacheUnsupported`)

    def _stacked_parameters(self):
        if not self._t2j_stacked:
            return {}
        return {n: self._parameters[key] for n, key in self._t2j_stacked.items()}

    def __iter__(self):
        return iter(_LayerCalls(_LayerRun(self, list(self._modules.values()), self._stacked_parameters())))

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            # (a negative step, ``layers[::-1]``: torch slices only forwards, so the rows are gathered)
            rows = idx if (idx.step or 1) > 0 else list(range(len(self._modules)))[idx]
            stacked = {n: p[rows] for n, p in self._stacked_parameters().items()}
            return _LayerCalls(_LayerRun(self, list(self._modules.values())[idx], stacked))
        return super().__getitem__(idx)


# ---------------------------------------------------------------------------
# layers whose parameters are stored stacked
# ---------------------------------------------------------------------------

def _stack_parameters(layers: _ScannedModuleList):
    """Move the layers' parameters into one stacked Parameter per name, registered
    on ``layers``; the layers read their slices (`_StackedAccess`), and the state
    dict keeps the per-layer names (``layers.3.attn.weight``)."""
    modules = list(layers._modules.values())
    names = [n for n, _ in modules[0].named_parameters()]
    every = [p for m in modules for _, p in m.named_parameters(remove_duplicate=False)]
    if len({id(p) for p in every}) != len(every):
        raise ControlFlowError("t2j.use_scan_layers: stack_parameters cannot stack layers with tied parameters")
    keys = {}
    for name in names:
        values = [dict(m.named_parameters())[name] for m in modules]
        key = "stacked_" + name.replace(".", "__")
        with torch.no_grad():
            stacked = torch.nn.Parameter(torch.stack([v.detach() for v in values]),
                                         requires_grad=values[0].requires_grad)
        layers.register_parameter(key, stacked)
        keys[name] = key
        for k, m in enumerate(modules):
            sub, leaf = _owner(m, name)
            del sub._parameters[leaf]
            if not isinstance(sub, _StackedAccess):
                sub.__class__ = _with_stacked_access(type(sub))
            sub.__dict__.setdefault("_t2j_stacked_refs", {})[leaf] = (layers, key, k)
    layers._t2j_stacked = keys
    layers._register_state_dict_hook(_per_layer_state_dict)
    layers._register_load_state_dict_pre_hook(_stack_loaded_state_dict, with_module=True)


def _per_layer_state_dict(layers, state_dict, prefix, local_metadata):
    for name, key in layers._t2j_stacked.items():
        stacked = state_dict.pop(prefix + key)
        for k in range(stacked.shape[0]):
            state_dict[f"{prefix}{k}.{name}"] = stacked[k]
    return state_dict


def _stack_loaded_state_dict(layers, state_dict, prefix, *args):
    n = len(layers._modules)
    for name, key in layers._t2j_stacked.items():
        per_layer = [f"{prefix}{k}.{name}" for k in range(n)]
        if all(k in state_dict for k in per_layer):
            state_dict[prefix + key] = torch.stack([state_dict.pop(k) for k in per_layer])


def stacked_parameter_names(module: torch.nn.Module) -> dict:
    """For each parameter of ``module`` that holds a stack of layers' parameters
    (`use_scan_layers` with ``stack_parameters=True``), its name in ``named_parameters()`` ->
    the name of the first layer's parameter it replaces: sharding rules written for one
    layer's parameters apply to the stack's trailing dimensions.

    >>> stacked_parameter_names(model)["model.layers.stacked_mlp__up_proj__weight"]
    'model.layers.0.mlp.up_proj.weight'
    """
    out = {}
    for prefix, sub in module.named_modules():
        for name, key in (getattr(sub, "_t2j_stacked", None) or {}).items():
            where = f"{prefix}." if prefix else ""
            out[f"{where}{key}"] = f"{where}0.{name}"
    return out


def use_scan_layers(model: torch.nn.Module, *, remat=None, names=("layers", "h", "blocks", "layer"),
                    stack_parameters: bool = False):
    """Make ``model`` run its stack of layers with `scan_layers`, in place.

    Finds each ``nn.ModuleList`` attribute called one of ``names`` (an HF Llama's
    ``model.layers``, GPT-2's ``transformer.h``, BERT's ``encoder.layer``) and makes
    ``for layer in layers: ...`` in the model's own forward run them as a
    ``lax.scan``: one traced body for layers that are alike, a period of layers
    at a time for layers that alternate (Gemma 2's sliding and full attention).
    Layers that fit no pattern (DeepSeek-V3's first dense layers) run one by one
    and the scan takes the rest; every layer still gets the arguments the loop
    passes it (a per-layer mask), checked call by call. Parameters, state dict and
    optimizers are unchanged. A transformers KV cache the layers update with
    ``cache.update(k, v, self.layer_idx)`` (the ``DynamicCache`` HF makes unless
    ``use_cache=False``) is updated by the scan, per layer as torch would. Returns
    ``model``.

    ``stack_parameters=True`` also stores the layers' parameters as JAX models
    do: one Parameter per name holding all layers (``[n_layers, ...]``), so an
    optimizer updates a dozen tensors instead of a dozen per layer (much faster
    to compile) and the scan reads them without stacking. ``model.parameters()``
    then yields the stacked Parameters (create the optimizer afterwards);
    ``layer.attn.weight`` still reads its layer's slice, and ``state_dict()`` /
    ``load_state_dict()`` keep the per-layer names, so checkpoints are unchanged
    (save the state dict: the layers' classes are specialized, so pickling the
    whole module is not supported). It needs layers of one structure.

    >>> t2j.use_scan_layers(llama)     # llama.model.layers now traces one layer
    """
    found, skipped = 0, []
    for prefix, module in model.named_modules():
        for name in names:
            child = module._modules.get(name)
            if not isinstance(child, torch.nn.ModuleList) or len(child) < 2:
                continue
            where = f"{prefix}.{name}" if prefix else name
            layers = list(child._modules.values())
            if any(isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) for m in layers):
                continue  # (containers of layers, not layers: Funnel's blocks of layers)
            stacked = child._stacked_parameters() if isinstance(child, _ScannedModuleList) else {}
            signatures = _Signatures(layers, stacked)
            if not any(signatures.period(k) or signatures.run_length(k) > 1 for k in range(len(layers) - 1)):
                # (the first layer unlike layer 0: Gemma 3's sixth, full-attention layer)
                k = next((k for k in range(1, len(layers)) if signatures.sigs[k] != signatures.sigs[0]), 1)
                skipped.append(f"{where}: no two neighbouring layers are alike and no pattern of them repeats "
                               f"(layer {k}: {signatures.first_difference(k)})")
                continue
            if stack_parameters and len(set(signatures.structures)) > 1:
                k = next(k for k in range(1, len(layers)) if signatures.structures[k] != signatures.structures[0])
                raise ControlFlowError(
                    f"t2j.use_scan_layers: stack_parameters needs layers of one structure, but in {where} layer {k} "
                    f"differs: {signatures.first_difference(k)}; leave stack_parameters off")
            if stack_parameters and len({tuple(p.requires_grad for p in m.parameters()) for m in layers}) > 1:
                raise ControlFlowError(
                    f"t2j.use_scan_layers: stack_parameters stores each parameter of all layers in one Parameter, "
                    f"which cannot train in some layers and not others, but some of {where}'s layers are frozen "
                    "(requires_grad=False); leave stack_parameters off, or freeze all layers alike")
            child.__class__ = _ScannedModuleList
            child._t2j_remat = remat
            if stack_parameters and not child._t2j_stacked:
                _stack_parameters(child)
            found += 1
    if not found:
        why = "".join(f"; {s}" for s in skipped)
        raise ControlFlowError(
            f"t2j.use_scan_layers: {type(model).__name__} has no ModuleList of layers to scan named one of "
            f"{names}{why}; call t2j.scan_layers(layers, hidden, ...) in its forward instead"
        )
    for s in skipped:
        _warn_once(f"t2j.use_scan_layers: {type(model).__name__}.{s}; its layers run one by one")
    return model
