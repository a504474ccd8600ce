"""`torch2jax.Tensor`: a torch.Tensor on the "jax" device that holds a jax.Array.

Aliasing follows torch exactly (DESIGN.md, decision 2). Every tensor points to a
`Storage` (the value of its base, a jax.Array) and, if it is a view, to the chain
of view steps that derives its value from the base. A write to any tensor is
pushed back through the inverse of each step into the storage and bumps the
storage's version; every other view of that storage recomputes its value from
the new base the next time it is read. This is functionalization done eagerly:
the program JAX sees is pure, so it traces under jit, grad, vmap and scan.

Example::

    x = torch.zeros(2, 3, device="jax")
    x[:, 0].add_(1)          # a view, written in place
    x.t().mul_(2)            # another view of the same storage
    x.jax()                  # Array([[2., 0., 0.], [2., 0., 0.]], dtype=float32)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import math
import multiprocessing.reduction
import os
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx.experimental.proxy_tensor as _proxy_tensor
import torch.utils.data._utils.collate as _collate_module
from jax._src.array import ArrayImpl as _ArrayImpl

from . import device as _device
from . import dtypes as _dt
from . import gradcut as _gradcut
from .ops.registry import placed_as

_device.register()
DEVICE = torch.device(_device.NAME, 0)

# While `t2j.jit` traces a function, the tracer of its state: it learns of every
# storage created and every tensor read (see torch2jax/jit.py).
CAPTURE = None
# Called with a tensor whose storage an op reads beyond the tensor's elements (``as_strided``,
# ``untyped_storage()``): a trace whose view arguments are copies stops there (`torch2jax.jit._watching_copies`).
storage_watchers: list = []

# torch's active fake mode, if any (looked up on every op: bound once)
_dispatch_mode, _FAKE = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE

# The innermost `call_scope` running (torch code that JAX code calls), or None.
CALL_SCOPE = None

# A trace of torch code (`t2j.jit`, a control-flow body, the reads of an autograd Function's forward)
# sets the module state above, which the ops of every thread read. So one thread traces at a time,
# holding TRACE_LOCK in a `traced_block`, and the ops of another thread wait for it (`dispatch`):
# none of their storages, reads or random draws lands in a trace that is not theirs.
TRACE_LOCK = threading.RLock()
TRACING = None  # the ident of the thread inside a `traced_block`, if any


@contextlib.contextmanager
def traced_block():
    """Hold the trace state for this thread while the block runs (re-entrant)."""
    global TRACING
    with TRACE_LOCK:
        outer, TRACING = TRACING, threading.get_ident()
        try:
            yield
        finally:
            TRACING = outer

# Storages holding the jax-device copy of a CPU tensor that a trace indexes at a traced position
# (`symbolic._on_device_if_host`): reads see its values, a write would miss the CPU tensor.
HOST_COPIES: weakref.WeakSet = weakref.WeakSet()


class _CallScope:
    """One run of `call_scope`: ``active`` while it runs, inside ``parent`` (the scope it was entered in)."""

    __slots__ = ("parent", "active")

    def __init__(self, parent):
        self.parent, self.active = parent, True


@contextlib.contextmanager
def call_scope():
    """Let traced writes into the storages created while the block runs (see `Storage.check_write`).

    Torch code that JAX code calls (`call_torch`, `functionalize`) gets its arguments and state as
    tensors made for the call, and allocates buffers it fills in place (``torch.zeros_like(x)``, then
    ``buf[0] = x[1]``); under an eager ``jax.grad`` or ``jax.vmap`` these hold concrete arrays until a
    traced value is written into them. Nothing outside the call holds them, so no tracer escapes.
    """
    global CALL_SCOPE
    scope = CALL_SCOPE = _CallScope(CALL_SCOPE)
    try:
        yield
    finally:
        scope.active, CALL_SCOPE = False, scope.parent


class Storage:
    """The shared value of a base tensor and all of its views."""

    # (handle: a weak reference to the `_StorageHandle` ``untyped_storage()`` last gave, set then)
    __slots__ = ("array", "version", "saved", "host", "handle", "scope", "grown", "__weakref__")

    def __init__(self, array):
        self.array = array
        self.version = 0
        # per growth of the storage in place (a growing ``resize_``: `dispatch._grow_storage`), the view
        # steps from the grown flat array to the array before it: a tensor's chain made before then starts there
        self.grown = ()
        self.scope = CALL_SCOPE  # (the call of torch code from JAX that made it, if any: see `call_scope`)
        self.host = None  # (array, its value on the host), for state `t2j.jit` branches on: see `hints`
        # (weak reference to the CPU copy being pickled, version it copies): see `_saved_base`
        self.saved = None
        if CAPTURE is not None:
            CAPTURE.created(self)

    def check_write(self, value):
        """Refuse to store a tracer in a storage that outlives the trace.

        Inside `t2j.jit` and the control-flow functions such storages already hold
        tracers (their values are inputs of the program). A write of a traced value
        into one that holds a concrete array means a foreign JAX transform (a plain
        ``jax.jit`` of torch code) is mutating persistent state: the tracer would
        escape into a parameter, buffer or optimizer state.
        """
        if CAPTURE is not None:
            if HOST_COPIES and self in HOST_COPIES:
                from .dispatch import OpError

                raise OpError(
                    "torch2jax: a write into a CPU tensor at a position the program computes (hist[i][...] = v "
                    "with i a number the jitted program takes): a program cannot write a CPU tensor. Keep the "
                    "tensor on the jax device to make this one program.")
        elif isinstance(value, jax.core.Tracer) and not isinstance(self.array, jax.core.Tracer) \
                and not self._made_in_running_call():
            from .dispatch import OpError

            raise OpError(
                "torch2jax: a traced value is being written in place into a tensor created outside the traced "
                "function (a parameter, buffer, optimizer state or captured tensor); under a plain jax.jit it "
                "would escape the trace. Use t2j.jit, which carries such state in and out, or "
                "t2j.functionalize for a pure function of the state."
            )

    def _made_in_running_call(self) -> bool:
        """Whether a `call_scope` that is still running created this storage (directly or in a call it made)."""
        scope = self.scope
        while scope is not None:
            if scope.active:
                return True
            scope = scope.parent
        return False


class _StorageHandle(torch.UntypedStorage):
    """``untyped_storage()`` of a jax-device tensor. Its values live in a jax.Array, so this
    is an empty meta storage that only answers what code asks of a storage's identity:
    ``data_ptr()`` (the same for a base tensor and all its views, different for tensors
    that do not share values), ``nbytes()`` and ``device``."""

    def __new__(cls, storage):
        handle = super().__new__(cls, 0, device="meta")
        handle._t2j_storage = storage
        return handle

    def __init__(self, storage):
        pass

    def data_ptr(self):
        # (0 for an empty storage, as torch's null pointer)
        return id(self._t2j_storage) if self._t2j_storage.array.size else 0

    def nbytes(self):
        array = self._t2j_storage.array
        return math.prod(array.shape) * array.dtype.itemsize

    def size(self):
        return self.nbytes()

    def __len__(self):
        return self.nbytes()

    @property
    def device(self):
        return DEVICE

    def copy_(self, source, non_blocking=None):
        """Overwrite the bytes of this storage with those of ``source`` (a storage of the same
        size, jax or CPU): every tensor on it sees them, reinterpreted in its dtype."""
        source_bytes = _storage_bytes(source)
        if source_bytes.size != self.nbytes():
            raise RuntimeError(f"size does not match, self was {self.nbytes()} bytes but src was "
                               f"{source_bytes.size} bytes")
        self._write_bytes(source_bytes)
        return self

    def fill_(self, value):
        """Set every byte of this storage to ``value``, as torch's ``UntypedStorage.fill_``."""
        self._write_bytes(np.full(self.nbytes(), value, dtype=np.uint8))
        return self

    def resize_(self, size):
        if size != self.nbytes():
            raise RuntimeError(
                f"torch2jax: untyped_storage().resize_({size}) of a jax tensor: its storage is a jax.Array of "
                f"{self.nbytes()} bytes, which cannot grow or shrink in place; resize the tensor instead "
                "(t.resize_(...)), or drop the tensor to free its memory")
        return self

    def cpu(self):
        """A CPU ``UntypedStorage`` holding a copy of this storage's bytes."""
        return torch.UntypedStorage.from_buffer(_storage_bytes(self).tobytes(), dtype=torch.uint8)

    def tolist(self):
        return _storage_bytes(self).tolist()

    def __getitem__(self, index):
        return self.cpu()[index]

    def __setitem__(self, index, value):
        """Set the bytes at ``index`` (an int or a slice) to ``value``, as torch's ``UntypedStorage``."""
        data = _storage_bytes(self).copy()
        if isinstance(index, int) and not -data.size <= index < data.size:
            raise RuntimeError(f"index {index} out of range for storage of size {data.size}")
        data[index] = value
        self._write_bytes(data)

    def clone(self):
        """A storage of its own with the same bytes (a jax array is immutable: no copy is made)."""
        return _StorageHandle(Storage(self._t2j_storage.array))

    def __reduce__(self):
        # pickled (outside torch.save, which saves it as a storage: `_normalize_storage_type`)
        # as the CPU storage of its bytes
        return self.cpu().__reduce__()

    def _write_file(self, *args, **kwargs):
        # torch's legacy format (pickle of ``x.storage()``, torch.save(..., _use_new_zipfile_serialization=False))
        return self.cpu()._write_file(*args, **kwargs)

    def _to(self, dtype):
        """A typed storage on the jax device of each byte converted to ``dtype`` (``.float()``, ``.long()``)."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Argument 'dtype' must be torch.dtype, not {type(dtype)}")
        data = torch.from_numpy(_storage_bytes(self).copy())
        return from_torch_cpu(data).to(dtype)._typed_storage()

    def _byteswap(self, elem_size):
        """Reverse the bytes of each ``elem_size``-byte element in place (``byteswap(dtype)``)."""
        if elem_size > 1:
            self._write_bytes(_storage_bytes(self).reshape(-1, elem_size)[:, ::-1].reshape(-1))

    def is_pinned(self, device=None):
        return False  # (a device's memory is not pinned host memory, as for a CUDA storage)

    def new(self):
        return _StorageHandle(Storage(jnp.zeros(0, jnp.uint8)))

    def type(self, dtype=None, non_blocking=False):
        if dtype is None:
            return "torch.storage.UntypedStorage"  # (as a CUDA storage's)
        return super().type(dtype, non_blocking)

    def __deepcopy__(self, memo):
        return memo.setdefault(id(self), self.clone())

    def _write_bytes(self, data):
        st = self._t2j_storage
        array = st.array
        if isinstance(array, jax.core.Tracer):
            raise RuntimeError("torch2jax: writing the bytes of a storage inside a traced function is not "
                               "supported; write through the tensor (t.copy_(src))")
        values = _private(data).view(np.dtype(array.dtype)).reshape(array.shape)
        st.array = jax.device_put(values, array.sharding)
        st.version += 1


_torch_new_wrapped_storage = torch.storage.TypedStorage._new_wrapped_storage


def _new_wrapped_storage(self, untyped_storage):
    # a TypedStorage's clone / copy / deepcopy / same-dtype conversion wraps the new untyped storage,
    # which torch insists be exactly an UntypedStorage: a jax tensor's is a `_StorageHandle`
    if type(untyped_storage) is _StorageHandle:
        return torch.TypedStorage(wrap_storage=untyped_storage, dtype=self.dtype, _internal=True)
    return _torch_new_wrapped_storage(self, untyped_storage)


torch.storage.TypedStorage._new_wrapped_storage = _new_wrapped_storage


def _storage_bytes(storage) -> np.ndarray:
    """The bytes of a storage (of a jax tensor, or on the CPU) as a uint8 NumPy array."""
    storage = getattr(storage, "_untyped_storage", storage)
    if isinstance(storage, _StorageHandle):
        array = np.asarray(jax.device_get(_addressable(storage._t2j_storage.array)))
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if storage.device.type != "cpu":
        raise RuntimeError(f"torch2jax: cannot copy a storage on {storage.device} into a jax tensor's storage")
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


class ViewStep:
    """One view op applied to its input: ``forward(x)`` and ``inverse(x, value)``.

    ``key`` (hashable) names the op and its arguments when they are all static,
    and ``trace(x, *positions)`` then applies the op to a traced array: a compiled
    lowering that reads the view applies the step inside its own program. Both are
    None otherwise. ``positions``: the integers (where a ``select`` or ``slice``
    starts) the key leaves out, inputs of such a program, so that one program
    serves every row of a loop over ``x[i]`` or ``x[i:i + k]``.
    """

    __slots__ = ("forward", "inverse", "name", "key", "trace", "repeats", "traced_offset", "call", "positions")

    def __init__(self, forward, inverse, name, key=None, trace=None, repeats=False, traced_offset=False, call=None,
                 positions=()):
        self.forward = forward
        self.inverse = inverse
        self.name = name
        self.key = key
        self.trace = trace
        self.positions = positions
        # (op, its other arguments, its keyword arguments, which output) as the view op was called: t2j.jit
        # calls it again on an input to give a view of it back (`jit._replayed_view_of_slot`)
        self.call = call
        # some of the view's elements are one element of the input (as_strided with overlapping
        # strides, unfold with a step below the size); a view with more elements than its
        # input (expand) repeats elements without saying so
        self.repeats = repeats
        # where the view starts depends on a traced number (``x[t]``, t an input of a jitted
        # program): its storage_offset() is the one of the trace's value, so the view's elements
        # can only be found through its steps, not from its metadata
        self.traced_offset = traced_offset


def _unchanged(base, value):
    return value


# The view step of ``detach()`` while JAX traces (torch2jax/gradcut.py): reads stop the
# gradient; a write through it changes the storage `straight_through` (see `Tensor._assign`).
DETACHED = ViewStep(_gradcut.stop, _unchanged, torch.ops.aten.detach.default)


# View ops whose result's elements are not elements of their input (a dtype reinterpretation, a
# lazy conjugation or negation): their steps cannot be replayed on element positions
VALUE_VIEWS = frozenset({
    torch.ops.aten._conj.default, torch.ops.aten._neg_view.default, torch.ops.aten.view.dtype,
    torch.ops.aten.view_as_real.default, torch.ops.aten.view_as_complex.default,
})


def moves_elements(step) -> bool:
    """Whether a view step's result is made of elements of its input, moved (not a `VALUE_VIEWS` step)."""
    return isinstance(step.name, torch._ops.OpOverload) and step.name not in VALUE_VIEWS


