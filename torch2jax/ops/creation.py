"""Factories, copies and dtype / device conversion."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from ..symbolic import traced_number
from .registry import (_HALF, as_dtype, cast, checked_scalar, placed_as, register, scalar_type_name, true_divide,
                       warning)

aten = torch.ops.aten


def jax_dtype(dtype, default=None):
    """The JAX dtype for a torch ``dtype=`` argument (None -> ``default`` or torch's default)."""
    if dtype is None:
        return np.dtype(default) if default is not None else _dt.default_float()
    return _dt.to_jax(dtype)


def _shape(size):
    if isinstance(size, int):
        return (size,)
    shape = tuple(int(s) for s in size)
    if any(s < 0 for s in shape):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(shape)}: {list(shape)}")
    return shape


def uninitialized(shape, dtype):
    """The values of memory torch leaves uninitialized (``torch.empty``, a growing ``resize_``): zeros;
    under ``torch.use_deterministic_algorithms(True)`` with ``torch.utils.deterministic.
    fill_uninitialized_memory`` (its default), what torch fills it with: NaN, the largest integer, True."""
    if not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory):
        return jnp.zeros(shape, dtype)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        value = True
    elif jnp.issubdtype(dtype, jnp.integer):
        value = jnp.iinfo(dtype).max
    elif jnp.issubdtype(dtype, jnp.complexfloating):
        value = complex(float("nan"), 0.0)  # (torch's complex NaN: a NaN real part)
    else:
        value = float("nan")
    return jnp.full(shape, np.asarray(value, dtype), dtype)


def _size_and_dtype(args, dtype, methods):
    """(shape, dtype) of a factory called as ``torch.x(size)`` or, with ``methods`` arguments, as the method
    ``self.new_x(size, ...)``, whose dtype defaults to ``self``'s."""
    if len(args) == methods:
        return _shape(args[1]), jax_dtype(dtype, args[0].dtype)
    return _shape(args[0]), jax_dtype(dtype)


@register(aten.zeros.default, aten.new_zeros, aten._efficientzerotensor)
def zeros(*args, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, names=None):
    return jnp.zeros(*_size_and_dtype(args, dtype, 2))


@register(aten.empty.memory_format, aten.new_empty)
def empty(*args, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, names=None):
    return uninitialized(*_size_and_dtype(args, dtype, 2))


@register(aten.empty_strided, aten.new_empty_strided)
def empty_strided(*args, dtype=None, layout=None, device=None, pin_memory=None):
    return uninitialized(*_size_and_dtype(args, dtype, 3))


