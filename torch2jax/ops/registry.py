"""The op registry: one table keyed by `torch._ops.OpOverload` (DESIGN.md, decision 3).

A lowering is a plain function over `jax.Array`s and Python values that returns
arrays with exactly the dtypes and shapes torch would. It is registered by a
decorator placed right above it::

    @register(aten.neg)                     # every overload of aten.neg
    def neg(x):
        return -x

`elementwise` adds torch's type promotion (and opmath: bf16/fp16 computed in
float32) so the function body only sees operands of one dtype. View ops are
registered with `view`, which pairs the forward function with its inverse
(how a write to the view lands in its base).
"""

from __future__ import annotations

import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from .. import env as _env
from .. import symbolic as _sym

LOWERINGS: dict = {}
VIEWS: dict = {}
DECOMPOSITIONS: dict = {}
WARNINGS: dict = {}
STRIDES: dict = {}
LAYOUT_KEYWORDS: dict = {}


def _overloads(op):
    if isinstance(op, torch._ops.OpOverloadPacket):
        # In-place and out= overloads are served by dispatch from the functional one.
        overloads = [getattr(op, name) for name in op.overloads()]
        return [o for o in overloads if not o._schema.is_mutable]
    return [op]


def _into(table, ops):
    """A decorator putting its function into ``table`` under every overload of ``ops``."""

    def deco(fn):
        for op in ops:
            for overload in _overloads(op):
                table[overload] = fn
        return fn

    return deco


def register(*ops):
    """Register the decorated function as the lowering of ``ops``.

    An `OpOverloadPacket` (``aten.add``) stands for all of its overloads.
    """
    return _into(LOWERINGS, ops)


def strides(*ops):
    """Register the decorated ``fn(args, kwargs, results)`` as the strides torch's CPU kernels give the
    results of ``ops`` (a tuple, None for row-major) where no meta kernel can tell: their
    shapes depend on the values (nonzero's column-major indices)."""
    return _into(STRIDES, ops)


def layout_keywords(*ops):
    """Register the decorated ``fn(args, kwargs)``, on torch's arguments (tensors, not arrays),
    as keyword arguments to add to the lowering of ``ops`` where what a kernel computes depends
    on its operands' layout, which the arrays do not show (torch's det factors ``A^T`` of a
    contiguous real ``A``, and its derivative formulas rely on it)."""
    return _into(LAYOUT_KEYWORDS, ops)


def warning(*ops):
    """Register the decorated ``fn(func, args, kwargs)`` to run before every call of ``ops``,
    on torch's arguments (tensors, not arrays): for torch's warnings, which a lowering would
    give only when a compiled call of it is traced, and for its checks of the operands'
    dtypes before promotion."""

    def deco(fn):
        for op in ops:
            for overload in _overloads(op):
                earlier = WARNINGS.get(overload)
                WARNINGS[overload] = fn if earlier is None else _both(earlier, fn)
        return fn

    return deco


_KIND = {torch.bool: "b"}


def _dtype_kind(dtype) -> str:
    """"b" bool, "c" complex, "i" integer, "f" floating."""
    kind = _KIND.get(dtype)
    if kind is None:
        kind = _KIND[dtype] = "c" if dtype.is_complex else "f" if dtype.is_floating_point else "i"
    return kind


# Ops whose lowerings always run op by op in eager mode, never as one compiled call (`dispatch._jittable`)
OP_BY_OP: set = set()


def op_by_op(*ops):
    """Keep ``ops``' lowerings op by op in eager mode: where XLA's fusion of a whole lowering may round
    float16 steps otherwise than torch's kernel, which rounds them one by one (a multiply and an add
    contracted into one fused multiply-add, steps computed in float32), and the result is a
    discontinuous function of them (grid sampling picks other pixels)."""
    for op in ops:
        OP_BY_OP.update(_overloads(op))