def strided_steps(chain) -> bool:
    """Whether the view reached through ``chain`` is its storage's elements where its metadata
    (size, strides, offset) says: every step moves elements, none at a traced position."""
    return all(moves_elements(s) and not s.traced_offset for s in chain)


def _repeats_elements(chain, arrays) -> bool:
    """Whether a view reached by ``chain`` (``arrays``: the input of each step, then the view)
    passes through a view that shows one element in several places, so that writing back
    through each step would also write the stale copies of what the view changed."""
    return any(step.repeats or arrays[i + 1].size > arrays[i].size for i, step in enumerate(chain)) and all(
        map(moves_elements, chain))


def _write_positions(array, chain, old, value):
    """``array`` with the elements of a view (``chain`` applied to ``array``, now ``old``) that
    ``value`` changes set to their new values. The chain is replayed on the elements' positions.
    Only changed elements are written, as torch's kernel writes only what it computes: a
    stale copy of an element the view shows twice must not overwrite the new one."""
    positions = jnp.arange(array.size).reshape(array.shape)
    for step in chain:
        positions = step.forward(positions)
    changed = _bits(old) != _bits(value)
    if changed.ndim > value.ndim:  # complex: either part
        changed = changed.any(-1)
    positions = jnp.where(changed, positions, array.size).reshape(-1)
    return array.reshape(-1).at[positions].set(value.reshape(-1), mode="drop").reshape(array.shape)


