"""complex32 (``torch.chalf``) on the jax device, held as complex64 with float16 parts.

JAX has no complex32. A complex32 tensor on the jax device is a `Complex32Tensor`: a
`Tensor` whose storage holds complex64 values whose real and imaginary parts are
float16 values. An op that reads or makes one (a complex32 input, ``dtype=torch.chalf``,
a float16 input that torch turns complex, as ``h * 1j``) runs on complex64 views of its
complex32 inputs and float32 views of its float16 ones, then rounds each result to
the dtype torch's meta kernel gives for the real inputs: a complex32 result to float16
parts, a float16 one (``abs``, ``.real``, ``view_as_real``) to float16. A result that is
a view stays a view of the same storage, and a write through any view of a complex32
storage is rounded before the op returns, so views and in-place ops behave as on CPU.

torch's CPU kernels round after every arithmetic step of a complex32 op (they compute
in ``c10::complex<Half>``); we round once per op, so results can differ from torch's by
float16 rounding, never by more.

Example::

    z = torch.tensor([1 + 2j], dtype=torch.chalf).to("jax")
    (z * 2).dtype                 # torch.complex32
    torch.view_as_real(z).dtype   # torch.float16, a view: writes reach z
    z.jax()                       # Array([1.+2.j], dtype=complex64)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from . import dtypes as _dt
from .tensor import Tensor, ViewStep, _mark_saved, kernel_error, reduce_as_cpu, torch_cpu


class Complex32Tensor(Tensor):
    """A complex32 tensor on the jax device (see the module docstring).

    ``jax()`` gives its value as a complex64 array.
    """

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return run(func, args, kwargs or {})
        except Exception as error:
            return kernel_error(func, args, kwargs, error)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = retag(super().__deepcopy__(memo))
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        # saved as a contiguous CPU complex32 tensor: torch.load gives one back on the
        # jax device (or the CPU with map_location), without sharing with other views
        base = _mark_saved(torch_cpu(self._value()).to(torch.complex32))
        meta = (tuple(self.shape), base.stride(), 0)
        return reduce_as_cpu(self, base, meta, protocol)


@jax.jit
def _round(a):
    """complex64 ``a`` with its parts rounded to float16."""
    half = lambda p: p.astype(jnp.float16).astype(jnp.float32)  # noqa: E731
    return lax.complex(half(jnp.real(a)), half(jnp.imag(a)))


def retag(t: Tensor) -> Complex32Tensor:
    """The complex32 tensor over ``t``'s storage, view chain and layout (``t`` complex64,
    its values already complex32 values)."""
    return Tensor.__new__(
        Complex32Tensor, t._t2j_storage, t._t2j_view, value=t._value(),
        size=t.shape, stride=t.stride(), offset=t.storage_offset(), dtype=torch.complex32,
        requires_grad=t.requires_grad,
    )


def _retyped(t: Tensor, dtype: torch.dtype, step=None) -> Tensor:
    """``t`` seen as ``dtype`` over the same storage (through ``step`` where the values change)."""
    chain = t._t2j_view + (step,) if step is not None else t._t2j_view
    value = t._value() if step is None else step.forward(t._value())
    return Tensor(
        t._t2j_storage, chain, value=value, size=t.shape, stride=t.stride(), offset=t.storage_offset(), dtype=dtype
    )


def _cast_step(dtype) -> ViewStep:
    """A view step that reads the values as ``dtype`` and writes them back in the base's dtype."""
    dtype = _dt.to_jax(dtype)
    return ViewStep(lambda a: a.astype(dtype), lambda base, value: value.astype(base.dtype), "complex32 parts")


def _expected_dtypes(func, args, kwargs):
    """torch's dtype for each tensor ``func`` returns on these inputs (its meta kernel), or
    None where no meta kernel answers (an output size that depends on the values)."""
    from .dispatch import _to_meta, _tree_map_tensors

    try:
        margs, mkwargs = _tree_map_tensors(_to_meta, (args, kwargs))
        if "device" in mkwargs:
            mkwargs["device"] = torch.device("meta")
        out = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - the fallback rule in `_narrowed` applies
        return None
    return _tree_map_tensors(lambda o: o.dtype, out)


def involved(tree) -> bool:
    """Whether op arguments ``tree`` hold anything `run` widens."""
    if isinstance(tree, torch.Tensor):
        return tree.dtype is torch.complex32 or (isinstance(tree, Tensor) and tree.dtype is torch.float16)
    if isinstance(tree, (list, tuple)):
        return any(involved(a) for a in tree)
    if isinstance(tree, dict):
        return any(involved(a) for a in tree.values())
    return tree is torch.complex32


