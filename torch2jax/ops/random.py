"""Lowerings: random sampling.

Every op draws a fresh key from the stream of its ``generator`` argument (the
default generator when None), see `torch2jax.env.next_key`; the values follow
torch's distributions, not its bit streams. bf16 / fp16 are sampled in float32
and rounded; complex tensors get independent real and imaginary parts, as in
torch.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import dtypes as _dt
from ..dispatch import TorchValueError
from ..env import next_key
from .creation import jax_dtype
from .registry import (broadcast_shapes, cast, check_values, decomposition, placed_as, refused_dtypes, register,
                       scalar_type_name, traced_numbers_only, warning)

aten = torch.ops.aten

_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _size(size):
    shape = (size,) if isinstance(size, int) else tuple(int(s) for s in size)
    if any(s < 0 for s in shape):
        raise RuntimeError(f"Trying to create tensor with negative dimension {min(shape)}: {list(shape)}")
    return shape


def _sample_dtype(dtype):
    """The float dtype to sample in for a result of ``dtype``."""
    dtype = _dt.real_of(dtype)
    return np.dtype(np.float32) if dtype in _HALF else dtype


def _unsupported(kernel, dtype):
    """torch's error for a sampling kernel without an instance for ``dtype``."""
    return NotImplementedError(f"\"{kernel}\" not implemented for '{scalar_type_name(dtype)}'")


def _c(v) -> str:
    """A number as torch's C++ messages print a double (``-1``, ``0.123457``, ``1e-10``)."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def _require_float(kernel, dtype, complex_ok=True):
    if not (_dt.is_floating(dtype) or (complex_ok and _dt.is_complex(dtype))):
        raise _unsupported(kernel, dtype)


def _continuous_only(name, dtype, type_name):
    if not _dt.is_floating(dtype):
        raise RuntimeError(f"{name} distribution is a continuous probability distribution. dtype must be a "
                           f"floating point but you specified {type_name(dtype)}")


def _real_shape(shape, dtype):
    """Complex results are sampled as (..., 2) real pairs."""
    return shape + (2,) if _dt.is_complex(dtype) else shape


def _as_result(sample, dtype):
    if _dt.is_complex(dtype):
        return jax.lax.complex(sample[..., 0], sample[..., 1]).astype(dtype)
    return sample.astype(dtype)


def _uniform(generator, shape, dtype, low=0.0, high=1.0):
    """Samples in [low, high), drawn as torch's CPU kernels draw them: a multiple of 2**-24 in [0, 1)
    (of 2**-53 for float64) times ``high - low``, plus ``low``. (jax.random.uniform's steps are twice
    as coarse, 2**-23 and 2**-52: it draws 0 twice as often and never an odd multiple of the step.)"""
    dt = _sample_dtype(dtype)
    key = next_key(generator)
    if dt == np.float64:
        hi, lo = jax.random.bits(key, (2, *shape), np.uint32)  # (64-bit draws do not lower in a program)
        u = (hi >> 11).astype(dt) * 2.0 ** -21 + lo.astype(dt) * 2.0 ** -53
    else:
        u = (jax.random.bits(key, shape, np.uint32) >> 8).astype(dt) * np.asarray(2.0 ** -24, dt)
    # bounds as arrays of the sample dtype: Python floats would be float64 in a program traced with x64
    low, high = jnp.asarray(low, dt), jnp.asarray(high, dt)
    return u * (high - low) + low


def _uniform_result(generator, shape, dtype, low=0.0, high=1.0):
    """rand / uniform_: samples of ``dtype`` in [low, high). A sample that rounds to ``high`` in
    ``dtype`` (float16 and bfloat16 often do) is ``low``, as torch's CPU kernel makes it."""
    real = _dt.real_of(dtype)
    u = _uniform(generator, _real_shape(shape, dtype), dtype, low, high).astype(real)
    u = jnp.where(u == jnp.asarray(high, real), jnp.asarray(low, real), u)
    return _as_result(u, dtype)