@functools.partial(jax.jit, static_argnums=2)
def _update_box(array, value, shape, starts):
    """``value``, reshaped to ``shape``, written into ``array`` at ``starts`` (`_contiguous_box`) as
    one compiled program: an eager write would dispatch the reshape and the update one by one,
    each costing what a whole small op does."""
    return jax.lax.dynamic_update_slice(array, value.reshape(shape), starts)


def _contiguous_box(view, chain, array, value):
    """(start indices, shape) of the box of ``array`` (a storage's array) that a contiguous ``view``
    of it covers, where its elements are one box in the array's own shape; else None.

    A write through such a view is then one dynamic_update_slice of the storage's array in its
    own shape. Replaying the view's steps backwards would update a reshape of it, and XLA's CPU
    compiler moves that reshape across the update and then reads rows it has already written when
    the new rows are computed from shifted old ones (``x[1:] = x[:-1] + 1`` gave a cascade under
    t2j.jit; openxla/xla#49176)."""
    # (a view with torch's conjugate or negative bit holds its elements conjugated or negated)
    if (value.dtype != array.dtype or not strided_steps(chain) or not view.is_contiguous() or view.is_conj()
            or view.is_neg()):
        return None
    return _box(array.shape, view.storage_offset(), view.numel())


@functools.lru_cache(maxsize=4096)
def _box(shape, offset, n):
    """(starts, block shape) where the row-major elements [offset, offset + n) of an array of
    ``shape`` are one box: full in the dimensions after some d, a range in d, one index before it."""
    if n == 0:
        return None
    for d in range(len(shape)):
        inner = math.prod(shape[d + 1:])
        if offset % inner or n % inner:
            continue
        k, at = n // inner, offset // inner
        start = at % shape[d]
        if start + k > shape[d]:
            continue
        outer = np.unravel_index(at // shape[d], shape[:d]) if d else ()
        return (*map(int, outer), start, *[0] * (len(shape) - d - 1)), (*[1] * d, k, *shape[d + 1:])
    return None


def _bits(a):
    """``a``'s bit patterns, so that a comparison sees NaN == NaN and -0.0 != 0.0."""
    if a.dtype == jnp.bool_:
        return a
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        return jnp.stack([_bits(a.real), _bits(a.imag)], -1)
    return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{a.dtype.itemsize * 8}"))


@functools.cache
def on_jax_device(cls: type) -> type:
    """The type of a ``cls`` instance on the jax device: ``cls`` itself where it is a `Tensor`,
    else a subclass of ``cls`` and `Tensor` named after ``cls``. It keeps ``cls``'s
    ``__torch_function__`` (so ``y + 1`` is a ``cls`` again, as torch's default one makes it)
    and takes `Tensor`'s ``__torch_dispatch__``, which computes with jax arrays."""
    if issubclass(cls, Tensor) or cls is torch.Tensor:
        return Tensor if cls is torch.Tensor else cls
    if not issubclass(cls, torch.Tensor):
        raise TypeError(f"as_subclass: expected a subclass of torch.Tensor, got {cls!r}")
    if "__torch_dispatch__" in {k for c in cls.__mro__[:cls.__mro__.index(torch.Tensor)] for k in vars(c)}:
        raise TypeError(f"as_subclass: {cls.__qualname__} defines __torch_dispatch__; a tensor on the jax device "
                        "already dispatches to torch2jax, so it cannot take another")
    own = inspect.getattr_static(cls, "__torch_function__")
    if own is inspect.getattr_static(torch.Tensor, "__torch_function__"):
        # (torch disables a class's inherited default next to a __torch_dispatch__: name it again)
        own = classmethod(_default_torch_function)
    namespace = {"__torch_function__": own, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    if issubclass(cls, torch.nn.Parameter):
        # pickled as a jax tensor is (nn.Parameter's own would pickle torch2jax's attributes), which
        # gives an nn.Parameter, as torch's pickling of a subclass of it does
        namespace["__reduce_ex__"] = Tensor.__reduce_ex__
    jax_cls = type(cls.__name__, (cls, Tensor), namespace)
    _USER_CLASSES[jax_cls] = cls
    return jax_cls


# the jax-device class `on_jax_device` made -> the user's class it stands for
_USER_CLASSES: dict = {}


def _default_torch_function(cls, func, types, args=(), kwargs=None):
    """torch's default ``__torch_function__`` (``torch.Tensor.__torch_function__``) for a jax-device class
    ``cls``: the results are wrapped in ``cls``, but for those that left the jax device (``y.cpu()``),
    which become the user's own class, as a CPU ``MyT`` is (``cls`` over a CPU tensor is no working tensor)."""
    if not all(issubclass(cls, t) for t in types):
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **(kwargs or {}))
        if func in torch.overrides.get_default_nowrap_functions():
            return out
        return _wrapped_in(out, cls, next(_USER_CLASSES[c] for c in cls.__mro__ if c in _USER_CLASSES))


def _wrapped_in(out, cls, user):
    if isinstance(out, torch.Tensor):
        if isinstance(out, Tensor):
            return out if isinstance(out, cls) else out.as_subclass(cls)
        return out if isinstance(out, user) else out.as_subclass(user)
    if isinstance(out, (tuple, list)):  # (namedtuples too, as torch's)
        return type(out)(_wrapped_in(o, cls, user) for o in out)
    return out


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _parameter_of_its_class(data, positional, requires_grad):
    """``type(p)(data, requires_grad)`` of a jax parameter ``p``, whose class is `Tensor` as every plain
    jax tensor's is: ``nn.Parameter(data, requires_grad)``, as the class of a CPU or CUDA parameter makes
    (accelerate's ``param_cls(new_value, requires_grad=old.requires_grad)`` replacing a module's weight).
    ``positional``: `Tensor.__new__`'s second positional argument, there a ``requires_grad`` given so."""
    if positional != ():
        requires_grad = positional
    return torch.nn.Parameter(data, True if requires_grad is None else requires_grad)


def dense_order(shape, strides) -> tuple | None:
    """The dimensions from outermost to innermost in memory, where ``strides`` lay out
    ``shape`` densely in some order (contiguous, channels_last, a transpose); None
    where they leave gaps or overlap."""
    order = sorted(range(len(shape)), key=lambda d: -strides[d])
    dense = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != dense:
            return None
        dense *= shape[d]
    return tuple(order)


class Tensor(torch.Tensor):
    """A torch tensor on the "jax" device whose value is a jax.Array.

    Create one with any torch factory on ``device="jax"`` or ``t.to("jax")``;
    read the array back with `Tensor.jax`.
    """

    _t2j_storage: Storage
    # A base tensor's: `new_tensor` sets only the storage, once per op result.
    _t2j_chain: tuple = ()
    _t2j_grown: int = 0  # how many growths of its storage (`Storage.grown`) the chain has seen
    _t2j_cache: object = None  # a view's value, computed at `_t2j_version` of its storage
    _t2j_version: int = -1

    @staticmethod
    def __new__(cls, storage=None, view=(), *, value=None, size=None, stride=None, offset=0, dtype=None,
                requires_grad=None):
        if type(storage) is not Storage:
            return _parameter_of_its_class(storage, view, requires_grad)
        if value is None:
            value = storage.array
        shape = tuple(value.shape) if size is None else tuple(size)
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=_contiguous_strides(shape) if stride is None else tuple(stride),
            storage_offset=offset,
            dtype=_dt.to_torch(value.dtype) if dtype is None else dtype,
            device=DEVICE,
            requires_grad=bool(requires_grad),
        )
        r._t2j_storage = storage
        r._t2j_view = view
        r._t2j_cache = value
        r._t2j_version = storage.version
        return r

    def __init__(self, *args, **kwargs):
        pass

    @property
    def _t2j_view(self) -> tuple:
        """The view steps from the storage's array to this tensor's value. A storage that grew in
        place since the chain was made (torch's ``resize_`` reallocates the one storage its views
        share) holds a longer flat array: the chain then starts with the step back to the old one."""
        grown = self._t2j_storage.grown
        if self._t2j_grown != len(grown):
            self._t2j_chain = grown[self._t2j_grown] + self._t2j_chain
            self._t2j_grown = len(grown)
        return self._t2j_chain

    @_t2j_view.setter
    def _t2j_view(self, chain: tuple) -> None:
        self._t2j_chain = chain
        self._t2j_grown = len(self._t2j_storage.grown)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        fake_mode = _dispatch_mode(_FAKE)
        if fake_mode is not None:
            return _as_fake(fake_mode, func, args, kwargs or {})
        if len(types) > 1 and not all(issubclass(t, Tensor) for t in types):
            # another tensor subclass among the operands (a jagged nested tensor's stand-in in
            # ``_nested_view_from_jagged``): its __torch_dispatch__ handles the op, as torch's protocol asks
            return NotImplemented
        try:
            return _dispatch(func, args, kwargs or {})
        except Exception as error:
            return kernel_error(func, args, kwargs, error)

    # -- value access -------------------------------------------------------

    def _value(self):
        st = self._t2j_storage
        if not self._t2j_view:
            return st.array
        if self._t2j_version != st.version:
            a = st.array
            for step in self._t2j_view:
                a = step.forward(a)
            self._t2j_cache = a
            self._t2j_version = st.version
        return self._t2j_cache

    def _assign(self, value):
        """Write ``value`` (this tensor's shape and dtype) into this tensor and its storage."""
        st = self._t2j_storage
        st.check_write(value)
        chain = self._t2j_view
        old = st.array
        if not chain:
            st.array = placed_as(old, value) if type(old) is _ArrayImpl else _gradcut.written(old, value, False)
            st.version += 1
            return
        if value.size == 0:  # (nothing to write; ``expand(8, 0)`` or ``unfold(...)[:, :0]`` has no inverse step)
            st.version += 1
            return
        bases = [old]
        for step in chain[:-1]:
            bases.append(step.forward(bases[-1]))
        # (the steps after the last that changes values, a dtype view's, move its elements: positions
        # replay on them)
        moved = next((i for i in range(len(chain), 0, -1) if not moves_elements(chain[i - 1])), 0)
        repeats = _repeats_elements(chain[moved:], bases[moved:] + [value])
        box = None if repeats else _contiguous_box(self, chain, old, value)
        if repeats:
            new = _write_positions(bases[moved], chain[moved:], chain[-1].forward(bases[-1]), value)
            for step, base in zip(reversed(chain[:moved]), reversed(bases[:moved])):
                new = step.inverse(base, new)
        elif box is not None:
            # (int32 starts: a transform applied outside 64-bit mode, a vmap of its VJP, builds int32 bounds)
            starts = tuple(np.int32(i) for i in box[0])
            if type(old) is _ArrayImpl and type(value) is _ArrayImpl:
                new = _update_box(old, value, box[1], starts)
            else:
                new = jax.lax.dynamic_update_slice(old, value.reshape(box[1]), starts)
        else:
            new = value
            for step, base in zip(reversed(chain), reversed(bases)):
                new = step.inverse(base, new)
        st.array = placed_as(old, new) if type(old) is _ArrayImpl else _gradcut.written(old, new, DETACHED in chain)
        st.version += 1
        if not repeats:  # else two places of ``value`` may name one element: read it back
            self._t2j_cache = value
            self._t2j_version = st.version

    def jax(self) -> jax.Array:
        """The jax.Array holding this tensor's value.

        >>> torch.ones(2, device="jax").jax()
        Array([1., 1.], dtype=float32)
        """
        return self._value()

    def numpy(self, *, force: bool = False) -> np.ndarray:
        if not force:
            if self.requires_grad:
                raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() "
                                   "instead.")
            if self.is_conj():
                raise RuntimeError("Can't call numpy() on Tensor that has conjugate bit set. Use "
                                   "tensor.resolve_conj().numpy() instead.")
            if self.is_neg():
                raise RuntimeError("Can't call numpy() on Tensor that has negative bit set. Use "
                                   "tensor.resolve_neg().numpy() instead.")
        # a copy of the device's value, so read-only: a write to it would not reach the tensor (on the
        # CPU the array shares the tensor's memory); ``.copy()`` it to write
        array = self.detach().cpu().numpy()
        array.flags.writeable = False
        return array

    @property
    def data(self):
        d = torch.Tensor.data.__get__(self)
        # While JAX traces, `.data` is a cut as `detach()` is: autograd does not see it
        # (autograd's own detaches, of the tensors it saves, do not come through here)
        if _gradcut.differentiable(d._t2j_storage.array):
            d._t2j_view, d._t2j_version = d._t2j_view + (DETACHED,), -1
        return d

    @data.setter
    def data(self, value):
        # torch's setter copies only the C++ metadata (shape, dtype); the value lives
        # on the Python side, so it is re-pointed here too.
        old = self._value()
        self._rebind(value)
        # While JAX traces, autograd does not see the new value either: later reads send their
        # gradient to this tensor as it was (a straight-through write, as through `.data`), not
        # to what computed the value. Where the value is a view of a larger storage (as in
        # vector_to_parameters) the reads stay cut instead, as ``value.data`` was.
        st = value._t2j_storage
        detached = self._t2j_view and all(step is DETACHED for step in self._t2j_view)  # ``p.data = y.data``
        if detached and _gradcut.differentiable(old) and st.array.shape == old.shape and st.array.dtype == old.dtype:
            st.array = _gradcut.straight_through(old, st.array)
            st.version += 1
            self._t2j_view, self._t2j_version = (), -1

    def _rebind(self, other: "Tensor") -> None:
        """Make this tensor another view of ``other``'s value, with ``other``'s shape,
        strides and dtype (resize_, unsqueeze_, t_, ``out=`` resizing, ``.data =``)."""
        torch.Tensor.data.__set__(self, other)
        self._t2j_storage = other._t2j_storage
        self._t2j_view = other._t2j_view
        self._t2j_cache = other._t2j_cache
        self._t2j_version = other._t2j_version

    def tolist(self):
        return self.cpu().tolist()

    def __repr__(self, *, tensor_contents=None):
        value = self._value()
        if isinstance(value, jax.core.Tracer):
            return f"torch2jax.Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, traced={value.aval})"
        host = torch_cpu(value)
        if host.dtype is not self.dtype:  # complex32 is held as complex64
            host = host.to(self.dtype)
        # a user's type (`as_subclass`) prints its name, as in torch; ours print as plain tensors
        name = type(self).__name__
        internal = type(self).__module__.startswith("torch2jax")
        prefix = "tensor(" if internal else f"{name}("
        # torch's own printing, suffixes and line wrapping included, with the values formatted on the CPU
        contents = tensor_contents if tensor_contents is not None else "[]" if host.numel() == 0 else \
            torch._tensor_str._tensor_str(host, len(prefix))
        text = torch._tensor_str._str(self, tensor_contents=contents)
        if not internal:
            return text
        start = text.index(f"{name}(")
        text = prefix + text[start + len(name) + 1:len(text) - (1 if start else 0)]  # (torch's "Parameter(...)")
        # nn.Parameter of a subclass is the tensor itself, marked (torch's Parameter.__new__)
        return "Parameter containing:\n" + text if getattr(self, "_is_param", False) else text

    def untyped_storage(self):
        for watch in storage_watchers:
            watch(self)
        # one object while it lives, as torch's ``untyped_storage()`` of a CPU tensor and its views
        st = self._t2j_storage
        ref = getattr(st, "handle", None)
        handle = ref() if ref is not None else None
        if handle is None:
            handle = _StorageHandle(st)
            st.handle = weakref.ref(handle)
        return handle

    def data_ptr(self):
        """An address that identifies the storage, as libraries compare them (tied weights
        in safetensors / transformers' save_pretrained): views of one storage share it,
        offset by their ``storage_offset``; 0 for a tensor of no elements, as torch's null pointer.
        Nothing can be read through it."""
        if not self.numel():
            return 0
        return id(self._t2j_storage) + self.storage_offset() * self.element_size()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export the value through DLPack, as its jax.Array does (zero-copy where JAX allows).

        The consumer sees the memory JAX holds: ``torch.from_dlpack`` and
        ``numpy.from_dlpack`` of a tensor on a CPU-backed jax device give host arrays,
        on a GPU-backed one CUDA arrays.

        >>> import numpy as np
        >>> np.from_dlpack(torch.arange(3.0, device="jax"))
        array([0., 1., 2.], dtype=float32)
        """
        if self.requires_grad:
            raise BufferError("Can't export tensors that require gradient, use tensor.detach()")
        kwargs = {"stream": stream, "dl_device": dl_device, "copy": copy}
        if max_version is not None:
            kwargs["max_version"] = max_version
        return self._exported_value("__dlpack__").__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._exported_value("__dlpack_device__").__dlpack_device__()

    def _exported_value(self, what):
        value = self._value()
        if isinstance(value, jax.core.Tracer):
            from .dispatch import ExportError

            raise ExportError(
                f"torch2jax: {what} of a tensor traced inside jit: its value exists only when the program runs; "
                "export the result after the jitted call returns."
            )
        return value

    def __format__(self, format_spec):
        # torch formats a 0-d tensor as its Python number only when its type is exactly
        # torch.Tensor; f"{loss:.4f}" must work on the jax device too.
        if self.dim() == 0 and not isinstance(self._value(), jax.core.Tracer):
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __reduce_ex__(self, protocol):
        base = _saved_base(self._t2j_storage)
        if self.dtype != base.dtype:
            # a dtype view is saved on its storage's bytes, as torch does (which refuses to
            # save it together with a view of another dtype)
            base = torch.empty(0, dtype=self.dtype).set_(
                base.untyped_storage(), 0, (base.untyped_storage().nbytes() // self.element_size(),))
        meta = (tuple(self.shape), tuple(self.stride()), self.storage_offset())
        bits = _view_bits(self)
        if not _is_view_of(self, base, meta, bits):
            base = _mark_saved(torch_cpu(self._value()))
            meta, bits = (tuple(self.shape), _contiguous_strides(tuple(self.shape)), 0), ()
        return reduce_as_cpu(self, base, meta, protocol, bits)

    def as_subclass(self, cls):
        """This tensor seen as an instance of torch.Tensor subclass ``cls``, sharing its storage and
        its autograd history, as torch's ``as_subclass`` (torchvision's ``tv_tensors``, user tensor types).

        On the jax device the result's type is a subclass of both ``cls`` and `Tensor`
        (`on_jax_device`), so ``isinstance(y, cls)`` holds and its values stay jax arrays.

        >>> class Tagged(torch.Tensor): pass
        >>> y = torch.ones(2, device="jax").as_subclass(Tagged)
        >>> isinstance(y, Tagged), isinstance(y + 1, Tagged), y.device.type
        (True, True, 'jax')
        """
        out = torch.ops.aten.alias.default(self)
        out.__class__ = on_jax_device(cls)
        return out

    def __copy__(self):
        """A new leaf on the same storage, as torch's copy.copy of a tensor (through its pickle)."""
        out = self.detach()
        out.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            out._is_param = True
        out.__dict__.update(user_attributes(self))
        return out

    def __deepcopy__(self, memo):
        user = _USER_CLASSES.get(type(self))
        if user is not None and torch.overrides.has_torch_function_unary(self):
            # a user's class copies through its __torch_function__, as torch's deepcopy of a subclass
            return torch.overrides.handle_torch_function(Tensor.__deepcopy__, (self,), self, memo)
        if user is not None and type(self.new_empty([])) is not type(self):
            raise RuntimeError(
                "The default implementation of __deepcopy__() for non-wrapper subclasses only works for subclass "
                "types that implement new_empty() and for which that function returns another instance of the same "
                "subclass. You should either properly implement new_empty() for your subclass or override "
                "__deepcopy__() if it is intended behavior for new_empty() to return an instance of a different type.")
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the "
                "moment.  If you were attempting to deepcopy a module, this may be because of a torch.nn.utils."
                "weight_norm usage, see https://github.com/pytorch/pytorch/pull/103001"
            )
        if id(self) in memo:
            return memo[id(self)]
        # one copy per storage, so that copied views share it as the originals do; its own
        # buffer, as t2j.jit may donate the original's
        st = self._t2j_storage
        copied = memo.get(id(st))
        if copied is None:
            copied = memo[id(st)] = Storage(st.array.copy())
        if self._t2j_view:
            out = lazy_view(copied, self._t2j_view, self.shape, self.stride(), self.storage_offset(), self.dtype)
        else:
            out = Tensor(copied)
        if user is not None:
            out.__class__ = type(self)
        out.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            out._is_param = True  # torch's Parameter.__deepcopy__ leaves .grad behind
        elif self.grad is not None:
            out.grad = self.grad.__deepcopy__(memo)
        memo[id(self)] = out
        if not getattr(self, "_is_param", False):  # torch's Parameter.__deepcopy__ drops them
            out.__dict__.update(copy.deepcopy(user_attributes(self), memo))
        return out

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=torch.Tensor):
        # torch.compile(backend="torch2jax") traces jax tensors as plain tensors on the
        # jax device (torch2jax/dynamo.py); AOTAutograd's backward calls this to accept
        # a jax tensor where it traced a plain one.
        return self if expected_type is torch.Tensor else None


