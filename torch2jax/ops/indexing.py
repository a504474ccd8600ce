"""Lowerings: indexing, gathers and scatters, concatenation, padding and search.

JAX clamps out-of-range gather indices and drops out-of-range scatter updates;
torch raises. So every op taking indices checks them (`check_values`): in eager
mode with one device sync, inside a traced program only under
``check_indices="always"``, never when it is off. Ops whose output
shape depends on values (``nonzero``, ``unique``, boolean-mask indexing, ...) run
only eagerly and raise `OpError` when traced.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from ..dispatch import TorchRuntimeError, TorchTypeError
from .registry import (_HALF, as_dtype, canonical_dim, canonical_dims, check_values, checked_scalar, overflow_error,
                       layout_keywords, overflows, refused_dtypes, register, scalar_type_name, strides, true_divide,
                       warning)

aten = torch.ops.aten
prims = torch.ops.prims

_LONG = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)


# -- helpers -----------------------------------------------------------------


def _traced(*arrays):
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _concrete(name, *arrays):
    """NumPy values of ``arrays`` for an op whose output shape depends on them (eager only)."""
    if _traced(*arrays):
        from ..dispatch import OpError

        raise OpError(
            f"torch2jax: {name} has an output shape that depends on tensor values, so it cannot run "
            "under jax.jit; call it outside the traced function"
        )
    return [np.asarray(a) for a in arrays]


# An eager op's compiled call may trace `_concrete`: the trace raises, and dispatch runs that call op by
# op (`_Compiled`), so it is no reason to keep a lowering's every call op by op (`dispatch._jittable`)
_concrete.not_followed = True


def _is_traced_mask(m) -> bool:
    """Whether the mask ``m`` is traced: its true entries' count is then unknown (see `_masked_put`)."""
    return isinstance(m, jax.core.Tracer)


# (`_masked_put`'s traced path gives the op-by-op path's values: a compiled eager call may take it)
_is_traced_mask.not_followed = True


def raise_as_torch(fn, *args):
    """Raise torch's own error for operands it rejects by dtype: ``fn``, torch's CPU kernel,
    runs on stand-ins of them (small CPU tensors of their dtypes), so the message names the
    dtypes as torch does ("long int", "ComplexFloat"). Returns where torch accepts them."""
    try:
        fn(*args)
    except RuntimeError as e:
        if type(e) is not RuntimeError:  # NotImplementedError ("... not implemented for 'Long'")
            raise
        raise TorchRuntimeError(str(e)) from None


def stand_in(dtype, numel=0):
    """A CPU tensor of ``dtype`` (empty, or ``numel`` zeros: some kernels check the dtype only when
    there is an element to compute) for `raise_as_torch`."""
    return torch.zeros(numel, dtype=_dt.to_torch(dtype))


def _check_range(index, size, error, negative=True):
    """Raise ``error(bad_index)`` if ``index`` has a value outside torch's valid range (see `check_values`)."""
    lo = -size if negative else 0
    check_values(index, lambda i: (i < lo) | (i >= size), error)


def _out_of_bounds(dim, size, kind=IndexError, prefix=""):
    return lambda i: kind(f"{prefix}index {i} is out of bounds for dimension {dim} with size {size}")


def _index_out_of_range_in_self(i):
    return IndexError("index out of range in self")


def _flat_out_of_range(n):
    return lambda i: IndexError(f"out of range: tried to access index {i} on a tensor of {n} elements.")


def _value(v, dtype):
    """A scalar argument (Python number or 0-d array) as a 0-d array of ``dtype``."""
    return v.astype(dtype) if hasattr(v, "dtype") else jnp.asarray(as_dtype(checked_scalar(v, dtype), dtype))


def _is_mask(i):
    return i is not None and i.dtype in (_BOOL, np.dtype(np.uint8))


# -- advanced indexing ---------------------------------------------------------


_INDEX_DTYPES = frozenset(map(np.dtype, (np.int64, np.int32, np.uint8, np.bool_)))


def _expand_masks(x, indices, name):
    """(x, indices) with boolean masks replaced by the coordinates of their True entries."""
    if any(i is not None and np.dtype(i.dtype) not in _INDEX_DTYPES for i in indices):
        raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
    out = []
    for i in indices:
        if not _is_mask(i):
            out.append(i)
            continue
        d = len(out)
        if i.ndim == 0:  # x[True] adds a dim of size 1 (0 for False)
            (m,) = _concrete(name, i)
            x = jnp.expand_dims(x, d)
            out.append(jnp.zeros((int(bool(m)),), _LONG))
            continue
        _check_mask_shape(x, i, d)
        (m,) = _concrete(name, i)
        out.extend(jnp.asarray(c, _LONG) for c in np.nonzero(m))
    return x, out


def _check_mask_shape(x, mask, d):
    """torch's IndexError for a boolean mask indexing ``x`` from dim ``d`` whose shape is not x's there."""
    for k, n in enumerate(mask.shape):
        if d + k >= x.ndim or x.shape[d + k] != n:
            raise IndexError(
                f"The shape of the mask {list(mask.shape)} at index {k} does not match the shape of the indexed "
                f"tensor {list(x.shape)} at index {d + k}"
            )


def _index_tuple(x, indices, check):
    if len(indices) > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim} (got {len(indices)})")
    shapes = [i.shape for i in indices if i is not None]
    try:
        jnp.broadcast_shapes(*shapes)
    except ValueError:
        raise IndexError("shape mismatch: indexing tensors could not be broadcast together with shapes "
                         + ", ".join(str(list(s)) for s in shapes)) from None
    if check:
        given = [(d, i) for d, i in enumerate(indices) if i is not None]
        for k, (d, i) in enumerate(given):  # torch's message counts the index tensors, not the dims
            _check_range(i, x.shape[d], _out_of_bounds(k, x.shape[d]))
    return tuple(slice(None) if i is None else i for i in indices)


# A boolean mask's true entries are found on the host (eagerly: `_expand_masks`), and their count is
# the shape of what indexing with them reads or writes: a batch whose mask has another count compiles
# it anew. These run it as one compiled call, where the indexing primitives would each compile.


def _split_index(idx):
    """(the index arrays of an `_index_tuple`, where its full slices are)."""
    return tuple(i for i in idx if type(i) is not slice), tuple(type(i) is slice for i in idx)


def _joined_index(arrays, slices):
    it = iter(arrays)
    return tuple(slice(None) if s else next(it) for s in slices)


