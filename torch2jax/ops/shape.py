"""Views and shape ops.

Each view op has a forward lowering and an inverse: how a value written into
the view lands in its input. The inverse of ``slice`` is ``slice_scatter``, of
``select`` is ``select_scatter`` and so on; those scatter ops and the ``*_copy``
variants are registered from the same functions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from ..tensor import Tensor
from ..dispatch import INTERNAL_OVERLAP_MESSAGE, TorchRuntimeError, _storage_numel
from .registry import canonical_dim, canonical_dims, decomposition, register, view

aten = torch.ops.aten
prims = torch.ops.prims


def infer_size(size, numel):
    """torch's ``view`` size with at most one -1 filled in."""
    size = [int(s) for s in size]
    if size.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        if known == 0 or numel % known:
            raise RuntimeError(f"shape '{size}' is invalid for input of size {numel}")
        size[size.index(-1)] = numel // known
    if math.prod(size) != numel:
        raise RuntimeError(f"shape '{size}' is invalid for input of size {numel}")
    return tuple(size)


def _reshape_back(base, value, *args, **kwargs):
    return value.reshape(base.shape)


# -- identity views ----------------------------------------------------------


@view(aten.alias, aten.detach, aten.lift_fresh, inverse=None)
def alias(x):
    return x


@register(aten.alias_copy, aten.detach_copy)
def alias_copy(x):
    return x


# -- reshaping views ---------------------------------------------------------


# (``_unsafe_view`` shares storage as ``view`` does; only autograd does not record it as a view)
@view(aten.view.default, aten._reshape_alias, aten._unsafe_view, inverse=_reshape_back)
def view_(x, size, *stride):
    return x.reshape(infer_size(size, x.size))


@register(aten.view_copy.default, aten._reshape_copy)
def view_copy(x, size):
    return x.reshape(infer_size(size, x.size))


@view(aten.squeeze, inverse=_reshape_back)
def squeeze(x, dim=None):
    dims = canonical_dims(dim, x.ndim) if dim is not None else tuple(range(x.ndim))
    return x.reshape(tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1)))


@view(aten.unsqueeze, inverse=_reshape_back)
def unsqueeze(x, dim):
    return jnp.expand_dims(x, canonical_dim(dim, x.ndim + 1))


register(aten.squeeze_copy)(squeeze)
register(aten.unsqueeze_copy)(unsqueeze)