# make_fx (behind torch.func.linearize, functionalize and export tracing) treats a tensor type
# it does not know as a subclass to desugar first and leaves ops on it untraced, so a jax
# tensor the traced function closes over became a constant with the ops on it folded away.
# A jax tensor is a dense tensor on a device, traced like a CPU or CUDA one.
_proxy_tensor.HANDLED_TYPES = (*_proxy_tensor.HANDLED_TYPES, Tensor)


class ForkedProcessError(RuntimeError):
    """A jax-device tensor was used in a process forked from the one that made it."""


def _unusable_after_fork():
    """In a forked child (a DataLoader worker with the default start method), ops on jax
    tensors raise `ForkedProcessError`: JAX's runtime and its device buffers do not
    survive ``fork``, and using them crashes the worker with a segmentation fault."""

    def refuse(cls, func, types, args=(), kwargs=None):
        raise ForkedProcessError(
            f"torch2jax: {func} on a jax-device tensor in a forked process (a DataLoader worker?): JAX's "
            "runtime does not survive fork. Keep the dataset's tensors on the CPU and move each batch with "
            ".to('jax') in the loop, or give the DataLoader multiprocessing_context='spawn'"
        )

    Tensor.__torch_dispatch__ = classmethod(refuse)


os.register_at_fork(after_in_child=_unusable_after_fork)