@functools.partial(jax.jit, static_argnums=2)
def _read_at_mask(x, arrays, slices):
    return x[_joined_index(arrays, slices)]


@functools.partial(jax.jit, static_argnums=(3, 4))
def _write_at_mask(x, arrays, values, slices, accumulate):
    return _put(x, _joined_index(arrays, slices), values, accumulate)


@register(aten.index.Tensor)
def index(x, indices):
    masked = any(map(_is_mask, indices))
    x, indices = _expand_masks(x, indices, "aten.index (boolean mask indexing)")
    idx = _index_tuple(x, indices, True)
    return _read_at_mask(x, *_split_index(idx)) if masked else x[idx]


@register(aten._unsafe_index.Tensor)
def _unsafe_index(x, indices):
    x, indices = _expand_masks(x, indices, "aten._unsafe_index (boolean mask indexing)")
    return x[_index_tuple(x, indices, False)]


def _accumulate(ref, values, dtype):
    return ref.max(values) if dtype == _BOOL else ref.add(values)


def _masked_put(x, indices, values, accumulate):
    """``x[mask] = values`` as a select when ``values`` broadcasts over the masked rows.

    That is the common ``x[mask] = 0`` and it has a static shape, so it also runs under jit.
    """
    masks = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or not _is_mask(masks[0][1]):
        return None
    d, m = masks[0]
    _check_mask_shape(x, m, d)
    rest = x.shape[d + m.ndim :]
    mask = m.astype(bool).reshape((1,) * d + m.shape + (1,) * len(rest))
    if _is_traced_mask(m) and values.ndim == len(rest) + 1 and values.shape[0] > 1 \
            and jnp.broadcast_shapes(values.shape[1:], rest) == tuple(rest):
        # one value per true entry, in order (DQN's ``next_values[non_final] = target(...)``): the k-th true
        # entry takes values[k]; traced, as the result's shape is x's
        flat = m.astype(bool).reshape(-1)
        n = values.shape[0]
        check_values(jnp.sum(flat), lambda count: count != n, lambda count: TorchRuntimeError(
            f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to indexing result of "
            f"shape {[int(count), *rest]}"))
        picked = values[jnp.clip(jnp.cumsum(flat) - 1, 0, n - 1)]
        values = picked.reshape((1,) * d + m.shape + values.shape[1:])
    elif values.ndim > len(rest) or jnp.broadcast_shapes(values.shape, rest) != tuple(rest):
        return None
    if accumulate:
        values = jnp.where(mask, values, jnp.zeros((), x.dtype))
        return _accumulate(x.at[...], values, x.dtype) if x.dtype == _BOOL else x + values
    return jnp.where(mask, values, x)


def _index_put(x, indices, values, accumulate, check):
    values = values.astype(x.dtype)
    out = _masked_put(x, indices, values, accumulate)
    if out is not None:
        return out
    xe, expanded = _expand_masks(x, indices, "aten.index_put (boolean mask indexing)")
    idx = _index_tuple(xe, expanded, check)
    selected = jax.eval_shape(lambda a: a[idx], xe).shape
    if values.ndim > len(selected) or any(v not in (1, s) for v, s in zip(values.shape[::-1], selected[::-1])):
        raise TorchRuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                                f"indexing result of shape {list(selected)}")
    if any(map(_is_mask, indices)):
        arrays, slices = _split_index(idx)
        return _write_at_mask(x, arrays, values, slices, accumulate)
    return _put(x, idx, values, accumulate)


def _put(x, idx, values, accumulate):
    """``x`` with ``values`` written (or added) at the `_index_tuple` ``idx``."""
    if accumulate:
        return _accumulate(x.at[idx], values, x.dtype)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return _set_with_torch_gradient(x, idx, values)
    return x.at[idx].set(values)


def _set_with_torch_gradient(x, idx, values):
    """``x.at[idx].set(values)`` differentiated as torch's index_put: every value that an index
    names gets the gradient of its position, also where an index repeats (JAX's scatter gives it
    only to the value written last), and ``x`` gets the gradient outside the written positions.
    The tangent rule writes the values' tangents summed over repeats; its transpose is torch's
    backward, and forward mode (jax.jacfwd, jax.hessian) still works."""
    arrays = [i for i in idx if isinstance(i, jax.Array | np.ndarray)]

    def index(arrays):
        it = iter(arrays)
        return tuple(next(it) if isinstance(i, jax.Array | np.ndarray) else i for i in idx)

    @jax.custom_jvp
    def put(x, values, arrays):
        return x.at[index(arrays)].set(values)

    @put.defjvp
    def put_jvp(primals, tangents):
        x, values, arrays = primals
        tx, tvalues, _ = tangents
        at = index(arrays)
        written = jnp.zeros(x.shape, bool).at[at].set(True)  # (a select, not a scatter: it transposes)
        return put(x, values, arrays), jnp.where(written, jnp.zeros((), tx.dtype), tx).at[at].add(tvalues)

    return put(x, values, arrays)


def _check_same_dtype(x, values):
    if values.dtype != x.dtype:
        raise TorchRuntimeError(
            f"Index put requires the source and destination dtypes match, got {scalar_type_name(x.dtype)} for the "
            f"destination and {scalar_type_name(values.dtype)} for the source.")


@layout_keywords(aten.index_put.default, aten._index_put_impl.default)
def _one_host_value(args, kwargs):
    values = args[2] if len(args) > 2 else kwargs["values"]
    return {"host_value": values.device.type == "cpu" and values.numel() == 1}


def _put_values(x, indices, values, accumulate, host_value):
    """``values`` as ``index_put_`` writes them. torch sends ``x[mask] = v`` with one mask, no
    accumulation and one value to ``masked_fill_``, which refuses a uint8 mask; with the value on
    the CPU (``x[mask] = torch.tensor(5.0)``) it takes any dtype, as a Scalar. Otherwise the
    source's dtype must be ``x``'s."""
    given = [i for i in indices if i is not None]
    if not accumulate and len(given) == 1 and values.size == 1:
        if given[0].dtype == np.uint8:
            raise TorchRuntimeError("masked_fill_ only supports boolean masks, but got mask with dtype unsigned char")
        if host_value and given[0].dtype == np.bool_:
            return values.astype(x.dtype)
    _check_same_dtype(x, values)
    return values


@register(aten.index_put.default)
def index_put(x, indices, values, accumulate=False, host_value=False):
    return _index_put(x, indices, _put_values(x, indices, values, accumulate, host_value), accumulate, True)


