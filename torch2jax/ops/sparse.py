"""Sparse layouts on the jax device.

A sparse tensor on the jax device is torch's own sparse tensor (``layout=torch.sparse_coo``,
``device="jax"``; or a compressed layout, CSR / CSC / BSR / BSC) whose index and value tensors
are jax tensors: ``_indices()``, ``_values()``, ``_nnz()``, ``coalesce()``, ``is_coalesced()`` and
``torch.sparse`` behave as on the CPU. torch sends the ops of such a tensor to its
``SparsePrivateUse1`` (``SparseCsrPrivateUse1``) dispatch key, or to ``Tensor.__torch_dispatch__``
where a dense jax tensor takes part (``dense.add_(sparse)``, ``sparse_mask``): `run` serves both.
The kernels registered here with `sparse_kernel` compute on the jax arrays (``to_dense``,
``coalesce``, ``add``, ``mul``, ``mm`` / ``addmm``, ``sum``, ``sparse_mask``, conversions); every
other op runs on a CPU copy through torch's own sparse kernels and comes back, with a one-time
warning naming it, as the host fallback of dense ops does.

Inside a traced program (``t2j.jit``, ``jax.jit``) the number of elements a new sparse tensor
stores would depend on values JAX does not know yet: a sparse COO tensor built there (the weight
gradient of ``nn.Embedding(sparse=True)`` in a jitted step) is stored dense, as its
``to_dense()``, with a one-time warning; ``to_sparse()`` of a traced tensor raises.
"""

from __future__ import annotations

import warnings

import jax
import torch
from torch.utils import _pytree

from .. import dispatch as _dispatch
from ..dispatch import OpError, is_sparse_jax
from ..tensor import DEVICE, Tensor, from_torch_cpu
from .linalg import addmm
from .reductions import sum_
from .registry import decomposition, register

aten = torch.ops.aten

# OpOverload -> handler(func, args, kwargs), for ops with a sparse jax tensor among their operands
SPARSE: dict = {}

_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
# torch's CPU kernels of the ops that only read or set a sparse tensor's parts work for any device
_CPU_KEYS = {torch.sparse_coo: torch._C.DispatchKeySet(torch._C.DispatchKey.SparseCPU),
             **{layout: torch._C.DispatchKeySet(torch._C.DispatchKey.SparseCsrCPU) for layout in _COMPRESSED}}

_warned_dense = False
_warned_host: set = set()


def _warn_dense():
    global _warned_dense
    if not _warned_dense:
        _warned_dense = True
        warnings.warn(
            "torch2jax: a sparse COO tensor made inside a traced program (t2j.jit, jax.jit; e.g. the weight "
            "gradient of nn.Embedding(sparse=True)) is stored dense, with the same values as its to_dense(): "
            "how many elements it stores would depend on values the program does not know yet",
            stacklevel=2,
        )