def _reduce_for_another_process(t: Tensor):
    """How multiprocessing sends a jax tensor to another process (a queue, a DataLoader
    worker started with "spawn"): its values, copied. torch's own reduction shares a CPU
    tensor's memory through a file descriptor, which the temporary CPU copy of a jax
    tensor would close before the other process opens it."""
    return _rebuild_from_another_process, (
        np.asarray(jax.device_get(_addressable(t._value()))), t.dtype, t.requires_grad, getattr(t, "_is_param", False))


def _rebuild_from_another_process(values, dtype, requires_grad, is_param):
    t = new_tensor(jnp.asarray(values))
    if t.dtype != dtype:  # complex32, held as complex64
        t = t.to(dtype)
    t.requires_grad_(requires_grad)
    if is_param:
        t._is_param = True
    return t


multiprocessing.reduction.ForkingPickler.register(Tensor, _reduce_for_another_process)


def _collate(batch, *, collate_fn_map=None):
    """DataLoader's collation of jax tensors: stacked on the jax device. torch's own,
    in a worker process, stacks into a new shared-memory storage on the tensors'
    device, which the jax device has no allocator for."""
    return torch.stack(batch, 0)


_collate_module.default_collate_fn_map[Tensor] = _collate


def kernel_error(func, args, kwargs, error):
    """Raise ``error``, an op's failure; in the autograd engine, defer it instead: an error
    escaping a Python kernel there on a PrivateUse1 device aborts the process (a torch
    bug), so the engine gets a stand-in result and the error is raised when the backward
    pass returns."""
    if torch._C._current_graph_task_id() == -1:
        raise error
    from .dispatch import defer_backward_error

    return defer_backward_error(func, args, kwargs or {}, error)


