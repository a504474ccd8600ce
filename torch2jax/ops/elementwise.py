"""Lowerings: elementwise ops, ATen and the ``prims`` they decompose to.

ATen ops promote their operands as torch does (``registry.elementwise``).
``prims`` ops get operands that already share one dtype and keep it (except
comparisons, which give bool), so they are registered with the same compute
function under the "default" promotion kind; ``prims.div`` truncates integers.
"""

from __future__ import annotations

import math
import operator
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from .. import dtypes as _dt
from ..dispatch import OpError, TorchRuntimeError
from .indexing import raise_as_torch, stand_in
from .registry import (HALF_DTYPES, LOWERINGS, as_dtype, cast, check_values, checked_scalar, decomposition, elementwise,
                       float_abs, promote, refused_dtypes, register, scalar_type_name, strides, torch_slopes, true_divide,
                       view, warning)

aten = torch.ops.aten
prims = torch.ops.prims


def _is_bool(x) -> bool:
    return np.dtype(x.dtype) == np.bool_


def _is_int(x) -> bool:
    return _dt.is_integral(x.dtype, include_bool=True)


def _is_complex(x) -> bool:
    return _dt.is_complex(x.dtype)


def _reject_complex(name, *xs):
    """torch's own error for a complex operand of ``torch.<name>`` (an ordering, which complex
    numbers lack), from its CPU kernel run on one-element stand-ins."""
    complex_ = [x for x in xs if _is_complex(x)]
    if complex_:
        z = stand_in(complex_[0].dtype, 1)
        if name == "clamp":
            args = (z, 0)
        elif name.startswith("is"):  # isposinf, isneginf
            args = (z,)
        else:
            args = (z, z)
        raise_as_torch(getattr(torch, name), *args)
        raise OpError(f'torch2jax: "{name}" is not implemented for complex tensors')


def _check_divisor(b):
    """torch raises on integer division by zero (on CPU); XLA would return garbage. A value
    check (`check_values`): in eager mode, and inside compiled programs when they run under
    ``check_indices="always"``."""
    if _is_int(b):  # (torch's message for an integer division by zero)
        check_values(b, lambda v: v == 0, lambda _: RuntimeError("ZeroDivisionError"))


def _result_of(*operands):
    """torch's result dtype of ``operands`` (None left out)."""
    return _dt.result_type(*[a for a in operands if a is not None])


def _promoted(kind, *operands):
    """(operands promoted to torch's compute dtype, float32 for half types; None kept, result dtype)."""
    compute, result = promote(kind, [a for a in operands if a is not None])
    if compute in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        compute = np.dtype(np.float32)
    return [None if a is None else as_dtype(a, compute) for a in operands], result


# -- unary math ----------------------------------------------------------------

# ATen name -> (prims name or None, function); all promote integers to float.
_FLOAT_UNARY = {
    "sqrt": ("sqrt", jnp.sqrt),
    "rsqrt": ("rsqrt", lax.rsqrt),
    "exp": ("exp", jnp.exp),
    "exp2": ("exp2", jnp.exp2),
    "expm1": ("expm1", jnp.expm1),
    "log": ("log", jnp.log),
    "log2": ("log2", jnp.log2),
    "log10": ("log10", jnp.log10),
    "log1p": ("log1p", jnp.log1p),
    "sin": ("sin", jnp.sin),
    "cos": ("cos", jnp.cos),
    "tan": ("tan", jnp.tan),
    "asin": ("asin", jnp.arcsin),
    "acos": ("acos", jnp.arccos),
    "atan": ("atan", jnp.arctan),
    "sinh": ("sinh", jnp.sinh),
    "cosh": ("cosh", jnp.cosh),
    "tanh": ("tanh", jnp.tanh),
    "asinh": ("asinh", jnp.arcsinh),
    "acosh": ("acosh", jnp.arccosh),
    "atanh": ("atanh", jnp.arctanh),
    "erf": ("erf", lax.erf),
    "erfc": ("erfc", lax.erfc),
    "erfinv": ("erf_inv", lax.erf_inv),
    "lgamma": ("lgamma", lax.lgamma),
    "deg2rad": (None, jnp.deg2rad),
    "rad2deg": (None, jnp.rad2deg),
}

for _aten_name, (_prim_name, _fn) in _FLOAT_UNARY.items():
    elementwise(getattr(aten, _aten_name), promote_kind="int_to_float")(_fn)
    if _prim_name is not None:
        elementwise(getattr(prims, _prim_name))(_fn)


@elementwise(prims.cbrt)
def cbrt(x):
    return jnp.cbrt(x)


@elementwise(aten.reciprocal, promote_kind="int_to_float")
def reciprocal(x):
    return 1 / x


elementwise(prims.reciprocal)(reciprocal.compute)


@elementwise(aten.sigmoid, promote_kind="int_to_float")
def sigmoid(x):
    return 1 / (1 + jnp.exp(-x)) if _is_complex(x) else jax.nn.sigmoid(x)