def run(func, args, kwargs):
    """Run ``func`` where complex32 is involved: on complex64 / float32 views, then
    rounded to torch's result dtypes (see the module docstring)."""
    from .dispatch import dispatch

    if func is torch.ops.aten.view.dtype:
        return _view_dtype(*args)
    expected = _expected_dtypes(func, args, kwargs)
    originals: dict = {}  # id(widened view) -> (the tensor it stands for, that tensor)
    complex_storages = []
    host_copies = []  # (complex64 copy, the CPU complex32 tensor it copies)

    def widen(a):
        if isinstance(a, Complex32Tensor):
            wide = _retyped(a, torch.complex64)
            complex_storages.append((a._t2j_storage, a._t2j_storage.version))
        elif isinstance(a, Tensor) and a.dtype is torch.float16:
            wide = _retyped(a, torch.float32, _cast_step(torch.float32))
        elif isinstance(a, torch.Tensor) and a.dtype is torch.complex32:
            wide = a.to(torch.complex64)
            host_copies.append((wide, a))
        elif a is torch.complex32:
            return torch.complex64
        elif isinstance(a, (list, tuple)):
            return type(a)(widen(b) for b in a)
        else:
            return a
        originals[id(wide)] = (wide, a)
        return wide

    # (a view's values are computed by its view steps, which index with int64 as the dispatch does)
    with jax.enable_x64(True):
        wide_args, wide_kwargs = widen(args), {k: widen(v) for k, v in kwargs.items()}
    out = dispatch(func, wide_args, wide_kwargs)
    for storage, version in complex_storages:
        # written through a complex64 view: back to complex32 values (a complex32 view of
        # float16 storage was rounded by its write already)
        if storage.version != version and storage.array.dtype == jnp.complex64:
            storage.array = _round(storage.array)
            storage.version += 1
    if host_copies:  # the ones written on the host (``cpu_chalf.copy_(z)``) are copied back
        written = _written_arguments(func, args, kwargs)
        for wide, host in host_copies:
            if any(host is w for w in written):
                host.copy_(wide)
    known = {id(s) for s, _ in complex_storages}
    return _narrowed(out, expected, originals, known)


def _written_arguments(func, args, kwargs):
    """The tensors op ``func`` writes (its schema's mutable arguments)."""
    if not isinstance(func, torch._ops.OpOverload):
        return []
    arguments = func._schema.arguments
    return [
        args[i] if i < len(args) else kwargs.get(a.name)
        for i, a in enumerate(arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def _narrowed(out, expected, originals, input_storages):
    if isinstance(out, (list, tuple)):
        picks = expected if isinstance(expected, (list, tuple)) else [None] * len(out)
        return type(out)(_narrowed(o, e, originals, input_storages) for o, e in zip(out, picks))
    if not isinstance(out, torch.Tensor):
        return out
    entry = originals.get(id(out))
    if entry is not None and entry[0] is out:  # an in-place op returned its (widened) input
        return entry[1]
    if expected is None:  # no meta kernel: complex results of complex32 inputs are complex32
        expected = torch.complex32 if out.dtype is torch.complex64 else out.dtype
    if out.dtype is expected:
        return out
    if not isinstance(out, Tensor):  # a CPU result (``.cpu()``)
        return out.to(expected)
    fresh = not out._t2j_view and id(out._t2j_storage) not in input_storages
    if expected is torch.complex32:
        if fresh:
            out._t2j_storage.array = _round(out._t2j_storage.array.astype(jnp.complex64))
        return retag(out)
    if fresh:
        out._t2j_storage.array = out._t2j_storage.array.astype(_dt.to_jax(expected))
        return _retyped(out, expected)
    return _retyped(out, expected, _cast_step(expected))


def _view_dtype(x, dtype):
    """``x.view(dtype)`` where either side is complex32: through its float16 (real, imag) pairs."""
    meta = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").view(dtype)  # torch's checks
    if x.dim() == 0:  # a same-size view: as of the one-element tensor
        x = x.reshape(1)
    if x.dtype is torch.complex32:
        halves = torch.view_as_real(x).flatten(-2)
        out = halves if dtype is torch.float16 else halves.view(dtype)
    else:
        halves = x if x.dtype is torch.float16 else x.view(torch.float16)
        out = torch.view_as_complex(halves.unflatten(-1, (-1, 2)))
    return out.reshape(meta.shape)
