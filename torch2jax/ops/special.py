"""Lowerings: special functions (``torch.special``) and the ``prims`` they decompose to.

Functions JAX lacks are computed here. Bessel J0 / J1 in float64: a power
series for small arguments, Hankel's asymptotic expansion for large ones.
Bessel Y0 / Y1, modified Bessel K0 / K1 and Airy Ai in float64: power series
for small arguments, the trapezoidal rule on an integral representation for
large ones. The orthogonal polynomials follow torch's CPU kernels step for
step (the same branches, and the same three-term recurrences in the same
dtype), with their trigonometric forms evaluated in float64.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch

from ..dispatch import OpError
from .elementwise import digamma
from .registry import (HALF_DTYPES, as_dtype, cast, decomposition, elementwise, promote, refused_dtypes, register,
                       torch_slopes, true_divide)

aten = torch.ops.aten
prims = torch.ops.prims

# torch's CPU kernels of these compute no complex numbers, nor (the special functions) float16 / bfloat16
refused_dtypes(aten.igamma, aten.igammac, kinds="bic")
refused_dtypes(aten.polygamma, aten.special_entr, aten.special_xlog1py, kinds="c")
refused_dtypes(*(getattr(aten, "special_" + name) for name in (
    "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
    "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
    "spherical_bessel_j0", "airy_ai",
    "erfcx", "log_ndtr", "ndtri", "zeta", "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
    "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u",
    "shifted_chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h",
    "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p")), kinds="c", dtypes=HALF_DTYPES)


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
    # (a where, not minimum(x, 0): its derivative at 0 would halve the lower piece's)
    return jnp.where(x > 0, upper, jsp.log_ndtr(jnp.where(x > 0, jnp.zeros((), x.dtype), x)))


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


@elementwise(aten.special_entr, promote_kind="int_to_float", opmath=False)  # torch rounds log(x) to float16 first
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


@elementwise(aten.special_xlog1py, promote_kind="int_to_float", opmath=False)  # (as xlogy)
def special_xlog1py(x, y):
    return _xlog1py(x, y)


def _xlog1py_value(x, y):
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros((), x.dtype), x * jnp.log1p(y)))


# torch's: xlog1py(x != 0, y) (0 where x is 0, so at y = -1 too: JAX's is NaN there) and x / (1 + y)
_xlog1py = torch_slopes(_xlog1py_value, lambda x, y: (_xlog1py_value((x != 0).astype(x.dtype), y), x / (1 + y)))


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
    return _zeta(*jnp.broadcast_arrays(x, q))


@jax.custom_jvp
def _zeta(x, q):
    """Hurwitz zeta (the loop `_shift_to_one` runs is of data-dependent length, which reverse mode
    cannot go through: its derivative is `_zeta_jvp`)."""
    pole = (q <= 0) & (q == jnp.floor(q))  # torch: inf at q = 0, -1, -2, ...
    acc, shifted = _shift_to_one(x, jnp.where(pole | ~jnp.isfinite(q), 1, q))
    out = jnp.where(jnp.isfinite(q), acc + jsp.zeta(x, shifted), jsp.zeta(x, q))
    out = jnp.where(pole, jnp.inf, out)
    return jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, out)).astype(x.dtype)


def _zeta_jvp(primals, tangents):
    # torch's: d/dq zeta(x, q) = -x zeta(x + 1, q); none with respect to x
    x, q = primals
    x_dot, q_dot = tangents
    if type(x_dot) is not jax.custom_derivatives.SymbolicZero:
        raise NotImplementedError("torch2jax: the derivative of special_zeta with respect to its first argument "
                                  "is not implemented (as in torch)")
    out = _zeta(x, q)
    if type(q_dot) is jax.custom_derivatives.SymbolicZero:
        return out, jnp.zeros_like(out)
    return out, -x * _zeta(x + 1, q) * q_dot


_zeta.defjvp(_zeta_jvp, symbolic_zeros=True)


# Beyond this shape parameter the incomplete gamma functions come from the Wilson-Hilferty
# normal approximation of the gamma distribution (error below 1e-8 there); JAX's series slow
# down and drift as a grows (in float64 by 1e-5 at a = 1e10).
_LARGE_A = 1e6


def _incomplete_gamma(a, x, upper):
    """P(a, x) (``upper``: Q = 1 - P) in float64 whatever the dtype: JAX's float32 series lose
    accuracy as a and x grow together (torch switches to an asymptotic expansion there)."""
    a, x = jnp.broadcast_arrays(a, x)
    a64, x64 = a.astype(np.float64), x.astype(np.float64)
    large = (a64 > _LARGE_A) & (x64 > 0) & jnp.isfinite(x64)
    series = (jsp.gammaincc if upper else jsp.gammainc)(jnp.where(large, 1.0, a64), jnp.where(large, 1.0, x64))
    safe_a = jnp.where(large, a64, 1.0)
    z = (jnp.cbrt(x64 / safe_a) - (1 - 1 / (9 * safe_a))) * jnp.sqrt(9 * safe_a)
    normal = jsp.ndtr(-z if upper else z)
    # torch's edge cases, in its order (the first that holds decides, even with a NaN beside it)
    lo, hi = (1.0, 0.0) if upper else (0.0, 1.0)
    edges = [((x64 < 0) | (a64 < 0), np.nan), (a64 == 0, jnp.where(x64 > 0, hi, np.nan)), (x64 == 0, lo),
             (jnp.isinf(a64), jnp.where(jnp.isinf(x64), np.nan, lo)), (jnp.isinf(x64), hi)]
    out = jnp.select([c for c, _ in edges], [v for _, v in edges], jnp.where(large, normal, series))
    return out.astype(a.dtype)


@elementwise(aten.igamma, prims.igamma, promote_kind="int_to_float")
def igamma(a, x):
    return _incomplete_gamma(a, x, upper=False)


@elementwise(aten.igammac, prims.igammac, promote_kind="int_to_float")
def igammac(a, x):
    return _incomplete_gamma(a, x, upper=True)


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


# (x.polygamma_(n)): its arguments are polygamma's swapped, so no functional variant is found for it
@decomposition(aten.polygamma_.default)
def polygamma_(x, n):
    return aten.polygamma.out(n, x, out=x)


@register(aten.mvlgamma)
def mvlgamma(x, p):
    if p < 1:
        raise OpError("torch2jax: mvlgamma: p has to be greater than or equal to 1")
    x, result = _float_operand(x)
    terms = sum(jax.lax.lgamma(x - j / 2) for j in range(p))
    return (terms + p * (p - 1) / 4 * math.log(math.pi)).astype(result)


# -- Bessel functions of the first kind ----------------------------------------

_SERIES_LIMIT = 8.0  # below: power series (60 terms, whose cancellation costs two digits at most)
_INTEGRAL_LIMIT = 20.0  # below: Bessel's integral (`_bessel_integral`); above: asymptotic expansion (30 terms)
_INTEGRAL_POINTS = 64  # its error is about J_64(x), below 1e-24 up to x = 20


def _bessel_series(x, order):
    """Sum_k (-x^2/4)^k / (k! (k + order)!) times (x/2)^order."""
    q = -(x * x) / 4
    term = jnp.ones_like(x)
    total = term
    for k in range(1, 60):
        term = term * q / (k * (k + order))
        total = total + term
    return total * (x / 2) ** order


def _bessel_integral(x, order):
    """Bessel's integral J_n(x) = (1/2 pi) Int_{-pi}^{pi} cos(n t - x sin t) dt by the trapezoidal rule,
    which converges geometrically for this periodic integrand (where the power series would lose
    eight digits to cancellation near x = 20)."""
    t = np.array([2 * np.pi * k / _INTEGRAL_POINTS for k in range(_INTEGRAL_POINTS)])
    angles, sines = jnp.asarray(order * t), jnp.asarray(np.sin(t))

    # rolled: unrolled, the 64 cosines are a quarter of the compile time at every new shape
    def add_point(k, total):
        return total + jnp.cos(angles[k] - x * sines[k])

    return jax.lax.fori_loop(0, _INTEGRAL_POINTS, add_point, jnp.zeros_like(x)) / _INTEGRAL_POINTS


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
    small, middle = ax < _SERIES_LIMIT, ax < _INTEGRAL_LIMIT
    out = jnp.where(
        small,
        _bessel_series(jnp.where(small, ax, 0.0), order),
        jnp.where(middle, _bessel_integral(jnp.where(middle, ax, _SERIES_LIMIT), order),
                  _bessel_asymptotic(jnp.where(middle, _INTEGRAL_LIMIT, ax), order)),
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


# -- ops whose torch CPU kernels exist for float32 and float64 only -------------

_TORCH_DTYPE_NAMES = {
    np.dtype(jnp.float16): "Half",
    np.dtype(jnp.bfloat16): "BFloat16",
    np.dtype(np.complex64): "ComplexFloat",
    np.dtype(np.complex128): "ComplexDouble",
}


def _kernel_operands(kernel, *args):
    """``args`` as arrays of the dtype torch's CPU kernel ``kernel`` computes in (integers and bool: the
    default float), and that dtype; half, bfloat16 and complex raise as that kernel does."""
    dtype, _ = promote("int_to_float", args)
    if dtype in _TORCH_DTYPE_NAMES:
        raise NotImplementedError(f"\"{kernel}_cpu\" not implemented for '{_TORCH_DTYPE_NAMES[dtype]}'")
    return [jnp.asarray(as_dtype(a, dtype)) for a in args], dtype


# -- Bessel functions of the second kind, modified ones, Airy Ai -----------------

_EULER_GAMMA = 0.57721566490153286061
_SECOND_KIND_SERIES_LIMIT = 2.0  # up to here the power series (in x^2/4 <= 1), beyond it `_descent_integral`


def _log_series_coefficients(order, terms=18):
    """(1 / (k! (k + order)!), (H_k + H_(k + order)) / (k! (k + order)!)) for k < terms, H_k the harmonic numbers;
    the last terms are below 1e-29 for |q| <= 1."""
    plain, harmonic = [], []
    for k in range(terms):
        scale = Fraction(1, math.factorial(k) * math.factorial(k + order))
        h = sum(Fraction(1, j) for j in range(1, k + 1)) + sum(Fraction(1, j) for j in range(1, k + order + 1))
        plain.append(float(scale))
        harmonic.append(float(h * scale))
    return plain, harmonic


_LOG_SERIES = {order: _log_series_coefficients(order) for order in (0, 1)}


def _horner(coefficients, q):
    """Sum of coefficients[k] q^k."""
    total = jnp.full_like(q, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        total = total * q + c
    return total


def _log_series(x, q, order):
    """(log(x/2) + gamma) A(q) - B(q)/2, with A, B the series of `_log_series_coefficients`.

    With q = -x^2/4 it is pi/2 Y_0(x), and (pi/2 Y_1(x) + 1/x) / (x/2); with q = x^2/4 it is -K_0(x), and
    (K_1(x) - 1/x) / (x/2) (DLMF 10.8.1 and 10.31.1, with psi(k + 1) = H_k - gamma).
    """
    plain, harmonic = _LOG_SERIES[order]
    log_half_x = jnp.log(x) - np.log(2)  # x / 2 is subnormal, read as 0 on CPU, for the smallest normal x
    return (log_half_x + _EULER_GAMMA) * _horner(plain, q) - _horner(harmonic, q) / 2


_STEP = 0.2
_NODES = _STEP * np.arange(34)  # exp(-s^2) < 1.2e-19 past the last node
_WEIGHTED = np.exp(-(_NODES**2)) * np.where(_NODES == 0, _STEP / 2, _STEP)


def _descent_integral(zeta, order):
    """The integral over s >= 0 of exp(-s^2) cosh(order t) / sqrt(1 + s^2 / (2 zeta)), s = sqrt(2 zeta) sinh(t/2).

    That substitution takes K_order(zeta) = integral over t >= 0 of exp(-zeta cosh t) cosh(order t) to
    sqrt(2 / zeta) exp(-zeta) times this, for |arg zeta| < pi. The integrand is even in s and analytic but
    for branch points at s = +-i sqrt(2 zeta), at least 1.4 from the real axis for the zeta it is used at
    (|zeta| >= 2, |arg zeta| <= pi/2), so the trapezoidal rule with step 0.2 is exact to rounding.
    """
    nodes, weights = jnp.asarray(_NODES), jnp.asarray(_WEIGHTED)

    def add_node(i, total):
        u = nodes[i] * nodes[i] / (2 * zeta)  # sinh(t/2)^2
        root = jnp.sqrt(1 + u)  # cosh(t/2)
        if order == 0:
            even = 1
        elif order == 1:
            even = 1 + 2 * u
        else:
            power = (jnp.sqrt(u) + root) ** (2 * order)  # exp(order t)
            even = (power + 1 / power) / 2
        return total + weights[i] * even / root

    # a loop, not an axis of nodes (no array 34 times zeta's size), and a rolled one: unrolled, the
    # complex arithmetic of 34 nodes took XLA seconds to compile at every new shape
    return jax.lax.fori_loop(0, len(_NODES), add_node, jnp.zeros_like(zeta))


def _bessel_y(x, order):
    """Y_order(x) for float64 x: `_log_series` up to x = 2; beyond it the imaginary part of the Hankel function
    H_order(x) = (2/pi) i^-(order + 1) K_order(-ix) = (2/pi) sqrt(2/x) exp(i (x - (2 order + 1) pi/4)) I,
    I the `_descent_integral` at -ix. As torch: -inf at 0, NaN below 0 and at inf."""
    small = x <= _SECOND_KIND_SERIES_LIMIT
    xs = jnp.where(small & (x > 0), x, 1.0)
    series = _log_series(xs, -xs * xs / 4, order)
    if order == 1:
        series = xs / 2 * series - 1 / xs
    xl = jnp.where(small, _SECOND_KIND_SERIES_LIMIT, x)
    phase = jax.lax.complex(jnp.cos(xl), jnp.sin(xl)) * np.exp(-1j * (2 * order + 1) * np.pi / 4)
    hankel_part = jnp.sqrt(2 / xl) * (phase * _descent_integral(-1j * xl, order)).imag
    out = 2 / np.pi * jnp.where(small, series, hankel_part)
    return jnp.where(x == 0, -np.inf, jnp.where(x < 0, np.nan, out))


def _bessel_k(x, order, scaled):
    """K_order(x) (times exp(x) if ``scaled``) for float64 x: `_log_series` up to x = 2, `_descent_integral`
    beyond it. As torch: inf at 0, NaN below 0, 0 at inf."""
    small = x <= _SECOND_KIND_SERIES_LIMIT
    xs = jnp.where(small & (x > 0), x, 1.0)
    series = _log_series(xs, xs * xs / 4, order)
    series = -series if order == 0 else xs / 2 * series + 1 / xs
    if scaled:
        series = series * jnp.exp(xs)
    xl = jnp.where(small, _SECOND_KIND_SERIES_LIMIT, x)
    integral = jnp.sqrt(2 / xl) * _descent_integral(xl, order)
    if not scaled:
        integral = integral * jnp.exp(-xl)
    out = jnp.where(small, series, integral)
    return jnp.where(x == 0, np.inf, jnp.where(x < 0, np.nan, out))


def _second_kind(kernel, x, fn, *args):
    """``fn(x, *args)`` in float64, in torch's result dtype."""
    (x,), dtype = _kernel_operands(kernel, x)
    return fn(x.astype(np.float64), *args).astype(dtype)