@register(aten.ones.default, aten.new_ones)
def ones(*args, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(*_size_and_dtype(args, dtype, 2))


def _fill_dtype(value, dtype):
    if dtype is not None:
        return _dt.to_jax(dtype)
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    if isinstance(value, complex):
        return _dt.default_complex()
    if hasattr(value, "dtype"):
        return _dt.weak_scalar_dtype(value) or np.dtype(value.dtype)
    return _dt.default_float()


@register(aten.full.default)
def full(size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    dt = _fill_dtype(fill_value, dtype)
    return jnp.full(_shape(size), as_dtype(checked_scalar(fill_value, dt), dt), dt)


@register(aten.new_full)
def new_full(x, size, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    dt = jax_dtype(dtype, x.dtype)
    return jnp.full(_shape(size), as_dtype(checked_scalar(fill_value, dt), dt), dt)


@register(aten.scalar_tensor)
def scalar_tensor(value, *, dtype=None, layout=None, device=None, pin_memory=None):
    dt = jax_dtype(dtype)
    # (torch's CPU kernel converts a number to float16 / bfloat16 unchecked: out of range is inf there)
    if np.dtype(dt) not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        value = checked_scalar(value, dt)
    return jnp.asarray(as_dtype(value, dt))


# The *_like factories place their result as ``x`` is (`placed_as`): the Adam state of a sharded
# parameter is sharded as it is.
@register(aten.zeros_like)
def zeros_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return placed_as(x, jnp.zeros(x.shape, jax_dtype(dtype, x.dtype)))


@register(aten.empty_like)
def empty_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return placed_as(x, uninitialized(x.shape, jax_dtype(dtype, x.dtype)))


@register(aten.ones_like)
def ones_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return placed_as(x, jnp.ones(x.shape, jax_dtype(dtype, x.dtype)))


@register(aten.full_like)
def full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    dt = jax_dtype(dtype, x.dtype)
    return placed_as(x, jnp.full(x.shape, as_dtype(checked_scalar(fill_value, dt), dt), dt))


@register(aten.fill.Scalar, aten.fill.Tensor)
def fill(x, value):
    if getattr(value, "ndim", 0):
        raise RuntimeError(f"fill_ only supports 0-dimension value tensor but got tensor with {value.ndim} dimensions.")
    value = as_dtype(checked_scalar(value, x.dtype), x.dtype) if not hasattr(value, "dtype") else value.astype(x.dtype)
    return jnp.full(x.shape, value, x.dtype)


@register(aten.zero)
def zero(x):
    return jnp.zeros_like(x)


def _arange_dtype(values, dtype):
    if dtype is not None:
        return _dt.to_jax(dtype)
    if all(isinstance(v, (int, np.integer)) or (hasattr(v, "dtype") and _dt.is_integral(v.dtype, True)) for v in values):
        return np.dtype(np.int64)
    return _dt.default_float()


def _c_int_div(a: int, b: int) -> int:
    """C++'s division of Python ints (rounds toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _integer_arange(start, end, step, dt):
    """torch CPU's integer arange: start, end and step truncated to integers first; the length
    from those in int64 (``ceil`` of an integer division), from the given values otherwise."""
    istart, iend, istep = (int(v) for v in (start, end, step))
    if step == 0 or (istep == 0 and dt == np.int64):
        # (a narrower type takes its length from the given step: a step truncated to 0 repeats start)
        raise (ValueError if dt == np.int64 and step != 0 else RuntimeError)("step must be nonzero")
    if dt == np.int64:
        if not ((istep > 0 and iend >= istart) or (istep < 0 and iend <= istart)):
            raise RuntimeError("upper bound and lower bound inconsistent with step sign")
        n = _c_int_div(iend - istart + istep - (1 if istep > 0 else -1), istep)
    else:
        if (float(end) - float(start)) / float(step) < 0:
            raise RuntimeError("upper bound and lower bound inconsistent with step sign")
        n = int(np.ceil((float(end) - float(start)) / float(step)))
    return (istart + jnp.arange(max(n, 0), dtype=np.int64) * istep).astype(dt)


@register(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange(*args, dtype=None, layout=None, device=None, pin_memory=None):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args + (1,))[:3]
    dt = _arange_dtype((start, end, step), dtype)
    if dt == np.bool_ or _dt.is_complex(dt):
        raise NotImplementedError(f"\"arange_cpu\" not implemented for '{scalar_type_name(dt)}'")
    if _dt.is_integral(dt):
        return _integer_arange(start, end, step, dt)
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if (end - start) / step < 0:
        raise RuntimeError(
            "upper bound and lower bound inconsistent with step sign"
        )
    n = int(np.ceil((end - start) / step))
    return (start + jnp.arange(n, dtype=np.float64) * step).astype(dt)


def _in_dtype(value, dt):
    """A float64 array of ``value`` as torch's range kernels read it: converted to the
    output dtype first (integers truncate and wrap, half-precision types round)."""
    v = jnp.asarray(value)
    v = v.real if jnp.iscomplexobj(v) and not jnp.issubdtype(dt, jnp.complexfloating) else v
    if _dt.is_integral(dt):
        return cast(v, dt).astype(np.float64)
    return _rounded_to(v.astype(np.float64), dt) if dt in _HALF else v.astype(np.float64)


def _rounded_to(v, dt):
    """Float64 ``v`` rounded to floating type ``dt``, still float64: reduce_precision, as inside a program
    XLA may drop a round trip through a narrower type ("excess precision")."""
    info = jnp.finfo(dt)
    return jax.lax.reduce_precision(v, info.nexp, info.nmant)


def _halves(start, end, steps, step, rnd):
    """torch's range kernels: the first half counts up from ``start``, the second down from
    ``end`` (so both ends are exact); ``rnd`` rounds each intermediate to the output type."""
    idx = jnp.arange(steps, dtype=np.float64)
    up = rnd(start + rnd(step * idx))
    down = rnd(end - rnd(step * (steps - 1 - idx)))
    return jnp.where(idx < steps // 2, up, down)


def _two_product(a, b):
    """``a * b`` as an unevaluated sum ``p + err``, exactly (Dekker's product; host numpy, which
    never fuses a multiply into an add)."""
    p = a * b
    split = 134217729.0  # 2**27 + 1
    ca, cb = split * a, split * b
    ah, bh = ca - (ca - a), cb - (cb - b)
    al, bl = a - ah, b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _fused_multiply_add(a, b, c):
    """``a * b + c`` rounded once, as the fused multiply-add torch CPU's compiled kernels use."""
    p, err = _two_product(a, b)
    h = p + c
    bv = h - c
    low = (p - bv) + (c - (h - bv))  # two-sum's rounding error of p + c
    return h + (low + err)


# Up to this many points, a float linspace with concrete ends is computed on the host (`_fused_halves`):
# inside a jitted program a constant; a longer one is computed by the program (an ulp off torch's at some points)
_HOST_LINSPACE = 1 << 16


def _fused_halves(start, end, steps, dt):
    """torch CPU's float linspace on the host: the step in the output type (float64 for integers),
    the first half ``start + step * i`` and the second ``end - step * (steps - 1 - i)``, each one
    fused multiply-add; computed with numpy, as XLA fuses some of them and not others."""
    if not _dt.is_integral(dt):
        start, end = np.float64(dt.type(start)), np.float64(dt.type(end))
    step_t = np.float64 if _dt.is_integral(dt) else dt.type
    step = np.float64(step_t((step_t(end) - step_t(start)) / step_t(steps - 1)))
    idx = np.arange(steps, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        up = _fused_multiply_add(np.full(steps, step), idx, np.full(steps, start))
        down = _fused_multiply_add(np.full(steps, -step), steps - 1 - idx, np.full(steps, end))
    out = np.where(idx < steps // 2, up, down)
    return out if _dt.is_integral(dt) else out.astype(dt)


def _identity(x):
    return x


def _space_dtype(start, end, dtype):
    """linspace / logspace's result type: ``dtype``, else torch's default complex type where an
    end is complex (``torch.linspace(1 + 1j, 2, 3)`` is complex64), else its default float type."""
    if dtype is None and any(isinstance(a, complex) or jnp.iscomplexobj(a) for a in (start, end)):
        return np.dtype(np.complex128 if _dt.default_float() == np.float64 else np.complex64)
    return jax_dtype(dtype)


@register(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar,
          aten.linspace.Scalar_Tensor)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=None):
    dt = _space_dtype(start, end, dtype)
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    if dt == np.bool_:
        raise NotImplementedError("\"linspace_cpu\" not implemented for 'Bool'")
    if jnp.issubdtype(dt, jnp.complexfloating):
        return jnp.linspace(jnp.asarray(start, dt), jnp.asarray(end, dt), steps).astype(dt)
    s, e = _in_dtype(start, dt), _in_dtype(end, dt)
    if steps <= 1:
        return jnp.broadcast_to(s, (steps,)).astype(dt)
    if dt in _HALF:
        # scalar Half / BFloat16 arithmetic: each operation rounds to the type
        def rnd(x):
            return _rounded_to(x.astype(np.float64), dt)

        return _halves(s, e, steps, rnd(true_divide(rnd(e - s), steps - 1.0)), rnd).astype(dt)
    if steps <= _HOST_LINSPACE and not any(isinstance(v, jax.core.Tracer) for v in (s, e)):
        return cast(jnp.asarray(_fused_halves(np.float64(s), np.float64(e), steps, dt)), dt)
    if dt == np.float32:
        # the ends and the step in float32 as torch; each exact product in float64, then one sum
        s, e = _rounded_to(s, dt), _rounded_to(e, dt)
        return cast(_halves(s, e, steps, _rounded_to(true_divide(_rounded_to(e - s, dt), steps - 1.0), dt),
                            _identity), dt)
    out = _halves(s, e, steps, true_divide(e - s, steps - 1.0), _identity)
    return cast(out, dt)


@register(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar,
          aten.logspace.Scalar_Tensor)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    dt = _space_dtype(start, end, dtype)
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    if dt == np.bool_:
        raise NotImplementedError("\"logspace_cpu\" not implemented for 'Bool'")
    if jnp.issubdtype(dt, jnp.complexfloating):
        exponents = jnp.linspace(jnp.asarray(start, dt), jnp.asarray(end, dt), steps)
        return (jnp.asarray(base, dt) ** exponents).astype(dt)
    # torch CPU: the ends converted to the output type and their difference taken in it;
    # the exponents, pow and the base in float64, then one conversion (integers truncate
    # and wrap); a single step is pow(base, start) of the start as given
    integral = _dt.is_integral(dt)
    b = jnp.asarray(base, np.float64)
    if steps <= 1:
        exponents = jnp.broadcast_to(jnp.asarray(start, np.float64), (steps,))
    else:
        s, e = _in_dtype(start, dt), _in_dtype(end, dt)
        diff = e - s if integral else _rounded_to(e - s, dt)
        exponents = _halves(s, e, steps, true_divide(diff, steps - 1.0), _identity)
    out = b ** exponents
    return cast(out, dt)


def _triangle_indices(np_indices, row, col, offset, dtype):
    if row < 0 or col < 0:
        raise RuntimeError(f"row and col must be non-negative, got row={row}, col={col}")
    r, c = np_indices(row, offset, col)
    return jnp.asarray(np.stack([r, c]), jax_dtype(dtype, np.int64))


@register(aten.tril_indices.default)
def tril_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _triangle_indices(np.tril_indices, row, col, offset, dtype)


@register(aten.triu_indices.default)
def triu_indices(row, col, offset=0, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _triangle_indices(np.triu_indices, row, col, offset, dtype)


@register(aten.eye.default, aten.eye.m)
def eye(n, m=None, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, n if m is None else m, dtype=jax_dtype(dtype))


@register(aten.clone)
def clone(x, *, memory_format=None):
    return jnp.array(x, copy=True) if not isinstance(x, jax.core.Tracer) else x + jnp.zeros((), x.dtype)


_warned_complex_to_real = False


@warning(aten._to_copy, aten.copy, aten.copy_.default)
def _warn_complex_to_real(func, args, kwargs):
    """torch's one-time warning (TORCH_WARN_ONCE) for a copy that drops imaginary parts."""
    global _warned_complex_to_real
    if _warned_complex_to_real:
        return
    if func is aten._to_copy.default:
        src, dtype = args[0], kwargs.get("dtype")
    else:
        src, dtype = args[1], args[0].dtype
    if isinstance(src, torch.Tensor) and src.is_complex() and dtype is not None and not dtype.is_complex \
            and dtype is not torch.bool:
        _warned_complex_to_real = True
        warnings.warn("Casting complex values to real discards the imaginary part", UserWarning, stacklevel=3)


@register(aten._to_copy)
def _to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return x if dtype is None else cast(x, _dt.to_jax(dtype))


@register(aten.is_pinned)
def is_pinned(x, device=None):
    """A jax tensor lives in JAX's memory, never in torch's pinned host memory."""
    return False


@register(aten._pin_memory)
def _pin_memory(x, device=None):
    """Pinning a jax tensor (a DataLoader's ``pin_memory=True`` over jax tensors) gives it as it is:
    JAX transfers host memory itself (see torch2jax.offload for host-memory placement)."""
    return x


@register(aten.lift_fresh_copy)
def lift_fresh_copy(x):
    return x


@register(aten.copy)
def copy(x, src, non_blocking=False):
    if not hasattr(src, "dtype"):  # a Python number (``x.copy_(2.5)``)
        src = jnp.asarray(src)
    out = jnp.broadcast_to(cast(src, x.dtype), x.shape)
    # An eager copy_ of the same dtype and shape would hand the destination the source's own
    # jax.Array; t2j.jit donates the buffers of the state it overwrites, so the copy (an
    # AveragedModel's first update_parameters, `ema.copy_(p)`) would be deleted with it.
    if out is src and not isinstance(src, jax.core.Tracer):
        out = jnp.array(src, copy=True)
    return out


@register(aten._local_scalar_dense, aten.item)
def _local_scalar_dense(x):
    """``t.item()``: a Python number, or a traced one while ``t`` is being traced
    (see torch2jax/symbolic.py). Like torch's Python number it carries no gradient where JAX
    differentiates the program (a jitted forward's backward, ``call_torch`` under ``jax.grad``).
    (``aten.item`` itself reaches the jax device under ``torch.inference_mode()``, where torch
    does not decompose it.)"""
    if isinstance(x, jax.core.Tracer):
        return traced_number(jax.lax.stop_gradient(x))
    return np.asarray(x).item()