@register(aten._unsafe_index_put.default)
def _unsafe_index_put(x, indices, values, accumulate=False):
    return _index_put(x, indices, values, accumulate, False)


@register(aten._index_put_impl.default)
def _index_put_impl(x, indices, values, accumulate=False, unsafe=False, host_value=False):
    return _index_put(x, indices, _put_values(x, indices, values, accumulate, host_value), accumulate, not unsafe)


def _clamped(x, indices):
    return [
        None if i is None else jnp.clip(i, -x.shape[d], x.shape[d] - 1) for d, i in enumerate(indices)
    ]


@register(aten._unsafe_masked_index.default)
def _unsafe_masked_index(x, mask, indices, fill):
    v = x[_index_tuple(x, _clamped(x, indices), False)]
    return jnp.where(mask, v, _value(fill, x.dtype))


@register(aten._unsafe_masked_index_put_accumulate.default)
def _unsafe_masked_index_put_accumulate(x, mask, indices, values):
    values = jnp.where(mask, values.astype(x.dtype), jnp.zeros((), x.dtype))
    return _accumulate(x.at[_index_tuple(x, _clamped(x, indices), False)], values, x.dtype)


# -- gather and scatter ------------------------------------------------------


def _as_1d(x, dim):
    """(axis, x) with a 0-d ``x`` seen as 1-d, as torch's dim-wise indexing ops allow."""
    return canonical_dim(dim, x.ndim), (x.reshape(1) if x.ndim == 0 else x)


def _along(d, index):
    """The full index tuple addressing ``index[i0, .., in]`` along axis ``d`` and ``(i0, .., in)`` elsewhere."""
    grid = [jax.lax.broadcasted_iota(index.dtype, index.shape, a) for a in range(index.ndim)]
    grid[d] = index
    return tuple(grid)


def _crop(a, shape):
    return a[tuple(slice(0, n) for n in shape)] if a.shape != tuple(shape) else a


@register(aten.gather.default)
def gather(x, dim, index, *, sparse_grad=False):
    _check_index_dtype("gather", index)
    if max(index.ndim, 1) != max(x.ndim, 1) and index.size:  # torch checks no shapes of an empty index
        raise TorchRuntimeError("Index tensor must have the same number of dimensions as input tensor")
    d, x1 = _as_1d(x, dim)
    larger = [k for k, n in enumerate(np.shape(index) or (1,)) if k != d and n > x1.shape[k]] if index.size else []
    if larger:
        raise TorchRuntimeError(f"Size does not match at dimension {larger[0]} expected index {list(index.shape)} to "
                                f"be no larger than self {list(x.shape)} apart from dimension {d}")
    index1 = index.reshape(-1) if index.ndim == 0 else index
    _check_range(index1, x1.shape[d], _out_of_bounds(dim, x1.shape[d], TorchRuntimeError), negative=False)
    if index1.size == 0:
        return jnp.zeros(index.shape, x.dtype)
    return x1[_along(d, index1)].reshape(index.shape)


def _check_index_dtype(name, index):
    if index.size and index.dtype not in (np.int32, np.int64):  # (an empty index of any dtype gathers nothing)
        raise TorchRuntimeError(f"{name}(): Expected dtype int32/int64 for index")


def _check_scatter_shapes(x1, d, index1, src):
    """torch's scatter shape check: ``index`` no larger than ``x`` but along ``d``, nor than a tensor ``src``."""
    tensor_src = hasattr(src, "ndim")
    src_shape = (np.shape(src) or (1,)) if tensor_src else None
    wrong = any(n > x1.shape[k] for k, n in enumerate(index1.shape) if k != d) or (
        tensor_src and any(n > (src_shape[k] if k < len(src_shape) else 1) for k, n in enumerate(index1.shape)))
    if wrong:
        message = (f"Expected index {list(index1.shape)} to be no larger than self {list(x1.shape)} apart from "
                   f"dimension {d}")
        if tensor_src:
            message += f" and to be no larger size than src {list(np.shape(src))}"
        raise TorchRuntimeError(message)


def _scatter_args(x, dim, index, src):
    if hasattr(src, "dtype") and src.dtype != x.dtype:  # (a Python number takes x's dtype)
        raise TorchRuntimeError("scatter(): Expected self.dtype to be equal to src.dtype")
    _check_index_dtype("scatter", index)
    d, x1 = _as_1d(x, dim)
    index1 = index.reshape(-1) if index.ndim == 0 else index
    if index1.size == 0:  # writes nothing, whatever the index's rank (torch checks no shapes then)
        nowhere = jnp.zeros((0,), np.int64)
        return x1, (nowhere,) * x1.ndim, jnp.zeros((0,), x.dtype)
    _check_scatter_shapes(x1, d, index1, src)
    _check_range(index1, x1.shape[d], _out_of_bounds(dim, x1.shape[d], TorchRuntimeError), negative=False)
    if hasattr(src, "ndim") and src.ndim:
        src = _crop(src, index1.shape)
    src = jnp.broadcast_to(_value(src, x.dtype), index1.shape)
    return x1, _along(d, index1), src


_IDENTITY = {"sum": 0, "prod": 1, "mean": 0}


def _identity(reduce, dtype):
    if reduce in _IDENTITY:
        return jnp.asarray(_IDENTITY[reduce], dtype)
    if dtype == _BOOL:
        return jnp.asarray(reduce == "amin")
    info = jnp.finfo(dtype) if _dt.is_floating(dtype) else jnp.iinfo(dtype)
    if _dt.is_floating(dtype):
        return jnp.asarray(-jnp.inf if reduce == "amax" else jnp.inf, dtype)
    return jnp.asarray(info.min if reduce == "amax" else info.max, dtype)


def _combine(ref, reduce, src, dtype):
    if dtype == _BOOL:  # sum is logical or, prod logical and
        return ref.max(src) if reduce in ("sum", "amax") else ref.min(src)
    if reduce == "sum":
        return ref.add(src)
    if reduce == "prod":
        return ref.multiply(src)
    if reduce == "amax":
        return ref.max(src)
    if reduce == "amin":
        return ref.min(src)
    raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")


def _reduce_into(x, idx, src, reduce, include_self):
    """Reduce ``src`` into ``x.at[idx]`` (scatter_reduce / index_reduce semantics)."""
    base = x if include_self else x.at[idx].set(_identity(reduce, x.dtype))
    if reduce != "mean":
        return _combine(base.at[idx], reduce, src, x.dtype)
    sums = base.at[idx].add(src)
    counts = jnp.zeros(x.shape, _LONG).at[idx].add(1) + int(include_self)
    counts = jnp.maximum(counts, 1)
    if _dt.is_integral(x.dtype, include_bool=True):
        return jnp.floor_divide(sums, counts.astype(x.dtype))
    return (sums / counts.astype(x.dtype)).astype(x.dtype)