@register(aten.special_bessel_y0)
def special_bessel_y0(x):
    return _second_kind("bessel_y0", x, _bessel_y, 0)


@register(aten.special_bessel_y1)
def special_bessel_y1(x):
    return _second_kind("bessel_y1", x, _bessel_y, 1)


@register(aten.special_modified_bessel_k0)
def special_modified_bessel_k0(x):
    return _second_kind("modified_bessel_k0", x, _bessel_k, 0, False)


@register(aten.special_modified_bessel_k1)
def special_modified_bessel_k1(x):
    return _second_kind("modified_bessel_k1", x, _bessel_k, 1, False)


@register(aten.special_scaled_modified_bessel_k0)
def special_scaled_modified_bessel_k0(x):
    return _second_kind("scaled_modified_bessel_k0", x, _bessel_k, 0, True)


@register(aten.special_scaled_modified_bessel_k1)
def special_scaled_modified_bessel_k1(x):
    return _second_kind("scaled_modified_bessel_k1", x, _bessel_k, 1, True)


_AIRY_SERIES_LIMIT = 2.1  # up to here (|x|) the Maclaurin series, beyond it `_descent_integral` (|zeta| >= 2)
_AIRY_AT_0 = 3 ** (-2 / 3) / math.gamma(2 / 3)  # Ai(0)
_AIRY_SLOPE_AT_0 = 3 ** (-1 / 3) / math.gamma(1 / 3)  # -Ai'(0)


