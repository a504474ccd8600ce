"""torch containers as JAX pytrees.

torch's named-tuple results (``torch.return_types.max``, ``sort``, ...) are
registered so results of multi-output ops flow through `jax.tree_util`,
`jax.jit` outputs and the interop helpers unchanged. So are the classes of other
objects that hold tensors (a Hugging Face ``DynamicCache``, returned with
``use_cache=True``): their tensors are the leaves, the rest is static.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import numpy as np
import torch


def _register_return_types() -> None:
    for name in dir(torch.return_types):
        cls = getattr(torch.return_types, name)
        if not (isinstance(cls, type) and issubclass(cls, tuple)):
            continue
        try:
            jax.tree_util.register_pytree_node(cls, lambda t: (tuple(t), None), lambda _, children, c=cls: c(children))
        except ValueError:  # already registered
            pass


_register_return_types()


_registered: set = set()


def ensure_jax_pytree(tree) -> None:
    """Register with JAX every torch pytree node type found in ``tree`` (HF
    ``ModelOutput`` classes, torch's named tuples...), using torch's own flatten and
    unflatten functions, so results of torch code can leave a jitted JAX function."""
    from torch.utils import _pytree as tp

    cls = type(tree)
    node = tp.SUPPORTED_NODES.get(cls)
    if node is None:
        if _is_object(tree) and _holds_tensors(tree):
            _register_object_class(cls)
        return
    if cls not in _registered and cls not in (list, tuple, dict):
        _registered.add(cls)
        try:
            jax.tree_util.register_pytree_node(
                cls,
                lambda t, n=node: _children_and_context(n, t),
                lambda ctx, children, n=node: n.unflatten_fn(list(children), ctx),
            )
        except ValueError:  # JAX knows it already
            pass
    for child in node.flatten_fn(tree)[0]:
        ensure_jax_pytree(child)


def _children_and_context(node, tree):
    children, context = node.flatten_fn(tree)
    return list(children), context


# -- objects holding tensors ---------------------------------------------------------
#
# An object is flattened through its attributes, and lists, tuples and dicts in them, to the
# tensors and arrays it holds; its skeleton (classes, attribute names, other values) is the
# static part, compared by value so that the same structure gives the same treedef.

_OBJECT_CLASSES: set = set()
_ARRAY = "array"


def _is_array(x) -> bool:
    return isinstance(x, (torch.Tensor, jax.Array, jax.core.Tracer, np.ndarray))


def _is_object(x) -> bool:
    """An instance of a user class (not an array, module, class or function)."""
    return hasattr(x, "__dict__") and not _is_array(x) and not isinstance(x, (type, torch.nn.Module)) \
        and not callable(x)


def _holds_tensors(x, depth=0) -> bool:
    if depth > 4:
        return False
    if _is_array(x):
        return True
    if isinstance(x, (list, tuple)):
        return any(_holds_tensors(v, depth + 1) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensors(v, depth + 1) for v in x.values())
    return _is_object(x) and any(_holds_tensors(v, depth + 1) for v in vars(x).values())


def _static(value):
    try:
        hash(value)
        return "value", value
    except TypeError:  # compared by identity
        return "id", id(value)


def _skeleton(x, leaves, top=False):
    """The static structure of ``x``, its tensors and arrays appended to ``leaves``."""
    if top:
        return "object", type(x), tuple((k, _skeleton(v, leaves)) for k, v in vars(x).items())
    if _is_array(x):
        leaves.append(x)
        return _ARRAY
    if type(x) in (list, tuple):
        return type(x), tuple(_skeleton(v, leaves) for v in x)
    if type(x) is dict:
        return dict, tuple((k, _skeleton(v, leaves)) for k, v in x.items())
    if _is_object(x) and _holds_tensors(x):
        return "object", type(x), tuple((k, _skeleton(v, leaves)) for k, v in vars(x).items())
    return _static(x)


def _rebuild(skeleton, leaves):
    if skeleton == _ARRAY:
        return next(leaves)
    kind = skeleton[0]
    if kind in (list, tuple):
        return kind(_rebuild(v, leaves) for v in skeleton[1])
    if kind is dict:
        return {k: _rebuild(v, leaves) for k, v in skeleton[1]}
    if kind == "object":
        obj = skeleton[1].__new__(skeleton[1])
        obj.__dict__.update({k: _rebuild(v, leaves) for k, v in skeleton[2]})
        return obj
    return skeleton[1]


def with_arrays(x, convert):
    """``x``, an object holding tensors (not a tensor or container), as a copy holding
    ``convert(tensor)`` in their places, its class registered with JAX; None for anything else.

    >>> with_arrays(DynamicCache(...), lambda t: t.jax())   # a copy holding jax arrays
    """
    if not _is_object(x) or not _holds_tensors(x):
        return None
    _register_object_class(type(x))
    return jax.tree.map(convert, x, is_leaf=_is_array)


def _register_object_class(cls) -> None:
    """Register ``cls`` with JAX: an instance's leaves are the tensors and arrays in its attributes."""
    if cls in _OBJECT_CLASSES:
        return
    _OBJECT_CLASSES.add(cls)

    def flatten(obj):
        leaves = []
        skeleton = _skeleton(obj, leaves, top=True)
        return leaves, skeleton

    try:
        jax.tree_util.register_pytree_node(cls, flatten, lambda skeleton, leaves: _rebuild(skeleton, iter(leaves)))
    except ValueError:  # JAX knows it already
        pass


# -- dict-like arguments -------------------------------------------------------------
#
# A mapping class torch's pytree does not know (transformers' ``BatchEncoding``, a ``UserDict``; a
# dict subclass) is a leaf to it: t2j.jit would take the whole batch for an object it reaches, whose
# changes (``batch.pop("labels")``) it cannot make again. Registered, its values are children and the
# rest of the instance (its keys, its other attributes) is the static part.

_MAPPING_CLASSES: set = set()


def register_argument_nodes(tree, depth=0) -> None:
    """Register with torch's pytree every dict-like class among ``tree``'s containers that is not a
    node yet (a ``collections.UserDict`` subclass or a ``dict`` subclass: its values are its
    children), every class JAX's pytree knows and torch's does not (a dataclass registered with
    ``jax.tree_util``, an equinox module: JAX's children are its children), and every other
    dataclass and every plain class whose instance holds data only (a batch made for each call:
    its attributes are its children), so that `t2j.jit` takes the tensors and arrays inside them
    as arguments of their own.

    >>> register_argument_nodes(((batch_encoding,), {}))
    >>> torch.utils._pytree.tree_leaves(batch_encoding)   # its tensors
    """
    from torch.utils import _pytree as tp

    if isinstance(tree, (list, tuple)):
        children = tree
    elif isinstance(tree, (dict, collections.UserDict)):
        if type(tree) not in tp.SUPPORTED_NODES:
            _register_mapping_class(type(tree))
        children = tree.values()
    elif type(tree) in _JAX_NODE_CLASSES or (
            tree is not None and not _is_array(tree) and type(tree) not in _OBJECT_CLASSES and tp.tree_is_leaf(tree)
            and jax.tree_util.default_registry.flatten_one_level(tree) is not None):
        _register_jax_node_class(type(tree))
        children = jax.tree_util.default_registry.flatten_one_level(tree)[0]
    elif type(tree) in _RECORD_CLASSES or (_is_record(tree) and tp.tree_is_leaf(tree)):
        _register_record_class(type(tree))
        children = record_items(tree).values()
    else:
        return
    if depth < 8:
        for child in children:
            register_argument_nodes(child, depth + 1)


def is_registered_mapping(x) -> bool:
    """Whether ``x`` is an instance of a dict-like class `register_argument_nodes` registered."""
    return type(x) in _MAPPING_CLASSES


class _MappingContext:
    """The static part of a registered mapping: its keys, and its other attributes. Those that are
    plain values (None, numbers, strings) compare by value; any other by type only, so that a new
    batch's tokenizer ``Encoding`` objects keep one pytree structure (a jitted function reading
    them sees the values of the call it was traced with)."""

    __slots__ = ("keys", "attrs")

    def __init__(self, keys, attrs):
        self.keys, self.attrs = keys, attrs

    def _compared(self):
        return self.keys, tuple((k, v if v is None or type(v) in (bool, int, float, str) else type(v))
                                for k, v in self.attrs)

    def __eq__(self, other):
        return type(other) is _MappingContext and self._compared() == other._compared()

    def __hash__(self):
        return hash(self.keys)

    def __repr__(self):
        return f"_MappingContext({list(self.keys)})"


def _register_mapping_class(cls) -> None:
    from torch.utils import _pytree as tp

    if cls in _MAPPING_CLASSES:
        return
    _MAPPING_CLASSES.add(cls)
    user_dict = issubclass(cls, collections.UserDict)

    def flatten(obj):
        attrs = tuple((k, v) for k, v in vars(obj).items() if not (user_dict and k == "data"))
        return list(obj.values()), _MappingContext(tuple(obj.keys()), attrs)

    def unflatten(children, context):
        obj = cls.__new__(cls)
        obj.__dict__.update(context.attrs)
        items = dict(zip(context.keys, children))
        if user_dict:
            obj.__dict__["data"] = items
        else:
            dict.update(obj, items)
        return obj

    def flatten_with_keys(obj):
        return [(tp.MappingKey(k), v) for k, v in obj.items()], flatten(obj)[1]

    try:
        tp.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)
    except ValueError:  # registered meanwhile
        pass