@register(aten.scatter.src, aten.scatter.value)
def scatter(x, dim, index, src):
    x1, idx, src = _scatter_args(x, dim, index, src)
    return x1.at[idx].set(src).reshape(x.shape)


_LEGACY_REDUCE = {"add": "sum", "multiply": "prod"}


@register(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(x, dim, index, src, *, reduce):
    if reduce not in _LEGACY_REDUCE:
        raise RuntimeError(f"reduce argument must be either add or multiply., got {reduce}")
    x1, idx, src = _scatter_args(x, dim, index, src)
    return _combine(x1.at[idx], _LEGACY_REDUCE[reduce], src, x.dtype).reshape(x.shape)


@register(aten.scatter_add.default)
def scatter_add(x, dim, index, src):
    x1, idx, src = _scatter_args(x, dim, index, src)
    return _combine(x1.at[idx], "sum", src, x.dtype).reshape(x.shape)


# torch's kernel takes "max" and "min" for "amax" and "amin"
_SCATTER_REDUCE_ALIASES = {"max": "amax", "min": "amin"}


@register(aten.scatter_reduce.two)
def scatter_reduce(x, dim, index, src, reduce, *, include_self=True):
    reduce = _SCATTER_REDUCE_ALIASES.get(reduce, reduce)
    x1, idx, src = _scatter_args(x, dim, index, src)
    return _reduce_into(x1, idx, src, reduce, include_self).reshape(x.shape)


def _dim_index(x, dim, index, error, source=None, negative=False):
    """(x as >= 1-d, index tuple selecting ``index`` along ``dim``, ``source`` shaped as that selection)."""
    d, x1 = _as_1d(x, dim)
    index = index.reshape(-1)
    _check_range(index, x1.shape[d], error(d, x1.shape[d]), negative)
    if source is not None:
        source = source.astype(x.dtype).reshape(x1.shape[:d] + index.shape + x1.shape[d + 1 :])
    return x1, (slice(None),) * d + (index,), source


def _check_index_add_source(x, dim, index, source, op="index_add_"):
    """torch's checks that ``source`` is ``x`` with ``index``'s length along ``dim`` (a 0-d ``x`` aside)."""
    if x.ndim == 0:
        return
    d = dim % x.ndim
    if d < source.ndim and source.shape[d] != index.size:
        raise TorchRuntimeError(f"{op}(): Number of indices ({index.size}) should be equal to source.size(dim): "
                                f"({source.shape[d]}), for dim: {dim}")
    if source.ndim != x.ndim or any(a != b for k, (a, b) in enumerate(zip(x.shape, source.shape)) if k != d):
        raise TorchRuntimeError(f"source tensor shape must match self tensor shape, excluding the specified dimension. "
                                f"Got self.shape = {list(x.shape)} source.shape = {list(source.shape)}")


def _check_index_copy_source(x, dim, index, source):
    """torch's checks of index_copy_'s ``source`` against ``x`` and ``index``, with its words."""
    if x.ndim == 0 or source.ndim == 0:
        return
    if source.ndim != x.ndim:
        raise IndexError(f"index_copy_(): When source and destination are not scalars, their dimensionality must "
                         f"match. Source dimensionality ({source.ndim}), destination dimensionality ({x.ndim})")
    d = dim % x.ndim
    rest = [k for k in range(x.ndim) if k != d]
    if any(x.shape[k] != source.shape[k] for k in rest):
        raise TorchRuntimeError(
            "index_copy_(): Source/destination tensor must have same slice shapes. Destination slice shape: "
            f"{' '.join(str(x.shape[k]) for k in rest)} at dimension {dim} and source slice shape: "
            f"{' '.join(str(source.shape[k]) for k in rest)} at dimension 0.")
    if source.shape[d] != index.size:
        raise IndexError(f"index_copy_(): Number of indices ({index.size}) should be equal to source.size(dim) "
                         f"({source.shape[d]})")


def _index_select_error(x, d):
    """torch's CPU kernel words an out-of-range index by the path it takes: the one for
    dim 1 (and for an empty tensor) of a tensor of two or more dims names the index."""
    if x.ndim > 1 and (d == 1 or x.size == 0):
        return lambda i: TorchRuntimeError(f"INDICES element is out of DATA bounds, id={i} axis_dim={x.shape[d]}")
    return _index_out_of_range_in_self


@register(aten.index_select.default)
def index_select(x, dim, index):
    if index.dtype not in (np.int32, np.int64):
        raise TorchRuntimeError("index_select(): Expected dtype int32 or int64 for index")
    if index.ndim > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    d, x1 = _as_1d(x, dim)
    if x.ndim > 1 and x.shape[d] == 0 and index.size:
        raise TorchRuntimeError("index_select(): self indexing axis dim should be positive")
    _check_range(index, x1.shape[d], _index_select_error(x, d), negative=False)
    out = jnp.take(x1, index.reshape(-1), axis=d)
    return out.reshape(()) if x.ndim == 0 else out


@register(aten.index_add.default)
def index_add(x, dim, index, source, *, alpha=1):
    if source.dtype != x.dtype:
        raise TorchRuntimeError(f"index_add_(): self ({scalar_type_name(x.dtype)}) and source "
                                f"({scalar_type_name(source.dtype)}) must have the same scalar type")
    # torch's 1-d kernel reports an out-of-range index as index_select does
    bad = (lambda d, n: _index_out_of_range_in_self) if x.ndim <= 1 else (
        lambda d, n: _out_of_bounds(d, n, TorchRuntimeError))
    _check_index_add_source(x, dim, index, source)
    x1, idx, src = _dim_index(x, dim, index, bad, source)
    if alpha != 1:
        src = src * _value(alpha, x.dtype)
    return _accumulate(x1.at[idx], src, x.dtype).reshape(x.shape)


@register(aten.index_copy.default)
def index_copy(x, dim, index, source):
    if source.dtype != x.dtype:
        raise TorchRuntimeError("index_copy_(): self and source expected to have the same dtype, but got (self) "
                                f"{scalar_type_name(x.dtype)} and (source) {scalar_type_name(source.dtype)}")
    _check_index_copy_source(x, dim, index, source)
    x1, idx, src = _dim_index(x, dim, index, lambda d, n: _out_of_bounds(d, n, prefix="index_copy_(): "), source)
    return x1.at[idx].set(src).reshape(x.shape)


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, dim, index, value):
    if isinstance(value, complex) and not _dt.is_complex(x.dtype):
        raise TorchRuntimeError("index_fill_(): Converting complex Scalar to non-complex type is not supported")
    if getattr(value, "ndim", 0):
        raise TorchRuntimeError("index_fill_ only supports a 0-dimensional value tensor, but got tensor with "
                                f"{value.ndim} dimension(s).")
    x1, idx, _ = _dim_index(x, dim, index, _out_of_bounds, negative=True)
    return x1.at[idx].set(_value(value, x.dtype)).reshape(x.shape)