def _dispatch(func, args, kwargs):
    # torch2jax.dispatch imports this module; on the first op this function
    # replaces itself by dispatch.dispatch, sparing every later op an import.
    global _dispatch
    from .dispatch import dispatch as _dispatch

    return _dispatch(func, args, kwargs)


_TORCH_DTYPES: dict = {}
# the dtypes of a 0-d tensor torch's indexing takes as an integer position (uint8 and bool are masks)
INDEX_DTYPES = frozenset(map(np.dtype, ("int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")))


def new_tensor(array, requires_grad: bool = False) -> Tensor:
    """A fresh base tensor (its own storage) holding ``array``."""
    # `Tensor.__new__` without its generality: this runs once per op result.
    jax_dtype = array.dtype
    dtype = _TORCH_DTYPES.get(jax_dtype)
    if dtype is None:
        dtype = _TORCH_DTYPES[jax_dtype] = _dt.to_torch(jax_dtype)
    cls = Tensor
    if type(array) is not _ArrayImpl and not array.shape and jax_dtype in INDEX_DTYPES \
            and isinstance(array, jax.core.Tracer):
        cls = TracedIndex
    try:
        r = torch.Tensor._make_wrapper_subclass(cls, array.shape, dtype=dtype, device=DEVICE,
                                                requires_grad=requires_grad)
    except TypeError:
        if any(not isinstance(d, int) for d in array.shape):
            raise TypeError(
                f"torch2jax: an array of shape {tuple(array.shape)} cannot become a torch tensor: its symbolic "
                "dimensions (jax.export.symbolic_shape) are not sizes a torch tensor can have. Export a module "
                "with t2j.export(module, *args, dynamic_shapes=...), which gives torch symbolic sizes") from None
        raise
    r._t2j_storage = Storage(array)
    return r