# every dtype torch has (the quantized and bit ones are "i")
_ALL_DTYPES = frozenset(v for v in vars(torch).values() if isinstance(v, torch.dtype))
HALF_DTYPES = (torch.float16, torch.bfloat16)


def refused_dtypes(*ops, kinds: str = "", dtypes=(), operands=None):
    """Register a check that ``ops`` refuse operands of the dtype ``kinds`` ("b" bool, "c" complex,
    "i" integer, "f" floating) or of ``dtypes`` (where a kind is too coarse: `HALF_DTYPES`) as
    torch's CPU kernels do where the lowering would compute them (``round`` of a bool tensor,
    ``hypot`` of integers: NotImplementedError): torch's kernel runs on stand-ins of the operands
    and its error is raised where it is one of dtypes (else the lowering computes: a mixed call
    torch promotes). ``operands``: how many leading positional arguments to look at, where the
    others have dtypes of their own (indices, targets), so that no call pays for them; all by
    default. Only calls with such an operand pay for more than a set lookup."""
    refused = frozenset(d for d in _ALL_DTYPES if _dtype_kind(d) in kinds) | frozenset(dtypes)

    def check(func, args, kwargs):
        for a in args[:operands]:
            if isinstance(a, torch.Tensor) and a.dtype in refused:
                return _raise_refused(func, args, kwargs)
        if operands is None and kwargs:
            for a in kwargs.values():
                if isinstance(a, torch.Tensor) and a.dtype in refused:
                    return _raise_refused(func, args, kwargs)

    return warning(*ops)(check)


def _raise_refused(func, args, kwargs):
    from ..dispatch import raise_cpu_dtype_error

    raise_cpu_dtype_error(func, args, kwargs)


def _both(first, second):
    def both(func, args, kwargs):
        first(func, args, kwargs)
        second(func, args, kwargs)

    return both


def view(*ops, inverse):
    """Register a view op: ``fn(x, *args)`` gives the view, ``inverse(base, value, *args)``
    the new base after ``value`` is written into the view."""

    def deco(fn):
        for op in ops:
            for overload in _overloads(op):
                VIEWS[overload] = (fn, inverse)
        return fn

    return deco


def decomposition(*ops):
    """Register a decomposition of ``ops``: a function over torch tensors (not arrays)
    that calls other ATen ops, used in place of torch's own decomposition. For ops
    that mutate tensors a lowering cannot reach (batch norm's running statistics)."""

    def deco(fn):
        for op in ops:
            for overload in _overloads(op):
                DECOMPOSITIONS[overload] = fn
        return fn

    return deco


_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def torch_slopes(value, slopes):
    """``value`` (a function of arrays) differentiated by JAX as torch differentiates it.

    ``slopes(*args)`` gives, per argument, the derivative of each element of the result with respect to that
    argument (broadcast against the result; None for one without), with torch's choices at kinks (relu'(0) = 0,
    a clamp passing the gradient at its bounds, fmax's tie to its first operand): jax.grad / jax.vjp of a
    lowering (a jitted forward differentiated outside, ``call_torch`` under jax.grad, make_train_step) then
    give torch's gradients. The slopes must be finite wherever torch's gradient is (a zero cotangent times an
    infinite slope is NaN); an argument that is not differentiated (a zero tangent) adds nothing, whatever
    its slope (``x ** e``'s slope for ``e``, log(x), is NaN for a negative ``x``).

    >>> relu = torch_slopes(lambda x: jnp.maximum(x, 0), lambda x: (x > 0,))
    >>> jax.grad(relu)(0.0)
    Array(0., dtype=float32, weak_type=True)
    """
    f = jax.custom_jvp(value)

    def jvp(primals, tangents):
        out = value(*primals)
        total = jnp.zeros(out.shape, out.dtype)
        for slope, t in zip(slopes(*primals), tangents):
            if slope is not None and type(t) is not jax.custom_derivatives.SymbolicZero:
                total = total + (slope * t).astype(out.dtype)
        return out, total

    f.defjvp(jvp, symbolic_zeros=True)
    return f