def _airy_series_coefficients(offset, terms=16):
    """Coefficients of the power series f (offset 1) and g (offset 2) in z = x^3 with
    Ai(x) = Ai(0) f(x^3) + Ai'(0) x g(x^3), where f(x^3) and x g(x^3) solve y'' = x y:
    c_(k+1) = c_k / ((3k + offset + 1) (3k + offset + 2)); the last terms are below 1e-23 for |x| <= 2.1."""
    coefficients = [1.0]
    for k in range(terms - 1):
        coefficients.append(coefficients[-1] / ((3 * k + offset + 1) * (3 * k + offset + 2)))
    return coefficients


_AIRY_F = _airy_series_coefficients(1)
_AIRY_G = _airy_series_coefficients(2)


@register(aten.special_airy_ai)
def special_airy_ai(x):
    """Ai(x), in float64: the Maclaurin series for |x| <= 2.1. Beyond it, with zeta = (2/3) |x|^(3/2),
    Ai(z) = sqrt(z/3) K_1/3(zeta) / pi = z^(-1/4) exp(-zeta) I(zeta) / pi, I the `_descent_integral` of
    order 1/3: at x > 0 directly; at x = -r < 0 through Ai(-r) = 2 Re(exp(i pi/3) Ai(r exp(i pi/3))),
    where zeta is i zeta(r): Ai(-r) = (2/pi) r^(-1/4) Re(exp(i (pi/4 - zeta)) I(i zeta)).
    As torch: NaN at +-inf, 0 past x = 103.892."""
    (x,), dtype = _kernel_operands("airy_ai", x)
    x = x.astype(np.float64)
    near = jnp.abs(x) <= _AIRY_SERIES_LIMIT
    xs = jnp.where(near, x, 0.0)
    cube = xs * xs * xs
    series = _AIRY_AT_0 * _horner(_AIRY_F, cube) - _AIRY_SLOPE_AT_0 * xs * _horner(_AIRY_G, cube)
    r = jnp.where(near, _AIRY_SERIES_LIMIT, jnp.abs(x))
    zeta = 2 / 3 * r * jnp.sqrt(r)
    integral = _descent_integral(jnp.where(x > 0, zeta + 0j, 1j * zeta), 1 / 3)
    right = jnp.exp(-zeta) * integral.real / np.pi
    left = 2 / np.pi * (jax.lax.complex(jnp.cos(zeta), -jnp.sin(zeta)) * np.exp(1j * np.pi / 4) * integral).real
    out = jnp.where(near, series, r**-0.25 * jnp.where(x > 0, right, left))
    out = jnp.where(x > 103.892, 0.0, out)
    return jnp.where(jnp.isinf(x), np.nan, out).astype(dtype)


