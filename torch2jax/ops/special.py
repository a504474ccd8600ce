"""Lowerings: special functions (``torch.special``) and the ``prims`` they decompose to.

Functions JAX lacks (Bessel J0 / J1) are computed here in float64: a power
series for small arguments, Hankel's asymptotic expansion for large ones.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch

from ..dispatch import OpError
from .elementwise import digamma
from .registry import elementwise, promote, register

aten = torch.ops.aten
prims = torch.ops.prims


def _float_operand(x):
    """``x`` as the float dtype torch computes in (ints -> default float; half -> float32), and torch's result dtype."""
    compute, result = promote("int_to_float", [x])
    if compute in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        compute = np.dtype(np.float32)
    return jnp.asarray(x, compute), result


# ATen name -> (prims name or None, function); integers are promoted to float.
_UNARY = {
    "i0": ("bessel_i0", jsp.i0),
    "special_i0e": ("bessel_i0e", jsp.i0e),
    "special_i1": ("bessel_i1", jsp.i1),
    "special_i1e": ("bessel_i1e", jsp.i1e),
    "special_modified_bessel_i0": (None, jsp.i0),
    "special_modified_bessel_i1": (None, jsp.i1),
    "special_ndtr": (None, jsp.ndtr),
    "special_ndtri": ("ndtri", jsp.ndtri),
}

for _aten_name, (_prim_name, _fn) in _UNARY.items():
    elementwise(getattr(aten, _aten_name), promote_kind="int_to_float")(_fn)
    if _prim_name is not None:
        elementwise(getattr(prims, _prim_name))(_fn)


@elementwise(aten.special_log_ndtr, promote_kind="int_to_float")
def special_log_ndtr(x):
    """log1p(-ndtr(-x)) for x > 0: jax.scipy.special.log_ndtr loses the upper tail (log of a value near 1)."""
    upper = jnp.log1p(-jsp.ndtr(-jnp.abs(x)))
    return jnp.where(x > 0, upper, jsp.log_ndtr(jnp.minimum(x, 0)))


@register(aten.special_erfcx, prims.erfcx)
def special_erfcx(x):
    """exp(x^2) erfc(x) in float64; an asymptotic series beyond x = 10, where erfc underflows.

    (jax.scipy.special.erfcx returns 0 for float32 x in [9.19, 9.42], where erfc underflows first.)
    """
    _, result = _float_operand(x)
    x = jnp.asarray(x, np.float64)
    large = x > 10
    small_x = jnp.where(large, 0.0, x)
    direct = jnp.exp(small_x * small_x) * jax.lax.erfc(small_x)
    large_x = jnp.where(large, x, 10.0)
    inv = 1 / (2 * large_x * large_x)
    series = jnp.ones_like(x)
    term = jnp.ones_like(x)
    for n in range(1, 16):
        term = -term * (2 * n - 1) * inv
        series = series + term
    asymptotic = series / (large_x * np.sqrt(np.pi))
    return jnp.where(large, asymptotic, direct).astype(result)


@elementwise(aten.special_entr, promote_kind="int_to_float")
def special_entr(x):
    safe = jnp.where(x > 0, x, 1)
    out = jnp.where(x > 0, -x * jnp.log(safe), jnp.where(x == 0, 0, -jnp.inf).astype(x.dtype))
    return jnp.where(jnp.isnan(x), x, out)


@elementwise(aten.sinc, promote_kind="int_to_float")
def sinc(x):
    px = np.pi * jnp.where(x == 0, 1, x).astype(x.dtype)
    return jnp.where(x == 0, jnp.ones((), x.dtype), jnp.sin(px) / px)


@elementwise(aten.special_spherical_bessel_j0, prims.spherical_bessel_j0, promote_kind="int_to_float")
def special_spherical_bessel_j0(x):
    """sin(x) / x, by its Taylor series near 0 where the quotient loses precision."""
    x2 = x * x
    series = 1 - x2 / 6 * (1 - x2 / 20 * (1 - x2 / 42 * (1 - x2 / 72 * (1 - x2 / 110 * (1 - x2 / 156)))))
    safe = jnp.where(jnp.abs(x) < 0.5, 1, x).astype(x.dtype)
    out = jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(safe) / safe)
    return jnp.where(jnp.isinf(x), jnp.zeros((), x.dtype), out)


@elementwise(aten.special_xlog1py, promote_kind="int_to_float")
def special_xlog1py(x, y):
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros((), x.dtype), x * jnp.log1p(y)))