# |x| of a real array with torch's derivative, sign(x): 0 at 0, where JAX's is 1
float_abs = torch_slopes(jnp.abs, lambda x: (jnp.sign(x),))


def root_zero_slope(v, p=2):
    """``v ** (1 / p)`` (``sqrt`` for 2) whose JAX derivative is 0 where ``v`` is 0 (torch's for std, norms
    and distances of constant or zero data; the root's infinite slope there would make every gradient
    through it NaN)."""
    zero = v == 0
    safe = jnp.where(zero, jnp.ones((), v.dtype), v)
    return jnp.where(zero, jnp.zeros((), v.dtype), jnp.sqrt(safe) if p == 2 else safe ** (1.0 / p))


def _is_operand(a):
    return hasattr(a, "dtype") or isinstance(a, (bool, int, float, complex))


def true_divide(a, b):
    """``a / b``, correctly rounded as torch computes it, also for a scalar ``b``.

    XLA rewrites a division by a broadcast scalar, constant or not, into a multiplication
    by its reciprocal, which can miss the correctly rounded quotient by one unit in the
    last place (49.0 / 49.0 -> 0.9999999999999999 in float64), so a truncating, flooring
    or integer-converting division after it is off by one. A divisor that is not a
    broadcast (``b - 0.0 * iota``: ``b`` itself, signed zeros, infinities and NaN
    included) keeps XLA's divide; it fuses into the same loop, so costs no memory.

    >>> jax.jit(lambda x: true_divide(x, 49.0))(jnp.float64(49.0) * jnp.arange(1, 4))
    Array([1., 2., 3.], dtype=float64)
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    # (a complex divisor too: the reciprocal of a complex zero is nan, where the quotient is infinite)
    if (b.shape != shape or not shape) and jnp.issubdtype(b.dtype, jnp.inexact):
        # along the longest dimension: an iota of length 1 is a known zero. A quotient of
        # one element (a constant 0-d divisor is rewritten too) hides it behind a barrier.
        full = shape or (1,)
        static = [d if isinstance(d, (int, np.integer)) else 0 for d in full]
        # (a symbolic dimension of an export with dynamic shapes cannot be compared: one is
        # taken where every static dimension is 1)
        axis = int(np.argmax(static)) if max(static) > 1 or len(static) == full.count(1) else static.index(0)
        real = jnp.finfo(b.dtype).dtype  # (the iota of a complex divisor is real)
        iota = jax.lax.broadcasted_iota(real, full, axis)
        if static[axis] == 1:
            iota = jax.lax.optimization_barrier(iota)
        b = b - (jnp.zeros((), real) * iota).astype(b.dtype)
        return (a / b).reshape(shape)
    return a / b


def cast(x, dtype):
    """Array ``x`` converted to ``dtype`` as torch's CPU kernels convert.

    Complex to real keeps the real part; to bool, any nonzero part is True. Float8 e4m3fn
    saturates at its largest finite value, 448. Float to integer truncates toward zero through
    int32 (int64 for 64-bit types and uint32; uint64 also takes [2**63, 2**64)): a value out
    of that range, or NaN, becomes its minimum, and
    narrower types keep the low bits (300.0 -> uint8 44, -1.0 -> uint8 255, 1e10 -> int32
    -2147483648), where XLA's conversion would saturate.

    >>> cast(jnp.array([300.0, -1.0]), np.uint8)
    Array([ 44, 255], dtype=uint8)
    """
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    if dtype == np.bool_:  # nonzero, the imaginary part included
        return x != 0
    if jnp.issubdtype(x.dtype, jnp.complexfloating) and not jnp.issubdtype(dtype, jnp.complexfloating):
        x = jnp.real(x)
    if dtype == _FLOAT8_E4M3FN and jnp.issubdtype(x.dtype, jnp.floating):
        # torch saturates to the largest finite value (448), infinities too; XLA gives NaN past it
        x = jnp.where(jnp.isnan(x), x, jnp.clip(x, -448.0, 448.0))
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.integer):
        # uint32 goes through int64 (3e9 stays 3e9; -1.0 wraps to 2**32 - 1), as torch's kernels cast
        wide = np.dtype(np.int64 if dtype.itemsize == 8 or dtype == np.uint32 else np.int32)
        info = np.iinfo(wide)
        t = jnp.trunc(x.astype(np.float32) if x.dtype.itemsize < 4 else x)  # bounds past float16's range
        # the bounds as floats of x's type: 2**31 and 2**63 are exact, so `<` excludes them
        inside = (t >= float(info.min)) & (t < -float(info.min))
        out = jnp.where(inside, t, 0).astype(wide)
        out = jnp.where(inside, out, jnp.asarray(info.min, wide))
        if dtype == np.uint64:  # [2**63, 2**64) converts directly, past int64's range
            high = (t >= 2.0 ** 63) & (t < 2.0 ** 64)
            upper = jnp.where(high, t - 2.0 ** 63, 0).astype(wide).astype(dtype) + np.uint64(2 ** 63)
            return jnp.where(high, upper, out.astype(dtype))
        x = out
    return _astype(x, dtype)


_FLOAT8_E4M3FN = np.dtype(jnp.float8_e4m3fn)


def _astype(x, dtype):
    """``x.astype(dtype)``; a boolean array becomes floats through a select: XLA rewrites a
    product with converted booleans, ``x * mask.float()``, into a select that loses ``x``'s
    NaN and infinity where the mask is False (torch gives ``nan * 0 = nan``)."""
    if x.dtype == np.bool_ and jnp.issubdtype(dtype, jnp.inexact):
        return jnp.where(x, jnp.ones((), dtype), jnp.zeros((), dtype))
    return x.astype(dtype)


def as_dtype(a, dtype):
    """``a`` (array or Python number) as an array of ``dtype``; numbers wrap like torch's casts."""
    if hasattr(a, "dtype"):
        return a if a.dtype == dtype else _astype(a, dtype)
    if np.dtype(dtype) == np.bool_:  # any nonzero number is True (0.5, 1j), not its truncation
        return np.array(a != 0)
    if isinstance(a, complex) and not _dt.is_complex(dtype):
        a = a.real
    if _dt.is_integral(dtype, include_bool=True) and isinstance(a, float):
        if np.isnan(a) or np.isinf(a):
            return np.array(a, np.float64).astype(dtype)
        a = int(a)
    if _dt.is_integral(dtype) and isinstance(a, int):
        return np.array(a & 0xFFFFFFFFFFFFFFFF, np.uint64).astype(dtype) if a < 0 or a > 2**63 - 1 else np.array(a, np.int64).astype(dtype)
    with np.errstate(over="ignore"):  # (a float beyond the dtype's range is inf, as in torch's casts)
        return np.array(a, dtype=dtype)