# -- orthogonal polynomials, as torch's CPU kernels compute them -----------------


def _polynomial_operands(kernel, x, n):
    """x and n as torch's kernel ``kernel`` reads them: promoted to one float dtype (integers and bool: the
    default float) and broadcast, then n truncated to int64 from that dtype (NaN, infinities and values
    beyond int64 become its minimum, a negative degree: the polynomial is 0)."""
    (x, n), _ = _kernel_operands(kernel, x, n)
    x, n = jnp.broadcast_arrays(x, n)
    return x, cast(n, np.int64)


def _recurrence(step, start, first, last):
    """q after ``p, q = q, step(k, p, q)`` for k = first, ..., last from p = 1, q = ``start``, per element
    (no step where ``last`` < ``first``); an element stops once q is NaN, as torch's loops do. (Where q
    starts NaN, torch's kernels mostly return an uninitialized variable; this gives NaN.)

    A while loop over the whole array: ``last`` may be traced, and it takes as many steps as the element
    that needs most (as many as torch's loop: n, or until an overflow turns q NaN).
    """

    def running(k, q):
        return (k <= last) & ~jnp.isnan(q)

    def body(carry):
        k, p, q = carry
        go = running(k, q)
        return k + 1, jnp.where(go, q, p), jnp.where(go, step(k, p, q), q)

    carry = (jnp.asarray(first, np.int64), jnp.ones_like(start), start)
    return jax.lax.while_loop(lambda carry: jnp.any(running(carry[0], carry[2])), body, carry)[2]