refused_dtypes(aten.index_reduce, kinds="bc")  # (torch's CPU kernel: no bools but for prod / amax / amin, no complex)


@register(aten.index_reduce.default)
def index_reduce(x, dim, index, source, reduce, *, include_self=True):
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise TorchRuntimeError(
            f"index_reduce(): Expected reduce to be one of prod, mean, amax or amin but got {reduce}.")
    if index.ndim > 1:
        raise IndexError(f"index_reduce_(): Index is supposed to be a vector, but got dim: {index.ndim} with type: "
                         f"{scalar_type_name(index.dtype)} and size: {list(index.shape)}")
    if index.dtype not in (np.int32, np.int64):
        raise TorchRuntimeError(f"index_reduce_(): Expected dtype int32/int64 for index but got: "
                                f"{scalar_type_name(index.dtype)}")
    if source.dtype != x.dtype:
        raise TorchRuntimeError(f"index_reduce_(): self ({scalar_type_name(x.dtype)}) and source "
                                f"({scalar_type_name(source.dtype)}) must have the same scalar type")
    _check_index_add_source(x, dim, index, source, "index_reduce_")
    x1, idx, src = _dim_index(x, dim, index, lambda d, n: _index_out_of_range_in_self, source)
    return _reduce_into(x1, idx, src, reduce, include_self).reshape(x.shape)


@register(aten.take.default)
def take(x, index):
    if index.dtype != _LONG:
        raise TorchRuntimeError(f"take(): Expected a long tensor for index, but got {scalar_type_name(index.dtype)}")
    n = x.size
    _check_range(index, n, _flat_out_of_range(n))
    if n == 0:
        return jnp.zeros(index.shape, x.dtype)
    return x.reshape(-1)[index]


@register(aten.put.default)
def put(x, index, source, accumulate=False):
    n = x.size
    _check_range(index, n, _flat_out_of_range(n))
    ref = x.reshape(-1).at[index.reshape(-1)]
    src = source.reshape(-1).astype(x.dtype)
    return (_accumulate(ref, src, x.dtype) if accumulate else ref.set(src)).reshape(x.shape)


@register(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if weight.ndim != 2:
        raise TorchRuntimeError("'weight' must be 2-D")
    if indices.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        legacy = torch.empty(0, dtype=_dt.to_torch(indices.dtype)).type()  # "torch.FloatTensor"
        raise TorchRuntimeError(
            "Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int; but got "
            f"{legacy} instead (while checking arguments for embedding)")
    if weight.shape[0] == 0 and indices.size:  # torch's embedding is an index_select of the weight's rows
        raise TorchRuntimeError("index_select(): self indexing axis dim should be positive")
    _check_range(indices, weight.shape[0], _index_out_of_range_in_self, negative=False)
    if padding_idx < 0 and not scale_grad_by_freq:
        return jnp.take(weight, indices, axis=0)
    return _rows_with_torch_slopes(weight, indices, padding_idx, scale_grad_by_freq)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _rows_with_torch_slopes(weight, indices, padding_idx, scale_grad_by_freq):
    """``weight``'s rows at ``indices``, differentiated by JAX as torch's `embedding_dense_backward`: the row
    ``padding_idx`` gets no gradient, and with ``scale_grad_by_freq`` each row's is divided by how often
    ``indices`` names it."""
    return jnp.take(weight, indices, axis=0)


@_rows_with_torch_slopes.defjvp
def _rows_with_torch_slopes_jvp(padding_idx, scale_grad_by_freq, primals, tangents):
    weight, indices = primals
    factor = (indices != padding_idx).astype(weight.dtype)
    if scale_grad_by_freq:
        counts = jnp.zeros(weight.shape[0], weight.dtype).at[indices.reshape(-1)].add(1)
        factor = factor / counts[indices]
    return jnp.take(weight, indices, axis=0), jnp.take(tangents[0], indices, axis=0) * factor[..., None]


@register(aten.embedding_renorm.default)
def embedding_renorm(weight, indices, max_norm, norm_type):
    """``embedding(max_norm=...)``'s renormalization: each row that ``indices`` names (once,
    however often it appears) whose ``norm_type``-norm exceeds ``max_norm`` is scaled by
    max_norm / (norm + 1e-7), as torch's kernel scales it."""
    _check_range(indices, weight.shape[0], _index_out_of_range_in_self, negative=False)
    acc = np.dtype(np.float32) if weight.dtype in _HALF else weight.dtype
    rows = weight.astype(acc)
    norm = jnp.linalg.norm(rows, ord=norm_type, axis=1)
    named = jnp.zeros(weight.shape[0], bool).at[indices.reshape(-1)].set(True)
    scale = jnp.where(named & (norm > max_norm), max_norm / (norm + 1e-7), 1.0)
    return (rows * scale[:, None].astype(acc)).astype(weight.dtype)


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = grad.reshape(idx.shape[0], -1)
    acc = np.dtype(np.float32) if g.dtype in _HALF else g.dtype
    g = g.astype(acc)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), acc).at[idx].add(1)
        g = g / counts[idx][:, None]
    g = jnp.where((idx == padding_idx)[:, None], jnp.zeros((), acc), g)
    out = jnp.zeros((num_weights, g.shape[1]), acc).at[idx].add(g)
    return out.reshape((num_weights,) + grad.shape[indices.ndim :]).astype(grad.dtype)


# -- masks -------------------------------------------------------------------


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    if mask.dtype != _BOOL:  # jnp.where would take any nonzero value as True
        raise_as_torch(torch.Tensor.masked_fill_, stand_in(x.dtype), stand_in(mask.dtype), 0)
    if hasattr(value, "ndim") and value.ndim:
        raise RuntimeError(
            "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
            f"{value.ndim} dimension(s)."
        )
    if hasattr(value, "dtype") and value.dtype != x.dtype:  # torch reads it as a Scalar, which must fit
        check_values(value, lambda v: overflows(v, x.dtype), lambda v: overflow_error(x.dtype))
    return jnp.where(mask, _value(value, x.dtype), x)