_C_TYPE_NAMES = {
    "int8": "int8_t", "uint8": "uint8_t", "int16": "int16_t", "int32": "int", "int64": "int64_t",
    "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "float16": "c10::Half", "bfloat16": "c10::BFloat16", "float32": "float", "float64": "double",
    "complex64": "c10::complex<float>", "complex128": "c10::complex<double>",
}


def traced_numbers_only(fn):
    """Mark ``fn`` as safe in a compiled lowering (see ``dispatch._jittable``) although it
    branches on tracers: its traced branch is taken only for a Python number that t2j.jit
    lifted to a program input, and a compiled lowering's numbers are static, never traced.

    >>> @traced_numbers_only
    ... def checked_scalar(value, dtype): ...
    """
    fn.traced_numbers_only = True
    return fn


@traced_numbers_only
def checked_scalar(value, dtype):
    """``value`` itself, after torch's check (c10::checked_convert) that the Python number
    fits ``dtype``, which the kernels taking a Scalar make (fill_, full, masked_fill, clamp,
    scalar_tensor behind ``x[i] = v``...): a float NaN or infinity never fits an integer
    type, an imaginary part never fits a real type, a finite value must be in range (an
    unsigned type also takes negatives down to minus its maximum, wrapping them).

    >>> checked_scalar(1000, np.dtype(np.int8))
    RuntimeError: value cannot be converted to type int8_t without overflow
    """
    if isinstance(value, jax.core.Tracer) and np.dtype(dtype) != np.bool_:
        # a number the program takes as an input (t2j.jit lifts one that changes): checked when the program
        # runs, as the values `check_values` checks (under check_indices="always")
        check_values(value, lambda v: overflows(v, dtype), lambda _: overflow_error(dtype))
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, complex)):
        return value
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return value
    real = value
    if isinstance(value, complex):
        if not _dt.is_complex(dtype):
            if value.imag != 0:
                _overflow(dtype)
            real = value.real
        else:
            _check_range(value.real, _dt.real_of(dtype), dtype)
            _check_range(value.imag, _dt.real_of(dtype), dtype)
            return value
    _check_range(real, dtype, dtype)
    return value