class TracedIndex(Tensor):
    """A 0-d integer tensor whose value is traced (``i = logits.argmax()`` inside `t2j.jit`, `call_torch`
    under jax.jit or jax.vmap). As an index (``w[i]``, ``w[:, i] = v``) torch's indexing would read its
    value with ``item()`` for a ``select``; here it is the traced number ``i.item()``, whose select is a
    view the program places (`torch2jax.symbolic`). Everything else it takes part in runs as for any
    jax tensor: its ``__torch_function__`` only makes torch's indexing ask it first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.__getitem__ or func is torch.Tensor.__setitem__) and len(args) > 1:
            index = args[1]
            parts = index if type(index) is tuple else (index,)
            if any(type(p) is TracedIndex for p in parts):
                numbers = tuple(p.item() if type(p) is TracedIndex else p for p in parts)
                args = (args[0], numbers if type(index) is tuple else numbers[0], *args[2:])
                from .symbolic import index_with_numbers

                return index_with_numbers(func, args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def lazy_view(storage, chain, size, stride, offset, dtype) -> Tensor:
    """A view of ``storage`` through ``chain`` whose value is computed when first read."""
    r = torch.Tensor._make_wrapper_subclass(
        Tensor, size, strides=stride, storage_offset=offset, dtype=dtype, device=DEVICE
    )
    r._t2j_storage = storage
    r._t2j_view = chain  # no cache yet (the class's version -1 matches no storage's)
    return r


def torch_cpu(array) -> torch.Tensor:
    """A torch CPU tensor with the value of a jax / NumPy array (a copy). An array sharded over
    the devices of several processes is gathered: a collective, which every process makes, as
    SPMD code calling ``.cpu()`` / ``.item()`` / ``print`` on the same tensor does."""
    dtype = _dt.to_torch(array.dtype)
    host = np.asarray(jax.device_get(_addressable(array)))
    if dtype in (torch.bfloat16,) or host.dtype.kind == "V" or dtype.is_floating_point and dtype.itemsize == 1:
        bits = np.array(host, order="C", copy=True).view(np.uint16 if dtype.itemsize == 2 else np.uint8)
        return torch.from_numpy(bits).view(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        signed = {2: np.int16, 4: np.int32, 8: np.int64}[dtype.itemsize]
        return torch.from_numpy(np.array(host, order="C", copy=True).view(signed)).view(dtype)
    return torch.from_numpy(np.array(host, copy=True))


def _addressable(array):
    """``array``, or where it spans other processes' devices, its whole value on this process."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return array
    if array.sharding.is_fully_replicated:
        return array.addressable_data(0)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(array, tiled=True)


def _as_fake(mode, func, args, kwargs):
    """``func`` on jax tensors while a fake mode traces (a constant that Dynamo or AOTAutograd
    made for real, such as ``torch.tensor(1.0, device=x.device)``, meeting the traced values):
    dispatched again on fake stand-ins of them, as torch's fake mode does with a CUDA constant."""
    def fake(t):
        # the fake keeps the real value as its constant: the traced graph holds the fake, and
        # torch2jax.fx reads the constant from it
        return mode.fake_tensor_converter.from_real_tensor(mode, t, make_constant=True)

    args, kwargs = torch.utils._pytree.tree_map_only(Tensor, fake, (args, kwargs))
    return func(*args, **kwargs)


def _private(host: np.ndarray) -> np.ndarray:
    """A copy of ``host`` for JAX to own. JAX's CPU client takes a NumPy array's memory as the
    jax.Array's own (``jax.device_put``) or copies it after the call returns, so an array viewing a
    torch tensor's memory gave a jax tensor that changed with the CPU tensor's later writes
    (``x.to("jax")`` then ``x.add_(1)`` raced; ``storage.copy_(cpu)`` always followed it)."""
    return np.array(host, order="C", copy=True)


def _host_view(t: torch.Tensor) -> np.ndarray:
    # through DLPack: ``t.numpy()`` would mark the tensor's storage as never resizable again
    # (a later ``resize_`` or ``out=`` into it raised)
    return np.from_dlpack(t)


def jax_array(t: torch.Tensor):
    """A jax.Array with the value of a torch CPU tensor."""
    if torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_legacy_batchedtensor(t):
        raise RuntimeError(
            "torch2jax: a tensor batched by a vmap (torch.func.vmap, is_grads_batched=True, "
            "jacobian/hessian(vectorize=True)) reached a step that converts it to a JAX array, which has no "
            "batching rule (the second-order backward of a jitted function or of a JAX function called from "
            "torch): "
            "use vectorize=False, or vmap inside JAX")
    t = t.detach().resolve_conj().resolve_neg()
    if t.dtype is torch.complex32:  # (JAX has no complex32: its values as complex64, as a jax tensor holds them)
        t = t.to(torch.complex64)
    if not t.is_contiguous():
        t = t.contiguous()
    dtype = _dt.to_jax(t.dtype)
    if t.dtype in (torch.bfloat16, torch.uint16, torch.uint32, torch.uint64) or (t.dtype.is_floating_point and t.dtype.itemsize == 1):
        bits = _host_view(t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize]))
        host = bits.view(dtype)
    else:
        host = _host_view(t)
    host = _private(host)
    # a concrete array even while a program is traced: a CPU tensor's value is a constant of it, which
    # lowerings that need values (pack_padded_sequence's lengths) can read;
    # int64 / float64 stay 64-bit wherever this is called (DESIGN.md, decision 6)
    with jax.ensure_compile_time_eval():
        if host.dtype.itemsize >= 8:
            with jax.enable_x64(True):
                return jnp.asarray(host)
        return jnp.asarray(host)


def from_torch_cpu(t: torch.Tensor) -> Tensor:
    """A torch2jax tensor copying a torch CPU tensor (``t.to("jax")`` goes through here)."""
    if t.dtype is torch.complex32:  # held as complex64 (torch2jax/complex32.py)
        from .complex32 import retag

        return retag(new_tensor(jax_array(t.to(torch.complex64))))
    return new_tensor(jax_array(t))


# -- serialization -------------------------------------------------------------
#
# torch.save and pickle write a jax tensor as a CPU copy of its storage's base (one
# copy per storage and pickling session, so tensors that share a storage load sharing
# one again) plus the tensor's size, strides and offset into it. The copy's storage is
# tagged "jax:0" like a device storage: torch.load without map_location gives jax
# tensors, torch.load(map_location="cpu") gives CPU tensors, as for CUDA checkpoints.

# data_ptr of each storage torch.load is restoring -> the device type it restores to
_RESTORING: dict = {}


def _mark_saved(cpu: torch.Tensor) -> torch.Tensor:
    """Tag the storage of ``cpu``, a copy made for saving, for the jax device (`_tag`). The mark
    is an attribute of the storage's Python object, which torch keeps while the storage lives
    (the copy itself is gone once pickled: only its storage is in the pickler's hands)."""
    cpu.untyped_storage()._t2j_saving = True
    return cpu


def _saved_base(storage: Storage) -> torch.Tensor:
    """The CPU copy of ``storage``'s base for the pickling session under way. The copy's
    storage lives while the session does (torch.save holds it until it is written), so the
    copy is found again through a weak reference to that storage."""
    if storage.saved is not None:
        ref, version = storage.saved
        cpu_storage = ref()
        if cpu_storage is not None and version == storage.version:
            return torch.empty(0, dtype=_dt.to_torch(storage.array.dtype)).set_(
                cpu_storage, 0, tuple(storage.array.shape))
    base = _mark_saved(torch_cpu(storage.array))
    storage.saved = (weakref.ref(base.untyped_storage()), storage.version)
    return base