@elementwise(aten.logit, promote_kind="int_to_float", opmath=False)  # torch's kernel rounds x / (1 - x) to float16
def logit(x, eps=None):
    if eps is None:
        return _logit(x)
    # torch's order of the bounds, which matters where eps > 0.5
    clamped = jnp.where(x < eps, eps, jnp.where(x > 1 - eps, 1 - eps, x)).astype(x.dtype)
    return jnp.log(clamped / (1 - clamped))


# torch's 1 / (x (1 - x)): infinite at 0 and 1 (JAX's derivative of the quotient's log is NaN there), NaN outside
_logit = torch_slopes(lambda x: jnp.log(x / (1 - x)),
                      lambda x: (jnp.where((x < 0) | (x > 1), jnp.full((), jnp.nan, x.dtype), 1 / (x * (1 - x))),))


@register(aten.logit_backward.default)
def logit_backward(grad, x, eps=None):
    """``grad / (x (1 - x))``, 0 outside [eps, 1 - eps] (NaN outside [0, 1] without eps), in the
    inputs' own dtype as torch's kernel computes it (float16 rounds at each step, eps too)."""
    dtype = jnp.result_type(grad, x)
    grad, x = grad.astype(dtype), x.astype(dtype)
    slope = grad / (x * (1 - x))
    if eps is None or eps < 0:
        return jnp.where((x < 0) | (x > 1), jnp.full((), jnp.nan, dtype), slope)
    low = jnp.asarray(eps, dtype)
    return jnp.where((x < low) | (x > 1 - low), jnp.zeros((), dtype), slope)


@elementwise(aten.digamma, prims.digamma, promote_kind="int_to_float")
def digamma(x):
    # torch: digamma(+-0) = -+inf (the pole's one-sided limit); XLA gives nan.
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), lax.digamma(x))


@elementwise(aten.neg, prims.neg)
def neg(x):
    if _is_bool(x):
        raise TorchRuntimeError(
            "Negation, the `-` operator, on a bool tensor is not supported. If you are trying to invert "
            "a mask, use the `~` or `logical_not()` operator instead."
        )
    return -x


@warning(aten.abs_.default)
def _no_complex_abs_(func, args, kwargs):
    """abs of complex numbers is real, which the complex input cannot hold."""
    if args[0].is_complex():
        raise RuntimeError("In-place abs is not supported for complex tensors.")


@elementwise(aten.abs, prims.abs, promote_kind="complex_to_float")
def absolute(x):
    if _is_bool(x):
        raise NotImplementedError("\"abs_cpu\" not implemented for 'Bool'")
    return float_abs(x) if _dt.is_floating(x.dtype) else jnp.abs(x)


@elementwise(aten.sign, prims.sign)
def sign(x):
    if _is_complex(x):
        raise NotImplementedError(
            "Unlike NumPy, torch.sign is not intended to support complex numbers. Please use torch.sgn instead.")
    return sgn.compute(x)


@elementwise(aten.sgn)
def sgn(x):
    if _is_bool(x):
        return x
    if _is_complex(x):
        a = jnp.abs(x)
        return jnp.where(a == 0, jnp.zeros((), x.dtype), x / a.astype(x.dtype))
    # (0 < x) - (x < 0), as torch: sign(nan) = 0 and sign(-0.0) = +0.0
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


@elementwise(aten.signbit, prims.signbit, promote_kind="always_bool")
def signbit(x):
    if _is_int(x):
        return x < 0
    return jnp.signbit(x)


# -- rounding ------------------------------------------------------------------


def _rounding(fn):
    def lowering(x):
        return x if _is_int(x) else fn(x)

    return lowering


# torch's CPU kernels round no bools (nor complex numbers), and compute none of these of bools
refused_dtypes(aten.floor, aten.ceil, aten.trunc, aten.addcmul, aten.remainder, aten.fmod, aten.pow,
               aten.bitwise_left_shift, aten.__lshift__, aten.bitwise_right_shift, aten.__rshift__, kinds="b")
refused_dtypes(aten.round, aten.floor_divide, aten.div.Tensor_mode, aten.div.Scalar_mode, kinds="bc")
refused_dtypes(aten.hypot, aten.lerp, aten.logaddexp, kinds="bi")  # (floating kernels only)
# (floating kernels only, real ones: frac and round(decimals=) keep no integers as they are, as floor does)
refused_dtypes(aten.frac, aten.round.decimals, aten.logaddexp2, aten.nextafter, aten.frexp, kinds="bic")
refused_dtypes(aten.gcd, aten.lcm, kinds="bcf")  # (integer kernels only)
# (real kernels only; deg2rad / rad2deg refuse complex numbers with an error of their own)
refused_dtypes(aten.atan2, aten.logit, aten.xlogy, aten.deg2rad, aten.rad2deg, aten.clamp_min, aten.clamp_max,
               kinds="c")