def _normal(generator, shape, dtype):
    return jax.random.normal(next_key(generator), shape, _sample_dtype(dtype))


# -- continuous distributions -------------------------------------------------


def _check_std(std):
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {_c(std)}")


@register(aten.normal_functional)
def normal_functional(x, mean=0.0, std=1.0, *, generator=None):
    _require_float("normal_kernel_cpu", x.dtype)
    _check_std(std)
    if _dt.is_complex(x.dtype):
        std = std / math.sqrt(2)
    z = _normal(generator, _real_shape(x.shape, x.dtype), x.dtype)
    return _as_result(mean + std * z, x.dtype)


def _standard_normal(generator, shape, dtype):
    """Standard normal samples as ``dtype``'s sampling type; a complex one has independent
    real and imaginary parts of variance 1/2 each, as torch's."""
    if not _dt.is_complex(dtype):
        return _normal(generator, shape, dtype)
    z = _normal(generator, _real_shape(shape, dtype), dtype) / np.sqrt(2).astype(_sample_dtype(dtype))
    return jax.lax.complex(z[..., 0], z[..., 1])


def _check_std_tensor(std):
    if _dt.is_complex(std.dtype):
        raise RuntimeError("normal expects standard deviation to be non-complex")
    check_values(std, lambda v: ~(v >= 0), lambda v: RuntimeError("normal expects all elements of std >= 0.0"))


def _normal_around(generator, mean, std, shape, dtype):
    """``mean + std * z`` for standard normal ``z`` of ``shape``, computed in ``dtype``'s sampling type."""
    z = _standard_normal(generator, shape, dtype)
    return (jnp.asarray(mean).astype(z.dtype) + jnp.asarray(std).astype(z.real.dtype) * z).astype(dtype)


@register(aten.normal.Tensor_float)
def normal_tensor_float(mean, std=1.0, *, generator=None):
    _require_float("normal_kernel_cpu", mean.dtype)
    _check_std(std)
    return _normal_around(generator, mean, std, mean.shape, mean.dtype)


@register(aten.normal.float_Tensor)
def normal_float_tensor(mean, std, *, generator=None):
    _require_float("normal_kernel_cpu", std.dtype)
    _check_std_tensor(std)
    return _normal_around(generator, mean, std, std.shape, std.dtype)


@register(aten.normal.Tensor_Tensor)
def normal_tensor_tensor(mean, std, *, generator=None):
    _require_float("normal_kernel_cpu", mean.dtype)
    _check_std_tensor(std)
    return _normal_around(generator, mean, std, broadcast_shapes(mean.shape, std.shape), mean.dtype)


