"""dtype mapping between torch and JAX, and torch's type-promotion rules.

torch is the specification: `result_type` reproduces `torch.result_type` for
arrays and Python scalars (dimensioned tensors, zero-dim tensors and Python
numbers form three priority tiers), without calling into torch on the hot path.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import torch

_TORCH_TO_JAX = {
    torch.bool: jnp.bool_,
    torch.uint8: jnp.uint8,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
    torch.float8_e4m3fnuz: jnp.float8_e4m3fnuz,
    torch.float8_e5m2fnuz: jnp.float8_e5m2fnuz,
}
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


class Complex32Needed(TypeError):
    """An op made or read complex32, which JAX lacks: the dispatcher runs it again on
    complex64 values rounded to complex32 (torch2jax/complex32.py)."""


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The JAX dtype of a torch dtype, e.g. ``to_jax(torch.bfloat16) -> bfloat16``."""
    try:
        return np.dtype(_TORCH_TO_JAX[dtype])
    except KeyError:
        if dtype is torch.complex32:
            raise Complex32Needed("torch2jax: complex32 is held as complex64 with float16 parts") from None
        raise TypeError(f"torch2jax: dtype {dtype} has no JAX equivalent") from None


def to_torch(dtype) -> torch.dtype:
    """The torch dtype of a JAX / NumPy dtype, e.g. ``to_torch(jnp.int64) -> torch.int64``."""
    try:
        return _JAX_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"torch2jax: JAX dtype {dtype} has no torch equivalent") from None


# Categories in increasing order: bool < integer < floating < complex.
_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3


def category(dtype) -> int:
    kind = np.dtype(dtype).kind
    if kind == "b":
        return _BOOL
    if kind in "iu":
        return _INT
    if kind == "c":
        return _COMPLEX
    return _FLOAT


def is_floating(dtype) -> bool:
    return category(dtype) == _FLOAT


def is_complex(dtype) -> bool:
    return category(dtype) == _COMPLEX


def is_integral(dtype, include_bool: bool = False) -> bool:
    c = category(dtype)
    return c == _INT or (include_bool and c == _BOOL)


def default_float() -> np.dtype:
    return to_jax(torch.get_default_dtype())


def default_complex() -> np.dtype:
    return np.dtype(jnp.complex128) if torch.get_default_dtype() == torch.float64 else np.dtype(jnp.complex64)


def complex_of(dtype) -> np.dtype:
    """The complex dtype whose parts have ``dtype`` (float32 -> complex64)."""
    d = np.dtype(dtype)
    if d == np.float64:
        return np.dtype(np.complex128)
    if category(d) == _COMPLEX:
        return d
    if d == np.float16:
        raise Complex32Needed("torch2jax: the complex dtype of float16 is complex32, held as complex64")
    return np.dtype(np.complex64)


def real_of(dtype) -> np.dtype:
    """The real dtype of a complex dtype's parts (complex64 -> float32); identity otherwise."""
    d = np.dtype(dtype)
    if d == np.complex128:
        return np.dtype(np.float64)
    if d == np.complex64:
        return np.dtype(np.float32)
    return d


@functools.lru_cache(maxsize=None)
def promote_types(a, b) -> np.dtype:
    """torch.promote_types on JAX dtypes."""
    return to_jax(torch.promote_types(to_torch(a), to_torch(b)))


def _scalar_dtype(x) -> np.dtype:
    if isinstance(x, bool):
        return np.dtype(np.bool_)
    if isinstance(x, int):
        return np.dtype(np.int64)
    if isinstance(x, float):
        return default_float()
    if isinstance(x, complex):
        return default_complex()
    raise TypeError(f"not a number: {x!r}")


@functools.lru_cache(maxsize=4096)
def _result_type_key(dims, zeros, scalars):
    def fold(dtypes):
        out = None
        for d in dtypes:
            out = d if out is None else promote_types(out, d)
        return out

    dim_r, zero_r, wrap_r = fold(dims), fold(zeros), fold(scalars)

    def combine(higher, lower):
        if higher is None:
            return lower
        if lower is None:
            return higher
        ch, cl = category(higher), category(lower)
        if ch == _COMPLEX:
            return higher
        if cl == _COMPLEX:
            return complex_of(higher) if ch == _FLOAT else lower
        if ch == _FLOAT:
            return higher
        if higher == np.dtype(np.bool_) or cl == _FLOAT:
            return promote_types(higher, lower)
        return higher

    return combine(dim_r, combine(zero_r, wrap_r))


_NUMBER_TYPES = (bool, int, float, complex)


def _weak_number_type(a):
    """The Python number type a weakly typed 0-d array stands for (a traced Python number,
    `symbolic.scalar_value_of`), else None."""
    if a.ndim or not getattr(a, "weak_type", False):
        return None
    c = category(a.dtype)
    return complex if c == _COMPLEX else float if c == _FLOAT else int


def weak_scalar_dtype(a):
    """The dtype torch gives a Python number, for a weakly typed 0-d array standing for one; else None."""
    number = _weak_number_type(a)
    return None if number is None else _scalar_dtype(number(0))


_result_type_memo: dict = {}


def result_type(*args) -> np.dtype:
    """torch.result_type over JAX arrays (ndim 0 = zero-dim tensor) and Python numbers.

    >>> result_type(jnp.zeros(3, jnp.int32), 2.5)
    dtype('float32')
    """
    key = tuple(
        type(a) if isinstance(a, _NUMBER_TYPES) else _weak_number_type(a) or (a.dtype, a.ndim == 0)
        for a in args if a is not None
    )
    key = (key, torch.get_default_dtype())
    out = _result_type_memo.get(key)
    if out is None:
        dims, zeros, scalars = [], [], []
        for a in args:
            if a is None:
                continue
            if isinstance(a, _NUMBER_TYPES):
                scalars.append(_scalar_dtype(a))
            elif (weak := weak_scalar_dtype(a)) is not None:
                scalars.append(weak)
            else:
                (zeros if np.ndim(a) == 0 else dims).append(np.dtype(a.dtype))
        out = _result_type_memo[key] = _result_type_key(tuple(dims), tuple(zeros), tuple(scalars))
    return out


def can_cast(src, dst) -> bool:
    """torch's rule for writing a result of dtype ``src`` into a tensor of dtype ``dst``."""
    cs, cd = category(src), category(dst)
    if cs == _COMPLEX and cd != _COMPLEX:
        return False
    if cs == _FLOAT and cd < _FLOAT:
        return False
    if cs != _BOOL and cd == _BOOL:
        return False
    return True


# torch's C++ names of its element types, which its error messages print ("long int", "c10::Half")
_C_TYPE_NAMES = {torch.uint8: "unsigned char", torch.int8: "signed char", torch.int16: "short int",
                 torch.int32: "int", torch.int64: "long int", torch.bool: "bool", torch.float16: "c10::Half",
                 torch.bfloat16: "c10::BFloat16", torch.float32: "float", torch.float64: "double",
                 torch.complex32: "c10::complex<c10::Half>", torch.complex64: "c10::complex<float>",
                 torch.complex128: "c10::complex<double>"}


def c_type_name(dtype) -> str:
    """The name torch's C++ errors give ``dtype`` (a torch or NumPy dtype).

    >>> c_type_name(torch.int64)
    'long int'
    """
    t = dtype if isinstance(dtype, torch.dtype) else to_torch(dtype)
    return _C_TYPE_NAMES.get(t, str(t).removeprefix("torch."))