refused_dtypes(aten.clamp, kinds="bc")  # (clamp of bools by numbers computes; by bool tensors: NotImplementedError)

elementwise(aten.floor, prims.floor)(_rounding(jnp.floor))
elementwise(aten.ceil, prims.ceil)(_rounding(jnp.ceil))
elementwise(aten.trunc, prims.trunc)(_rounding(jnp.trunc))
elementwise(prims.round)(_rounding(jnp.round))


@elementwise(aten.round)
def round_decimals(x, *, decimals=0):
    if _is_int(x):
        if decimals:
            raise NotImplementedError(f'"round_cpu" not implemented for \'{scalar_type_name(x.dtype)}\'')
        return x
    if decimals == 0:
        return jnp.round(x)  # round half to even, as torch's nearbyint
    scale = np.array(10.0 ** abs(decimals), x.dtype)
    return jnp.round(x / scale) * scale if decimals < 0 else jnp.round(x * scale) / scale


@elementwise(aten.frac)
def frac(x):
    return x - jnp.trunc(x)


# -- arithmetic ----------------------------------------------------------------


def _alpha(alpha, x, y, name):
    # a traced alpha (an array: t.item() under jit) is never known to be 1
    if not hasattr(alpha, "dtype") and alpha == 1:
        return y
    if _is_int(x) and isinstance(alpha, float):
        raise OpError(
            f"torch2jax: {name}: For integral input tensors, argument alpha must not be a floating point number."
        )
    if _is_bool(x) and not isinstance(alpha, bool):
        raise OpError(f"torch2jax: {name}: Boolean alpha only supported for Boolean results.")
    return as_dtype(checked_scalar(alpha, x.dtype), x.dtype) * y


@elementwise(aten.add, prims.add)
def add(x, y, alpha=1):
    y = _alpha(alpha, x, y, "add")
    return jnp.logical_or(x, y) if _is_bool(x) else x + y


def _cpu_operand(a):
    """``a`` for a run of torch's CPU kernel that only checks dtypes: a tensor's one-element stand-in,
    0-dim for a 0-dim tensor (which torch's checks can exempt: lerp takes a 0-dim weight of any dtype)."""
    return torch.zeros((1,) * min(a.dim(), 1), dtype=a.dtype) if isinstance(a, torch.Tensor) else a


@warning(aten.sub, aten.sub_, aten.rsub)
def _no_bool_subtraction(func, args, kwargs):
    """torch's check that no operand of a subtraction is a bool (a mask is inverted with ``~``), made
    on torch's operands: the lowering sees them promoted."""
    if any(a.dtype == torch.bool if isinstance(a, torch.Tensor) else type(a) is bool for a in args[:2]):
        raise_as_torch(torch.rsub if func.overloadpacket is aten.rsub else torch.sub, *map(_cpu_operand, args[:2]))


@elementwise(aten.sub, prims.sub)
def sub(x, y, alpha=1):
    return x - _alpha(alpha, x, y, "sub")


@elementwise(aten.rsub)
def rsub(x, y, alpha=1):
    return y - _alpha(alpha, x, x, "rsub")


@elementwise(aten.mul, prims.mul, round_scalars="first")
def mul(x, y):
    return jnp.logical_and(x, y) if _is_bool(x) else x * y


def _trunc_div(a, b):
    if _is_int(a):
        _check_divisor(b)
        return lax.div(*jnp.broadcast_arrays(a, b))
    if a.dtype in (jnp.float16, jnp.bfloat16):
        quotient = true_divide(a.astype(np.float32), b.astype(np.float32))
        if jnp.ndim(b) == 0:  # torch CPU's scalar-divisor kernel truncates the float32 quotient
            return jnp.trunc(quotient).astype(a.dtype)
        # the tensor kernel rounds the quotient to the half type before truncating
        return jnp.trunc(quotient.astype(a.dtype))
    return jnp.trunc(true_divide(a, b))


def _floor_div(a, b):
    if _is_int(a):
        _check_divisor(b)
        return jnp.floor_divide(a, b)
    # torch's div_floor_floating: the floor of the exact quotient, computed through fmod.
    mod = jnp.fmod(a, b)
    div = true_divide(a - mod, b)
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floor = jnp.floor(div)
    floor = jnp.where(div - floor > 0.5, floor + 1, floor)
    quotient = true_divide(a, b)
    out = jnp.where(div != 0, floor, jnp.copysign(jnp.zeros_like(div), quotient))
    return jnp.where(b == 0, quotient, out)


@elementwise(aten.div.Tensor, aten.div.Scalar, aten.true_divide, promote_kind="int_to_float", round_scalars="first")
def div(a, b):
    return true_divide(a, b)


_div_trunc = elementwise(opmath=False)(_trunc_div)
floor_divide = elementwise(aten.floor_divide, round_scalars="first")(_floor_div)


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return div(a, b)
    if rounding_mode == "trunc":
        return _div_trunc(a, b)
    if rounding_mode == "floor":
        return floor_divide(a, b)
    raise OpError(
        f"torch2jax: div expected rounding_mode to be one of None, 'trunc', or 'floor' but found '{rounding_mode}'"
    )