def _check_range(v, dtype, named):
    if _dt.is_integral(dtype):
        if isinstance(v, float) and not math.isfinite(v):
            _overflow(named)
        info = np.iinfo(dtype)
        # an unsigned type takes a negative int (wrapping it), not a negative float
        lowest = -int(info.max) if info.min == 0 and isinstance(v, int) else int(info.min)
        if v < lowest or v > info.max:
            _overflow(named)
    elif math.isfinite(v) and abs(v) > float(jnp.finfo(dtype).max):
        _overflow(named)


def _overflow(dtype):
    raise overflow_error(dtype)


def overflow_error(dtype) -> RuntimeError:
    return RuntimeError(f"value cannot be converted to type {_C_TYPE_NAMES.get(np.dtype(dtype).name, dtype)} "
                        "without overflow")


def overflows(values, dtype):
    """Elementwise, whether ``values`` (a NumPy or JAX array) do not fit ``dtype`` by the rule of
    `checked_scalar`: for a tensor's value that a kernel reads as a Scalar (masked_fill's), with
    `check_values`. Only array operators, so NumPy arrays are compared in their own dtypes."""
    if np.dtype(dtype) == np.bool_ or values.dtype == np.bool_:
        return np.zeros(np.shape(values), bool)
    if _dt.is_complex(values.dtype):
        if _dt.is_complex(dtype):
            part = _dt.real_of(dtype)
            return _out_of_range(values.real, part) | _out_of_range(values.imag, part)
        return (values.imag != 0) | _out_of_range(values.real, dtype)
    return _out_of_range(values, dtype)


def _out_of_range(v, dtype):
    if _dt.is_integral(dtype):
        info = np.iinfo(dtype)
        lowest = -int(info.max) if info.min == 0 else int(info.min)
        if _dt.is_integral(v.dtype):  # the bounds clipped to v's range, where they compare exactly
            own = np.iinfo(v.dtype)
            return (v < max(lowest, int(own.min))) | (v > min(int(info.max), int(own.max)))
        return ~((v >= float(lowest)) & (v <= float(info.max)))  # NaN and infinities too
    return (abs(v) > float(jnp.finfo(dtype).max)) & (abs(v) < np.inf)


def promote(kind: str, operands):
    """(compute dtype, result dtype) of an elementwise op under torch's promotion ``kind``.

    kind is one of "default", "int_to_float", "always_bool", "complex_to_float",
    "bool_to_long", "no_opmath" (as torch._prims_common.ELEMENTWISE_TYPE_PROMOTION_KIND).
    """
    dtype = _dt.result_type(*operands)
    if kind == "int_to_float" and _dt.is_integral(dtype, include_bool=True):
        dtype = _dt.default_float()
    elif kind == "bool_to_long" and dtype == np.bool_:
        dtype = np.dtype(np.int64)
    result = dtype
    if kind == "always_bool":
        result = np.dtype(np.bool_)
    elif kind == "complex_to_float":
        result = _dt.real_of(dtype)
    return dtype, result