# -- record arguments -------------------------------------------------------------------
#
# A dataclass instance (``Batch(x, y)``, made for each call), or a plain class's instance that
# holds only data (tensors, numbers, strings, and lists, tuples and dicts of them), is a leaf to
# torch's pytree: t2j.jit would key its programs by the object, compiling one per batch.
# Registered, its attributes are children and their names the static part; `t2j.jit` makes the
# attribute assignments a trace made to it (``batch.logits = ...``) on the caller's object, as
# it does a dict's changes. A plain object holding anything else (a module, a function: a trainer,
# a context) stays one object, its state read where the function reads it.

_RECORD_CLASSES: set = set()
_DATA = (torch.Tensor, jax.Array, np.ndarray, int, float, complex, bool, str, bytes, type(None), torch.dtype,
         torch.device)


def _is_record(x) -> bool:
    if isinstance(x, (type, torch.nn.Module, torch.optim.Optimizer)):
        return False
    if type(getattr(x, "__dict__", None)) is not dict and not _slot_names(type(x)):
        return False
    return dataclasses.is_dataclass(x) or _is_plain_record(x)


@functools.lru_cache(maxsize=None)
def _slot_names(cls) -> tuple:
    """The attribute names ``cls`` and its bases declare in ``__slots__`` (private ones mangled)."""
    names = []
    for c in cls.__mro__:
        slots = vars(c).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{c.__name__.lstrip('_')}{name}"
            if name not in names:
                names.append(name)
    return tuple(names)