@elementwise(prims.div)
def prims_div(a, b):
    return _trunc_div(a, b) if _is_int(a) else true_divide(a, b)


@elementwise(aten.remainder, prims.remainder)
def remainder(a, b):
    if _is_int(a):
        _check_divisor(b)
        return jnp.remainder(a, b)
    mod = jnp.fmod(a, b)
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@elementwise(aten.fmod, prims.fmod)
def fmod(a, b):
    if _is_int(a):
        _check_divisor(b)
    return jnp.fmod(a, b)


@warning(aten.pow, aten.pow_)
def _no_negative_integer_exponent(func, args, kwargs):
    """torch's refusal of an integer tensor to a negative Python-integer power, made on the Python
    number: the lowering sees it converted to the tensor's dtype (-1 is 255 in uint8)."""
    x, e = args[:2]
    if isinstance(x, torch.Tensor) and not x.dtype.is_floating_point and not x.dtype.is_complex and (
            x.dtype != torch.bool and type(e) is int and e < 0):
        raise RuntimeError("Integers to negative integer powers are not allowed.")


def _power_by_squaring(x, e):
    """``x ** e`` for integer arrays, ``e >= 0``, wrapping in ``x``'s dtype as torch's kernel:
    one square-and-multiply step per bit of ``e`` (jnp.power goes wrong from the exponent's top
    bit on: 2 ** uint8(128) gives 1)."""
    x, e = jnp.broadcast_arrays(x, e)
    result, base = jnp.ones_like(x), x
    for bit in range(e.dtype.itemsize * 8):
        result = jnp.where((e >> bit) & 1 == 1, result * base, result)
        base = base * base
    return result


def _int_pow(x, e):
    """Exact integer power; a negative exponent gives 1 / x**-e truncated toward zero, as torch."""
    if _is_bool(x):
        return x | (e == 0)
    positive = _power_by_squaring(x, jnp.maximum(e, 0))
    one = jnp.ones((), x.dtype)
    inverse = jnp.where(x == 1, one, jnp.where(x == -1, jnp.where(e % 2 == 0, one, -one), jnp.zeros((), x.dtype)))
    return jnp.where(e < 0, inverse, positive)


@elementwise(aten.pow, prims.pow, checked=(1,))
def power(x, e):
    if isinstance(e, np.ndarray) and e.ndim == 0 and not _is_bool(x):  # a Python-number exponent
        v = e.item()
        if _is_int(x):
            if v < 0:
                raise RuntimeError("Integers to negative integer powers are not allowed.")
            return lax.integer_pow(x, v) if v < 2**31 else jnp.power(x, e)
        if v == 0.5 and not _is_complex(x):
            return jnp.sqrt(x)
        if v == -0.5 and not _is_complex(x):
            return lax.rsqrt(x)
        if v in (-2, -1, 2, 3):
            return lax.integer_pow(x, int(v.real))
    if _is_int(x):
        return _int_pow(x, e)
    return _float_pow(x, e)


def _pow_slopes(x, e):
    # torch's: 0 for a zero exponent (JAX's e * x ** (e - 1) is NaN at 0 ** 0), and for the exponent 0
    # where the base is 0 and the exponent's real part is not negative (JAX's x ** e * log(x) is NaN there)
    zero = jnp.zeros((), x.dtype)
    base = jnp.where(e == 0, zero, e * jnp.power(x, e - 1))
    exponent = jnp.where((x == 0) & (jnp.real(e) >= 0), zero, jnp.power(x, e) * jnp.log(x))
    return base, exponent


_float_pow = torch_slopes(jnp.power, _pow_slopes)


@register(aten.float_power)
def float_power(x, e):
    """Always computed in double (complex double when either operand is complex)."""
    dt = np.dtype(np.complex128) if _dt.is_complex(_dt.result_type(x, e)) else np.dtype(np.float64)
    return jnp.power(as_dtype(x, dt), as_dtype(e, dt))


@elementwise(aten.atan2, prims.atan2, promote_kind="int_to_float")
def atan2(a, b):
    return _atan2(a, b)


def _atan2_slopes(a, b):
    # torch's b / (a² + b²) and -a / (a² + b²), but 0 at the origin (JAX's are NaN there)
    origin, recip = (a == 0) & (b == 0), 1 / (a * a + b * b)
    zero = jnp.zeros((), a.dtype)
    return jnp.where(origin, zero, b * recip), jnp.where(origin, zero, -a * recip)


_atan2 = torch_slopes(jnp.arctan2, _atan2_slopes)


@elementwise(aten.hypot, prims.hypot)
def hypot(a, b):
    return jnp.hypot(a, b)


@elementwise(aten.copysign, promote_kind="int_to_float")
def copysign(a, b):
    return _copysign(a, b)