def _every_overload(op) -> list:
    """``op``'s overloads, in-place and ``out=`` ones included (``op`` itself if it is one)."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def sparse_kernel(*ops):
    """Register the decorated ``fn(*args, **kwargs)``, over torch tensors, as the kernel of ``ops``
    (every overload of a packet, in-place ones included) where a sparse jax tensor takes part."""

    def deco(fn):
        for overload in (o for op in ops for o in _every_overload(op)):
            SPARSE[overload] = lambda func, args, kwargs: fn(*args, **kwargs)
        return fn

    return deco


def run(func, args, kwargs):
    """Run ATen op ``func`` with a sparse jax tensor among its operands: its kernel here, else on the host."""
    handler = SPARSE.get(func)
    if handler is not None:
        return handler(func, args, kwargs)
    return _on_host(func, args, kwargs)


def _structural(func, args, kwargs):
    """torch's CPU kernel of ``func``: it reads or sets the sparse tensor's parts, whatever their device."""
    layouts = [a.layout for a in _pytree.tree_leaves((args, kwargs)) if is_sparse_jax(a)]
    return func.redispatch(_CPU_KEYS[(layouts or [kwargs.get("layout") or torch.sparse_coo])[0]], *args, **kwargs)


for _name in ("_indices", "_values", "_nnz", "is_coalesced", "sparse_dim", "dense_dim", "_dimI", "_dimV",
              "_coalesced_", "indices", "values", "crow_indices", "col_indices", "ccol_indices", "row_indices",
              "clone", "copy_", "zero_", "sparse_resize_", "sparse_resize_and_clear_", "copy_sparse_to_sparse_",
              "_sparse_coo_tensor_with_dims", "detach", "alias"):
    for _overload in _every_overload(getattr(aten, _name)):
        SPARSE[_overload] = _structural


def _coo(sparse_dim, dense_dim, size, indices, values, dtype=None, is_coalesced=None):
    """A sparse COO tensor on the jax device holding ``indices`` and ``values`` themselves."""
    return aten._sparse_coo_tensor_with_dims_and_tensors.default.redispatch(
        _CPU_KEYS[torch.sparse_coo], sparse_dim, dense_dim, list(size), indices, values,
        dtype=dtype or values.dtype, layout=torch.sparse_coo, device=DEVICE, pin_memory=None, is_coalesced=is_coalesced)


def _traced(*tensors) -> bool:
    """Whether any of ``tensors`` (or of a sparse one's parts) holds a value a JAX trace computes."""
    return any(_traced(t._values()) if is_sparse_jax(t) and t.layout == torch.sparse_coo
               else _traced(t.values()) if is_sparse_jax(t)
               else isinstance(t, Tensor) and isinstance(t._value(), jax.core.Tracer) for t in tensors)


@decomposition(aten._sparse_coo_tensor_with_dims_and_tensors)
def _sparse_coo_tensor_with_dims_and_tensors(sparse_dim, dense_dim, size, indices, values, *, dtype=None,
                                             layout=None, device=None, pin_memory=None, is_coalesced=None):
    """torch.sparse_coo_tensor on the jax device (and every sparse result torch builds from parts)."""
    if _traced(indices, values):
        _warn_dense()
        dense = torch.zeros(list(size), dtype=dtype or values.dtype, device=DEVICE)
        return dense.index_put_(tuple(indices[:sparse_dim]), values.to(dense.dtype), accumulate=True)
    return _coo(sparse_dim, dense_dim, size, indices, values, dtype, is_coalesced)


def _compressed_from_parts(func):
    """A compressed sparse tensor (CSR, CSC, BSR, BSC) on the jax device holding the given parts."""

    def make(*args, **kwargs):
        if _traced(*(a for a in args if isinstance(a, torch.Tensor))):
            raise OpError(f"torch2jax: {func}: a compressed sparse tensor cannot be built inside a traced program "
                          "(t2j.jit, jax.jit); build it outside, or keep the tensor dense there")
        return func.redispatch(_CPU_KEYS[torch.sparse_csr], *args, **kwargs)

    return make


for _packet in (aten.sparse_compressed_tensor, aten._sparse_compressed_tensor_unsafe):
    for _op in _every_overload(_packet):
        decomposition(_op)(_compressed_from_parts(_op))


def _like(x, indices, values, is_coalesced=None):
    """A sparse COO tensor with ``x``'s size and dimensions, holding ``indices`` and ``values``."""
    return _coo(x.sparse_dim(), x.dense_dim(), x.shape, indices, values, values.dtype, is_coalesced)


# -- conversions ----------------------------------------------------------------------------


@sparse_kernel(aten._to_dense)
def _to_dense(x, dtype=None, masked_grad=None):
    if x.layout != torch.sparse_coo:
        return _on_host(aten._to_dense.default, (x,), {"dtype": dtype, "masked_grad": masked_grad})
    out = torch.zeros(x.shape, dtype=dtype or x.dtype, device=DEVICE)
    return out.index_put_(tuple(x._indices()), x._values().to(out.dtype), accumulate=True)


@decomposition(aten._to_sparse)
def _to_sparse(x, sparse_dim=None, *, layout=None, blocksize=None, dense_dim=None):
    """``x.to_sparse()``: the positions of ``x``'s nonzero elements (along its first ``sparse_dim``
    dimensions), coalesced. Compressed layouts are made on the host."""
    if _traced(x):
        raise OpError(
            "torch2jax: aten._to_sparse has an output shape that depends on tensor values (how many elements the "
            "sparse tensor stores), so it cannot run under jax.jit / t2j.jit; convert outside the traced function, "
            "or keep the tensor dense there")
    if layout not in (None, torch.sparse_coo):
        kwargs = {"layout": layout, "blocksize": blocksize, "dense_dim": dense_dim}
        return _on_host(aten._to_sparse.default, (x,), kwargs)
    sd = x.dim() - (dense_dim or 0) if sparse_dim is None else sparse_dim
    if not 0 <= sd <= x.dim():
        raise RuntimeError(f"sparse_dim must be in [0, {x.dim()}], got {sd}")  # (torch's check, its words)
    mask = x != 0
    if sd < x.dim():
        mask = mask.flatten(sd).any(-1)
    indices = mask.nonzero().t().contiguous() if sd else torch.zeros(0, 1, dtype=torch.int64, device=DEVICE)
    values = x[tuple(indices)] if sd else x.unsqueeze(0)
    return _coo(sd, x.dim() - sd, x.shape, indices, values.clone(), x.dtype, True)


def _made_on_host(func):
    """``x.to_sparse_csr()`` and the other compressed layouts of a dense jax tensor: made on the host."""

    def convert(x, *args, **kwargs):
        if _traced(x):
            raise OpError(f"torch2jax: {func} has an output shape that depends on tensor values (how many elements "
                          "the sparse tensor stores), so it cannot run under jax.jit / t2j.jit; convert outside the "
                          "traced function")
        return _on_host(func, (x, *args), kwargs)

    return convert


for _layout in ("csr", "csc", "bsr", "bsc"):
    _op = getattr(aten, f"_to_sparse_{_layout}").default
    decomposition(_op)(_made_on_host(_op))


@sparse_kernel(aten._to_copy)
def _to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    """A sparse tensor to or from the jax device (torch sends a CPU one here when asked for the jax
    device), or to another dtype: the same layout, its parts copied."""
    target = torch.device(device) if device is not None else x.device
    if layout not in (None, x.layout):
        kwargs = {"dtype": dtype, "layout": layout, "device": device}
        return _on_host(aten._to_copy.default, (x,), {k: v for k, v in kwargs.items() if v is not None})
    dtype = dtype or x.dtype
    if x.layout == torch.sparse_coo:
        indices, values = x._indices().to(target, copy=True), x._values().to(target, dtype, copy=True)
        return aten._sparse_coo_tensor_with_dims_and_tensors(
            x.sparse_dim(), x.dense_dim(), list(x.shape), indices, values, dtype=dtype, layout=torch.sparse_coo,
            device=target, is_coalesced=x.is_coalesced())
    compressed, plain = _compressed_parts(x)
    return torch.sparse_compressed_tensor(compressed.to(target, copy=True), plain.to(target, copy=True),
                                          x.values().to(target, dtype, copy=True), x.shape, dtype=dtype,
                                          layout=x.layout, device=target)


def _compressed_parts(x):
    if x.layout in (torch.sparse_csr, torch.sparse_bsr):
        return x.crow_indices(), x.col_indices()
    return x.ccol_indices(), x.row_indices()


@sparse_kernel(aten.sparse_mask)
def sparse_mask(x, mask):
    """``x`` (dense) at the positions ``mask`` stores, in ``mask``'s order."""
    if mask.layout != torch.sparse_coo or is_sparse_jax(x):
        return _on_host(aten.sparse_mask.default, (x, mask), {})
    indices = mask._indices()
    return _like(mask, indices.clone(), x[tuple(indices)].clone(), mask.is_coalesced())


# -- coalesce -------------------------------------------------------------------------------


def _linear(indices, size):
    """Each stored element's row-major position among the sparse dimensions ``size``."""
    lin = torch.zeros(indices.shape[1], dtype=torch.int64, device=DEVICE)
    for d, n in enumerate(size):
        lin = lin * n + indices[d]
    return lin


def _unlinear(lin, size):
    rows = []
    for n in reversed(size):
        rows.append(lin % n)
        lin = lin // n
    return torch.stack(rows[::-1]) if rows else lin.reshape(0, -1)


@sparse_kernel(aten._coalesce)
def _coalesce(x):
    """Duplicate positions summed, positions sorted (torch's coalesce)."""
    sd, indices, values = x.sparse_dim(), x._indices(), x._values()
    if indices.shape[1] < 2:
        return _like(x, indices.clone(), values.clone(), True)
    size = list(x.shape[:sd])
    unique, inverse = torch.unique(_linear(indices, size), sorted=True, return_inverse=True)
    summed = torch.zeros((unique.shape[0], *values.shape[1:]), dtype=values.dtype, device=DEVICE)
    return _like(x, _unlinear(unique, size), summed.index_add_(0, inverse, values), True)


# -- arithmetic -----------------------------------------------------------------------------


def _scalar(x) -> bool:
    return not isinstance(x, torch.Tensor) or (x.dim() == 0 and not is_sparse_jax(x))


def _add(func, args, kwargs):
    """Sparse + sparse (COO, one size): both sets of stored elements; dense + sparse: dense."""
    x, other = args
    alpha = kwargs.get("alpha", 1) * (-1 if func._schema.name in ("aten::sub", "aten::sub_") else 1)
    inplace = func._schema.is_mutable
    if not is_sparse_jax(x) and other.layout == torch.sparse_coo:  # dense + sparse: dense, as torch
        dense = _to_dense(other)
        return x.add_(dense, alpha=alpha) if inplace else torch.add(x, dense, alpha=alpha)
    if not (is_sparse_jax(other) and x.layout == other.layout == torch.sparse_coo and x.shape == other.shape
            and x.sparse_dim() == other.sparse_dim()):
        return _on_host(func, args, kwargs)
    dtype = torch.result_type(x, other)
    indices = torch.cat([x._indices(), other._indices()], 1)
    values = torch.cat([x._values().to(dtype), (other._values() * alpha).to(dtype)])
    total = _like(x, indices, values)
    # (torch merges two coalesced operands into a coalesced sum, and concatenates otherwise)
    if x.is_coalesced() and other.is_coalesced():
        total = _coalesce(total)
    return _structural(aten.copy_.default, (x, total), {}) if inplace else total


for _op in (aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor):
    SPARSE[_op] = _add


def _times(func, args, kwargs):
    """A sparse COO tensor times (over) a number, a 0-d tensor or a dense tensor of its shape:
    sparse, its stored values multiplied (divided) where they are."""
    x, other = args
    divide = func._schema.name.startswith("aten::div")
    if not is_sparse_jax(x) and not divide:
        x, other = other, x
    fits = is_sparse_jax(x) and x.layout == torch.sparse_coo and (
        _scalar(other) or (not is_sparse_jax(other) and not divide and other.shape == x.shape))
    if not fits or func._schema.is_mutable:
        return _on_host(func, args, kwargs)
    indices, values = x._indices(), x._values()
    factor = other if _scalar(other) else other[tuple(indices)]
    values = torch.div(values, factor, **kwargs) if divide else values * factor
    return _like(x, indices.clone(), values, x.is_coalesced())


for _op in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode,
            aten.div.Scalar_mode):
    SPARSE[_op] = _times


