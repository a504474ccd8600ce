"""Lowerings: reductions, scans, sorting and selection.

bf16 / fp16 inputs are reduced in float32 and cast back, as torch does on CPU.
Extrema propagate NaN and their indices point at the first NaN (or the first
extremum on ties); sorting puts NaN after every number, as torch does.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from ..dispatch import OpError, TorchRuntimeError
from .indexing import raise_as_torch, stand_in
from .registry import (_HALF, HALF_DTYPES, argmax_index, argmin_index, canonical_dim, canonical_dims, decomposition,
                       float_abs, refused_dtypes, register, root_zero_slope, scalar_type_name, true_divide, warning)
from .shape import is_traced

aten = torch.ops.aten
prims = torch.ops.prims

_LONG = np.dtype(np.int64)


# -- helpers -----------------------------------------------------------------


def _axes(dim, ndim):
    """The axes torch's ``dim`` argument reduces: None or [] means every axis."""
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return tuple(range(ndim))
    axes = canonical_dims(dim, ndim)
    if len(set(axes)) != len(axes):
        raise RuntimeError(f"dim {axes[0]} appears multiple times in the list of dims")
    return axes if ndim else ()


def _opmath(x):
    return x.astype(np.float32) if x.dtype in _HALF else x


def _torch_name(dtype):
    return str(_dt.to_torch(dtype)).replace("torch.", "")


def _long_if_integral(dtype):
    """Result dtype of sum / prod / cumsum without ``dtype=``: integers and bool give int64."""
    return _LONG if _dt.is_integral(dtype, include_bool=True) else np.dtype(dtype)


def _out_dtype(x, dtype, default=None):
    if dtype is not None:
        return _dt.to_jax(dtype)
    return default if default is not None else np.dtype(x.dtype)


def _require_nonempty(name, x, axes):
    """torch refuses to reduce an empty dim with an op that has no identity; JAX returns +-inf."""
    if x.ndim == 0:
        return
    for a in axes:
        if x.shape[a] == 0:
            raise IndexError(f"{name}(): Expected reduction dim {a} to have non-zero size.")


def _require_float(dtype, message):
    if not (_dt.is_floating(dtype) or _dt.is_complex(dtype)):
        raise RuntimeError(message)


def _size(x, axes):
    return math.prod(x.shape[a] for a in axes)


def _dim_axis(x, dim):
    """(axis, input) for an op over one dim; a 0-d input is treated as 1-d."""
    d = canonical_dim(dim, x.ndim)
    return d, (x.reshape(1) if x.ndim == 0 else x)


def _keep(out, x, d, keepdim):
    """Reshape a result reduced over axis ``d`` of a possibly 0-d input back to torch's shape."""
    if x.ndim == 0:
        return out.reshape(())
    return jnp.expand_dims(out, d) if keepdim else out


# -- sums and products -------------------------------------------------------


def _sum(x, axes, keepdim, out):
    return jnp.sum(_opmath(x.astype(out)), axis=axes, keepdims=keepdim).astype(out)


@register(aten.sum.default, aten.sum.dim_IntList)
def sum_(x, dim=None, keepdim=False, *, dtype=None):
    return _sum(x, _axes(dim, x.ndim), keepdim, _out_dtype(x, dtype, _long_if_integral(x.dtype)))


refused_dtypes(aten.nansum, kinds="c")  # ("nansum on CPU does not support complex inputs"; nanmean calls it)


@register(aten.nansum.default)
def nansum(x, dim=None, keepdim=False, *, dtype=None):
    if _dt.is_floating(x.dtype):
        x = jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return sum_(x, dim, keepdim, dtype=dtype)


@register(aten.mean.default, aten.mean.dim)
def mean(x, dim=None, keepdim=False, *, dtype=None):
    out = _out_dtype(x, dtype)
    _require_float(
        out,
        "mean(): could not infer output dtype. Input dtype must be either a floating point or complex dtype. "
        f"Got: {scalar_type_name(out)}",
    )
    return jnp.mean(_opmath(x.astype(out)), axis=_axes(dim, x.ndim), keepdims=keepdim).astype(out)


@register(aten.prod.default, aten.prod.dim_int)
def prod(x, dim=None, keepdim=False, *, dtype=None):
    out = _out_dtype(x, dtype, _long_if_integral(x.dtype))
    return jnp.prod(_opmath(x.astype(out)), axis=_axes(dim, x.ndim), keepdims=keepdim).astype(out)