def _copysign_slopes(a, b):
    # torch's: ±1 but 0 where a is 0; zeros (a gradient, not None) for b, whose sign JAX reads as a boolean
    zero = jnp.zeros((), a.dtype)
    return jnp.where(a == 0, zero, jnp.copysign(jnp.ones((), a.dtype), a) * jnp.copysign(jnp.ones((), a.dtype), b)), \
        jnp.zeros_like(b)


_copysign = torch_slopes(jnp.copysign, _copysign_slopes)


@elementwise(aten.nextafter, prims.nextafter, opmath=False)
def nextafter(a, b):
    return jnp.nextafter(a, b)


@elementwise(aten.xlogy, promote_kind="int_to_float", opmath=False)  # (torch: log rounded to bf16 / fp16, then the product)
def xlogy(x, y):
    return _xlogy(x, y)


def _xlogy_value(x, y):
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros((), x.dtype), x * jnp.log(y)))


def _xlogy_slopes(x, y):
    # torch's: log(y) but 0 where x = 0 and y <= 0, and x / y (a where over x * log(y) gave NaN at x = y = 0)
    return jnp.where((x == 0) & (y <= 0), jnp.zeros((), y.dtype), jnp.log(y)), x / y


_xlogy = torch_slopes(_xlogy_value, _xlogy_slopes)


@elementwise(aten.logaddexp, promote_kind="int_to_float")
def logaddexp(a, b):
    if _is_complex(a):
        m = jnp.where(a.real >= b.real, a, b)
        return m + jnp.log1p(jnp.exp(-jnp.where(a.real >= b.real, a - b, b - a)))
    return jnp.logaddexp(a, b)


@elementwise(aten.logaddexp2, promote_kind="int_to_float")
def logaddexp2(a, b):
    return jnp.logaddexp2(a, b)


@warning(aten.lerp, aten.lerp_)
def _lerp_dtypes(func, args, kwargs):
    """torch's check that ``end`` (and a tensor ``weight``) have ``start``'s dtype: lerp does not promote."""
    if any(isinstance(a, torch.Tensor) and a.dtype != args[0].dtype for a in args[1:3]):
        raise_as_torch(torch.lerp, *map(_cpu_operand, args[:3]))


@elementwise(aten.lerp, round_scalars="tensors")  # torch keeps a Scalar weight in float32, casts a 0-dim tensor
def lerp(start, end, weight):
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


@elementwise(aten.addcmul)
def addcmul(x, t1, t2, *, value=1):
    return x + as_dtype(checked_scalar(value, x.dtype), x.dtype) * t1 * t2


def fma(a, b, c):
    """Inductor's ``prims.fma(a, b, c)``, ``a * b + c``: Dynamo's own rewrite of ``addcmul_`` /
    ``addcdiv_`` with a ``value`` and of ``add_`` with a tensor ``alpha`` (Adam's moments), so it
    reaches graphs compiled by the torch2jax backend. The op exists only once
    ``torch._inductor.inductor_prims`` is imported (seconds): `lower_inductor_prims` registers it then."""
    return a * b + c


def lower_inductor_prims() -> None:
    """Register `fma` as the lowering of ``prims.fma`` if Dynamo has defined the op by now."""
    op = getattr(prims, "fma", None) if "torch._inductor.inductor_prims" in sys.modules else None
    if op is not None and op.default not in LOWERINGS:
        elementwise(op)(fma)


@elementwise(aten.addcdiv)
def addcdiv(x, t1, t2, *, value=1):
    if _is_int(t1) and _is_int(t2):
        raise TorchRuntimeError(
            "Integer division with addcdiv is no longer supported, and in a future  release addcdiv will perform "
            "a true division of tensor1 and tensor2. The historic addcdiv behavior can be implemented as "
            "(input + value * torch.trunc(tensor1 / tensor2)).to(input.dtype) for integer inputs and as "
            "(input + value * tensor1 / tensor2) for float inputs. The future addcdiv behavior is just the latter "
            "implementation: (input + value * tensor1 / tensor2), for all dtypes.")
    return x + as_dtype(checked_scalar(value, x.dtype), x.dtype) * t1 / t2


@register(aten.heaviside)
def heaviside(x, values):
    if x.dtype != values.dtype:
        raise OpError("torch2jax: heaviside is not yet implemented for tensors with different dtypes.")
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TorchRuntimeError("heaviside is not yet implemented for complex tensors.")
    return jnp.where(x == 0, values, (x > 0).astype(x.dtype))


def _gcd(a, b):
    """torch's Euclid loop (calc_gcd): on |a| and |b| with C's remainder, so that the most
    negative value, whose absolute value wraps to itself, ends as on the CPU (gcd(-128, 6) is
    -2 in int8); jnp.gcd loops forever on it."""
    a, b = jnp.broadcast_arrays(jnp.abs(a), jnp.abs(b))

    def body(carry):
        a, b = carry
        nonzero = a != 0
        return jnp.where(nonzero, lax.rem(b, jnp.where(nonzero, a, 1)), 0), jnp.where(nonzero, a, b)

    return lax.while_loop(lambda carry: jnp.any(carry[0] != 0), body, (a, b))[1]