@sparse_kernel(aten.neg)
def _neg(x):
    return _like(x, x._indices().clone(), -x._values(), x.is_coalesced())


@sparse_kernel(aten.sum.default)
def _sum(x, dtype=None):
    if x.layout != torch.sparse_coo:
        return _on_host(aten.sum.default, (x,), {"dtype": dtype})
    return x._values().sum(dtype=dtype)


@sparse_kernel(aten.sum.dim_IntList)
def _sum_dim(x, dim, keepdim=False, *, dtype=None):
    """``x.sum(dim)`` of a COO tensor: `_coo_sum`, integers summed as int64 (torch.sum's promotion)."""
    if x.layout != torch.sparse_coo or keepdim or not dim:
        return _on_host(aten.sum.dim_IntList, (x, dim, keepdim), {"dtype": dtype})
    if dtype is None and not (x.is_floating_point() or x.is_complex()):
        dtype = torch.int64
    return _coo_sum(x, dim, dtype)


@sparse_kernel(aten._sparse_sum.dim, aten._sparse_sum.dim_dtype)
def _sparse_sum(x, dim, dtype=None):
    """``torch.sparse.sum(x, dim)`` of a COO tensor: `_coo_sum`, in ``x``'s dtype."""
    if x.layout != torch.sparse_coo:
        return _on_host(aten._sparse_sum.dim_dtype if dtype is not None else aten._sparse_sum.dim, (x, dim),
                        {} if dtype is None else {"dtype": dtype})
    return _coo_sum(x, dim, dtype)