def _bitcast(x, dtype):
    src, dst = np.dtype(x.dtype), np.dtype(dtype)
    if src == dst:
        return x
    if src.kind == "c" or dst.kind == "c":
        return _bitcast_complex(x, dst)
    if dst == np.bool_ or src == np.bool_:
        carrier = np.dtype(np.uint8)
        if src == np.bool_:
            return _bitcast(x.astype(carrier), dst)
        return _bitcast(x, carrier).astype(np.bool_)
    if dst.itemsize == src.itemsize:
        return jax.lax.bitcast_convert_type(x, dst)
    if x.ndim == 0 or (dst.itemsize > src.itemsize and x.shape[-1] * src.itemsize % dst.itemsize):
        raise RuntimeError(
            "self.size(-1) must be divisible by {} to view {} as {} (different element sizes)".format(
                dst.itemsize // src.itemsize, _dt.to_torch(src), _dt.to_torch(dst)
            )
        )
    if dst.itemsize < src.itemsize:
        # (through a trailing unit dim: XLA's simplifier folds a narrowing bitcast of a widening one's result
        # into one bitcast between the outer types, of a shape the HLO verifier then refuses)
        out = jax.lax.bitcast_convert_type(x[..., None], dst)  # adds a trailing dim of src/dst
        return out.reshape(x.shape[:-1] + (x.shape[-1] * (src.itemsize // dst.itemsize),))
    ratio = dst.itemsize // src.itemsize
    return jax.lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (x.shape[-1] // ratio, ratio)), dst)


def _bitcast_complex(x, dst):
    """`_bitcast` where a side is complex, through the real parts (XLA bitcasts no complex).
    The shapes were checked by torch's meta kernel: a 0-d ``x`` changes no element size."""
    one = x.reshape(1) if x.ndim == 0 else x
    if np.dtype(x.dtype).kind == "c":
        parts = jnp.stack([jnp.real(one), jnp.imag(one)], axis=-1)
        out = _bitcast(parts.reshape(one.shape[:-1] + (2 * one.shape[-1],)), dst)
    else:
        parts = _bitcast(one, _dt.real_of(dst))
        out = jax.lax.complex(parts[..., 0::2], parts[..., 1::2])
    return out.reshape(()) if x.ndim == 0 else out


def storage_as(dtype, base):
    """``base``'s bytes as a flat array of ``dtype``, less the trailing bytes that make no
    whole element of it (torch's storage holds ``nbytes // itemsize`` elements of a dtype view)."""
    flat = base.reshape(-1)
    src, dst = np.dtype(flat.dtype).itemsize, np.dtype(dtype).itemsize
    whole = flat.size * src // dst * dst // src
    return _bitcast(flat[:whole], dtype)


def storage_as_back(base, value):
    """`storage_as`'s inverse: ``value``'s bytes written over ``base``'s first ones."""
    flat = base.reshape(-1)
    back = _bitcast(value, flat.dtype)
    return jnp.concatenate([back, flat[back.size:]]).reshape(base.shape)


@view(aten.view.dtype, inverse=lambda base, value, dtype: _bitcast(value, base.dtype))
def view_dtype(x, dtype):
    return _bitcast(x, _dt.to_jax(dtype))


@view(aten.view_as_real, inverse=lambda base, value: jax.lax.complex(value[..., 0], value[..., 1]))
def view_as_real(x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@view(aten.view_as_complex, inverse=lambda base, value: view_as_real(value))
def view_as_complex(x):
    if x.ndim == 0 or x.shape[-1] != 2:
        raise RuntimeError("Tensor must have a last dimension of size 2")
    return jax.lax.complex(x[..., 0], x[..., 1])


register(aten.view_as_real_copy)(view_as_real)
register(aten.view_as_complex_copy)(view_as_complex)


# -- permutations ------------------------------------------------------------


def _transpose_dims(ndim, dim0, dim1):
    perm = list(range(ndim))
    d0, d1 = canonical_dim(dim0, ndim), canonical_dim(dim1, ndim)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


@view(aten.transpose.int, inverse=lambda base, value, dim0, dim1: transpose(value, dim0, dim1))
def transpose(x, dim0, dim1):
    if x.ndim == 0:
        return x
    return jnp.transpose(x, _transpose_dims(x.ndim, dim0, dim1))


@view(aten.t, inverse=lambda base, value: t(value))
def t(x):
    if x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    return x.T


@view(aten.permute, inverse=lambda base, value, dims: jnp.transpose(value, np.argsort(canonical_dims(dims, base.ndim))))
def permute(x, dims):
    dims = canonical_dims(dims, x.ndim)
    if len(dims) != x.ndim or len(set(dims)) != x.ndim:
        raise RuntimeError(
            f"permute(sparse_coo): number of dimensions in the tensor input does not match the length of "
            f"the desired ordering of dimensions i.e. input.dim() = {x.ndim} is not equal to len(dims) = {len(dims)}"
        )
    return jnp.transpose(x, dims)


register(aten.transpose_copy.int)(transpose)
register(aten.t_copy)(t)
register(aten.permute_copy)(permute)


# -- slicing -----------------------------------------------------------------


def _slice_bounds(n, start, end, step):
    start = 0 if start is None else start
    end = n if end is None else end
    if start < 0:
        start += n
    if end < 0:
        end += n
    start = min(max(start, 0), n)
    end = min(max(end, start), n)
    return start, end, step


def _slice_index(ndim, dim, start, end, step):
    idx = [slice(None)] * ndim
    idx[dim] = slice(start, end, step)
    return tuple(idx)


def slice_scatter(base, value, dim=0, start=None, end=None, step=1):
    d = canonical_dim(dim, base.ndim)
    s, e, st = _slice_bounds(base.shape[d], start, end, step)
    where = _slice_index(base.ndim, d, s, e, st)
    sliced = list(base.shape)
    concrete = all(isinstance(n, int) for n in (*sliced, *value.shape, s, e))  # (not with symbolic sizes)
    sliced[d] = len(range(s, e, st)) if concrete else sliced[d]
    if concrete and list(value.shape) != sliced:
        raise TorchRuntimeError(f"expected src to have a size equal to the slice of self. src size = "
                                f"{list(value.shape)}, slice size = {sliced}")
    return base.at[where].set(value.astype(base.dtype))


@view(aten.slice.Tensor, inverse=slice_scatter)
def slice_(x, dim=0, start=None, end=None, step=1):
    if step <= 0:
        raise RuntimeError("slice step must be positive")
    d = canonical_dim(dim, x.ndim)
    s, e, st = _slice_bounds(x.shape[d], start, end, step)
    return jax.lax.slice_in_dim(x, s, e, st, axis=d)


register(aten.slice_scatter)(slice_scatter)
register(aten.slice_copy.Tensor)(slice_)


def select_scatter(base, value, dim, index):
    d = canonical_dim(dim, base.ndim)
    if not isinstance(index, int):  # a traced number (select's backward of ``alphas[t]``)
        at = jnp.where(index < 0, index + base.shape[d], index)
        return jax.lax.dynamic_update_index_in_dim(base, value.astype(base.dtype), at, d)
    idx = [slice(None)] * base.ndim
    idx[d] = index + base.shape[d] if index < 0 else index
    return base.at[tuple(idx)].set(value.astype(base.dtype))


@view(aten.select.int, inverse=select_scatter)
def select(x, dim, index):
    d = canonical_dim(dim, x.ndim)
    n = x.shape[d]
    if not -n <= index < n:
        raise IndexError(f"select(): index {index} out of range for tensor of size {list(x.shape)} at dimension {dim}")
    return jax.lax.index_in_dim(x, index % n, axis=d, keepdims=False)


register(aten.select_scatter)(select_scatter)
register(aten.select_copy.int)(select)


def _split_bounds(n, sizes):
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    if start != n:
        raise RuntimeError(
            f"split_with_sizes expects split_sizes to sum exactly to {n}, but got split_sizes={list(sizes)}"
        )
    return bounds


def _split_sizes(n, split_size):
    if split_size == 0 and n == 0:
        return [0]
    if split_size <= 0:
        raise RuntimeError(f"split_size can only be 0 if dimension size is 0, but got dimension size of {n}")
    return [min(split_size, n - i) for i in range(0, n, split_size)] or [0]


def split_with_sizes_scatter(base, value, i, sizes, dim=0):
    d = canonical_dim(dim, base.ndim)
    s, e = _split_bounds(base.shape[d], sizes)[i]
    return slice_scatter(base, value, d, s, e)


@view(aten.split_with_sizes, inverse=split_with_sizes_scatter)
def split_with_sizes(x, sizes, dim=0):
    d = canonical_dim(dim, x.ndim)
    return [jax.lax.slice_in_dim(x, s, e, axis=d) for s, e in _split_bounds(x.shape[d], sizes)]


@view(
    aten.split.Tensor,
    inverse=lambda base, value, i, size, dim=0: split_with_sizes_scatter(
        base, value, i, _split_sizes(base.shape[canonical_dim(dim, base.ndim)], size), dim
    ),
)
def split(x, split_size, dim=0):
    return split_with_sizes(x, _split_sizes(x.shape[canonical_dim(dim, x.ndim)], split_size), dim)


@view(aten.unbind.int, inverse=lambda base, value, i, dim=0: select_scatter(base, value, dim, i))
def unbind(x, dim=0):
    if x.ndim == 0:  # (whatever the dim)
        raise IndexError("Dimension specified as 0 but tensor has no dimensions")
    d = canonical_dim(dim, x.ndim)
    return [jax.lax.index_in_dim(x, i, axis=d, keepdims=False) for i in range(x.shape[d])]


register(aten.split_with_sizes_copy)(split_with_sizes)
register(aten.split_copy.Tensor)(split)
register(aten.unbind_copy.int)(unbind)


def _write_pieces(name, pieces, out, exact):
    """Write ``pieces`` into the list ``out`` as torch's out= kernels of the split ops do: with
    ``exact``, each out of the piece's dtype and resized to it, else copied into (broadcast, cast)."""
    if len(out) != len(pieces):
        raise RuntimeError(f"{name} expected an out= argument of size {len(pieces)}, got size {len(out)}")
    for o, piece in zip(out, pieces):
        if not exact:
            o.copy_(piece)
            continue
        if o.dtype != piece.dtype:
            raise RuntimeError(f"Expected out tensor to have dtype {_dt.c_type_name(piece.dtype)}, but got "
                               f"{_dt.c_type_name(o.dtype)} instead")
        aten.clone.out(piece, out=o)  # (resized as out= is)


@decomposition(aten.unbind_copy.int_out)
def unbind_copy_out(x, dim=0, *, out):
    _write_pieces("unbind_copy_int_out", aten.unbind_copy.int(x, dim), out, exact=True)


@decomposition(aten.split_with_sizes_copy.out)
def split_with_sizes_copy_out(x, split_sizes, dim=0, *, out):
    _write_pieces("split_with_sizes_copy_out", aten.split_with_sizes_copy(x, split_sizes, dim), out, exact=True)


@decomposition(aten.split_copy.Tensor_out)
def split_copy_out(x, split_size, dim=0, *, out):
    _write_pieces("split_copy_Tensor_out()", aten.split_copy.Tensor(x, split_size, dim), out, exact=False)


def _diagonal_index(shape, offset, dim1, dim2):
    n = len(shape)
    d1, d2 = canonical_dim(dim1, n), canonical_dim(dim2, n)
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    length = max(0, min(shape[d1] + min(offset, 0), shape[d2] - max(offset, 0)))
    i = np.arange(length)
    return d1, d2, i - min(offset, 0), i + max(offset, 0)


def diagonal_scatter(base, value, offset=0, dim1=0, dim2=1):
    d1, d2, r, c = _diagonal_index(base.shape, offset, dim1, dim2)
    moved = jnp.moveaxis(base, (d1, d2), (-2, -1))
    moved = moved.at[..., r, c].set(value.astype(base.dtype))
    return jnp.moveaxis(moved, (-2, -1), (d1, d2))


@view(aten.diagonal.default, inverse=diagonal_scatter)
def diagonal(x, offset=0, dim1=0, dim2=1):
    d1, d2, r, c = _diagonal_index(x.shape, offset, dim1, dim2)
    return jnp.moveaxis(x, (d1, d2), (-2, -1))[..., r, c]


register(aten.diagonal_scatter)(diagonal_scatter)
register(aten.diagonal_copy.default)(diagonal)


def _expand_shape(shape, size):
    size = list(size)
    if len(size) < len(shape):
        raise RuntimeError(
            f"expand(torch.FloatTensor{{{list(shape)}}}, size={size}): the number of sizes provided "
            f"({len(size)}) must be greater or equal to the number of dimensions in the tensor ({len(shape)})"
        )
    lead = len(size) - len(shape)
    out = []
    for i, s in enumerate(size):
        old = shape[i - lead] if i >= lead else 1
        if s == -1:
            if i < lead:
                raise RuntimeError("The expanded size of the tensor (-1) isn't allowed in a leading, non-existing dimension")
            s = old
        elif old != 1 and old != s:
            raise RuntimeError(
                f"The expanded size of the tensor ({s}) must match the existing size ({old}) at non-singleton "
                f"dimension {i}.  Target sizes: {size}.  Tensor sizes: {list(shape)}"
            )
        out.append(s)
    return tuple(out)


def _expand_inverse(base, value, size, implicit=False):
    shape = _expand_shape(base.shape, size)
    lead = len(shape) - base.ndim
    if any(s > 1 and (i < lead or base.shape[i - lead] == 1) for i, s in enumerate(shape)):
        raise RuntimeError(INTERNAL_OVERLAP_MESSAGE)
    return value.reshape(base.shape)


@view(aten.expand.default, inverse=_expand_inverse)
def expand(x, size, implicit=False):
    return jnp.broadcast_to(x, _expand_shape(x.shape, size))


register(aten.expand_copy.default)(expand)


@register(aten.resize.default)
def resize(x, size, memory_format=None):
    """``x``'s elements in order, cut to or extended to ``size``: the new elements, which torch
    leaves uninitialized, are zeros (or torch's deterministic fill: `creation.uninitialized`)."""
    from .creation import uninitialized

    flat = x.reshape(-1)
    n = math.prod(size)
    if n > flat.shape[0]:
        flat = jnp.concatenate([flat, uninitialized((n - flat.shape[0],), flat.dtype)])
    return flat[:n].reshape(size)


@decomposition(aten.as_strided_scatter.default, prims.as_strided_scatter.default)
def as_strided_scatter(x, src, size, stride, storage_offset=0):
    """A copy of ``x`` (its storage as far as its layout reaches, strides kept, as torch's
    clone_preserve_strides) with ``src`` written into its ``as_strided(size, stride,
    storage_offset)`` view."""
    if tuple(src.shape) != tuple(size):
        raise RuntimeError(f"as_strided_scatter: expected src to have a size equal to the slice of self. "
                           f"src size = {list(src.shape)}, slice size = {list(size)}")
    needed = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + x.storage_offset() if x.numel() else 0
    buffer = x.as_strided((needed,), (1,), 0).clone()
    out = buffer.as_strided(x.shape, x.stride(), x.storage_offset())
    buffer.as_strided(size, stride, 0 if storage_offset is None else storage_offset).copy_(src)
    return out


# -- storage metadata (forward-mode AD's tangent layout) -----------------------


@decomposition(aten._has_same_storage_numel.default)
def has_same_storage_numel(base, other):
    """Whether two tensors' storages hold as many elements (``make_dual`` asks it of a
    tangent); a question about metadata, answered from the storages' static shapes."""
    return _storage_numel(base) == _storage_numel(other)


@decomposition(aten._new_zeros_with_same_feature_meta.default)
def new_zeros_with_same_feature_meta(self, other, *, self_num_batch_dims=0):
    """Zeros laid out like ``other`` (its sizes, strides and storage size), behind
    ``self``'s first ``self_num_batch_dims`` dimensions: the storage forward-mode AD copies a
    tangent into so that it mirrors its primal's layout."""
    numel = _storage_numel(other)
    if self_num_batch_dims == 0:
        zeros = torch.zeros(numel, dtype=self.dtype, device=self.device)
        return zeros.as_strided(other.shape, other.stride(), other.storage_offset())
    batch = self.shape[:self_num_batch_dims]
    strides = []
    for size in reversed(batch):
        strides.insert(0, numel)
        numel *= size
    zeros = torch.zeros(numel, dtype=other.dtype, device=other.device)
    return zeros.as_strided((*batch, *other.shape), (*strides, *other.stride()), other.storage_offset())


def is_traced(t):
    """Whether ``t`` is a torch2jax tensor whose value is being traced (a CPU tensor never is)."""
    return isinstance(t, Tensor) and isinstance(t.jax(), jax.core.Tracer)


def narrow_tensor(x, dim, start, length):
    """The AutogradPrivateUse1 kernel of aten::narrow.Tensor. torch reads ``start`` with
    ``item()``; while ``start`` is traced its value is unknown, so the slice is a gather at
    ``start + arange(length)`` (a copy: a view cannot start at a traced offset) and the
    range check torch makes is left to the caller."""
    if not is_traced(start):
        return aten.narrow.Tensor.decompose(x, dim, start, length)
    if start.dim() != 0 or start.is_floating_point() or start.is_complex() or start.dtype == torch.bool:
        raise RuntimeError("start must be an 0-dim integral Tensor.")
    d = canonical_dim(dim, x.dim())
    n = x.shape[d]
    if length < 0 or length > n:
        raise RuntimeError(f"start + length ({length}) exceeds dimension size ({n}).")
    start = torch.where(start < 0, start + n, start)
    return x.index_select(d, start + torch.arange(length, device=x.device))


_library = torch.library.Library("aten", "IMPL")
_library.impl("narrow.Tensor", narrow_tensor, "AutogradPrivateUse1")


def tensor_split_tensor(x, indices_or_sections, dim=0):
    """The AutogradPrivateUse1 kernel of aten::tensor_split.tensor_indices_or_sections. torch
    wants the indices (or the number of sections) on the CPU and reads them with ``tolist()``;
    here they may also be on the jax device (where `t2j.jit` puts a CPU argument) and are read
    the same way, so while they are traced the trace stops (the pieces' sizes depend on them)."""
    t = indices_or_sections
    if t.dtype != torch.long:
        raise RuntimeError(f"tensor_split expected tensor_indices_or_sections to have dtype of long, but got {t.dtype}")
    if t.dim() > 1:
        raise RuntimeError("tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
                           f"one-dimensional tensor, but got a tensor with {t.dim()} dims")
    return torch.tensor_split(x, t.item() if t.dim() == 0 else t.tolist(), dim)


_library.impl("tensor_split.tensor_indices_or_sections", tensor_split_tensor, "AutogradPrivateUse1")