@elementwise(aten.gcd, prims.gcd)
def gcd(a, b):
    return _gcd(a, b)


@elementwise(aten.lcm)
def lcm(a, b):
    # torch's kernel computes |a / g * b| in C's int for the narrow types, then narrows
    wide = a.dtype if a.dtype.itemsize >= 4 else jnp.dtype(jnp.int32)
    g = _gcd(a, b)
    quotient = lax.div(*jnp.broadcast_arrays(a, jnp.where(g == 0, 1, g)))
    out = jnp.abs(quotient.astype(wide) * b.astype(wide)).astype(a.dtype)
    return jnp.where(g == 0, jnp.zeros((), a.dtype), out)


@register(aten.frexp.Tensor, prims.frexp)
def frexp(x):
    mantissa, exponent = jnp.frexp(x.astype(np.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x)
    return mantissa.astype(x.dtype), exponent.astype(np.int32)


# -- clamping, min / max -------------------------------------------------------


@register(aten.clamp, aten.clip)
def clamp(x, min=None, max=None):  # noqa: A002 - torch's argument names
    if min is None and max is None:
        raise OpError("torch2jax: clamp: At least one of 'min' or 'max' must not be None")
    bound_dtype = _result_of(x, min, max)
    (x, lo, hi), result = _promoted("default", x, checked_scalar(min, bound_dtype), checked_scalar(max, bound_dtype))
    _reject_complex("clamp", x)
    if _dt.is_floating(x.dtype):
        inf = np.asarray(np.inf, x.dtype)
        return _float_clamp(x, -inf if lo is None else lo, inf if hi is None else hi).astype(result)
    return _clamp(x, lo, hi).astype(result)


def _clamp(x, lo, hi):
    if lo is not None:
        x = jnp.maximum(x, lo)  # jnp.maximum / minimum propagate NaN, as torch's clamp
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


# torch's derivative passes the gradient at the bounds (jnp.maximum would halve it there)
_float_clamp = torch_slopes(_clamp, lambda x, lo, hi: ((x >= lo) & (x <= hi), x < lo, x > hi))


@register(aten.clamp_min)
def clamp_min(x, min):  # noqa: A002
    return clamp(x, min=min)


@register(aten.clamp_max)
def clamp_max(x, max):  # noqa: A002
    return clamp(x, max=max)


@elementwise(aten.maximum, prims.maximum)
def maximum(a, b):
    _reject_complex("maximum", a)
    return jnp.maximum(a, b)


@elementwise(aten.minimum, prims.minimum)
def minimum(a, b):
    _reject_complex("minimum", a)
    return jnp.minimum(a, b)


@elementwise(aten.fmax, prims.fmax)
def fmax(a, b):
    _reject_complex("fmax", a)
    return _fmax(a, b) if _dt.is_floating(a.dtype) else jnp.fmax(a, b)


@elementwise(aten.fmin, prims.fmin)
def fmin(a, b):
    _reject_complex("fmin", a)
    return _fmin(a, b) if _dt.is_floating(a.dtype) else jnp.fmin(a, b)


def _first_wins(keep):
    """torch's derivative of fmax / fmin: all of it to the first operand where it is kept (ties too)."""

    def slopes(a, b):
        first = keep(a, b) | jnp.isnan(b)
        return first, ~first

    return slopes


_fmax = torch_slopes(jnp.fmax, _first_wins(operator.ge))
_fmin = torch_slopes(jnp.fmin, _first_wins(operator.le))


# -- comparisons and logic -----------------------------------------------------


@elementwise(aten.eq, prims.eq, promote_kind="always_bool")
def eq(a, b):
    return a == b


@elementwise(aten.ne, prims.ne, promote_kind="always_bool")
def ne(a, b):
    return a != b


def _ordered(name, fn):
    def lowering(a, b):
        _reject_complex(name, a)
        return fn(a, b)

    return lowering


elementwise(aten.lt, prims.lt, promote_kind="always_bool")(_ordered("lt", jnp.less))
elementwise(aten.le, prims.le, promote_kind="always_bool")(_ordered("le", jnp.less_equal))
elementwise(aten.gt, prims.gt, promote_kind="always_bool")(_ordered("gt", jnp.greater))
elementwise(aten.ge, prims.ge, promote_kind="always_bool")(_ordered("ge", jnp.greater_equal))


def _truth(x):
    return x != 0 if hasattr(x, "dtype") else bool(x)


@register(aten.logical_and)
def logical_and(a, b):
    return jnp.logical_and(_truth(a), _truth(b))


@register(aten.logical_or)
def logical_or(a, b):
    return jnp.logical_or(_truth(a), _truth(b))


@register(aten.logical_xor)
def logical_xor(a, b):
    return jnp.logical_xor(_truth(a), _truth(b))


@register(aten.logical_not)
def logical_not(x):
    return x == 0


def _reject_float(name, x):
    """torch's own error (NotImplementedError, from its CPU kernel) for a floating operand of a bitwise op."""
    if not _is_int(x):
        z = stand_in(x.dtype, 1)
        raise_as_torch(getattr(torch, name), *((z,) if name == "bitwise_not" else (z, z)))
        raise OpError(
            f'torch2jax: "{name}" is only implemented for integer and bool tensors, got {_dt.to_torch(x.dtype)}'
        )


# (integer kernels only: torch's error names the operand's dtype, float16 too, which the lowering computes in float32)
refused_dtypes(aten.bitwise_and, aten.__and__, aten.bitwise_or, aten.__or__, aten.bitwise_xor, aten.__xor__,
               aten.bitwise_not, aten.bitwise_left_shift, aten.__lshift__, aten.bitwise_right_shift, aten.__rshift__,
               kinds="fc")


@elementwise(aten.bitwise_and, prims.bitwise_and, aten.__and__)
def bitwise_and(a, b):
    _reject_float("bitwise_and", a)
    return a & b


@elementwise(aten.bitwise_or, prims.bitwise_or, aten.__or__)
def bitwise_or(a, b):
    _reject_float("bitwise_or", a)
    return a | b


@elementwise(aten.bitwise_xor, prims.bitwise_xor, aten.__xor__)
def bitwise_xor(a, b):
    _reject_float("bitwise_xor", a)
    return a ^ b


@elementwise(aten.bitwise_not, prims.bitwise_not)
def bitwise_not(x):
    _reject_float("bitwise_not", x)
    return ~x


def _shift_out_of_range(x, s):
    bits = np.dtype(x.dtype).itemsize * 8
    signed = s.astype(np.dtype(f"int{bits}")) if _dt.is_integral(s.dtype) else s
    return (signed < 0) | (s >= bits), bits


@elementwise(aten.bitwise_left_shift, aten.__lshift__, prims.shift_left)
def bitwise_left_shift(x, s):
    """Shifts by a negative amount or by the bit width or more give 0, as torch."""
    _reject_float("bitwise_left_shift", x)
    out_of_range, _ = _shift_out_of_range(x, s)
    shifted = lax.shift_left(*jnp.broadcast_arrays(x, jnp.where(out_of_range, jnp.zeros((), s.dtype), s)))
    return jnp.where(out_of_range, jnp.zeros((), x.dtype), shifted)


@elementwise(aten.bitwise_right_shift, aten.__rshift__, prims.shift_right_arithmetic)
def bitwise_right_shift(x, s):
    """Arithmetic for signed, logical for unsigned; out-of-range shifts fill with the sign bit, as torch."""
    _reject_float("bitwise_right_shift", x)
    out_of_range, bits = _shift_out_of_range(x, s)
    s = jnp.where(out_of_range, np.array(bits - 1, s.dtype), s)
    if np.dtype(x.dtype).kind == "u":
        out = lax.shift_right_logical(*jnp.broadcast_arrays(x, s))
        return jnp.where(out_of_range, jnp.zeros((), x.dtype), out)
    return lax.shift_right_arithmetic(*jnp.broadcast_arrays(x, s))


# -- selection -----------------------------------------------------------------


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar, prims.where)
def where(condition, x, y):
    if condition.dtype != np.bool_:  # torch rejects other dtypes (uint8 with a warning only)
        raise_as_torch(torch.where, stand_in(condition.dtype), 0, 0)
    dtype = _dt.result_type(x, y)
    # (torch's kernel checks that a Python number fits an integral result; a float one overflows to inf)
    check = checked_scalar if _dt.is_integral(dtype) else lambda v, _: v
    return jnp.where(condition, as_dtype(check(x, dtype), dtype), as_dtype(check(y, dtype), dtype))