@register(aten.normal.float_float)
def normal_float_float(mean, std, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    _check_std(std)
    dt = jax_dtype(dtype)
    _require_float("normal_kernel_cpu", dt)
    return _normal_around(generator, mean, std, _size(size), dt)


@register(aten.randn.default, aten.randn.generator)
def randn(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, names=None):
    dt = jax_dtype(dtype)
    _require_float("normal_kernel_cpu", dt)
    return _as_result(_normal(generator, _real_shape(_size(size), dt), dt) * _complex_scale(dt), dt)


@register(aten.randn_like)
def randn_like(x, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return placed_as(x, randn(x.shape, generator=generator, dtype=_dt.to_torch(jax_dtype(dtype, x.dtype))))


def _complex_scale(dtype):
    return 1 / math.sqrt(2) if _dt.is_complex(dtype) else 1


@register(aten.rand.default, aten.rand.generator)
def rand(size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, names=None):
    dt = jax_dtype(dtype)
    _require_float("check_uniform_bounds", dt)
    return _uniform_result(generator, _size(size), dt)


@register(aten.rand_like)
def rand_like(x, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return placed_as(x, rand(x.shape, generator=generator, dtype=_dt.to_torch(jax_dtype(dtype, x.dtype))))


@register(aten.uniform.default)
def uniform(x, low=0.0, high=1.0, *, generator=None):
    _check_uniform_bounds(x, low, high)
    return _uniform_result(generator, x.shape, x.dtype, low, high)


@traced_numbers_only
def _check_uniform_bounds(x, low, high):
    """torch's checks of uniform_'s bounds; a bound `t2j.jit` lifted to a program input (traced) is
    checked for its order only."""
    _require_float("check_uniform_bounds", x.dtype)
    real, known = _dt.real_of(x.dtype), not any(isinstance(v, jax.core.Tracer) for v in (low, high))
    largest = float(jnp.finfo(real).max)
    for name, v in (("from", low), ("to", high)) if known else ():
        if not -largest <= v <= largest:
            raise RuntimeError(f"{name} is out of bounds for {_dt.c_type_name(real)}")
    if low > high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={_c(low)} > to={_c(high)}")
    if known and high - low > largest:
        raise RuntimeError(f"uniform_ expects to-from <= std::numeric_limits<{scalar_type_name(real)}>::max(), but "
                           f"found to={_c(high)} and from={_c(low)} which result in to-from to exceed the limit")


@register(aten.exponential.default)
def exponential(x, lambd=1.0, *, generator=None):
    _continuous_only("Exponential", x.dtype, scalar_type_name)
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={_c(lambd)}")
    e = jax.random.exponential(next_key(generator), x.shape, _sample_dtype(x.dtype))
    # torch's kernel never draws 0 (gumbel_softmax takes its log): it takes the log of a draw within
    # half an epsilon of 1 as -epsilon / 2, so no sample is below epsilon / 2
    e = jnp.maximum(e, np.asarray(jnp.finfo(x.dtype).eps / 2, e.dtype))
    return (e / lambd).astype(x.dtype)


@register(aten.cauchy.default)
def cauchy(x, median=0.0, sigma=1.0, *, generator=None):
    _continuous_only("Cauchy", x.dtype, _dt.c_type_name)
    if sigma <= 0:
        raise RuntimeError(f"cauchy_ expects sigma > 0.0, but found sigma={_c(sigma)}")
    u = _uniform(generator, x.shape, x.dtype)
    return (median + sigma * jnp.tan(np.pi * (u - 0.5))).astype(x.dtype)


@register(aten.log_normal.default)
def log_normal(x, mean=1.0, std=2.0, *, generator=None):
    _require_float("log_normal_cpu", x.dtype, complex_ok=False)
    if std <= 0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={_c(std)}")
    return jnp.exp(mean + std * _normal(generator, x.shape, x.dtype)).astype(x.dtype)


@register(aten._standard_gamma.default)
def _standard_gamma(alpha, generator=None):
    _require_float("gamma_cpu", alpha.dtype, complex_ok=False)
    dt = _sample_dtype(alpha.dtype)
    a = alpha.astype(dt)
    sample = jax.random.gamma(next_key(generator), a, alpha.shape, dt)
    # torch never returns 0 (a Dirichlet row of zeros would be 0 / 0): the smallest normal number instead,
    # also for a concentration that is no gamma's (<= 0), where JAX's draw is NaN
    tiny = float(jnp.finfo(alpha.dtype).tiny)
    return jnp.where(a > 0, jnp.maximum(sample, tiny), tiny).astype(alpha.dtype)


@register(aten._standard_gamma_grad.default)
def _standard_gamma_grad(alpha, sample):
    dt = _sample_dtype(alpha.dtype)
    return jax.lax.random_gamma_grad(alpha.astype(dt), sample.astype(dt)).astype(alpha.dtype)


@register(aten._sample_dirichlet.default)
def _sample_dirichlet(alpha, generator=None):
    """Gamma draws normalized to sum to 1, computed from their logarithms: for small
    concentrations (Beta(2, 0.02), Dirichlet(0.01)) the draws themselves underflow, which would
    give 0 / 0 or exact zeros and ones. As torch's kernel, no result is 0 or 1: they are kept
    within [smallest normal number, largest number below 1] of the dtype."""
    _require_float("dirichlet", alpha.dtype, complex_ok=False)
    dt = _sample_dtype(alpha.dtype)
    a = alpha.astype(dt)
    log_g = jax.random.loggamma(next_key(generator), a, a.shape, dt)
    # a zero concentration's draw is 0: the smallest normal number, as torch clamps its gamma draws (a
    # row of zero concentrations is split evenly)
    log_g = jnp.where(jnp.isneginf(log_g), np.log(jnp.finfo(alpha.dtype).tiny).astype(dt), log_g)
    x = jax.nn.softmax(log_g, axis=-1) if a.ndim else jnp.ones_like(a)
    info = jnp.finfo(alpha.dtype)
    return jnp.clip(x, float(info.tiny), float(1 - info.epsneg)).astype(alpha.dtype)


def _beta_fraction(x, a, b, terms=300):
    """The continued fraction of the regularized incomplete beta function,
    I_x(a, b) = x^a (1 - x)^b / (a B(a, b)) * fraction, by Lentz's method with a fixed number
    of terms (it converges fast for x < (a + 1) / (a + b + 2)); differentiable in ``a``."""
    tiny = 1e-300

    def nonzero(v):
        return jnp.where(jnp.abs(v) < tiny, tiny, v)

    def step(c, d, f, coefficient):
        d = 1 / nonzero(1 + coefficient * d)
        c = nonzero(1 + coefficient / c)
        return c, d, f * c * d

    def body(m, carry):
        m = m.astype(x.dtype)
        carry = step(*carry, m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)))
        return step(*carry, -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)))

    d = 1 / nonzero(1 - (a + b) * x / (a + 1))
    return jax.lax.fori_loop(1, terms, body, (jnp.ones_like(x), d, d))[2]