_UNSET = object()


def record_items(obj) -> dict:
    """A record's attributes by name: its ``__dict__``'s, then the ``__slots__`` it has set."""
    items = dict(getattr(obj, "__dict__", ()))
    for name in _slot_names(type(obj)):
        value = getattr(obj, name, _UNSET)
        if value is not _UNSET:
            items[name] = value
    return items


def set_record_items(obj, items) -> None:
    """Make ``items`` (name, value pairs) ``obj``'s attributes, and only them (a frozen dataclass's
    too: the trace changed it the same way)."""
    items = dict(items)
    slots = _slot_names(type(obj))
    for name in slots:
        if name in items:
            object.__setattr__(obj, name, items.pop(name))
        elif hasattr(obj, name):
            object.__delattr__(obj, name)
    if hasattr(obj, "__dict__"):
        vars(obj).clear()
        vars(obj).update(items)


def _is_plain_record(x) -> bool:
    """Whether ``x`` is an instance of a plain class, compared by identity, whose attributes are
    data only, some of it tensors."""
    cls = type(x)
    if cls.__module__ == "builtins" or cls.__eq__ is not object.__eq__ or cls.__hash__ is not object.__hash__:
        return False
    values = record_items(x).values()
    return all(_is_data(v) for v in values) and any(_holds_tensors(v) for v in values)


def _is_data(x, depth=0) -> bool:
    if isinstance(x, _DATA):
        return True
    if type(x) in (list, tuple) and depth < 4:
        return all(_is_data(v, depth + 1) for v in x)
    if type(x) is dict and depth < 4:
        return all(_is_data(v, depth + 1) for v in x.values())
    return False


def is_registered_record(x) -> bool:
    """Whether ``x`` is an instance of a record class (a dataclass, a plain class holding data)
    `register_argument_nodes` registered."""
    return type(x) in _RECORD_CLASSES


def _register_record_class(cls) -> None:
    from torch.utils import _pytree as tp

    if cls in _RECORD_CLASSES:
        return
    _RECORD_CLASSES.add(cls)

    def flatten(obj):
        items = record_items(obj)
        return list(items.values()), tuple(items)

    def unflatten(children, names):
        obj = cls.__new__(cls)  # (not __init__: its __post_init__ already ran on the caller's object)
        set_record_items(obj, zip(names, children))
        return obj

    def flatten_with_keys(obj):
        items = record_items(obj)
        return [(tp.GetAttrKey(n), v) for n, v in items.items()], tuple(items)

    try:
        tp.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)
    except ValueError:  # registered meanwhile
        pass


# -- JAX's pytree nodes as arguments ---------------------------------------------------------


class _JaxNodeContext:
    """The static part of a JAX pytree node for torch's pytree: JAX's treedef of its first level,
    compared as JAX compares them (its class and auxiliary data)."""

    __slots__ = ("treedef",)

    def __init__(self, treedef):
        self.treedef = treedef

    def __eq__(self, other):
        return type(other) is _JaxNodeContext and self.treedef == other.treedef

    def __hash__(self):  # (auxiliary data need not be hashable: JAX compares it with ==)
        return hash(self.treedef.num_leaves)

    def __repr__(self):
        return f"_JaxNodeContext({self.treedef})"


_JAX_NODE_CLASSES: set = set()


def _register_jax_node_class(cls) -> None:
    from torch.utils import _pytree as tp

    if cls in _JAX_NODE_CLASSES:
        return
    _JAX_NODE_CLASSES.add(cls)

    def flatten(obj):
        children = jax.tree_util.default_registry.flatten_one_level(obj)[0]
        return list(children), _JaxNodeContext(jax.tree_util.tree_structure(obj, is_leaf=lambda x: x is not obj))

    def unflatten(children, context):
        return context.treedef.unflatten(list(children))

    try:
        tp.register_pytree_node(cls, flatten, unflatten)
    except ValueError:  # registered meanwhile
        pass