def _chebyshev(kind, x, n, shifted, trigonometric_above):
    """torch's kernel for the Chebyshev polynomial of the first to fourth kind (``kind`` "t", "u", "v", "w")
    of degree n at t = x, or at t = 2x - 1 if ``shifted``.

    At x = +-1 (shifted: x = 1, 0) the polynomial's value at t = +-1. For n above ``trigonometric_above``
    and |t| < 1 the trigonometric form, in float64: torch's, in x's dtype, is off by up to n ulps of the
    angle. Else the recurrence r = 2t q - p in x's dtype, which turns NaN once it overflows, as torch's does.
    """
    t = x + x - 1 if shifted else x
    at_one, at_minus_one = x == 1, x == (0 if shifted else -1)
    dtype = t.dtype
    sign = jnp.where(n % 2 == 0, 1, -1)
    value_at_one, value_at_minus_one = (
        jnp.asarray(value).astype(dtype)
        for value in {
            "t": (1, sign),
            "u": (n + 1, sign * (n + 1)),
            "v": (1, sign * (2 * n + 1)),
            "w": (2 * n + 1, sign),
        }[kind]
    )
    start = {"t": t, "u": t + t, "v": t + t - 1, "w": t + t + 1}[kind]
    trigonometric = (n > trigonometric_above) & (jnp.abs(t) < 1)
    inside = jnp.where(trigonometric, t, 0)
    # from x: 2x - 1 is exact in float64, and rounded to x's dtype it would move the angle n times as far
    wide = jnp.where(trigonometric, x, 0.5 if shifted else 0).astype(np.float64)
    angle = jnp.arccos(wide + wide - 1 if shifted else wide)
    degree = n.astype(np.float64)
    if kind == "t":
        closed = jnp.cos(degree * angle)
    elif kind == "u":
        closed = jnp.sin((degree + 1) * angle) / jnp.sin(angle)
    elif kind == "v":
        closed = jnp.cos((degree + 0.5) * angle) / jnp.cos(angle / 2)
    else:
        closed = jnp.sin((degree + 0.5) * angle) / jnp.sin(angle / 2)
    closed = closed.astype(dtype)
    # Where sin (V) or cos (W) of half torch's angle rounds to 1 in x's dtype, torch returns the value at
    # t = -1 (V), at t = 1 (W), or at t = -1 (shifted W).
    half = jnp.arccos(inside) / 2
    if kind == "v":
        closed = jnp.where(jnp.sin(half) == 1, value_at_minus_one, closed)
    elif kind == "w":
        closed = jnp.where(jnp.cos(half) == 1, value_at_minus_one if shifted else value_at_one, closed)
    last = jnp.where(trigonometric | at_one | at_minus_one, 1, n)
    out = jnp.where(n == 0, jnp.ones((), dtype), _recurrence(lambda k, p, q: (t + t) * q - p, start, 2, last))
    out = jnp.where(trigonometric, closed, out)
    out = jnp.where(at_one, value_at_one, jnp.where(at_minus_one, value_at_minus_one, out))
    return jnp.where(n < 0, 0, out).astype(dtype)