def _shift_to_one(x, q):
    """(sum of (q + k)^-x for the k that bring q to >= 1, that q): zeta(x, q) = q^-x + zeta(x, q + 1).

    jax.scipy.special.zeta is inaccurate for q below about -8.
    """

    def below(carry):
        return jnp.any(carry[1] < 1)

    def step(carry):
        acc, q = carry
        low = q < 1
        return acc + jnp.where(low, jnp.power(q, -x), 0), jnp.where(low, q + 1, q)

    return jax.lax.while_loop(below, step, (jnp.zeros_like(q), q))


@elementwise(aten.special_zeta, prims.zeta, promote_kind="int_to_float")
def special_zeta(x, q):
    x, q = jnp.broadcast_arrays(x, q)
    pole = (q <= 0) & (q == jnp.floor(q))  # torch: inf at q = 0, -1, -2, ...
    acc, shifted = _shift_to_one(x, jnp.where(pole | ~jnp.isfinite(q), 1, q))
    out = jnp.where(jnp.isfinite(q), acc + jsp.zeta(x, shifted), jsp.zeta(x, q))
    out = jnp.where(pole, jnp.inf, out)
    return jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, out)).astype(x.dtype)


@elementwise(aten.igamma, prims.igamma, promote_kind="int_to_float")
def igamma(a, x):
    return jsp.gammainc(*jnp.broadcast_arrays(a, x))


@elementwise(aten.igammac, prims.igammac, promote_kind="int_to_float")
def igammac(a, x):
    return jsp.gammaincc(*jnp.broadcast_arrays(a, x))


def _trigamma(x):
    """As torch: reflection below 1/2, six recurrence steps, then the asymptotic series."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(np.pi * x)
    result = jnp.where(reflect, -(np.pi**2) / (sin_pi_x * sin_pi_x), 0)
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -result, result).astype(x.dtype)


@register(aten.polygamma)
def polygamma(n, x):
    if n < 0:
        raise OpError("torch2jax: polygamma(n, x) does not support negative n.")
    x, result = _float_operand(x)
    if n == 0:
        out = digamma.compute(x)
    elif n == 1:
        out = _trigamma(x)
    else:
        scale = (-1) ** (n + 1) * math.factorial(n)
        out = scale * special_zeta.compute(jnp.full(x.shape, n + 1, x.dtype), x)
    return out.astype(result)


@register(aten.mvlgamma)
def mvlgamma(x, p):
    if p < 1:
        raise OpError("torch2jax: mvlgamma: p has to be greater than or equal to 1")
    x, result = _float_operand(x)
    terms = sum(jax.lax.lgamma(x - j / 2) for j in range(p))
    return (terms + p * (p - 1) / 4 * math.log(math.pi)).astype(result)


# -- Bessel functions of the first kind ----------------------------------------

_SERIES_LIMIT = 20.0  # below: power series (60 terms); above: asymptotic expansion (30 terms)


def _bessel_series(x, order):
    """Sum_k (-x^2/4)^k / (k! (k + order)!) times (x/2)^order."""
    q = -(x * x) / 4
    term = jnp.ones_like(x)
    total = term
    for k in range(1, 60):
        term = term * q / (k * (k + order))
        total = total + term
    return total * (x / 2) ** order


def _bessel_asymptotic(x, order):
    """Hankel's expansion: sqrt(2 / (pi x)) (P cos(chi) - Q sin(chi)), chi = x - (2 order + 1) pi / 4."""
    mu = 4.0 * order * order
    p = jnp.zeros_like(x)
    q = jnp.zeros_like(x)
    coefficient = jnp.ones_like(x)
    for k in range(30):
        if k % 2 == 0:
            p = p + (-1) ** (k // 2) * coefficient
        else:
            q = q + (-1) ** (k // 2) * coefficient
        coefficient = coefficient * (mu - (2 * k + 1) ** 2) / ((k + 1) * 8 * x)
    chi = x - (2 * order + 1) * np.pi / 4
    return jnp.sqrt(2 / (np.pi * x)) * (p * jnp.cos(chi) - q * jnp.sin(chi))


def _bessel_j(x, order):
    _, result = _float_operand(x)
    x = jnp.asarray(x, np.float64)
    ax = jnp.abs(x)
    small = ax < _SERIES_LIMIT
    out = jnp.where(
        small,
        _bessel_series(jnp.where(small, ax, 0.0), order),
        _bessel_asymptotic(jnp.where(small, _SERIES_LIMIT, ax), order),
    )
    out = jnp.where(jnp.isinf(x), 0.0, out)
    if order == 1:
        out = jnp.where(x < 0, -out, out)
    return out.astype(result)


@register(aten.special_bessel_j0, prims.bessel_j0)
def special_bessel_j0(x):
    return _bessel_j(x, 0)


@register(aten.special_bessel_j1, prims.bessel_j1)
def special_bessel_j1(x):
    return _bessel_j(x, 1)