def _coo_sum(x, dim, dtype):
    """COO ``x`` summed over ``dim``: dense dimensions in the values; summed sparse dimensions leave
    the index rows, and entries that then coincide add up (the result coalesced, as torch's always
    is). With every sparse dimension summed the result is dense (as torch.sum promotes it)."""
    sd = x.sparse_dim()
    dims = sorted({d % x.dim() for d in dim})
    values = x._values() if dtype is None else x._values().to(dtype)
    dense = [d - sd + 1 for d in dims if d >= sd]  # (values are (nnz, *dense dims))
    if dense:
        values = values.sum(dense, dtype=values.dtype)
    keep = [d for d in range(sd) if d not in dims]
    if not keep:
        return values.sum(0)
    size = [n for d, n in enumerate(x.shape) if d not in dims]
    if len(keep) == sd and x.is_coalesced():
        return _coo(sd, values.dim() - 1, size, x._indices().clone(), values, values.dtype, True)
    return _coalesce(_coo(len(keep), values.dim() - 1, size, x._indices()[keep], values, values.dtype))


@sparse_kernel(aten._sparse_sum_backward)
def _sparse_sum_backward(grad, x, dim):
    """The gradient of `_coo_sum` for COO ``x``: each entry of ``x`` (coalesced) gets the entry of
    ``grad`` at its position with the summed dimensions left out (zero where ``grad`` stores none),
    spread over the summed dense dimensions."""
    if x.layout != torch.sparse_coo or (is_sparse_jax(grad) and grad.layout != torch.sparse_coo):
        return _on_host(aten._sparse_sum_backward.default, (grad, x, dim), {})
    x = x if x.is_coalesced() else _coalesce(x)
    sd, indices = x.sparse_dim(), x._indices()
    dims = sorted({d % x.dim() for d in dim})
    keep = [d for d in range(sd) if d not in dims]
    if keep:  # grad is sparse over the kept sparse dimensions: look each entry up by position
        grad = grad if grad.is_coalesced() else _coalesce(grad)
        size = [x.shape[d] for d in keep]
        stored, wanted = _linear(grad._indices(), size), _linear(indices[keep], size)
        rows = grad._values()
        if stored.shape[0] == 0:
            per_entry = rows.new_zeros((wanted.shape[0], *rows.shape[1:]))
        else:
            at = torch.searchsorted(stored, wanted).clamp(max=stored.shape[0] - 1)
            found = (stored[at] == wanted).view(-1, *[1] * (rows.dim() - 1))
            per_entry = torch.where(found, rows[at], 0)
    else:  # every sparse dimension summed: grad is dense over the dense dimensions left
        per_entry = grad.unsqueeze(0).expand(indices.shape[1], *grad.shape)
    for d in dims:  # (the summed dense dimensions back, as size-1, then spread)
        if d >= sd:
            per_entry = per_entry.unsqueeze(d - sd + 1)
    values = per_entry.expand(indices.shape[1], *x.shape[sd:]).to(x.dtype).clone()
    return _like(x, indices.clone(), values, True)