# -- floating-point classification ---------------------------------------------


@register(aten.isnan)
def isnan(x):
    return jnp.isnan(x) if not _is_int(x) else jnp.zeros(x.shape, bool)


@register(aten.isinf)
def isinf(x):
    return jnp.isinf(x) if not _is_int(x) else jnp.zeros(x.shape, bool)


@register(aten.isfinite, prims.isfinite)
def isfinite(x):
    return jnp.isfinite(x) if not _is_int(x) else jnp.ones(x.shape, bool)


@register(aten.isposinf)
def isposinf(x):
    _reject_complex("isposinf", x)
    return x == np.inf if not _is_int(x) else jnp.zeros(x.shape, bool)


@register(aten.isneginf)
def isneginf(x):
    _reject_complex("isneginf", x)
    return x == -np.inf if not _is_int(x) else jnp.zeros(x.shape, bool)


def _nan_to_num_real(x, nan, posinf, neginf):
    info = jnp.finfo(x.dtype)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    out = jnp.where(jnp.isnan(x), as_dtype(nan, x.dtype), x)
    out = jnp.where(x == np.inf, as_dtype(posinf, x.dtype), out)
    return jnp.where(x == -np.inf, as_dtype(neginf, x.dtype), out)


@register(aten.nan_to_num)
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    if _is_int(x):
        return x
    nan = 0.0 if nan is None else nan
    if _is_complex(x):
        return lax.complex(
            _nan_to_num_real(x.real, nan, posinf, neginf), _nan_to_num_real(x.imag, nan, posinf, neginf)
        )
    return _nan_to_num_real(x, nan, posinf, neginf)