@register(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    if mask.dtype != _BOOL:
        raise_as_torch(torch.Tensor.masked_scatter_, stand_in(x.dtype), stand_in(mask.dtype), stand_in(x.dtype))
    if source.dtype != x.dtype:
        raise TorchRuntimeError(f"masked_scatter: expected self and source to have same dtypes but got"
                                f"{scalar_type_name(x.dtype)} and {scalar_type_name(source.dtype)}")
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    m = jnp.broadcast_to(mask, shape).reshape(-1)
    src = source.reshape(-1).astype(x.dtype)
    check_values(jnp.sum(m), lambda ones: ones > src.size,
                 lambda _: TorchRuntimeError("Number of elements of source < number of ones in mask"))
    if src.size == 0:
        return jnp.broadcast_to(x, shape)
    pos = jnp.cumsum(m) - 1
    return jnp.where(m, src[jnp.clip(pos, 0, src.size - 1)], jnp.broadcast_to(x, shape).reshape(-1)).reshape(shape)


@register(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad, mask, sizes):
    """The source's gradient: the gradient at the mask's true positions, in order, then zeros."""
    m = jnp.broadcast_to(mask, grad.shape).reshape(-1)
    n = math.prod(sizes)
    slot = jnp.where(m, jnp.cumsum(m) - 1, n)  # past the end: dropped
    return jnp.zeros(n, grad.dtype).at[slot].set(grad.reshape(-1), mode="drop").reshape(sizes)


@register(aten.masked_select.default)
def masked_select(x, mask):
    if mask.dtype != _BOOL:
        raise_as_torch(torch.masked_select, stand_in(x.dtype), stand_in(mask.dtype))
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    (m,) = _concrete("aten.masked_select", mask)
    return jnp.broadcast_to(x, shape)[np.broadcast_to(m, shape)]


@register(aten.nonzero.default)
def nonzero(x):
    (nz,) = _concrete("aten.nonzero", x != 0)
    return jnp.asarray(np.argwhere(nz), _LONG)


@strides(aten.nonzero.default)
def _nonzero_strides(args, kwargs, out):
    return ((1, out[0].shape[0]),)  # column-major: each coordinate (nonzero(as_tuple=True)) is contiguous


@register(aten.nonzero_static.default)
def nonzero_static(x, *, size, fill_value=-1):
    if x.size == 0:  # jnp.argwhere pads an empty input with zeros, torch with fill_value
        return jnp.full((size, x.ndim), fill_value, _LONG)
    if x.ndim == 0:
        x = x.reshape(1)
        return jnp.argwhere(x, size=size, fill_value=fill_value).astype(_LONG)[:, :0]
    return jnp.argwhere(x, size=size, fill_value=fill_value).astype(_LONG)


# -- concatenation, tiling, padding -------------------------------------------


@warning(aten.cat.out, aten.stack.out)
def _check_cat_out(func, args, kwargs):
    """torch's check that out's dtype can hold the promoted inputs', where another op would write
    a result into out if only it can be cast."""
    out = kwargs["out"]
    if not args[0]:  # (cat's own error)
        return
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in args[0]))
    if not torch.can_cast(dtype, out.dtype):
        raise TorchTypeError(f"torch.cat(): input types can't be cast to the desired output type "
                             f"{scalar_type_name(out.dtype)}")


@register(aten.cat.default)
def cat(tensors, dim=0):
    dtype = _dt.result_type(*tensors)
    parts = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]  # torch skips legacy empty tensors
    if not parts:
        return jnp.zeros((0,), dtype)
    for i, t in enumerate(parts):
        if t.ndim == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")
    d = canonical_dim(dim, parts[0].ndim)
    for i, t in enumerate(tensors):
        if t.ndim == 1 and t.shape[0] == 0:  # (a legacy empty tensor)
            continue
        if t.ndim != parts[0].ndim:
            raise RuntimeError(f"Tensors must have same number of dimensions: got {parts[0].ndim} and {t.ndim}")
        for k, (a, b) in enumerate(zip(parts[0].shape, t.shape)):
            if k != d and a != b:
                raise RuntimeError(f"Sizes of tensors must match except in dimension {d}. Expected size {a} but got "
                                   f"size {b} for tensor number {i} in the list.")
    return jnp.concatenate([t.astype(dtype) for t in parts], axis=canonical_dim(dim, parts[0].ndim))


@register(aten.stack.default)
def stack(tensors, dim=0):
    for i, t in enumerate(tensors[1:], 1):
        if t.shape != tensors[0].shape:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got {list(tensors[0].shape)} at entry "
                               f"0 and {list(t.shape)} at entry {i}")
    dtype = _dt.result_type(*[t.reshape(1) if t.ndim == 0 else t for t in tensors])
    return jnp.stack([t.astype(dtype) for t in tensors], axis=canonical_dim(dim, tensors[0].ndim + 1))


@register(aten.flip.default)
def flip(x, dims):
    axes = canonical_dims(dims, x.ndim)
    return jnp.flip(x, axes) if x.ndim and axes else x


@register(aten.roll.default)
def roll(x, shifts, dims=()):
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not shifts:
        raise RuntimeError("`shifts` required")
    if not dims:
        if len(shifts) != 1:
            raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:0")
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    if len(shifts) != len(dims):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")
    if x.ndim == 0:  # torch does not take a scalar for a 1-d tensor here
        raise IndexError(f"Dimension specified as {dims[0]} but tensor has no dimensions")
    return jnp.roll(x, shifts, canonical_dims(dims, x.ndim))


@register(aten.repeat.default)
def repeat(x, repeats):
    repeats = tuple(repeats)
    if len(repeats) < x.ndim:
        raise RuntimeError(
            "Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor"
        )
    if any(r < 0 for r in repeats):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(repeats)}: {list(repeats)}")
    return jnp.tile(x.reshape((1,) * (len(repeats) - x.ndim) + x.shape), repeats)