# -- matrix products ------------------------------------------------------------------------


def _sparse_times_dense(a, b):
    """``a @ b`` for a 2-d sparse COO ``a`` and a dense ``b``: each stored ``a[i, k]`` adds
    ``a[i, k] * b[k]`` to row ``i``."""
    rows, cols = a._indices()
    dtype = torch.result_type(a, b)
    terms = a._values().to(dtype).unsqueeze(-1) * b[cols].to(dtype)
    return torch.zeros((a.shape[0], b.shape[1]), dtype=dtype, device=DEVICE).index_add_(0, rows, terms)


def _coo_matrix(x) -> bool:
    return is_sparse_jax(x) and x.layout == torch.sparse_coo and x.dim() == 2 and x.dense_dim() == 0


@sparse_kernel(aten.mm)
def _mm(a, b):
    if not (_coo_matrix(a) and not is_sparse_jax(b) and b.dim() == 2):
        return _on_host(aten.mm.default, (a, b), {})
    return _sparse_times_dense(a, b)


@sparse_kernel(aten.addmm, aten._sparse_addmm)
def _addmm(x, a, b, *, beta=1, alpha=1):
    if is_sparse_jax(x) or not (_coo_matrix(a) and not is_sparse_jax(b) and b.dim() == 2):
        return _on_host(aten.addmm.default, (x, a, b), {"beta": beta, "alpha": alpha})
    product = _sparse_times_dense(a, b)
    return product * alpha if beta == 0 else x * beta + product * alpha