@register(aten._dirichlet_grad.default)
def _dirichlet_grad(x, alpha, total):
    """The pathwise derivative of a Dirichlet sample's coordinate ``x`` in its concentration
    ``alpha`` (``total``: the concentrations' sum), as torch's ``_Dirichlet`` backward uses it.

    ``x`` is a Beta(a, b) sample with a = alpha, b = total - alpha; moving ``a`` at a fixed
    quantile moves it by -(d/da I_x(a, b)) / pdf(x; a, b), which torch divides by 1 - x (the
    Dirichlet's renormalization, undone by its backward). Writing I_x(a, b) = pdf * R with
    R = x (1 - x) / a * `_beta_fraction` (or, above the fraction's fast region, through
    I_x(a, b) = 1 - I_{1-x}(b, a)), the ratio is d/da log pdf * R + dR/da: no term under- or
    overflows in the tails. torch evaluates it with fitted approximations, within about 1e-3 of
    this (exact to float64 rounding) on samples of the distribution.
    """
    if not (x.dtype == alpha.dtype == total.dtype):
        raise RuntimeError(f"_dirichlet_grad: expected x, alpha and total of one dtype, got {x.dtype}, "
                           f"{alpha.dtype} and {total.dtype}")
    if x.dtype not in (np.float32, np.float64):  # torch's CPU kernel has no half-precision instances
        raise _unsupported("_dirichlet_grad_cpu", x.dtype)
    shape = broadcast_shapes(x.shape, alpha.shape, total.shape)
    x, a, t = (jnp.broadcast_to(v, shape).astype(jnp.float64) for v in (x, alpha, total))
    at_zero = x <= 0  # (also a subnormal x the device flushes to zero): the derivative's limit, 0
    x = jnp.clip(x, np.finfo(np.float64).tiny, 1 - np.finfo(np.float64).epsneg)  # x = 1: the finite limit
    b = t - a
    score = jnp.log(x) - jax.scipy.special.digamma(a) + jax.scipy.special.digamma(t)  # d/da log pdf
    ones = jnp.ones_like(a)
    r, dr = jax.jvp(lambda a: x * (1 - x) * _beta_fraction(x, a, b) / a, (a,), (ones,))
    r_upper, dr_upper = jax.jvp(lambda a: x * (1 - x) * _beta_fraction(1 - x, b, a) / b, (a,), (ones,))
    ratio = jnp.where(x < (a + 1) / (t + 2), score * r + dr, -(score * r_upper + dr_upper))
    return jnp.where(at_zero, 0.0, -ratio / (1 - x)).astype(alpha.dtype)