@register(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0):
    if len(pad) % 2:
        raise RuntimeError(f"Length of pad must be even but instead it equals {len(pad)}")
    if len(pad) // 2 > x.ndim:
        raise RuntimeError(
            "Length of pad should be no more than twice the number of dimensions of the input. "
            f"Pad length is {len(pad)} while the input has {x.ndim} dimensions."
        )
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        axis = x.ndim - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        if x.shape[axis] + lo + hi < 0:
            raise RuntimeError(
                f"The input size {x.shape[axis]}, plus negative padding {lo} and {hi} resulted in a negative output "
                f"size, which is invalid. Check dimension {axis} of your input."
            )
        config[axis] = (lo, hi, 0)
    return jax.lax.pad(x, _value(value, x.dtype), config)


def _require_matrix(name, x):
    if x.ndim < 2:
        raise RuntimeError(f"{name}: input tensor must have at least 2 dimensions")


@register(aten.tril.default)
def tril(x, diagonal=0):
    _require_matrix("tril", x)
    return jnp.tril(x, diagonal)


@register(aten.triu.default)
def triu(x, diagonal=0):
    _require_matrix("triu", x)
    return jnp.triu(x, diagonal)


@register(aten.narrow_copy.default)
def narrow_copy(x, dim, start, length):
    if x.ndim == 0:
        raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
    if dim >= x.ndim:  # torch's check without a message of its own (a negative dim is wrapped, or an IndexError)
        raise RuntimeError("Expected dim < static_cast<int64_t>(self_sizes.size()) to be true, but got false.  "
                           "(Could this error message be improved?  If so, please report an enhancement request "
                           "to PyTorch.)")
    d = canonical_dim(dim, x.ndim)
    n = x.shape[d]
    if not -n <= start <= n:
        raise IndexError(f"start out of range (expected to be in range of [{-n}, {n}], but got {start})")
    start = start + n if start < 0 else start
    if length < 0 or start + length > n:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size ({n}).")
    return jax.lax.slice_in_dim(x, start, start + length, axis=d)


@register(aten.diag_embed.default)
def diag_embed(x, offset=0, dim1=-2, dim2=-1):
    nd = x.ndim + 1
    d1, d2 = canonical_dim(dim1, nd), canonical_dim(dim2, nd)
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    k = x.shape[-1] if x.ndim else 1
    n = k + abs(offset)
    i = np.arange(k)
    rows, cols = i - min(offset, 0), i + max(offset, 0)
    out = jnp.zeros(x.shape[:-1] + (n, n), x.dtype).at[..., rows, cols].set(x.reshape(x.shape[:-1] + (k,)))
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


# -- search and counting -----------------------------------------------------


def _binary_search(seq, values, right):
    """torch's binary search (cus_lower_bound / cus_upper_bound) step for step, over the last
    axis of ``seq`` (rows matching ``values``'): with NaN in either, its answer depends on the
    path it takes, which a count of smaller elements would not give."""
    n = seq.shape[-1]
    start = jnp.zeros(values.shape, _LONG)
    end = jnp.full(values.shape, n, _LONG)
    for _ in range(n.bit_length()):  # each step halves end - start
        mid = start + ((end - start) >> 1)
        at = jnp.take_along_axis(seq, jnp.clip(mid, 0, n - 1), axis=-1)
        go_right = ~(at > values) if right else ~(at >= values)
        active = start < end
        start = jnp.where(active & go_right, mid + 1, start)
        end = jnp.where(active & ~go_right, mid, end)
    return start


def _searchsorted(seq, values, right, out_int32):
    dtype = _dt.result_type(seq, values)
    seq, values = seq.astype(dtype), values.astype(dtype)
    out_dtype = np.int32 if out_int32 else _LONG
    if seq.ndim <= 1:
        flat = values.reshape(1, -1)
        return _binary_search(seq.reshape(1, -1), flat, right).reshape(values.shape).astype(out_dtype)
    if seq.shape[:-1] != values.shape[:-1]:
        raise RuntimeError(
            "torch.searchsorted(): boundaries tensor should be 1 dimension or the first N-1 dimensions of boundaries "
            f"tensor and input value tensor must match, but we got boundaries tensor {list(seq.shape)} and input "
            f"value tensor {list(values.shape)}"
        )
    if values.size == 0 or seq.size == 0:
        return jnp.zeros(values.shape, out_dtype)
    return _binary_search(seq, values, right).astype(out_dtype)


refused_dtypes(aten.searchsorted, aten.bucketize, aten.isin, kinds="bc")  # (torch's CPU kernels compare numbers)
# (not of bools, nor complex numbers; of integers too, as CUDA's kernel, unlike the CPU's: see histc)
refused_dtypes(aten.histc, kinds="bc")


@register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted(seq, values, *, out_int32=False, right=False, side=None, sorter=None):
    if side is not None:
        right = side == "right"
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    if not hasattr(values, "dtype"):
        values = jnp.asarray(as_dtype(values, _dt.result_type(seq, values)))
    return _searchsorted(seq, values, right, out_int32)


@register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize(values, boundaries, *, out_int32=False, right=False):
    if not hasattr(values, "dtype"):
        values = jnp.asarray(as_dtype(values, _dt.result_type(boundaries, values)))
    if boundaries.ndim != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.ndim})")
    return _searchsorted(boundaries, values, right, out_int32)


@register(aten.histc.default)
def histc(x, bins=100, min=0, max=0):
    # integer inputs too, as CUDA's kernel counts them (HF's MoE layers histc int expert ids off the CPU)
    if bins <= 0:
        raise RuntimeError(f"torch.histc(): bins must be > 0, but got {bins} for dimension 0")
    if min > max:
        raise RuntimeError("torch.histc(): max must be larger than min")
    xc = x.astype(np.float32) if x.dtype in _HALF else x
    if min == max and x.size:
        lo, hi = jnp.min(xc), jnp.max(xc)
    else:
        lo, hi = jnp.asarray(min, xc.dtype), jnp.asarray(max, xc.dtype)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    inside = (xc >= lo) & (xc <= hi)
    # torch computes the bin in the input's dtype: a half-precision input rounds after each step
    rnd = (lambda v: v.astype(x.dtype).astype(np.float32)) if x.dtype in _HALF else (lambda v: v)
    pos = jnp.floor(rnd(true_divide(rnd(rnd(xc - lo) * bins), rnd(hi - lo)))).astype(_LONG)
    pos = jnp.where(inside, jnp.clip(pos, 0, bins - 1), 0)
    return jnp.zeros((bins,), x.dtype).at[pos.reshape(-1)].add(inside.reshape(-1).astype(x.dtype))


refused_dtypes(aten.bincount, kinds="bcf", operands=1)  # (torch's CPU kernel counts integers; floating weights)