def _scalar_like(a) -> bool:
    """A Python number (NumPy 0-d, as dispatch passes it) or a 0-dim tensor operand."""
    return isinstance(a, (bool, int, float, complex)) or getattr(a, "ndim", 1) == 0


def _is_tensor_scalar(a) -> bool:
    """A 0-dim tensor operand (an array, traced or not), not a Python number."""
    return isinstance(a, jax.Array) and a.ndim == 0


def elementwise(*ops, promote_kind: str = "default", opmath: bool = True, checked: tuple = (),
                round_scalars: bool | str = True):
    """Register an elementwise lowering with torch's type promotion.

    The leading positional array / number arguments are the operands: they are
    promoted to one dtype (float32 for bf16/fp16 when ``opmath``), the function
    runs, and its result is cast to torch's result dtype. The operands at the
    positions ``checked`` must fit the result dtype when they are Python numbers
    (`checked_scalar`), as the kernels taking them as a Scalar require. With bf16 / fp16
    operands, a number or 0-dim operand is first rounded to that dtype, as torch converts
    it to the common dtype (``round_scalars="first"``: only as the first operand, for kernels
    that read a second scalar operand's own value in float32, as mul and div do;
    ``"tensors"``: only 0-dim tensors, for kernels that read a number in float32, as lerp does).
    """

    def deco(fn):
        @functools.wraps(fn)
        def lowering(*args, **kwargs):
            n = 0
            while n < len(args) and _is_operand(args[n]):
                n += 1
            compute, result = promote(promote_kind, args[:n])
            for i in checked:
                if i < n:
                    checked_scalar(args[i], result)
            operands = args[:n]
            if compute in _HALF and round_scalars and n > 1 and not all(map(_scalar_like, operands)):
                last = 1 if round_scalars == "first" else n
                rounds = _is_tensor_scalar if round_scalars == "tensors" else _scalar_like
                operands = [as_dtype(a, compute) if i < last and rounds(a) else a for i, a in enumerate(operands)]
                if isinstance(kwargs.get("alpha"), (int, float)):  # add / sub's alpha too
                    kwargs = {**kwargs, "alpha": float(np.asarray(kwargs["alpha"], compute))}
            if opmath and compute in _HALF:
                compute = np.dtype(np.float32)
            operands = [as_dtype(a, compute) for a in operands]
            out = fn(*operands, *args[n:], **kwargs)
            return out if out.dtype == result else out.astype(result)

        lowering.compute = fn
        register(*ops)(lowering)
        return lowering

    return deco


def check_values(values, is_bad, error, with_position=False) -> None:
    """Raise ``error(v)`` for the first value ``v`` of ``values`` where ``is_bad`` (applied to
    the NumPy or JAX array of them) is true, as torch's kernels check the values they read
    (indices, class labels); ``error(position, v)`` ``with_position`` (in the flattened
    values). Follows ``check_indices``: in eager mode at once (one device sync), in a traced
    program when it runs (only under ``check_indices="always"``, see `torch2jax.Config`).

    >>> check_values(index, lambda i: (i < 0) | (i >= n), lambda i: IndexError(f"index {i} is out of bounds"))
    """
    deferred = getattr(_DEFERRED, "checks", None)
    mode = _env.config().check_indices
    if not (mode or deferred) or np.size(values) == 0:
        return
    if not isinstance(values, jax.core.Tracer):
        values = np.asarray(values)
    values = values.reshape(-1)
    bad = is_bad(values)
    if isinstance(bad, jax.core.Tracer):
        if deferred is not None:
            deferred.add(values, bad, error, with_position)
        elif mode == "always":
            first = jnp.argmax(bad)
            if with_position:
                _sym.check_when_run(jnp.any(bad), lambda pv: error(*pv),
                                    jnp.stack([first.astype(np.int64), jnp.asarray(values)[first].astype(np.int64)]))
            else:
                _sym.check_when_run(jnp.any(bad), error, jnp.asarray(values)[first])
        return
    bad = np.asarray(bad)
    if mode and bad.any():
        first = int(np.argmax(bad))
        raise error(first, values[first].item()) if with_position else error(values[first].item())