@register(aten.special_chebyshev_polynomial_t)
def special_chebyshev_polynomial_t(x, n):
    """T_n(x); cos(n arccos x) for |x| < 1 and n > 6."""
    x, n = _polynomial_operands("chebyshev_polynomial_t", x, n)
    return _chebyshev("t", x, n, False, 6)


@register(aten.special_chebyshev_polynomial_u)
def special_chebyshev_polynomial_u(x, n):
    """U_n(x); sin((n + 1) theta) / sin(theta), theta = arccos x, for |x| < 1 and n > 8."""
    x, n = _polynomial_operands("chebyshev_polynomial_u", x, n)
    return _chebyshev("u", x, n, False, 8)


@register(aten.special_chebyshev_polynomial_v)
def special_chebyshev_polynomial_v(x, n):
    """V_n(x); cos((n + 1/2) theta) / cos(theta / 2), theta = arccos x, for |x| < 1 and n > 8."""
    x, n = _polynomial_operands("chebyshev_polynomial_v", x, n)
    return _chebyshev("v", x, n, False, 8)


@register(aten.special_chebyshev_polynomial_w)
def special_chebyshev_polynomial_w(x, n):
    """W_n(x); sin((n + 1/2) theta) / sin(theta / 2), theta = arccos x, for |x| < 1 and n > 8."""
    x, n = _polynomial_operands("chebyshev_polynomial_w", x, n)
    return _chebyshev("w", x, n, False, 8)


@register(aten.special_shifted_chebyshev_polynomial_t)
def special_shifted_chebyshev_polynomial_t(x, n):
    """T_n(2x - 1); the trigonometric form for 0 < x < 1 and n > 6."""
    x, n = _polynomial_operands("shifted_chebyshev_polynomial_t", x, n)
    return _chebyshev("t", x, n, True, 6)