def reduce_as_cpu(t: Tensor, base: torch.Tensor, meta, protocol, bits=()):
    """Pickle ``t`` as torch pickles ``base.as_strided(*meta)`` with the conjugate / negative
    view ``bits`` (`_view_bits`), a CPU tensor on a storage tagged for the jax device
    (`_mark_saved`, `_tag`): torch alone loads it (weights_only too) with
    ``map_location="cpu"``; with torch2jax it comes back on the jax device
    (`_rebuild_tensor_v2`), sharing its storage with the other views saved with it."""
    cpu = _with_view_bits(base.as_strided(*meta), bits)
    if getattr(t, "_is_param", False):
        cpu = torch.nn.Parameter(cpu, t.requires_grad)
    else:
        cpu.requires_grad_(t.requires_grad)
        user = _USER_CLASSES.get(type(t))
        if user is not None:  # (pickled with its class, as torch does a subclass: it loads as one again)
            cpu = cpu.as_subclass(user)
    cpu.__dict__.update(user_attributes(t))  # torch pickles a tensor's attributes with it
    return cpu.__reduce_ex__(protocol)


def user_attributes(t: Tensor) -> dict:
    """The attributes a program set on jax tensor ``t`` (``p.no_decay = True``), which torch
    keeps through copy, deepcopy and pickling; not torch2jax's own."""
    return {k: v for k, v in t.__dict__.items() if not k.startswith("_t2j_") and k != "_is_param"}


def _is_view_of(t: Tensor, base: torch.Tensor, meta, bits) -> bool:
    """Whether ``t`` is ``base.as_strided(*meta)`` with view ``bits`` (not so for views that
    reinterpret the dtype, or whose torch strides do not describe the base's layout)."""
    size, stride, offset = meta
    if not t._t2j_view:
        return size == tuple(base.shape) and stride == _contiguous_strides(size) and offset == 0
    try:
        seen = _with_view_bits(base.as_strided(size, stride, offset), bits).resolve_conj().resolve_neg()
        return _same_bits(seen, torch_cpu(t._value()))
    except RuntimeError:
        return False


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes (``torch.equal`` says no where both hold a NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _view_bits(t: torch.Tensor) -> tuple:
    """The lazy conjugate / negation of view ``t`` (``x.conj()``, ``x.conj().imag``): torch saves
    them with the tensor, over its storage's values as they are."""
    return tuple(bit for bit, on in (("conj", t.is_conj()), ("neg", t.is_neg())) if on)


def _with_view_bits(t: torch.Tensor, bits) -> torch.Tensor:
    for bit in bits:
        t = t.conj() if bit == "conj" else t._neg_view()
    return t


def _tag(storage):
    if storage.device.type == "cpu" and getattr(storage, "_t2j_saving", False):
        return f"{_device.NAME}:0"
    return None


def _restore(storage, location):
    # Called for every storage torch.load restores, with the location it maps to:
    # the mark tells `_rebuild_tensor_v2` where the tensors on this storage go.
    if location.startswith(_device.NAME) and torch.device(location).index:
        raise RuntimeError(f"torch2jax: torch.load(map_location={location!r}): invalid device ordinal: the jax device "
                           f"is one torch device, {_device.NAME}:0 (shard across JAX devices with t2j.parallel)")
    ptr = storage.data_ptr()
    _RESTORING[ptr] = location.split(":")[0]
    weakref.finalize(storage, _RESTORING.pop, ptr, None)
    return storage if location.startswith(_device.NAME) else None


_torch_rebuild_tensor_v2 = torch._utils._rebuild_tensor_v2
_torch_rebuild_tensor_v3 = torch._utils._rebuild_tensor_v3


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    # torch's rebuild of a CPU tensor in a checkpoint, then, when ``map_location``
    # maps its storage to the jax device (``_restore`` marked it), the same tensor
    # there. Tensors sharing a storage become views of one jax base, as in torch.
    t = _torch_rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata)
    return _loaded_onto_jax(t, storage, storage_offset, size, stride, requires_grad)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    # torch's rebuild for the dtypes it added after TypedStorage (uint16-64, float8, complex32)
    t = _torch_rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata)
    return _loaded_onto_jax(t, storage, storage_offset, size, stride, requires_grad)


def _loaded_onto_jax(t, storage, storage_offset, size, stride, requires_grad):
    untyped = storage._untyped_storage if isinstance(storage, torch.TypedStorage) else storage
    if untyped.device.type != "cpu" or _RESTORING.get(untyped.data_ptr()) != _device.NAME:
        return t
    bits = _view_bits(t)
    base = getattr(storage, "_t2j_loaded", None)
    if base is None:
        whole = (not bits and t.is_contiguous() and t.storage_offset() == 0
                 and t.numel() * t.element_size() == untyped.nbytes())
        if not whole:
            t = torch.empty(0, dtype=t.dtype).set_(untyped, 0, (untyped.nbytes() // t.element_size(),))
        with jax.enable_x64(True):
            base = storage._t2j_loaded = from_torch_cpu(t)
        if getattr(untyped, "_torch_load_uninitialized", False):
            _FILLED_LATER.append((base, t))
        if whole:
            return base.requires_grad_(requires_grad) if requires_grad else base
    meta = (tuple(size), tuple(stride), storage_offset)
    same = meta == (tuple(base.shape), tuple(base.stride()), base.storage_offset())
    out = _with_view_bits((base if same else base.as_strided(*meta)).detach(), bits)
    return out.requires_grad_(requires_grad) if requires_grad else out


# (jax base, CPU tensor on its storage) for each storage torch's legacy (non-zip) format
# reads only after unpickling, when the tensors on it are already made
_FILLED_LATER: list = []
_torch_legacy_load = torch.serialization._legacy_load


def _legacy_load(*args, **kwargs):
    """torch's load of its legacy format, then the values of jax tensors made before their
    storages were read (``torch.save(..., _use_new_zipfile_serialization=False)``)."""
    start = len(_FILLED_LATER)
    try:
        return _torch_legacy_load(*args, **kwargs)
    finally:
        filled = _FILLED_LATER[start:]
        del _FILLED_LATER[start:]
        for base, cpu in filled:
            with jax.enable_x64(True):
                base._t2j_storage.array = from_torch_cpu(cpu)._t2j_storage.array
            base._t2j_storage.version += 1


torch.serialization._legacy_load = _legacy_load

# Pickles name the functions by module and qualified name, and torch.load's
# weights-only unpickler allows them by that name: they keep torch's.
for _ours in (_rebuild_tensor_v2, _rebuild_tensor_v3):
    _ours.__module__ = "torch._utils"
    setattr(torch._utils, _ours.__name__, _ours)
del _ours
torch._weights_only_unpickler._get_allowed_globals.cache_clear()

# before torch's own CPU tagger (priority 10)
torch.serialization.register_package(9, _tag, _restore)

# A jax tensor's ``untyped_storage()`` is a storage to ``torch.is_storage``, and torch.save writes
# its bytes as an ``UntypedStorage``'s (torch.load gives them back as a CPU storage).
_torch_is_storage = torch.is_storage


def is_storage(obj, /) -> bool:
    return type(obj) is _StorageHandle or _torch_is_storage(obj)


is_storage.__doc__ = _torch_is_storage.__doc__
torch.is_storage = is_storage
_torch_normalize_storage_type = torch.serialization.normalize_storage_type


def _normalize_storage_type(storage_type):
    if issubclass(storage_type, _StorageHandle):
        return torch.UntypedStorage
    return _torch_normalize_storage_type(storage_type)


torch.serialization.normalize_storage_type = _normalize_storage_type