# `check_values` is not a reason to run a lowering op by op: a compiled eager call checks as the
# op-by-op run does (dispatch's `_Compiled` traces it under `deferred_checks`)
check_values.not_followed = True

_DEFERRED = threading.local()


class DeferredChecks:
    """The value checks (`check_values`) of a lowering traced into an eager op's program: the
    program returns, with its results, whether each check failed and the first offending element,
    and `raise_failed` raises the error of the first failed one after the program runs, as
    `check_values` raises it before the op-by-op run computes. The errors are made from the
    values only, so the Python closures the trace recorded stay right for every call."""

    __slots__ = ("errors", "arrays")

    def __init__(self):
        self.errors: list = []  # (error, with_position) per check, in trace order
        self.arrays: list = []  # (any bad, first bad position, its value) per check

    def add(self, values, bad, error, with_position):
        first = jnp.argmax(bad)
        self.errors.append((error, with_position))
        self.arrays.append((jnp.any(bad), first, jnp.asarray(values)[first]))

    def outputs(self):
        """The program's extra outputs: every check's flag in one array (one transfer per call),
        and each one's (position, value); None where the trace made no check."""
        if not self.arrays:
            return None
        return jnp.stack([a[0] for a in self.arrays]), tuple(a[1:] for a in self.arrays)

    def raise_failed(self, outputs) -> None:
        """Raise the first failed check's error, if any (under ``check_indices`` falsy: none)."""
        if outputs is None or not _env.config().check_indices:
            return
        failed, found = outputs
        failed = np.asarray(failed)
        if not failed.any():
            return
        i = int(np.argmax(failed))
        error, with_position = self.errors[i]
        first, value = found[i]
        value = np.asarray(value).item()
        raise error(int(first), value) if with_position else error(value)


class deferred_checks:
    """Trace a lowering with its `check_values` calls recorded in a `DeferredChecks` (the value
    of ``with``), not skipped as in a program `t2j.jit` traces.

    >>> with deferred_checks() as checks:
    ...     out = lowering(*tracers)
    """

    def __enter__(self) -> DeferredChecks:
        self.outer = getattr(_DEFERRED, "checks", None)
        _DEFERRED.checks = DeferredChecks()
        return _DEFERRED.checks

    def __exit__(self, *exc):
        _DEFERRED.checks = self.outer


def broadcast_error(shapes):
    """TensorIterator's message for operand shapes that do not broadcast (folded left to
    right, as it infers the shape), or None."""
    if not shapes:
        return None
    out = list(shapes[0])
    for shape in shapes[1:]:
        n = max(len(out), len(shape))
        a, b = [1] * (n - len(out)) + out, [1] * (n - len(shape)) + list(shape)
        for d in range(n - 1, -1, -1):
            if a[d] != b[d] and a[d] != 1 and b[d] != 1:
                return (f"The size of tensor a ({a[d]}) must match the size of tensor b ({b[d]}) at non-singleton "
                        f"dimension {d}")
        out = [x if y == 1 else y for x, y in zip(a, b)]
    return None


def broadcast_shapes(*shapes) -> tuple:
    """The shape ``shapes`` broadcast to, or TensorIterator's RuntimeError where they do not broadcast."""
    message = broadcast_error(shapes)
    if message is not None:
        raise RuntimeError(message)
    return jnp.broadcast_shapes(*shapes)