@register(aten.special_shifted_chebyshev_polynomial_u)
def special_shifted_chebyshev_polynomial_u(x, n):
    """U_n(2x - 1); the trigonometric form for 0 < x < 1 and n > 6."""
    x, n = _polynomial_operands("shifted_chebyshev_polynomial_u", x, n)
    return _chebyshev("u", x, n, True, 6)


@register(aten.special_shifted_chebyshev_polynomial_v)
def special_shifted_chebyshev_polynomial_v(x, n):
    """V_n(2x - 1); the trigonometric form for 0 < x < 1 and n > 6."""
    x, n = _polynomial_operands("shifted_chebyshev_polynomial_v", x, n)
    return _chebyshev("v", x, n, True, 6)


@register(aten.special_shifted_chebyshev_polynomial_w)
def special_shifted_chebyshev_polynomial_w(x, n):
    """W_n(2x - 1); the trigonometric form for 0 < x < 1 and n > 4."""
    x, n = _polynomial_operands("shifted_chebyshev_polynomial_w", x, n)
    return _chebyshev("w", x, n, True, 4)


def _hermite(x, n, start, step):
    """torch's Hermite kernels: 1, ``start``, then ``step``'s recurrence for k = 1, ..., n - 1; NaN past
    degree 128 (float32) or 512 (float64), where torch stops."""
    too_high = n > (128 if x.dtype == np.float32 else 512)
    out = jnp.where(n == 0, 1, _recurrence(step, start, 1, jnp.where(too_high | (n < 1), 0, n - 1)))
    return jnp.where(n < 0, 0, jnp.where(too_high, np.nan, out)).astype(x.dtype)


@register(aten.special_hermite_polynomial_h)
def special_hermite_polynomial_h(x, n):
    """The physicists' H_n(x): H_(k+1) = 2x H_k - 2k H_(k-1)."""
    x, n = _polynomial_operands("hermite_polynomial_h", x, n)
    return _hermite(x, n, x + x, lambda k, p, q: (x + x) * q - (k + k).astype(x.dtype) * p)


@register(aten.special_hermite_polynomial_he)
def special_hermite_polynomial_he(x, n):
    """The probabilists' He_n(x): He_(k+1) = x He_k - k He_(k-1)."""
    x, n = _polynomial_operands("hermite_polynomial_he", x, n)
    return _hermite(x, n, x, lambda k, p, q: x * q - k.astype(x.dtype) * p)


@register(aten.special_laguerre_polynomial_l)
def special_laguerre_polynomial_l(x, n):
    """L_n(x): (k + 1) L_(k+1) = (2k + 1 - x) L_k - k L_(k-1), grouped as torch's kernel groups it; 1 at x = 0."""
    x, n = _polynomial_operands("laguerre_polynomial_l", x, n)
    dtype = x.dtype

    def step(k, p, q):
        # correctly rounded, as torch divides: XLA would multiply by the reciprocal of the broadcast k + 1
        return true_divide(((k + k).astype(dtype) + (1 - x)) * q - k.astype(dtype) * p, (k + 1).astype(dtype))

    out = jnp.where(n == 0, 1, _recurrence(step, 1 - x, 1, jnp.where((x == 0) | (n < 1), 0, n - 1)))
    return jnp.where(n < 0, 0, jnp.where(x == 0, 1, out)).astype(dtype)


@register(aten.special_legendre_polynomial_p)
def special_legendre_polynomial_p(x, n):
    """P_n(x): (k + 1) P_(k+1) = (2k + 1) x P_k - k P_(k-1), grouped as torch's kernel groups it."""
    x, n = _polynomial_operands("legendre_polynomial_p", x, n)
    dtype = x.dtype
    ends = jnp.abs(x) == 1

    def step(k, p, q):
        # correctly rounded, as torch divides (see `special_laguerre_polynomial_l`)
        return true_divide((k + k + 1).astype(dtype) * x * q - k.astype(dtype) * p, (k + 1).astype(dtype))

    out = jnp.where(n == 0, 1, _recurrence(step, x, 1, jnp.where(ends | (n < 1), 0, n - 1)))
    out = jnp.where(ends, jnp.where((x > 0) | (n % 2 == 0), 1, -1), out)
    return jnp.where(n < 0, 0, out).astype(dtype)