@register(aten.bincount.default)
def bincount(x, weights=None, minlength=0):
    if x.ndim != 1 or not _dt.is_integral(x.dtype):
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    (v,) = _concrete("aten.bincount", x)
    if v.size and v.min() < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    n = max(int(v.max()) + 1 if v.size else 0, minlength)
    if weights is None:
        return jnp.zeros((n,), _LONG).at[x].add(1)
    dtype = weights.dtype if weights.dtype in (np.dtype(np.float32), np.dtype(np.float64)) else np.dtype(np.float64)
    return jnp.zeros((n,), dtype).at[x].add(weights.astype(dtype))


# -- unique ------------------------------------------------------------------


def _host_values(name, x):
    (v,) = _concrete(name, x)
    return v.astype(np.float32) if v.dtype in _HALF else v


def _empty_long():
    return jnp.zeros((0,), _LONG)


@register(aten.repeat_interleave.Tensor)
def repeat_interleave(repeats, *, output_size=None):
    """``i`` repeated ``repeats[i]`` times; under jax.jit only with ``output_size`` given."""
    if repeats.ndim != 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    if output_size is None or not _traced(repeats):
        counts = _concrete("aten.repeat_interleave", repeats)[0]
        if (counts < 0).any():
            raise RuntimeError("repeats can not be negative")
        if output_size is not None and output_size != counts.sum():
            raise RuntimeError("allocated size does not match required size")
        return jnp.asarray(np.repeat(np.arange(counts.size), counts), repeats.dtype)
    return jnp.repeat(jnp.arange(repeats.shape[0], dtype=repeats.dtype), repeats, total_repeat_length=output_size)


# torch's CPU kernels sort real numbers only
refused_dtypes(aten._unique2, aten._unique, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive,
               kinds="c")


@register(aten._unique2.default)
def _unique2(x, sorted=True, return_inverse=False, return_counts=False):
    v = _host_values("aten.unique", x).reshape(-1)
    values, inverse, counts = np.unique(v, return_inverse=True, return_counts=True, equal_nan=False)
    return (
        jnp.asarray(values).astype(x.dtype),
        jnp.asarray(inverse.reshape(x.shape), _LONG) if return_inverse else _empty_long(),
        jnp.asarray(counts, _LONG) if return_counts else _empty_long(),
    )


@register(aten._unique.default)
def _unique(x, sorted=True, return_inverse=False):
    values, inverse, _ = _unique2(x, sorted, return_inverse)
    return values, inverse


@register(aten.unique_dim.default)
def unique_dim(x, dim, sorted=True, return_inverse=False, return_counts=False):
    d = canonical_dim(dim, x.ndim)
    v = _host_values("aten.unique_dim", x)
    if v.shape[d] == 0:
        values, inverse, counts = v, np.zeros((0,), np.int64), np.zeros((0,), np.int64)
    else:
        values, inverse, counts = np.unique(v, return_inverse=True, return_counts=True, axis=d)
    return (
        jnp.asarray(values).astype(x.dtype),
        jnp.asarray(inverse.reshape(-1), _LONG) if return_inverse else _empty_long(),
        jnp.asarray(counts, _LONG) if return_counts else _empty_long(),
    )


def _slices_contiguous(out, dim):
    """Strides for ``out[0]`` whose slices along ``dim`` are contiguous, one after another."""
    shape = out[0].shape
    if dim is None or not shape:
        return (None,) * len(out)
    d = canonical_dim(dim, len(shape))
    st, step = [0] * len(shape), 1
    for k in reversed([d] + [k for k in range(len(shape)) if k != d]):
        st[k] = step
        step *= max(shape[k], 1)
    return (tuple(st),) + (None,) * (len(out) - 1)


@strides(aten.unique_dim, aten.unique_dim_consecutive)
def _unique_dim_strides(args, kwargs, out):
    return _slices_contiguous(out, args[1])  # torch gathers the unique slices one after another


@strides(aten.unique_consecutive)
def _unique_consecutive_strides(args, kwargs, out):
    return _slices_contiguous(out, args[3] if len(args) > 3 else kwargs.get("dim"))


def _unique_consecutive(name, x, return_inverse, return_counts, dim):
    v = _host_values(name, x)
    flat = dim is None
    rows = v.reshape(-1, 1) if flat else np.moveaxis(v, canonical_dim(dim, x.ndim), 0)
    n = rows.shape[0]
    changed = np.ones(n, bool)
    if n > 1:
        changed[1:] = (rows[1:] != rows[:-1]).reshape(n - 1, -1).any(axis=1)
    starts = np.flatnonzero(changed)
    values = rows[starts]
    values = values.reshape(-1) if flat else np.moveaxis(values, 0, canonical_dim(dim, x.ndim))
    inverse = np.cumsum(changed) - 1
    counts = np.diff(np.append(starts, n))
    return (
        jnp.asarray(values).astype(x.dtype),
        jnp.asarray(inverse.reshape(x.shape) if flat else inverse, _LONG) if return_inverse else _empty_long(),
        jnp.asarray(counts, _LONG) if return_counts else _empty_long(),
    )


@register(aten.unique_consecutive.default)
def unique_consecutive(x, return_inverse=False, return_counts=False, dim=None):
    return _unique_consecutive("aten.unique_consecutive", x, return_inverse, return_counts, dim)


@register(aten.unique_dim_consecutive.default)
def unique_dim_consecutive(x, dim, return_inverse=False, return_counts=False):
    return _unique_consecutive("aten.unique_dim_consecutive", x, return_inverse, return_counts, dim)


# -- composites whose output shape torch computes from values -------------------------
#
# These CompositeImplicitAutograd ops select with a boolean mask (masked_select), so
# they cannot run under jax.jit although their output shape depends on sizes only.
# An AutogradPrivateUse1 kernel computes the positions from the sizes on the host and
# gathers them with a differentiable index op, so autograd stays torch's.


def combinations(x, r=2, with_replacement=False):
    """The AutogradPrivateUse1 kernel of aten::combinations."""
    if x.dim() != 1:
        raise RuntimeError(f"Expect a 1D vector, but got shape {list(x.shape)}")
    if r < 0:
        raise RuntimeError(f"Expect a non-negative number, but got {r}")
    if r == 0:
        return x.new_empty(0)
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    positions = np.array(list(pick(range(x.shape[0]), r)), np.int64).reshape(-1, r)
    return x[torch.from_numpy(positions).to(x.device)]


_library = torch.library.Library("aten", "IMPL")
_library.impl("combinations", combinations, "AutogradPrivateUse1")