@decomposition(aten.nan_to_num_.default)
def nan_to_num_(x, nan=None, posinf=None, neginf=None):
    """torch leaves an integer or bool tensor as it is: nothing is written (an expanded one is no error)."""
    if x.is_floating_point() or x.is_complex():
        x.copy_(torch.nan_to_num(x, nan, posinf, neginf))
    return x


# -- complex numbers -------------------------------------------------------------


@register(aten.conj_physical, aten._conj_physical, prims.conj_physical, prims.conj)
def conj_physical(x):
    return jnp.conj(x) if _is_complex(x) else x


@decomposition(aten.conj_physical_.default)
def conj_physical_(x):
    """torch leaves a real tensor as it is: nothing is written (an expanded one is no error)."""
    if x.is_complex():
        x.copy_(torch.conj_physical(x))
    return x


@view(aten._conj, inverse=lambda base, value: conj_physical(value))
def _conj(x):
    """``x.conj()``: a view, as in torch, whose values are computed conjugated (torch2jax
    tensors carry no conjugate bit); a write through it reaches ``x`` conjugated back."""
    return conj_physical(x)


@view(aten._neg_view, inverse=lambda base, value: jnp.negative(value))
def _neg_view(x):
    """The negated view torch makes in its complex formulas (``z.conj().imag``); its values are
    computed negated, as `_conj`'s are conjugated."""
    return jnp.negative(x)


@strides(aten.angle.default)
def angle_strides(args, kwargs, results):
    """torch's CPU kernel gives the angle of a complex tensor in row-major order whatever its
    layout (its meta kernel keeps the layout); a real tensor's keeps the layout, but for a
    contiguous one (TensorIterator's fast path) whatever the strides of its size-1 dimensions."""
    x = args[0]
    return (None if x.is_complex() or x.is_contiguous() else torch.empty_like(x, device="meta").stride(),)


@register(aten.angle)
def angle(x):
    if _is_complex(x):
        return jnp.angle(x)
    (x,), result = _promoted("int_to_float", x)
    out = jnp.where(jnp.isnan(x), x, jnp.where(x < 0, np.array(math.pi, x.dtype), np.array(0, x.dtype)))
    return out.astype(result)


def _check_complex_parts(part):
    if part.dtype == jnp.float16:
        raise _dt.Complex32Needed("torch2jax: complex parts in float16 make complex32, held as complex64")


def _check_parts_dtypes(op, a, b):
    """torch's check that the two parts are float16, float32 or float64 tensors of one dtype, in
    its words: from its kernel ``op`` on stand-ins of them."""
    if a.dtype != b.dtype or not _dt.is_floating(a.dtype) or a.dtype == jnp.bfloat16:
        raise_as_torch(op, stand_in(a.dtype), stand_in(b.dtype))


_COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}


@warning(aten.complex.out, aten.polar.out)
def _check_complex_out(func, args, kwargs):
    """torch's out= of complex / polar must be of the parts' complex dtype, where a result is
    otherwise cast into out (checked with the parts' dtypes, as torch does, from its kernel on
    stand-ins)."""
    a, b, out = args[0], args[1], kwargs["out"]
    if a.dtype != b.dtype or out.dtype != _COMPLEX_OF.get(a.dtype):
        op = torch.complex if func.overloadpacket is aten.complex else torch.polar
        raise_as_torch(lambda x, y: op(x, y, out=torch.empty(0, dtype=out.dtype)),
                       torch.empty(0, dtype=a.dtype), torch.empty(0, dtype=b.dtype))


refused_dtypes(aten.polar, kinds="bic", dtypes=HALF_DTYPES)  # (torch's CPU kernel: float32 / float64 only)


@register(aten.polar)
def polar(magnitude, phase):
    _check_parts_dtypes(torch.polar, magnitude, phase)
    _check_complex_parts(magnitude)
    return lax.complex(*jnp.broadcast_arrays(magnitude * jnp.cos(phase), magnitude * jnp.sin(phase)))


@register(aten.complex)
def complex_from_parts(real, imag):
    _check_parts_dtypes(torch.complex, real, imag)
    _check_complex_parts(real)
    return lax.complex(*jnp.broadcast_arrays(real, imag))


# -- dtype conversion ------------------------------------------------------------


@register(prims.convert_element_type)
def convert_element_type(x, dtype):
    return cast(x, _dt.to_jax(dtype))