# -- discrete distributions ---------------------------------------------------


def _probability(p, name="p"):
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got {name}={_c(p)}")


def _probabilities(p):
    """torch's check of a tensor of probabilities (NaN fails it too), as `check_values` makes it."""
    check_values(p, lambda v: ~((v >= 0) & (v <= 1)), lambda v: RuntimeError(
        "Expected p_in >= 0 && p_in <= 1 to be true, but got false.  (Could this error message be improved?  "
        "If so, please report an enhancement request to PyTorch.)"))


def _bernoulli_dtypes(dtype, p_dtype):
    if _dt.is_complex(dtype):
        raise _unsupported("bernoulli_tensor_cpu_self_", dtype)
    if not _dt.is_floating(p_dtype):
        raise _unsupported("bernoulli_tensor_cpu_p_", p_dtype)


@register(aten.bernoulli.default)
def bernoulli(p, *, generator=None):
    # torch fills a tensor like p (bernoulli_tensor_cpu_self_) with probabilities p (..._p_)
    _bernoulli_dtypes(p.dtype, p.dtype)
    _probabilities(p)
    u = _uniform(generator, p.shape, p.dtype)
    return (u < p.astype(u.dtype)).astype(p.dtype)


@register(aten.bernoulli.p)
def bernoulli_p(x, p, *, generator=None):
    if _dt.is_complex(x.dtype):
        raise _unsupported("bernoulli_scalar_cpu_", x.dtype)
    _probability(p)
    if not isinstance(p, (int, float)):  # (a number the program takes)
        return (_uniform(generator, x.shape, np.float32) < p).astype(x.dtype)
    return _below(generator, x.shape, p).astype(x.dtype)


def _below(generator, shape, p):
    """Draws with probability ``p`` (a Python number), exact where a float32 uniform would round
    a tiny ``p`` (torch draws a double) up to a multiple of 2**-24: 32 random bits, as an integer,
    below ``p * 2**32`` for a ``p`` of 2**-12 or more (within 2**-20 of ``p``, relatively), else 64
    bits below ``p * 2**64``, compared in 32-bit halves."""
    threshold = int(p * 2.0**64)
    if threshold >= 2**64:
        return jnp.ones(shape, np.bool_)
    if p >= 2.0**-12 or threshold & 0xFFFFFFFF == 0:
        return jax.random.bits(next_key(generator), shape, np.uint32) < np.uint32(threshold >> 32)
    hi, lo = jax.random.bits(next_key(generator), (2, *shape), np.uint32)
    t_hi, t_lo = np.uint32(threshold >> 32), np.uint32(threshold & 0xFFFFFFFF)
    return (hi < t_hi) | ((hi == t_hi) & (lo < t_lo))


@register(aten.bernoulli.Tensor)
def bernoulli_tensor(x, p, *, generator=None):
    _bernoulli_dtypes(x.dtype, p.dtype)
    dt = _sample_dtype(p.dtype) if _dt.is_floating(p.dtype) else np.dtype(np.float32)
    _probabilities(p)
    u = _uniform(generator, x.shape, dt)
    return (u < jnp.broadcast_to(p, x.shape).astype(dt)).astype(x.dtype)


@register(aten.rrelu_with_noise_functional.default)
def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """(output, noise): in training each non-positive element gets a slope drawn from
    U(lower, upper), recorded in noise (1 elsewhere) for the backward; in eval the
    slope is the mean and noise is left as it was."""
    if not training:  # torch's leaky_relu with the mean slope: in float32 for float16 / bfloat16
        wide = x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x
        return jnp.where(x > 0, x, wide * ((lower + upper) / 2)).astype(x.dtype), noise
    slope = _uniform(generator, x.shape, x.dtype, lower, upper)
    negative = x <= 0
    out = jnp.where(negative, x.astype(slope.dtype) * slope, x.astype(slope.dtype))
    return out.astype(x.dtype), jnp.where(negative, slope, 1).astype(noise.dtype)