# -- the host path --------------------------------------------------------------------------


def _on_host(func, args, kwargs):
    """Run ``func`` through torch's CPU kernels on copies of the operands; results come back to the
    jax device (except where the op was asked for another device), written back into mutated ones."""
    if _traced(*(t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))):
        raise OpError(
            f"torch2jax: {func} on a sparse tensor has no kernel on the jax device, and a traced program (t2j.jit, "
            "jax.jit) cannot run it on the host: use dense tensors there (x.to_dense())")
    if func not in _warned_host:
        _warned_host.add(func)
        warnings.warn(f"torch2jax: {func} on a sparse jax tensor runs on the host through torch's sparse kernels "
                      "(a copy to the CPU and back)", stacklevel=3)
    device = kwargs.get("device")
    stays = device is not None and torch.device(device).type != DEVICE.type
    cargs, ckwargs = _pytree.tree_map(_to_host, (args, kwargs))
    out = func(*cargs, **ckwargs)
    schema = func._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            target = args[i] if i < len(args) else kwargs.get(a.name)
            source = cargs[i] if i < len(cargs) else ckwargs.get(a.name)
            if isinstance(target, torch.Tensor):
                _write(target, source)
    if stays:
        return out
    mutated = {id(c): a for c, a in zip(cargs, args) if isinstance(a, torch.Tensor)}
    return _pytree.tree_map(lambda o: mutated[id(o)] if id(o) in mutated else _to_jax(o), out)


def _to_host(x):
    if isinstance(x, torch.device) and x.type == DEVICE.type:
        return torch.device("cpu")
    if not isinstance(x, torch.Tensor) or x.device.type != DEVICE.type:
        return x
    copy = x.detach().cpu() if x.layout == torch.strided else _to_copy(x, device="cpu")
    # (some kernels compute what their backward needs only for inputs that require grad: sparse.mm's
    # reduce="amax" indices)
    return copy.requires_grad_() if x.requires_grad else copy


def _to_jax(o):
    if not isinstance(o, torch.Tensor) or o.device.type != "cpu":
        return o
    return from_torch_cpu(o) if o.layout == torch.strided else o.to(DEVICE)


def _write(target, source):
    """Put into ``target`` (a jax tensor) what the op wrote into its CPU copy ``source``."""
    if target.layout == torch.strided:
        with torch.no_grad():
            target.copy_(source)
    else:
        _structural(aten.copy_.default, (target, source.to(DEVICE)), {})




def _register():
    """Send every op on a sparse jax tensor to `run`: the ops here by kernels of their own (which
    take precedence over torch's composite kernels, e.g. ``is_coalesced``'s), the rest by a fallback."""
    _dispatch.sparse_run = run
    host = torch.library.Library("_", "IMPL")
    kernels = torch.library.Library("aten", "IMPL")
    for key in ("SparsePrivateUse1", "SparseCsrPrivateUse1"):
        host.fallback(lambda func, *args, **kwargs: run(func, args, kwargs), key)
        for func in SPARSE:
            kernels.impl(func, (lambda f: lambda *args, **kwargs: run(f, args, kwargs))(func), key)
    return host, kernels


# -- dense stand-ins --------------------------------------------------------------------------
#
# Inside a traced program a sparse COO tensor is stored dense (`_sparse_coo_tensor_with_dims_and_tensors`):
# torch.sparse's functions, called on it, compute on the dense value, as absent entries are zeros.

@register(aten._sparse_addmm.default)
def _sparse_addmm(self, mat1, mat2, *, beta=1, alpha=1):
    """``torch.sparse.mm`` / ``torch.sparse.addmm``: ``beta * self + alpha * (mat1 @ mat2)``."""
    return addmm(self, mat1, mat2, beta=beta, alpha=alpha)


@register(aten._sparse_sum.dim, aten._sparse_sum.dim_dtype)
def _sparse_sum_dim(self, dim, dtype=None):
    """``torch.sparse.sum(x, dim)``: summed over ``dim`` (dense, as the jax device stores every layout)."""
    return sum_(self, dim, dtype=dtype)


_LIBRARIES = _register()  # (kept: a Library deregisters what it holds when it is collected)