def scalar_type_name(dtype) -> str:
    """torch's C++ name of ``dtype`` (a JAX or torch dtype) in its messages: "Float", "Long"."""
    dtype = dtype if isinstance(dtype, torch.dtype) else _dt.to_torch(dtype)
    return torch.empty(0, dtype=dtype, device="cpu").type()[len("torch."):-len("Tensor")]


def _arg_reduction(reduce, x, axis=None, keepdims=False):
    flat = x.reshape(-1) if axis is None else x
    ax = 0 if axis is None else axis % x.ndim
    index_dtype = np.int32 if flat.shape[ax] < 2**31 else np.int64
    index = reduce(flat, ax, index_dtype).astype(np.int64)
    if keepdims:
        index = index.reshape((1,) * x.ndim) if axis is None else jnp.expand_dims(index, ax)
    return index


def argmax_index(x, axis=None, keepdims=False):
    """``jnp.argmax`` (NaN first, then the first maximum) as int64, its index computed as int32.

    ``lax.argmax`` lowers by tracing again under the x64 setting of the jit that lowers it: an
    int64 index traced in torch2jax's 64-bit mode inside a user's 32-bit ``jax.jit`` of torch
    code (`jax_view`) failed to lower. Widening an int32 index is an ordinary conversion.

    >>> argmax_index(jnp.array([[1.0, 3.0], [2.0, 0.0]]), axis=1)   # [1, 0], int64
    """
    return _arg_reduction(jax.lax.argmax, x, axis, keepdims)


def argmin_index(x, axis=None, keepdims=False):
    """``jnp.argmin`` as int64, computed as `argmax_index` is."""
    return _arg_reduction(jax.lax.argmin, x, axis, keepdims)


def canonical_dim(dim: int, ndim: int) -> int:
    """A dim in [0, ndim) from torch's possibly negative ``dim`` (a scalar counts as 1-d)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def canonical_dims(dims, ndim: int) -> tuple:
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(canonical_dim(d, ndim) for d in dims)


# id of an input of the `t2j.jit` trace running now -> (that tracer, the sharding of the array it stands for),
# for the inputs sharded across devices (`traced_shardings`)
_TRACED_SHARDINGS: dict = {}


# id of a value `placed_as` constrained in that trace -> (the value, its sharding)
_PLACED: dict = {}


def traced_shardings(shardings: dict):
    """Set the shardings of the inputs of the trace running now (``{id(tracer): (tracer, sharding)}``)."""
    global _TRACED_SHARDINGS
    _TRACED_SHARDINGS = shardings
    _PLACED.clear()


def placed_sharding(value):
    """The sharding `placed_as` gave ``value`` in the trace running now, if it did."""
    known = _PLACED.get(id(value))
    return known[1] if known is not None and known[0] is value else None


def placed_as(reference, value):
    """``value`` placed as the concrete array ``reference`` is where that is across devices or in
    host memory: the result of a ``*_like`` factory, or a value written in place into a storage
    holding ``reference`` (``p.normal_()``, the ``p.copy_(cpu_tensor)`` of ``load_state_dict``),
    stays sharded as a sharded parameter is, as a CUDA tensor's stays on its device. Inside a
    `t2j.jit` trace, a ``reference`` that is a sharded input of the program (``zeros_like(p)``: Adam's
    state made in the first step) constrains ``value`` to its sharding, where XLA would pick one."""
    if isinstance(reference, jax.core.Tracer):
        known = _TRACED_SHARDINGS.get(id(reference))
        if known is not None and known[0] is reference and isinstance(value, jax.core.Tracer) \
                and value.shape == reference.shape:
            value = jax.lax.with_sharding_constraint(value, known[1])
            _PLACED[id(value)] = (value, known[1])
        return value
    if isinstance(value, jax.core.Tracer) or not isinstance(value, jax.Array):
        return value
    sharding = reference.sharding
    if type(sharding) is jax.sharding.SingleDeviceSharding and sharding.memory_kind == "device" \
            or value.sharding == sharding:
        return value
    return jax.device_put(value, sharding)