# (torch's CPU kernel is floating only, and not of float16, which CUDA's computes, as here)
refused_dtypes(aten.rrelu_with_noise.default, aten.rrelu_with_noise_functional, kinds="bic")


# rrelu_with_noise writes noise but has no in-place name that would lead to the functional variant
@decomposition(aten.rrelu_with_noise.default)
def rrelu_with_noise(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    out, new_noise = aten.rrelu_with_noise_functional.default(x, noise, lower, upper, training, generator)
    noise.copy_(new_noise)
    return out


# (F.rrelu_): the in-place name leads to rrelu_with_noise, itself a decomposition, not a lowering
@decomposition(aten.rrelu_with_noise_.default)
def rrelu_with_noise_(x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    out, new_noise = aten.rrelu_with_noise_functional.default(x, noise, lower, upper, training, generator)
    noise.copy_(new_noise)
    return x.copy_(out)


@register(aten.geometric.default)
def geometric(x, p, *, generator=None):
    if x.dtype == np.bool_ or _dt.is_complex(x.dtype):
        raise _unsupported("geometric_cpu", x.dtype)
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={_c(p)}")
    dt = np.dtype(np.float64 if x.dtype == np.float64 else np.float32)
    u = jax.random.uniform(next_key(generator), x.shape, dt, minval=np.finfo(dt).tiny)
    return cast(jnp.ceil(jnp.log(u) / np.log1p(-p)), x.dtype)  # (a narrow int type wraps, as torch's cast)


@register(aten.poisson.default)
def poisson(rates, generator=None):
    _require_float("poisson_cpu", rates.dtype, complex_ok=False)
    check_values(rates, lambda v: ~(v >= 0), lambda v: RuntimeError(
        "invalid Poisson rate, expected rate to be non-negative"))
    dt = _sample_dtype(rates.dtype)
    key, large_key = jax.random.split(next_key(generator))
    small = jax.random.poisson(key, rates.astype(dt), rates.shape, np.int64).astype(np.float64)
    # jax.random.poisson computes in float32, whose spacing above 1.7e7 shows in its draws (multiples
    # of 8 near 1e8, a variance 1.5x the rate): there, the normal approximation with its skewness term
    # (errors of order rate ** -1, below what any sample can show), in float64
    lam = rates.astype(np.float64)
    z = jax.random.normal(large_key, rates.shape, np.float64)
    large = jnp.maximum(jnp.floor(lam + jnp.sqrt(lam) * z + (z * z - 1) / 6 + 0.5), 0)
    return jnp.where(lam < _POISSON_LARGE, small, large).astype(rates.dtype)


_POISSON_LARGE = 1e7


@register(aten.binomial.default)
def binomial(count, prob, generator=None):
    for x, name in ((count, "count"), (prob, "prob")):
        if not _dt.is_floating(x.dtype):
            raise TorchValueError(f"binomial only supports floating-point dtypes for {name}, got: "
                                  f"{scalar_type_name(x.dtype)}")
    if prob.dtype != count.dtype:
        raise RuntimeError(f"Found dtype {scalar_type_name(prob.dtype)} but expected {scalar_type_name(count.dtype)}")
    if count.dtype in _HALF:
        raise _unsupported("binomial_cpu", count.dtype)
    shape = broadcast_shapes(count.shape, prob.shape)
    count, prob = jnp.broadcast_to(count, shape), jnp.broadcast_to(prob, shape)
    # torch's kernel: no draw for a count or probability <= 0 (0) or a probability >= 1 (count)
    out = jax.random.binomial(next_key(generator), jnp.maximum(count, 0), jnp.clip(prob, 0, 1), shape, count.dtype)
    return jnp.where((count <= 0) | (prob <= 0), 0, jnp.where(prob >= 1, count, out)).astype(count.dtype)


def _integers(generator, shape, low, high, dtype):
    """Integers uniform in [low, high) (Python ints, up to the full 64-bit range) as ``dtype``."""
    span = high - low
    # two 32-bit draws: 64-bit random bits cannot be lowered inside a JAX program
    # traced without x64 (jax.random re-traces its bit generator at lowering time)
    hi, lo = jax.random.bits(next_key(generator), (2, *shape), np.uint32)
    bits = (hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)
    if span < 2**64:
        bits = bits % np.uint64(span)
    value = jax.lax.bitcast_convert_type(bits + np.uint64(low % 2**64), np.int64)
    return value.astype(dtype)


def _dtype_max(dtype):
    """The largest value `random_` draws for ``dtype`` (exactly representable for floats)."""
    if dtype == np.bool_:
        return 1
    if _dt.is_integral(dtype):
        return int(np.iinfo(dtype).max)
    return 2 ** (jnp.finfo(dtype).nmant + 1)


@register(aten.random.default)
def random(x, *, generator=None):
    _require_random_dtype(x.dtype)
    return _integers(generator, x.shape, 0, _dtype_max(x.dtype) + 1, x.dtype)


@register(aten.random.to)
def random_to(x, to, *, generator=None):
    return random_from(x, 0, to, generator=generator)


@register(getattr(aten.random, "from"))
def random_from(x, low, high, *, generator=None):
    if high is None:
        if _dt.is_complex(x.dtype):
            raise RuntimeError("random_from_to_impl handles only integral, floating-point and boolean types")
        to_inc = _dtype_max(x.dtype)
        _check_range(low, to_inc, x.dtype)
        # a float type draws up to 2**digits, its last integer with a neighbour one apart
        if low > to_inc or (_dt.is_floating(x.dtype) and low == to_inc):
            raise RuntimeError("random_ expects 'from' casted to dtype to be less than or equal to 'to_inc' casted "
                               f"to dtype, but got from={low} > to_inc={to_inc}")
        high = to_inc + 1
    elif low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    _check_range(low, high - 1, x.dtype)
    return _integers(generator, x.shape, low, high, x.dtype)


def _require_random_dtype(dtype):
    if _dt.is_complex(dtype):
        raise _unsupported("random_kernel_cpu", dtype)


def _check_range(low, high_inclusive, dtype):
    """torch's check that [low, high_inclusive] holds values of ``dtype`` (the sample would wrap
    around otherwise), warning where a float type cannot tell consecutive integers apart."""
    if _dt.is_complex(dtype):
        raise RuntimeError("check_random_bounds handles only integral, floating-point and boolean types")
    if _dt.is_floating(dtype):
        info = jnp.finfo(dtype)
        lowest, highest = -float(info.max), float(info.max)
    else:
        lowest, highest = (0, 1) if dtype == np.bool_ else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
    for value, what in ((low, "from"), (high_inclusive, "to - 1")):
        if not lowest <= value <= highest:
            raise RuntimeError(f"{what} is out of bounds for {_dt.c_type_name(dtype)}")
    if _dt.is_floating(dtype):
        digits = jnp.finfo(dtype).nmant + 1
        for value, what in ((low, "from"), (high_inclusive, "to - 1")):
            if not -(2**digits) <= value <= 2**digits:
                warnings.warn(f"{what} is out of bounds [-(2^{digits}), 2^{digits}]. Due to precision limitations "
                              f"{_dt.c_type_name(dtype)} can support discrete uniform distribution only within this "
                              "range. This warning will become an error in version 1.7 release, please fix the "
                              "code in advance")


@register(aten.randint.default, aten.randint.generator)
def randint(high, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    return randint_low(0, high, size, generator=generator, dtype=dtype)


@register(aten.randint.low, aten.randint.low_generator)
def randint_low(low, high, size, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    if low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    dtype = jax_dtype(dtype, np.int64)
    _check_range(low, high - 1, dtype)
    return _integers(generator, _size(size), low, high, dtype)


@register(aten.randint_like.default, aten.randint_like.generator, aten.randint_like.Tensor,
          aten.randint_like.Tensor_generator)
def randint_like(x, high, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
                 memory_format=None):
    return randint_like_low(x, 0, high, generator=generator, dtype=dtype)


@register(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype)
def randint_like_low(x, low, high, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None,
                     memory_format=None):
    if hasattr(high, "dtype"):
        if isinstance(high, jax.core.Tracer):
            raise RuntimeError("torch2jax: randint_like with a tensor `high` needs its value; it cannot be traced")
        high = int(high)
    if low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    dtype = jax_dtype(dtype, x.dtype)
    _check_range(low, high - 1, dtype)
    return placed_as(x, _integers(generator, x.shape, low, high, dtype))


@register(aten.randperm.default, aten.randperm.generator)
def randperm(n, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None):
    _size(n)  # (torch allocates the result before it checks n: a negative n raises as a negative size)
    dtype = jax_dtype(dtype, np.int64)
    if dtype == np.bool_ or _dt.is_complex(dtype):
        raise _unsupported("randperm", dtype)
    if _dt.is_integral(dtype) and n - 1 > np.iinfo(dtype).max:
        raise RuntimeError(f"value cannot be converted to type {np.dtype(dtype).name}_t without overflow")
    # torch's limits: beyond them a float type would repeat values
    limit = {np.dtype(jnp.float16): (2**11 + 1, "2049"), np.dtype(np.float32): (2**24 + 1, "2^24+1"),
             np.dtype(np.float64): (2**53 + 1, "2^53+1")}.get(np.dtype(dtype))
    if limit is not None and n > limit[0]:
        raise RuntimeError(f"n cannot be greater than {limit[1]} for {scalar_type_name(dtype)} type.")
    return jax.random.permutation(next_key(generator), n).astype(dtype)


@warning(aten.multinomial.out)
def _long_out(func, args, kwargs):
    """torch writes the sampled indices only into an int64 out (other ops cast into out)."""
    out = kwargs["out"]
    if out.dtype != torch.int64:
        raise RuntimeError(f"multinomial expects Long tensor out, got: {scalar_type_name(out.dtype)}")


@register(aten.multinomial.default)
def multinomial(probs, num_samples, replacement=False, *, generator=None):
    if probs.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not _dt.is_floating(probs.dtype):
        raise RuntimeError("multinomial only supports floating-point dtypes for input, got: "
                           f"{scalar_type_name(probs.dtype)}")
    n = probs.shape[-1]
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > n:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    _check_distribution(probs)
    weights = probs.astype(_sample_dtype(probs.dtype))
    batch = weights[None] if probs.ndim == 1 else weights
    key = next_key(generator)
    if replacement:
        # the inverse of the CDF at uniform points: memory of the samples, not samples x categories
        # in float64 where JAX has it (torch's CPU kernel draws double uniforms): a float32 uniform is 0 once
        # in 2^23 draws, which picked the first category however small its weight
        wide = jax.dtypes.canonicalize_dtype(np.float64)
        cdf = jnp.cumsum(batch.astype(wide), axis=-1)
        u = jax.random.uniform(key, (batch.shape[0], num_samples), wide) * cdf[:, -1:]
        out = jax.vmap(lambda c, v: jnp.searchsorted(c, v, side="right"))(cdf, u)
        last = n - 1 - jnp.argmax((batch > 0)[:, ::-1], axis=-1)  # rounding never picks a weightless tail
        out = jnp.minimum(out, last[:, None])
    else:
        # Gumbel top-k: the first k of a random order weighted by probs, drawn without replacement.
        g = jnp.log(batch) + jax.random.gumbel(key, batch.shape, batch.dtype)
        out = jax.lax.top_k(g, num_samples)[1]
    out = out.astype(np.int64)
    return out[0] if probs.ndim == 1 else out


def _check_distribution(probs):
    """torch's checks of multinomial's weights, where their values are known: a traced
    call cannot raise, and there (as with CUDA's device-side asserts) bad rows sample
    arbitrary categories."""
    if isinstance(probs, jax.core.Tracer):
        return
    values = np.asarray(probs, np.float64)
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if np.any(values.sum(axis=-1) <= 0):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