@register(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(x, dim=None):
    return jnp.sum(x != 0, axis=_axes(dim, x.ndim), dtype=_LONG)


@register(aten.logsumexp.default)
def logsumexp(x, dim, keepdim=False):
    out = np.dtype(x.dtype) if not _dt.is_integral(x.dtype, include_bool=True) else _dt.default_float()
    axes = _axes(dim, x.ndim)
    if _size(x, axes) == 0:
        return jnp.full(jnp.sum(x, axis=axes, keepdims=keepdim).shape, -jnp.inf, out)
    if out in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        return _logsumexp_narrow(x.astype(out), axes, keepdim)
    return jax.nn.logsumexp(_opmath(x.astype(out)), axis=axes, keepdims=keepdim).astype(out)


def _logsumexp_narrow(x, axes, keepdim):
    """torch's composite logsumexp in float16 / bfloat16, each step rounded to that dtype:
    log(sum(exp(x - max))) + max, an infinite max taken as 0."""
    top = jnp.max(x, axis=axes, keepdims=True)
    top = jnp.where(jnp.isinf(top), jnp.zeros((), x.dtype), top)
    total = jnp.sum(jnp.exp(x - top).astype(jnp.float32), axis=axes, keepdims=True).astype(x.dtype)
    out = jnp.log(total) + top
    return out if keepdim else jnp.squeeze(out, axes)


# -- extrema -----------------------------------------------------------------


def _extreme(name, reduce, x, dim, keepdim):
    if not dim:  # all dims
        _require_numel(name, x)
    axes = _axes(dim, x.ndim)
    _require_nonempty(name, x, axes)
    return reduce(x, axis=axes, keepdims=keepdim)


def _real_only(call):
    """For the lowering below: a complex input gets the error of torch's CPU kernel ``call``
    (orderings have none for complex numbers), run on a one-element stand-in."""

    def deco(fn):
        @functools.wraps(fn)
        def checked(x, *args, **kwargs):
            if _dt.is_complex(x.dtype):
                raise_as_torch(call, stand_in(x.dtype, 1))
            return fn(x, *args, **kwargs)

        return checked

    return deco


@register(aten.amax.default)
@_real_only(torch.amax)
def amax(x, dim=(), keepdim=False):
    return _extreme("amax", jnp.max, x, dim, keepdim)


@register(aten.amin.default)
@_real_only(torch.amin)
def amin(x, dim=(), keepdim=False):
    return _extreme("amin", jnp.min, x, dim, keepdim)


refused_dtypes(aten.hash_tensor, kinds="c")  # (torch's CPU kernel: "xor_sum_cpu" of no complex numbers)


@register(aten.hash_tensor.default)
def hash_tensor(x, dim=(), keepdim=False, mode=0):
    """The xor of the elements' bits, each first widened to float64 / int64 (sign extended)
    and read as a uint64."""
    if mode != 0:
        raise RuntimeError(f"hash_tensor: mode {mode} is not supported; only mode=0 (xor reduction) is")
    if _dt.is_complex(x.dtype):
        raise RuntimeError("hash_tensor: complex tensors are not supported")
    if x.size == 0 and not dim:
        raise RuntimeError("hash_tensor: Expected reduction dim to be specified for input.numel() == 0. "
                           "Specify the reduction dim with the 'dim' argument.")
    if _dt.is_floating(x.dtype):
        wide = x.astype(np.float64)
    else:
        wide = x.astype(np.uint64 if x.dtype == np.uint64 else np.int64)
    bits = jax.lax.bitcast_convert_type(wide, np.uint64)
    axes = _axes(dim, x.ndim)
    _require_nonempty("hash_tensor", x, axes)
    out = jax.lax.reduce(bits, np.uint64(0), jax.lax.bitwise_xor, axes)
    return jnp.expand_dims(out, axes) if keepdim else out


def _require_numel(name, x):
    if x.size == 0:
        raise RuntimeError(
            f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
            "Specify the reduction dim with the 'dim' argument."
        )


@register(aten.max.default)
@_real_only(torch.max)
def max_(x):
    _require_numel("max", x)
    return jnp.max(x)


@register(aten.min.default)
@_real_only(torch.min)
def min_(x):
    _require_numel("min", x)
    return jnp.min(x)


def _arg_extreme(name, arg, x, dim, keepdim):
    """argmax / argmin give the first NaN, else the first extremum, as torch does."""
    if dim is None:
        if x.size == 0:
            raise IndexError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0.")
        return arg(x, axis=None, keepdims=keepdim).astype(_LONG)
    d, x1 = _dim_axis(x, dim)
    _require_nonempty(name, x1, (d,))
    return _keep(arg(x1, axis=d), x, d, keepdim).astype(_LONG)


def _no_bools(name, x):
    """argmax / argmin refuse bools (max.dim / min.dim, which give the same index, take them)."""
    if x.dtype == np.bool_:
        raise TorchRuntimeError(f"{name}(): does not support bool input")


@register(aten.argmax.default)
@_real_only(torch.argmax)
def argmax(x, dim=None, keepdim=False):
    _no_bools("argmax", x)
    return _arg_extreme("argmax", argmax_index, x, dim, keepdim)


@register(aten.argmin.default)
@_real_only(torch.argmin)
def argmin(x, dim=None, keepdim=False):
    _no_bools("argmin", x)
    return _arg_extreme("argmin", argmin_index, x, dim, keepdim)


@register(aten.max.dim)
@_real_only(lambda t: torch.max(t, 0))
def max_dim(x, dim, keepdim=False):
    return _at_index(x, dim, keepdim, _arg_extreme("max", argmax_index, x, dim, keepdim))


@register(aten.min.dim)
@_real_only(lambda t: torch.min(t, 0))
def min_dim(x, dim, keepdim=False):
    return _at_index(x, dim, keepdim, _arg_extreme("min", argmin_index, x, dim, keepdim))


def _at_index(x, dim, keepdim, index):
    """(the elements of ``x`` at ``index`` along ``dim``, ``index``): max.dim's and min.dim's values, read at
    their indices so that JAX's derivative goes to that element alone among ties, as torch's (a reduction's
    derivative splits it)."""
    if x.ndim == 0:
        return x, index
    d = canonical_dim(dim, x.ndim)
    at = index if keepdim else jnp.expand_dims(index, d)
    values = jnp.take_along_axis(x, at, axis=d)
    return (values if keepdim else jnp.squeeze(values, d)), index


@register(aten.aminmax.default)
@_real_only(torch.aminmax)
def aminmax(x, *, dim=None, keepdim=False):
    axes = _axes(dim if dim is None else [dim], x.ndim)
    if dim is not None and x.ndim and x.shape[axes[0]] == 0:
        raise IndexError(f"aminmax: Expected reduction dim {axes[0]} to have non-zero size.")
    if _size(x, axes) == 0 and x.ndim:
        raise RuntimeError(
            "aminmax(): cannot compute aminmax over an empty dimension as the operation has no identity."
        )
    return jnp.min(x, axis=axes, keepdims=keepdim), jnp.max(x, axis=axes, keepdims=keepdim)


# -- variance ----------------------------------------------------------------


def _var_mean(x, axes, correction, keepdim):
    _require_float(x.dtype, "std and var only support floating point and complex dtypes")
    correction = 1 if correction is None else correction
    xc = _opmath(x)
    m = jnp.mean(xc, axis=axes, keepdims=True)
    d = xc - m
    sq = jnp.real(d) ** 2 + jnp.imag(d) ** 2 if _dt.is_complex(x.dtype) else d * d
    var = jnp.sum(sq, axis=axes, keepdims=keepdim) / max(0, _size(x, axes) - correction)
    if not keepdim:
        m = jnp.squeeze(m, axes)
    return var, m


def _real_out(x):
    return _dt.real_of(x.dtype)


def _var_std(x, dim, correction, keepdim, sqrt):
    v, m = _var_mean(x, _axes(dim, x.ndim), correction, keepdim)
    return (root_zero_slope(v) if sqrt else v).astype(_real_out(x)), m.astype(x.dtype)


@warning(aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction)
def _warn_no_degrees_of_freedom(func, args, kwargs):
    x, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim"))
    correction = kwargs.get("correction")
    n = math.prod(x.shape[d] for d in _axes(dim, x.dim()))
    if n - (1 if correction is None else correction) <= 0:
        warnings.warn(f"{func._schema.name.split('::')[1]}(): degrees of freedom is <= 0. Correction should be "
                      "strictly less than the reduction factor (input numel divided by output numel).", UserWarning,
                      stacklevel=3)


@register(aten.var.correction)
def var(x, dim=None, *, correction=None, keepdim=False):
    return _var_std(x, dim, correction, keepdim, False)[0]


@register(aten.std.correction)
def std(x, dim=None, *, correction=None, keepdim=False):
    return _var_std(x, dim, correction, keepdim, True)[0]


@register(aten.var_mean.correction)
def var_mean(x, dim=None, *, correction=None, keepdim=False):
    return _var_std(x, dim, correction, keepdim, False)


@register(aten.std_mean.correction)
def std_mean(x, dim=None, *, correction=None, keepdim=False):
    return _var_std(x, dim, correction, keepdim, True)


# -- logical -----------------------------------------------------------------


def _logical(reduce, x, axes, keepdim):
    out = x.dtype if x.dtype == np.uint8 else np.bool_
    return reduce(x != 0, axis=axes, keepdims=keepdim).astype(out)


@register(aten.any.default, aten.any.dim)
def any_(x, dim=None, keepdim=False):
    return _logical(jnp.any, x, _axes(None if dim is None else [dim], x.ndim), keepdim)


@register(aten.all.default, aten.all.dim)
def all_(x, dim=None, keepdim=False):
    return _logical(jnp.all, x, _axes(None if dim is None else [dim], x.ndim), keepdim)


@register(aten._is_all_true.default)
def _is_all_true(x):
    """A 0-d bool: whether every element of a bool tensor is True (torch.distributions' argument checks)."""
    return jnp.all(x)


@register(aten._is_any_true.default)
def _is_any_true(x):
    return jnp.any(x)


@register(aten.any.dims)
def any_dims(x, dim=None, keepdim=False):
    return _logical(jnp.any, x, _axes(dim, x.ndim) if dim is None or len(dim) else (), keepdim)


@register(aten.all.dims)
def all_dims(x, dim=None, keepdim=False):
    return _logical(jnp.all, x, _axes(dim, x.ndim) if dim is None or len(dim) else (), keepdim)


def _python_bool(name, value):
    """A 0-d bool array as the Python bool torch's ``name`` returns. The dispatcher turns
    the result into a C++ bool, so it cannot stay traced (symbolic.py's traced numbers)."""
    if isinstance(value, jax.core.Tracer):
        raise OpError(
            f"torch2jax: aten.{name} returns a Python bool, and inside t2j.jit / jax.jit a tensor's value is not "
            "known while the program is traced; compare with tensor ops instead (torch.eq(...).all(), "
            "torch.isclose(...).all()) or call it outside the traced function"
        )
    return bool(value)


@register(aten.equal.default)
def equal(x, other):
    if x.shape != other.shape:
        return False
    dtype = _dt.result_type(x, other)
    return _python_bool("equal", jnp.all(x.astype(dtype) == other.astype(dtype)))


@register(aten.allclose.default)
def allclose(x, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """torch.isclose(...).all(): integers and bool are compared in the default float dtype."""
    if x.dtype != other.dtype:
        raise RuntimeError(f"{_torch_name(x.dtype)} did not match {_torch_name(other.dtype)}")
    if rtol < 0 or atol < 0:
        raise RuntimeError("rtol and atol must be greater than or equal to zero")
    close = x == other
    if equal_nan and (_dt.is_floating(x.dtype) or _dt.is_complex(x.dtype)):
        close = close | (jnp.isnan(x) & jnp.isnan(other))
    if rtol or atol:
        if not (_dt.is_floating(x.dtype) or _dt.is_complex(x.dtype)):
            x, other = x.astype(_dt.default_float()), other.astype(_dt.default_float())
        error = jnp.abs(x - other)
        close = close | (jnp.isfinite(error) & (error <= atol + jnp.abs(rtol * other)))
    return _python_bool("allclose", jnp.all(close))


# torch's cov (and corrcoef, which calls it) is CompositeImplicitAutograd and checks
# its weights and degrees of freedom with Python bools of tensor values, which a traced
# program cannot give. Its AutogradPrivateUse1 kernel runs torch's composite in eager
# mode and, while traced, the same computation with the value checks left out and the
# degrees of freedom clamped with torch.where; the ops it calls keep autograd torch's.


def cov(x, *, correction=1, fweights=None, aweights=None):
    """The AutogradPrivateUse1 kernel of aten::cov."""
    if not any(is_traced(t) for t in (x, fweights, aweights)):
        return aten.cov.default.decompose(x, correction=correction, fweights=fweights, aweights=aweights)
    if x.dim() > 2:
        raise RuntimeError(f"cov(): expected input to have two or fewer dimensions but got an input with {x.dim()} dimensions")
    if x.dtype == torch.bool:
        raise RuntimeError("cov(): bool dtype is not supported for input")
    inp = x.view(1, -1) if x.dim() < 2 else x
    n = inp.shape[1]
    weights = (("fweights", fweights, "integral", lambda d: not (d.is_floating_point or d.is_complex or d == torch.bool)),
               ("aweights", aweights, "floating point", lambda d: d.is_floating_point))
    for name, w, kind, ok in weights:
        if w is None:
            continue
        if w.dim() > 1:
            raise RuntimeError(f"cov(): expected {name} to have one or fewer dimensions but got {name} with {w.dim()} dimensions")
        if not ok(w.dtype):
            raise RuntimeError(f"cov(): expected {name} to have {kind} dtype but got {name} with {w.dtype} dtype")
        if w.numel() != n:
            raise RuntimeError(f"cov(): expected {name} to have the same numel as there are observations in the input but got {w.numel()} != {n}")
    w = fweights if aweights is None else aweights if fweights is None else fweights * aweights
    if w is None:
        avg = inp.sum(1) / n
        norm = torch.tensor(max(n - correction, 0), device=x.device)
    else:
        w_sum = w.sum()
        avg = (inp * w).sum(1) / w_sum
        if correction == 0:
            norm = w_sum
        elif aweights is None:
            norm = w_sum - correction
        elif fweights is None and n == 1 and correction == 1:
            norm = torch.zeros((), dtype=torch.long, device=x.device)
        else:
            norm = w_sum - correction * (w * aweights).sum() / w_sum
        norm = torch.where(norm > 0, norm, torch.zeros_like(norm))
    if n == 1 and (fweights is None) != (aweights is None):
        inp = torch.zeros_like(inp, dtype=torch.float32 if not (inp.is_floating_point() or inp.is_complex()) else None)
    else:
        inp = inp - avg.unsqueeze(1)
    c = torch.mm(inp, (inp if w is None else inp * w).t().conj())
    if c.is_complex() and 1 in inp.shape:
        c = torch.complex(c.real, torch.zeros_like(c.real))
    return torch.true_divide(c, norm).squeeze()


_library = torch.library.Library("aten", "IMPL")
_library.impl("cov", cov, "AutogradPrivateUse1")


# -- norms -------------------------------------------------------------------


def _check_empty_norm(x, ord, dim):
    """torch's refusal of a negative or infinite norm of an empty tensor or over an empty dim (these norms
    have no identity; JAX would give 0 or inf). ``dim`` as the caller gave it: torch names it so."""
    if x.size != 0 or not (ord < 0 or ord == math.inf):
        return
    shown = f"{ord:g}" if isinstance(ord, float) else str(ord)  # as torch prints a Scalar
    dim = (dim,) if isinstance(dim, int) else dim
    if not dim:
        raise RuntimeError(f"linalg.vector_norm cannot compute the {shown} norm on an empty tensor because the "
                           "operation does not have an identity")
    for d in dim:
        if x.shape[d] == 0:  # (torch's message has no space before "because")
            raise RuntimeError(f"linalg.vector_norm cannot compute the {shown} norm on the dimension {d}because this "
                               "dimension is empty and the operation does not have an identity")


@register(aten.linalg_vector_norm.default)
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    _require_float(
        x.dtype,
        "linalg.vector_norm: Expected a floating point or complex tensor as input. "
        f"Got {scalar_type_name(x.dtype)}",
    )
    if dtype is not None:
        x = x.astype(_dt.to_jax(dtype))
    _check_empty_norm(x, ord, dim)
    out = _real_out(x)
    axes = _axes(dim, x.ndim)
    xo = _opmath(x)
    # (|x| of a real x as sqrt(x * x) does not need; torch's abs'(0) is 0, JAX's 1)
    a = jnp.abs(xo) if _dt.is_complex(x.dtype) else float_abs(xo) if ord != 2 else xo
    if ord in (math.inf, -math.inf):
        r = (jnp.max if ord > 0 else jnp.min)(a, axis=axes, keepdims=keepdim)
    elif ord == 0:
        r = jnp.sum(a != 0, axis=axes, keepdims=keepdim).astype(a.dtype)
    elif ord == 1:
        r = jnp.sum(a, axis=axes, keepdims=keepdim)
    elif ord == 2:
        r = root_zero_slope(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    else:
        r = root_zero_slope(jnp.sum(a**ord, axis=axes, keepdims=keepdim), ord)
    return r.astype(out)


@register(aten.norm.Scalar, aten.norm.ScalarOpt_dtype)
def norm(x, p=2, *, dtype=None):
    return linalg_vector_norm(x, 2 if p is None else p, None, False, dtype=dtype)


@register(aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype)
def norm_dim(x, p, dim, keepdim=False, *, dtype=None):
    return linalg_vector_norm(x, 2 if p is None else p, dim, keepdim, dtype=dtype)


# -- scans -------------------------------------------------------------------


def _scan(fn, x, dim, dtype):
    out = _out_dtype(x, dtype, _long_if_integral(x.dtype))
    if out == np.bool_:  # a bool result only by an explicit dtype (or out=): torch has no such kernel
        raise NotImplementedError(f"\"{fn.__name__}_out_cpu\" not implemented for 'Bool'")
    d, x1 = _dim_axis(x, dim)
    return fn(_opmath(x1.astype(out)), axis=d).astype(out).reshape(x.shape)


@register(aten.cumsum.default)
def cumsum(x, dim, *, dtype=None):
    return _scan(jnp.cumsum, x, dim, dtype)


@register(aten.cumprod.default)
def cumprod(x, dim, *, dtype=None):
    return _scan(jnp.cumprod, x, dim, dtype)


# torch's in-place scans run in the tensor's own dtype (their out= kernels), not the functional
# ops' (int64 for integers and bools): a bool tensor's ``cumsum_`` has no kernel


@decomposition(aten.cumsum_.default)
def cumsum_(x, dim, *, dtype=None):
    return x.copy_(torch.cumsum(x, dim, dtype=x.dtype if dtype is None else dtype))


@decomposition(aten.cumprod_.default)
def cumprod_(x, dim, *, dtype=None):
    return x.copy_(torch.cumprod(x, dim, dtype=x.dtype if dtype is None else dtype))


refused_dtypes(aten.logcumsumexp, aten._logcumsumexp, kinds="bi")


@register(aten.logcumsumexp.default, aten._logcumsumexp.default)
def logcumsumexp(x, dim):
    d, x1 = _dim_axis(x, dim)
    if _dt.is_complex(x.dtype):
        out = jax.lax.associative_scan(_complex_logaddexp, x1, axis=d)
    else:
        out = jax.lax.cumlogsumexp(_opmath(x1), axis=d)
    return out.astype(x.dtype).reshape(x.shape)


def _complex_logaddexp(a, b):
    m = jnp.where(jnp.real(a) >= jnp.real(b), a, b)
    n = jnp.where(jnp.real(a) >= jnp.real(b), b, a)
    finite = jnp.isfinite(jnp.real(m))
    shifted = jnp.where(finite, n - m, jnp.where(jnp.real(n) == jnp.real(m), n - m, -jnp.inf))
    return m + jnp.log1p(jnp.exp(shifted))


def _cum_extreme(x, dim, better):
    """cummax / cummin: a later element wins on ties and NaN wins over numbers, as torch's kernel does."""
    d, x1 = _dim_axis(x, dim)
    idx = jax.lax.broadcasted_iota(_LONG, x1.shape, d)
    floating = _dt.is_floating(x.dtype)

    def combine(a, b):
        (va, ia), (vb, ib) = a, b
        take_b = better(vb, va) | (vb == va)
        if floating:
            take_b = jnp.isnan(vb) | (~jnp.isnan(va) & take_b)
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    values, indices = jax.lax.associative_scan(combine, (x1, idx), axis=d)
    return values.reshape(x.shape), indices.reshape(x.shape)


@register(aten.cummax.default)
@_real_only(lambda t: torch.cummax(t, 0))
def cummax(x, dim):
    return _cum_extreme(x, dim, jnp.greater)


@register(aten.cummin.default)
@_real_only(lambda t: torch.cummin(t, 0))
def cummin(x, dim):
    return _cum_extreme(x, dim, jnp.less)


# -- histograms --------------------------------------------------------------


def _linspace_edges(lo, hi, bins, dtype):
    """``bins + 1`` edges as torch's linspace computes them in ``dtype``: from the start for
    the first half, from the end for the second, so both ends are exact."""
    lo, hi = jnp.asarray(lo, dtype), jnp.asarray(hi, dtype)
    step = true_divide(hi - lo, bins)
    i = jnp.arange(bins + 1)
    return jnp.where(i < (bins + 1) // 2, lo + step * i.astype(dtype), hi - step * (bins - i).astype(dtype))


def _outer_edges(v, lo_hi, name_dim):
    """torch's outer bin edges of the values ``v``: the given (lo, hi), else their min and max
    (0 and 1 when empty), widened by 0.5 each way when equal."""
    if lo_hi is not None:
        lo, hi = float(lo_hi[0]), float(lo_hi[1])
        if lo > hi:
            raise RuntimeError(f"torch.histogramdd: min should not exceed max, but got min {lo} max {hi} for dimension {name_dim}")
    elif v.size == 0:
        lo, hi = 0.0, 1.0
    else:
        lo, hi = jnp.min(v), jnp.max(v)
        if not isinstance(v, jax.core.Tracer) and not (np.isfinite(lo) and np.isfinite(hi)):
            raise RuntimeError(f"torch.histogramdd: dimension {name_dim}'s range [{lo}, {hi}] is not finite")
    widen = jnp.where(jnp.asarray(lo) == hi, 0.5, 0.0)
    return lo - widen, hi + widen


def _require_points(x):
    """histogramdd's input: points along its last axis."""
    if x.ndim < 2:
        raise RuntimeError("torch.histogramdd: input tensor should have at least 2 dimensions")


def _bin_edges(x, bins, range):
    """Equal-width edges for each of the last axis's ``x.shape[-1]`` dimensions."""
    _require_points(x)
    if len(bins) != x.shape[-1]:
        raise RuntimeError("histogramdd: The size of bins must be equal to the innermost dimension of the input.")
    points = x.reshape(-1, x.shape[-1])
    edges = []
    for d, n in enumerate(bins):
        if n <= 0:
            raise TorchRuntimeError(f"torch.histogram(): bins must be > 0, but got {n} for dimension {d}")
        lo, hi = _outer_edges(points[:, d], None if range is None else range[2 * d:2 * d + 2], d)
        edges.append(_linspace_edges(lo, hi, n, x.dtype))
    return edges


def _histogramdd(x, edges, weight, density):
    """Counts (or weights) of the points ``x.reshape(-1, D)`` in the bins between ``edges``:
    the last bin of each dimension includes its right edge, points outside count nowhere."""
    points = x.reshape(-1, x.shape[-1])
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros(points.shape[0], np.int64)
    inside = jnp.ones(points.shape[0], bool)
    for d, e in enumerate(edges):
        v = points[:, d]
        pos = jnp.clip(jnp.searchsorted(e, v, side="right") - 1, 0, shape[d] - 1)
        flat = flat * shape[d] + pos
        inside = inside & (v >= e[0]) & (v <= e[-1])
    w = jnp.ones(points.shape[0], x.dtype) if weight is None else weight.reshape(-1).astype(x.dtype)
    hist = jax.ops.segment_sum(jnp.where(inside, w, 0), flat, math.prod(shape)).reshape(shape)
    if density:
        hist = hist / hist.sum()
        for d, e in enumerate(edges):
            hist = hist / jnp.diff(e).reshape((-1,) + (1,) * (len(edges) - d - 1))
    return hist.astype(x.dtype)


# torch's CPU histograms are floating only, histogram and histogramdd not of float16 / bfloat16 either
refused_dtypes(aten.histogram, aten._histogramdd_bin_edges, aten._histogramdd_from_bin_cts,
               aten._histogramdd_from_bin_tensors, kinds="bic", dtypes=HALF_DTYPES)


@register(aten.histogram.bin_ct)
def histogram(x, bins=100, *, range=None, weight=None, density=False):
    (edges,) = _bin_edges(x.reshape(-1, 1), [bins], range)
    return _histogramdd(x.reshape(-1, 1), [edges], weight, density), edges


@register(aten.histogram.bins_tensor)
def histogram_bins_tensor(x, bins, *, weight=None, density=False):
    edges = bins.astype(x.dtype)
    return _histogramdd(x.reshape(-1, 1), [edges], weight, density), edges


@register(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(x, bins, range=None, weight=None, density=False):
    return _bin_edges(x, bins, range)


@register(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(x, bins, range=None, weight=None, density=False):
    return _histogramdd(x, _bin_edges(x, bins, range), weight, density)


@register(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(x, bins, weight=None, density=False):
    _require_points(x)
    n = x.shape[-1]
    if len(bins) != n:
        raise RuntimeError(f"torch.histogramdd: expected {n} sequences of bin edges for a {n}-dimensional histogram "
                           f"but got {len(bins)}")
    return _histogramdd(x, [b.astype(x.dtype) for b in bins], weight, density)


# -- sorting and selection ---------------------------------------------------


def _sort(x, d, descending):
    """Stable sort along axis ``d``: (values, int64 indices); NaN sorts above every number."""
    key = jnp.where(x == 0, jnp.zeros((), x.dtype), x) if _dt.is_floating(x.dtype) else x
    iota = jax.lax.broadcasted_iota(_LONG, x.shape, d)
    if descending:
        # Ascending on (key, -index), then reversed: descending keys, ties in index order.
        _, neg, values = jax.lax.sort((key, -iota, x), dimension=d, num_keys=2)
        return jnp.flip(values, d), -jnp.flip(neg, d)
    _, indices, values = jax.lax.sort((key, iota, x), dimension=d, num_keys=1, is_stable=True)
    return values, indices


@register(aten.sort.default)
@_real_only(torch.sort)
def sort(x, dim=-1, descending=False):
    d, x1 = _dim_axis(x, dim)
    values, indices = _sort(x1, d, descending)
    return values.reshape(x.shape), indices.reshape(x.shape)


@register(aten.sort.stable)
@_real_only(torch.sort)
def sort_stable(x, *, stable=None, dim=-1, descending=False):
    return sort(x, dim, descending)


refused_dtypes(aten.topk, aten.kthvalue, aten.median, aten.nanmedian, kinds="b")  # (torch's CPU selections)


@register(aten.topk.default)
@_real_only(lambda t: torch.topk(t, 1))
def topk(x, k, dim=-1, largest=True, sorted=True):
    d, x1 = _dim_axis(x, dim)
    if not 0 <= k <= x1.shape[d]:
        raise RuntimeError("selected index k out of range")
    values, indices = _sort(x1, d, largest)
    values, indices = jax.lax.slice_in_dim(values, 0, k, axis=d), jax.lax.slice_in_dim(indices, 0, k, axis=d)
    if x.ndim == 0:
        return values.reshape(()), indices.reshape(())
    return values, indices


def _pick(values, indices, pos, x, d, keepdim):
    """The entries at position ``pos`` (int or array broadcast against the reduced shape) along axis ``d``."""
    pos = jnp.broadcast_to(jnp.asarray(pos, _LONG), values.shape[:d] + (1,) + values.shape[d + 1 :])
    v = jnp.take_along_axis(values, pos, axis=d)
    i = jnp.take_along_axis(indices, pos, axis=d)
    if x.ndim == 0:
        return v.reshape(()), i.reshape(())
    if not keepdim:
        v, i = jnp.squeeze(v, d), jnp.squeeze(i, d)
    return v, i


@register(aten.kthvalue.default)
@_real_only(lambda t: torch.kthvalue(t, 1))
def kthvalue(x, k, dim=-1, keepdim=False):
    d, x1 = _dim_axis(x, dim)
    _require_nonempty("kthvalue", x1, (d,))
    if not 1 <= k <= x1.shape[d]:
        raise RuntimeError(f"kthvalue(): selected number k out of range for dimension {d}")
    values, indices = _sort(x1, d, False)
    return _pick(values, indices, k - 1, x, d, keepdim)


def _median(x, dim, keepdim, ignore_nan):
    d, x1 = _dim_axis(x, dim)
    _require_nonempty("nanmedian" if ignore_nan else "median", x1, (d,))
    values, indices = _sort(x1, d, False)
    n = x1.shape[d]
    if not _dt.is_floating(x.dtype):
        return _pick(values, indices, (n - 1) // 2, x, d, keepdim)
    nan = jnp.isnan(x1)
    if ignore_nan:
        count = jnp.sum(~nan, axis=d, keepdims=True)
        return _pick(values, indices, jnp.maximum(count - 1, 0) // 2, x, d, keepdim)
    v, i = _pick(values, indices, (n - 1) // 2, x, d, keepdim)
    has_nan = _keep(jnp.any(nan, axis=d), x, d, keepdim)
    first_nan = _keep(argmax_index(nan, axis=d), x, d, keepdim).astype(_LONG)
    return jnp.where(has_nan, jnp.array(jnp.nan, x.dtype), v), jnp.where(has_nan, first_nan, i)


@register(aten.median.dim)
@_real_only(lambda t: torch.median(t, 0))
def median_dim(x, dim, keepdim=False):
    return _median(x, dim, keepdim, False)


@register(aten.nanmedian.dim)
@_real_only(lambda t: torch.nanmedian(t, 0))
def nanmedian_dim(x, dim, keepdim=False):
    return _median(x, dim, keepdim, True)


@register(aten.median.default)
@_real_only(torch.median)
def median(x):
    if x.size == 0:
        return jnp.full((), jnp.nan, x.dtype)
    return _evenly_differentiated(x, _median(x.reshape(-1), 0, False, False)[0])


@register(aten.nanmedian.default)
@_real_only(torch.nanmedian)
def nanmedian(x):
    if x.size == 0:
        return jnp.full((), jnp.nan, x.dtype)
    return _evenly_differentiated(x, _median(x.reshape(-1), 0, False, True)[0])


def _evenly_differentiated(x, value):
    """``value``, one of ``x``'s elements, whose JAX derivative splits evenly among the elements equal to it
    (all NaNs where it is NaN), as torch differentiates a median without a dim (JAX's goes to one of them)."""
    return _split_evenly(x, value) if _dt.is_floating(x.dtype) else value


@jax.custom_jvp
def _split_evenly(x, value):
    return value


@_split_evenly.defjvp
def _split_evenly_jvp(primals, tangents):
    x, value = primals
    ties = jnp.where(jnp.isnan(value), jnp.isnan(x), x == value)
    return value, jnp.sum(jnp.where(ties, tangents[0], 0)).astype(x.dtype) / jnp.sum(ties).astype(x.dtype)


@register(aten.mode.default)
@_real_only(torch.mode)
def mode(x, dim=-1, keepdim=False):
    """The smallest most frequent value, and the last index holding it (torch's CPU kernel)."""
    d, x1 = _dim_axis(x, dim)
    _require_nonempty("mode", x1, (d,))
    n = x1.shape[d]
    s = jnp.moveaxis(_sort(x1, d, False)[0], d, -1)
    # int32 positions: cummax lowers under the x64 setting of the jit lowering it (see argmax_index)
    pos = jnp.arange(n, dtype=np.int32)
    new_run = jnp.concatenate([jnp.ones(s.shape[:-1] + (1,), bool), s[..., 1:] != s[..., :-1]], axis=-1)
    run_start = jax.lax.cummax(jnp.where(new_run, pos, 0), axis=s.ndim - 1)
    ends_run = jnp.concatenate([s[..., 1:] != s[..., :-1], jnp.ones(s.shape[:-1] + (1,), bool)], axis=-1)
    run_len = jnp.where(ends_run, pos - run_start + 1, 0)
    best = argmax_index(run_len, axis=-1)
    value = jnp.take_along_axis(s, best[..., None], axis=-1)
    last = jnp.max(jnp.where(jnp.moveaxis(x1, d, -1) == value, pos, -1), axis=-1)
    value = jnp.squeeze(value, -1)
    return _keep(value, x, d, keepdim), _keep(last, x, d, keepdim).astype(_LONG)


# -- segment reductions ------------------------------------------------------

# torch's names of the reductions segment_reduce accepts, and the one each stands for
_SEGMENT_REDUCTIONS = {"sum": "sum", "mean": "mean", "prod": "prod", "max": "max", "amax": "max", "min": "min",
                       "amin": "min"}
_SEGMENT_DTYPES = tuple(np.dtype(d) for d in (np.float32, np.float64, jnp.float16, jnp.bfloat16))


def _segment_kind(reduce):
    if reduce not in _SEGMENT_REDUCTIONS:
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")
    return _SEGMENT_REDUCTIONS[reduce]


class _Segments:
    """Where the segments of a segment reduction lie, for data viewed as (B, N, I).

    ``axis`` (of data) is the last axis of ``lengths`` / ``offsets``, whose leading axes are
    data's first B = prod(data.shape[:axis]) rows; N is data's length along ``axis`` and I the
    product of the axes after it. Each row has S segments: ``lengths`` gives their sizes, laid
    end to end from 0; ``offsets`` (S + 1 per row) their boundaries. ``ids`` (B * N,) numbers
    the segment of every position globally (row * S + segment); a position in no segment
    (lengths that do not cover the axis, which torch allows when ``unsafe``, or offsets that
    start past 0 or end before N) gets B * S, which jax.ops.segment_* drop. ``sizes``
    (B * S,) are the segments' lengths.
    Everything here depends on the values of lengths / offsets only through arrays, so the
    segments may be traced; the shapes come from the tensors' shapes.
    """

    def __init__(self, data, lengths, offsets, axis):
        by_offsets = offsets is not None
        if not by_offsets and lengths is None:
            raise RuntimeError("segment_reduce(): Either lengths or offsets must be defined.")
        bounds = offsets if by_offsets else lengths
        name = "offsets" if by_offsets else "lengths"
        a = canonical_dim(axis, data.ndim)
        if data.ndim < bounds.ndim:
            raise RuntimeError(f"segment_reduce(): Expected data.dim() >= {name}.dim(), got {data.ndim} and "
                               f"{bounds.ndim}.")
        if a != bounds.ndim - 1:
            raise RuntimeError(f"segment_reduce(): Expected axis to be the last dimension of {name} but got {a}.")
        if bounds.dtype not in (np.int32, np.int64):
            raise RuntimeError(f"segment_reduce(): {name} must be an int32 or int64 tensor, got "
                               f"{_torch_name(bounds.dtype)}")
        if bounds.shape[:-1] != data.shape[:a]:
            # torch's kernel reads past the end of the tensor here
            raise RuntimeError(f"segment_reduce(): {name} of shape {tuple(bounds.shape)} does not match data of "
                               f"shape {tuple(data.shape)} in the dimensions before axis {a}")
        if by_offsets and bounds.shape[-1] == 0:
            raise RuntimeError("segment_reduce(): offsets must hold at least one boundary along axis")
        self.shape, self.axis, self.name = data.shape, a, name
        self.rows, self.n = math.prod(data.shape[:a]), data.shape[a]
        self.inner = math.prod(data.shape[a + 1:])
        bounds = bounds.reshape(self.rows, bounds.shape[-1]).astype(_LONG)
        if by_offsets:
            starts, ends, first = bounds[:, :-1], bounds[:, 1:], bounds[:, :1]
        else:
            ends = jnp.cumsum(bounds, axis=1)
            starts, first = ends - bounds, jnp.zeros((self.rows, 1), _LONG)
        self.count = ends.shape[1]
        self.bounds = bounds
        self.sizes = (ends - starts).reshape(-1)
        pos = jnp.arange(self.n, dtype=_LONG)
        # the segment holding position p is the first whose end lies past p: empty segments
        # before it end where it starts
        seg = jax.vmap(lambda e: jnp.searchsorted(e, pos, side="right"))(ends)
        inside = (pos >= first) & (seg < self.count)
        row = jnp.arange(self.rows, dtype=_LONG)[:, None] * self.count
        self.ids = jnp.where(inside, row + seg, self.rows * self.count).reshape(-1)

    @property
    def segments(self):
        return self.rows * self.count

    def flat(self, x):
        """Data-shaped ``x`` as (B * N, I), one row per position."""
        return x.reshape(self.rows * self.n, self.inner)

    def out_flat(self, y):
        """Output-shaped ``y`` (data's shape with S along axis) as (B * S, I), one row per segment."""
        return y.reshape(self.segments, self.inner)

    def out(self, y):
        return y.reshape(self.shape[:self.axis] + (self.count,) + self.shape[self.axis + 1:])

    def gather(self, per_segment):
        """(B * S, ...) values per segment -> (B * N, ...) per position (0 outside any segment)."""
        return jnp.take(per_segment, self.ids, axis=0, mode="fill", fill_value=0)

    def reduce(self, fn, x):
        return fn(x, self.ids, num_segments=self.segments)


def _check_segment_lengths(seg, unsafe):
    """torch's checks of the segments' lengths. They read the values, so run in eager mode
    only (naming Tracer keeps this lowering out of the dispatcher's compiled calls, where
    the values would be traced too)."""
    if isinstance(seg.sizes, jax.core.Tracer):
        return
    if seg.name == "lengths" and not unsafe:
        lengths = np.asarray(seg.bounds)
        if lengths.size and lengths.min() < 0:
            raise RuntimeError("lengths contains negative value!")
        if not (lengths.sum(axis=-1) == seg.n).all():
            raise RuntimeError("segment_reduce(): Expected all rows of lengths along axis to sum to "
                               "data.size(lengths.dim()-1) when !unsafe.")
    if (np.asarray(seg.sizes) < 0).any():
        raise RuntimeError("Expected segment_length >= 0 to be true, but got false.")


def _require_segment_dtype(x):
    if np.dtype(x.dtype) not in _SEGMENT_DTYPES:
        raise NotImplementedError(f"\"_segment_reduce_cpu\" not implemented for '{scalar_type_name(x.dtype)}'")


@register(aten.segment_reduce.default)
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """torch._segment_reduce: each segment of ``data`` along ``axis`` reduced to one value.

    The reduction starts from ``initial`` (cast to data's dtype) where given, else from the
    reduction's identity; an empty segment is that start value, except an empty mean without
    ``initial``, which is NaN. A mean divides the sum, ``initial`` included, by the segment's
    length. max / min are NaN when the segment or ``initial`` holds a NaN. ``offsets`` wins
    over ``lengths`` when both are given, as in torch. Sums and products of float16 /
    bfloat16 accumulate in float32, where torch's kernel rounds to the input's dtype after
    every element, so long segments can differ by more than one rounding.
    """
    if indices is not None:
        raise RuntimeError("segment_reduce(): indices based reduction is not supported yet.")
    kind = _segment_kind(reduce)
    seg = _Segments(data, lengths, offsets, axis)
    _require_segment_dtype(data)
    _check_segment_lengths(seg, unsafe)
    x = seg.flat(data)
    start = None if initial is None else jnp.asarray(initial, data.dtype)
    if kind in ("max", "min"):
        extreme = seg.reduce(jax.ops.segment_max if kind == "max" else jax.ops.segment_min, x)
        if start is not None:
            extreme = (jnp.maximum if kind == "max" else jnp.minimum)(extreme, start)
        # scatter-max and -min need not propagate NaN; torch's kernel keeps any NaN it meets
        has_nan = seg.reduce(jax.ops.segment_max, jnp.isnan(x))
        return seg.out(jnp.where(has_nan, jnp.array(jnp.nan, data.dtype), extreme))
    xc = _opmath(x)
    if kind == "prod":
        out = seg.reduce(jax.ops.segment_prod, xc)
        out = out if start is None else start.astype(xc.dtype) * out
        return seg.out(out.astype(data.dtype))
    total = seg.reduce(jax.ops.segment_sum, xc)
    if start is not None:
        total = start.astype(xc.dtype) + total
    if kind == "sum":
        return seg.out(total.astype(data.dtype))
    sizes = seg.sizes[:, None]
    empty = jnp.array(jnp.nan, xc.dtype) if start is None else start.astype(xc.dtype)
    mean = jnp.where(sizes > 0, total / jnp.maximum(sizes, 1).astype(xc.dtype), empty)
    return seg.out(mean.astype(data.dtype))


@register(aten._segment_reduce_backward.default)
def _segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    """The gradient of segment_reduce with respect to ``data``, as torch's CPU kernel gives it.

    sum: each element gets its segment's gradient; mean: that divided by the segment's length.
    max / min: the elements equal to the result, and NaN elements, get the gradient; when there
    are two or more of them, those whose gradient is positive share it equally (torch divides
    only positive gradients). prod: ``grad * result / x``, and for a zero or NaN element the
    gradient times the product of ``initial`` (1 when not given) and the segment's other
    elements. Elements in no segment get 0.
    """
    kind = _segment_kind(reduce)
    seg = _Segments(data, lengths, offsets, axis)
    dtype = grad.dtype
    x = seg.flat(data).astype(dtype)
    inside = (seg.ids < seg.segments)[:, None]
    g = seg.gather(seg.out_flat(grad))
    if kind == "sum":
        dx = g
    elif kind == "mean":
        dx = g / seg.gather(seg.sizes)[:, None].astype(dtype)
    elif kind in ("max", "min"):
        hit = jnp.isnan(x) | (x == seg.gather(seg.out_flat(output).astype(dtype)))
        ties = seg.gather(seg.reduce(jax.ops.segment_sum, hit.astype(_LONG)))
        dx = jnp.where(hit, g, jnp.zeros((), dtype))
        dx = jnp.where((ties >= 2) & (dx > 0), dx / ties.astype(dtype), dx)
    else:
        out = seg.gather(seg.out_flat(output).astype(dtype))
        zero, nan = x == 0, jnp.isnan(x)
        regular = ~(zero | nan)
        # the product of a zero or NaN element's segment-mates: the product of the segment's
        # other (regular) elements, 0 if another zero is among them, NaN if another NaN is
        xc = _opmath(x)
        others = seg.gather(seg.reduce(jax.ops.segment_prod, jnp.where(regular, xc, jnp.ones((), xc.dtype))))
        zeros = seg.gather(seg.reduce(jax.ops.segment_sum, zero.astype(_LONG))) - zero
        nans = seg.gather(seg.reduce(jax.ops.segment_sum, nan.astype(_LONG))) - nan
        others = jnp.where(zeros > 0, jnp.zeros((), xc.dtype) * others, others)
        others = jnp.where(nans > 0, jnp.array(jnp.nan, xc.dtype), others)
        if initial is not None:
            others = jnp.asarray(initial, dtype).astype(xc.dtype) * others
        dx = jnp.where(regular, (g * out) / jnp.where(regular, x, jnp.ones((), dtype)), g * others.astype(dtype))
    return jnp.where(inside, dx, jnp.zeros((), dtype)).reshape(data.shape)


# -- prims -------------------------------------------------------------------


def _prim_axes(dims, ndim):
    return tuple(range(ndim)) if dims is None else canonical_dims(dims, ndim)


def _prim_out(x, output_dtype):
    return _dt.to_jax(output_dtype) if output_dtype is not None else np.dtype(x.dtype)


@register(prims.sum.default)
def prim_sum(x, dims, *, output_dtype=None):
    out = _prim_out(x, output_dtype)
    return jnp.sum(_opmath(x), axis=_prim_axes(dims, x.ndim)).astype(out)


@register(prims.prod.default)
def prim_prod(x, dims, *, output_dtype=None):
    out = _prim_out(x, output_dtype)
    return jnp.prod(_opmath(x), axis=_prim_axes(dims, x.ndim)).astype(out)


@register(prims.amax.default)
def prim_amax(x, dims, *, output_dtype=None):
    return jnp.max(x, axis=_prim_axes(dims, x.ndim)).astype(_prim_out(x, output_dtype))


@register(prims.amin.default)
def prim_amin(x, dims, *, output_dtype=None):
    return jnp.min(x, axis=_prim_axes(dims, x.ndim)).astype(_prim_out(x, output_dtype))


@register(prims.var.default)
def prim_var(x, dims, correction=1, *, output_dtype=None):
    out = _prim_out(x, output_dtype) if output_dtype is not None else _real_out(x)
    return _var_mean(x, _prim_axes(dims, x.ndim), correction, False)[0].astype(out)


@register(prims.xor_sum.default)
def prim_xor_sum(x, dims, *, output_dtype=None):
    axes = _prim_axes(dims, x.ndim)
    out = jax.lax.reduce(x, np.zeros((), x.dtype), jax.lax.bitwise_xor, axes)
    return out.astype(_prim_out(x, output_dtype))
